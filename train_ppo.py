"""PPO-max: reinforcement learning from a reward model with every stabilising trick of Zheng et al. (2023) inline.

Each iteration samples responses from the policy (actor), scores them with the frozen reward model, subtracts a
per-token KL penalty against the frozen SFT policy (reference), estimates advantages with GAE from a critic that
starts from the reward model, and takes clipped PPO steps on the actor and the critic, plus an LM loss on
pre-training text (ptx). The PPO-max tricks: reward normalisation and clipping over running moments, the KL penalty,
advantage whitening per minibatch, value clipping, critic initialisation from the RM and critic warm-up, grad-norm
clipping, ptx, and a collapse detector over the monitoring metrics.
Paper: https://arxiv.org/abs/2307.04964 (Secrets of RLHF in Large Language Models Part I: PPO).
The critic-free estimators of DESIGN §5b are one flag away (--adv-estimator grpo | rloo | reinforce_pp: G responses
per prompt, no critic), with DAPO's clip-higher, dynamic sampling and overlong filtering, dual-clip and the loss
aggregations as flags; estimator-dependent defaults resolve in resolve_estimator_defaults and are printed at start-up.

python train_ppo.py                                                   # built-in task, CPU, ~4 min (after SFT and RM)
python train_ppo.py --rm-ckpt none --reward-fn data:gold_reward       # optimise the gold reward itself, no RM
python train_ppo.py --adv-estimator grpo                              # GRPO: groups of 4, k3 KL in the loss
python train_ppo.py --adv-estimator grpo --no-grpo-std-norm --loss-agg seq_sum_norm   # Dr. GRPO
torchrun --standalone --nproc_per_node 8 train_ppo.py --sft-ckpt sft/ckpt.pt --rm-ckpt rm/ckpt.pt --prompts p.jsonl
"""

import copy
import importlib
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
import tyro

import common
import hf
from common import UserError, exact_div, print0
from data import Order, Tokenizer, encode_sft, pad_left, pad_right, read_jsonl
from lora import BaseView
from model import entropy_from_logits, lm_loss, logprobs_from_logits, response_forward
from task import build_task, gold_reward


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
    """responses (episodes) sampled over the run (max_steps = total_episodes / rollout_batch_size unless --max-steps)"""
    rollout_batch_size: int = 64
    """responses per iteration, summed over ranks (the experience buffer: small, as PPO-max advises); prompts per
    iteration = rollout_batch_size / group_size"""
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
    # --- advantage estimator (DESIGN §5b); an Optional flag left at None takes the estimator's default, printed at
    # start-up (resolve_estimator_defaults)
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"
    """gae: PPO-max (critic, GAE); grpo, rloo, reinforce_pp (REINFORCE++): critic-free, no critic is built"""
    group_size: Optional[int] = None
    """responses sampled per prompt, consecutive rows of one rank (None: 4 for grpo/rloo, 1 for gae/reinforce_pp)"""
    grpo_std_norm: bool = True
    """grpo: divide by the group's std (--no-grpo-std-norm: Dr. GRPO, with --loss-agg seq_sum_norm)"""
    mask_truncated: bool = False
    """DAPO overlong filtering: responses without EOS keep their score but contribute nothing to the policy loss"""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (group_size > 1): a group whose G scores are all equal carries no signal; sample fresh
    groups until the iteration has rollout_batch_size / G informative ones or --max-sample-rounds are spent (then the
    first round's other groups fill the batch without a policy loss)"""
    max_sample_rounds: int = 3
    """dynamic sampling: the most rollouts per iteration"""
    # --- reward and KL
    reward_norm: Optional[Literal["none", "scale", "norm"]] = None
    """normalise scores with running moments over all history: scale = s/std, norm = (s-mean)/std (None: norm for
    gae/reinforce_pp, none for grpo/rloo)"""
    reward_clip: Optional[float] = 5.0
    """clip normalised scores to +-this (None: off); grpo/rloo use raw scores, unclipped, unless --reward-norm is
    given"""
    kl_coef: Optional[float] = None
    """beta of the KL penalty (the initial value when --kl-target is set; None: the estimator's default, see
    ESTIMATOR_DEFAULTS); gae's 0.3 keeps the built-in task's valid fraction above 0.9 across retrained RMs (README,
    "Ablation": gold peaks at beta 0.03-0.3, by the RM)"""
    kl_penalty: Optional[Literal["reward", "loss"]] = None
    """where the KL goes: -beta*kl in the rewards, or beta*k3 on the current log-probs in the policy loss (None: loss
    for grpo, reward for the others)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimate in the reward penalty: k1 = logp - ref_logp, k3 = (r - 1) - log r with r = ref_p / p (the
    loss penalty is always k3)"""
    kl_target: Optional[float] = None
    """adaptive KL controller (Ziegler et al. 2019): target KL per sequence in nats (None: fixed --kl-coef)"""
    kl_horizon: int = 10000
    """adaptive KL controller horizon, in episodes"""
    # --- PPO
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    adv_whiten: Optional[Literal["minibatch", "rollout", "none"]] = None
    """whiten advantages with global statistics per minibatch (PPO-max), once per rollout (TRL), or not (None:
    minibatch for gae, rollout for reinforce_pp (the method), none for grpo/rloo)"""
    loss_agg: Optional[Literal["token_mean", "seq_mean", "seq_sum_norm"]] = None
    """policy loss over the step's global batch: mean over tokens, mean over sequences of their token mean, or sum
    over tokens / (max_new_tokens * sequences) (Dr. GRPO) (None: seq_mean for grpo, token_mean for the others)"""
    cliprange: float = 0.2
    """policy ratio clip epsilon"""
    cliprange_high: Optional[float] = None
    """DAPO clip-higher: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] (None: cliprange)"""
    dual_clip: Optional[float] = None
    """dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the per-token loss is capped at -c*A (None: off)"""
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
    """iterations at the start where only the critic trains (gae only: critic-free estimators train from the first)"""
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


# DESIGN §5b's table: what an estimator-dependent flag left at None becomes. beta in the loss (k3) and in the reward
# (k1, on raw scores for rloo) are not on the same scale. Measured on the built-in task (make demo's SFT and RM,
# 12,800 episodes, eval.py on 512 held-out prompts, one seed; SFT gold 0.04, PPO-max 0.69 at KL 2.3):
# grpo beta 0.15 / 0.2 / 0.3 / 0.6 -> gold 0.59 / 0.56 / 0.51 / 0.38 at KL 2.8 / 2.3 / 1.4 / 0.5 nats, valid_frac
# 0.92-0.95 (beta 0.1: KL 4.2 and valid_frac 0.85 after 3,200 episodes already); rloo beta 0.3 / 0.6 -> gold
# 0.63 / 0.55 at KL 1.9 / 1.1, valid_frac 0.93 / 0.94 (beta 0.1: valid_frac 0.86 after 3,200). reinforce_pp keeps
# gae's 0.3 (normalised scores, like gae), not tuned.
ESTIMATOR_DEFAULTS = {
    "gae": dict(
        group_size=1,
        kl_penalty="reward",
        kl_coef=0.3,
        reward_norm="norm",
        adv_whiten="minibatch",
        loss_agg="token_mean",
    ),
    "reinforce_pp": dict(
        group_size=1, kl_penalty="reward", kl_coef=0.3, reward_norm="norm", adv_whiten="rollout", loss_agg="token_mean"
    ),
    "rloo": dict(
        group_size=4, kl_penalty="reward", kl_coef=0.3, reward_norm="none", adv_whiten="none", loss_agg="token_mean"
    ),
    "grpo": dict(
        group_size=4, kl_penalty="loss", kl_coef=0.15, reward_norm="none", adv_whiten="none", loss_agg="seq_mean"
    ),
}


def resolve_estimator_defaults(args: Args) -> Args:
    """A copy of args where every estimator-dependent flag left at None holds ESTIMATOR_DEFAULTS[args.adv_estimator].
    Idempotent (main, rollout and ppo_update all call it). Two settings follow the estimator rather than default: a
    critic-free estimator has no critic warm-up, and grpo/rloo clip only scores they normalise (--reward-clip applies
    to them only when --reward-norm is given)."""
    defaults = ESTIMATOR_DEFAULTS[args.adv_estimator]
    resolved = {}
    for key, default in defaults.items():
        given = getattr(args, key)
        resolved[key] = default if given is None else given
    if args.adv_estimator != "gae":
        resolved["critic_warmup_steps"] = 0
    if args.adv_estimator in ("grpo", "rloo") and args.reward_norm is None:
        resolved["reward_clip"] = None
    return replace(args, **resolved)


def uses_critic(args: Args) -> bool:
    """Only gae has a critic: the critic-free estimators build, step and save none."""
    return args.adv_estimator == "gae"


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


def normalize_scores(scores, mean: float, std: float, mode: str, clip: Optional[float]) -> torch.Tensor:
    """PPO-max §3.2: scores (B,) normalised with running moments, then clipped to +-clip (None: no clip). mode none |
    scale = s/std | norm = (s - mean)/std. A std under 1e-6 (every score seen so far equal: all responses missing EOS,
    an all-invalid batch under --reward-fn) gives no scale to divide by and counts as 1, never s/1e-8."""
    scale = std + 1e-8 if std > 1e-6 else 1.0
    if mode == "norm":
        scores = (scores - mean) / scale
    elif mode == "scale":
        scores = scores / scale
    elif mode != "none":
        raise ValueError(f"unknown reward normalisation {mode!r}")
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


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


def reward_to_go(rewards, mask, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns: rewards, mask (B, T) -> (B, T) sum over t' >= t of gamma^(t'-t) * rewards[t'] within each
    right-padded row, 0 on padding."""
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.size(1))):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def compute_group_advantages(scores, group_size: int, estimator: str, std_norm: bool = True) -> torch.Tensor:
    """scores (N,) = the R_i of DESIGN §5b, rows g*G .. g*G+G-1 one prompt's group -> advantages (N,).
    rloo: R_i - mean over the group's other responses (G >= 2); grpo: (R_i - group mean) / (group std + 1e-4),
    unbiased std, without the division when std_norm is False (Dr. GRPO); reinforce_pp: R_i - group mean (the
    group baseline of REINFORCE++ with G > 1)."""
    grouped = scores.view(-1, group_size)  # (N / G, G)
    if estimator == "rloo":
        others_mean = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        advantages = grouped - others_mean
    elif estimator in ("grpo", "reinforce_pp"):
        advantages = grouped - grouped.mean(1, keepdim=True)
        if estimator == "grpo" and std_norm:
            advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    else:
        raise ValueError(f"no group advantage for estimator {estimator!r}")
    return advantages.flatten()


def informative_groups(scores, group_size: int) -> torch.Tensor:
    """scores (N,), rows g*G .. g*G+G-1 one group -> (N / G,) bool: the group's scores are not all equal (DAPO's
    dynamic sampling keeps these: a group of ties has no advantage to learn from)."""
    grouped = scores.view(-1, group_size)  # (N / G, G)
    return (grouped != grouped[:, :1]).any(1)


def loss_weights(mask, agg: str, n_seq, n_tok, max_new_tokens: int) -> torch.Tensor:
    """mask (B, T) -> per-token weights (B, T) holding the mask and every denominator, so that sum(loss * weights) over
    all micro-batches and ranks of an optimizer step is its loss. n_seq, n_tok: the step's global counts of kept
    sequences and tokens. token_mean: mask / n_tok; seq_mean: mask / (len_i * n_seq); seq_sum_norm:
    mask / (max_new_tokens * n_seq) (Dr. GRPO)."""
    if agg == "token_mean":
        return mask / n_tok
    if agg == "seq_mean":
        lengths = mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1); an empty row has weight 0 anyway
        return mask / (lengths * n_seq)
    if agg == "seq_sum_norm":
        return mask / (max_new_tokens * n_seq)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def ppo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cliprange: float,
    denom=None,
    weights=None,
    cliprange_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
):
    """Clipped surrogate, per token l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps_high)), eps_high = cliprange_high or
    cliprange (DAPO clip-higher); with dual_clip c > 1, l = min(l, -c*A) where A < 0 (Ye et al. 2020). All (B, T).
    Returns sum(l * weights) when weights are given (loss_weights), else sum(l * mask) / denom (default: valid count).
    stats: clipfrac (clipped term strictly larger), clipfrac_low / clipfrac_high (the part with rho below / above the
    range), approx_kl (mean of (rho - 1) - log rho), ratio_mean."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    upper = 1.0 + (cliprange if cliprange_high is None else cliprange_high)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, upper)
    token_losses = torch.max(pg_losses, pg_losses2)
    if dual_clip is not None:
        capped = torch.min(token_losses, -dual_clip * advantages)
        token_losses = torch.where(advantages < 0, capped, token_losses)
    if weights is not None:
        pg_loss = (token_losses * weights).sum()
    else:
        pg_loss = (token_losses * mask).sum() / (mask.sum() if denom is None else denom)
    with torch.no_grad():
        clipped = pg_losses2 > pg_losses
        stats = {
            "clipfrac": masked_mean(clipped.float(), mask),
            "clipfrac_low": masked_mean((clipped & (ratio < 1.0 - cliprange)).float(), mask),
            "clipfrac_high": masked_mean((clipped & (ratio > upper)).float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return pg_loss, stats


def kl_loss(logprobs, ref_logprobs, weights, kl_coef: float) -> torch.Tensor:
    """--kl-penalty loss (GRPO): kl_coef * sum(k3 * weights), k3 = (r - 1) - log r with r = ref_p / p per token on the
    current log-probs (B, T), differentiable in logprobs; weights (B, T) from loss_weights (0 on padding)."""
    log_ratio = ref_logprobs - logprobs
    k3 = torch.expm1(log_ratio) - log_ratio
    return kl_coef * (k3 * weights).sum()


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
#
# How the two orchestration functions get their settings: the run's `Args`, passed whole and only read, so a new PPO
# flag is a two-place edit (its field in Args, and the line that uses it). What changes while the run goes (models,
# optimizers, the KL coefficient, the reward moments, the sampling generator) and sizes derived from the flags
# (micro_batch_size) are explicit arguments. The math above stays pure: tensors and numbers in, never `args`.


@torch.no_grad()
def rollout(
    policy,
    ref_policy,
    critic,
    reward_model,
    tok: Tokenizer,
    prompts: list[str],
    args: Args,
    *,
    micro_batch_size: int,
    generator: torch.Generator,
    kl_coef: float,
    reward_moments: RunningMoments,
    reward_fn: Optional[Callable] = None,
    gold_fn: Optional[Callable] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's prompts (a group's G copies of a prompt consecutive). policy, ref_policy: GPTs with an
    LM head; critic: scalar head, or None (critic-free estimators: no values, returns or value metrics); reward_model:
    scalar head, or None (reward_fn alone). Settings are read from args (see above).
    Returns (experience: dict of (B, ...) tensors, metrics: global means keyed by DESIGN §6 tags, samples: this
    rank's texts as dicts)."""
    args = resolve_estimator_defaults(args)
    device = next(policy.parameters()).device
    amp = common.autocast(device, dtype)
    # 1. generate with the KV cache from the tempered distribution (no top-k/top-p: the ratio must be on-policy)
    query, query_mask = pad_left([tok.encode(prompt, bos=True) for prompt in prompts], tok.pad_id)
    query = query.to(device)
    query_mask = query_mask.to(device)
    with amp, common.gathered(policy):  # under --fsdp: the actor's parameters gathered once, not per token
        response, mask, generation_logprobs = policy.generate(
            query,
            query_mask,
            args.max_new_tokens,
            tok.eos_id,
            tok.pad_id,
            temperature=args.temperature,
            generator=generator,
        )
    batch_size, prompt_len = query.shape
    # 2. generation stops each row at its first EOS and pads after it (mask includes the EOS); which rows ended
    last = mask.sum(1).long() - 1  # (B,) index of the last real response token
    ended = response.gather(1, last[:, None]).squeeze(1) == tok.eos_id
    # 3. no-grad passes of the training forward per micro-batch: old and reference log-probs, values, RM scores
    logprobs, ref_logprobs, values, entropy, rm_scores = [], [], [], [], []
    for start in range(0, batch_size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        micro_batch = (query[rows], query_mask[rows], response[rows], mask[rows])
        with amp:
            logits, _ = response_forward(policy, *micro_batch, args.temperature)
            ref_logits, _ = response_forward(ref_policy, *micro_batch, args.temperature)
            if critic is not None:
                _, micro_values = response_forward(critic, *micro_batch, args.temperature)
                values.append(micro_values)
            if reward_model is not None:  # the RM reads its score at the last real token (the EOS)
                sequence = torch.cat([query[rows], response[rows]], 1)
                sequence_mask = torch.cat([query_mask[rows], mask[rows]], 1)
                _, token_scores = reward_model(sequence, sequence_mask, logits=False)
                eos_position = prompt_len + last[rows, None]
                rm_scores.append(token_scores.float().gather(1, eos_position).squeeze(1))
        logprobs.append(logprobs_from_logits(logits, response[rows]))
        ref_logprobs.append(logprobs_from_logits(ref_logits, response[rows]))
        entropy.append(entropy_from_logits(logits))
    logprobs = torch.cat(logprobs) * mask
    ref_logprobs = torch.cat(ref_logprobs) * mask
    values = torch.cat(values) * mask if critic is not None else None
    entropy = torch.cat(entropy) * mask
    # the sampler's own log-probs must match the training forward's, or the first ratio is not 1; the max over ranks
    # decides, so every rank raises together (one rank alone would leave the others waiting in the next collective)
    logprob_error = ((generation_logprobs - logprobs).abs() * mask).max()
    if dist.is_initialized():
        dist.all_reduce(logprob_error, op=dist.ReduceOp.MAX)
    logprob_error = logprob_error.item()
    if dtype == torch.float32 and logprob_error > 1e-4:
        raise RuntimeError(
            f"generation log-probs differ from the training forward by {logprob_error:.2e} > 1e-4 in fp32"
        )
    # score = RM (calibration folded into its head) + coef * reward_fn; a response without EOS gets the penalty instead
    texts = [tok.decode(response[row, : last[row] + 1]) for row in range(batch_size)]
    scores = torch.cat(rm_scores) if rm_scores else torch.zeros(batch_size, device=device)
    if reward_fn is not None:
        extra = [float(reward_fn(p, t, e)) for p, t, e in zip(prompts, texts, ended.tolist())]
        scores = scores + args.reward_fn_coef * torch.tensor(extra, device=device)
    scores = torch.where(ended, scores, torch.full_like(scores, args.missing_eos_penalty))
    # 4. rewards: running moments over all history and ranks, normalise, clip (PPO-max §3.2); KL penalty per token
    # unless it goes into the policy loss (--kl-penalty loss, ppo_update)
    reward_moments.update(scores)
    score_norm = normalize_scores(scores, reward_moments.mean, reward_moments.std, args.reward_norm, args.reward_clip)
    reward_kl_coef = kl_coef if args.kl_penalty == "reward" else 0.0
    rewards, _ = shape_rewards(score_norm, logprobs, ref_logprobs, mask, reward_kl_coef, args.kl_estimator)
    # 5. advantages (DESIGN §5b); gae: returns = raw advantages + values, the critic's targets
    group_size = args.group_size
    returns = None
    if args.adv_estimator == "gae":
        advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
    elif args.adv_estimator == "reinforce_pp":  # reward-to-go, whitened over the rollout in ppo_update
        baseline_rewards = rewards
        if group_size > 1:  # the group mean as baseline: s_i - mean_group(s) replaces s_i
            centred = compute_group_advantages(score_norm, group_size, "reinforce_pp")
            baseline_rewards, _ = shape_rewards(
                centred, logprobs, ref_logprobs, mask, reward_kl_coef, args.kl_estimator
            )
        advantages = reward_to_go(baseline_rewards, mask, args.gamma)
    else:  # grpo, rloo: one advantage per response from R_i = s_i - beta * sum_t kl_t, on every token
        sequence_rewards = rewards.sum(1)  # (B,)
        sequence_advantages = compute_group_advantages(
            sequence_rewards, group_size, args.adv_estimator, args.grpo_std_norm
        )
        advantages = sequence_advantages[:, None] * mask

    # global statistics: one all-reduce of named sums
    gold = [0.0] * batch_size
    if gold_fn is not None:
        gold = [gold_fn(p, t, e) for p, t, e in zip(prompts, texts, ended.tolist())]
    kl_per_sequence = ((logprobs - ref_logprobs) * mask).sum(1)  # objective/kl is always the summed k1
    local_sums = {
        "sequences": float(batch_size),
        "score": scores.sum(),
        "score_norm": score_norm.sum(),
        "kl": kl_per_sequence.sum(),
        "rlhf_reward": rewards.sum(),
        "entropy": entropy.sum(),
        "tokens": mask.sum(),
        "nll": -logprobs.sum(),
        "ended": ended.float().sum(),
        "gold": float(sum(gold)),
    }
    if critic is not None:
        value_error = (returns - values) * mask
        local_sums["returns"] = returns.sum()
        local_sums["returns_squared"] = (returns**2).sum()
        local_sums["value_error"] = value_error.sum()
        local_sums["value_error_squared"] = (value_error**2).sum()
    sums = common.all_reduce_dict(local_sums, device)
    sequences = sums["sequences"]
    tokens = sums["tokens"]
    metrics = {
        "objective/score": sums["score"] / sequences,
        "objective/score_norm": sums["score_norm"] / sequences,
        "objective/kl": sums["kl"] / sequences,
        "objective/rlhf_reward": sums["rlhf_reward"] / sequences,
        "objective/entropy": sums["entropy"] / tokens,
        "rollout/response_len": tokens / sequences,
        "rollout/perplexity": math.exp(sums["nll"] / tokens),
        "rollout/eos_frac": sums["ended"] / sequences,
        "rollout/logprob_err": logprob_error,
    }
    if critic is not None:
        returns_variance = sums["returns_squared"] / tokens - (sums["returns"] / tokens) ** 2
        error_variance = sums["value_error_squared"] / tokens - (sums["value_error"] / tokens) ** 2
        metrics["value/explained_variance"] = 1 - error_variance / max(returns_variance, 1e-12)
    if args.mask_truncated:  # responses without EOS: in the group statistics, not in the policy loss
        metrics["rollout/truncated_frac"] = 1 - sums["ended"] / sequences
    if gold_fn is not None:
        metrics["objective/gold"] = sums["gold"] / sequences
    experience = dict(
        query=query,
        query_mask=query_mask,
        response=response,
        mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        rewards=rewards,
        advantages=advantages,
        scores=scores,
        ended=ended.float(),
    )
    if critic is not None:
        experience["values"] = values
        experience["returns"] = returns
    samples = []
    for prompt, text, is_ended, score, gold_value in zip(prompts, texts, ended.tolist(), scores.tolist(), gold):
        sample = {"prompt": prompt, "response": text, "ended": is_ended, "score": score}
        sample["gold"] = gold_value if gold_fn else None
        samples.append(sample)
    return experience, metrics, samples


def concat_experience(parts: list[dict], pad_id: int) -> dict:
    """Experience dicts of different widths -> one: prompts left-padded (query with pad_id, query_mask with 0; position
    ids follow the attention mask, so more left padding changes nothing), responses right-padded with pad_id, every
    other (B, T) tensor right-padded with 0, (B,) tensors concatenated."""
    merged = {}
    for key in parts[0]:
        tensors = [part[key] for part in parts]
        if tensors[0].dim() == 1:
            merged[key] = torch.cat(tensors)
            continue
        width = max(tensor.size(1) for tensor in tensors)
        value = pad_id if key in ("query", "response") else 0
        padded = []
        for tensor in tensors:
            extra = width - tensor.size(1)
            left = extra if key in ("query", "query_mask") else 0
            padded.append(torch.nn.functional.pad(tensor, (left, extra - left), value=value))
        merged[key] = torch.cat(padded)
    return merged


def keep_informative_groups(rounds: list[dict], group_size: int, rows: int, pad_id: int) -> dict:
    """Dynamic sampling (DAPO) over the experiences of one iteration's rollout rounds: the first rows / group_size
    informative groups, in round order; when there are fewer, the first round's other groups fill the batch. The
    result has `rows` rows and a row flag "informative" (1.0, or 0.0 for the filling: no policy loss)."""
    parts = []
    kept = 0
    for experience in rounds:
        flags = informative_groups(experience["scores"], group_size).repeat_interleave(group_size)  # (B,)
        index = flags.nonzero().squeeze(1)
        parts.append({key: value[index] for key, value in experience.items()})
        kept += len(index)
    kept = min(kept, rows)
    first_flags = informative_groups(rounds[0]["scores"], group_size).repeat_interleave(group_size)
    filling = (~first_flags).nonzero().squeeze(1)[: rows - kept]
    parts.append({key: value[filling] for key, value in rounds[0].items()})
    experience = {key: value[:rows] for key, value in concat_experience(parts, pad_id).items()}
    device = experience["mask"].device
    experience["informative"] = torch.cat([torch.ones(kept, device=device), torch.zeros(rows - kept, device=device)])
    return experience


def ppo_update(
    actor,
    critic,
    actor_optimizer,
    critic_optimizer,
    experience: dict,
    args: Args,
    *,
    micro_batch_size: int,
    train_actor: bool = True,
    generator: Optional[torch.Generator] = None,
    ptx_sampler: Optional[Callable] = None,
    dtype: torch.dtype = torch.float32,
    kl_coef: float = 0.0,
) -> tuple[dict, dict]:
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches, one optimizer step per
    minibatch for the critic and (unless train_actor is False: critic warm-up) the actor. actor and critic may be DDP
    or compiled modules; critic and critic_optimizer are None for a critic-free estimator. kl_coef: beta of the KL
    loss (--kl-penalty loss). A step whose minibatch has no token left for the policy loss (--mask-truncated) takes
    no actor step. ptx_sampler() -> (inputs, targets, mask) of one micro-batch of pre-training text (None: no
    ptx loss). Settings are read from args (see above).
    A model whose global grad norm is not finite skips that step (the other still steps); the step counts once.
    Returns (metrics: global means keyed by DESIGN §6 tags over the steps each model took (policy/* only when the
    actor trained), diagnostics: {"updates": steps every model took, "skipped": steps some model skipped, "first":
    ratio_err, approx_kl and clipfrac of the first micro-batch, which must read 0, 0, 0})."""
    args = resolve_estimator_defaults(args)
    mask = experience["mask"]
    rows_per_rank = mask.size(0)
    device = mask.device
    minibatch_rows = exact_div(rows_per_rank, args.num_minibatches, "rollout rows per rank over --num-minibatches")
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    amp = common.autocast(device, dtype)
    # DDP averages gradients over ranks; the losses below are global sums, so each backward scales by the world size
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    use_ptx = train_actor and args.ptx_coef > 0 and ptx_sampler is not None
    loss_mask = mask  # the policy loss's tokens: --mask-truncated drops the responses without EOS
    if args.mask_truncated:
        loss_mask = mask * experience["ended"][:, None]
    if args.dynamic_sampling:  # the groups that only fill the batch
        loss_mask = loss_mask * experience["informative"][:, None]
    advantages = experience["advantages"]
    # whitening statistics come from the tokens the policy loss sees (with neither --mask-truncated nor
    # --dynamic-sampling, every token, bit for bit): a dropped response's advantages never move the update
    loss_advantages = advantages * loss_mask
    if args.adv_whiten == "rollout":  # once over the whole rollout with global statistics (TRL)
        moments = common.all_reduce_dict(
            {"tokens": loss_mask.sum(), "sum": loss_advantages.sum(), "sum_squared": (loss_advantages**2).sum()},
            device,
        )
        moments["tokens"] = max(moments["tokens"], 1.0)  # every response dropped: no actor step, no NaN
        mean = moments["sum"] / moments["tokens"]
        variance = moments["sum_squared"] / moments["tokens"] - mean**2
        advantages = masked_whiten(
            advantages,
            mask,
            mean=torch.tensor(mean, dtype=torch.float32, device=device),
            var=torch.tensor(variance, dtype=torch.float32, device=device),
        )
    # this rank's sums over the steps taken, per model; a step's own sums join them only when that model steps
    totals = {}
    model_steps = {"actor": 0, "critic": 0}
    first = {}
    updates = 0  # optimizer steps every model took
    skipped = 0  # optimizer steps some model skipped (non-finite grad norm), counted once
    lengths = mask.sum(1).long().tolist()  # one host sync: each micro-batch trims its right padding to its longest row
    for _ in range(args.ppo_epochs):
        permutation = torch.randperm(
            rows_per_rank, generator=generator, device=generator.device if generator else "cpu"
        )
        order = permutation.tolist()
        permutation = permutation.to(device)
        for minibatch in range(args.num_minibatches):
            minibatch_index = permutation[minibatch * minibatch_rows : (minibatch + 1) * minibatch_rows]
            ptx_batches = [ptx_sampler() for _ in range(grad_accum_steps)] if use_ptx else []
            # the step's global token counts (loss denominators) and whitening statistics: one all-reduce per step
            minibatch_mask = mask[minibatch_index]
            minibatch_loss_mask = loss_mask[minibatch_index]
            minibatch_advantages = loss_advantages[minibatch_index]
            ptx_tokens = sum((batch[2].sum() for batch in ptx_batches), torch.zeros((), device=device))
            counts = common.all_reduce_dict(
                {
                    "tokens": minibatch_mask.sum(),
                    "advantages": minibatch_advantages.sum(),
                    "advantages_squared": (minibatch_advantages**2).sum(),
                    "ptx_tokens": ptx_tokens,
                    "loss_tokens": minibatch_loss_mask.sum(),
                    "loss_sequences": (minibatch_loss_mask.sum(1) > 0).sum(),
                },
                device,
            )
            whitened_tokens = max(counts["loss_tokens"], 1.0)
            advantage_mean = counts["advantages"] / whitened_tokens
            advantage_variance = counts["advantages_squared"] / whitened_tokens - advantage_mean**2
            advantage_mean = torch.tensor(advantage_mean, dtype=torch.float32, device=device)
            advantage_variance = torch.tensor(advantage_variance, dtype=torch.float32, device=device)
            token_count = torch.tensor(counts["tokens"], dtype=torch.float32, device=device)
            ptx_token_count = torch.tensor(counts["ptx_tokens"], dtype=torch.float32, device=device)
            loss_token_count = torch.tensor(counts["loss_tokens"], dtype=torch.float32, device=device)
            loss_sequence_count = counts["loss_sequences"]
            # nothing to train the actor on (every response truncated): no actor step, explicitly rather than a NaN
            actor_steps_now = train_actor and counts["loss_tokens"] > 0
            step_sums = {"actor": {}, "critic": {}}  # this step's sums per model, kept if that model steps
            for micro in range(grad_accum_steps):
                micro_index = minibatch_index[micro * micro_batch_size : (micro + 1) * micro_batch_size]
                start = minibatch * minibatch_rows + micro * micro_batch_size
                longest = max(lengths[row] for row in order[start : start + micro_batch_size])  # no host sync
                query = experience["query"][micro_index]
                query_mask = experience["query_mask"][micro_index]
                response = experience["response"][micro_index, :longest]
                micro_mask = mask[micro_index, :longest]
                micro_tokens = micro_mask.sum()
                micro_loss_mask = loss_mask[micro_index, :longest]
                micro_loss_tokens = micro_loss_mask.sum()
                old_logprobs = experience["logprobs"][micro_index, :longest]
                micro_advantages = advantages[micro_index, :longest]
                if args.adv_whiten == "minibatch":  # PPO-max: global statistics over the whole minibatch
                    micro_advantages = masked_whiten(
                        micro_advantages, micro_mask, mean=advantage_mean, var=advantage_variance
                    )
                sync = micro == grad_accum_steps - 1
                if actor_steps_now:
                    weights = loss_weights(
                        micro_loss_mask, args.loss_agg, loss_sequence_count, loss_token_count, args.max_new_tokens
                    )
                    # token_mean keeps PPO-max's denominator, bit for bit; the other aggregations weigh each token
                    policy_weights = None if args.loss_agg == "token_mean" else weights
                    if use_ptx:  # LM loss on pre-training text (InstructGPT's PPO-ptx); never the syncing backward
                        ptx_inputs, ptx_targets, ptx_mask = ptx_batches[micro]
                        with common.grad_sync(actor, False), amp:
                            ptx_logits, _ = actor(ptx_inputs)
                            ptx_loss = lm_loss(ptx_logits, ptx_targets, ptx_mask, denom=ptx_token_count)
                        (args.ptx_coef * ptx_loss * world_size).backward()
                        _add(step_sums["actor"], "ptx_loss", ptx_loss.detach())
                    with common.grad_sync(actor, sync), amp:
                        logits, _ = response_forward(actor, query, query_mask, response, micro_mask, args.temperature)
                        logprobs = logprobs_from_logits(logits, response)
                        pg_loss, pg_stats = ppo_policy_loss(
                            logprobs,
                            old_logprobs,
                            micro_advantages,
                            micro_loss_mask,
                            args.cliprange,
                            denom=loss_token_count,
                            weights=policy_weights,
                            cliprange_high=args.cliprange_high,
                            dual_clip=args.dual_clip,
                        )
                        loss = pg_loss
                        if args.kl_penalty == "loss":  # GRPO: beta * k3 against the reference, aggregated alike
                            micro_ref_logprobs = experience["ref_logprobs"][micro_index, :longest]
                            kl_term = kl_loss(logprobs, micro_ref_logprobs, weights, kl_coef)
                            loss = loss + kl_term
                            _add(step_sums["actor"], "kl_loss", kl_term.detach())
                        if args.entropy_coef > 0:
                            entropy = entropy_from_logits(logits)
                            if policy_weights is None:
                                entropy_bonus = args.entropy_coef * (entropy * micro_loss_mask).sum() / loss_token_count
                            else:
                                entropy_bonus = args.entropy_coef * (entropy * weights).sum()
                            loss = loss - entropy_bonus
                    (loss * world_size).backward()
                    _add(step_sums["actor"], "pg_loss", pg_loss.detach())
                    for key in ("approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean"):
                        _add(step_sums["actor"], key, _token_sum(pg_stats[key], micro_loss_tokens))
                    _add(step_sums["actor"], "tokens", micro_loss_tokens)
                    if not first and micro_loss_tokens > 0:  # must be ratio 1, approx_kl 0, clipfrac 0 (DESIGN §5)
                        ratio_error = ((logprobs - old_logprobs).exp().sub(1).abs() * micro_loss_mask).max()
                        first = {
                            "ratio_err": ratio_error.item(),
                            "approx_kl": pg_stats["approx_kl"].item(),
                            "clipfrac": pg_stats["clipfrac"].item(),
                        }
                if critic is None:
                    continue
                with common.grad_sync(critic, sync), amp:
                    _, new_values = response_forward(critic, query, query_mask, response, micro_mask, args.temperature)
                    vf_loss, vf_stats = ppo_value_loss(
                        new_values,
                        experience["values"][micro_index, :longest],
                        experience["returns"][micro_index, :longest],
                        micro_mask,
                        args.cliprange_value,
                        denom=token_count,
                    )
                (vf_loss * world_size).backward()
                _add(step_sums["critic"], "vf_loss", vf_loss.detach())
                _add(step_sums["critic"], "vf_clipfrac", vf_stats["clipfrac"] * micro_tokens)
                _add(step_sums["critic"], "tokens", micro_tokens)
            # separate optimizers and clips; each norm is global (after DDP's all-reduce; FSDP2's is a DTensor whose
            # full value is the global norm), so every rank takes the
            # same decision; a model whose norm is not finite skips this step (the step is counted once as skipped)
            stepping = []
            if actor_steps_now:
                stepping.append(("actor", actor, actor_optimizer, args.grad_clip))
            if critic is not None:
                stepping.append(("critic", critic, critic_optimizer, args.critic_grad_clip))
            if not stepping:  # critic-free and nothing to train on: neither an update nor a skipped step
                continue
            step_ok = True
            for name, model, optimizer, clip in stepping:
                norm = common.full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")))
                if torch.isfinite(norm):  # the model's one host sync per step
                    optimizer.step()
                    model_steps[name] += 1
                    _add(totals, f"{name}/grad_norm", norm)
                    for key, value in step_sums[name].items():
                        _add(totals, f"{name}/{key}", value)
                else:  # name the bad quantity (the loss sums are this rank's)
                    step_ok = False
                    losses = ", ".join(f"{key} {value.item():.3g}" for key, value in step_sums[name].items())
                    common.print0(f"non-finite {name} grad norm ({norm.item()}; {losses}): step skipped")
                optimizer.zero_grad(set_to_none=True)
            updates += step_ok
            skipped += not step_ok
    # global means over the steps each model took; the grad norms are already global (the same on every rank)
    summed = {}
    if totals:  # empty when every step was skipped: the same on every rank, so no rank waits in a lone collective
        summed = common.all_reduce_dict({key: totals[key] for key in sorted(totals)}, device)
    metrics = {}
    if model_steps["critic"]:
        critic_steps = model_steps["critic"]
        metrics["value/loss"] = summed["critic/vf_loss"] / critic_steps
        metrics["value/clipfrac"] = summed["critic/vf_clipfrac"] / summed["critic/tokens"]
        metrics["value/grad_norm"] = summed["critic/grad_norm"] / (critic_steps * world_size)
    if model_steps["actor"]:
        actor_steps = model_steps["actor"]
        metrics["policy/loss"] = summed["actor/pg_loss"] / actor_steps
        metrics["policy/approx_kl"] = summed["actor/approx_kl"] / summed["actor/tokens"]
        metrics["policy/clipfrac"] = summed["actor/clipfrac"] / summed["actor/tokens"]
        metrics["policy/ratio_mean"] = summed["actor/ratio_mean"] / summed["actor/tokens"]
        metrics["policy/clipfrac_low"] = summed["actor/clipfrac_low"] / summed["actor/tokens"]
        metrics["policy/clipfrac_high"] = summed["actor/clipfrac_high"] / summed["actor/tokens"]
        if args.kl_penalty == "loss":
            metrics["policy/kl_loss"] = summed["actor/kl_loss"] / actor_steps
        metrics["train/grad_norm"] = summed["actor/grad_norm"] / (actor_steps * world_size)
        if use_ptx:
            metrics["ptx/loss"] = summed["actor/ptx_loss"] / actor_steps
    diagnostics = {"updates": updates, "skipped": skipped, "first": first}
    return metrics, diagnostics


def _add(sums: dict, key: str, value: torch.Tensor) -> None:
    """sums[key] += value, starting from 0 (a running sum that stays on the device: no host sync)."""
    sums[key] = sums[key] + value if key in sums else value


def _token_sum(mean: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A per-token mean times its token count, 0 for a micro-batch without tokens (whose mean is 0/0; no host sync)."""
    return torch.where(tokens > 0, mean * tokens, torch.zeros_like(mean))


def iteration_flops(actor, critic, reward_model, sequence_len: int, sequences: int, ppo_epochs: int) -> float:
    """Training-equivalent FLOPs of one PPO iteration for perf/mfu (flops_per_token counts a forward and a backward,
    a forward is a third of it): generation, old and reference log-probs (three actor-sized forwards), the values and
    the RM score (two forwards), then ppo_epochs forward-backward passes of the actor and the critic over the rollout.
    sequence_len = prompt + response positions; sequences summed over ranks."""
    actor_flops = actor.flops_per_token(sequence_len)
    critic_flops = critic.flops_per_token(sequence_len) if critic is not None else 0
    # the RM's forward reads its scalar head only (logits=False), like the critic's: critic-sized (without a critic,
    # the RM's own count, its LM head included when it has one)
    reward_flops = 0
    if reward_model is not None:
        reward_flops = critic_flops if critic is not None else reward_model.flops_per_token(sequence_len)
    rollout_flops = (3 * actor_flops + critic_flops + reward_flops) / 3
    update_flops = ppo_epochs * (actor_flops + critic_flops)
    return sequences * sequence_len * (rollout_flops + update_flops)


# -----------------------------------------------------------------------------
# main


def load_reward_fn(spec: str) -> Callable:
    """--reward-fn module:function -> the function; data:gold_reward (its name before the task had a file of its own,
    still in older checkpoints' args) is task:gold_reward."""
    module, _, name = {"data:gold_reward": "task:gold_reward"}.get(spec, spec).partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as e:
        raise UserError(f"--reward-fn {spec}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise UserError(f"--reward-fn {spec}: expected module:function, e.g. data:gold_reward")
    return fn


def format_sample(sample: dict) -> str:
    """prompt + response, marked when the response has no EOS."""
    return f"{sample['prompt']}{sample['response']}{'' if sample['ended'] else ' [no EOS]'}"


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
    args = resolve_estimator_defaults(args)  # the estimator's defaults, printed below; the checkpoint keeps these
    common.seed_everything(args.seed)  # before any model is built: a fresh critic head follows --seed
    # 1. checkpoints, tokenizer, models, data (user mistakes surface here, before any process group)
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: PPO samples from the tempered distribution; use > 0")
    if args.rm_ckpt == "none" and args.reward_fn is None:
        raise UserError("--rm-ckpt none needs --reward-fn module:function (e.g. data:gold_reward)")
    if args.group_size < 1 or (args.adv_estimator in ("grpo", "rloo") and args.group_size < 2):
        raise UserError(
            f"--group-size {args.group_size}: {args.adv_estimator} compares responses within a group, use >= 2"
        )
    if args.dynamic_sampling and args.group_size < 2:
        raise UserError(
            f"--dynamic-sampling compares the scores of a group: use --group-size >= 2, not {args.group_size}"
        )
    if args.max_sample_rounds < 1:
        raise UserError(f"--max-sample-rounds {args.max_sample_rounds}: use >= 1")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise UserError(f"--dual-clip {args.dual_clip}: the cap -c*A needs c > 1")
    sft = common.load_checkpoint(args.sft_ckpt, kind=("sft", "dpo", "ppo"), flag="--sft-ckpt")
    rm = None
    if args.rm_ckpt != "none":
        rm = common.load_checkpoint(args.rm_ckpt, kind="rm", flag="--rm-ckpt")
    if rm is not None and rm["tokenizer"] != sft["tokenizer"]:
        raise UserError(
            f"--rm-ckpt {args.rm_ckpt}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s "
            "(train the RM from this SFT checkpoint)"
        )
    tok = Tokenizer.from_state(sft["tokenizer"])
    reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else None
    # every model from the checkpoints already in memory; PPO-max: the critic starts from the RM (or, with no RM,
    # from the SFT trunk with a fresh head); the critic-free estimators build none
    # With LoRA, one base serves two roles: the reference is the actor with its adapters off, and the reward model
    # the critic's base with the RM's own (frozen) score head
    actor = hf.model_from_checkpoint(sft)
    common.prepare_model(actor, args, "actor")
    lora = args.lora_rank > 0
    ref_policy = BaseView(actor) if lora else hf.model_from_checkpoint(sft)
    critic = None
    if uses_critic(args):
        critic = hf.model_from_checkpoint(rm if rm is not None else sft, lm_head=False, score_head=True)
        common.prepare_model(critic, args, "critic")
    reward_model = None
    if rm is not None and lora and critic is not None:
        reward_model = BaseView(critic, score_head=copy.deepcopy(critic.score_head).requires_grad_(False))
    elif rm is not None:
        reward_model = hf.model_from_checkpoint(rm)
    builtin = args.prompts is None
    block_size = actor.config.block_size
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    prompts = [row["prompt"] for row in read_jsonl(task["prompts"] if builtin else args.prompts, "prompts")]
    prompts_read = len(prompts)
    prompts = [prompt for prompt in prompts if len(tok.encode(prompt, bos=True)) + args.max_new_tokens <= block_size]
    if not prompts:
        raise UserError(
            f"every prompt is longer than the context minus --max-new-tokens ({block_size} - {args.max_new_tokens} "
            "tokens)"
        )
    ptx_path = args.ptx_data or (task["pretrain"] if builtin else None)
    ptx = []
    if ptx_path:
        ptx, _ = encode_sft(tok, read_jsonl(ptx_path, "text"), block_size, mask_prompt=False)
    gold_fn = gold_reward if builtin else None

    # 2. distributed set-up, sizes, optimizers, state
    # sizes first, against the launched world size: a mistake ends here, before any process group
    launched = common.launched_world_size()
    rows_per_rank = exact_div(args.rollout_batch_size, launched, "--rollout-batch-size over the world size")
    # a group never straddles two ranks: each rank samples its prompts' G responses itself
    prompts_per_rank = exact_div(rows_per_rank, args.group_size, "--rollout-batch-size/world_size over --group-size")
    prompts_per_iteration = prompts_per_rank * launched
    minibatch_rows = exact_div(
        rows_per_rank, args.num_minibatches, "--rollout-batch-size/world_size over --num-minibatches"
    )
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)  # never more than a rank's share of a minibatch
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    ptx_micro_batch_size = 0
    if ptx and args.ptx_coef > 0:  # checked only when there is a ptx loss to compute
        ptx_micro_batch_size = exact_div(
            args.ptx_batch_size, launched * grad_accum_steps, "--ptx-batch-size over world_size * accum steps"
        )
    common.prepare_out_dir(args.out_dir, args.resume, args.overwrite)  # refuses to replace a run silently
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    critic_size = f"{critic.num_params() / 1e6:.2f} M" if critic is not None else "none"
    print0(
        f"ppo: {len(prompts)} prompts ({prompts_read - len(prompts)} too long, skipped) | {len(ptx)} ptx texts | "
        f"actor {actor.num_params() / 1e6:.2f} M, critic {critic_size} | rollout "
        f"{args.rollout_batch_size} = {d.world_size} ranks x {args.num_minibatches} minibatches x {grad_accum_steps} "
        f"accum x {micro_batch_size} | {max_steps} iterations | rm {args.rm_ckpt} | device {d.device} {dtype}"
    )
    print0(
        f"estimator {args.adv_estimator}: {prompts_per_iteration} prompts x group_size {args.group_size} | kl "
        f"{args.kl_penalty} ({'k3' if args.kl_penalty == 'loss' else args.kl_estimator}) beta {args.kl_coef} | "
        f"reward_norm {args.reward_norm} clip {args.reward_clip} | adv_whiten {args.adv_whiten} | loss_agg "
        f"{args.loss_agg} | cliprange {args.cliprange}/{args.cliprange_high or args.cliprange} dual_clip "
        f"{args.dual_clip} | mask_truncated {args.mask_truncated} | critic {'yes' if critic else 'no'}"
    )
    for model in (ref_policy, reward_model):
        if model is not None:
            model.requires_grad_(False)
    for model in (actor, ref_policy, critic, reward_model):
        if model is None:
            continue
        model.eval()  # eval mode always: dropout off in all four models
        common.place_model(model, args, d, dtype)  # --fsdp shards the frozen models too
    actor_optimizer = actor.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    critic_optimizer = None
    if critic is not None:
        critic_optimizer = critic.configure_optimizers(args.weight_decay, args.critic_lr, (0.9, 0.95), d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)  # sampling and shuffling
    kl_controller = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
    reward_moments = RunningMoments()
    detector = CollapseDetector(args.collapse_window, args.collapse_z, args.collapse_lag)
    prompt_order = Order(len(prompts), args.seed)
    ptx_order = Order(max(1, len(ptx)), args.seed + 1)
    step = 0
    seconds = 0.0  # wall time of earlier runs of this checkpoint
    updates = 0  # optimizer steps taken
    skipped = 0  # optimizer steps skipped (non-finite gradients)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    hashes = {
        "sft_hash": common.file_sha256(args.sft_ckpt),
        "rm_hash": common.file_sha256(args.rm_ckpt) if rm else None,
    }
    if args.resume:
        inputs = {"sft_hash": ("--sft-ckpt", hashes["sft_hash"]), "rm_hash": ("--rm-ckpt", hashes["rm_hash"])}
        ckpt = common.load_resume(ckpt_path, "ppo", d.world_size, max_steps, inputs)
        common.load_model_state(actor, ckpt)
        common.load_optimizer_state(actor, actor_optimizer, ckpt["optimizer"], args.out_dir)
        if critic is not None:
            common.load_model_state(critic, ckpt, "critic")
            common.load_optimizer_state(critic, critic_optimizer, ckpt["critic_optimizer"], args.out_dir)
        reward_moments.load_state_dict(ckpt["reward_moments"])
        kl_controller.load_state_dict(ckpt["kl_ctl"])
        data_state = ckpt["data_state"]
        detector.load_state_dict(data_state["collapse"])
        prompt_order = Order(**data_state["prompts"])
        ptx_order = Order(**data_state["ptx"])
        updates = data_state["updates"]
        skipped = data_state["skipped"]
        step = ckpt["step"]
        seconds = ckpt["seconds"]
        common.set_rng_state(ckpt["rng"][d.rank], sampler)
        print0(f"resumed from {ckpt_path} at step {step}")
    # the training forward (compiled on CUDA) also serves the no-grad rollout passes; DDP wraps it for the update
    # (a LoRA view switches its base's adapters off in eager code around the call: not compiled)
    compiled = common.use_compile(args.compile, d.device)
    actor_forward = torch.compile(actor) if compiled else actor
    critic_forward = torch.compile(critic) if compiled and critic is not None else critic
    ref_forward = torch.compile(ref_policy) if compiled and not lora else ref_policy
    compile_rm = compiled and reward_model is not None and not isinstance(reward_model, BaseView)
    rm_forward = torch.compile(reward_model) if compile_rm else reward_model
    replicated = d.ddp and not args.fsdp  # FSDP2 needs no wrapper
    actor_trained = common.replicate(actor_forward, d) if replicated else actor_forward
    critic_trained = common.replicate(critic_forward, d) if replicated and critic is not None else critic_forward
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None, console_keys=CONSOLE)
    peak = common.peak_flops(d.device, args.peak_flops)

    def ptx_sampler():
        """This rank's slice of the next global ptx micro-batch: (inputs, targets, target mask)."""
        global_rows = ptx_order.take(ptx_micro_batch_size * d.world_size)
        rows = global_rows[d.rank * ptx_micro_batch_size : (d.rank + 1) * ptx_micro_batch_size]
        ids, _ = pad_right([ptx[row][0] for row in rows], tok.pad_id)
        loss_mask, _ = pad_right([ptx[row][1] for row in rows], 0)
        return ids[:, :-1].to(d.device), ids[:, 1:].to(d.device), loss_mask[:, 1:].float().to(d.device)

    def save(step: int) -> None:
        rng_states = common.all_rng_states(sampler)
        # under --fsdp every rank gathers the weights and saves its optimizer shards; rank 0 writes ckpt.pt
        actor_state = common.training_state(actor, actor_optimizer, args.out_dir)
        critic_state = (
            common.training_state(critic, critic_optimizer, args.out_dir, "critic") if critic is not None else {}
        )
        if not d.master:
            return
        schedule = dict(warmup_steps=args.warmup_steps, max_steps=max_steps, delay=args.critic_warmup_steps)
        data_state = dict(
            prompts=prompt_order.state_dict(),
            ptx=ptx_order.state_dict(),
            collapse=detector.state_dict(),
            updates=updates,
            skipped=skipped,
        )
        checkpoint = dict(
            kind="ppo",
            **actor_state,
            model_config=asdict(actor.config),
            tokenizer=tok.state(),
            args=asdict(args),
            step=step,
            scheduler=schedule | {"lr": args.lr},
            rng=rng_states,
            data_state=data_state,
            world_size=d.world_size,
            seconds=seconds + time.time() - t_start,
            reward_moments=reward_moments.state_dict(),
            kl_ctl=kl_controller.state_dict(),
            **hashes,
        )
        if critic is not None:
            checkpoint |= critic_state
            checkpoint["critic_config"] = asdict(critic.config)
            checkpoint["critic_scheduler"] = schedule | {"lr": args.critic_lr, "delay": 0}
        common.save_checkpoint(checkpoint, ckpt_path)

    def rollout_round(kl_coef: float) -> tuple[dict, dict, list]:
        """Steps 1-5 on this rank's share of the next prompts, each repeated group_size times in a row."""
        global_rows = prompt_order.take(prompts_per_iteration)
        rows = global_rows[d.rank * prompts_per_rank : (d.rank + 1) * prompts_per_rank]
        group_prompts = [prompts[row] for row in rows for _ in range(args.group_size)]
        return rollout(
            actor_forward,
            ref_forward,
            critic_forward,
            rm_forward,
            tok,
            group_prompts,
            args,
            micro_batch_size=micro_batch_size,
            generator=sampler,
            kl_coef=kl_coef,
            reward_moments=reward_moments,
            reward_fn=reward_fn,
            gold_fn=gold_fn,
            dtype=dtype,
        )

    # 3. the loop: rollout (steps 1-5), update (6), then log, samples, collapse check, checkpoint (7)
    first = {}  # the first minibatch of this process's first update
    start_step = step
    samples = []
    skipped_in_row = 0
    while step < max_steps:
        t_rollout = time.time()
        kl_coef = kl_controller.value
        experience, metrics, samples = rollout_round(kl_coef)
        if args.dynamic_sampling:  # DAPO: fresh groups until enough are informative on every rank (the metrics and
            # samples are the first round's: what the policy does)
            rounds = [experience]
            group_flags = informative_groups(experience["scores"], args.group_size)
            counts = common.all_reduce_dict({"groups": len(group_flags), "zero_std": (~group_flags).sum()}, d.device)
            metrics["rollout/zero_std_frac"] = counts["zero_std"] / counts["groups"]
            while len(rounds) < args.max_sample_rounds:
                informative = sum(informative_groups(part["scores"], args.group_size).sum() for part in rounds)
                short = common.all_reduce_dict({"ranks_short": float(informative < prompts_per_rank)}, d.device)
                if short["ranks_short"] == 0:
                    break
                rounds.append(rollout_round(kl_coef)[0])
            metrics["rollout/sample_rounds"] = len(rounds)
            experience = keep_informative_groups(rounds, args.group_size, rows_per_rank, tok.pad_id)
        kl_controller.update(metrics["objective/kl"], args.rollout_batch_size)
        t_update = time.time()
        # the actor's schedule starts when it starts moving, after the critic warm-up
        actor_step = max(0, step - args.critic_warmup_steps)
        actor_steps = max_steps - args.critic_warmup_steps
        lr = common.lr_at(actor_step, actor_steps, args.lr, args.warmup_steps)
        critic_lr = common.lr_at(step, max_steps, args.critic_lr, args.warmup_steps)
        for group in actor_optimizer.param_groups:
            group["lr"] = lr
        if critic_optimizer is not None:
            for group in critic_optimizer.param_groups:
                group["lr"] = critic_lr
        update_metrics, diagnostics = ppo_update(
            actor_trained,
            critic_trained,
            actor_optimizer,
            critic_optimizer,
            experience,
            args,
            micro_batch_size=micro_batch_size,
            train_actor=step >= args.critic_warmup_steps,
            generator=sampler,
            ptx_sampler=ptx_sampler if ptx_micro_batch_size else None,
            dtype=dtype,
            kl_coef=kl_coef,
        )
        first = first or diagnostics["first"]
        step += 1
        updates += diagnostics["updates"]
        skipped += diagnostics["skipped"]
        skipped_in_row = skipped_in_row + 1 if diagnostics["skipped"] else 0
        if skipped_in_row >= 10:  # the checkpoint saved before these stays the last good one
            raise RuntimeError(
                f"non-finite gradients in {skipped_in_row} iterations in a row: lower --lr/--critic-lr or check the "
                "reward"
            )
        t_end = time.time()

        # 7. monitoring; the collapse detector watches the actor's moves only (after the critic warm-up)
        alarm = step > args.critic_warmup_steps and detector.update(
            metrics["objective/kl"], metrics["rollout/response_len"], metrics["rollout/perplexity"]
        )
        sequence_len = experience["query"].size(1) + experience["mask"].size(1)
        sequences = experience["mask"].size(0) * d.world_size
        flops = iteration_flops(actor, critic, reward_model, sequence_len, sequences, args.ppo_epochs)
        metrics |= update_metrics
        if critic is not None:
            metrics["train/critic_lr"] = critic_lr
        metrics |= {
            "train/lr": lr,
            "train/kl_coef": kl_coef,
            "train/updates": updates,
            "train/skipped_steps": skipped,
            "collapse/alarm": float(alarm),
            "perf/rollout_s": t_update - t_rollout,
            "perf/update_s": t_end - t_update,
            "perf/tokens_per_sec": sequences * sequence_len / (t_end - t_rollout),
            "perf/mfu": flops / (t_end - t_rollout) / (peak * d.world_size),
        }
        if step == start_step + 1:  # the first iteration of this process: how close sampler and trainer agree
            logprob_error = metrics["rollout/logprob_err"]
            print0(f"step {step}: generation vs training-forward log-probs, max |diff| {logprob_error:.1e}")
        show = step % args.log_every == 0 or step == max_steps or alarm
        logger.log(step, metrics, max_steps, console=show)
        if step % args.sample_every == 0 or step == max_steps:
            table = []
            for sample in samples[:8]:
                line = f"{format_sample(sample)} | score {sample['score']:.2f}"
                if gold_fn:
                    line += f" | gold {sample['gold']:.2f}"
                table.append(line)
            logger.text("samples", "\n\n".join(table), step)
            logger.samples(step, samples[:16])
        if alarm and args.stop_on_collapse:
            print0(f"collapse alarm at step {step}: stopping (the last checkpoint saved before it is kept)")
            break
        if (args.save_every and step % args.save_every == 0) or step == max_steps:
            save(step)

    # 4. a few samples to look at
    for sample in samples[:5]:
        print0(f"  {format_sample(sample)}  (score {sample['score']:.2f})")
    if args.export_hf and d.master:
        common.export_hf(actor, tok, args.export_hf)
    first_line = ", ".join(f"{key} {value:.1e}" for key, value in first.items())
    print0(f"ppo done in {time.time() - t_start:.0f}s: {ckpt_path} | first minibatch of the first update: {first_line}")
    logger.close()
    common.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
