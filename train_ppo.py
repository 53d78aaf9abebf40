"""PPO-max: reinforcement learning from a reward model with every stabilising trick of Zheng et al. (2023) inline.

Each iteration samples responses from the policy (actor), scores them with the frozen reward model, subtracts a
per-token KL penalty (k1) against the frozen SFT policy (reference), estimates advantages with GAE from a critic that
starts from the reward model, and takes clipped PPO steps on the actor and the critic, plus an LM loss on
pre-training text (ptx). The PPO-max tricks: reward normalisation and clipping over running moments, the KL penalty
(fixed, or adaptive with --kl-target), advantage whitening per minibatch, value clipping, critic initialisation from
the RM and critic warm-up, grad-norm clipping, ptx, and a collapse detector over the monitoring metrics.
Paper: https://arxiv.org/abs/2307.04964 (Secrets of RLHF in Large Language Models Part I: PPO).
What every RL stage does the same (the reference, RM ensembles and --rm-agg, --reward-fn, --ref-ckpt, --tis-cap,
LoRA, FSDP, compile, resume, the prompt and ptx streams, steps 1-3 of the rollout) is rollout.py's; the critic-free
estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) are train_grpo.py.

python train_ppo.py                                                   # built-in task, CPU, ~2 min (after SFT and RM)
python train_ppo.py --rm-ckpt none --reward-fn task:gold_reward       # optimise the gold reward itself, no RM
torchrun --standalone --nproc_per_node 8 train_ppo.py --sft-ckpt sft/ckpt.pt --rm-ckpt rm/ckpt.pt --prompts p.jsonl
"""

import math
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import checkpoints
import common
import hf
import parallel
import rollout
from common import Trained, UserError, exact_div, format_sample, print0
from data import Order
from model import response_forward
from rollout import Models, RunningMoments, masked_mean, masked_whiten, world_size
from tokenizer import Tokenizer


@common.stage_args
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


# flags an older train_ppo.py had, with the value this one always uses: a checkpoint of a run that set another is
# not resumed here (checkpoints.resume_args)
MOVED = "critic-free runs live in train_grpo.py now: start one there (--sft-ckpt takes this checkpoint)"
RETIRED = {
    "adv_estimator": ("gae", MOVED),
    "group_size": (1, MOVED),
    "kl_penalty": ("reward", MOVED),
    "kl_estimator": ("k1", "PPO-max's KL in the reward is k1 (k2 and k3 there work against the KL, DESIGN §5d)"),
    "loss_agg": ("token_mean", MOVED),
    "mask_truncated": (False, MOVED),
    "dynamic_sampling": (False, MOVED),
    "cliprange_high": (None, MOVED),
    "dual_clip": (None, MOVED),
    "entropy_coef": (0.0, "the entropy bonus is no flag of train_ppo.py (README, How to extend)"),
}


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
# PPO math: pure functions, imported by tests. Tensors are (B, T) over response tokens, mask 1.0 = real token.


def shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    """scores (B,), the rest (B, T) -> (rewards, kl), both (B, T) and 0 on padding: rewards = -kl_coef * k1 per token
    (k1 = logp - ref_logp, rollout.kl_estimate), plus the score on the last valid token (the EOS)."""
    kl = rollout.kl_estimate(logprobs, ref_logprobs, mask, "k1")
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


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: Optional[float], denom=None, weights=None):
    """Clipped surrogate, per token l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps)) (cliprange None: no clip, l = -A*rho),
    all (B, T). Returns sum(l * weights) / denom (defaults: the mask and its count, the mean over valid entries;
    PPO passes the minibatch's global token count, and the mask times the --tis-cap weights). stats: clipfrac
    (clipped term strictly larger), approx_kl (mean of (rho - 1) - log rho), ratio_mean."""
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
    Calibration on the built-in task: experiments/ablation.py replays it on every run (docs/results.md, "Ablation")."""

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
# one iteration: rollout (steps 1-5) and update (step 6). The orchestration functions read the run's resolved Args,
# passed whole; what changes while the run goes (models, optimizers, beta, the reward moments, the generator) and the
# derived sizes are explicit arguments. The math above stays pure.


@torch.no_grad()
def critic_values(critic, experience: dict, micro_batch_size: int, temperature: float, amp) -> torch.Tensor:
    """The critic's values (B, T) of the rollout's response tokens, per micro-batch, masked (DESIGN §2: a value is
    read where the token's log-prob is, one position before the token)."""
    parts = []
    for start in range(0, experience["mask"].size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        inputs = [experience[key][rows] for key in ("query", "query_mask", "response", "mask")]
        with amp:
            parts.append(response_forward(critic, *inputs, temperature)[1])
    return torch.cat(parts) * experience["mask"]


@torch.no_grad()
def ppo_rollout(
    models: Models,
    critic,
    tok: Tokenizer,
    prompts: list,
    args: Args,
    *,
    kl_coef: float,
    reward_moments: RunningMoments,
    micro_batch_size: int,
    generator: torch.Generator,
    reward_fn=None,
    gold_fn=None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's prompts: rollout.rollout (generate, score, log-probs), the critic's values, then
    kl_coef and reward_moments (updated in place) shape the rewards and GAE the advantages. Returns (experience,
    metrics: global means keyed by DESIGN §6 tags, samples)."""
    shared = dict(micro_batch_size=micro_batch_size, generator=generator, reward_fn=reward_fn, gold_fn=gold_fn)
    experience, sums, samples = rollout.rollout(models, tok, prompts, args, dtype=dtype, **shared)
    mask = experience["mask"]
    amp = parallel.autocast(mask.device, dtype)
    values = critic_values(critic, experience, micro_batch_size, args.temperature, amp)
    # 4. rewards: running moments over all history and ranks, normalise, clip (PPO-max §3.2); -beta * k1 per token
    scores = experience["scores"]
    reward_moments.update(scores)
    score_norm = rollout.normalize_scores(
        scores, reward_moments.mean, reward_moments.std, args.reward_norm, args.reward_clip
    )
    rewards, _ = shape_rewards(score_norm, experience["logprobs"], experience["ref_logprobs"], mask, kl_coef)
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
    return experience, metrics, samples


def actor_backward(actor, batch: dict, args: Args, token_count, sync: bool, amp):
    """The actor's clipped policy loss on one micro-batch, a token mean over the minibatch's global token count, and
    its backward (gradients accumulate; DDP all-reduces where sync). Returns (its sums for the metrics, the new
    log-probs)."""
    mask = batch["mask"]
    weights = mask * batch["tis"] if "tis" in batch else mask  # --tis-cap
    with parallel.grad_sync(actor, sync), amp:
        logits, logprobs = rollout.policy_logprobs(actor, batch, args.temperature)
        loss, stats = ppo_policy_loss(
            logprobs, batch["logprobs"], batch["advantages"], mask, args.cliprange, denom=token_count, weights=weights
        )
        sums = {"pg_loss": loss.detach()}  # each term's global sum, for the metrics
    # DDP averages gradients over ranks; the losses are global sums, so each backward scales by the world size
    (loss * world_size()).backward()
    tokens = mask.sum()
    sums["tokens"] = tokens
    for key in ("approx_kl", "clipfrac", "ratio_mean"):
        sums[key] = rollout.token_sum(stats[key], tokens)
    return sums, logprobs


def critic_backward(critic, batch: dict, cliprange_value, token_count, sync: bool, amp, temperature: float) -> dict:
    """The clipped value loss on one micro-batch over the minibatch's global token count, and its backward."""
    inputs = [batch[key] for key in ("query", "query_mask", "response", "mask")]
    with parallel.grad_sync(critic, sync), amp:
        _, new_values = response_forward(critic, *inputs, temperature)
        vf_loss, vf_stats = ppo_value_loss(
            new_values, batch["values"], batch["returns"], batch["mask"], cliprange_value, denom=token_count
        )
    (vf_loss * world_size()).backward()
    tokens = batch["mask"].sum()
    return {"vf_loss": vf_loss.detach(), "vf_clipfrac": vf_stats["clipfrac"] * tokens, "tokens": tokens}


def ppo_update(
    actor: Trained,
    critic: Trained,
    guard: common.StepGuard,
    experience: dict,
    args: Args,
    *,
    micro_batch_size: int,
    train_actor: bool = True,
    generator: Optional[torch.Generator] = None,
    ptx_sampler=None,
    dtype: torch.dtype = torch.float32,
    step: int = 0,
    diagnose: bool = False,
) -> tuple[dict, dict]:
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches, one optimizer step per
    minibatch for the critic and (unless train_actor is False: critic warm-up) the actor, each through its Trained
    entry (the training forward `forward`, compiled and/or DDP; guarded_step over the bare modules). ptx_sampler() ->
    (inputs, targets, mask) of one micro-batch of pre-training text (None: no ptx loss). A model whose global grad
    norm is not finite skips that step (the other still steps); the step counts once in guard.skipped. Returns
    (metrics: global means keyed by DESIGN §6 tags over the steps each model took, policy/* only when the actor
    trained, and policy/update_kl, how far the update moved the policy (rollout.update_kl); diagnostics:
    {"updates": steps every model took, "skipped": steps some model skipped, "first": with diagnose, ratio_err,
    approx_kl and clipfrac of the first micro-batch, which must read 0, 0, 0})."""
    mask = experience["mask"]
    device = mask.device
    minibatch_rows = exact_div(mask.size(0), args.num_minibatches, "rollout rows per rank over --num-minibatches")
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    amp = parallel.autocast(device, dtype)
    actor_forward = actor.model if actor.forward is None else actor.forward
    critic_forward = critic.model if critic.forward is None else critic.forward
    use_ptx = train_actor and args.ptx_coef > 0 and ptx_sampler is not None
    batch = dict(experience)
    metrics = {}
    if args.tis_cap is not None:  # truncated importance sampling: the sampler's and the trainer's numerics differ
        batch["tis"], metrics = rollout.tis_metrics(experience, mask, args.tis_cap, device)
    if args.adv_whiten == "rollout":  # once over the whole rollout with global statistics (TRL)
        mean, variance = rollout.global_moments(batch["advantages"], mask, device)
        batch["advantages"] = masked_whiten(batch["advantages"], mask, mean=mean, var=variance)
    totals = {"model": {}, "critic": {}}  # this rank's sums over the steps each model took
    steps = {"model": 0, "critic": 0}  # the steps each model took (the same on every rank)
    first = {}
    updates = 0  # optimizer steps every model took
    skipped_before = guard.skipped
    lengths = mask.sum(1).long().tolist()  # one host sync: each micro-batch trims its right padding to its longest row
    for _ in range(args.ppo_epochs):
        permutation = torch.randperm(mask.size(0), generator=generator, device=generator.device if generator else "cpu")
        widths = rollout.micro_batch_widths(lengths, permutation.tolist(), micro_batch_size)
        permutation = permutation.to(device)
        for minibatch in range(args.num_minibatches):
            minibatch_rows_taken = slice(minibatch * minibatch_rows, (minibatch + 1) * minibatch_rows)
            minibatch_batch = rollout.take_rows(batch, permutation[minibatch_rows_taken])
            minibatch_mask = minibatch_batch["mask"]
            if args.adv_whiten == "minibatch":  # PPO-max: global statistics over the whole minibatch
                mean, variance = rollout.global_moments(minibatch_batch["advantages"], minibatch_mask, device)
                advantages = masked_whiten(minibatch_batch["advantages"], minibatch_mask, mean=mean, var=variance)
                minibatch_batch["advantages"] = advantages
            ptx_batches = [ptx_sampler() for _ in range(grad_accum_steps)] if use_ptx else []
            # the step's global token counts (loss denominators): one all-reduce per step, left on device
            ptx_tokens = sum((ptx_batch[2].sum() for ptx_batch in ptx_batches), torch.zeros((), device=device))
            token_count, ptx_token_count = parallel.all_reduce_stack([minibatch_mask.sum(), ptx_tokens], device).float()
            step_sums = {"model": {}, "critic": {}}  # this step's sums per model, kept if that model steps
            for micro in range(grad_accum_steps):
                rows = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
                micro_batch = rollout.take_rows(minibatch_batch, rows, widths[minibatch * grad_accum_steps + micro])
                sync = micro == grad_accum_steps - 1
                if train_actor:
                    if use_ptx:
                        ptx_sums = rollout.ptx_backward(
                            actor_forward, ptx_batches[micro], args.ptx_coef, ptx_token_count, amp
                        )
                        rollout.add_all(step_sums["model"], ptx_sums)
                    sums, logprobs = actor_backward(actor_forward, micro_batch, args, token_count, sync, amp)
                    rollout.add_all(step_sums["model"], sums)
                    if diagnose and not first:  # must be ratio 1, approx_kl 0, clipfrac 0 (DESIGN §5)
                        first = rollout.first_micro_batch(logprobs, micro_batch["logprobs"], micro_batch["mask"], sums)
                sums = critic_backward(
                    critic_forward, micro_batch, args.cliprange_value, token_count, sync, amp, args.temperature
                )
                rollout.add_all(step_sums["critic"], sums)
            # separate optimizers and clips; each norm is global (after DDP's all-reduce; FSDP2's is a DTensor whose
            # full value is the global norm), so every rank takes the same decision
            stepping = [actor, critic] if train_actor else [critic]
            stepped = common.guarded_step(stepping, guard, step)
            for entry in stepping:
                if entry.name in stepped:
                    rollout.add_all(totals[entry.name], step_sums[entry.name])
                    steps[entry.name] += 1
                else:  # name the bad quantity (the loss sums are this rank's)
                    losses = ", ".join(f"{key} {value.item():.3g}" for key, value in step_sums[entry.name].items())
                    print0(f"step {step}: the {entry.name}'s sums when its grad norm was not finite: {losses}")
            updates += len(stepped) == len(stepping)
    metrics |= update_metrics(totals, steps, guard, device)
    metrics["policy/update_kl"] = rollout.update_kl(actor_forward, experience, micro_batch_size, args.temperature, amp)
    return metrics, {"updates": updates, "skipped": guard.skipped - skipped_before, "first": first}


def update_metrics(totals: dict, steps: dict, guard: common.StepGuard, device) -> dict:
    """Global means over the steps each model took from this rank's sums (one all-reduce; every rank has the same
    keys, since the steps are decided the same on every rank), and each model's mean grad norm (already global) from
    the guard. A loss sum is the step's global loss (its denominators are global), a per-token stat sum is over
    tokens."""
    flat = {f"{name}/{key}": value for name, sums in totals.items() for key, value in sums.items()}
    summed = {}
    if flat:  # empty when every step was skipped: the same on every rank, so no rank waits in a lone collective
        summed = parallel.all_reduce_dict({key: flat[key] for key in sorted(flat)}, device)
    metrics = guard.read({"model": "train/grad_norm", "critic": "value/grad_norm"})
    if steps["critic"]:
        metrics["value/loss"] = summed["critic/vf_loss"] / steps["critic"]
        metrics["value/clipfrac"] = summed["critic/vf_clipfrac"] / summed["critic/tokens"]
    if steps["model"]:
        metrics["policy/loss"] = summed["model/pg_loss"] / steps["model"]
        for key in ("approx_kl", "clipfrac", "ratio_mean"):
            metrics[f"policy/{key}"] = summed[f"model/{key}"] / summed["model/tokens"]
        for key, tag in (("ptx_loss", "ptx/loss"),):  # the loss terms a run has beside the policy loss
            if f"model/{key}" in summed:
                metrics[tag] = summed[f"model/{key}"] / steps["model"]
    return metrics


# -----------------------------------------------------------------------------
# main: the set-up in named builders, then the loop


def build_critic(args: Args, sft: dict, rms: list[dict]) -> torch.nn.Module:
    """PPO-max's critic: the first RM's trunk and score head (with no RM, the SFT trunk with a fresh head), on the
    CPU, LoRA and --grad-ckpt applied."""
    critic = hf.model_from_checkpoint(rms[0] if rms else sft, lm_head=False, score_head=True)
    parallel.prepare_model(critic, args, "critic")
    return critic


def build_optimizers(args: Args, models: Models, critic, max_steps: int, device_type: str) -> tuple[Trained, Trained]:
    """The actor's and the critic's AdamW, LR schedule and grad-norm clip, as Trained entries (the checkpoint keys
    `model` and `critic`). The actor's schedule starts when it starts moving, after the critic warm-up."""
    betas = (0.9, 0.95)
    actor_optimizer = models.actor.configure_optimizers(args.weight_decay, args.lr, betas, device_type)
    actor_schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps, delay=args.critic_warmup_steps)
    actor = Trained("model", models.actor, actor_optimizer, actor_schedule, args.grad_clip)
    critic_optimizer = critic.configure_optimizers(args.weight_decay, args.critic_lr, betas, device_type)
    critic_schedule = common.LRSchedule(args.critic_lr, args.warmup_steps, max_steps)
    return actor, Trained("critic", critic, critic_optimizer, critic_schedule, args.critic_grad_clip)


CONSOLE = (
    "objective/score",
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
    # --resume: the run's own flags
    args = checkpoints.resume_args(args, "ppo", rollout.resolve_rollout_args, RETIRED)
    check_args(args)
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)  # refuses to replace a run silently
    common.seed_everything(args.seed)  # before any model is built: a fresh critic head follows --seed
    # 1. checkpoints, tokenizer, models, data (user mistakes surface here, before any process group)
    sft, ref, rms = rollout.load_inputs(args)
    tok = Tokenizer.from_state(sft["tokenizer"])
    reward_fn = common.load_reward_fn(args.reward_fn) if args.reward_fn else None
    actor_model, reference = rollout.build_policy(args, sft, ref)
    critic_model = build_critic(args, sft, rms)
    reward_models = rollout.build_reward_models(args, rms, rm_base=critic_model)
    models = Models(actor_model, reference, reward_models)
    prompts, too_long, ptx, gold_fn = rollout.load_prompts(args, tok, models.actor.config.block_size)

    # 2. sizes, distributed set-up, optimizers, state
    sizes = rollout.batch_sizes(args, group_size=1, has_ptx=bool(ptx) and args.ptx_coef > 0)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    print0(
        f"ppo: {len(prompts)} prompts ({too_long} too long, skipped) | {len(ptx)} ptx texts | actor "
        f"{models.actor.num_params() / 1e6:.2f} M, critic {critic_model.num_params() / 1e6:.2f} M | rollout "
        f"{args.rollout_batch_size} = {d.world_size} ranks x {args.num_minibatches} minibatches x "
        f"{sizes.grad_accum_steps} accum x {sizes.micro_batch_size} | {max_steps} iterations | rm {args.rm_ckpt} | "
        f"kl_coef {args.kl_coef} | device {d.device} {dtype}"
    )
    for model in (models.actor, critic_model, *models.frozen()):
        model.eval()  # eval mode always: dropout off in all four models
        frozen = model not in (models.actor, critic_model)  # stored in bf16 under bf16 (DESIGN §7)
        parallel.place_model(model, args, d, dtype, frozen=frozen)  # --fsdp shards the frozen models too
    models = models.with_sampler(dtype, args.fsdp)  # under bf16 the rollouts come from a bf16 copy of the actor
    actor, critic = build_optimizers(args, models, critic_model, max_steps, d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)  # sampling and shuffling
    kl_controller = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
    reward_moments = RunningMoments()
    detector = CollapseDetector(args.collapse_window, args.collapse_z, args.collapse_lag)
    prompt_stream = rollout.PromptStream(prompts, Order(len(prompts), args.seed), sizes.prompts_per_rank, 1, d)
    ptx_order = Order(max(1, len(ptx)), args.seed + 1)
    ptx_sampler = rollout.PtxSampler(ptx, ptx_order, sizes.ptx_micro_batch_size, d, tok.pad_id)
    guard = common.StepGuard()
    run = checkpoints.Run("ppo", args, d, tok, [actor, critic], started=t_start)
    step = 0
    updates = 0  # optimizer steps taken
    episodes = 0  # responses sampled
    hashes = rollout.input_hashes(args)
    if args.resume:
        ckpt, step, updates, episodes = rollout.resume_loop(
            run, hashes, sampler, prompt_stream, ptx_sampler, guard, args
        )
        reward_moments.load_state_dict(ckpt["reward_moments"])
        kl_controller.load_state_dict(ckpt["kl_ctl"])
        detector.load_state_dict(ckpt["data_state"]["collapse"])
    # the training forward (compiled on CUDA) also serves the no-grad rollout passes; DDP wraps it for the update
    forward = models.compiled(args.compile, d.device)
    critic_forward = (
        rollout.compile_role(critic_model) if parallel.use_compile(args.compile, d.device) else critic_model
    )
    replicated = d.ddp and not args.fsdp  # FSDP2 needs no wrapper
    actor.forward = parallel.replicate(forward.actor, d) if replicated else forward.actor
    critic.forward = parallel.replicate(critic_forward, d) if replicated else critic_forward
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None, console_keys=CONSOLE)
    peak = common.peak_flops(d.device, args.peak_flops)
    shared = dict(micro_batch_size=sizes.micro_batch_size, generator=sampler, dtype=dtype)
    scoring = dict(reward_fn=reward_fn, gold_fn=gold_fn, reward_moments=reward_moments)
    updating = dict(ptx_sampler=ptx_sampler if sizes.ptx_micro_batch_size else None, **shared)

    # 3. the loop: rollout (steps 1-5), update (6), then log, samples, collapse check, checkpoint (7)
    first = {}  # the first minibatch of this process's first update
    start_step = step
    records = []
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the iteration, exit 128 + signal
    while step < max_steps:
        t_rollout = time.time()
        kl_coef = kl_controller.value
        batch_prompts = prompt_stream.next()
        experience, metrics, records = ppo_rollout(
            forward, critic_forward, tok, batch_prompts, args, kl_coef=kl_coef, **scoring, **shared
        )
        kl_controller.update(metrics["objective/kl"], args.rollout_batch_size)
        t_update = time.time()
        lr, critic_lr = common.step_lr(actor, step), common.step_lr(critic, step)
        train_actor = step >= args.critic_warmup_steps
        updated, diagnostics = ppo_update(
            actor, critic, guard, experience, args, train_actor=train_actor, step=step, diagnose=not first, **updating
        )
        first = first or diagnostics["first"]
        rollout.refresh_sampler(models)  # the updated actor into its bf16 copy, in place
        step += 1
        updates += diagnostics["updates"]
        episodes += args.rollout_batch_size * int(metrics.get("rollout/sample_rounds", 1))
        stopping = stop.requested(d.device)
        t_end = time.time()

        # 7. monitoring; the collapse detector watches the actor's moves only (after the critic warm-up)
        alarm = step > args.critic_warmup_steps and detector.update(
            metrics["objective/kl"], metrics["rollout/response_len"], metrics["rollout/perplexity"]
        )
        times = (t_rollout, t_update, t_end)
        metrics |= rollout.perf_metrics(models, experience, args.ppo_epochs, times, peak, d.world_size, critic_model)
        metrics |= updated | {
            "train/lr": lr,
            "train/critic_lr": critic_lr,
            "train/kl_coef": kl_coef,
            "train/updates": updates,
            "train/episodes": episodes,
            "train/skipped_steps": guard.skipped,
            "collapse/alarm": float(alarm),
        }
        if step == start_step + 1:  # the first iteration of this process: how close sampler and trainer agree
            logprob_error = metrics["rollout/logprob_err"]
            print0(f"step {step}: generation vs training-forward log-probs, max |diff| {logprob_error:.1e}")
        logger.log(step, metrics, max_steps, console=common.every(step, args.log_every) or step == max_steps or alarm)
        if common.every(step, args.sample_every) or step == max_steps:
            rollout.log_samples(logger, records, step)
        if alarm and args.stop_on_collapse:
            print0(f"collapse alarm at step {step}: stopping (the last checkpoint saved before it is kept)")
            break
        if common.every(step, args.save_every) or step == max_steps or stopping:
            data_state = rollout.loop_state(prompt_stream, ptx_sampler, guard, updates, episodes)
            data_state["collapse"] = detector.state_dict()
            ppo_state = dict(reward_moments=reward_moments.state_dict(), kl_ctl=kl_controller.state_dict())
            run.save(step, data_state, sampler, **ppo_state, **hashes)
        if stopping:
            logger.close()
            stop.exit(stopping, run.path)

    stop.close()
    # 4. a few samples to look at
    for record in records[:5]:
        text = format_sample(record["prompt"], record["response"], record["ended"])
        print0(f"  {text}  (score {record['score']:.2f})")
    if args.export_hf and d.master:
        checkpoints.export_hf(models.actor, tok, args.export_hf)
    first_line = ", ".join(f"{key} {value:.1e}" for key, value in first.items())
    print0(f"ppo done in {time.time() - t_start:.0f}s: {run.path} | first minibatch of the first update: {first_line}")
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, common.cli(Args))
