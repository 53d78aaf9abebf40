"""PPO-max: reinforcement learning from a reward model with every stabilising trick of Zheng et al. (2023) inline.

Each iteration samples responses from the policy (actor), scores them with the frozen reward model, subtracts a
per-token KL penalty against the frozen SFT policy (reference), estimates advantages with GAE from a critic that
starts from the reward model, and takes clipped PPO steps on the actor and the critic, plus an LM loss on
pre-training text (ptx). The PPO-max tricks: reward normalisation and clipping over running moments, the KL penalty,
advantage whitening per minibatch, value clipping, critic initialisation from the RM and critic warm-up, grad-norm
clipping, ptx, and a collapse detector over the monitoring metrics.
Paper: https://arxiv.org/abs/2307.04964 (Secrets of RLHF in Large Language Models Part I: PPO).

python train_ppo.py                                                   # built-in task, CPU, ~4 min (after SFT and RM)
python train_ppo.py --rm-ckpt none --reward-fn data:gold_reward       # optimise the gold reward itself, no RM
torchrun --standalone --nproc_per_node 8 train_ppo.py --sft-ckpt sft/ckpt.pt --rm-ckpt rm/ckpt.pt --prompts p.jsonl
"""

import importlib
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import hf
from common import UserError, exact_div, print0
from data import Order, Tokenizer, build_task, encode_sft, gold_reward, pad_left, pad_right, read_jsonl, write_atomic
from model import GPT, entropy_from_logits, lm_loss, logprobs_from_logits, response_forward


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/ppo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- models and data
    sft_ckpt: str = "out/sft/ckpt.pt"
    """policy init and frozen reference"""
    rm_ckpt: str = "out/rm/ckpt.pt"
    """frozen reward model, also the critic's init; 'none': --reward-fn alone, critic from the SFT trunk"""
    reward_fn: Optional[str] = None
    """module:function, fn(prompt: str, response: str, ended: bool) -> float, added to the RM score"""
    reward_fn_coef: float = 1.0
    """weight of --reward-fn in the score"""
    prompts: Optional[str] = None
    """PPO prompts JSONL, one {"prompt": str} a line (None: the built-in task's)"""
    ptx_data: Optional[str] = None
    """pre-training text JSONL {"text": str} for the ptx loss (None: the built-in task's text; none on user prompts)"""
    # --- rollout
    total_episodes: int = 12800
    """prompts sampled over the run (max_steps = total_episodes / rollout_batch_size unless --max-steps)"""
    rollout_batch_size: int = 64
    """prompts per iteration, summed over ranks (the experience buffer: small, as PPO-max advises)"""
    num_minibatches: int = 2
    """optimizer steps per PPO epoch (a minibatch is rollout_batch_size / num_minibatches)"""
    micro_batch_size: int = 32
    """rows per rank per forward, at most a rank's share of a minibatch (gradient accumulation makes up the rest)"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    max_new_tokens: int = 64
    """longest response; sampling uses the tempered distribution only (top-k/top-p would make the ratio off-policy)"""
    temperature: float = 1.0
    """sampling temperature; log-probs for the ratio and the KL use logits / temperature too"""
    missing_eos_penalty: float = -1.0
    """score of a response that does not end with EOS, in place of the RM score"""
    # --- reward and KL
    reward_norm: Literal["none", "scale", "norm"] = "norm"
    """normalise scores with running moments over all history: scale = s/std, norm = (s-mean)/std"""
    reward_clip: Optional[float] = 5.0
    """clip normalised scores to +-this (None: off)"""
    kl_coef: float = 0.3
    """beta of the per-token KL penalty (the initial value when --kl-target is set); 0.3 keeps the built-in task's
    valid fraction above 0.9 across retrained RMs (README, "Ablation": gold peaks at beta 0.03-0.3, by the RM)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimate in the penalty: k1 = logp - ref_logp, k3 = (r - 1) - log r with r = ref_p / p"""
    kl_target: Optional[float] = None
    """adaptive KL controller (Ziegler et al. 2019): target KL per sequence in nats (None: fixed --kl-coef)"""
    kl_horizon: int = 10000
    """adaptive KL controller horizon, in episodes"""
    # --- PPO
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    adv_whiten: Literal["minibatch", "rollout", "none"] = "minibatch"
    """whiten advantages with global statistics per minibatch (PPO-max), once per rollout (TRL), or not"""
    cliprange: float = 0.2
    """policy ratio clip epsilon"""
    cliprange_value: Optional[float] = 0.2
    """value clip around the rollout's values (None: off)"""
    entropy_coef: float = 0.0
    """entropy bonus weight"""
    ptx_coef: float = 0.1
    """weight of the LM loss on pre-training text (0: off)"""
    ptx_batch_size: int = 16
    """pre-training texts per optimizer step, summed over ranks (split like the minibatch)"""
    # --- optimisation
    lr: float = 5e-4
    """actor learning rate (linear warm-up once the critic warm-up is over, then cosine to 10%)"""
    critic_lr: float = 3e-4
    """critic learning rate (same schedule)"""
    warmup_steps: int = 5
    """learning-rate warm-up, in iterations"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (actor and critic)"""
    grad_clip: float = 1.0
    """actor grad-norm clip (0: off)"""
    critic_grad_clip: float = 1.0
    """critic grad-norm clip (0: off)"""
    critic_warmup_steps: int = 5
    """iterations at the start where only the critic trains"""
    # --- monitoring
    sample_every: int = 25
    """iterations between sample tables (TensorBoard text and samples.jsonl)"""
    collapse_window: int = 15
    """collapse detector: trailing window (iterations) each new KL, length and perplexity value is z-scored against"""
    collapse_z: float = 3.5
    """collapse detector: z-score that counts as a jump"""
    collapse_lag: int = 3
    """collapse detector: a KL jump and a length-up or perplexity-down jump this close together fire the alarm"""
    stop_on_collapse: bool = False
    """end the run when the alarm fires, keeping the last checkpoint saved before it"""


# -----------------------------------------------------------------------------
# PPO math: pure functions, imported by tests. Tensors are (B, T) over response tokens, mask 1.0 = real token.


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the valid entries."""
    return (x * mask).sum() / mask.sum()


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, mean=None, var=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the biased variance of the valid entries (or the given global mean/var);
    shift_mean=False adds the mean back. Padding entries are meaningless: mask them."""
    mean = masked_mean(x, mask) if mean is None else mean
    var = masked_mean((x - mean) ** 2, mask) if var is None else var
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, kl_estimator: str = "k1"):
    """scores (B,), the rest (B, T) -> (rewards, kl), both (B, T) and 0 on padding: rewards = -kl_coef * kl, plus the
    score on the last valid token (the EOS). KL estimators: http://joschu.net/blog/kl-approx.html"""
    log_ratio = logprobs - ref_logprobs
    if kl_estimator == "k1":
        kl = log_ratio
    elif kl_estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with r = ref_p / p: unbiased and >= 0
    else:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}")
    kl = kl * mask
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)  # (B,) index of the last real token
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask, kl


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2015) over right-padded rows; the value after the last valid
    token is 0. Returns (advantages, returns = advantages + values), 0 on padding."""
    rewards, values = rewards * mask, values * mask
    T = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else torch.zeros_like(lastgaelam)  # 0 past the end (masked)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = (delta + gamma * lam * lastgaelam) * mask[:, t]
        advantages[:, t] = lastgaelam
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float, denom=None):
    """Clipped surrogate: sum of max(-A*rho, -A*clip(rho, 1-eps, 1+eps)) / denom (default: valid count).
    stats: clipfrac (clipped term strictly larger), approx_kl (mean of (rho - 1) - log rho), ratio_mean."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = (torch.max(pg_losses, pg_losses2) * mask).sum() / (mask.sum() if denom is None else denom)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_losses2 > pg_losses).float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return pg_loss, stats


def ppo_value_loss(values, old_values, returns, mask, cliprange_value: Optional[float], denom=None):
    """0.5 * sum of max((v - R)^2, (old_v + clip(v - old_v, +-eps) - R)^2) / denom; cliprange_value None: no clip.
    stats: clipfrac (clipped term strictly larger)."""
    vf_losses = (values - returns) ** 2
    if cliprange_value is None:
        vf_losses2 = vf_losses
    else:
        vf_losses2 = (old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value) - returns) ** 2
    vf_loss = 0.5 * (torch.max(vf_losses, vf_losses2) * mask).sum() / (mask.sum() if denom is None else denom)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((vf_losses2 > vf_losses).float(), mask)}
    return vf_loss, stats


class RunningMoments:
    """Running mean and std of everything seen (parallel Welford / Chan et al.), merged across DDP ranks."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    @staticmethod
    def combine(parts: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        """Fold (count, mean, M2) triples into one (Chan et al. 1979); exact, order-independent up to rounding."""
        n, mean, m2 = 0.0, 0.0, 0.0
        for nb, mb, m2b in parts:
            if nb == 0:
                continue
            delta, tot = mb - mean, n + nb
            mean, m2, n = mean + delta * nb / tot, m2 + m2b + delta**2 * n * nb / tot, tot
        return n, mean, m2

    def update(self, x: torch.Tensor) -> None:
        """Add a batch: every rank's (count, mean, M2) is all-gathered and folded in rank order, so all ranks agree."""
        x = x.detach().double().flatten()
        local = torch.stack([torch.tensor(float(x.numel()), device=x.device), x.mean(), ((x - x.mean()) ** 2).sum()])
        parts = [local]
        if dist.is_initialized():
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local)
        parts = [(self.count, self.mean, self.m2)] + [tuple(p.tolist()) for p in parts]
        self.count, self.mean, self.m2 = self.combine(parts)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


class KLController:
    """beta of the KL penalty: fixed, or with a target the adaptive controller of Ziegler et al. 2019
    (https://arxiv.org/abs/1909.08593 §2.2): beta *= 1 + clip(KL/target - 1, +-0.2) * n/horizon, KL the mean over
    sequences of the summed k1, n the episodes of the iteration."""

    def __init__(self, kl_coef: float, target: Optional[float] = None, horizon: int = 10000):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_episodes: int) -> None:
        if self.target is not None:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_episodes / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class CollapseDetector:
    """The PPO-max paper's collapse signature (§5.2) is sudden: each iteration's KL, response length and perplexity are
    z-scored against the trailing window of the last `window` iterations (at least 3); the alarm is 1 while a KL jump
    up (z > z_threshold) and a length jump up or perplexity jump down (|z| > z_threshold) both lie within the last
    `lag` iterations. The std has a floor of 5% of the window's mean level, so a flat series does not alarm on noise,
    and of 1 nat for KL, so the first rise from KL = 0 when the actor starts moving is not a jump.
    Calibration on the built-in task: bench/ablation.py replays it on every run (README, "Ablation")."""

    KEYS = ("kl", "response_len", "perplexity")
    FLOOR = {"kl": 1.0, "response_len": 0.0, "perplexity": 0.0}  # absolute std floors, in each series' units

    def __init__(self, window: int = 15, z_threshold: float = 3.5, lag: int = 3):
        self.window, self.z_threshold, self.lag = window, z_threshold, lag
        self.history: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self.last_kl_jump, self.last_other_jump = -(10**9), -(10**9)

    def zscore(self, key: str) -> float:
        *trailing, current = self.history[key][-(self.window + 1) :]
        if len(trailing) < 3:
            return 0.0  # not enough history yet
        trailing = torch.tensor(trailing, dtype=torch.float64)
        std = torch.maximum(trailing.std(correction=0), 0.05 * trailing.mean().abs() + self.FLOOR[key] + 1e-8)
        return ((current - trailing.mean()) / std).item()

    def update(self, kl: float, response_len: float, perplexity: float) -> bool:
        for k, v in zip(self.KEYS, (kl, response_len, perplexity)):
            self.history[k].append(float(v))
        t = len(self.history["kl"])
        if self.zscore("kl") > self.z_threshold:
            self.last_kl_jump = t
        if self.zscore("response_len") > self.z_threshold or self.zscore("perplexity") < -self.z_threshold:
            self.last_other_jump = t
        return t - self.last_kl_jump < self.lag and t - self.last_other_jump < self.lag

    def state_dict(self) -> dict:
        return {"history": self.history, "last_kl_jump": self.last_kl_jump, "last_other_jump": self.last_other_jump}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.last_kl_jump, self.last_other_jump = state["last_kl_jump"], state["last_other_jump"]


# -----------------------------------------------------------------------------
# one iteration: rollout (steps 1-5) and update (step 6)


@torch.no_grad()
def rollout(
    policy,
    ref_policy,
    critic,
    reward_model,
    tok: Tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    kl_coef: float,
    kl_estimator: str,
    reward_moments: RunningMoments,
    reward_norm: str,
    reward_clip: Optional[float],
    missing_eos_penalty: float,
    gamma: float,
    lam: float,
    micro_batch_size: int,
    reward_fn: Optional[Callable] = None,
    reward_fn_coef: float = 1.0,
    gold_fn: Optional[Callable] = None,
    dtype=torch.float32,
):
    """Steps 1-5 on this rank's prompts. policy, ref_policy: GPTs with an LM head; critic: scalar head; reward_model:
    scalar head, or None (reward_fn alone). Returns (experience: dict of (B, ...) tensors, stats: global means keyed
    by DESIGN §6 tags plus logprob_err (generation vs training forward), samples: this rank's texts as dicts)."""
    device = next(policy.parameters()).device
    amp = common.autocast(device, dtype)
    # 1. generate with the KV cache from the tempered distribution (no top-k/top-p: the ratio must be on-policy)
    query, query_mask = (t.to(device) for t in pad_left([tok.encode(p) for p in prompts], tok.pad_id))
    with amp:
        response, mask, gen_logprobs = policy.generate(
            query, query_mask, max_new_tokens, tok.eos_id, tok.pad_id, temperature=temperature, generator=generator
        )
    B, P = query.shape
    # 2. generation stops each row at its first EOS and pads after it (mask includes the EOS); which rows ended
    last = mask.sum(1).long() - 1  # (B,) index of the last real response token
    ended = response.gather(1, last[:, None]).squeeze(1) == tok.eos_id
    # 3. no-grad passes of the training forward per micro-batch: old and reference log-probs, values, RM scores
    logprobs, ref_logprobs, values, entropy, rm_scores = [], [], [], [], []
    for i in range(0, B, micro_batch_size):
        q, qm, r, m = (t[i : i + micro_batch_size] for t in (query, query_mask, response, mask))
        with amp:
            logits, _ = response_forward(policy, q, qm, r, m, temperature)
            ref_logits, _ = response_forward(ref_policy, q, qm, r, m, temperature)
            values.append(response_forward(critic, q, qm, r, m, temperature)[1])
            if reward_model is not None:  # the RM reads its score at the last real token (the EOS)
                _, s = reward_model(torch.cat([q, r], 1), torch.cat([qm, m], 1), logits=False)
                rm_scores.append(s.float().gather(1, P + last[i : i + micro_batch_size, None]).squeeze(1))
        logprobs.append(logprobs_from_logits(logits, r))
        ref_logprobs.append(logprobs_from_logits(ref_logits, r))
        entropy.append(entropy_from_logits(logits))
    logprobs, ref_logprobs, values, entropy = (torch.cat(x) * mask for x in (logprobs, ref_logprobs, values, entropy))
    # the sampler's own log-probs must match the training forward's, or the first ratio is not 1
    lp_err = ((gen_logprobs - logprobs).abs() * mask).max().item()
    if dtype == torch.float32 and lp_err > 1e-4:
        raise RuntimeError(f"generation log-probs differ from the training forward by {lp_err:.2e} > 1e-4 in fp32")
    # score = RM (calibration folded into its head) + coef * reward_fn; a response without EOS gets the penalty instead
    texts = [tok.decode(response[b, : last[b] + 1]) for b in range(B)]
    scores = torch.cat(rm_scores) if rm_scores else torch.zeros(B, device=device)
    if reward_fn is not None:
        fn = [float(reward_fn(p, t, e)) for p, t, e in zip(prompts, texts, ended.tolist())]
        scores = scores + reward_fn_coef * torch.tensor(fn, device=device)
    scores = torch.where(ended, scores, torch.full_like(scores, missing_eos_penalty))
    # 4. rewards: running moments over all history and ranks, normalise, clip (PPO-max §3.2); KL penalty per token
    reward_moments.update(scores)
    score_norm = scores
    if reward_norm == "norm":
        score_norm = (scores - reward_moments.mean) / (reward_moments.std + 1e-8)
    elif reward_norm == "scale":
        score_norm = scores / (reward_moments.std + 1e-8)
    if reward_clip is not None:
        score_norm = score_norm.clamp(-reward_clip, reward_clip)
    rewards, _ = shape_rewards(score_norm, logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    # 5. GAE; returns = raw advantages + values
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)

    # global statistics: one all-reduce of sums
    gold = [gold_fn(p, t, e) for p, t, e in zip(prompts, texts, ended.tolist())] if gold_fn else [0.0] * B
    kl_seq = ((logprobs - ref_logprobs) * mask).sum(1)  # objective/kl is always the per-sequence sum of k1
    err = (returns - values) * mask
    sums = torch.stack(
        [
            torch.tensor(float(B), device=device),
            scores.sum(),
            score_norm.sum(),
            kl_seq.sum(),
            rewards.sum(),
            entropy.sum(),
            mask.sum(),
            -logprobs.sum(),
            ended.float().sum(),
            torch.tensor(float(sum(gold)), device=device),
            returns.sum(),
            (returns**2).sum(),
            err.sum(),
            (err**2).sum(),
        ]
    ).double()
    n, score, norm, kl, rlhf, ent, n_tok, nll, eos, gld, r1, r2, e1, e2 = common.all_reduce_sum(sums).tolist()
    var_r, var_err = r2 / n_tok - (r1 / n_tok) ** 2, e2 / n_tok - (e1 / n_tok) ** 2
    stats = {
        "objective/score": score / n,
        "objective/score_norm": norm / n,
        "objective/kl": kl / n,
        "objective/rlhf_reward": rlhf / n,
        "objective/entropy": ent / n_tok,
        "rollout/response_len": n_tok / n,
        "rollout/perplexity": math.exp(nll / n_tok),
        "rollout/eos_frac": eos / n,
        "value/explained_variance": 1 - var_err / max(var_r, 1e-12),
        "logprob_err": lp_err,
    }
    if gold_fn is not None:
        stats["objective/gold"] = gld / n
    exp = dict(
        query=query,
        query_mask=query_mask,
        response=response,
        mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
        scores=scores,
    )
    samples = [
        {"prompt": p, "response": t, "ended": e, "score": s, "gold": g if gold_fn else None}
        for p, t, e, s, g in zip(prompts, texts, ended.tolist(), scores.tolist(), gold)
    ]
    return exp, stats, samples


def _sync(model, sync: bool):
    """DDP's public no_sync() on the accumulation micro-steps; a plain module needs nothing."""
    return model.no_sync() if isinstance(model, DDP) and not sync else nullcontext()


def ppo_update(
    actor,
    critic,
    actor_optimizer,
    critic_optimizer,
    exp: dict,
    *,
    ppo_epochs: int,
    num_minibatches: int,
    micro_batch_size: int,
    cliprange: float,
    cliprange_value: Optional[float],
    temperature: float,
    adv_whiten: str = "minibatch",
    entropy_coef: float = 0.0,
    ptx_coef: float = 0.0,
    ptx_sampler: Optional[Callable] = None,
    grad_clip: float = 0.0,
    critic_grad_clip: float = 0.0,
    train_actor: bool = True,
    generator: Optional[torch.Generator] = None,
    dtype=torch.float32,
) -> dict:
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches, one optimizer step per
    minibatch for the critic and (unless train_actor is False: critic warm-up) the actor. actor and critic may be DDP
    or compiled modules. ptx_sampler() -> (inputs, targets, mask) of one micro-batch of pre-training text.
    Returns global means keyed by DESIGN §6 tags, plus `updates`, `skipped` and the first minibatch's `first/*`."""
    B, device, mask = exp["mask"].size(0), exp["mask"].device, exp["mask"]
    mb_rows = exact_div(B, num_minibatches, "rollout rows per rank over --num-minibatches")
    accum = exact_div(mb_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    amp = common.autocast(device, dtype)
    world = dist.get_world_size() if dist.is_initialized() else 1  # DDP averages gradients; the losses are global sums
    use_ptx = train_actor and ptx_coef > 0 and ptx_sampler is not None
    advantages = exp["advantages"]
    if adv_whiten == "rollout":  # once over the whole rollout with global statistics (TRL)
        n, s1, s2 = common.all_reduce_sum(torch.stack([mask.sum(), advantages.sum(), (advantages**2).sum()]).double())
        advantages = masked_whiten(advantages, mask, mean=(s1 / n).float(), var=(s2 / n - (s1 / n) ** 2).float())
    keys = ("pg_loss", "vf_loss", "ptx_loss", "approx_kl", "clipfrac", "ratio", "vf_clipfrac", "tokens")
    acc = {k: torch.zeros((), dtype=torch.float64, device=device) for k in keys}  # this rank's sums
    norms = {k: torch.zeros((), dtype=torch.float64, device=device) for k in ("actor", "critic")}
    first, n_steps, skipped = {}, 0, 0
    lengths = mask.sum(1).long().tolist()  # one host sync: each micro-batch trims its right padding to its longest row
    for epoch in range(ppo_epochs):
        perm = torch.randperm(B, generator=generator, device=generator.device if generator else "cpu")
        perm_list, perm = perm.tolist(), perm.to(device)
        for mb in range(num_minibatches):
            rows = perm[mb * mb_rows : (mb + 1) * mb_rows]
            ptx = [ptx_sampler() for _ in range(accum)] if use_ptx else []
            # the step's global token counts (loss denominators) and whitening statistics: one all-reduce per step
            m, a = mask[rows], advantages[rows]
            ptx_tokens = sum((p[2].sum() for p in ptx), torch.zeros((), device=device))
            n_tok, s1, s2, n_ptx = common.all_reduce_sum(
                torch.stack([m.sum(), a.sum(), (a**2).sum(), ptx_tokens]).double()
            )
            adv_mean, adv_var = (s1 / n_tok).float(), (s2 / n_tok - (s1 / n_tok) ** 2).float()
            n_tok, n_ptx = n_tok.float(), n_ptx.float()
            for j in range(accum):
                idx, sync = rows[j * micro_batch_size : (j + 1) * micro_batch_size], j == accum - 1
                at = mb * mb_rows + j * micro_batch_size
                T = max(lengths[i] for i in perm_list[at : at + micro_batch_size])  # no host sync
                q, qm, r, m = exp["query"][idx], exp["query_mask"][idx], exp["response"][idx, :T], mask[idx, :T]
                old_logprobs, adv = exp["logprobs"][idx, :T], advantages[idx, :T]
                if adv_whiten == "minibatch":  # PPO-max: global statistics over the whole minibatch
                    adv = masked_whiten(adv, m, mean=adv_mean, var=adv_var)
                if train_actor:
                    if use_ptx:  # LM loss on pre-training text (InstructGPT's PPO-ptx); never the syncing backward
                        with _sync(actor, False), amp:
                            ptx_loss = lm_loss(actor(ptx[j][0])[0], ptx[j][1], ptx[j][2], denom=n_ptx)
                        (ptx_coef * ptx_loss * world).backward()
                        acc["ptx_loss"] += ptx_loss.detach()
                    with _sync(actor, sync), amp:
                        logits, _ = response_forward(actor, q, qm, r, m, temperature)
                        logprobs = logprobs_from_logits(logits, r)
                        pg_loss, st = ppo_policy_loss(logprobs, old_logprobs, adv, m, cliprange, denom=n_tok)
                        loss = (
                            pg_loss - entropy_coef * (entropy_from_logits(logits) * m).sum() / n_tok
                            if entropy_coef > 0
                            else pg_loss
                        )
                    (loss * world).backward()
                    acc["pg_loss"] += pg_loss.detach()
                    for k, key in (("approx_kl", "approx_kl"), ("clipfrac", "clipfrac"), ("ratio", "ratio_mean")):
                        acc[k] += st[key] * m.sum()
                    if epoch == 0 and mb == 0 and j == 0:  # must be ratio 1, approx_kl 0, clipfrac 0 (DESIGN §5)
                        first = {
                            "first/ratio_err": ((logprobs - old_logprobs).exp().sub(1).abs() * m).max().item(),
                            "first/approx_kl": st["approx_kl"].item(),
                            "first/clipfrac": st["clipfrac"].item(),
                        }
                with _sync(critic, sync), amp:
                    _, v = response_forward(critic, q, qm, r, m, temperature)
                    vf_loss, vst = ppo_value_loss(
                        v, exp["values"][idx, :T], exp["returns"][idx, :T], m, cliprange_value, denom=n_tok
                    )
                (vf_loss * world).backward()
                acc["vf_loss"] += vf_loss.detach()
                acc["vf_clipfrac"] += vst["clipfrac"] * m.sum()
                acc["tokens"] += m.sum()
            # separate optimizers and clips; a non-finite norm (the same on every rank after the all-reduce) skips
            for name, model, opt, clip in (
                ("actor", actor, actor_optimizer, grad_clip),
                ("critic", critic, critic_optimizer, critic_grad_clip),
            ):
                if name == "critic" or train_actor:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
                    if torch.isfinite(norm):  # the step's one host sync
                        opt.step()
                        norms[name] += norm
                    else:  # name the bad quantity (the loss sums are this rank's)
                        skipped += 1
                        losses = ", ".join(f"{k} {acc[k].item():.3g}" for k in ("pg_loss", "vf_loss", "ptx_loss"))
                        common.print0(f"non-finite {name} grad norm ({norm.item()}; {losses}): step skipped")
                opt.zero_grad(set_to_none=True)
            n_steps += 1
    g = dict(zip(keys, common.all_reduce_sum(torch.stack([acc[k] for k in keys])).tolist()))
    tokens = max(g["tokens"], 1.0)
    return {
        "policy/loss": g["pg_loss"] / n_steps,
        "value/loss": g["vf_loss"] / n_steps,
        "ptx/loss": g["ptx_loss"] / n_steps,
        "policy/approx_kl": g["approx_kl"] / tokens,
        "policy/clipfrac": g["clipfrac"] / tokens,
        "policy/ratio_mean": g["ratio"] / tokens if train_actor else 1.0,
        "value/clipfrac": g["vf_clipfrac"] / tokens,
        "train/grad_norm": norms["actor"].item() / n_steps,
        "value/grad_norm": norms["critic"].item() / n_steps,
        "updates": n_steps,
        "skipped": skipped,
        **first,
    }


# -----------------------------------------------------------------------------
# main


def load_reward_fn(spec: str) -> Callable:
    """--reward-fn module:function -> the function."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as e:
        raise UserError(f"--reward-fn {spec}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise UserError(f"--reward-fn {spec}: expected module:function, e.g. data:gold_reward")
    return fn


CONSOLE = (
    "objective/score",
    "objective/gold",
    "objective/kl",
    "rollout/response_len",
    "rollout/perplexity",
    "objective/entropy",
    "policy/approx_kl",
    "policy/clipfrac",
    "value/explained_variance",
    "collapse/alarm",
    "perf/rollout_s",
    "perf/update_s",
)


def main(args: Args) -> None:
    t_start = time.time()
    # 1. checkpoints, tokenizer, models, data (user mistakes surface here, before any process group)
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: PPO samples from the tempered distribution; use > 0")
    if args.rm_ckpt == "none" and args.reward_fn is None:
        raise UserError("--rm-ckpt none needs --reward-fn module:function (e.g. data:gold_reward)")
    sft = common.load_checkpoint(args.sft_ckpt, kind=("sft", "ppo"), flag="--sft-ckpt")
    rm = None if args.rm_ckpt == "none" else common.load_checkpoint(args.rm_ckpt, kind="rm", flag="--rm-ckpt")
    if rm is not None and rm["tokenizer"] != sft["tokenizer"]:
        raise UserError(
            f"--rm-ckpt {args.rm_ckpt}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s "
            "(train the RM from this SFT checkpoint)"
        )
    tok = Tokenizer.from_state(sft["tokenizer"])
    reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else None
    actor, ref_policy = GPT.from_checkpoint(sft), GPT.from_checkpoint(sft)
    reward_model = None if rm is None else GPT.from_checkpoint(rm)
    # PPO-max: the critic starts from the RM (or, with no RM, from the SFT trunk with a fresh head)
    critic, _, _ = hf.load_init(args.rm_ckpt if rm else args.sft_ckpt, score_head=True, lm_head=False)
    builtin, block = args.prompts is None, actor.config.block_size
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    prompts = [r["prompt"] for r in read_jsonl(task["prompts"] if builtin else args.prompts, "prompts")]
    n_all, prompts = len(prompts), [p for p in prompts if len(tok.encode(p)) + args.max_new_tokens <= block]
    if not prompts:
        raise UserError(
            f"every prompt is longer than the context minus --max-new-tokens ({block} - {args.max_new_tokens} tokens)"
        )
    ptx_path = args.ptx_data or (task["pretrain"] if builtin else None)
    ptx = encode_sft(tok, read_jsonl(ptx_path, "text"), block, mask_prompt=False)[0] if ptx_path else []
    gold_fn = gold_reward if builtin else None

    # 2. distributed set-up, sizes, optimizers, state
    # sizes first, against the launched world size: a mistake ends here, before any process group
    world = common.launched_world_size()
    per_rank = exact_div(args.rollout_batch_size, world, "--rollout-batch-size over the world size")
    mb_rows = exact_div(per_rank, args.num_minibatches, "--rollout-batch-size/world_size over --num-minibatches")
    mbs = min(args.micro_batch_size, mb_rows)  # a micro-batch never exceeds a rank's share of the minibatch
    accum = exact_div(mb_rows, mbs, "minibatch rows per rank over --micro-batch-size")
    ptx_micro = (
        exact_div(args.ptx_batch_size, world * accum, "--ptx-batch-size over world_size * accum steps")
        if ptx and args.ptx_coef > 0
        else 0
    )  # checked only when there is a ptx loss to compute
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    print0(
        f"ppo: {len(prompts)} prompts ({n_all - len(prompts)} too long, skipped) | {len(ptx)} ptx texts | actor "
        f"{actor.num_params() / 1e6:.2f} M, critic {critic.num_params() / 1e6:.2f} M | rollout "
        f"{args.rollout_batch_size} = {d.world_size} ranks x {args.num_minibatches} minibatches x {accum} accum x "
        f"{mbs} | {max_steps} iterations | rm {args.rm_ckpt} | device {d.device} {dtype}"
    )
    common.seed_everything(args.seed)
    for m in (actor, ref_policy, critic, reward_model):
        if m is not None:
            m.to(d.device).eval()  # eval mode always: dropout off in all four models
    for m in (ref_policy, reward_model):
        if m is not None:
            m.requires_grad_(False)
    actor_opt = actor.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    critic_opt = critic.configure_optimizers(args.weight_decay, args.critic_lr, (0.9, 0.95), d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)  # sampling and shuffling
    kl_ctl = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
    moments, detector = RunningMoments(), CollapseDetector(args.collapse_window, args.collapse_z, args.collapse_lag)
    prompt_order, ptx_order = Order(len(prompts), args.seed), Order(max(1, len(ptx)), args.seed + 1)
    step, seconds, updates, skipped = 0, 0.0, 0, 0
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    hashes = {
        "sft_hash": common.file_sha256(args.sft_ckpt),
        "rm_hash": common.file_sha256(args.rm_ckpt) if rm else None,
    }
    if args.resume:
        inputs = {"sft_hash": ("--sft-ckpt", hashes["sft_hash"]), "rm_hash": ("--rm-ckpt", hashes["rm_hash"])}
        ck = common.load_resume(ckpt_path, "ppo", d.world_size, max_steps, inputs)
        for obj, key in (
            (actor, "model"),
            (critic, "critic"),
            (actor_opt, "optimizer"),
            (critic_opt, "critic_optimizer"),
            (moments, "reward_moments"),
            (kl_ctl, "kl_ctl"),
        ):
            obj.load_state_dict(ck[key])
        ds = ck["data_state"]
        detector.load_state_dict(ds["collapse"])
        prompt_order, ptx_order = Order(**ds["prompts"]), Order(**ds["ptx"])
        step, seconds, updates, skipped = ck["step"], ck["seconds"], ds["updates"], ds["skipped"]
        common.set_rng_state(ck["rng"][d.rank], sampler)
        print0(f"resumed from {ckpt_path} at step {step}")
    # the training forward (compiled on CUDA) also serves the no-grad rollout passes; DDP wraps it for the update
    compiled = d.device.type == "cuda" and args.compile
    actor_fwd, critic_fwd, ref_fwd, rm_fwd = (
        torch.compile(m) if compiled and m is not None else m for m in (actor, critic, ref_policy, reward_model)
    )
    ids = [d.local_rank] if d.device.type == "cuda" else None
    actor_ddp, critic_ddp = (DDP(m, device_ids=ids) if d.ddp else m for m in (actor_fwd, critic_fwd))
    logger = common.Logger(args.out_dir, d.master, purge_step=step if args.resume else None)
    peak = common.peak_flops(d.device, args.peak_flops)

    def ptx_sampler():
        """This rank's slice of the next global ptx micro-batch: (inputs, targets, target mask)."""
        rows = ptx_order.take(ptx_micro * d.world_size)[d.rank * ptx_micro : (d.rank + 1) * ptx_micro]
        x, _ = pad_right([ptx[i][0] for i in rows], tok.pad_id)
        y, _ = pad_right([ptx[i][1] for i in rows], 0)
        return x[:, :-1].to(d.device), x[:, 1:].to(d.device), y[:, 1:].float().to(d.device)

    def save(step: int) -> None:
        rngs = common.all_rng_states(sampler)
        if d.master:
            sched = dict(warmup_steps=args.warmup_steps, max_steps=max_steps, delay=args.critic_warmup_steps)
            common.save_checkpoint(
                dict(
                    kind="ppo",
                    model=actor.state_dict(),
                    model_config=asdict(actor.config),
                    tokenizer=tok.state(),
                    args=asdict(args),
                    step=step,
                    optimizer=actor_opt.state_dict(),
                    scheduler=sched | {"lr": args.lr},
                    rng=rngs,
                    data_state=dict(
                        prompts=prompt_order.state_dict(),
                        ptx=ptx_order.state_dict(),
                        collapse=detector.state_dict(),
                        updates=updates,
                        skipped=skipped,
                    ),
                    world_size=d.world_size,
                    seconds=seconds + time.time() - t_start,
                    critic=critic.state_dict(),
                    critic_config=asdict(critic.config),
                    critic_optimizer=critic_opt.state_dict(),
                    critic_scheduler=sched | {"lr": args.critic_lr, "delay": 0},
                    reward_moments=moments.state_dict(),
                    kl_ctl=kl_ctl.state_dict(),
                    **hashes,
                ),
                ckpt_path,
            )

    # 3. the loop: rollout (steps 1-5), update (6), then log, samples, collapse check, checkpoint (7)
    first, start_step, samples, bad_in_row = {}, step, [], 0
    show = lambda s: f"{s['prompt']}{s['response']}{'' if s['ended'] else ' [no EOS]'}"  # noqa: E731
    samples_path = os.path.join(args.out_dir, "samples.jsonl")
    if d.master:  # a fresh run starts a fresh sample file; a resumed one drops what came after its checkpoint
        os.makedirs(args.out_dir, exist_ok=True)
        kept = []
        if args.resume and os.path.exists(samples_path):
            with open(samples_path) as f:
                kept = [x for x in f if x.endswith("\n") and json.loads(x)["step"] <= step]
        write_atomic(samples_path, "".join(kept))
    while step < max_steps:
        t0 = time.time()
        rows = prompt_order.take(args.rollout_batch_size)[d.rank * per_rank : (d.rank + 1) * per_rank]
        exp, stats, samples = rollout(
            actor_fwd,
            ref_fwd,
            critic_fwd,
            rm_fwd,
            tok,
            [prompts[i] for i in rows],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            generator=sampler,
            kl_coef=kl_ctl.value,
            kl_estimator=args.kl_estimator,
            reward_moments=moments,
            reward_norm=args.reward_norm,
            reward_clip=args.reward_clip,
            missing_eos_penalty=args.missing_eos_penalty,
            gamma=args.gamma,
            lam=args.lam,
            micro_batch_size=mbs,
            reward_fn=reward_fn,
            reward_fn_coef=args.reward_fn_coef,
            gold_fn=gold_fn,
            dtype=dtype,
        )
        kl_coef = kl_ctl.value
        kl_ctl.update(stats["objective/kl"], args.rollout_batch_size)
        t1 = time.time()
        # the actor's schedule starts when it starts moving, after the critic warm-up
        lr = common.lr_at(
            max(0, step - args.critic_warmup_steps), max_steps - args.critic_warmup_steps, args.lr, args.warmup_steps
        )
        critic_lr = common.lr_at(step, max_steps, args.critic_lr, args.warmup_steps)
        for opt, value in ((actor_opt, lr), (critic_opt, critic_lr)):
            for group in opt.param_groups:
                group["lr"] = value
        upd = ppo_update(
            actor_ddp,
            critic_ddp,
            actor_opt,
            critic_opt,
            exp,
            ppo_epochs=args.ppo_epochs,
            num_minibatches=args.num_minibatches,
            micro_batch_size=mbs,
            cliprange=args.cliprange,
            cliprange_value=args.cliprange_value,
            temperature=args.temperature,
            adv_whiten=args.adv_whiten,
            entropy_coef=args.entropy_coef,
            ptx_coef=args.ptx_coef if ptx else 0.0,
            ptx_sampler=ptx_sampler,
            grad_clip=args.grad_clip,
            critic_grad_clip=args.critic_grad_clip,
            train_actor=step >= args.critic_warmup_steps,
            generator=sampler,
            dtype=dtype,
        )
        first = first or {k: v for k, v in upd.items() if k.startswith("first/")}
        step, updates, skipped = step + 1, updates + upd["updates"], skipped + upd["skipped"]
        bad_in_row = bad_in_row + 1 if upd["skipped"] else 0
        if bad_in_row >= 10:  # the checkpoint saved before these stays the last good one
            raise RuntimeError(
                f"non-finite gradients in {bad_in_row} iterations in a row: lower --lr/--critic-lr or check the reward"
            )
        t2 = time.time()

        # 7. monitoring; the collapse detector watches the actor's moves only (after the critic warm-up)
        alarm = step > args.critic_warmup_steps and detector.update(
            stats["objective/kl"], stats["rollout/response_len"], stats["rollout/perplexity"]
        )
        # FLOPs: a forward is ~1/3 of training; generation + old + ref (actor-sized), critic + RM, then the epochs
        L = exp["query"].size(1) + exp["mask"].size(1)
        fa, fc = actor.flops_per_token(L), critic.flops_per_token(L)
        flops = exp["mask"].size(0) * L * d.world_size * ((3 * fa + 2 * fc) / 3 + args.ppo_epochs * (fa + fc))
        metrics = {k: v for k, v in (stats | upd).items() if "/" in k and not k.startswith("first/")} | {
            "train/lr": lr,
            "train/critic_lr": critic_lr,
            "train/kl_coef": kl_coef,
            "train/updates": updates,
            "train/skipped_steps": skipped,
            "collapse/alarm": float(alarm),
            "perf/rollout_s": t1 - t0,
            "perf/update_s": t2 - t1,
            "perf/tokens_per_sec": exp["mask"].size(0) * L * d.world_size / (t2 - t0),
            "perf/mfu": flops / (t2 - t0) / (peak * d.world_size),
        }
        if step == start_step + 1:  # the first iteration of this process: how close sampler and trainer agree
            print0(f"step {step}: generation vs training-forward log-probs, max |diff| {stats['logprob_err']:.1e}")
        logger.log(step, metrics, console=False)
        if step % args.log_every == 0 or step == max_steps or alarm:
            print0(
                " | ".join(
                    [f"step {step:05d}/{max_steps:05d}"]
                    + [f"{k.split('/')[-1]} {common._fmt(metrics[k])}" for k in CONSOLE if k in metrics]
                )
            )
        if d.master and (step % args.sample_every == 0 or step == max_steps):
            logger.text(
                "samples",
                "\n\n".join(
                    f"{show(s)} | score {s['score']:.2f}" + (f" | gold {s['gold']:.2f}" if gold_fn else "")
                    for s in samples[:8]
                ),
                step,
            )
            with open(samples_path, "a") as f:
                f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples[:16])
        if alarm and args.stop_on_collapse:
            print0(f"collapse alarm at step {step}: stopping (the last checkpoint saved before it is kept)")
            break
        if (args.save_every and step % args.save_every == 0) or step == max_steps:
            save(step)

    # 4. a few samples to look at
    for s in samples[:5]:
        print0(f"  {show(s)}  (score {s['score']:.2f})")
    if args.export_hf and d.master:
        common.export_hf(actor, tok, args.export_hf)
    print0(
        f"ppo done in {time.time() - t_start:.0f}s: {ckpt_path} | first minibatch of the first update: "
        + ", ".join(f"{k[6:]} {v:.1e}" for k, v in first.items())
    )
    logger.close()
    common.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
