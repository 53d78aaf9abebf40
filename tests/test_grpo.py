"""train_grpo.py, the critic-free family (GRPO, Dr. GRPO, RLOO, REINFORCE++, DAPO's tricks): the recipes and their
resolution, every pure function against naive loops on random ragged batches (group advantages, reward-to-go, loss
aggregation over micro-batches, the clipped loss with clip-higher and dual-clip, the KL in the loss with k3 and k2,
padding with extreme log-probs), dynamic sampling's batch, dropped responses that never move the whitening, the first
minibatch's ratio; the flags no run can mean (a KL estimator where it works against the KL included); smoke runs of
main() for each estimator (no critic, no KL controller, no collapse detector), train/episodes (dynamic sampling's extra
rounds included) and kill-and-resume."""

import dataclasses
import math
import os
import re
import sys

import pytest
import torch
from conftest import (
    RUN_KEYS,
    TINY_RL,
    assert_same_weights,
    boost_eos,
    critic_free_experience,
    exits_2_with_one_line,
    fake_experience,
    grpo_update_once,
    kill_and_resume,
    ragged,
    read_scalars,
    run,
    tiny_gpt,
    trained,
)

import checkpoints
import common
import rollout
import train_grpo
from model import GPT
from roles import Models
from train_grpo import (
    RECIPES,
    RunningMoments,
    group_advantages,
    kl_estimate,
    kl_loss,
    loss_weights,
    policy_loss,
    resolve_args,
    reward_to_go,
    shape_rewards,
)

# -----------------------------------------------------------------------------
# the recipes


def test_recipes_rows_share_their_keys_and_fill_only_none_defaults():
    """Each estimator's row of RECIPES sets the same flags (a new row missing one would leave it None), each an Args
    field whose default is None, so a flag given on the command line always wins; resolved, none is None."""
    fields = {field.name: field for field in dataclasses.fields(train_grpo.Args)}
    keys = set(next(iter(RECIPES.values())))
    assert set(RECIPES) == {"grpo", "rloo", "reinforce_pp"} and keys
    for estimator, recipe in RECIPES.items():
        assert set(recipe) == keys, estimator
    for key in keys:
        assert key in fields and fields[key].default is None, key
    for estimator in RECIPES:
        resolved = resolve_args(train_grpo.Args(estimator=estimator))
        assert all(getattr(resolved, key) is not None for key in keys | {"kl_estimator"}), estimator
        assert {key: getattr(resolved, key) for key in keys} == RECIPES[estimator]


def test_resolve_args():
    grpo = resolve_args(train_grpo.Args())
    assert grpo.estimator == "grpo" and grpo.out_dir == "out/grpo"
    assert (grpo.group_size, grpo.kl_penalty, grpo.kl_coef, grpo.reward_norm) == (4, "loss", 0.15, "none")
    assert (grpo.adv_whiten, grpo.loss_agg, grpo.kl_estimator) == ("none", "seq_mean", "k3")
    assert resolve_args(grpo) == grpo  # idempotent
    given = resolve_args(train_grpo.Args(estimator="rloo", group_size=8, reward_norm="scale"))
    assert (given.group_size, given.reward_norm, given.reward_clip, given.kl_penalty) == (8, "scale", 5.0, "reward")
    assert given.kl_estimator == "k1"  # in the reward
    rpp = resolve_args(train_grpo.Args(estimator="reinforce_pp"))
    assert (rpp.adv_whiten, rpp.reward_norm, rpp.reward_clip, rpp.group_size) == ("rollout", "norm", 5.0, 1)
    # the KL estimator follows its placement: k3 in the loss, k1 in the reward; a given one is kept
    assert resolve_args(train_grpo.Args(kl_estimator="k2")).kl_estimator == "k2"
    assert resolve_args(train_grpo.Args(estimator="rloo", kl_penalty="loss")).kl_estimator == "k3"
    for critic_only in ("critic_warmup_steps", "lam", "cliprange_value", "kl_target", "collapse_window"):
        assert not hasattr(grpo, critic_only), critic_only  # no critic, no KL controller, no collapse detector


# -----------------------------------------------------------------------------
# pure functions against naive loops


def test_shape_rewards():
    """-beta * k1 per token plus the score on the EOS, 0 on padding."""
    lengths, mask, (lp, ref, _, _, _) = ragged()
    scores = torch.randn(len(lengths), dtype=torch.float64)
    rewards = shape_rewards(scores, lp, ref, mask, 0.1)
    for b, n in enumerate(lengths):
        for t in range(mask.size(1)):
            if t >= n:
                assert rewards[b, t] == 0
                continue
            d = (lp[b, t] - ref[b, t]).item()
            want = -0.1 * d + (scores[b].item() if t == n - 1 else 0.0)  # the score lands on the EOS
            assert rewards[b, t].item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("group_size", [2, 3])
def test_group_advantages(group_size):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4 * group_size, generator=g, dtype=torch.float64)
    scores[:group_size] = 0.5  # a group of ties: zero advantage, no division by 0
    got = {
        "rloo": group_advantages(scores, group_size, "rloo"),
        "grpo": group_advantages(scores, group_size, "grpo"),
        "dr_grpo": group_advantages(scores, group_size, "grpo", std_norm=False),
        "reinforce_pp": group_advantages(scores, group_size, "reinforce_pp"),
    }
    for start in range(0, len(scores), group_size):
        group = scores[start : start + group_size].tolist()
        mean = sum(group) / group_size
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (group_size - 1))
        for i, s in enumerate(group):
            others = [o for j, o in enumerate(group) if j != i]
            row = start + i
            assert got["rloo"][row].item() == pytest.approx(s - sum(others) / len(others), abs=1e-12)
            assert got["grpo"][row].item() == pytest.approx((s - mean) / (std + 1e-4), abs=1e-12)
            assert got["dr_grpo"][row].item() == pytest.approx(s - mean, abs=1e-12)
            assert got["reinforce_pp"][row].item() == pytest.approx(s - mean, abs=1e-12)
    assert (got["grpo"][:group_size] == 0).all()
    with pytest.raises(ValueError, match="no group advantage"):
        group_advantages(scores, group_size, "gae")


def test_reward_to_go():
    lengths, mask, (rewards, *_) = ragged()
    gamma = 0.9
    got = reward_to_go(rewards, mask, gamma)
    for b, n in enumerate(lengths):
        for t in range(n):
            want = sum(gamma ** (k - t) * rewards[b, k].item() for k in range(t, n))
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
        assert (got[b, n:] == 0).all()


def test_dynamic_sampling_keeps_informative_groups_first():
    """Informative groups of every round first, in order, padded to the widest prompt and response; the first
    round's groups of ties fill the batch, flagged informative = 0."""

    def experience(scores, query_width, response_width):
        B = len(scores)
        return dict(
            query=torch.arange(B * query_width).view(B, query_width),
            query_mask=torch.ones(B, query_width),
            response=torch.arange(B * response_width).view(B, response_width) + 100,
            mask=torch.ones(B, response_width),
            scores=torch.tensor(scores),
        )

    first = experience([1.0, 1.0, 0.0, 2.0, -1.0, -1.0], 3, 4)  # groups of 2: ties, informative, ties
    second = experience([0.5, 0.5, 3.0, 1.0, 2.0, 0.0], 2, 5)  # ties, informative, informative
    assert train_grpo.informative_groups(first["scores"], 2).tolist() == [False, True, False]
    kept = train_grpo.keep_informative_groups([first, second], 2, 6, pad_id=-7)
    assert kept["scores"].tolist() == [0.0, 2.0, 3.0, 1.0, 2.0, 0.0] and kept["informative"].tolist() == [1.0] * 6
    assert kept["query"].shape == (6, 3) and kept["response"].shape == (6, 5)
    assert kept["query"][2].tolist() == [-7, 2 * 2, 2 * 2 + 1] and kept["query_mask"][2].tolist() == [0, 1, 1]
    assert kept["response"][0].tolist() == [2 * 4 + 100 + t for t in range(4)] + [-7] and kept["mask"][0, 4] == 0
    short = train_grpo.keep_informative_groups([first], 2, 6, pad_id=-7)  # one informative group: the ties fill
    assert short["scores"].tolist() == [0.0, 2.0, 1.0, 1.0, -1.0, -1.0]
    assert short["informative"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_loss_weights_over_micro_batches(agg):
    """Weights from the step's global counts, summed over uneven micro-batches, give the naive aggregate of the whole
    batch; a row with no kept token (--mask-truncated) counts in neither."""
    lengths, mask, (losses, *_) = ragged(B=8, seed=2)
    mask[3] = 0.0
    kept = [n for b, n in enumerate(lengths) if b != 3]
    n_seq, n_tok, max_new_tokens = (mask.sum(1) > 0).sum(), mask.sum(), 9
    total = 0.0
    for s in (slice(0, 3), slice(3, 4), slice(4, 8)):
        weights, denom = loss_weights(mask[s], agg, n_seq, n_tok, max_new_tokens)
        total += (losses[s] * weights).sum() / denom
    per_row = [sum(losses[b, :n].tolist()) for b, n in enumerate(lengths) if b != 3]
    want = {
        "token_mean": sum(per_row) / sum(kept),
        "seq_mean": sum(r / n for r, n in zip(per_row, kept)) / len(kept),
        "seq_sum_norm": sum(per_row) / (max_new_tokens * len(kept)),
    }[agg]
    assert total.item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_policy_loss_clip_higher_dual_clip_and_weights(dual_clip):
    lengths, mask, (lp, old, adv, _, _) = ragged(B=10, seed=6)
    lp = old + 0.5 * lp
    eps, eps_high = 0.2, 0.28
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    loss, stats = policy_loss(lp, old, adv, mask, eps, weights, denom, cliprange_high=eps_high, dual_clip=dual_clip)
    total, low, high, capped, tokens = 0.0, 0, 0, 0, sum(lengths)
    for b, n in enumerate(lengths):
        for t in range(n):
            r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
            u, c = -a * r, -a * min(max(r, 1 - eps), 1 + eps_high)
            term = max(u, c)
            if dual_clip is not None and a < 0 and -dual_clip * a < term:
                term, capped = -dual_clip * a, capped + 1
            total += term / (n * len(lengths))
            low += c > u and r < 1 - eps
            high += c > u and r > 1 + eps_high
    assert loss.item() == pytest.approx(total, abs=1e-12)
    assert stats["clipfrac_low"].item() == pytest.approx(low / tokens, abs=1e-12) and low > 0
    assert stats["clipfrac_high"].item() == pytest.approx(high / tokens, abs=1e-12) and high > 0
    assert stats["clipfrac"].item() == pytest.approx((low + high) / tokens, abs=1e-12)
    assert (capped > 0) == (dual_clip is not None)


def test_cliprange_none_is_the_plain_policy_gradient():
    """--cliprange None: no clip at any ratio, the loss is the mean of -A * ratio (nanochat's REINFORCE with the
    on-policy ratio 1)."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=6, seed=9)
    lp = old + 2.0 * lp  # ratios far outside any clip range
    loss, stats = policy_loss(lp, old, adv, mask, None, mask, mask.sum())
    want = (-adv * torch.exp(lp - old) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12) and stats["clipfrac"] == 0


def test_kl_loss_value_and_gradient():
    lengths, mask, (lp, ref, *_) = ragged()
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    logprobs = lp.clone().requires_grad_(True)
    loss = kl_loss(logprobs, ref, mask, weights, denom, 0.05, "k3")
    want = 0.0
    for b, n in enumerate(lengths):
        for t in range(n):
            d = ref[b, t].item() - lp[b, t].item()
            want += 0.05 * (math.exp(d) - 1 - d) * weights[b, t].item() / denom
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()  # d k3 / d logp = 1 - ref_p / p: pulls the policy towards the reference, 0 on padding
    assert torch.allclose(logprobs.grad, 0.05 * weights / denom * (1 - torch.exp(ref - lp)), atol=1e-12)


def test_k2_in_the_loss_value_and_gradient():
    """k2 = d^2 / 2 with d = logp - ref_logp: its gradient in logp is d, the on-policy gradient of k1 in the reward;
    padding holds an extreme log-prob and changes nothing; k1 in the loss is refused (its expected gradient is 0)."""
    lengths, mask, (lp, ref, *_) = ragged()
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    logprobs = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0)).requires_grad_(True)
    loss = kl_loss(logprobs, ref * mask, mask, weights, denom, 0.05, "k2")
    want = sum(
        0.05 * 0.5 * (lp[b, t].item() - ref[b, t].item()) ** 2 * weights[b, t].item() / denom
        for b, n in enumerate(lengths)
        for t in range(n)
    )
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    assert torch.allclose(logprobs.grad, 0.05 * weights / denom * (lp - ref) * mask, atol=1e-12)
    with pytest.raises(ValueError, match="k1's expected gradient is zero"):
        kl_loss(logprobs, ref, mask, weights, denom, 0.05, "k1")


def test_losses_are_masked_before_the_exponential():
    """Padding may hold any log-prob (a pad target's log-prob under the current policy is not masked): at -1000 on the
    policy side and 0 on the reference side, exp(ref - logp) alone would be inf and inf * 0 a NaN; the KL loss, its
    gradient, the reward penalty and the policy loss stay finite and equal the unpadded values."""
    lengths, mask, (lp, ref, adv, *_) = ragged(seed=4)
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    weights, denom = loss_weights(mask, "token_mean", len(lengths), mask.sum(), 7)
    logprobs = extreme.clone().requires_grad_(True)
    loss = kl_loss(logprobs, ref * mask, mask, weights, denom, 0.1, "k3")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and (logprobs.grad[mask == 0] == 0).all()
    assert loss.item() == pytest.approx(kl_loss(lp, ref * mask, mask, weights, denom, 0.1, "k3").item(), abs=1e-12)
    rewards = shape_rewards(torch.ones(len(lengths)), extreme, ref * mask, mask, 0.1)
    assert torch.isfinite(rewards).all() and (rewards[mask == 0] == 0).all()
    pg_loss, stats = policy_loss(extreme, lp * mask, adv, mask, 0.2, weights, denom, cliprange_high=0.3, dual_clip=3)
    assert torch.isfinite(pg_loss) and all(torch.isfinite(value) for value in stats.values())


# -----------------------------------------------------------------------------
# the rollout and the update on tiny models


@pytest.mark.parametrize("drop", ["mask_truncated", "dynamic_sampling"])
def test_dropped_responses_never_move_the_whitening(drop):
    """--mask-truncated drops the responses without EOS from the policy loss, --dynamic-sampling the groups that only
    fill the batch; REINFORCE++'s whitening over the rollout takes its statistics from the same tokens, so the dropped
    rows' advantages, here scaled 100-fold, leave the update unchanged."""
    weights = []
    for scale in (1.0, 100.0):
        actor, _, exp = fake_experience()
        exp = critic_free_experience(exp)  # rows 2 and 5 end without EOS
        dropped = exp["ended"] == 0
        if drop == "dynamic_sampling":  # the groups of rows 2-3 and 4-5 fill the batch
            dropped = torch.tensor([False, False, True, True, True, True, False, False])
            exp["informative"] = (~dropped).float()
        exp["advantages"] = exp["advantages"] * torch.where(dropped, scale, 1.0)[:, None]
        flags = {drop: True} | ({"group_size": 2} if drop == "dynamic_sampling" else {})
        stats = grpo_update_once(actor, exp, 4, estimator="reinforce_pp", **flags)
        assert stats["updates"] == 1
        weights.append(actor.state_dict())
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-6), name


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_against_the_formulas_masked_before_the_exponential(estimator):
    """train_grpo.kl_estimate per token, with d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = (exp(-d) - 1) + d
    (>= 0, like k2); 0 on padding. Padding may hold any log-prob (a pad target's log-prob under the current policy is
    not masked): at -1000 on the policy side and 0 on the reference side, exp(ref - logp) alone would be inf and
    inf * 0 a NaN; the estimates stay finite and equal the unpadded ones."""
    lengths, mask, (lp, ref, *_) = ragged(seed=4)
    kl = kl_estimate(lp, ref, mask, estimator)
    for b, n in enumerate(lengths):
        for t in range(mask.size(1)):
            if t >= n:
                assert kl[b, t] == 0
                continue
            d = (lp[b, t] - ref[b, t]).item()
            want = {"k1": d, "k2": 0.5 * d**2, "k3": (math.exp(-d) - 1) + d}[estimator]
            assert kl[b, t].item() == pytest.approx(want, abs=1e-12)
    assert estimator == "k1" or (kl >= 0).all()
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    padded = kl_estimate(extreme, ref * mask, mask, estimator)
    assert torch.isfinite(padded).all() and (padded[mask == 0] == 0).all()
    assert torch.allclose(padded, kl_estimate(lp, ref * mask, mask, estimator), atol=1e-12)
    with pytest.raises(ValueError, match="unknown kl estimator"):
        kl_estimate(lp, ref, mask, "k4")


def test_rollout_advantages_and_the_first_minibatch(task_tok):
    """grpo_rollout with the policy as its own reference, groups of 4: the rewards are the scores on the EOS tokens
    (KL in the loss), every token of a response has its group advantage; the first minibatch of the update reads
    ratio 1, approx_kl 0, clipfrac 0; later minibatches move."""
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)
    ref = GPT(actor.config).eval()
    ref.load_state_dict(actor.state_dict())
    rm = tiny_gpt(tok, 2, score_head=True)
    prompts = [p for p in ("Review of The Silent River (music):", "Review of") for _ in range(4)]
    args = resolve_args(
        train_grpo.Args(max_new_tokens=12, temperature=0.9, missing_eos_penalty=-3.0, ppo_epochs=2, num_minibatches=2)
    )
    engine = rollout.Engine(Models(actor, ref, [rm]), tok, args, 4, torch.Generator().manual_seed(0))
    exp, metrics, _ = train_grpo.grpo_rollout(engine, prompts, reward_moments=RunningMoments())
    mask = exp["mask"]
    assert metrics["objective/kl"] == 0.0 and 0 < exp["ended"].sum() < len(prompts)
    last = mask.sum(1).long() - 1
    assert torch.allclose(exp["rewards"].sum(1), exp["scores"]) and torch.allclose(
        exp["rewards"].gather(1, last[:, None]).squeeze(1), exp["scores"]
    )
    want = group_advantages(exp["scores"], 4, "grpo")
    assert torch.allclose(exp["advantages"], want[:, None] * mask, atol=1e-6)
    loop = checkpoints.Loop(torch.Generator().manual_seed(0))
    args = dataclasses.replace(args, micro_batch_size=2)
    metrics, diagnostics = train_grpo.grpo_update(trained("model", actor, grad_clip=1.0), exp, args, loop)
    first = diagnostics["first"]
    assert first["ratio_err"] <= 1e-5 and abs(first["approx_kl"]) <= 1e-5 and first["clipfrac"] == 0
    assert diagnostics["updates"] == 4 and metrics["policy/approx_kl"] > 0 and metrics["policy/kl_loss"] >= 0


def test_tis_weights_of_one_leave_the_update_unchanged():
    """With the sampler's log-probs equal to the trainer's (fp32), --tis-cap changes nothing: the weights are 1."""
    outcomes = []
    for tis_cap in (None, 2.0):
        actor, _, exp = fake_experience()
        exp = critic_free_experience(exp) | {"sampler_logprobs": exp["logprobs"].clone()}
        outcomes.append(grpo_update_once(actor, exp, 4, tis_cap=tis_cap) | {"weights": actor.state_dict()})
    assert outcomes[1]["policy/tis_weight_mean"] == pytest.approx(1.0) and outcomes[1]["policy/tis_clipfrac"] == 0
    for name, value in outcomes[0]["weights"].items():
        assert torch.allclose(value, outcomes[1]["weights"][name], atol=1e-7), name


# -----------------------------------------------------------------------------
# user mistakes


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(cliprange_high=-0.5), r"--cliprange-high -0\.5: the upper bound"),
        (dict(cliprange=-1.0), r"--cliprange -1\.0: use > 0 \(None: no clip\)"),
        (dict(kl_coef=-1.0), r"--kl-coef -1\.0: beta is the strength of a penalty"),
        (dict(ppo_epochs=0), r"--ppo-epochs 0: passes over each rollout"),
        (dict(estimator="rloo", grpo_std_norm=False), r"--no-grpo-std-norm applies to --estimator grpo, not rloo"),
        (dict(max_sample_rounds=5), r"--max-sample-rounds 5: it applies to --dynamic-sampling only"),
        (dict(cliprange=None, cliprange_high=0.28), r"--cliprange-high 0\.28: .*needs eps > 0 and a --cliprange"),
        (dict(gamma=1.5), r"--gamma 1\.5: a discount lies in \[0, 1\]"),
        (dict(group_size=1), r"--group-size 1: grpo compares responses within a group, use >= 2"),
        (dict(estimator="reinforce_pp", dynamic_sampling=True), r"--dynamic-sampling compares a group's scores"),
        (dict(dual_clip=1.0), r"--dual-clip 1\.0: the cap -c\*A needs c > 1"),
    ],
)
def test_settings_no_run_can_mean_are_refused(tmp_path, flags, message):
    """Values that used to run silently (an upper clip below the lower one zeroes every positive advantage's
    gradient, --ppo-epochs 0 never updates, ...): one line naming the flag, before any work."""
    with pytest.raises(common.UserError, match=message) as error:
        train_grpo.main(train_grpo.Args(out_dir=str(tmp_path / "grpo"), **flags))
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "grpo")


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--kl-penalty reward --kl-estimator k3", r"--kl-estimator k3 in the reward: .*works against the KL"),
        ("--kl-penalty reward --kl-estimator k2", r"--kl-estimator k2 in the reward: .*works against the KL"),
        ("--estimator rloo --kl-estimator k3", r"--kl-estimator k3 in the reward: "),  # rloo's KL is in the reward
        ("--kl-penalty loss --kl-estimator k1", r"--kl-estimator k1 in the loss: its expected gradient is zero"),
    ],
)
def test_a_kl_estimator_where_it_works_against_the_kl_is_refused(tmp_path, flags, message, capsys, monkeypatch):
    """k2 and k3 as a detached penalty in the reward (their gradient there is not the KL's, docs/design.md §5d), and k1
    in the loss (its expected gradient is zero): one line, exit 2, nothing written."""
    out = tmp_path / "grpo"
    err = exits_2_with_one_line("train_grpo.py", [*flags.split(), "--out-dir", str(out)], capsys, monkeypatch)
    assert re.search(message, err), err
    assert not os.path.exists(out)


def test_an_estimator_without_an_advantage_is_refused_at_start_up(tmp_path, monkeypatch):
    """A RECIPES row with no function in ADVANTAGES (a new estimator half added) is one line naming both tables,
    before any model loads or rollout runs, never an unbound variable after the first rollout."""
    monkeypatch.setitem(train_grpo.RECIPES, "remax", RECIPES["rloo"] | {"group_size": 1})
    out = tmp_path / "grpo"
    with pytest.raises(common.UserError, match=r"--estimator remax: RECIPES has it, .*ADVANTAGES") as error:
        train_grpo.main(train_grpo.Args(estimator="remax", out_dir=str(out), sft_ckpt=str(tmp_path / "missing.pt")))
    assert "\n" not in str(error.value) and not os.path.exists(out)


# -----------------------------------------------------------------------------
# smoke runs of main()

CKPT_KEYS = RUN_KEYS | {
    "reward_moments",
    "sft_hash",
    "rm_hashes",
}
GRPO_TAGS = {
    "objective/score",
    "objective/score_norm",
    "objective/kl",
    "objective/rlhf_reward",
    "objective/entropy",
    "objective/gold",
    "rollout/response_len",
    "rollout/perplexity",
    "rollout/eos_frac",
    "rollout/logprob_err",
    "policy/update_kl",
    "train/kl_coef",
    "train/updates",
    "train/lr",
    "train/skipped_steps",
    "perf/rollout_s",
    "perf/update_s",
    "perf/tokens_per_sec",
    "perf/mfu",
}
# logged for the iterations whose update took a step
STEP_TAGS = {
    "policy/loss",
    "policy/approx_kl",
    "policy/clipfrac",
    "policy/clipfrac_low",
    "policy/clipfrac_high",
    "policy/ratio_mean",
    "ptx/loss",
    "train/grad_norm",
}
# PPO-max's own: a critic, the KL controller's beta schedule, the collapse detector
PPO_ONLY_TAGS = {
    "value/loss",
    "value/clipfrac",
    "value/explained_variance",
    "value/grad_norm",
    "train/critic_lr",
    "collapse/alarm",
}


@pytest.mark.parametrize(
    "estimator, flags",
    [
        ("grpo", dict(cliprange_high=0.28, dual_clip=3.0)),
        pytest.param(
            "rloo",
            dict(loss_agg="seq_sum_norm", kl_penalty="loss", mask_truncated=True, dynamic_sampling=True),
            marks=pytest.mark.slow,
        ),
        pytest.param("reinforce_pp", dict(group_size=2), marks=pytest.mark.slow),
    ],
)
def test_grpo_smoke(tmp_path, task_dir, trained_sft, estimator, flags):
    """Each estimator on the gold reward: no critic built or saved, no KL controller or collapse detector, the
    actor trains from iteration 1, the §5b metrics are logged and finite, no value metric; --resume works. The tiny
    SFT policy hardly ever ends a response: under --mask-truncated most steps have nothing to train on and take no
    step (never a NaN)."""
    out = str(tmp_path / estimator)
    args = train_grpo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=trained_sft,
        rm_ckpt="none",
        reward_fn="data:gold_reward",
        estimator=estimator,
        max_steps=3,
        **TINY_RL,
        **flags,
    )
    train_grpo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "grpo" and ckpt["step"] == 3
    assert not [key for key in ckpt if key.startswith("critic")] and "kl_ctl" not in ckpt
    assert "collapse" not in ckpt["data_state"]
    assert ckpt["args"]["group_size"] == (args.group_size or 4)  # the resolved settings are saved
    assert ckpt["args"]["estimator"] == estimator and "critic_warmup_steps" not in ckpt["args"]
    scalars = read_scalars(out)
    resolved = resolve_args(args)
    step_tags = set(STEP_TAGS)
    if resolved.kl_penalty == "loss":
        step_tags.add("policy/kl_loss")
    tags = GRPO_TAGS | step_tags
    if args.mask_truncated:
        tags.add("rollout/truncated_frac")
    if args.dynamic_sampling:
        tags |= {"rollout/zero_std_frac", "rollout/sample_rounds"}
    for tag in tags:  # every iteration, the policy's included: no critic warm-up
        logged = scalars.get(tag, [])
        assert all(math.isfinite(v) for v in logged), tag
        assert len(logged) == 3 or (args.mask_truncated and tag in step_tags), tag
    assert not (PPO_ONLY_TAGS & set(scalars))
    updates = scalars["train/updates"][-1]
    assert updates == 3 * 2 * 2 or (args.mask_truncated and updates < 3 * 2 * 2)
    if args.dynamic_sampling:  # groups of ties (no response ends: every score is the penalty) ask for more rounds
        zero_std = scalars["rollout/zero_std_frac"]
        want_rounds = [args.max_sample_rounds if z == 1.0 else 1.0 for z in zero_std]
        assert all(rounds >= 1 for rounds in scalars["rollout/sample_rounds"])
        assert scalars["rollout/sample_rounds"] == want_rounds or min(zero_std) < 1.0
    train_grpo.main(train_grpo.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 4


@pytest.mark.parametrize(
    "flags",
    [dict(), dict(group_size=2, dynamic_sampling=True, max_sample_rounds=3)],
    ids=["grpo", "dynamic"],
)
def test_grpo_logs_episodes_as_the_responses_sampled(tmp_path, task_dir, tiny_ckpts, flags):
    """train/episodes counts the responses sampled so far: iterations x --rollout-batch-size at every logged step,
    continued (not restarted) by a resume; under --dynamic-sampling each extra round of an iteration adds another
    rollout batch (rollout/sample_rounds: the tiny random policy seldom ends a response, so its groups tie and ask
    for more)."""
    settings = dict(out_dir=str(tmp_path), task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_ckpts[1])
    sizes = dict(rollout_batch_size=8, num_minibatches=2, micro_batch_size=4, max_new_tokens=8, warmup_steps=1)
    args = train_grpo.Args(**settings, **sizes, **flags, max_steps=2)
    train_grpo.main(args)
    train_grpo.main(dataclasses.replace(args, max_steps=3, resume=True))
    scalars = read_scalars(str(tmp_path))
    rounds = scalars.get("rollout/sample_rounds", [1.0] * 3)
    assert len(rounds) == 3 and (not flags or max(rounds) > 1), rounds
    want = [8.0 * sum(rounds[: step + 1]) for step in range(3)]
    assert scalars["train/episodes"] == want and (flags or want == [8.0, 16.0, 24.0])


# -----------------------------------------------------------------------------
# reliability: a run killed at a random moment resumes exactly

GRPO_FLAGS = (
    "--max-steps 12 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 "
    "--max-new-tokens 16 --warmup-steps 2 --sample-every 1 --log-every 4 --save-every 1"
)
# the §5b flags on (Dr. GRPO's aggregation, KL in the loss, clip-higher, dual-clip); the tiny random policy never
# ends a response, so its policy moves through the ptx loss
CRITIC_FREE_FLAGS = (
    "--estimator grpo --group-size 2 --no-grpo-std-norm --loss-agg seq_sum_norm --cliprange-high 0.28 --dual-clip 3"
)
# DAPO's dynamic sampling: the tiny random policy seldom ends a response, so most groups score the missing-EOS
# penalty alike and are not informative; iterations sample extra rounds (more RNG draws and prompts)
DYNAMIC_FLAGS = "--estimator grpo --group-size 2 --dynamic-sampling --max-sample-rounds 3"


@pytest.mark.slow
@pytest.mark.parametrize("flags", [CRITIC_FREE_FLAGS, DYNAMIC_FLAGS], ids=["grpo", "dynamic"])
def test_grpo_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts, flags):
    sft, rm = tiny_ckpts
    base = f"{sys.executable} train_grpo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} {GRPO_FLAGS} {flags}"
    r = run(f"{base} --out-dir {tmp_path}/full")
    assert r.returncode == 0, r.stderr[-3000:]
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=5)
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    assert "critic" not in full and "kl_ctl" not in full
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    for k, v in full["reward_moments"].items():
        assert abs(v - killed["reward_moments"][k]) <= 1e-5 * max(1.0, abs(v)), k
    updates = full["data_state"]["updates"]
    assert killed["data_state"]["updates"] == updates
    if flags == DYNAMIC_FLAGS:  # a minibatch with no informative group is no step
        assert 0 < updates <= 12 * 2
        assert max(read_scalars(str(tmp_path / "full"))["rollout/sample_rounds"]) > 1  # extra rounds were drawn
    else:
        assert updates == 12 * 2
    assert full["data_state"]["prompts"] == killed["data_state"]["prompts"]
    assert full["data_state"]["ptx"] == killed["data_state"]["ptx"]
    # samples.jsonl: no duplicate lines, 8 per iteration, the very lines of the uninterrupted run
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 12 * 8
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()
