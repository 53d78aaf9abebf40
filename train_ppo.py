"""PPO-max: reinforcement learning from a reward model with every stabilising trick of Zheng et al. (2023) inline.

Each iteration samples responses from the policy (actor), scores them with the frozen reward model, subtracts a
per-token KL penalty (k1) against the frozen SFT policy (reference), estimates advantages with GAE from a critic that
starts from the reward model, and takes clipped PPO steps on the actor and the critic, plus an LM loss on
pre-training text (ptx). The PPO-max tricks: reward normalisation and clipping over running moments, the KL penalty
(fixed, or adaptive with --kl-target), advantage whitening per minibatch, value clipping, critic initialisation from
the RM and critic warm-up, grad-norm clipping, ptx, and a collapse detector over the monitoring metrics.
Paper: https://arxiv.org/abs/2307.04964 (Secrets of RLHF in Large Language Models Part I: PPO).

Steps 1-3 (generate, score, log-probs) are rollout.rollout; the numbered steps are those of docs/design.md §5.

python train_ppo.py                                                   # built-in task, 2 cores, 2-4 min (after SFT, RM)
python train_ppo.py --rm-ckpt none --reward-fn task:gold_reward       # optimise the gold reward itself, no RM
torchrun --standalone --nproc_per_node 8 train_ppo.py --sft-ckpt sft/ckpt.pt --rm-ckpt rm/ckpt.pt --prompts p.jsonl
"""

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist

import checkpoints
import cli
import common
import parallel
import rollout
from common import Trained, UserError, exact_div, format_sample, print0
from model import entropy_from_logits, lm_loss, masked_mean, response_forward, row_extent


@dataclass
class Args(rollout.RolloutArgs):
    out_dir: str = "out/ppo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- reward and KL
    reward_norm: Literal["none", "scale", "norm"] = "norm"
    """normalise scores with running moments over all history: scale = s/std, norm = (s-mean)/std (PPO-max §3.2)"""
    reward_clip: Optional[float] = 5.0
    """clip normalised scores to +-this (None: off)"""
    kl_coef: float = 0.3
    """beta of the per-token KL penalty -beta * (logp - ref_logp) in the rewards (the initial value with
    --kl-target); 0.3 keeps the built-in task's valid fraction above 0.9 across retrained RMs"""
    kl_target: Optional[float] = None
    """adaptive KL controller (Ziegler et al. 2019): target KL per sequence in nats (None: fixed --kl-coef)"""
    kl_horizon: int = 10000
    """adaptive KL controller horizon, in episodes"""
    # --- PPO
    ppo_epochs: int = 1
    """passes over each rollout"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    adv_whiten: Literal["minibatch", "rollout", "none"] = "minibatch"
    """whiten advantages with global statistics per minibatch (PPO-max), once per rollout (TRL), or not"""
    cliprange: Optional[float] = 0.2
    """policy ratio clip epsilon (None: no clip, the plain policy gradient -A*ratio)"""
    cliprange_value: Optional[float] = 0.2
    """value clip around the rollout's values (None: off)"""
    entropy_coef: float = 0.0
    """the entropy bonus: -coef x the policy's entropy a token in the policy loss, aggregated as it (0: off; PPO-max
    leaves it out: the KL penalty keeps the policy spread, and the paper finds the bonus sensitive)"""
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
    collapse_window: int = 15
    """collapse detector: trailing window (iterations) each new KL, length and perplexity value is z-scored against"""
    collapse_z: float = 3.5
    """collapse detector: z-score that counts as a jump"""
    collapse_lag: int = 3
    """collapse detector: a KL jump and a length-up or perplexity-down jump this close together fire the alarm"""
    stop_on_collapse: bool = False
    """end the run when the alarm fires, keeping the last checkpoint saved before it"""


def check_args(args: Args) -> None:
    """Settings no run can mean: a one-line UserError naming the flag, before any work."""
    rollout.check_rollout_args(args)
    if args.cliprange is not None and args.cliprange <= 0:
        raise UserError(f"--cliprange {args.cliprange}: use > 0 (None: no clip)")
    if args.cliprange_value is not None and args.cliprange_value <= 0:
        raise UserError(f"--cliprange-value {args.cliprange_value}: use > 0 (None: no clip)")
    if args.kl_coef < 0:
        raise UserError(f"--kl-coef {args.kl_coef}: beta is the strength of a penalty, use >= 0")
    if args.kl_target is not None and args.kl_target <= 0:
        raise UserError(f"--kl-target {args.kl_target}: a KL per sequence in nats, use > 0")
    if args.ppo_epochs < 1:
        raise UserError(f"--ppo-epochs {args.ppo_epochs}: passes over each rollout, use >= 1")
    if not 0 <= args.gamma <= 1 or not 0 <= args.lam <= 1:
        raise UserError(f"--gamma {args.gamma} --lam {args.lam}: both lie in [0, 1]")


# -----------------------------------------------------------------------------
# PPO-max's math: pure functions, imported by tests. Tensors are (B, T) over response tokens, mask 1.0 = real token
# (a model token: in a multi-turn episode the environment's tokens between turns are 0, docs/design.md §5).


class RunningMoments:
    """Running mean and std of every score seen (parallel Welford / Chan et al.), merged across DDP ranks: the moments
    step 4 normalises the scores with (PPO-max §3.2)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    @staticmethod
    def combine(triples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        """Fold (count, mean, M2) triples into one (Chan et al. 1979); exact, order-independent up to rounding."""
        n, mean, m2 = 0.0, 0.0, 0.0
        for nb, mb, m2b in triples:
            if nb == 0:
                continue
            delta, tot = mb - mean, n + nb
            mean, m2, n = mean + delta * nb / tot, m2 + m2b + delta**2 * n * nb / tot, tot
        return n, mean, m2

    def update(self, x: torch.Tensor) -> None:
        """Add a batch: every rank's (count, mean, M2) is all-gathered and folded in rank order, so all ranks agree."""
        x = x.detach().double().flatten()
        local = torch.stack([torch.tensor(float(x.numel()), device=x.device), x.mean(), ((x - x.mean()) ** 2).sum()])
        per_rank = [local]
        if dist.is_initialized():
            per_rank = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, local)
        per_rank = torch.stack(per_rank).tolist()  # one host sync
        self.count, self.mean, self.m2 = self.combine([(self.count, self.mean, self.m2)] + per_rank)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def normalize_scores(scores, mean: float, std: float, mode: str, clip: Optional[float]) -> torch.Tensor:
    """PPO-max §3.2: scores (B,) normalised with running moments, then clipped to +-clip (None: no clip). mode none |
    scale = s/std | norm = (s - mean)/std; a std under 1e-6 counts as 1."""
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


def split_turn_rewards(turn_rewards, mask):
    """turn_rewards (B, T), each turn's reward on its last model token (a row sums to the episode's return) -> (the
    last turn's (B,), on the episode's last model token; the earlier turns' (B, T), 0 there and off the mask)."""
    last = (row_extent(mask) - 1).clamp(min=0)[:, None]  # (B, 1) the episode's last model token
    earlier = (turn_rewards * mask).scatter(1, last, 0.0)
    return turn_rewards.gather(1, last).squeeze(1), earlier


def shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, turn_rewards=None):
    """scores (B,), the rest (B, T) -> (rewards, kl), both (B, T), 0 off the mask: rewards = -kl_coef * k1 per token,
    k1 = logp - ref_logp, plus the score on the last model token (the EOS), plus turn_rewards (B, T) where given: a
    multi-turn episode's earlier turns' rewards, each on its turn's last model token.
    http://joschu.net/blog/kl-approx.html"""
    kl = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0) * mask
    rewards = -kl_coef * kl
    if turn_rewards is not None:
        rewards = rewards + turn_rewards
    last = (row_extent(mask) - 1).clamp(min=0)  # (B,) index of the last model token
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask, kl


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2015) over right-padded rows; the value after the last model
    token is 0. On the environment's tokens inside a row (mask 0) the next value and the running advantage pass
    through unchanged, so a model token's next value is the next model token's (verl's multi-turn
    compute_gae_advantage_return). Returns (advantages, returns = advantages + values), 0 off the mask."""
    rewards, values = rewards * mask, values * mask
    T = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    next_values = torch.zeros_like(rewards[:, 0])  # 0 past the last model token
    lastgaelam = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        model_token = mask[:, t].bool()
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        advantages[:, t] = (delta + gamma * lam * lastgaelam) * mask[:, t]
        # padding and the environment's tokens carry both through
        next_values = torch.where(model_token, values[:, t], next_values)
        lastgaelam = torch.where(model_token, advantages[:, t], lastgaelam)
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: Optional[float], denom=None, weights=None):
    """Clipped surrogate l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps)) per token, all (B, T) (cliprange None: no
    clip). Returns (sum(l * weights) / denom, stats: clipfrac, approx_kl, ratio_mean); weights and denom default to
    the mask and its count."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # masked before the exponential
    ratio = torch.exp(log_ratio)
    lower, upper = 0.0, math.inf  # cliprange None: no clip (a ratio is > 0)
    if cliprange is not None:
        lower, upper = 1.0 - cliprange, 1.0 + cliprange
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, lower, upper)
    token_losses = torch.max(pg_losses, pg_losses2)
    weights = mask if weights is None else weights
    pg_loss = (token_losses * weights).sum() / (mask.sum() if denom is None else denom)
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


def whiten(advantages, mean, variance) -> torch.Tensor:
    """(A - mean) / sqrt(variance + 1e-8): advantages whitened with the moments of the whole minibatch over every rank
    (parallel.global_moments), PPO-max's per-minibatch normalisation (or once over the rollout, TRL's)."""
    return (advantages - mean) * torch.rsqrt(variance + 1e-8)


def ptx_loss(actor, ptx_batch: tuple, ptx_tokens) -> torch.Tensor:
    """InstructGPT's PPO-ptx term before its coefficient: the LM loss on one micro-batch of pre-training text
    (inputs, targets, target mask), summed over its targets and divided by the step's global ptx token count."""
    inputs, targets, target_mask = ptx_batch
    logits, _ = actor(inputs)
    return lm_loss(logits, targets, target_mask, denom=ptx_tokens)


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
    """The PPO-max paper's collapse signature (§5.2): KL, response length and perplexity z-scored against the last
    `window` iterations; the alarm is 1 while a KL jump up and a length jump up or perplexity jump down both lie
    within the last `lag` iterations. Std floors: 5% of the window's mean level, plus 1 nat for KL."""

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
def critic_values(critic, experience: dict, micro_batch_size: int, temperature: float, amp) -> torch.Tensor:
    """The critic's values (B, T) of the rollout's response tokens, per micro-batch, masked to the model's tokens (read
    one position before each token, where its log-prob is; the forward attends to the observations too)."""
    parts = []
    for start in range(0, experience["mask"].size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        inputs = [experience[key][rows] for key in ("query", "query_mask", "response", "attention_mask")]
        with amp:
            parts.append(response_forward(critic, *inputs, temperature)[1])
    return torch.cat(parts) * experience["mask"]


@torch.no_grad()
def ppo_rollout(
    engine: rollout.Engine, args: Args, prompts: list, kl_coef: float, reward_moments: RunningMoments
) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's prompts: rollout.rollout (1-3), the critic's values, the rewards (reward_moments
    updated in place) and GAE. Returns (experience, metrics: global means, records: the responses as dicts)."""
    experience, sums, records = rollout.rollout(engine, prompts)
    mask = experience["mask"]
    amp = torch.autocast(mask.device.type, dtype=engine.dtype, enabled=engine.dtype != torch.float32)
    values = critic_values(engine.models.critic, experience, engine.micro_batch_size, args.temperature, amp)
    # 4. rewards: running moments of the returns over all history and ranks, normalise, clip (PPO-max §3.2); -beta * k1
    # per token
    scores = experience["scores"]
    reward_moments.update(scores)
    mean, std = reward_moments.mean, reward_moments.std
    # the earlier turns' rewards (all 0 in an episode of one turn) over the std, the mean off the last turn's only
    final_scores, turn_rewards = split_turn_rewards(experience["turn_rewards"], mask)
    turn_rewards = normalize_scores(turn_rewards, 0.0, std, args.reward_norm, args.reward_clip)
    score_norm = normalize_scores(final_scores, mean, std, args.reward_norm, args.reward_clip)
    logprobs, ref_logprobs = experience["logprobs"], experience["ref_logprobs"]
    rewards, _ = shape_rewards(score_norm, logprobs, ref_logprobs, mask, kl_coef, turn_rewards)
    score_norm = score_norm + turn_rewards.sum(1)  # the normalised return
    # 5. advantages by GAE; returns = raw advantages + values, the critic's targets
    advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
    experience |= dict(rewards=rewards, advantages=advantages, values=values, returns=returns)
    value_error = (returns - values) * mask
    sums |= {
        "score_norm": score_norm.sum(),
        "rlhf_reward": rewards.sum(),
        "returns": returns.sum(),
        "returns_squared": (returns**2).sum(),
        "value_error": value_error.sum(),
        "value_error_squared": (value_error**2).sum(),
    }
    metrics, totals = rollout.rollout_metrics(sums, mask.device)
    sequences, tokens = totals["sequences"], totals["tokens"]
    returns_variance = totals["returns_squared"] / tokens - (totals["returns"] / tokens) ** 2
    error_variance = totals["value_error_squared"] / tokens - (totals["value_error"] / tokens) ** 2
    metrics["objective/score_norm"] = totals["score_norm"] / sequences
    metrics["objective/rlhf_reward"] = totals["rlhf_reward"] / sequences
    metrics["value/explained_variance"] = 1 - error_variance / max(returns_variance, 1e-12)
    return experience, metrics, records


def actor_backward(actor, batch: dict, args: Args, token_count, sync: bool, amp):
    """The actor's clipped policy loss on one micro-batch, a token mean over the minibatch's global token count, and
    its backward (gradients accumulate; DDP all-reduces where sync). Returns (its sums for the metrics, the new
    log-probs)."""
    mask = batch["loss_mask"]
    weights = mask * batch["tis"] if "tis" in batch else mask  # --tis-cap
    with parallel.grad_sync(actor, sync), amp:
        logits, logprobs = rollout.policy_logprobs(actor, batch, args.temperature)
        loss, stats = ppo_policy_loss(
            logprobs, batch["logprobs"], batch["advantages"], mask, args.cliprange, denom=token_count, weights=weights
        )
        sums = {"pg_loss": loss.detach()}  # each term's global sum, for the metrics
        if args.entropy_coef:  # the entropy bonus, a token mean over the minibatch as the policy loss
            entropy = (entropy_from_logits(logits) * mask).sum() / token_count
            sums["entropy_bonus"] = entropy.detach()
            loss = loss - args.entropy_coef * entropy
    parallel.backward_global(loss)
    tokens = mask.sum()
    sums["tokens"] = tokens
    for key in ("approx_kl", "clipfrac", "ratio_mean"):
        sums[key] = torch.where(tokens > 0, stats[key] * tokens, 0.0)  # 0, not 0/0, without tokens
    return sums, logprobs


def ptx_backward(actor, ptx_batch: tuple, args: Args, ptx_tokens, amp) -> dict:
    """--ptx-coef x the ptx loss on one micro-batch of pre-training text, and its backward: never the syncing one (the
    policy loss's comes after it)."""
    with parallel.grad_sync(actor, False), amp:
        loss = ptx_loss(actor, ptx_batch, ptx_tokens)
    parallel.backward_global(args.ptx_coef * loss)
    return {"ptx_loss": loss.detach()}


def critic_backward(critic, batch: dict, args: Args, token_count, sync: bool, amp) -> dict:
    """The clipped value loss on one micro-batch over the minibatch's global token count, and its backward."""
    inputs = [batch[key] for key in ("query", "query_mask", "response", "attention_mask")]
    mask = batch["loss_mask"]
    with parallel.grad_sync(critic, sync), amp:
        _, new_values = response_forward(critic, *inputs, args.temperature)
        vf_loss, vf_stats = ppo_value_loss(
            new_values, batch["values"], batch["returns"], mask, args.cliprange_value, denom=token_count
        )
    parallel.backward_global(vf_loss)
    tokens = mask.sum()
    return {"vf_loss": vf_loss.detach(), "vf_clipfrac": vf_stats["clipfrac"] * tokens, "tokens": tokens}


def ppo_update(
    actor: Trained,
    critic: Trained,
    experience: dict,
    args: Args,
    step: int,
    generator: torch.Generator,
    guard: common.StepGuard,
    ptx_stream,
):
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches (shuffled by
    generator), one guarded optimizer step per minibatch for the critic and, from iteration --critic-warmup-steps on,
    the actor (with ptx_stream's text under the ptx loss; None: none). Returns (metrics: global means over the steps
    each model took, plus policy/update_kl; diagnostics: updates, first_micro_batch: the actor's first
    micro-batch's ratio_diagnostics, on device)."""
    mask = experience["mask"]
    device = mask.device
    minibatch_rows = exact_div(mask.size(0), args.num_minibatches, "rollout rows per rank over --num-minibatches")
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)  # parallel.rollout_split's rule
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    dtype = parallel.resolve_dtype(args.dtype, device)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    train_actor = step >= args.critic_warmup_steps  # the critic warm-up: only the critic trains
    use_ptx = train_actor and ptx_stream is not None
    # the losses' tokens: the model's; --mask-truncated drops responses without EOS and episodes cut by the context
    loss_mask = mask
    if args.mask_truncated:
        loss_mask = mask * rollout.kept_rows(experience)[:, None]
    batch = experience | {"loss_mask": loss_mask}
    metrics = {}
    if args.tis_cap is not None:  # truncated importance sampling: the sampler's and the trainer's numerics differ
        batch["tis"], metrics = rollout.tis_metrics(experience, loss_mask, args.tis_cap, device)
    if args.adv_whiten == "rollout":  # once over the whole rollout with global statistics (TRL)
        mean, variance = parallel.global_moments(batch["advantages"], loss_mask, device)
        batch["advantages"] = whiten(batch["advantages"], mean, variance)
    totals = {"actor": defaultdict(float), "critic": defaultdict(float)}  # this rank's sums over the steps each took
    steps = {"actor": 0, "critic": 0}  # the steps each model took (the same on every rank)
    first_micro_batch = {}
    updates = 0  # optimizer steps every model took
    lengths = row_extent(
        experience["attention_mask"]
    ).tolist()  # one host sync: each micro-batch trims its right padding
    for _ in range(args.ppo_epochs):
        permutation = torch.randperm(mask.size(0), generator=generator, device=generator.device)
        widths = parallel.micro_batch_widths(lengths, permutation.tolist(), micro_batch_size)
        permutation = permutation.to(device)
        for minibatch in range(args.num_minibatches):
            minibatch_rows_taken = slice(minibatch * minibatch_rows, (minibatch + 1) * minibatch_rows)
            minibatch_batch = parallel.take_rows(batch, permutation[minibatch_rows_taken])
            minibatch_mask = minibatch_batch["loss_mask"]
            if args.adv_whiten == "minibatch":  # PPO-max: global statistics over the whole minibatch
                mean, variance = parallel.global_moments(minibatch_batch["advantages"], minibatch_mask, device)
                minibatch_batch["advantages"] = whiten(minibatch_batch["advantages"], mean, variance)
            ptx_batches = [ptx_stream.next() for _ in range(grad_accum_steps)] if use_ptx else []
            # the step's global token counts (loss denominators): one all-reduce per step, left on device
            ptx_tokens = sum((ptx_batch[2].sum() for ptx_batch in ptx_batches), torch.zeros((), device=device))
            token_count, ptx_token_count = parallel.all_reduce_stack([minibatch_mask.sum(), ptx_tokens], device).float()
            step_sums = {"actor": defaultdict(float), "critic": defaultdict(float)}  # kept if that model steps
            for micro in range(grad_accum_steps):
                rows = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
                micro_batch = parallel.take_rows(minibatch_batch, rows, widths[minibatch * grad_accum_steps + micro])
                sync = micro == grad_accum_steps - 1
                if train_actor:
                    ptx_sums = {}
                    if use_ptx:
                        ptx_sums = ptx_backward(actor.forward, ptx_batches[micro], args, ptx_token_count, amp)
                    sums, logprobs = actor_backward(actor.forward, micro_batch, args, token_count, sync, amp)
                    for key, value in (ptx_sums | sums).items():
                        step_sums["actor"][key] += value
                    if not first_micro_batch:  # must read ratio 1, approx_kl 0, clipfrac 0
                        first_micro_batch = rollout.ratio_diagnostics(
                            logprobs, micro_batch["logprobs"], micro_batch["loss_mask"], sums
                        )
                sums = critic_backward(critic.forward, micro_batch, args, token_count, sync, amp)
                for key, value in sums.items():
                    step_sums["critic"][key] += value
            # separate optimizers and clips; each norm is global (after DDP's all-reduce; FSDP2's is a DTensor whose
            # full value is the global norm), so every rank takes the same decision
            trained = {"actor": actor, "critic": critic} if train_actor else {"critic": critic}
            stepped = common.guarded_step(list(trained.values()), guard, step)
            for role, entry in trained.items():
                if entry.name in stepped:
                    for key, value in step_sums[role].items():
                        totals[role][key] += value
                    steps[role] += 1
                else:  # name the bad quantity (the loss sums are this rank's)
                    losses = ", ".join(f"{key} {value.item():.3g}" for key, value in step_sums[role].items())
                    print0(f"step {step}: the {role}'s sums when its grad norm was not finite: {losses}")
            updates += len(stepped) == len(trained)
    metrics |= guard.read({"model": "train/grad_norm", "critic": "value/grad_norm"})  # the actor is "model"
    metrics |= update_metrics(totals, steps, device)
    metrics["policy/update_kl"] = rollout.update_kl(actor.forward, experience, micro_batch_size, args.temperature, amp)
    return metrics, {"updates": updates, "first_micro_batch": first_micro_batch}


def update_metrics(totals: dict, steps: dict, device) -> dict:
    """Global means over the steps each model took, from this rank's sums (one all-reduce)."""
    flat = {f"{role}/{key}": value for role, sums in totals.items() for key, value in sums.items()}
    summed = {}
    if flat:  # empty when every step was skipped: the same on every rank, so no rank waits in a lone collective
        summed = parallel.all_reduce_dict({key: flat[key] for key in sorted(flat)}, device)
    metrics = {}
    if steps["critic"]:
        metrics["value/loss"] = summed["critic/vf_loss"] / steps["critic"]
        metrics["value/clipfrac"] = summed["critic/vf_clipfrac"] / summed["critic/tokens"]
    if steps["actor"]:
        metrics["policy/loss"] = summed["actor/pg_loss"] / steps["actor"]
        for key in ("approx_kl", "clipfrac", "ratio_mean"):
            metrics[f"policy/{key}"] = summed[f"actor/{key}"] / summed["actor/tokens"]
        if "actor/ptx_loss" in summed:
            metrics["ptx/loss"] = summed["actor/ptx_loss"] / steps["actor"]
        if "actor/entropy_bonus" in summed:  # the entropy the bonus rewards, before its coefficient
            metrics["policy/entropy_bonus"] = summed["actor/entropy_bonus"] / steps["actor"]
    return metrics


# -----------------------------------------------------------------------------
# main: the set-up in named builders, then the loop


def build_optimizers(args: Args, models, max_steps: int, device_type: str) -> tuple[Trained, Trained]:
    """The actor's and the critic's (models.actor, models.critic) AdamW, LR schedule and grad-norm clip, as Trained
    entries (the checkpoint keys `model` and `critic`). The actor's schedule starts when it starts moving, after the
    critic warm-up."""
    betas = (0.9, 0.95)
    actor_optimizer = models.actor.configure_optimizers(args.weight_decay, args.lr, betas, device_type)
    actor_schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps, delay=args.critic_warmup_steps)
    actor = Trained("model", models.actor, actor_optimizer, actor_schedule, args.grad_clip)
    critic_optimizer = models.critic.configure_optimizers(args.weight_decay, args.critic_lr, betas, device_type)
    critic_schedule = common.LRSchedule(args.critic_lr, args.warmup_steps, max_steps)
    critic = Trained("critic", models.critic, critic_optimizer, critic_schedule, args.critic_grad_clip)
    return actor, critic


CONSOLE = (
    "objective/score",
    "objective/reward_fn",
    "objective/gold",
    "objective/kl",
    "rollout/response_len",
    "rollout/perplexity",
    "objective/entropy",
    "policy/approx_kl",
    "policy/update_kl",
    "policy/clipfrac",
    "value/explained_variance",
    "collapse/alarm",
    "perf/rollout_s",
    "perf/update_s",
)


def main(args: Args) -> None:
    t_start = time.time()
    # the run's flags (with --resume, the checkpoint's wherever the command line gives none)
    args = checkpoints.task_from_checkpoint(args, args.sft_ckpt, "--sft-ckpt")  # --task: the SFT's unless given
    args = checkpoints.resume_args(args, "ppo")
    check_args(args)
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)  # refuses to replace a run silently
    common.seed_everything(args.seed)  # before any model is built: a fresh critic head follows --seed

    # checkpoints, tokenizer, data, models (user mistakes surface here, before any process group)
    sft, ref, rms, tok, data = rollout.load_inputs(args)
    # PPO-max's critic starts from the (first) reward model, its trunk and score head; with no RM, from the SFT trunk
    # and a fresh head
    models = rollout.build_models(args, sft, ref, rms, critic_init=rms[0] if rms else sft)

    # sizes, distributed set-up, placement, optimizers, the loop's state
    sizes = parallel.rollout_split(args, group_size=1, has_ptx=bool(data.ptx) and args.ptx_coef > 0)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    delay = args.critic_warmup_steps  # the actor's learning rate warms up after the critic's warm-up
    common.size_warnings(
        args.rollout_batch_size, "--rollout-batch-size", len(data.prompts), None, args.warmup_steps, max_steps, delay
    )
    models = rollout.place(models, args, d, dtype)  # under bf16, a bf16 sampler copy of the actor
    # actor.model and critic.model hold the parameters and the checkpoint; actor.forward and critic.forward (set
    # below) are what the losses call
    actor, critic = build_optimizers(args, models, max_steps, d.device.type)
    print0(
        f"ppo: {len(data.prompts)} prompts ({data.skipped()}) | actor "
        f"{actor.model.num_params() / 1e6:.2f} M, critic {critic.model.num_params() / 1e6:.2f} M | rollout "
        f"{args.rollout_batch_size} = {d.world_size} ranks x {args.num_minibatches} minibatches x "
        f"{sizes.grad_accum_steps} accum x {sizes.micro_batch_size} | {max_steps} iterations | rm {args.rm_ckpt} | "
        f"kl_coef {args.kl_coef} | device {d.device} {dtype}"
    )
    print0(rollout.rules(args, data))
    loop = rollout.build_loop(args, data, sizes, 1, d, tok.pad_id)  # its generator: sampling and shuffling
    kl_controller = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
    reward_moments = RunningMoments()
    detector = CollapseDetector(args.collapse_window, args.collapse_z, args.collapse_lag)
    run = checkpoints.Run("ppo", args, d, tok, [actor, critic], started=t_start)
    if args.resume:
        ckpt = loop.resume(run)
        reward_moments.load_state_dict(ckpt["reward_moments"])
        kl_controller.load_state_dict(ckpt["kl_ctl"])
        detector.load_state_dict(ckpt["data_state"]["collapse"])
        models.refresh_sampler()  # the resumed actor into its bf16 copy, before it samples
    # actor.forward and critic.forward: compiled on CUDA, DDP-wrapped under torchrun; the rollout runs the roles
    # compiled
    compiled = rollout.training_forwards(models, [actor, critic], args.compile, d)
    engine = rollout.Engine(
        compiled, tok, args, sizes.micro_batch_size, loop.generator, dtype, data.reward_fn, data.gold_fn, data.make_env
    )
    logger = common.Logger(args.out_dir, d.master, resume_step=loop.step if args.resume else None, console_keys=CONSOLE)
    peak = common.peak_flops(d.device, args.peak_flops, dtype)

    # the loop: steps 1-5 (ppo_rollout), 6 (ppo_update), 7 (log, samples, collapse check, checkpoint)
    start_step = loop.step
    records = []
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the iteration, exit 128 + signal
    while loop.step < max_steps:
        t_rollout = time.time()
        kl_coef = kl_controller.value
        experience, metrics, records = ppo_rollout(engine, args, loop.prompt_stream.next(), kl_coef, reward_moments)
        kl_controller.update(metrics["objective/kl"], args.rollout_batch_size)
        t_update = time.time()
        lr, critic_lr = common.step_lr(actor, loop.step), common.step_lr(critic, loop.step)
        updated, diagnostics = ppo_update(
            actor, critic, experience, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
        )
        if not loop.first_micro_batch:  # this process's first update whose first micro-batch has tokens (a host read)
            loop.first_micro_batch = rollout.read_diagnostics(diagnostics["first_micro_batch"])
        models.refresh_sampler()  # the updated actor into its bf16 copy, in place
        loop.step += 1
        loop.updates += diagnostics["updates"]
        loop.episodes += args.rollout_batch_size
        stopping = stop.requested(d.device)
        t_end = time.time()

        # 7. monitoring; the collapse detector watches the actor's moves only (after the critic warm-up)
        step = loop.step
        alarm = step > args.critic_warmup_steps and detector.update(
            metrics["objective/kl"], metrics["rollout/response_len"], metrics["rollout/perplexity"]
        )
        times = (t_rollout, t_update, t_end)
        metrics |= common.perf_metrics(models, experience, args.ppo_epochs, times, peak, d.world_size)
        metrics |= updated | {
            "train/lr": lr,
            "train/critic_lr": critic_lr,
            "train/kl_coef": kl_coef,
            "train/updates": loop.updates,
            "train/episodes": loop.episodes,
            "collapse/alarm": float(alarm),
        }
        if step == start_step + 1:  # the first iteration of this process: how close sampler and trainer agree
            largest, mean = metrics["rollout/logprob_err"], metrics["rollout/logprob_err_mean"]
            print0(f"step {step}: generation vs training-forward log-probs, |diff| max {largest:.1e} mean {mean:.1e}")
        last = step == max_steps
        # --*-every N: every N iterations and the last (0: the last only)
        console = (args.log_every > 0 and step % args.log_every == 0) or last or alarm
        logger.log(step, metrics, max_steps, console=console)
        if (args.sample_every > 0 and step % args.sample_every == 0) or last:
            logger.sample_table(step, records)
        if alarm and args.stop_on_collapse:
            print0(f"collapse alarm at step {step}: stopping (the last checkpoint saved before it is kept)")
            break
        if (args.save_every > 0 and step % args.save_every == 0) or last or stopping:
            data_state = loop.data_state() | {"collapse": detector.state_dict()}
            ppo_state = dict(reward_moments=reward_moments.state_dict(), kl_ctl=kl_controller.state_dict())
            run.save(step, data_state, loop.generator, **ppo_state, **loop.hashes)
        if stopping:
            logger.close()
            stop.exit(stopping, run.path)

    # the end: a few samples to look at, the export
    stop.close()
    for record in records[:5]:
        text = format_sample(record["prompt"], record["response"], record["ended"])
        print0(f"  {text}  (score {record['score']:.2f})")
    if args.export_hf and d.master:
        checkpoints.export_hf(actor.model, tok, args.export_hf)
    first_line = ", ".join(f"{key} {value:.1e}" for key, value in loop.first_micro_batch.items())
    print0(f"ppo done in {time.time() - t_start:.0f}s: {run.path} | first minibatch of the first update: {first_line}")
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
