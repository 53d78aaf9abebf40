"""train_grpo.py, the critic-free family (GRPO, Dr. GRPO, RLOO, REINFORCE++, DAPO's tricks): the recipes and their
resolution, every pure function against naive loops on random ragged batches (group advantages, reward-to-go, loss
aggregation over micro-batches, the clipped loss with clip-higher and dual-clip, GSPO's, CISPO's and DPPO's losses, the
KL in the loss with k3 and k2, padding with extreme log-probs), dynamic sampling's batch, dropped responses that never
move the whitening, the first minibatch's ratio; the flags no run can mean (a KL estimator where it works against the KL
included); smoke runs of main() for each estimator (no critic, no KL controller, no collapse detector), train/episodes
(dynamic sampling's extra rounds included) and kill-and-resume."""

import dataclasses
import math
import os
import re
import sys
from types import SimpleNamespace

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
    run_here,
    tiny_gpt,
    trained,
)

import common
import rollout
import train_grpo
from model import GPT, GPTConfig
from rollout import Models
from train_grpo import (
    RECIPES,
    RunningMoments,
    cispo_loss,
    group_advantages,
    gspo_loss,
    kl_estimate,
    kl_loss,
    loss_weights,
    policy_loss,
    reinforce_pp_advantages,
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
    assert set(RECIPES) == {"grpo", "rloo", "reinforce_pp", "vineppo", "rebel", "distill"} and keys
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


@pytest.mark.parametrize("group_size, gamma", [(1, 1.0), (2, 1.0), (3, 0.9)])
def test_reinforce_pp_advantages_match_a_per_token_loop(group_size, gamma):
    """REINFORCE++ before whitening, as OpenRLHF's reinforce_baseline orders it: s'_i = s_i - mean_group(s), then
    A_t = gamma^(n-1-t) s'_i - beta * sum_{u>=t} gamma^(u-t) k1_u over the row's real tokens; padding holds +-1e4
    log-probs and gets 0. verl's order (the group mean of s_i - beta * sum_t k1_t on every token) fails it."""
    lengths, mask, (scores, logprobs, ref_logprobs, *_) = ragged(B=6 * group_size, T=7, seed=group_size)
    scores = scores[:, 0]
    logprobs = torch.where(mask.bool(), logprobs, 1e4)
    ref_logprobs = torch.where(mask.bool(), ref_logprobs, -1e4)
    beta = 0.3
    got = reinforce_pp_advantages(scores, logprobs, ref_logprobs, mask, group_size, beta, gamma)
    for b, n in enumerate(lengths):
        start = b - b % group_size
        group = scores[start : start + group_size].tolist()
        centred = scores[b].item() - (sum(group) / group_size if group_size > 1 else 0.0)
        for t in range(n):
            kl = sum(gamma ** (u - t) * (logprobs[b, u] - ref_logprobs[b, u]).item() for u in range(t, n))
            want = gamma ** (n - 1 - t) * centred - beta * kl
            assert got[b, t].item() == pytest.approx(want, abs=1e-9)
        assert (got[b, n:] == 0).all()


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


def test_gspo_loss_against_a_written_out_sequence_reference():
    """GSPO-token's loss and gradient equal the sequence form written row by row: s_i = exp(the mean over the row's
    tokens of logp - old_logp), loss_i = max(-A_i * s_i, -A_i * clip(s_i)), the mean over rows (seq_mean weights);
    padding at +-1e4 moves nothing; seq_clipfrac counts the rows whose clip is active."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=12, seed=11)
    logprobs = (old + 0.05 * lp).masked_fill(mask == 0, 1e4).requires_grad_()
    old_logprobs = old.masked_fill(mask == 0, -1e4)
    advantages = adv[:, :1] * mask  # one advantage a sequence, as grpo's
    eps, eps_high = 0.01, 0.02
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    loss, stats = gspo_loss(logprobs, old_logprobs, advantages, mask, eps, weights, denom, eps_high)
    loss.backward()
    reference_logprobs = logprobs.detach().clone().requires_grad_()
    reference, clipped = 0.0, 0
    for b, n in enumerate(lengths):
        log_s = sum(reference_logprobs[b, t] - old_logprobs[b, t] for t in range(n)) / n
        s = torch.exp(log_s)
        a = advantages[b, 0].item()
        unclipped, clipped_term = -a * s, -a * s.clamp(1 - eps, 1 + eps_high)
        if clipped_term.item() > unclipped.item():
            reference, clipped = reference + clipped_term / len(lengths), clipped + 1
        else:
            reference = reference + unclipped / len(lengths)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    assert torch.allclose(logprobs.grad, reference_logprobs.grad, atol=1e-12)
    assert (logprobs.grad[mask == 0] == 0).all()
    assert 0 < clipped < len(lengths) and stats["seq_clipfrac"].item() == pytest.approx(clipped / len(lengths))


def test_gspo_zeroes_a_clipped_sequence_as_its_advantage_sign_says():
    """A sequence ratio above 1 + eps_high: no gradient for A > 0, the full one for A < 0; below 1 - eps the other way
    round; within the clip every row learns. Every token of a row moves alike (the sequence ratio's share)."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 6, dtype=torch.float64)
    shift = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0, 0.0], dtype=torch.float64)  # log s_i
    old_logprobs = torch.full((6, 4), -1.0, dtype=torch.float64)
    logprobs = (old_logprobs + shift[:, None]).requires_grad_()
    sign = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    loss, stats = gspo_loss(logprobs, old_logprobs, sign[:, None] * mask, mask, 3e-4, mask / 3, 6.0, 4e-4)
    loss.backward()
    moved = (logprobs.grad[:, :3] != 0).all(1).tolist()  # the real tokens
    assert moved == [False, True, False, True, True, True]
    assert ((logprobs.grad == 0) == (mask == 0) | ~torch.tensor(moved)[:, None]).all()
    assert stats["seq_clipfrac"].item() == pytest.approx(2 / 6)


def test_cispo_loss_against_a_written_out_reference():
    """-sg(clip(r, 1-eps, 1+eps_high)) * A * logp per token, token_mean, written token by token: the value and the
    gradient (the clipped weight times -A / tokens); padding at +-1e4 moves nothing."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=10, seed=12)
    lp = old + 0.5 * lp
    logprobs = lp.masked_fill(mask == 0, 1e4).requires_grad_()
    old_logprobs = old.masked_fill(mask == 0, -1e4)
    eps, eps_high = 0.2, 0.28
    weights, denom = loss_weights(mask, "token_mean", len(lengths), mask.sum(), 7)
    loss, stats = cispo_loss(logprobs, old_logprobs, adv, mask, eps, weights, denom, eps_high)
    loss.backward()
    tokens = sum(lengths)
    total, low, high = 0.0, 0, 0
    grad = torch.zeros_like(lp)
    for b, n in enumerate(lengths):
        for t in range(n):
            r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
            weight = min(max(r, 1 - eps), 1 + eps_high)
            total += -weight * a * lp[b, t].item() / tokens
            grad[b, t] = -weight * a / tokens
            low += r < 1 - eps
            high += r > 1 + eps_high
    assert loss.item() == pytest.approx(total, abs=1e-12)
    assert torch.allclose(logprobs.grad, grad, atol=1e-12)
    assert stats["clipfrac_low"].item() == pytest.approx(low / tokens) and low > 0
    assert stats["clipfrac_high"].item() == pytest.approx(high / tokens) and high > 0
    assert stats["clipfrac"].item() == pytest.approx((low + high) / tokens)


def test_cispo_keeps_the_gradient_of_the_tokens_ppo_clips_away():
    """Where PPO's clip is active its token's gradient is zero; CISPO's on the same tokens is not."""
    lengths, mask, (lp, old, adv, _, _) = ragged(B=10, seed=13)
    lp = old + 0.5 * lp
    grads = {}
    for name, loss_fn in (("ppo", policy_loss), ("cispo", cispo_loss)):
        logprobs = lp.clone().requires_grad_()
        loss, _ = loss_fn(logprobs, old, adv, mask, 0.2, mask, mask.sum(), 0.28)
        loss.backward()
        grads[name] = logprobs.grad
    ratio = torch.exp(lp - old)
    outside = mask.bool() & ((ratio < 0.8) | (ratio > 1.28))
    dropped = outside & (grads["ppo"] == 0)
    assert dropped.sum() > 3
    assert (grads["cispo"][dropped] != 0).all()


def dppo_inputs(seed: int):
    """Ragged rows with an environment's span inside some (mask 0 between model tokens), sampled tokens' log-probs
    (old and new, some moved far: ratios above 20), advantages with zeros, +-1e4 wherever the mask is 0."""
    lengths, mask, (noise, old_logits, adv, signs, _) = ragged(B=10, T=9, seed=seed)
    for b, n in enumerate(lengths):
        if n >= 4 and b % 3:  # an observation of one or two tokens inside the row
            mask[b, 1 : 2 + b % 2] = 0.0
    old_logits[:, 0] = -6.0  # rare tokens made likely: ratios of about 300
    logits = old_logits + noise
    logits[:, 0] = 1.0
    outside = 1e4 * torch.sign(signs)
    old_logprobs = torch.where(mask.bool(), torch.nn.functional.logsigmoid(old_logits), outside)
    logprobs = torch.where(mask.bool(), torch.nn.functional.logsigmoid(logits), -outside)
    adv = torch.where(mask.bool(), adv.masked_fill(adv.abs() < 0.2, 0.0), outside)
    return mask, logprobs, old_logprobs, adv


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
@pytest.mark.parametrize("divergence, delta_low, delta_high", [("tv", 0.1, 0.2), ("kl", 0.05, 0.1)])
def test_dppo_loss_against_a_per_token_loop(agg, divergence, delta_low, delta_high):
    """DPPO's loss and gradient written token by token over the model tokens (interior observation spans and padding
    at +-1e4 move nothing: their gradient is exactly 0): -A * min(rho, 20) * logp where the token stays in the trust
    region (tv: pi - pi_old against +delta_high for A > 0, -delta_low for A <= 0; kl: the binary KL, a move the
    advantage does not ask for always kept), aggregated as --loss-agg; clipfrac the tokens out of the region."""
    mask, lp, old, adv = dppo_inputs(seed=14)
    B, max_new_tokens = mask.size(0), 9
    weights, denom = loss_weights(mask, agg, B, mask.sum(), max_new_tokens)
    logprobs = lp.clone().requires_grad_()
    loss, stats = train_grpo.dppo_loss(logprobs, old, adv, mask, delta_low, weights, denom, delta_high, divergence)
    loss.backward()
    tokens = int(mask.sum())
    total, low, high, truncated = 0.0, 0, 0, 0
    grad = torch.zeros_like(lp)
    for b in range(B):
        row = mask[b].nonzero().squeeze(1).tolist()
        for t in row:
            p_lp, q_lp, a = lp[b, t].item(), old[b, t].item(), adv[b, t].item()
            p, q = math.exp(p_lp), math.exp(q_lp)
            if divergence == "tv":
                kept = p - q <= delta_high if a > 0 else p - q >= -delta_low
            else:
                binary_kl = q * (q_lp - p_lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                kept = (binary_kl <= delta_high or p <= q) if a > 0 else (binary_kl <= delta_low or p >= q)
            weight = min(math.exp(min(max(p_lp - q_lp, -20), 20)), 20.0)
            share = {"token_mean": 1 / tokens, "seq_mean": 1 / (len(row) * B)}.get(agg, 1 / (max_new_tokens * B))
            total += -a * weight * p_lp * kept * share
            grad[b, t] = -a * weight * kept * share
            low += not kept and a <= 0
            high += not kept and a > 0
            truncated += kept and a != 0 and weight == 20.0
    assert loss.item() == pytest.approx(total, rel=1e-12)
    assert torch.allclose(logprobs.grad, grad, rtol=1e-12, atol=1e-15)
    assert (logprobs.grad[mask == 0] == 0).all()
    assert low > 0 and high > 0 and truncated > 0 and low + high < tokens
    assert stats["clipfrac_low"].item() == pytest.approx(low / tokens)
    assert stats["clipfrac_high"].item() == pytest.approx(high / tokens)
    assert stats["clipfrac"].item() == pytest.approx((low + high) / tokens)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_on_policy_is_the_policy_gradient(divergence):
    """At pi = pi_old every token is in the region and its weight is 1: DPPO's gradient is PPO's, clipfrac 0."""
    lengths, mask, (lp, _, adv, _, _) = ragged(B=6, seed=15)
    old_logprobs = torch.nn.functional.logsigmoid(lp)
    grads = {}
    for name in ("ppo", "dppo"):
        logprobs = old_logprobs.clone().requires_grad_()
        if name == "dppo":
            loss, stats = train_grpo.dppo_loss(logprobs, old_logprobs, adv, mask, 0.05, mask, 9.0, None, divergence)
        else:
            loss, stats = policy_loss(logprobs, old_logprobs, adv, mask, 0.05, mask, 9.0)
        loss.backward()
        grads[name] = logprobs.grad
        assert stats["clipfrac"] == 0
    assert torch.allclose(grads["dppo"], grads["ppo"], atol=1e-15) and (grads["dppo"][mask.bool()] != 0).all()


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
    exp, metrics, _ = train_grpo.grpo_rollout(engine, args, prompts, reward_moments=RunningMoments())
    mask = exp["mask"]
    assert metrics["objective/kl"] == 0.0 and 0 < exp["ended"].sum() < len(prompts)
    last = mask.sum(1).long() - 1
    assert torch.allclose(exp["rewards"].sum(1), exp["scores"]) and torch.allclose(
        exp["rewards"].gather(1, last[:, None]).squeeze(1), exp["scores"]
    )
    want = group_advantages(exp["scores"], 4, "grpo")
    assert torch.allclose(exp["advantages"], want[:, None] * mask, atol=1e-6)
    loop = rollout.Loop(torch.Generator().manual_seed(0))
    args = dataclasses.replace(args, micro_batch_size=2)
    metrics, diagnostics = train_grpo.grpo_update(
        trained("model", actor, grad_clip=1.0), exp, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
    )
    first = rollout.read_diagnostics(diagnostics["first_micro_batch"])
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
        (dict(policy_loss="cispo", dual_clip=3.0), r"--dual-clip with --policy-loss cispo: it caps PPO's clipped"),
        (dict(policy_loss="gspo", dual_clip=3.0), r"--dual-clip with --policy-loss gspo: "),
        (dict(policy_loss="dppo_tv", dual_clip=3.0), r"--dual-clip with --policy-loss dppo_tv: "),
        (dict(policy_loss="dppo_kl", cliprange=None), r"--cliprange None with --policy-loss dppo_kl: its trust region"),
        (dict(policy_loss="gspo", estimator="rloo"), r"--loss-agg token_mean with --policy-loss gspo: .*use seq_mean"),
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


def test_an_estimator_without_a_step_5_is_one_line(task_tok, monkeypatch):
    """A RECIPES row with no branch in grpo_rollout's step 5 (a new estimator half added) is one line naming both,
    never an unbound variable."""
    monkeypatch.setitem(train_grpo.RECIPES, "remax", RECIPES["rloo"] | {"group_size": 1})
    actor = tiny_gpt(task_tok, 0)
    args = resolve_args(train_grpo.Args(estimator="remax", max_new_tokens=4))
    engine = rollout.Engine(Models(actor, actor, [tiny_gpt(task_tok, 2, score_head=True)]), task_tok, args, 4, None)
    with pytest.raises(ValueError, match=r"--estimator remax: a row of RECIPES without a branch in grpo_rollout") as e:
        train_grpo.grpo_rollout(engine, engine.args, ["Review of"] * 2, reward_moments=RunningMoments())
    assert "\n" not in str(e.value)


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
        ("grpo", dict(cliprange_high=0.28, dual_clip=3.0, entropy_coef=0.01)),
        pytest.param(
            "rloo",
            dict(loss_agg="seq_sum_norm", kl_penalty="loss", mask_truncated=True, dynamic_sampling=True),
            marks=pytest.mark.slow,
        ),
        pytest.param("reinforce_pp", dict(group_size=2), marks=pytest.mark.slow),
        ("vineppo", dict(vine_k=2)),
        ("rebel", dict()),
        pytest.param("grpo", dict(policy_loss="gspo", cliprange=3e-4, cliprange_high=4e-4), id="gspo"),
        pytest.param(
            "grpo", dict(policy_loss="cispo", cliprange=1.0, cliprange_high=0.28, loss_agg="token_mean"), id="cispo"
        ),
        pytest.param("grpo", dict(policy_loss="dppo_tv", cliprange=0.15), id="dppo_tv"),
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
        reward_fn="task:gold_reward",
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
    assert ckpt["args"]["group_size"] == (
        args.group_size or RECIPES[estimator]["group_size"]
    )  # the resolved settings are saved
    assert ckpt["args"]["estimator"] == estimator and "critic_warmup_steps" not in ckpt["args"]
    scalars = read_scalars(out)
    resolved = resolve_args(args)
    step_tags = set(STEP_TAGS)
    if resolved.kl_penalty == "loss":
        step_tags.add("policy/kl_loss")
    if args.policy_loss == "gspo":  # the share of sequences clipped
        step_tags.add("policy/seq_clipfrac")
    tags = GRPO_TAGS | step_tags
    if args.mask_truncated:
        tags.add("rollout/truncated_frac")
    if args.dynamic_sampling:
        tags |= {"rollout/zero_std_frac", "rollout/sample_rounds"}
    if args.entropy_coef:
        step_tags.add("policy/entropy_bonus")
        tags.add("policy/entropy_bonus")
    if estimator == "vineppo":  # the continuations: how many, their tokens, their seconds
        tags |= {"rollout/vine_responses", "rollout/vine_tokens", "perf/vine_s"}
    for tag in tags:  # every iteration, the policy's included: no critic warm-up
        logged = scalars.get(tag, [])
        assert all(math.isfinite(v) for v in logged), tag
        assert len(logged) == 3 or (args.mask_truncated and tag in step_tags), tag
    assert not (PPO_ONLY_TAGS & set(scalars))
    assert ("policy/seq_clipfrac" in scalars) == (args.policy_loss == "gspo")
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


def test_dynamic_sampling_stops_on_the_episode_budget(tmp_path, task_dir, tiny_ckpts):
    """Without --max-steps, --total-episodes is the budget of responses sampled: under --dynamic-sampling the extra
    rounds count against it, so the run ends in fewer iterations than total_episodes / rollout_batch_size (the tiny
    random policy's groups tie and ask for more rounds), at its first iteration at or past the budget, and saves it."""
    settings = dict(out_dir=str(tmp_path), task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_ckpts[1])
    sizes = dict(rollout_batch_size=8, num_minibatches=2, micro_batch_size=4, max_new_tokens=8, warmup_steps=1)
    flags = dict(group_size=2, dynamic_sampling=True, max_sample_rounds=3, total_episodes=40)
    train_grpo.main(train_grpo.Args(**settings, **sizes, **flags))
    episodes = read_scalars(str(tmp_path))["train/episodes"]
    assert episodes[-1] >= 40 and all(value < 40 for value in episodes[:-1]) and len(episodes) < 40 // 8, episodes
    assert torch.load(os.path.join(tmp_path, "ckpt.pt"), weights_only=False)["step"] == len(episodes)


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
    run_here(f"{base} --out-dir {tmp_path}/full")
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


# -----------------------------------------------------------------------------
# VinePPO and REBEL


def looped_steps(response: list, boundary: int) -> list:
    """The step of each token of one response, written out: a new step after each boundary token."""
    steps, current = [], 0
    for token in response:
        steps.append(current)
        current += token == boundary
    return steps


def test_vine_steps_sentences_and_chunks():
    """A sentence's '.' ends its step (the EOS after the last one is a step of its own); padding is -1 whatever it
    holds; without a boundary, every chunk tokens is a step. step_starts lists each step of each row with the column
    of its first token."""
    lengths, mask, _ = ragged(B=6, T=9, seed=3)
    g = torch.Generator().manual_seed(3)
    response = torch.randint(0, 4, (6, 9), generator=g)  # token 1 is the boundary
    response = response.masked_fill(mask == 0, 1)  # padding full of boundaries: never counted
    steps = train_grpo.vine_steps(response, mask, boundary_id=1, chunk=3)
    rows, step, starts = train_grpo.step_starts(steps)
    want_starts = []
    for b, n in enumerate(lengths):
        want = looped_steps(response[b, :n].tolist(), 1)
        assert steps[b, :n].tolist() == want and (steps[b, n:] == -1).all()
        want_starts += [(b, m, want.index(m)) for m in range(max(want) + 1)]
    assert list(zip(rows.tolist(), step.tolist(), starts.tolist())) == want_starts
    chunked = train_grpo.vine_steps(response, mask, boundary_id=None, chunk=3)
    for b, n in enumerate(lengths):
        assert chunked[b, :n].tolist() == [t // 3 for t in range(n)] and (chunked[b, n:] == -1).all()


def test_vine_advantages_against_a_loop():
    """Each token takes its step's advantage: the step's rewards summed, plus V at the next step's start (0 after the
    last step), minus V at its start; the last step's advantage is its rewards + 0 - its value. Ragged rows, values
    past a row's last step and padding rewards set to extremes that must not leak."""
    lengths, mask, (rewards, *_) = ragged(B=6, T=9, seed=4)
    rewards = rewards.masked_fill(mask == 0, 1e30)
    g = torch.Generator().manual_seed(4)
    response = torch.randint(0, 3, (6, 9), generator=g)
    steps = train_grpo.vine_steps(response, mask, boundary_id=0, chunk=1)
    M = int(steps.max()) + 1
    values = torch.randn(6, M, generator=g, dtype=torch.float64)
    for b in range(6):
        values[b, int(steps[b].max()) + 1 :] = 0  # past a row's last step
    got = train_grpo.vine_advantages(rewards, mask, steps, values)
    for b, n in enumerate(lengths):
        row_steps = steps[b, :n].tolist()
        last = max(row_steps)
        for t in range(n):
            m = row_steps[t]
            step_reward = sum(rewards[b, u].item() for u in range(n) if row_steps[u] == m)
            next_value = values[b, m + 1].item() if m < last else 0.0
            assert got[b, t].item() == pytest.approx(step_reward + next_value - values[b, m].item(), abs=1e-12)
            if m == last:
                assert got[b, t].item() == pytest.approx(step_reward + 0.0 - values[b, last].item(), abs=1e-12)
        assert (got[b, n:] == 0).all()


def fixed_rollout(calls: list):
    """A stand-in for rollout.rollout that returns continuations of fixed random lengths, log-probs and scores, and
    records each call (its prompts, prefix ids and mask, what it returned) in calls."""

    def continue_prefixes(engine, prompts, prefix, k=1):
        ids, prefix_mask = prefix
        S, width = ids.size(0), ids.size(1) + 6
        generator = torch.Generator().manual_seed(6 + len(calls))
        starts = prefix_mask.sum(1).long().repeat_interleave(k)
        ends = starts + torch.randint(1, 7, (S * k,), generator=generator)
        columns = torch.arange(width)
        continued_mask = (columns < ends[:, None]).float()
        continued = dict(
            mask=continued_mask,
            logprobs=-torch.rand(S * k, width, generator=generator) * continued_mask,
            ref_logprobs=-torch.rand(S * k, width, generator=generator) * continued_mask,
            scores=torch.randn(S * k, generator=generator) * 3,
        )
        calls.append((list(prompts), ids.clone(), prefix_mask.clone(), continued))
        return continued, {}, []

    return continue_prefixes


def test_vineppo_values_with_fixed_continuations_equal_a_loop(task_tok, monkeypatch):
    """vineppo_advantages with the continuations fixed (rollout.rollout replaced by one that returns given token
    rows, log-probs and scores): the prefixes it asks to continue are each response up to each step's start (the
    prompt alone first), k times in a row, decoded in calls of at most the rollout's rows (3 here: it was one call of
    all 18), and the values and advantages equal a hand-written loop over rows, steps and continuations: V = the
    mean over k of (score normalised with the run's moments - beta * k1 summed over the continuation)."""
    tok = task_tok
    dot, eos = tok.encode(".")[0], tok.eos_id
    words = tok.encode(" the music was good")
    rows = [words + [dot] + words + [dot, eos], words + [dot, eos], words[:3]]  # 3, 2 and 1 steps
    B, T, k = len(rows), max(map(len, rows)), 3
    response = torch.full((B, T), tok.pad_id)
    mask = torch.zeros(B, T)
    for b, row in enumerate(rows):
        response[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(B, T, generator=g) * mask
    moments = RunningMoments()
    moments.update(torch.randn(32, generator=g) * 2 + 1)
    args = resolve_args(train_grpo.Args(estimator="vineppo", vine_k=k, kl_coef=0.2, reward_clip=1.5))
    calls = []  # per call: its prompts, prefix ids and mask, and what it returned
    monkeypatch.setattr(rollout, "rollout", fixed_rollout(calls))
    engine = SimpleNamespace(args=args, tok=tok, gold_fn=lambda *a: 0.0)
    prompts = [
        "Review of The Silent River (music):",
        "Review of The Red Fox (acting):",
        "Review of The Old Sea (plot):",
    ]
    experience = dict(response=response, mask=mask, rewards=rewards)
    advantages, sums = train_grpo.vineppo_advantages(engine, engine.args, prompts, experience, moments)
    step_of = [looped_steps(row, dot) for row in rows]
    states = [(b, m, step_of[b].index(m)) for b in range(B) for m in range(max(step_of[b]) + 1)]
    assert len(calls) == len(states) * k // B and all(len(call[0]) <= B for call in calls)
    # the calls' rows one after the other: continuation c continues state c // k
    continuations = [(p, ids, pm, out, j) for p, ids, pm, out in calls for j in range(len(p))]
    assert [p[j] for p, _, _, _, j in continuations] == [prompts[b] for b, _, _ in states for _ in range(k)]
    values = {}
    scale = moments.std + 1e-8
    for s, (b, m, start) in enumerate(states):
        returns = []
        for c in range(s * k, s * k + k):
            _, prefix_ids, prefix_mask, continued, j = continuations[c]
            assert prefix_ids[j, :start].tolist() == rows[b][:start] and prefix_mask[j].sum().item() == start
            score = min(max((continued["scores"][j].item() - moments.mean) / scale, -1.5), 1.5)
            kl = sum(
                continued["logprobs"][j, t].item() - continued["ref_logprobs"][j, t].item()
                for t in range(start, continued["mask"].size(1))
                if continued["mask"][j, t] > 0
            )
            returns.append(score - 0.2 * kl)
        values[b, m] = sum(returns) / k
    for b, row in enumerate(rows):
        last = max(step_of[b])
        for t in range(len(row)):
            m = step_of[b][t]
            step_reward = sum(rewards[b, u].item() for u in range(len(row)) if step_of[b][u] == m)
            want = step_reward + (values[b, m + 1] if m < last else 0.0) - values[b, m]
            assert advantages[b, t].item() == pytest.approx(want, abs=1e-5)
        assert (advantages[b, len(row) :] == 0).all()
    assert sums["vine_responses"] == len(states) * k


def test_vineppo_on_arith_takes_steps_of_vine_chunk_tokens(task_tok, monkeypatch):
    """arith's answers have no sentence: a step is --vine-chunk tokens (it was the reviews task's '.' rule whenever
    the task had a gold reward: one step, the whole answer, whatever --vine-chunk said). With --vine-chunk 1 every
    token starts a state; on the reviews task a sentence still does."""
    lengths = [4, 2, 3]
    response = torch.randint(5, 20, (3, 4), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(4) < torch.tensor(lengths)[:, None]).float()
    experience = dict(response=response, mask=mask, rewards=torch.zeros(3, 4))
    moments = RunningMoments()
    for task, want in (("arith", sum(lengths)), ("reviews", 3)):
        calls = []
        monkeypatch.setattr(rollout, "rollout", fixed_rollout(calls))
        args = resolve_args(train_grpo.Args(task=task, estimator="vineppo", vine_k=1, vine_chunk=1, reward_norm="none"))
        engine = SimpleNamespace(args=args, tok=task_tok, gold_fn=lambda *a: 0.0)
        train_grpo.vineppo_advantages(engine, engine.args, ["1+2=", "3+4=", "5+6="], experience, moments)
        assert sum(len(call[0]) for call in calls) == want, task


def test_continuation_batches_bound_the_rows_and_never_leave_a_call_empty():
    """One process: ceil(rows / max_rows) calls (two ranks: tests/test_parallel.py's VinePPO under --fsdp)."""
    assert train_grpo.continuation_batches(18, 3, torch.device("cpu")) == 6
    assert train_grpo.continuation_batches(19, 3, torch.device("cpu")) == 7
    assert train_grpo.continuation_batches(2, 8, torch.device("cpu")) == 1


def test_vineppo_sampled_values_match_a_looped_estimate(task_tok):
    """The value of one state (a prompt and a one-sentence prefix) from rollout.rollout's batched, KV-cache
    continuations (k = 512) lies within 3 standard errors of a looped estimate: 512 continuations sampled token by
    token with the full forward of the policy, their score (the reward function) and k1 against the reference
    summed by hand."""
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id, amount=2.0)
    ref = tiny_gpt(tok, 1)
    prompt = "Review of The Silent River (music):"
    prefix_ids = torch.tensor([tok.encode(" the music was good.")])
    k, beta, max_new = 512, 0.2, 10

    def reward_fn(prompt, response, ended):
        return float(ended) + 0.1 * len(response.split())

    args = resolve_args(train_grpo.Args(estimator="vineppo", max_new_tokens=max_new, temperature=1.0, rm_ckpt="none"))
    engine = rollout.Engine(
        Models(actor, ref, []), tok, args, 64, torch.Generator().manual_seed(0), reward_fn=reward_fn
    )
    continued, _, _ = rollout.rollout(engine, [prompt], (prefix_ids, torch.ones_like(prefix_ids).float()), k=k)
    start = prefix_ids.size(1)
    sampled = continued["mask"] * (torch.arange(continued["mask"].size(1)) >= start)
    batched = train_grpo.continuation_returns(
        continued["scores"], continued["logprobs"], continued["ref_logprobs"], sampled, beta
    )
    # the looped estimate: token by token, the whole sequence through each model every time
    generator = torch.Generator().manual_seed(1)
    context = torch.tensor([tok.encode(prompt) + prefix_ids[0].tolist()]).repeat(k, 1)
    alive = torch.ones(k, dtype=torch.bool)
    kl = torch.zeros(k, dtype=torch.float64)
    generated = [[] for _ in range(k)]
    ended = [False] * k
    with torch.no_grad():
        for _ in range(max_new - start):
            logp = torch.log_softmax(actor(context)[0][:, -1].double(), -1)
            ref_logp = torch.log_softmax(ref(context)[0][:, -1].double(), -1)
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            picked = logp.gather(1, token[:, None]).squeeze(1) - ref_logp.gather(1, token[:, None]).squeeze(1)
            kl += torch.where(alive, picked, 0.0)
            for row in alive.nonzero().squeeze(1).tolist():
                generated[row].append(token[row].item())
                ended[row] = token[row].item() == tok.eos_id
            alive &= token != tok.eos_id
            context = torch.cat([context, token[:, None]], 1)
    prefix_text = tok.decode(prefix_ids[0].tolist())
    looped = torch.tensor(
        [reward_fn(prompt, prefix_text + tok.decode(ids), e) for ids, e in zip(generated, ended)], dtype=torch.float64
    )
    looped = looped - beta * kl
    se = math.sqrt(batched.double().var() / k + looped.var() / k)
    assert 0 < se and abs(batched.double().mean() - looped.mean()) < 3 * se


def test_pair_gaps_and_rebel_loss_against_a_written_out_reference():
    """REBEL's loss and its gradient against the formula written pair by pair, on ragged responses whose padding
    holds extreme log-probs; pair_gaps gives each row its reward minus its partner's."""
    lengths, mask, (logprobs, old_logprobs, *_) = ragged(B=6, T=7, seed=7)
    logprobs = logprobs.masked_fill(mask == 0, 1e4).requires_grad_()
    old_logprobs = old_logprobs.masked_fill(mask == 0, -1e4)
    rewards = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    gaps = train_grpo.pair_gaps(rewards)
    for j in range(3):
        assert gaps[2 * j].item() == pytest.approx(rewards[2 * j].item() - rewards[2 * j + 1].item())
        assert gaps[2 * j + 1].item() == pytest.approx(rewards[2 * j + 1].item() - rewards[2 * j].item())
    eta, denom = 0.7, 5.0
    loss, stats = train_grpo.rebel_loss(logprobs, old_logprobs, gaps, mask, eta, denom)
    loss.backward()
    reference_logprobs = logprobs.detach().clone().requires_grad_()
    reference = 0.0
    for j in range(3):
        a, b = 2 * j, 2 * j + 1
        ratio_a = sum(reference_logprobs[a, t] - old_logprobs[a, t] for t in range(lengths[a]))
        ratio_b = sum(reference_logprobs[b, t] - old_logprobs[b, t] for t in range(lengths[b]))
        reference = reference + ((ratio_a - ratio_b) / eta - (rewards[a] - rewards[b])) ** 2
    reference = reference / denom
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    assert torch.allclose(logprobs.grad, reference_logprobs.grad, atol=1e-12)
    assert (logprobs.grad[mask == 0] == 0).all() and stats["clipfrac"] == 0


def test_rebel_update_keeps_pairs_whole(monkeypatch):
    """Under rebel the update permutes whole groups: every micro-batch holds pairs (2j, 2j + 1) whose gaps are
    opposite, over epochs and minibatches; the first micro-batch reads ratio 1."""
    actor, _, exp = fake_experience()
    exp = critic_free_experience(exp)
    gaps = train_grpo.pair_gaps(torch.randn(8, generator=torch.Generator().manual_seed(8)))
    exp["advantages"] = gaps[:, None] * exp["mask"]
    seen = []
    real_loss = train_grpo.rebel_loss

    def recording_loss(logprobs, old_logprobs, gaps, mask, eta, denom):
        seen.append(gaps.clone())
        return real_loss(logprobs, old_logprobs, gaps, mask, eta, denom)

    monkeypatch.setattr(train_grpo, "rebel_loss", recording_loss)
    settings = dict(estimator="rebel", group_size=4, ppo_epochs=3, num_minibatches=2, micro_batch_size=2)
    args = resolve_args(dataclasses.replace(train_grpo.Args(temperature=1.0), **settings))
    loop = rollout.Loop(torch.Generator().manual_seed(0))
    metrics, diagnostics = train_grpo.grpo_update(
        trained("model", actor), exp, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
    )
    assert len(seen) == 3 * 2 * 2 and diagnostics["updates"] == 6
    for micro_gaps in seen:
        assert torch.allclose(micro_gaps[0::2], -micro_gaps[1::2])
    first = rollout.read_diagnostics(diagnostics["first_micro_batch"])
    assert first["ratio_err"] <= 1e-5 and math.isfinite(metrics["policy/loss"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(cliprange=0.3), r"--cliprange with --estimator rebel: its regression has no ratio to clip"),
        (dict(cliprange_high=0.28), r"--cliprange-high with --estimator rebel: "),
        (dict(dual_clip=3.0), r"--dual-clip with --estimator rebel: "),
        (dict(loss_agg="token_mean"), r"--loss-agg token_mean with rebel: rebel's loss is a mean over pairs"),
        (dict(kl_penalty="loss"), r"--kl-penalty loss with --estimator rebel: the KL goes in its reward"),
        (dict(adv_whiten="rollout"), r"--adv-whiten rollout with --estimator rebel: "),
        (dict(mask_truncated=True), r"--mask-truncated with --estimator rebel: "),
        (dict(dynamic_sampling=True), r"--dynamic-sampling with --estimator rebel: "),
        (dict(tis_cap=2.0), r"--tis-cap with --estimator rebel: "),
        (dict(policy_loss="cispo"), r"--policy-loss cispo with --estimator rebel: its loss is a regression"),
        (dict(group_size=3), r"--group-size 3: rebel pairs a group's responses"),
        (dict(rebel_eta=0.0), r"--rebel-eta 0\.0: the regression divides by it"),
    ],
)
def test_rebel_refuses_what_has_no_place_in_a_pair_regression(tmp_path, flags, message):
    with pytest.raises(common.UserError, match=message) as error:
        train_grpo.main(train_grpo.Args(estimator="rebel", out_dir=str(tmp_path / "grpo"), **flags))
    assert "\n" not in str(error.value) and not os.path.exists(tmp_path / "grpo")


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(vine_k=8), r"--vine-k and --vine-chunk apply to --estimator vineppo, not grpo"),
        (dict(rebel_eta=0.5), r"--rebel-eta applies to --estimator rebel, not grpo"),
        (dict(loss_agg="pair_mean"), r"--loss-agg pair_mean with grpo: rebel's loss is a mean over pairs"),
        (dict(estimator="vineppo", vine_k=0), r"--vine-k 0 --vine-chunk 16: use >= 1"),
    ],
)
def test_an_estimators_own_flags_are_refused_elsewhere(tmp_path, flags, message):
    with pytest.raises(common.UserError, match=message) as error:
        train_grpo.main(train_grpo.Args(out_dir=str(tmp_path / "grpo"), **flags))
    assert "\n" not in str(error.value) and not os.path.exists(tmp_path / "grpo")


def test_the_entropy_bonus_gradient_against_a_written_out_reference():
    """--entropy-coef c adds -c x the policy's (tempered) entropy, aggregated as the policy loss (here seq_mean's
    weights over the step's sequence count): the gradient with it minus the one without equals -c x the gradient of
    that term written out; the logged entropy_bonus is the term before its coefficient."""
    from contextlib import nullcontext

    from model import entropy_from_logits, response_forward

    actor, _, exp = fake_experience()
    exp = critic_free_experience(exp)
    weights, denom = loss_weights(exp["mask"], "seq_mean", 11.0, None, 24)
    batch = exp | {"loss_mask": exp["mask"], "weights": weights}
    grads, sums = {}, {}
    for coef in (0.0, 0.05):
        actor.zero_grad()
        args = resolve_args(train_grpo.Args(entropy_coef=coef, temperature=0.7))
        sums[coef], _ = train_grpo.actor_backward(actor, batch, args, denom, True, nullcontext())
        grads[coef] = [p.grad.clone() for p in actor.parameters()]
    actor.zero_grad()
    logits, _ = response_forward(actor, exp["query"], exp["query_mask"], exp["response"], exp["mask"], 0.7)
    entropy = (entropy_from_logits(logits) * weights).sum() / denom
    (-0.05 * entropy).backward()
    assert sums[0.05]["entropy_bonus"].item() == pytest.approx(entropy.item(), rel=1e-6)
    assert "entropy_bonus" not in sums[0.0]
    for with_bonus, without, parameter in zip(grads[0.05], grads[0.0], actor.parameters()):
        assert torch.allclose(with_bonus - without, parameter.grad, atol=1e-6)


# -----------------------------------------------------------------------------
# on-policy distillation (--estimator distill)


def test_distill_advantages_against_a_loop():
    """Each sampled token's advantage is -beta * (logp - teacher_logp), written out a token at a time; padding holds
    +-1e4 and gets 0."""
    torch.manual_seed(0)
    lengths = [5, 1, 3, 7]
    logprobs, teacher = -torch.rand(4, 7) * 3, -torch.rand(4, 7) * 3
    mask = torch.zeros(4, 7)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        logprobs[row, length:], teacher[row, length:] = 1e4, -1e4
    advantages = train_grpo.distill_advantages(logprobs, teacher, mask, kl_coef=0.5)
    for row, length in enumerate(lengths):
        for t in range(7):
            want = -0.5 * (logprobs[row, t] - teacher[row, t]) if t < length else 0.0
            assert advantages[row, t].item() == pytest.approx(float(want), abs=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(rm_ckpt="none"), r"--estimator distill: give the teacher as --ref-ckpt"),
        (dict(ref_ckpt="t.pt"), r"--estimator distill: the reward is the teacher's log-probs; use --rm-ckpt none"),
        (dict(ref_ckpt="t.pt", rm_ckpt="none", reward_fn="task:gold_reward"), r"use --rm-ckpt none, no --reward-fn"),
        (dict(ref_ckpt="t.pt", rm_ckpt="none", kl_penalty="loss"), r"the reverse KL is the reward"),
        (dict(ref_ckpt="t.pt", rm_ckpt="none", missing_eos_penalty=-1.0), r"--missing-eos-penalty would do nothing"),
    ],
)
def test_distill_refuses_a_run_without_a_teacher_or_with_a_score(tmp_path, flags, message):
    with pytest.raises(common.UserError, match=message) as error:
        train_grpo.main(train_grpo.Args(out_dir=str(tmp_path / "grpo"), estimator="distill", **flags))
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "grpo")


def exact_reverse_kl(student_ckpt: str, teacher_ckpt: str, ids) -> float:
    """KL(student || teacher) summed over the vocabulary, averaged over every position of ids (B, T)."""
    models = []
    for path in (student_ckpt, teacher_ckpt):
        ckpt = torch.load(path, weights_only=False)
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        models.append(model.eval())
    with torch.no_grad():
        student, teacher = (model(ids)[0].log_softmax(-1) for model in models)
    return (student.exp() * (student - teacher)).sum(-1).mean().item()


def test_distill_moves_the_student_toward_its_teacher(tmp_path, task_dir, task_tok, trained_sft):
    """The tiny SFT distilled from a sharpened copy of itself (ln_f x 4: the same tokenizer, logits 4x): the exact
    reverse KL to the teacher on fixed text falls, with neither an RM nor a reward function."""
    import checkpoints

    teacher = torch.load(trained_sft, weights_only=False)
    teacher["model"]["transformer.ln_f.weight"] *= 4
    teacher_path = str(tmp_path / "teacher.pt")
    checkpoints.save_checkpoint(teacher, teacher_path)
    out = str(tmp_path / "distill")
    flags = TINY_RL | dict(ppo_epochs=1, lr=3e-3, max_steps=8)
    args = train_grpo.Args(out_dir=out, task_dir=task_dir, sft_ckpt=trained_sft, ref_ckpt=teacher_path)
    train_grpo.main(dataclasses.replace(args, rm_ckpt="none", estimator="distill", **flags))
    kl = read_scalars(out)["objective/kl"]  # the sampled estimate, per response
    assert len(kl) == 8 and all(math.isfinite(value) for value in kl)
    text = torch.tensor([task_tok.encode("Review of The Quiet Voyage (plot): the plot was wonderful. i loved it.")])
    before = exact_reverse_kl(trained_sft, teacher_path, text)
    after = exact_reverse_kl(os.path.join(out, "ckpt.pt"), teacher_path, text)
    assert after < 0.8 * before, (before, after)
