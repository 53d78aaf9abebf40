"""train_ppo.py: every pure function against naive loops on random ragged batches (length-1 and full-length rows),
padding invariance, KL exactly 0 for policy == reference, the loss denominator under accumulation, reward moments
merged across ranks, the first minibatch's ratio, the collapse detector, and smoke runs of main()."""

import io
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import checkpoints
import common
import parallel
import train_ppo
from common import StepGuard, Trained
from model import GPT, GPTConfig, response_forward
from task import build_task
from train_ppo import (
    CollapseDetector,
    KLController,
    RunningMoments,
    compute_gae,
    compute_group_advantages,
    kl_loss,
    loss_weights,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    resolve_estimator_defaults,
    reward_to_go,
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
CKPT_KEYS = {
    "kind",
    "model",
    "model_config",
    "tokenizer",
    "args",
    "step",
    "optimizer",
    "scheduler",
    "rng",
    "data_state",
    "world_size",
    "seconds",
    "critic",
    "critic_optimizer",
    "critic_scheduler",
    "reward_moments",
    "kl_ctl",
    "sft_hash",
    "rm_hashes",
}


def ragged(B: int = 6, T: int = 7, seed: int = 0):
    """Random (B, T) tensors and a right-padded mask whose rows have lengths 1, T and random ones in between."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, T] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    x = [torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(5)]
    return lengths, mask, x


def valid(x, lengths):
    return [v for b, n in enumerate(lengths) for v in x[b, :n].tolist()]


# -----------------------------------------------------------------------------
# pure functions against naive loops


def test_masked_mean_and_whiten():
    lengths, mask, (x, *_) = ragged()
    vals = valid(x, lengths)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-12)
    w = masked_whiten(x, mask)
    assert valid(w, lengths) == pytest.approx([(v - mean) / math.sqrt(var + 1e-8) for v in vals], abs=1e-10)
    w = masked_whiten(x, mask, shift_mean=False)
    want = [(v - mean) / math.sqrt(var + 1e-8) + mean for v in vals]
    assert valid(w, lengths) == pytest.approx(want, abs=1e-10)
    w = masked_whiten(x, mask, mean=torch.tensor(0.5).double(), var=torch.tensor(4.0).double())  # global statistics
    assert valid(w, lengths) == pytest.approx([(v - 0.5) / math.sqrt(4.0 + 1e-8) for v in vals], abs=1e-10)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_shape_rewards(estimator):
    lengths, mask, (lp, ref, _, _, _) = ragged()
    scores = torch.randn(len(lengths), dtype=torch.float64)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.1, estimator)
    for b, n in enumerate(lengths):
        for t in range(mask.size(1)):
            if t >= n:
                assert rewards[b, t] == 0 and kl[b, t] == 0
                continue
            d = (lp[b, t] - ref[b, t]).item()
            want_kl = d if estimator == "k1" else (math.exp(-d) - 1) + d
            assert kl[b, t].item() == pytest.approx(want_kl, abs=1e-12)
            want = -0.1 * want_kl + (scores[b].item() if t == n - 1 else 0.0)  # the score lands on the EOS
            assert rewards[b, t].item() == pytest.approx(want, abs=1e-12)
    assert (kl * mask >= -1e-15).all() or estimator == "k1"


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


def test_ppo_policy_loss_with_the_new_flags_off_is_todays_loss():
    """token_mean with denom (the training loop's path) and every §5b argument None or at its default: the PPO-max
    loss bit for bit, computed here as it was before the flags existed."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=8, seed=5)
    lp = old + 0.3 * lp
    denom = mask.sum() + 3.0  # a global count larger than this micro-batch's
    ratio = torch.exp(lp - old)
    today = (torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2)) * mask).sum() / denom
    for extra in ({}, {"weights": None, "cliprange_high": None, "dual_clip": None}, {"cliprange_high": 0.2}):
        loss, _ = ppo_policy_loss(lp, old, adv, mask, 0.2, denom=denom, **extra)
        assert torch.equal(loss, today), extra


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_ppo_policy_loss_clip_higher_dual_clip_and_weights(dual_clip):
    lengths, mask, (lp, old, adv, _, _) = ragged(B=10, seed=6)
    lp = old + 0.5 * lp
    eps, eps_high = 0.2, 0.28
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    loss, stats = ppo_policy_loss(
        lp, old, adv, mask, eps, denom=denom, weights=weights, cliprange_high=eps_high, dual_clip=dual_clip
    )
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


@pytest.mark.parametrize("group_size", [2, 3])
def test_compute_group_advantages(group_size):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4 * group_size, generator=g, dtype=torch.float64)
    scores[:group_size] = 0.5  # a group of ties: zero advantage, no division by 0
    got = {
        "rloo": compute_group_advantages(scores, group_size, "rloo"),
        "grpo": compute_group_advantages(scores, group_size, "grpo"),
        "dr_grpo": compute_group_advantages(scores, group_size, "grpo", std_norm=False),
        "reinforce_pp": compute_group_advantages(scores, group_size, "reinforce_pp"),
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
    assert train_ppo.informative_groups(first["scores"], 2).tolist() == [False, True, False]
    kept = train_ppo.keep_informative_groups([first, second], 2, 6, pad_id=-7)
    assert kept["scores"].tolist() == [0.0, 2.0, 3.0, 1.0, 2.0, 0.0] and kept["informative"].tolist() == [1.0] * 6
    assert kept["query"].shape == (6, 3) and kept["response"].shape == (6, 5)
    assert kept["query"][2].tolist() == [-7, 2 * 2, 2 * 2 + 1] and kept["query_mask"][2].tolist() == [0, 1, 1]
    assert kept["response"][0].tolist() == [2 * 4 + 100 + t for t in range(4)] + [-7] and kept["mask"][0, 4] == 0
    short = train_ppo.keep_informative_groups([first], 2, 6, pad_id=-7)  # one informative group: the ties fill
    assert short["scores"].tolist() == [0.0, 2.0, 1.0, 1.0, -1.0, -1.0]
    assert short["informative"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_to_go():
    lengths, mask, (rewards, *_) = ragged()
    gamma = 0.9
    got = reward_to_go(rewards, mask, gamma)
    for b, n in enumerate(lengths):
        for t in range(n):
            want = sum(gamma ** (k - t) * rewards[b, k].item() for k in range(t, n))
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
        assert (got[b, n:] == 0).all()


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


def test_kl_loss_value_and_gradient():
    lengths, mask, (lp, ref, *_) = ragged()
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    logprobs = lp.clone().requires_grad_(True)
    loss = kl_loss(logprobs, ref, mask, weights, denom, 0.05)
    want = 0.0
    for b, n in enumerate(lengths):
        for t in range(n):
            d = ref[b, t].item() - lp[b, t].item()
            want += 0.05 * (math.exp(d) - 1 - d) * weights[b, t].item() / denom
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()  # d k3 / d logp = 1 - ref_p / p: pulls the policy towards the reference, 0 on padding
    assert torch.allclose(logprobs.grad, 0.05 * weights / denom * (1 - torch.exp(ref - lp)), atol=1e-12)


def test_kl_estimators_are_masked_before_the_exponential():
    """Padding may hold any log-prob (a pad target's log-prob under the current policy is not masked): at -1000 on the
    policy side and 0 on the reference side, exp(ref - logp) alone would be inf and inf * 0 a NaN; the KL loss, its
    gradient, the reward penalty and the policy loss stay finite and equal the unpadded values."""
    lengths, mask, (lp, ref, adv, *_) = ragged(seed=4)
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    weights, denom = loss_weights(mask, "token_mean", len(lengths), mask.sum(), 7)
    logprobs = extreme.clone().requires_grad_(True)
    loss = kl_loss(logprobs, ref * mask, mask, weights, denom, 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and (logprobs.grad[mask == 0] == 0).all()
    assert loss.item() == pytest.approx(kl_loss(lp, ref * mask, mask, weights, denom, 0.1).item(), abs=1e-12)
    for estimator in ("k1", "k3"):
        rewards, kl = shape_rewards(torch.ones(len(lengths)), extreme, ref * mask, mask, 0.1, estimator)
        assert torch.isfinite(rewards).all() and torch.isfinite(kl).all() and (kl[mask == 0] == 0).all()
    pg_loss, stats = ppo_policy_loss(extreme, lp * mask, adv, mask, 0.2)
    assert torch.isfinite(pg_loss) and all(torch.isfinite(value) for value in stats.values())


def test_resolve_estimator_defaults():
    gae = resolve_estimator_defaults(train_ppo.Args())
    assert (gae.group_size, gae.kl_penalty, gae.kl_coef, gae.reward_norm, gae.reward_clip) == (
        1,
        "reward",
        0.3,
        "norm",
        5.0,
    )
    assert (gae.adv_whiten, gae.loss_agg, gae.critic_warmup_steps) == ("minibatch", "token_mean", 5)
    grpo = resolve_estimator_defaults(train_ppo.Args(adv_estimator="grpo"))
    assert (grpo.group_size, grpo.kl_penalty, grpo.reward_norm, grpo.reward_clip) == (4, "loss", "none", None)
    assert (grpo.adv_whiten, grpo.loss_agg, grpo.critic_warmup_steps) == ("none", "seq_mean", 0)
    assert resolve_estimator_defaults(grpo) == grpo  # idempotent
    given = resolve_estimator_defaults(train_ppo.Args(adv_estimator="rloo", group_size=8, reward_norm="scale"))
    assert (given.group_size, given.reward_norm, given.reward_clip, given.kl_penalty) == (8, "scale", 5.0, "reward")
    rpp = resolve_estimator_defaults(train_ppo.Args(adv_estimator="reinforce_pp"))
    assert (rpp.adv_whiten, rpp.reward_norm, rpp.reward_clip, rpp.group_size) == ("rollout", "norm", 5.0, 1)


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


def test_running_moments_merge_equals_big_batch():
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


def fake_experience(B: int = 8, seed: int = 0):
    """A tiny actor and critic and an experience dict with ragged responses (no tokenizer needed)."""
    torch.manual_seed(seed)
    cfg = dict(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=16)
    actor, critic = GPT(GPTConfig(**cfg)).eval(), GPT(GPTConfig(**cfg, lm_head=False, score_head=True)).eval()
    q_len, r_len = torch.randint(1, 5, (B,)), torch.randint(1, 7, (B,))
    q_len[0], r_len[0], r_len[1] = 4, 6, 1  # a full-width prompt, a full-length and a length-1 response
    query_mask = (torch.arange(4) >= 4 - q_len[:, None]).float()
    mask = (torch.arange(6) < r_len[:, None]).float()
    query = torch.randint(0, 50, (B, 4)).masked_fill(query_mask == 0, 50)
    response = torch.randint(0, 50, (B, 6)).masked_fill(mask == 0, 50)
    with torch.no_grad():
        logits, _ = response_forward(actor, query, query_mask, response, mask, 1.0)
        _, values = response_forward(critic, query, query_mask, response, mask, 1.0)
    exp = dict(
        query=query,
        query_mask=query_mask,
        response=response,
        mask=mask,
        values=values * mask,
        logprobs=train_ppo.logprobs_from_logits(logits, response) * mask,
        advantages=torch.randn(B, 6) * mask,
        returns=torch.randn(B, 6) * mask,
    )
    return actor, critic, exp


def entries(actor, critic, grad_clip: float = 0.5, lr: float = 1e-2):
    """ppo_update's Trained entries for an actor and a critic (None: critic-free), AdamW at lr."""
    actor_entry = Trained("model", actor, torch.optim.AdamW(actor.parameters(), lr=lr), grad_clip=grad_clip)
    if critic is None:
        return actor_entry, None
    return actor_entry, Trained("critic", critic, torch.optim.AdamW(critic.parameters(), lr=lr), grad_clip=grad_clip)


def update_once(actor, critic, exp, micro_batch_size, **settings):
    """One PPO update over exp (one epoch, one minibatch) -> metrics | diagnostics. critic None: critic-free."""
    args = train_ppo.Args(ppo_epochs=1, num_minibatches=1, temperature=1.0, **settings)
    metrics, diagnostics = train_ppo.ppo_update(
        *entries(actor, critic),
        StepGuard(),
        exp,
        train_ppo.resolve_args(args),
        micro_batch_size=micro_batch_size,
        generator=torch.Generator().manual_seed(0),
        loss_kl_coef=0.1,
    )
    return metrics | diagnostics


# a critic-free estimator with the §5b flags on: per-sequence aggregation, KL in the loss, clip-higher, dual-clip,
# overlong filtering
CRITIC_FREE = dict(adv_estimator="grpo", cliprange_high=0.28, dual_clip=2.0, mask_truncated=True)


def critic_free_experience(exp: dict) -> dict:
    """exp plus what a critic-free update reads: reference log-probs and which responses ended (rows 2 and 5 not)."""
    g = torch.Generator().manual_seed(1)
    ref_logprobs = (exp["logprobs"] + 0.3 * torch.randn(exp["mask"].shape, generator=g)) * exp["mask"]
    ended = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    return exp | {"ref_logprobs": ref_logprobs, "ended": ended}


@pytest.mark.parametrize("whiten", ["minibatch", "rollout"])
def test_dropped_responses_never_move_the_whitening(whiten):
    """--mask-truncated drops the responses without EOS from the policy loss; the advantage whitening (PPO-max's per
    minibatch, and the rollout one) takes its statistics from the same tokens, so the dropped rows' advantages, here
    scaled 100-fold, leave the update unchanged."""
    weights = []
    for scale in (1.0, 100.0):
        actor, _, exp = fake_experience()
        exp = critic_free_experience(exp)  # rows 2 and 5 end without EOS
        exp["advantages"] = exp["advantages"] * torch.where(exp["ended"] == 0, scale, 1.0)[:, None]
        update_once(actor, None, exp, 4, adv_estimator="reinforce_pp", mask_truncated=True, adv_whiten=whiten)
        weights.append(actor.state_dict())
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-6), name


def _two_rank_worker(rank: int, port: int, q, wrap: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d = parallel.Dist(rank, rank, 2, torch.device("cpu"), True)

    def wrapped(model):  # DDP replicates (as the stages do), FSDP2 shards (blocks, then the root) as --fsdp does
        return parallel.replicate(model, d) if wrap == "ddp" else parallel.shard_model(model, d, torch.float32)

    def full_state(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    # reward moments: rank 0 sees 7 then 12 scores, rank 1 sees 3 then 1
    torch.manual_seed(0)
    data = [torch.randn(n, dtype=torch.float64) for n in (7, 3, 12, 1)]
    moments = RunningMoments()
    moments.update(data[rank])
    moments.update(data[2 + rank])
    # one PPO update on this rank's half of the experience
    actor, critic, exp = fake_experience()
    stats = update_once(wrapped(actor), wrapped(critic), {k: v[rank * 4 : (rank + 1) * 4] for k, v in exp.items()}, 2)
    # a critic-free update on this rank's half: sequence counts and lengths of the seq_mean weights are global
    free_actor, _, free_exp = fake_experience()
    free_exp = critic_free_experience(free_exp)
    free_half = {k: v[rank * 4 : (rank + 1) * 4] for k, v in free_exp.items()}
    free_stats = update_once(wrapped(free_actor), None, free_half, 2, **CRITIC_FREE)
    buf = io.BytesIO()  # plain bytes: tensors through a queue would need the worker alive to be received
    results = (moments.state_dict(), stats, full_state(actor), full_state(critic))
    torch.save(results + (free_stats, full_state(free_actor)), buf)
    q.put(buf.getvalue())
    dist.destroy_process_group()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_gloo_ranks_equal_one_big_batch(wrap):
    """Reward moments merged across 2 ranks equal one big batch; the same global minibatch split over 2 ranks x 2
    micro-batches gives the 1-rank update (weights, losses, clip fractions, grad norms), for gae and for a critic-free
    estimator with the §5b flags on; under DDP and under FSDP2 (--fsdp)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, q, wrap)) for r in range(2)]
    for p in procs:
        p.start()
    results = [torch.load(io.BytesIO(q.get()), weights_only=False) for _ in range(2)]  # read before join: big pickles
    for p in procs:
        p.join(60)
    torch.manual_seed(0)
    big = torch.cat([torch.randn(n, dtype=torch.float64) for n in (7, 3, 12, 1)])
    actor, critic, exp = fake_experience()
    want = update_once(actor, critic, exp, micro_batch_size=4)
    free_actor, _, free_exp = fake_experience()
    free_want = update_once(free_actor, None, critic_free_experience(free_exp), 4, **CRITIC_FREE)
    assert "value/loss" not in free_want and free_want["updates"] == 1
    for moments, stats, actor_sd, critic_sd, free_stats, free_actor_sd in results:
        for k in ("policy/loss", "policy/kl_loss", "policy/approx_kl", "policy/clipfrac_low", "train/grad_norm"):
            assert free_stats[k] == pytest.approx(free_want[k], rel=1e-4, abs=1e-6), k
        for k, v in free_actor.state_dict().items():
            assert torch.allclose(free_actor_sd[k], v, atol=1e-5), k
        rm = RunningMoments()
        rm.load_state_dict(moments)
        assert rm.count == 23 and rm.mean == pytest.approx(big.mean().item(), abs=1e-12)
        assert rm.std == pytest.approx(big.std(correction=0).item(), abs=1e-12)
        for k in (
            "policy/loss",
            "value/loss",
            "policy/approx_kl",
            "policy/clipfrac",
            "value/clipfrac",
            "train/grad_norm",
            "value/grad_norm",
        ):
            assert stats[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
        for mine, ref in ((actor_sd, actor.state_dict()), (critic_sd, critic.state_dict())):
            for k in ref:
                assert torch.allclose(mine[k], ref[k], atol=1e-5), k


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

    def run(jump_at=None, length_jump=True):
        det, alarms = CollapseDetector(), []  # the defaults
        for t in range(80):
            kl, length, ppl = 0.05 * t + 0.02 * noise(), 20 + 0.5 * noise(), 3 - 0.002 * t + 0.01 * noise()
            if jump_at is not None and t >= jump_at:
                kl += 5.0
                if length_jump and t >= jump_at + 2:
                    length += 15.0
            alarms.append(det.update(kl, length, ppl))
        return alarms

    assert not any(run())  # a smooth trend with noise: no alarm
    alarms = run(jump_at=50)
    assert not any(alarms[:50]) and alarms[52]  # KL jumps at 50, length at 52: fires at 52
    assert not any(run(jump_at=50, length_jump=False))  # KL alone is not the collapse signature
    # the first rise from KL = 0 once the actor moves (iterations 6-16 of a PPO-max run, seed 1) is not a collapse
    kl = [0.0, 0.029, 0.046, 0.030, 0.249, 0.428, 0.833, 3.215, 3.390, 4.154, 2.876]
    length = [14.3, 15.4, 14.9, 14.5, 14.7, 18.7, 18.3, 21.3, 21.8, 22.2, 21.1]
    ppl = [2.533, 2.508, 2.587, 2.571, 2.452, 2.490, 2.417, 2.362, 2.395, 2.286, 2.179]
    det = CollapseDetector()
    assert not any(det.update(*x) for x in zip(kl, length, ppl))


# -----------------------------------------------------------------------------
# models: padding, KL = 0, the first minibatch


@pytest.fixture(scope="module")
def tok(task_dir):
    from data import load_tokenizer

    return load_tokenizer(build_task(task_dir, 1337)["tokenizer"])


def tiny(tok, seed: int, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, **kw)).eval()


def test_padding_never_changes_logprobs_or_values(tok):
    from data import pad_left, pad_right

    actor, critic = tiny(tok, 0), tiny(tok, 1, lm_head=False, score_head=True)
    queries = [tok.encode("Review of The Silent River (music):"), tok.encode("Review of")]
    responses = [tok.encode(" the plot was good.") + [tok.eos_id], tok.encode(" i")]
    q, qm = pad_left(queries, tok.pad_id)
    r, rm = pad_right(responses, tok.pad_id)
    r = torch.cat([r, torch.full((2, 3), tok.pad_id)], 1)  # extra right padding
    rm = torch.cat([rm, torch.zeros(2, 3)], 1)
    logits, _ = response_forward(actor, q, qm, r, rm, 0.7)
    _, values = response_forward(critic, q, qm, r, rm, 0.7)
    lp = train_ppo.logprobs_from_logits(logits, r)
    with torch.no_grad():  # the lm head on the response positions only: the full forward's logits there
        full = actor(torch.cat([q, r], 1), torch.cat([qm, rm], 1))[0][:, q.size(1) - 1 : -1] / 0.7
    assert logits.shape == full.shape and torch.allclose(logits, full, atol=1e-5)
    for b in range(2):
        n = len(responses[b])
        q1, r1 = torch.tensor([queries[b]]), torch.tensor([responses[b]])
        l1, _ = response_forward(actor, q1, torch.ones_like(q1), r1, torch.ones_like(r1), 0.7)
        _, v1 = response_forward(critic, q1, torch.ones_like(q1), r1, torch.ones_like(r1), 0.7)
        assert torch.allclose(lp[b, :n], train_ppo.logprobs_from_logits(l1, r1)[0], atol=1e-5)
        assert torch.allclose(values[b, :n], v1[0], atol=1e-5)


def rollout_kwargs(reward_fn=None, **settings):
    """rollout()'s arguments after the prompts: Args (settings overridden by keyword) and the run's state."""
    defaults = dict(max_new_tokens=12, temperature=0.9, missing_eos_penalty=-3.0, gamma=1.0, lam=0.95)
    return dict(
        args=train_ppo.resolve_args(train_ppo.Args(**(defaults | settings))),
        micro_batch_size=4,
        generator=torch.Generator().manual_seed(0),
        reward_kl_coef=0.1,
        reward_moments=RunningMoments(),
        reward_fn=reward_fn,
    )


def boost_eos(model: GPT, eos_id: int, amount: float = 3.0) -> GPT:
    with torch.no_grad():
        w = model.transformer.wte.weight[eos_id]
        model.transformer.ln_f.bias += amount * w / w.norm() ** 2
    return model


def test_rollout_kl_zero_score_on_eos_and_first_minibatch(tok):
    actor = boost_eos(tiny(tok, 0), tok.eos_id)  # some rows end with EOS within 12 tokens, some do not
    ref = GPT(actor.config).eval()
    ref.load_state_dict(actor.state_dict())
    critic, rm = tiny(tok, 1, lm_head=False, score_head=True), tiny(tok, 2, score_head=True)
    prompts = [f"Review of The Silent River ({a}):" for a in ("plot", "music", "acting, ending")] + ["Review of"] * 5
    exp, stats, samples = train_ppo.rollout(
        train_ppo.Models(actor, ref, critic, [rm]),
        tok,
        prompts,
        **rollout_kwargs(
            reward_fn=lambda p, r, e: len(r) / 10, reward_fn_coef=0.5, reward_norm="none", reward_clip=None
        ),
    )
    assert stats["objective/kl"] == 0.0 and (exp["logprobs"] == exp["ref_logprobs"]).all()  # exactly, not approx
    mask, P = exp["mask"], exp["query"].size(1)
    ended = torch.tensor([s["ended"] for s in samples])
    assert 0 < ended.sum() < len(prompts), "want rows with and without EOS"
    last = mask.sum(1).long() - 1
    for b in range(len(prompts)):
        n = int(last[b]) + 1
        assert (exp["response"][b, n - 1] == tok.eos_id) == bool(ended[b])
        if ended[b]:  # the RM's score of the unpadded sequence at its EOS, + coef * reward_fn
            ids = torch.cat([exp["query"][b][exp["query_mask"][b].bool()], exp["response"][b, :n]])[None]
            want = rm(ids)[1][0, -1].item() + 0.5 * len(samples[b]["response"]) / 10
            assert exp["scores"][b].item() == pytest.approx(want, abs=1e-5)
        else:
            assert exp["scores"][b].item() == -3.0
        # the reward is the score on the EOS token only (KL = 0)
        assert exp["rewards"][b, n - 1].item() == pytest.approx(exp["scores"][b].item(), abs=1e-6)
        assert (exp["rewards"][b, : n - 1] == 0).all() and (exp["rewards"][b, n:] == 0).all()
    assert P == max(len(tok.encode(p)) for p in prompts)
    # the first minibatch of an update: ratio 1, approx_kl 0, clipfrac 0 (training shapes differ from scoring)
    args = train_ppo.Args(ppo_epochs=2, num_minibatches=2, cliprange=0.2, cliprange_value=0.2, temperature=0.9)
    metrics, diagnostics = train_ppo.ppo_update(
        *entries(actor, critic, grad_clip=1.0),
        StepGuard(),
        exp,
        train_ppo.resolve_args(args),
        micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )
    first = diagnostics["first"]
    assert first["ratio_err"] <= 1e-5 and abs(first["approx_kl"]) <= 1e-5 and first["clipfrac"] == 0
    assert diagnostics["updates"] == 4 and metrics["policy/approx_kl"] > 0  # later minibatches moved


def test_rollout_raises_on_logprob_mismatch(tok, monkeypatch):
    actor, critic = tiny(tok, 0), tiny(tok, 1, lm_head=False, score_head=True)
    gen = actor.generate

    def bad_generate(*a, **kw):
        r, m, lp = gen(*a, **kw)
        return r, m, lp + 1e-3 * m

    monkeypatch.setattr(actor, "generate", bad_generate)
    with pytest.raises(RuntimeError, match="generation log-probs differ"):
        train_ppo.rollout(
            train_ppo.Models(actor, actor, critic, []),
            tok,
            ["Review of"] * 4,
            **rollout_kwargs(reward_fn=lambda p, r, e: 0.0),
        )


# -----------------------------------------------------------------------------
# smoke runs of main()


def read_scalars(out_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(out_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]} | {
        "_text": acc.Tags()["tensors"]
    }


TINY_PPO = dict(
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=2,
    ppo_epochs=2,
    max_new_tokens=24,
    critic_warmup_steps=1,
    warmup_steps=1,
    log_every=1,
    sample_every=2,
    collapse_window=2,
)


@pytest.fixture(scope="module")
def sft_ckpt(tmp_path_factory, task_dir):
    import train_sft

    out = str(tmp_path_factory.mktemp("sft"))
    train_sft.main(
        train_sft.Args(
            out_dir=out,
            task_dir=task_dir,
            n_layer=1,
            n_head=2,
            n_embd=32,
            batch_size=8,
            micro_batch_size=8,
            max_steps=5,
            eval_every=5,
            num_samples=8,
            eval_samples=8,
            warmup_steps=1,
            max_new_tokens=16,
        )
    )
    return os.path.join(out, "ckpt.pt")


def test_ppo_smoke_gold_reward(tmp_path, task_dir, sft_ckpt):
    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=sft_ckpt,
        rm_ckpt="none",
        reward_fn="data:gold_reward",
        max_steps=3,
        **TINY_PPO,
    )
    train_ppo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "ppo" and ckpt["step"] == 3 and ckpt["rm_hashes"] == []
    assert len(ckpt["sft_hash"]) == 64
    policy, critic = GPT.from_checkpoint(ckpt), GPT.from_checkpoint(ckpt, key="critic")
    assert policy.config.lm_head and critic.config.score_head and not critic.config.lm_head
    scalars = read_scalars(out)
    for tag in PPO_TAGS:  # the actor's own tags start after the critic warm-up (1 of the 3 iterations)
        logged = 2 if tag in ACTOR_TAGS else 3
        assert tag in scalars and len(scalars[tag]) == logged and all(math.isfinite(v) for v in scalars[tag]), tag
    assert "samples/text_summary" in scalars["_text"]
    assert scalars["train/updates"][-1] == 3 * 2 * 2
    assert os.path.getsize(os.path.join(out, "samples.jsonl")) > 0
    # --resume continues from the checkpoint
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 4


CRITIC_KEYS = {"critic", "critic_config", "critic_optimizer", "critic_scheduler"}
VALUE_TAGS = {"value/loss", "value/clipfrac", "value/explained_variance", "value/grad_norm", "train/critic_lr"}


@pytest.mark.parametrize(
    "estimator, flags",
    [
        ("grpo", dict(cliprange_high=0.28, dual_clip=3.0)),
        ("rloo", dict(loss_agg="seq_sum_norm", kl_penalty="loss", mask_truncated=True, dynamic_sampling=True)),
        ("reinforce_pp", dict(group_size=2)),
    ],
)
def test_ppo_smoke_critic_free(tmp_path, task_dir, sft_ckpt, estimator, flags):
    """A critic-free estimator on the gold reward: no critic built or saved, the actor trains from iteration 1, the
    §5b metrics are logged and finite, no value metric; --resume works without critic keys. The tiny SFT policy
    hardly ever ends a response: under --mask-truncated most steps have nothing to train on and take no actor step
    (never a NaN)."""
    out = str(tmp_path / estimator)
    args = train_ppo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=sft_ckpt,
        rm_ckpt="none",
        reward_fn="data:gold_reward",
        adv_estimator=estimator,
        max_steps=3,
        **TINY_PPO,
        **flags,
    )
    train_ppo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert (CKPT_KEYS - CRITIC_KEYS) <= set(ckpt) and not (CRITIC_KEYS & set(ckpt)) and ckpt["step"] == 3
    assert ckpt["args"]["group_size"] == (args.group_size or 4)  # the resolved settings are saved
    assert ckpt["args"]["critic_warmup_steps"] == 0
    scalars = read_scalars(out)
    actor_tags = ACTOR_TAGS | {"policy/clipfrac_low", "policy/clipfrac_high"}
    if train_ppo.resolve_args(args).kl_penalty == "loss":
        actor_tags.add("policy/kl_loss")
    tags = (set(PPO_TAGS) - VALUE_TAGS) | actor_tags
    if args.mask_truncated:
        tags.add("rollout/truncated_frac")
    if args.dynamic_sampling:
        tags |= {"rollout/zero_std_frac", "rollout/sample_rounds"}
    for tag in tags:  # every iteration, the actor's included: no critic warm-up
        logged = scalars.get(tag, [])
        assert all(math.isfinite(v) for v in logged), tag
        assert len(logged) == 3 or (args.mask_truncated and tag in actor_tags), tag
    assert not (VALUE_TAGS & set(scalars))
    updates = scalars["train/updates"][-1]
    assert updates == 3 * 2 * 2 or (args.mask_truncated and updates < 3 * 2 * 2)
    if args.dynamic_sampling:  # groups of ties (no response ends: every score is the penalty) ask for more rounds
        zero_std = scalars["rollout/zero_std_frac"]
        want_rounds = [args.max_sample_rounds if z == 1.0 else 1.0 for z in zero_std]
        assert all(rounds >= 1 for rounds in scalars["rollout/sample_rounds"])
        assert scalars["rollout/sample_rounds"] == want_rounds or min(zero_std) < 1.0
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 4


def test_ppo_smoke_with_reward_model(tmp_path, task_dir, sft_ckpt):
    """An RM checkpoint (here an SFT trunk with a fresh score head, kind "rm") scores responses and starts the critic;
    an RM with another tokenizer is refused with one line."""
    import common

    sft = torch.load(sft_ckpt, weights_only=False)
    rm_model = GPT(GPTConfig(**{**sft["model_config"], "score_head": True}))
    rm_path = str(tmp_path / "rm.pt")
    checkpoints.save_checkpoint(sft | {"kind": "rm", "model": rm_model.state_dict(), "score_offset": 0.0}, rm_path)
    out = str(tmp_path / "ppo")
    train_ppo.main(
        train_ppo.Args(out_dir=out, task_dir=task_dir, sft_ckpt=sft_ckpt, rm_ckpt=rm_path, max_steps=2, **TINY_PPO)
    )
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert len(ckpt["rm_hashes"]) == 1 and "objective/gold" in read_scalars(out)
    bad_path = str(tmp_path / "rm_bad.pt")
    checkpoints.save_checkpoint(
        torch.load(rm_path, weights_only=False) | {"tokenizer": {**sft["tokenizer"], "name": "x"}}, bad_path
    )
    fresh = str(tmp_path / "ppo_fresh")  # mistakes of a new run
    with pytest.raises(common.UserError, match="tokenizer differs"):
        train_ppo.main(train_ppo.Args(out_dir=fresh, task_dir=task_dir, sft_ckpt=sft_ckpt, rm_ckpt=bad_path))
    with pytest.raises(common.UserError, match="needs --reward-fn"):
        train_ppo.main(train_ppo.Args(out_dir=fresh, task_dir=task_dir, sft_ckpt=sft_ckpt, rm_ckpt="none"))
    with pytest.raises(common.UserError, match="--reward-fn data:nope"):
        train_ppo.main(
            train_ppo.Args(out_dir=fresh, task_dir=task_dir, sft_ckpt=sft_ckpt, rm_ckpt="none", reward_fn="data:nope")
        )


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
    stats = update_once(actor, critic, exp, micro_batch_size=4)
    assert stats["skipped"] == 1 and all(torch.equal(v, before[k]) for k, v in actor.state_dict().items())
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
    stats = update_once(actor, critic, exp, micro_batch_size=4)
    assert stats["skipped"] == 1 and stats["updates"] == 0
    assert "value/loss" not in stats and "value/grad_norm" not in stats and "policy/loss" not in stats


def test_stop_on_collapse_keeps_the_checkpoint_before_the_alarm(tmp_path, task_dir, sft_ckpt, monkeypatch):
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
            sft_ckpt=sft_ckpt,
            rm_ckpt="none",
            reward_fn="data:gold_reward",
            max_steps=4,
            save_every=1,
            stop_on_collapse=True,
            **{**TINY_PPO, "critic_warmup_steps": 0},
        )
    )
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 1
    assert read_scalars(out)["collapse/alarm"] == [0.0, 1.0]


# -----------------------------------------------------------------------------
# defects of the review pass, each with the test that failed before its fix


def test_normalize_scores_with_a_zero_std():
    """Every score seen so far equal (all responses missing EOS): no scale to divide by, so scale/norm leave the
    scores finite (s and 0), never s / 1e-8 = -1e8 with --reward-clip None."""
    scores = torch.full((4,), -1.0)
    moments = RunningMoments()
    moments.update(scores)
    assert moments.std == 0.0
    scaled = train_ppo.normalize_scores(scores, moments.mean, moments.std, "scale", None)
    assert torch.equal(scaled, scores)
    centred = train_ppo.normalize_scores(scores, moments.mean, moments.std, "norm", None)
    assert torch.equal(centred, torch.zeros(4))
    # a real spread: the PPO-max formulas, then the clip
    scores = torch.tensor([0.0, 1.0, 2.0, 30.0])
    want = (scores - 1.5) / (2.0 + 1e-8)
    assert torch.allclose(train_ppo.normalize_scores(scores, 1.5, 2.0, "norm", None), want)
    assert torch.allclose(train_ppo.normalize_scores(scores, 1.5, 2.0, "scale", 5.0), (scores / 2.0).clamp(-5, 5))
    assert torch.equal(train_ppo.normalize_scores(scores, 1.5, 2.0, "none", None), scores)


def _logprob_check_worker(rank: int, port: int, tokenizer_state: dict, queue) -> None:
    """Rank 0's sampler disagrees with its training forward, rank 1's agrees: both must raise, none may hang."""
    import torch.distributed as dist

    from data import Tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = Tokenizer.from_state(tokenizer_state)
    actor, critic = tiny(tok, 0), tiny(tok, 1, lm_head=False, score_head=True)
    if rank == 0:
        generate = actor.generate

        def bad_generate(*args, **kwargs):
            response, mask, logprobs = generate(*args, **kwargs)
            return response, mask, logprobs + 1e-3 * mask

        actor.generate = bad_generate
    kwargs = rollout_kwargs(reward_fn=lambda prompt, response, ended: 0.0)
    try:
        train_ppo.rollout(train_ppo.Models(actor, actor, critic, []), tok, ["Review of"] * 4, **kwargs)
        queue.put((rank, "no error"))
    except RuntimeError as error:
        queue.put((rank, str(error)))
    dist.destroy_process_group()


def test_logprob_check_raises_on_every_rank(tok):
    """The generation-vs-training log-prob check reduces its error (max) across ranks before deciding."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_logprob_check_worker, args=(r, port, tok.state(), queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), "a rank hung or crashed"
    results = dict(queue.get() for _ in range(2))
    assert all("generation log-probs differ" in results[rank] for rank in (0, 1)), results


def test_fresh_critic_head_follows_the_seed(tmp_path, task_dir, sft_ckpt):
    """--rm-ckpt none: the critic's fresh head is built after seeding, so --seed decides it (and only --seed)."""
    heads = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = str(tmp_path / name)
        args = train_ppo.Args(
            out_dir=out,
            task_dir=task_dir,
            sft_ckpt=sft_ckpt,
            rm_ckpt="none",
            reward_fn="data:gold_reward",
            seed=seed,
            max_steps=1,
            **{**TINY_PPO, "critic_warmup_steps": 1, "critic_lr": 0.0},
        )
        train_ppo.main(args)
        heads[name] = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["critic"]["score_head.weight"]
    assert torch.equal(heads["a"], heads["b"]) and not torch.equal(heads["a"], heads["c"])


def test_iteration_flops_against_a_hand_count():
    """perf/mfu's FLOP count of one iteration on a tiny config, counted by hand: per token a training pass is 6N
    plus 12*L*H*Q*T of attention (PaLM), a forward a third of it."""
    config = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16)
    actor = GPT(GPTConfig(**config))
    critic = GPT(GPTConfig(**config, lm_head=False, score_head=True))
    reward_model = GPT(GPTConfig(**config, score_head=True))
    block = 12 * 16 * 16 + 9 * 16  # attention (qkv, proj) and MLP (fc, proj) weights plus their biases, per layer
    block += 4 * 16  # two layer norms
    trunk = 2 * block + 2 * 16  # blocks and ln_f (position embeddings are not counted)
    actor_n = trunk + 50 * 16  # the LM head (tied to wte) runs a matmul per token
    critic_n = trunk + 16 + 1  # the scalar head
    seq_len, sequences, epochs = 20, 8, 3
    attention = 12 * 2 * 2 * 8 * seq_len
    actor_per_token = 6 * actor_n + attention
    critic_per_token = 6 * critic_n + attention
    rollout = (3 * actor_per_token + 2 * critic_per_token) / 3  # generation, old, ref; values, RM score
    update = epochs * (actor_per_token + critic_per_token)
    want = sequences * seq_len * (rollout + update)
    assert actor.flops_per_token(seq_len) == actor_per_token
    models = train_ppo.Models(actor, actor, critic, [reward_model])
    got = train_ppo.iteration_flops(models, seq_len, sequences, epochs)
    assert got == pytest.approx(want, rel=1e-12)
    # --rm-ckpt none: no RM forward
    without_rm = train_ppo.iteration_flops(train_ppo.Models(actor, actor, critic, []), seq_len, sequences, epochs)
    assert want - without_rm == pytest.approx(sequences * seq_len * critic_per_token / 3, rel=1e-12)
    ensemble = train_ppo.iteration_flops(
        train_ppo.Models(actor, actor, critic, [reward_model] * 3), seq_len, sequences, epochs
    )
    assert ensemble - got == pytest.approx(2 * sequences * seq_len * critic_per_token / 3, rel=1e-12)  # a forward each


def test_ppo_starts_from_a_dpo_checkpoint(tmp_path, task_dir, sft_ckpt):
    """PPO after DPO: --sft-ckpt takes a kind "dpo" policy (policy and reference)."""

    dpo_path = str(tmp_path / "dpo.pt")
    checkpoints.save_checkpoint(torch.load(sft_ckpt, weights_only=False) | {"kind": "dpo"}, dpo_path)
    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out,
        task_dir=task_dir,
        sft_ckpt=dpo_path,
        rm_ckpt="none",
        reward_fn="data:gold_reward",
        max_steps=1,
        **TINY_PPO,
    )
    train_ppo.main(args)
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 1


def test_reward_fn_from_a_file_or_a_module_beside_the_working_folder(tmp_path, task_dir, sft_ckpt):
    """--reward-fn path/to/file.py:fn loads the file; module:fn finds a module in the working folder when the script
    runs by its path from there (the current folder used not to be on the import path: ModuleNotFoundError); the
    score's parts are logged apart: objective/reward_fn (and objective/rm_score beside an RM)."""
    import subprocess
    import sys

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
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_ppo.py")
    cmd = (
        f"{sys.executable} {script} --sft-ckpt {sft_ckpt} --rm-ckpt none --reward-fn myreward:length {flags} "
        f"--max-new-tokens 8 --task-dir {task_dir} --out-dir {tmp_path / 'ppo'}"
    )
    r = subprocess.run(
        cmd.split(), cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    scalars = read_scalars(str(tmp_path / "ppo"))
    assert "objective/reward_fn" in scalars and "objective/rm_score" not in scalars


def test_rollout_logs_the_rm_score_and_the_reward_function_apart(tok):
    actor, critic, rm = tiny(tok, 0), tiny(tok, 1, lm_head=False, score_head=True), tiny(tok, 2, score_head=True)
    kwargs = rollout_kwargs(reward_fn=lambda p, r, e: 0.25, reward_fn_coef=2.0, reward_norm="none", reward_clip=None)
    exp, stats, _ = train_ppo.rollout(train_ppo.Models(actor, actor, critic, [rm]), tok, ["Review of"] * 4, **kwargs)
    assert stats["objective/reward_fn"] == pytest.approx(0.25)
    ended = exp["ended"].bool()
    if ended.any():  # the score of an ended response is the RM's plus coef x the function's
        assert stats["objective/rm_score"] != 0.0


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(cliprange_high=-0.5), r"--cliprange-high -0\.5: the upper bound"),
        (dict(cliprange=-1.0), r"--cliprange -1\.0: use > 0 \(None: no clip\)"),
        (dict(kl_coef=-1.0), r"--kl-coef -1\.0: beta is the strength of a penalty"),
        (dict(ppo_epochs=0), r"--ppo-epochs 0: passes over each rollout"),
        (dict(adv_estimator="rloo", grpo_std_norm=False), r"--no-grpo-std-norm applies to --adv-estimator grpo"),
        (dict(max_sample_rounds=5), r"--max-sample-rounds 5: it applies to --dynamic-sampling only"),
        (dict(cliprange=None, cliprange_high=0.28), r"--cliprange-high 0\.28: .*needs eps > 0 and a --cliprange"),
        (dict(cliprange_value=0.0), r"--cliprange-value 0\.0: use > 0"),
        (dict(gamma=1.5), r"--gamma 1\.5 --lam 0\.95: both lie in \[0, 1\]"),
    ],
)
def test_settings_no_run_can_mean_are_refused(tmp_path, flags, message):
    """Values that used to run silently (an upper clip below the lower one zeroes every positive advantage's
    gradient, --ppo-epochs 0 never updates, ...): one line naming the flag, before any work."""
    with pytest.raises(common.UserError, match=message):
        train_ppo.main(train_ppo.Args(out_dir=str(tmp_path / "ppo"), **flags))
    assert not os.path.exists(tmp_path / "ppo")


def test_cliprange_none_is_the_plain_policy_gradient():
    """--cliprange None: no clip at any ratio, the loss is the mean of -A * ratio (nanochat's REINFORCE with the
    on-policy ratio 1)."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=6, seed=9)
    lp = old + 2.0 * lp  # ratios far outside any clip range
    loss, stats = ppo_policy_loss(lp, old, adv, mask, None)
    want = (-adv * torch.exp(lp - old) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12) and stats["clipfrac"] == 0


def test_tis_weights_against_the_formula():
    """--tis-cap C: min(exp(old - sampler), C) per valid token, 0 on padding whatever its log-probs (masked before the
    exponential); the stats are the valid tokens' mean weight and the share above the cap."""
    lengths, mask, (old, sampler, _, _, _) = ragged(B=6, seed=11)
    sampler = old + 0.8 * sampler  # ratios on both sides of the cap
    sampler = torch.where(mask.bool(), sampler, torch.full_like(sampler, -1000.0))
    weights, stats = train_ppo.tis_weights(old, sampler, mask, 1.5)
    want, above, n = [], 0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            ratio = math.exp(old[b, t].item() - sampler[b, t].item())
            assert weights[b, t].item() == pytest.approx(min(ratio, 1.5), abs=1e-12)
            want.append(min(ratio, 1.5))
            above += ratio > 1.5
            n += 1
        assert (weights[b, length:] == 0).all()
    assert stats["tis_weight_mean"].item() == pytest.approx(sum(want) / n, abs=1e-12)
    assert stats["tis_clipfrac"].item() == pytest.approx(above / n, abs=1e-12) and 0 < above < n


def test_tis_weights_of_one_leave_the_update_unchanged():
    """With the sampler's log-probs equal to the trainer's (fp32), --tis-cap changes nothing: the weights are 1."""
    outcomes = []
    for tis_cap in (None, 2.0):
        actor, critic, exp = fake_experience()
        exp["sampler_logprobs"] = exp["logprobs"].clone()
        outcomes.append(update_once(actor, critic, exp, 4, tis_cap=tis_cap) | {"weights": actor.state_dict()})
    assert outcomes[1]["policy/tis_weight_mean"] == pytest.approx(1.0) and outcomes[1]["policy/tis_clipfrac"] == 0
    for name, value in outcomes[0]["weights"].items():
        assert torch.allclose(value, outcomes[1]["weights"][name], atol=1e-7), name
