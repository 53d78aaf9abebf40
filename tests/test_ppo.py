"""train_ppo.py, PPO-max: every pure function against naive loops on random ragged batches (length-1 and full-length
rows), the loss denominator under accumulation, the KL controller and the collapse detector; the rollout's rewards and
the first minibatch's ratio, a NaN step, TIS weights of 1; its defaults and the flags no run can mean; smoke runs of
main() (gold reward, an RM, an ensemble with its own reference, LoRA's shared bases in test_lora.py), the critic's fresh
head, a DPO policy as its start, --reward-fn from a file, 2 torchrun ranks, train/episodes, kill-and-resume, and
SIGTERM's save, exit 143 and exact resume."""

import json
import math
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import (
    ENV,
    ROOT,
    RUN_KEYS,
    TINY_PPO,
    TORCHRUN,
    assert_same_weights,
    boost_eos,
    fake_experience,
    kill_and_resume,
    ppo_update_once,
    ragged,
    read_events,
    read_scalars,
    run,
    run_here,
    tiny_gpt,
    trained,
    valid,
)

import checkpoints
import common
import parallel
import rollout
import train_grpo
import train_ppo
from model import GPT, GPTConfig, masked_mean
from rollout import Models
from train_ppo import (
    CollapseDetector,
    KLController,
    RunningMoments,
    compute_gae,
    ppo_policy_loss,
    ppo_value_loss,
    shape_rewards,
)

PPO_TAGS = [
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
    "policy/loss",
    "policy/approx_kl",
    "policy/clipfrac",
    "policy/ratio_mean",
    "policy/update_kl",
    "value/loss",
    "value/clipfrac",
    "value/explained_variance",
    "value/grad_norm",
    "ptx/loss",
    "train/critic_lr",
    "train/kl_coef",
    "train/updates",
    "collapse/alarm",
    "perf/rollout_s",
    "perf/update_s",
    "train/lr",
    "train/grad_norm",
    "train/skipped_steps",
    "perf/tokens_per_sec",
    "perf/mfu",
]
# logged only for iterations where the actor trains (not during the critic warm-up)
ACTOR_TAGS = {"policy/loss", "policy/approx_kl", "policy/clipfrac", "policy/ratio_mean", "ptx/loss", "train/grad_norm"}
CKPT_KEYS = RUN_KEYS | {
    "critic",
    "critic_optimizer",
    "critic_scheduler",
    "reward_moments",
    "kl_ctl",
    "sft_hash",
    "rm_hashes",
}


# -----------------------------------------------------------------------------
# pure functions against naive loops; the statistics of steps 4 and 6 that train_grpo.py writes again are tested on
# both files


@pytest.mark.parametrize("stage", [train_ppo, train_grpo], ids=["ppo", "grpo"])
def test_global_moments_and_whiten(stage):
    """parallel.global_moments over one rank: the mean and biased variance of the valid entries; whiten: (x - mean) /
    sqrt(var + 1e-8) on them."""
    lengths, mask, (x, *_) = ragged()
    vals = valid(x, lengths)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-12)
    global_mean, global_var = parallel.global_moments(x, mask, "cpu")
    assert global_mean.item() == pytest.approx(mean, abs=1e-6) and global_var.item() == pytest.approx(var, rel=1e-6)
    w = stage.whiten(x, torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64))
    assert valid(w, lengths) == pytest.approx([(v - mean) / math.sqrt(var + 1e-8) for v in vals], abs=1e-10)
    w = stage.whiten(x, torch.tensor(0.5).double(), torch.tensor(4.0).double())
    assert valid(w, lengths) == pytest.approx([(v - 0.5) / math.sqrt(4.0 + 1e-8) for v in vals], abs=1e-10)
    nothing = parallel.global_moments(x, torch.zeros_like(mask), "cpu")
    assert nothing[0].item() == 0 and nothing[1].item() == 0  # no valid entry: 0 and 0, not a NaN


@pytest.mark.parametrize("stage", [train_ppo, train_grpo], ids=["ppo", "grpo"])
def test_running_moments_merge_equals_big_batch(stage):
    RunningMoments = stage.RunningMoments
    torch.manual_seed(0)
    chunks = [torch.randn(n, dtype=torch.float64) * 3 + 1 for n in (5, 1, 17, 64)]
    big = torch.cat(chunks)
    # ranks simulated by folding per-chunk triples (what update() does with the all-gathered triples)
    triples = [(len(c), c.mean().item(), ((c - c.mean()) ** 2).sum().item()) for c in chunks]
    n, mean, m2 = RunningMoments.combine(triples)
    assert n == len(big) and mean == pytest.approx(big.mean().item(), abs=1e-12)
    assert math.sqrt(m2 / n) == pytest.approx(big.std(correction=0).item(), abs=1e-12)
    # sequential updates over the history equal one big batch; state round-trips
    rm = RunningMoments()
    for c in chunks:
        rm.update(c)
    assert rm.mean == pytest.approx(big.mean().item(), abs=1e-12)
    assert rm.std == pytest.approx(big.std(correction=0).item(), abs=1e-12)
    rm2 = RunningMoments()
    rm2.load_state_dict(rm.state_dict())
    assert (rm2.count, rm2.mean, rm2.std) == (rm.count, rm.mean, rm.std)


@pytest.mark.parametrize("stage", [train_ppo, train_grpo], ids=["ppo", "grpo"])
def test_normalize_scores_with_a_zero_std(stage):
    """Every score seen so far equal (all responses missing EOS): no scale to divide by, so scale/norm leave the
    scores finite (s and 0), never s / 1e-8 = -1e8 with --reward-clip None."""
    normalize_scores = stage.normalize_scores
    scores = torch.full((4,), -1.0)
    moments = stage.RunningMoments()
    moments.update(scores)
    assert moments.std == 0.0
    scaled = normalize_scores(scores, moments.mean, moments.std, "scale", None)
    assert torch.equal(scaled, scores)
    centred = normalize_scores(scores, moments.mean, moments.std, "norm", None)
    assert torch.equal(centred, torch.zeros(4))
    # a real spread: the PPO-max formulas, then the clip
    scores = torch.tensor([0.0, 1.0, 2.0, 30.0])
    want = (scores - 1.5) / (2.0 + 1e-8)
    assert torch.allclose(normalize_scores(scores, 1.5, 2.0, "norm", None), want)
    assert torch.allclose(normalize_scores(scores, 1.5, 2.0, "scale", 5.0), (scores / 2.0).clamp(-5, 5))
    assert torch.equal(normalize_scores(scores, 1.5, 2.0, "none", None), scores)


def test_shape_rewards():
    """-beta * k1 per token, the score on the EOS, 0 on padding; the KL returned is k1 itself."""
    lengths, mask, (lp, ref, _, _, _) = ragged()
    scores = torch.randn(len(lengths), dtype=torch.float64)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.1)
    for b, n in enumerate(lengths):
        for t in range(mask.size(1)):
            if t >= n:
                assert rewards[b, t] == 0 and kl[b, t] == 0
                continue
            d = (lp[b, t] - ref[b, t]).item()
            assert kl[b, t].item() == pytest.approx(d, abs=1e-12)
            want = -0.1 * d + (scores[b].item() if t == n - 1 else 0.0)  # the score lands on the EOS
            assert rewards[b, t].item() == pytest.approx(want, abs=1e-12)
    # padding may hold any log-prob (-1000 on the policy side): k1 is masked first, so nothing changes
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    padded_rewards, padded_kl = shape_rewards(scores, extreme, ref, mask, 0.1)
    assert torch.equal(padded_rewards, rewards) and torch.equal(padded_kl, kl)


def test_compute_gae():
    lengths, mask, (rewards, values, _, _, _) = ragged()
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(rewards * mask, values * mask, mask, gamma, lam)
    for b, n in enumerate(lengths):
        gae = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            gae = delta + gamma * lam * gae
            assert adv[b, t].item() == pytest.approx(gae, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(gae + values[b, t].item(), abs=1e-12)
        assert (adv[b, n:] == 0).all() and (ret[b, n:] == 0).all()
    # values/rewards on padding are ignored
    adv2, _ = compute_gae(rewards, values, mask, gamma, lam)
    assert torch.equal(adv, adv2)


def test_ppo_policy_loss():
    lengths, mask, (lp, old, adv, _, _) = ragged()
    lp = old + 0.3 * lp  # ratios around 1, some clipped
    eps = 0.2
    loss, stats = ppo_policy_loss(lp, old, adv, mask, eps)
    terms, clipped, kls, ratios = [], [], [], []
    for b, n in enumerate(lengths):
        for t in range(n):
            r = math.exp(lp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            u, c = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            terms.append(max(u, c))
            clipped.append(float(c > u))
            kls.append((r - 1) - math.log(r))
            ratios.append(r)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)
    assert 0 < stats["clipfrac"].item() < 1
    assert stats["approx_kl"].item() == pytest.approx(sum(kls) / len(kls), abs=1e-12)
    assert stats["ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios), abs=1e-12)


def test_ppo_policy_loss_is_the_critic_free_loss_with_every_knob_off():
    """The training loop's path (a global denominator; weights = the mask, or the mask times TIS weights):
    train_ppo.ppo_policy_loss equals train_grpo.policy_loss with clip-higher and dual-clip off (or clip-higher at the
    clip itself) bit for bit, loss and shared statistics, and both equal the formula written out here."""
    lengths, mask, (lp, old, adv, tis, _) = ragged(B=8, seed=5)
    lp = old + 0.3 * lp
    denom = mask.sum() + 3.0  # a global count larger than this micro-batch's
    ratio = torch.exp(lp - old)
    today = (torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2)) * mask).sum() / denom
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2, denom=denom)
    assert torch.equal(loss, today)
    assert torch.equal(ppo_policy_loss(lp, old, adv, mask, 0.2, denom=denom, weights=mask)[0], today)
    for extra in ({}, {"cliprange_high": None, "dual_clip": None}, {"cliprange_high": 0.2}):
        free_loss, free_stats = train_grpo.policy_loss(lp, old, adv, mask, 0.2, mask, denom, **extra)
        assert torch.equal(free_loss, loss), extra
        assert all(torch.equal(free_stats[key], value) for key, value in stats.items()), extra
    weights = mask * tis.abs()  # --tis-cap: the mask times per-token weights
    weighted, _ = ppo_policy_loss(lp, old, adv, mask, 0.2, denom=denom, weights=weights)
    assert torch.equal(train_grpo.policy_loss(lp, old, adv, mask, 0.2, weights, denom)[0], weighted)
    assert not torch.equal(weighted, loss)


def test_cliprange_none_is_the_plain_policy_gradient():
    """--cliprange None: no clip at any ratio, the loss is the mean of -A * ratio (nanochat's REINFORCE with the
    on-policy ratio 1)."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=6, seed=9)
    lp = old + 2.0 * lp  # ratios far outside any clip range
    loss, stats = ppo_policy_loss(lp, old, adv, mask, None)
    want = (-adv * torch.exp(lp - old) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12) and stats["clipfrac"] == 0


def test_padding_with_extreme_logprobs_keeps_rewards_and_loss_finite():
    """Padding may hold any log-prob: at -1000 on the policy side the reward penalty and the policy loss (masked
    before the exponential) stay finite, 0 on padding, and equal the unpadded values."""
    lengths, mask, (lp, ref, adv, *_) = ragged(seed=4)
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    rewards, kl = shape_rewards(torch.ones(len(lengths)), extreme, ref * mask, mask, 0.1)
    assert torch.isfinite(rewards).all() and torch.isfinite(kl).all() and (kl[mask == 0] == 0).all()
    assert torch.allclose(rewards, shape_rewards(torch.ones(len(lengths)), lp, ref * mask, mask, 0.1)[0])
    pg_loss, stats = ppo_policy_loss(extreme, lp * mask, adv, mask, 0.2)
    assert torch.isfinite(pg_loss) and all(torch.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("eps", [0.2, None])
def test_ppo_value_loss(eps):
    lengths, mask, (v, old, ret, _, _) = ragged()
    loss, stats = ppo_value_loss(v, old, ret, mask, eps)
    terms, clipped = [], []
    for b, n in enumerate(lengths):
        for t in range(n):
            vv, o, r = v[b, t].item(), old[b, t].item(), ret[b, t].item()
            u = (vv - r) ** 2
            c = u if eps is None else (o + min(max(vv - o, -eps), eps) - r) ** 2
            terms.append(max(u, c))
            clipped.append(float(c > u))
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)
    assert (stats["clipfrac"].item() > 0) == (eps is not None)


def test_denom_gives_big_batch_gradient():
    """Micro-batches with denom = the step's token count accumulate to the gradient of the whole batch."""
    lengths, mask, (lp, old, adv, ret, _) = ragged(B=8, seed=3)
    for kind in ("policy", "value"):
        x_full = lp.clone().requires_grad_(True)
        f = (
            (lambda x, m, s: ppo_policy_loss(x, old[s], adv[s], m, 0.2, denom=denom)[0])
            if kind == "policy"
            else (lambda x, m, s: ppo_value_loss(x, old[s], ret[s], m, 0.2, denom)[0])
        )
        denom = None
        f(x_full, mask, slice(None)).backward()
        x_acc = lp.clone().requires_grad_(True)
        denom = mask.sum()
        for s in (slice(0, 3), slice(3, 5), slice(5, 8)):  # uneven micro-batches with different token counts
            f(x_acc[s], mask[s], s).backward()
        assert torch.allclose(x_full.grad, x_acc.grad, atol=1e-12), kind


def test_kl_controllers():
    fixed = KLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    ctl = KLController(0.1, target=6.0, horizon=1000)
    ctl.update(9.0, 100)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(5.7, 100)  # error -0.05
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1) * (1 - 0.05 * 0.1))
    ctl2 = KLController(1.0, 6.0, 1000)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.value == ctl.value


def test_collapse_detector():
    g = torch.Generator().manual_seed(0)

    def noise() -> float:
        return torch.randn(1, generator=g).item()

    def run_detector(jump_at=None, length_jump=True):
        det, alarms = CollapseDetector(), []  # the defaults
        for t in range(80):
            kl, length, ppl = 0.05 * t + 0.02 * noise(), 20 + 0.5 * noise(), 3 - 0.002 * t + 0.01 * noise()
            if jump_at is not None and t >= jump_at:
                kl += 5.0
                if length_jump and t >= jump_at + 2:
                    length += 15.0
            alarms.append(det.update(kl, length, ppl))
        return alarms

    assert not any(run_detector())  # a smooth trend with noise: no alarm
    alarms = run_detector(jump_at=50)
    assert not any(alarms[:50]) and alarms[52]  # KL jumps at 50, length at 52: fires at 52
    assert not any(run_detector(jump_at=50, length_jump=False))  # KL alone is not the collapse signature
    # the first rise from KL = 0 once the actor moves (iterations 6-16 of a PPO-max run, seed 1) is not a collapse
    kl = [0.0, 0.029, 0.046, 0.030, 0.249, 0.428, 0.833, 3.215, 3.390, 4.154, 2.876]
    length = [14.3, 15.4, 14.9, 14.5, 14.7, 18.7, 18.3, 21.3, 21.8, 22.2, 21.1]
    ppl = [2.533, 2.508, 2.587, 2.571, 2.452, 2.490, 2.417, 2.362, 2.395, 2.286, 2.179]
    det = CollapseDetector()
    assert not any(det.update(*x) for x in zip(kl, length, ppl))


def test_defaults_are_ppo_max_and_the_retired_flags_are_gone():
    """PPO-max's settings are plain defaults now (no estimator to resolve them from); the flags the critic-free
    family took along are no fields of train_ppo.Args (--mask-truncated is both stages' now: rollout.RolloutArgs)."""
    args = train_ppo.Args()
    assert (args.kl_coef, args.reward_norm, args.reward_clip, args.adv_whiten) == (0.3, "norm", 5.0, "minibatch")
    assert (args.critic_warmup_steps, args.out_dir) == (5, "out/ppo")
    moved = ("adv_estimator", "group_size", "grpo_std_norm", "dynamic_sampling", "kl_penalty")
    moved += ("max_sample_rounds", "kl_estimator", "loss_agg", "cliprange_high", "dual_clip")
    assert not set(moved) & set(train_ppo.Args.__dataclass_fields__)
    assert train_ppo.Args().entropy_coef == 0.0  # a flag again (default off)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(cliprange=-1.0), r"--cliprange -1\.0: use > 0 \(None: no clip\)"),
        (dict(kl_coef=-1.0), r"--kl-coef -1\.0: beta is the strength of a penalty"),
        (dict(ppo_epochs=0), r"--ppo-epochs 0: passes over each rollout"),
        (dict(cliprange_value=0.0), r"--cliprange-value 0\.0: use > 0"),
        (dict(gamma=1.5), r"--gamma 1\.5 --lam 0\.95: both lie in \[0, 1\]"),
        (dict(kl_target=0.0), r"--kl-target 0\.0: a KL per sequence in nats, use > 0"),
        (dict(temperature=0.0), r"--temperature 0\.0: RL samples from the tempered distribution"),
    ],
)
def test_settings_no_run_can_mean_are_refused(tmp_path, flags, message):
    """Values that used to run silently (--ppo-epochs 0 never updates, ...): one line naming the flag, before any
    work."""
    with pytest.raises(common.UserError, match=message) as error:
        train_ppo.main(train_ppo.Args(out_dir=str(tmp_path / "ppo"), **flags))
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "ppo")


# -----------------------------------------------------------------------------
# the rollout's rewards and advantages, the update on tiny models


def test_rollout_rewards_on_eos_and_the_first_minibatch(task_tok):
    """ppo_rollout with the policy as its own reference: the reward is the score on the EOS token alone (KL = 0);
    the first minibatch of the update that follows reads ratio 1, approx_kl 0, clipfrac 0 (training shapes differ
    from scoring), later minibatches move."""
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)  # some rows end with EOS within 12 tokens, some do not
    ref = GPT(actor.config).eval()
    ref.load_state_dict(actor.state_dict())
    critic, rm = tiny_gpt(tok, 1, lm_head=False, score_head=True), tiny_gpt(tok, 2, score_head=True)
    prompts = [f"Review of The Silent River ({a}):" for a in ("plot", "music", "acting, ending")] + ["Review of"] * 5
    args = train_ppo.Args(
        max_new_tokens=12,
        temperature=0.9,
        missing_eos_penalty=-3.0,
        reward_norm="none",
        reward_clip=None,
        ppo_epochs=2,
        num_minibatches=2,
        cliprange=0.2,
        cliprange_value=0.2,
    )
    generator = torch.Generator().manual_seed(0)
    reward_fn = lambda p, r, e: len(r) / 10  # noqa: E731
    engine = rollout.Engine(Models(actor, ref, [rm], critic=critic), tok, args, 4, generator, reward_fn=reward_fn)
    exp, metrics, records = train_ppo.ppo_rollout(engine, args, prompts, kl_coef=0.1, reward_moments=RunningMoments())
    assert metrics["objective/kl"] == 0.0 and (exp["logprobs"] == exp["ref_logprobs"]).all()
    ended = torch.tensor([record["ended"] for record in records])
    assert 0 < ended.sum() < len(prompts), "want rows with and without EOS"
    mask = exp["mask"]
    last = mask.sum(1).long() - 1
    for b in range(len(prompts)):
        n = int(last[b]) + 1
        if not ended[b]:
            assert exp["scores"][b].item() == -3.0
        # the reward is the score on the EOS token only (KL = 0)
        assert exp["rewards"][b, n - 1].item() == pytest.approx(exp["scores"][b].item(), abs=1e-6)
        assert (exp["rewards"][b, : n - 1] == 0).all() and (exp["rewards"][b, n:] == 0).all()
    want, _ = compute_gae(exp["rewards"], exp["values"], mask, args.gamma, args.lam)
    assert torch.allclose(exp["advantages"], want, atol=1e-6)
    loop = rollout.Loop(torch.Generator().manual_seed(0), step=args.critic_warmup_steps)
    actor_entry, critic_entry = trained("model", actor, grad_clip=1.0), trained("critic", critic, grad_clip=1.0)
    update_args = replace(args, micro_batch_size=2)
    metrics, diagnostics = train_ppo.ppo_update(
        actor_entry, critic_entry, exp, update_args, loop.step, loop.generator, loop.guard, loop.ptx_stream
    )
    first = rollout.read_diagnostics(diagnostics["first_micro_batch"])
    assert first["ratio_err"] <= 1e-5 and abs(first["approx_kl"]) <= 1e-5 and first["clipfrac"] == 0
    assert diagnostics["updates"] == 4 and metrics["policy/approx_kl"] > 0  # later minibatches moved


def test_non_finite_loss_skips_the_step(monkeypatch):
    """A NaN policy loss (monkeypatched) skips the actor's step and counts it once; the critic still steps; the
    actor's metrics average over the steps it took (none here), not over the skipped one."""
    actor, critic, exp = fake_experience()
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    critic_before = critic.score_head.weight.clone()
    real = train_ppo.ppo_policy_loss

    def nan_policy_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(train_ppo, "ppo_policy_loss", nan_policy_loss)
    stats = ppo_update_once(actor, critic, exp, micro_batch_size=4)
    assert stats["train/skipped_steps"] == 1 and all(torch.equal(v, before[k]) for k, v in actor.state_dict().items())
    assert not torch.equal(critic.score_head.weight, critic_before)
    assert stats["updates"] == 0 and "policy/loss" not in stats and "train/grad_norm" not in stats
    assert math.isfinite(stats["value/loss"]) and math.isfinite(stats["value/grad_norm"])


def test_both_norms_non_finite_count_one_skipped_step(monkeypatch):
    """Actor and critic both non-finite in the same step: one skipped step, no update, no metric from it."""
    actor, critic, exp = fake_experience()
    real_policy_loss, real_value_loss = train_ppo.ppo_policy_loss, train_ppo.ppo_value_loss

    def nan_policy_loss(*args, **kwargs):
        loss, stats = real_policy_loss(*args, **kwargs)
        return loss * float("nan"), stats

    def nan_value_loss(*args, **kwargs):
        loss, stats = real_value_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(train_ppo, "ppo_policy_loss", nan_policy_loss)
    monkeypatch.setattr(train_ppo, "ppo_value_loss", nan_value_loss)
    stats = ppo_update_once(actor, critic, exp, micro_batch_size=4)
    assert stats["train/skipped_steps"] == 1 and stats["updates"] == 0
    assert "value/loss" not in stats and "value/grad_norm" not in stats and "policy/loss" not in stats


def test_tis_weights_of_one_leave_the_update_unchanged():
    """With the sampler's log-probs equal to the trainer's (fp32), --tis-cap changes nothing: the weights are 1."""
    outcomes = []
    for tis_cap in (None, 2.0):
        actor, critic, exp = fake_experience()
        exp["sampler_logprobs"] = exp["logprobs"].clone()
        outcomes.append(ppo_update_once(actor, critic, exp, 4, tis_cap=tis_cap) | {"weights": actor.state_dict()})
    assert outcomes[1]["policy/tis_weight_mean"] == pytest.approx(1.0) and outcomes[1]["policy/tis_clipfrac"] == 0
    for name, value in outcomes[0]["weights"].items():
        assert torch.allclose(value, outcomes[1]["weights"][name], atol=1e-7), name


# -----------------------------------------------------------------------------
# smoke runs of main()


def test_ppo_smoke_gold_reward(tmp_path, task_dir, trained_sft):
    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=trained_sft,
        rm_ckpt="none",
        reward_fn="task:gold_reward",
        max_steps=3,
        entropy_coef=0.01,
        **TINY_PPO,
    )
    train_ppo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "ppo" and ckpt["step"] == 3 and ckpt["rm_hashes"] == []
    assert len(ckpt["sft_hash"]) == 64 and "collapse" in ckpt["data_state"]
    policy, critic = GPT.from_checkpoint(ckpt), GPT.from_checkpoint(ckpt, key="critic")
    assert policy.config.lm_head and critic.config.score_head and not critic.config.lm_head
    scalars, tags = read_events(out)
    actor_tags = ACTOR_TAGS | {"policy/entropy_bonus"}  # --entropy-coef set
    for tag in [
        *PPO_TAGS,
        "policy/entropy_bonus",
    ]:  # the actor's own tags start after the critic warm-up (1 of the 3 iterations)
        logged = 2 if tag in actor_tags else 3
        assert tag in scalars and len(scalars[tag]) == logged and all(math.isfinite(v) for v in scalars[tag]), tag
    assert abs(scalars["policy/update_kl"][0]) < 1e-4  # the critic warm-up: the actor did not move
    assert "samples/text_summary" in tags["tensors"]
    assert scalars["train/updates"][-1] == 3 * 2 * 2
    assert os.path.getsize(os.path.join(out, "samples.jsonl")) > 0
    # --resume continues from the checkpoint
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 4


@pytest.mark.slow
def test_ppo_smoke_with_reward_model(tmp_path, task_dir, trained_sft):
    """An RM checkpoint (here an SFT trunk with a fresh score head, kind "rm") scores responses and starts the critic;
    an RM with another tokenizer is refused with one line."""
    sft = torch.load(trained_sft, weights_only=False)
    rm_model = GPT(GPTConfig(**{**sft["model_config"], "score_head": True}))
    rm_path = str(tmp_path / "rm.pt")
    checkpoints.save_checkpoint(sft | {"kind": "rm", "model": rm_model.state_dict(), "score_offset": 0.0}, rm_path)
    out = str(tmp_path / "ppo")
    train_ppo.main(
        train_ppo.Args(out_dir=out, task_dir=task_dir, sft_ckpt=trained_sft, rm_ckpt=rm_path, max_steps=2, **TINY_PPO)
    )
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert len(ckpt["rm_hashes"]) == 1 and "objective/gold" in read_scalars(out)
    bad_path = str(tmp_path / "rm_bad.pt")
    ranks = list(sft["tokenizer"]["ranks"])
    ranks[300], ranks[301] = ranks[301], ranks[300]  # the same size, two merges swapped: another tokenizer
    checkpoints.save_checkpoint(
        torch.load(rm_path, weights_only=False) | {"tokenizer": {**sft["tokenizer"], "ranks": ranks}}, bad_path
    )
    fresh = str(tmp_path / "ppo_fresh")  # mistakes of a new run
    with pytest.raises(common.UserError, match="tokenizer differs"):
        train_ppo.main(train_ppo.Args(out_dir=fresh, task_dir=task_dir, sft_ckpt=trained_sft, rm_ckpt=bad_path))
    with pytest.raises(common.UserError, match="needs --reward-fn"):
        train_ppo.main(train_ppo.Args(out_dir=fresh, task_dir=task_dir, sft_ckpt=trained_sft, rm_ckpt="none"))
    with pytest.raises(common.UserError, match="--reward-fn data:nope"):
        train_ppo.main(
            train_ppo.Args(
                out_dir=fresh, task_dir=task_dir, sft_ckpt=trained_sft, rm_ckpt="none", reward_fn="data:nope"
            )
        )


@pytest.mark.slow
def test_stop_on_collapse_keeps_the_checkpoint_before_the_alarm(tmp_path, task_dir, trained_sft, monkeypatch):
    class AlarmOnSecond(train_ppo.CollapseDetector):
        def update(self, *values) -> bool:
            super().update(*values)
            return len(self.history["kl"]) == 2

    monkeypatch.setattr(train_ppo, "CollapseDetector", AlarmOnSecond)
    out = str(tmp_path / "ppo")
    train_ppo.main(
        train_ppo.Args(
            out_dir=out,
            task_dir=task_dir,
            sft_ckpt=trained_sft,
            rm_ckpt="none",
            reward_fn="task:gold_reward",
            max_steps=4,
            save_every=1,
            stop_on_collapse=True,
            **{**TINY_PPO, "critic_warmup_steps": 0},
        )
    )
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 1
    assert read_scalars(out)["collapse/alarm"] == [0.0, 1.0]


@pytest.mark.slow
def test_fresh_critic_head_follows_the_seed(tmp_path, task_dir, trained_sft):
    """--rm-ckpt none: the critic's fresh head is built after seeding, so --seed decides it (and only --seed)."""
    heads = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = str(tmp_path / name)
        args = train_ppo.Args(
            out_dir=out,
            task_dir=task_dir,
            sft_ckpt=trained_sft,
            rm_ckpt="none",
            reward_fn="task:gold_reward",
            seed=seed,
            max_steps=1,
            **{**TINY_PPO, "critic_warmup_steps": 1, "critic_lr": 0.0},
        )
        train_ppo.main(args)
        heads[name] = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["critic"]["score_head.weight"]
    assert torch.equal(heads["a"], heads["b"]) and not torch.equal(heads["a"], heads["c"])


@pytest.mark.slow
def test_ppo_starts_from_a_dpo_checkpoint(tmp_path, task_dir, trained_sft):
    """PPO after DPO: --sft-ckpt takes a kind "dpo" policy (policy and reference)."""
    dpo_path = str(tmp_path / "dpo.pt")
    checkpoints.save_checkpoint(torch.load(trained_sft, weights_only=False) | {"kind": "dpo"}, dpo_path)
    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=dpo_path,
        rm_ckpt="none",
        reward_fn="task:gold_reward",
        max_steps=1,
        **TINY_PPO,
    )
    train_ppo.main(args)
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 1


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "def score(prompt, response):\n    return 1.0\n",
            r"score\(the first prompt, '', ended=True\) raised TypeError",
        ),
        ("def score(prompt, response, ended):\n    return None\n", r"returned None: expected a finite number"),
        ("def score(prompt, response, ended):\n    return float('nan')\n", r"returned nan: expected a finite number"),
        (
            "def score(prompt, response, ended):\n    return 1.0 if ended else {}['x']\n",
            r"ended=False\) raised KeyError",
        ),
    ],
    ids=["signature", "none", "nan", "raises"],
)
def test_a_reward_function_is_tried_before_any_model_loads(tmp_path, task_dir, trained_sft, body, message, monkeypatch):
    """--reward-fn is called at start-up on the run's first prompt and an empty response, ended and not: a wrong
    signature, an exception or a value that is no finite number is one line naming the function, before any model
    loads (it was a 33-line traceback after the first rollout)."""
    import hf

    (tmp_path / "myreward.py").write_text(body)
    monkeypatch.setattr(hf, "model_from_checkpoint", lambda *a, **k: pytest.fail("a model was built"))
    args = train_ppo.Args(
        out_dir=str(tmp_path / "ppo"),
        task_dir=task_dir,
        sft_ckpt=trained_sft,
        rm_ckpt=["none"],
        reward_fn=f"{tmp_path}/myreward.py:score",
    )
    with pytest.raises(common.UserError, match=message) as error:
        train_ppo.main(args)
    assert str(error.value).startswith(f"--reward-fn {tmp_path}/myreward.py:score: score(") and "\n" not in str(
        error.value
    )


@pytest.mark.slow
def test_reward_fn_from_a_file_or_a_module_beside_the_working_folder(tmp_path, task_dir, trained_sft):
    """--reward-fn path/to/file.py:fn loads the file; module:fn finds a module in the working folder when the script
    runs by its path from there (the current folder used not to be on the import path: ModuleNotFoundError); the
    score's parts are logged apart: objective/reward_fn (and objective/rm_score beside an RM)."""
    (tmp_path / "myreward.py").write_text("def length(prompt, response, ended):\n    return len(response) / 10\n")
    fn = common.load_reward_fn(f"{tmp_path}/myreward.py:length")
    assert fn("prompt", "abcd", True) == pytest.approx(0.4)
    for spec, message in (
        (f"{tmp_path}/nope.py:length", r"nope\.py: no such file"),
        (f"{tmp_path}/myreward.py:width", "AttributeError"),
        ("no_such_module_here:fn", "ModuleNotFoundError"),
        ("task", "expected module:function or path/to/file.py:function"),
        ("task:TASK_FILES", "TASK_FILES is not a function"),
    ):
        with pytest.raises(common.UserError, match=message):
            common.load_reward_fn(spec)
    flags = "--max-steps 1 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4"
    script = os.path.join(ROOT, "train_ppo.py")
    cmd = (
        f"{sys.executable} {script} --sft-ckpt {trained_sft} --rm-ckpt none --reward-fn myreward:length {flags} "
        f"--max-new-tokens 8 --task-dir {task_dir} --out-dir {tmp_path / 'ppo'}"
    )
    r = run(cmd, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    scalars = read_scalars(str(tmp_path / "ppo"))
    assert "objective/reward_fn" in scalars and "objective/rm_score" not in scalars


# 2 iterations of 8 responses, 8 tokens at most, LoRA-free
TINY = dict(
    max_steps=2,
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=4,
    ptx_batch_size=4,
    max_new_tokens=8,
    critic_warmup_steps=1,
    warmup_steps=1,
    log_every=1,
)


@pytest.mark.slow
def test_ppo_with_an_ensemble_and_a_reference_of_its_own(tmp_path, task_dir, tiny_ckpts, tiny_rms):
    """--rm-ckpt a b (uwo) logs the members' spread and keeps both hashes; under LoRA the first member shares the
    critic's base and the second is a full model; --ref-ckpt sets the KL's reference apart from the policy's init
    (its first rollout's KL is then not 0) and a resume refuses a changed reference."""
    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out, task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_rms, rm_agg="uwo", lora_rank=2, **TINY
    )
    train_ppo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert len(ckpt["rm_hashes"]) == 2 and ckpt["args"]["rm_ckpt"] == tiny_rms
    assert read_scalars(out)["objective/score_std"][0] > 0
    # another reference: the tiny SFT policy moved a little is a policy of another seed
    other = str(tmp_path / "other_sft.pt")
    sft = torch.load(tiny_ckpts[0], weights_only=False)
    moved = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sft["model"].items()}
    checkpoints.save_checkpoint(sft | {"model": moved}, other)
    ref_out = str(tmp_path / "ref")
    ref_args = dict(sft_ckpt=tiny_ckpts[0], ref_ckpt=other, rm_ckpt=tiny_rms[:1])
    train_ppo.main(train_ppo.Args(out_dir=ref_out, task_dir=task_dir, **ref_args, **TINY))
    assert read_scalars(ref_out)["objective/kl"][0] != 0.0
    checkpoints.save_checkpoint(sft | {"model": moved, "seconds": 1.0}, other)
    with pytest.raises(common.UserError, match="--ref-ckpt changed since the run started"):
        train_ppo.main(train_ppo.Args(out_dir=ref_out, task_dir=task_dir, resume=True, max_steps=3))


@pytest.mark.slow
def test_ppo_two_ranks_torchrun(tmp_path, task_dir, tiny_ckpts):
    """train_ppo.py under torchrun with 2 CPU ranks (built-in task, ptx on, a tiny random SFT policy and RM) runs to the
    end: a checkpoint with both ranks' RNG states and finite metrics."""
    sft, rm = tiny_ckpts
    out = tmp_path / "ppo"
    cmd = (
        f"{TORCHRUN} train_ppo.py --task-dir "
        f"{task_dir} --sft-ckpt {sft} --rm-ckpt {rm} --out-dir {out} --max-steps 2 --rollout-batch-size 8 "
        "--num-minibatches 2 --micro-batch-size 2 --max-new-tokens 12 --critic-warmup-steps 1 --warmup-steps 1 "
        "--ptx-batch-size 4 --log-every 1 --sample-every 2 --collapse-window 2 --device cpu"
    )
    r = run(cmd, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt["kind"] == "ppo" and ckpt["step"] == 2 and ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    scalars = read_scalars(str(out))
    for tag in ("objective/score", "objective/kl", "objective/gold", "value/loss"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) for v in scalars[tag]), tag
    for tag in ("policy/loss", "ptx/loss"):  # the actor trains after the 1-iteration critic warm-up
        assert len(scalars[tag]) == 1 and math.isfinite(scalars[tag][0]), tag
    assert scalars["train/updates"][-1] == 2 * 2  # 2 iterations x 2 minibatches x 1 epoch


# -----------------------------------------------------------------------------
# reliability: a run killed at a random moment resumes exactly; a non-finite step is skipped and counted

PPO_FLAGS = (
    "--max-steps 12 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 "
    "--max-new-tokens 16 --critic-warmup-steps 2 --warmup-steps 2 --sample-every 1 --log-every 4 "
    "--kl-target 1.0 --kl-horizon 100 --collapse-window 3 --save-every 1"
)
# LoRA on actor and critic (the reference and the RM are their bases), the tied embedding adapter among them, with
# activation checkpointing
LORA_FLAGS = "--lora-rank 4 --lora-alpha 8 --lora-targets c_attn c_proj c_fc wte --grad-ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["", LORA_FLAGS], ids=["full", "lora"])
def test_ppo_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts, extra):
    sft, rm = tiny_ckpts
    base = f"{sys.executable} train_ppo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} {PPO_FLAGS} {extra}"
    run_here(f"{base} --out-dir {tmp_path}/full")
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=5)
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    keys = ("model", "critic")
    if extra == LORA_FLAGS:  # the adapters themselves, and the merged weights above
        keys += ("model_lora", "critic_lora")
    for key in keys:
        assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt", key)
    for key in ("reward_moments", "kl_ctl"):
        for k, v in full[key].items():
            assert abs(v - killed[key][k]) <= 1e-5 * max(1.0, abs(v)), (key, k)
    assert killed["data_state"]["updates"] == full["data_state"]["updates"] == 12 * 2
    assert full["data_state"]["prompts"] == killed["data_state"]["prompts"]
    assert full["data_state"]["ptx"] == killed["data_state"]["ptx"]
    assert full["data_state"]["collapse"] == killed["data_state"]["collapse"]
    # samples.jsonl: no duplicate lines, 8 per iteration, the very lines of the uninterrupted run
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 12 * 8
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()


def tiny_args(out_dir: str, task_dir: str, tiny_ckpts: tuple, **flags) -> train_ppo.Args:
    settings = dict(out_dir=out_dir, task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_ckpts[1])
    return train_ppo.Args(**(settings | TINY | {"log_every": 10} | flags))


@pytest.mark.slow
def test_ppo_kill_between_samples_and_save_leaves_no_duplicates(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    """A kill after an iteration's samples are appended but before its checkpoint: the resume drops them, redoes it."""

    class Killed(BaseException):
        pass

    real_save, calls = checkpoints.save_checkpoint, {"n": 0}

    def dying_save(obj, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Killed
        real_save(obj, path)

    monkeypatch.setattr(checkpoints, "save_checkpoint", dying_save)
    args = tiny_args(str(tmp_path), task_dir, tiny_ckpts, max_steps=4, sample_every=1, save_every=1)
    with pytest.raises(Killed):
        train_ppo.main(args)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 2
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "resume": True}))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")]
    assert steps == sorted(steps) and [steps.count(s) for s in (1, 2, 3, 4)] == [8, 8, 8, 8]


@pytest.mark.slow
def test_ppo_nan_step_is_skipped_and_the_run_finishes(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    """One NaN policy loss (monkeypatched) in a whole PPO run: that actor step is skipped and counted, the run ends
    normally; a NaN every time stops the run after 10 skipped optimizer steps in a row (the shared guard)."""
    real, calls = train_ppo.ppo_policy_loss, {"n": 0}

    def one_nan(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 3 else loss), stats

    monkeypatch.setattr(train_ppo, "ppo_policy_loss", one_nan)
    args = tiny_args(str(tmp_path / "one"), task_dir, tiny_ckpts, max_steps=3)
    train_ppo.main(args)
    ckpt = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3 and ckpt["data_state"]["skipped"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    calls["n"], always = -(10**9), lambda *a, **k: (lambda loss, st: (loss * float("nan"), st))(*real(*a, **k))
    monkeypatch.setattr(train_ppo, "ppo_policy_loss", always)
    with pytest.raises(RuntimeError, match="10 non-finite steps in a row"):
        train_ppo.main(train_ppo.Args(**{**args.__dict__, "out_dir": str(tmp_path / "all"), "max_steps": 20}))


# a run long enough that a SIGTERM sent after its first logged iteration lands mid-run; no --save-every: the only
# checkpoint before the end is the one the signal asks for
TERM_FLAGS = (
    "--max-steps 8 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 "
    "--max-new-tokens 8 --critic-warmup-steps 1 --warmup-steps 1 --log-every 1 --sample-every 1"
)


@pytest.mark.slow
def test_ppo_sigterm_saves_exits_143_and_resumes_exactly(tmp_path, task_dir, tiny_ckpts):
    """SIGTERM (a cluster's preemption, docs/design.md §8) sent to train_ppo.py after its first logged iteration: it
    finishes that iteration, saves it, prints one line with the command that continues it and exits 128 + 15; the rerun
    with --resume finishes, and its final actor and critic are bit-for-bit those of an uninterrupted run with the same
    flags (CPU, one thread: the stop is at an iteration boundary, like a --save-every checkpoint)."""
    sft, rm = tiny_ckpts
    base = f"{sys.executable} train_ppo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} {TERM_FLAGS}"
    run_here(f"{base} --out-dir {tmp_path}/full")
    out = tmp_path / "stopped"
    env = {**ENV, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            shlex.split(f"{base} --out-dir {out}"), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 00001/"):  # the first logged iteration
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=300)
    printed = "".join(lines)
    assert code == 128 + signal.SIGTERM, printed[-2000:] + (tmp_path / "stderr.txt").read_text()[-2000:]
    told = [line for line in lines if "--resume" in line]
    continued = common.resume_command(f"{out}/ckpt.pt", shlex.split(f"{base} --out-dir {out}")[1:])
    assert told == [f"stopped by SIGTERM with {out}/ckpt.pt saved; continue with: {continued}\n"], printed[-2000:]
    stopped_at = torch.load(out / "ckpt.pt", weights_only=False)["step"]
    assert 1 <= stopped_at < 8
    r = run(f"{base} --out-dir {out} --resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {out}/ckpt.pt at step {stopped_at}" in r.stdout
    full, resumed = (torch.load(path, weights_only=False) for path in (tmp_path / "full" / "ckpt.pt", out / "ckpt.pt"))
    assert full["step"] == resumed["step"] == 8
    for key in ("model", "critic"):
        differ = [name for name, tensor in full[key].items() if not torch.equal(tensor, resumed[key][name])]
        largest = max((full[key][n] - resumed[key][n]).abs().max().item() for n in full[key])
        assert not differ, (key, differ, largest)


def test_ppo_logs_episodes_as_iterations_times_the_rollout_batch(tmp_path, task_dir, tiny_ckpts):
    """train/episodes, the responses sampled so far (the x-axis against which --total-episodes budgets a run), is
    iterations x --rollout-batch-size at every logged step, and a resumed run continues the count from its
    checkpoint (data_state) instead of restarting it."""
    args = tiny_args(str(tmp_path), task_dir, tiny_ckpts, max_steps=2, rollout_batch_size=8)
    train_ppo.main(args)
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "max_steps": 3, "resume": True}))
    assert read_scalars(str(tmp_path))["train/episodes"] == [8.0, 16.0, 24.0]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["data_state"]["episodes"] == 24


def test_the_entropy_bonus_gradient_against_a_written_out_reference():
    """--entropy-coef c adds -c x the policy's (tempered) entropy a token, over the minibatch's token count as the
    policy loss: the gradient with it minus the one without equals -c x the gradient of that mean written out, and
    the logged entropy_bonus is the mean."""
    from contextlib import nullcontext

    from model import entropy_from_logits, response_forward

    actor, _, exp = fake_experience()
    token_count = exp["mask"].sum() + 3.0  # a minibatch's global count: more than this micro-batch's tokens
    grads, sums = {}, {}
    for coef in (0.0, 0.05):
        actor.zero_grad()
        args = train_ppo.Args(entropy_coef=coef, temperature=0.7)
        sums[coef], _ = train_ppo.actor_backward(
            actor, exp | {"loss_mask": exp["mask"]}, args, token_count, True, nullcontext()
        )
        grads[coef] = [p.grad.clone() for p in actor.parameters()]
    actor.zero_grad()
    logits, _ = response_forward(actor, exp["query"], exp["query_mask"], exp["response"], exp["mask"], 0.7)
    entropy = (entropy_from_logits(logits) * exp["mask"]).sum() / token_count
    (-0.05 * entropy).backward()
    assert sums[0.05]["entropy_bonus"].item() == pytest.approx(entropy.item(), rel=1e-6)
    assert "entropy_bonus" not in sums[0.0]
    for with_bonus, without, parameter in zip(grads[0.05], grads[0.0], actor.parameters()):
        assert torch.allclose(with_bonus - without, parameter.grad, atol=1e-6)
