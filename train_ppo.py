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
aggregations as flags; the settings that depend on the estimator are resolved once at start-up
(resolve_estimator_defaults) and printed.

python train_ppo.py                                                   # built-in task, CPU, ~2 min (after SFT and RM)
python train_ppo.py --rm-ckpt none --reward-fn task:gold_reward       # optimise the gold reward itself, no RM
python train_ppo.py --adv-estimator grpo                              # GRPO: groups of 4, k3 KL in the loss
python train_ppo.py --adv-estimator grpo --no-grpo-std-norm --loss-agg seq_sum_norm   # Dr. GRPO
torchrun --standalone --nproc_per_node 8 train_ppo.py --sft-ckpt sft/ckpt.pt --rm-ckpt rm/ckpt.pt --prompts p.jsonl
"""

import copy
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
import tyro

import checkpoints
import common
import hf
import parallel
from common import Trained, UserError, exact_div, format_sample, print0
from data import Order, Tokenizer, encode_prompts, encode_sft, pad_right, prompt_ids, prompt_text, read_jsonl
from lora import BaseView
from model import aggregate_rm_scores, entropy_from_logits, lm_loss, logprobs_from_logits, response_forward, sample
from task import build_task, gold_reward


@common.stage_args
@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/ppo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- models and data
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the policy's init (an SFT, DPO or PPO checkpoint), and the frozen reference unless --ref-ckpt"""
    ref_ckpt: Optional[str] = None
    """the frozen reference of the KL penalty (None: --sft-ckpt); a later round of iterated RLHF starts its policy
    from the last round's and keeps the SFT policy as the reference"""
    rm_ckpt: list[str] = field(default_factory=lambda: ["out/rm/ckpt.pt"])
    """frozen reward models: one, or the K members of an ensemble combined by --rm-agg; the first is also the critic's
    init; 'none': --reward-fn alone, critic from the SFT trunk"""
    rm_agg: Literal["mean", "min", "uwo"] = "mean"
    """an ensemble's scores combined: mean, min (the worst case) or uwo = mean - --rm-uwo-coef x the members'
    variance (uncertainty-weighted optimisation, Coste et al. 2023); one RM is its own score under all three"""
    rm_uwo_coef: float = 1.0
    """--rm-agg uwo: the weight of the members' population variance"""
    reward_fn: Optional[str] = None
    """module:function or path/to/file.py:function, fn(prompt: str, response: str, ended: bool) -> float, added to
    the RM score (e.g. task:gold_reward)"""
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
    """grpo only: divide by the group's std (--no-grpo-std-norm: Dr. GRPO, with --loss-agg seq_sum_norm)"""
    mask_truncated: bool = False
    """DAPO overlong filtering: responses without EOS keep their score but contribute nothing to the policy loss"""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (group_size > 1): a group whose G scores are all equal carries no signal; sample fresh
    groups until the iteration has rollout_batch_size / G informative ones or --max-sample-rounds are spent (then the
    first round's other groups fill the batch without a policy loss)"""
    max_sample_rounds: int = 3
    """--dynamic-sampling only: the most rollouts per iteration"""
    # --- reward and KL
    reward_norm: Optional[Literal["none", "scale", "norm"]] = None
    """normalise scores with running moments over all history: scale = s/std, norm = (s-mean)/std (None: norm for
    gae/reinforce_pp, none for grpo/rloo)"""
    reward_clip: Optional[float] = 5.0
    """clip normalised scores to +-this (None: off); grpo/rloo use raw scores, unclipped, unless --reward-norm is
    given"""
    kl_coef: Optional[float] = None
    """beta of the KL penalty (the initial value when --kl-target is set; None: the estimator's default, 0.15 for
    grpo, 0.3 for the others; gae's 0.3 keeps the built-in task's valid fraction above 0.9 across retrained RMs)"""
    kl_penalty: Optional[Literal["reward", "loss"]] = None
    """where the KL goes: -beta*kl in the rewards, or beta*k3 on the current log-probs in the policy loss (None: loss
    for grpo, reward for the others)"""
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = None
    """per-token KL estimate, with d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = (r - 1) - log r with r = ref_p / p
    (None: k1 in the reward, k3 in the loss; k1 in the loss is refused: its expected gradient is zero)"""
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
    cliprange: Optional[float] = 0.2
    """policy ratio clip epsilon (None: no clip, the plain policy gradient -A*ratio)"""
    cliprange_high: Optional[float] = None
    """DAPO clip-higher: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] (None: cliprange)"""
    dual_clip: Optional[float] = None
    """dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the per-token loss is capped at -c*A (None: off)"""
    tis_cap: Optional[float] = None
    """truncated importance sampling (Yao et al. 2025), for a sampler whose numerics differ from the trainer's (bf16):
    each token's policy loss weighted by min(pi_old / pi_sampler, C), pi_old the training forward's probability of
    the sampled token and pi_sampler the generation's own (None: off)"""
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


CRITIC_ESTIMATORS = ("gae",)  # the estimators with a critic; the others build, step and save none
GROUP_ESTIMATORS = ("grpo", "rloo")  # advantages from comparing a prompt's G responses: G >= 2


def resolve_estimator_defaults(args: Args) -> Args:
    """A copy of args where every estimator-dependent flag left at None holds ESTIMATOR_DEFAULTS[args.adv_estimator]:
    run once at start-up (checkpoints.resume_args), so everything after it, and the checkpoint, see the resolved
    values. Two settings follow the estimator rather than default: a critic-free estimator has no critic warm-up,
    and grpo/rloo clip only scores they normalise (--reward-clip applies to them only when --reward-norm is
    given)."""
    defaults = ESTIMATOR_DEFAULTS[args.adv_estimator]
    resolved = {}
    for key, default in defaults.items():
        given = getattr(args, key)
        resolved[key] = default if given is None else given
    if args.adv_estimator not in CRITIC_ESTIMATORS:
        resolved["critic_warmup_steps"] = 0
    if args.adv_estimator in GROUP_ESTIMATORS and args.reward_norm is None:
        resolved["reward_clip"] = None
    return replace(args, **resolved)


def resolve_args(args: Args) -> Args:
    """Every setting that depends on others, resolved once at start-up (checkpoints.resume_args applies it to the
    saved args too, so both compare like with like): the RM list (a checkpoint from before ensembles saved one path),
    older names of reward functions, the estimator's defaults, and the KL estimator of its placement (k1 in the
    reward, k3 in the loss)."""
    rm_ckpt = [args.rm_ckpt] if isinstance(args.rm_ckpt, str) else list(args.rm_ckpt)
    reward_fn = common.REWARD_FN_ALIASES.get(args.reward_fn, args.reward_fn)
    args = resolve_estimator_defaults(replace(args, rm_ckpt=rm_ckpt, reward_fn=reward_fn))
    if args.kl_estimator is None:
        return replace(args, kl_estimator="k3" if args.kl_penalty == "loss" else "k1")
    return args


def uses_critic(args: Args) -> bool:
    """Only gae has a critic: the critic-free estimators build, step and save none."""
    return args.adv_estimator in CRITIC_ESTIMATORS


def check_args(args: Args) -> None:
    """Settings no run can mean (on the resolved args): a one-line UserError naming the flag, before any work."""
    estimator = args.adv_estimator
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: PPO samples from the tempered distribution; use > 0")
    if args.rm_ckpt == ["none"] and args.reward_fn is None:
        raise UserError("--rm-ckpt none needs --reward-fn module:function (e.g. task:gold_reward)")
    if "none" in args.rm_ckpt and len(args.rm_ckpt) > 1:
        raise UserError(f"--rm-ckpt {' '.join(args.rm_ckpt)}: 'none' stands alone (no reward model)")
    if args.kl_penalty == "loss" and args.kl_estimator == "k1":
        raise UserError("--kl-estimator k1 in the loss: its expected gradient is zero; use k2 or k3")
    if args.group_size < 1 or (estimator in GROUP_ESTIMATORS and args.group_size < 2):
        raise UserError(f"--group-size {args.group_size}: {estimator} compares responses within a group, use >= 2")
    if args.dynamic_sampling and args.group_size < 2:
        raise UserError(f"--dynamic-sampling compares a group's scores: use --group-size >= 2, not {args.group_size}")
    if args.max_sample_rounds < 1:
        raise UserError(f"--max-sample-rounds {args.max_sample_rounds}: use >= 1")
    if args.max_sample_rounds != Args.max_sample_rounds and not args.dynamic_sampling:
        raise UserError(f"--max-sample-rounds {args.max_sample_rounds}: it applies to --dynamic-sampling only")
    if not args.grpo_std_norm and estimator != "grpo":
        raise UserError(f"--no-grpo-std-norm applies to --adv-estimator grpo, not {estimator}")
    if args.cliprange is not None and args.cliprange <= 0:
        raise UserError(f"--cliprange {args.cliprange}: use > 0 (None: no clip)")
    if args.cliprange_high is not None and (args.cliprange is None or args.cliprange_high <= 0):
        raise UserError(
            f"--cliprange-high {args.cliprange_high}: the upper bound 1 + eps needs eps > 0 and a --cliprange"
        )
    if args.tis_cap is not None and args.tis_cap <= 0:
        raise UserError(f"--tis-cap {args.tis_cap}: the cap of an importance weight, use > 0 (e.g. 2)")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise UserError(f"--dual-clip {args.dual_clip}: the cap -c*A needs c > 1")
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
    if args.entropy_coef < 0 or args.ptx_coef < 0:
        raise UserError(f"--entropy-coef {args.entropy_coef} --ptx-coef {args.ptx_coef}: loss weights, use >= 0")


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
    score on the last valid token (the EOS). KL estimators (http://joschu.net/blog/kl-approx.html), masked before any
    exponential (padding may hold any log-prob): k1 = logp - ref_logp, k2 = k1^2 / 2, k3 = (r - 1) - log r with
    r = ref_p / p."""
    log_ratio = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0)
    if kl_estimator == "k1":
        kl = log_ratio
    elif kl_estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif kl_estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio  # unbiased and >= 0
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


def loss_weights(mask, agg: str, n_seq, n_tok, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (B, T) -> (weights (B, T), denom): sum(loss * weights) / denom over all micro-batches and ranks of an
    optimizer step is its aggregated loss (the one path of every loss term). n_seq, n_tok: the step's global counts of
    kept sequences and tokens. token_mean: mask / n_tok; seq_mean: (mask / len_i) / n_seq; seq_sum_norm:
    mask / (max_new_tokens * n_seq) (Dr. GRPO)."""
    if agg == "token_mean":
        return mask, n_tok
    if agg == "seq_mean":
        lengths = mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1); an empty row has weight 0 anyway
        return mask / lengths, n_seq
    if agg == "seq_sum_norm":
        return mask, max_new_tokens * n_seq
    raise ValueError(f"unknown loss aggregation {agg!r}")


def ppo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cliprange: Optional[float],
    denom=None,
    weights=None,
    cliprange_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
):
    """Clipped surrogate, per token l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps_high)), eps_high = cliprange_high or
    cliprange (DAPO clip-higher; cliprange None: no clip, l = -A*rho); with dual_clip c > 1, l = min(l, -c*A) where
    A < 0 (Ye et al. 2020). All (B, T). Returns sum(l * weights) / denom (loss_weights; defaults: the mask and its
    count, the mean over valid entries). stats: clipfrac (clipped term strictly larger), clipfrac_low / clipfrac_high
    (the part with rho below / above the range), approx_kl (mean of (rho - 1) - log rho), ratio_mean."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # masked before the exponential
    ratio = torch.exp(log_ratio)
    lower, upper = 0.0, math.inf  # cliprange None: no clip (a ratio is > 0)
    if cliprange is not None:
        lower = 1.0 - cliprange
        upper = 1.0 + (cliprange if cliprange_high is None else cliprange_high)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, lower, upper)
    token_losses = torch.max(pg_losses, pg_losses2)
    if dual_clip is not None:
        capped = torch.min(token_losses, -dual_clip * advantages)
        token_losses = torch.where(advantages < 0, capped, token_losses)
    weights = mask if weights is None else weights
    pg_loss = (token_losses * weights).sum() / (mask.sum() if denom is None else denom)
    with torch.no_grad():
        clipped = pg_losses2 > pg_losses
        stats = {
            "clipfrac": masked_mean(clipped.float(), mask),
            "clipfrac_low": masked_mean((clipped & (ratio < lower)).float(), mask),
            "clipfrac_high": masked_mean((clipped & (ratio > upper)).float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return pg_loss, stats


def tis_weights(old_logprobs, sampler_logprobs, mask, cap: float) -> tuple[torch.Tensor, dict]:
    """Truncated importance sampling (Yao et al. 2025): per token (B, T) min(pi_old / pi_sampler, cap), pi_old the
    training forward's probability of the sampled token and pi_sampler the sampler's own, masked before the
    exponential (0 on padding); stats: tis_weight_mean, tis_clipfrac (the share of tokens whose ratio exceeds the
    cap), means over the valid tokens."""
    ratio = torch.exp(torch.where(mask.bool(), old_logprobs - sampler_logprobs, 0.0))
    weights = ratio.clamp(max=cap) * mask
    stats = {"tis_weight_mean": masked_mean(weights, mask), "tis_clipfrac": masked_mean((ratio > cap).float(), mask)}
    return weights, stats


def kl_loss(logprobs, ref_logprobs, mask, weights, denom, kl_coef: float, estimator: str = "k3") -> torch.Tensor:
    """--kl-penalty loss (GRPO): kl_coef * sum(k * weights) / denom (loss_weights) per token on the current log-probs
    (B, T), differentiable in logprobs, masked before the exponential (a pad token's log-prob may be anything). With
    d = logp - ref_logp: k3 = (r - 1) - log r, r = ref_p / p, is an unbiased estimate of KL(pi || ref) but its
    on-policy gradient is that of KL(ref || pi); k2 = d^2 / 2 is biased, and its on-policy gradient is that of
    KL(pi || ref), the gradient k1 gives in the reward (Liu et al. 2025, DESIGN §5d)."""
    log_ratio = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0)
    if estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    else:
        raise ValueError(f"kl_loss estimator {estimator!r}: k2 or k3 (k1's expected gradient is zero)")
    return kl_coef * (kl * weights).sum() / denom


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
    Calibration on the built-in task: bench/ablation.py replays it on every run (docs/results.md, "Ablation")."""

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
# How the orchestration functions get their settings: the run's resolved `Args`, passed whole and only read, so a new
# PPO flag is a two-place edit (its field in Args, and the line that uses it). What changes while the run goes
# (models, optimizers, the KL coefficient, the reward moments, the sampling generator) and sizes derived from the
# flags (micro_batch_size) are explicit arguments. The math above stays pure: tensors and numbers in, never `args`.


@dataclass
class Models:
    """PPO's four roles: actor (policy, LM head) and the frozen reference, critic (scalar head; None for a critic-free
    estimator) and the frozen reward models (scalar heads: one, the K members of an ensemble, or none with --rm-ckpt
    none). Under LoRA the reference is the actor with its adapters off and the first reward model the critic's base
    with the RM's own head (lora.BaseView)."""

    actor: torch.nn.Module
    ref: torch.nn.Module
    critic: Optional[torch.nn.Module]
    reward_models: list[torch.nn.Module]

    def compiled(self, setting: str, device: torch.device) -> "Models":
        """The training forward of each role: torch.compile'd under --compile (a LoRA view switches its base's
        adapters in eager code around the call: not compiled), else the modules themselves. Rollout's no-grad passes
        run it too, so the sampler's log-probs are checked against the very forward the update differentiates."""
        if not parallel.use_compile(setting, device):
            return self

        def compile_role(model):
            return model if model is None or isinstance(model, BaseView) else parallel.compile_forward(model)

        reward_models = [compile_role(model) for model in self.reward_models]
        return Models(compile_role(self.actor), compile_role(self.ref), compile_role(self.critic), reward_models)


@torch.no_grad()
def score_rollout(models: Models, query, query_mask, samples, micro_batch_size: int, temperature: float, amp) -> dict:
    """Step 3's no-grad passes of the training forward, per micro-batch: old and reference log-probs and the entropy
    (B, T), values (B, T) from the critic, each masked, and every reward model's score read at the last real token
    (the EOS): rm_scores (K, B)."""
    response, mask = samples.response, samples.mask
    prompt_len = query.size(1)
    parts = {"logprobs": [], "ref_logprobs": [], "entropy": [], "values": [], "rm_scores": []}
    eos_position = prompt_len + samples.last[:, None]  # (B, 1)
    for start in range(0, response.size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        micro_batch = (query[rows], query_mask[rows], response[rows], mask[rows])
        with amp:
            logits, _ = response_forward(models.actor, *micro_batch, temperature)
            ref_logits, _ = response_forward(models.ref, *micro_batch, temperature)
            if models.critic is not None:
                parts["values"].append(response_forward(models.critic, *micro_batch, temperature)[1])
            sequence = torch.cat([query[rows], response[rows]], 1)
            sequence_mask = torch.cat([query_mask[rows], mask[rows]], 1)
            member_scores = []  # an RM reads its score at the last real token (the EOS)
            for reward_model in models.reward_models:
                _, token_scores = reward_model(sequence, sequence_mask, logits=False)
                member_scores.append(token_scores.float().gather(1, eos_position[rows]).squeeze(1))
            if member_scores:
                parts["rm_scores"].append(torch.stack(member_scores))  # (K, micro-batch)
        parts["logprobs"].append(logprobs_from_logits(logits, response[rows]))
        parts["ref_logprobs"].append(logprobs_from_logits(ref_logits, response[rows]))
        parts["entropy"].append(entropy_from_logits(logits))
    scored = {key: torch.cat(values, dim=-1 if key == "rm_scores" else 0) for key, values in parts.items() if values}
    for key in ("logprobs", "ref_logprobs", "entropy", "values"):
        if key in scored:
            scored[key] = scored[key] * mask
    return scored


def check_logprobs(generation_logprobs, logprobs, mask, dtype: torch.dtype) -> float:
    """The sampler's own log-probs must match the training forward's, or the first ratio is not 1: the max |diff|
    over ranks (every rank raises together; one rank alone would leave the others waiting in the next collective),
    an error above 1e-4 in fp32, reported in bf16."""
    error = ((generation_logprobs - logprobs).abs() * mask).max()
    if dist.is_initialized():
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    error = error.item()
    if dtype == torch.float32 and error > 1e-4:
        raise RuntimeError(f"generation log-probs differ from the training forward by {error:.2e} > 1e-4 in fp32")
    return error


@torch.no_grad()
def rollout(
    models: Models,
    tok: Tokenizer,
    prompts: list[str],
    args: Args,
    *,
    micro_batch_size: int,
    generator: torch.Generator,
    reward_kl_coef: float,
    reward_moments: "RunningMoments",
    reward_fn: Optional[Callable] = None,
    gold_fn: Optional[Callable] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's prompts (a group's G copies of a prompt consecutive), with models' training forwards.
    reward_kl_coef: beta of the KL in the reward (0 when it goes into the loss). Settings from the resolved args.
    Returns (experience: dict of (B, ...) tensors, metrics: global means keyed by DESIGN §6 tags, samples: this
    rank's texts as dicts)."""
    device = next(models.actor.parameters()).device
    amp = parallel.autocast(device, dtype)
    # 1. generate with the KV cache from the tempered distribution (no top-k/top-p: the ratio must be on-policy);
    # --compile: static caches and the one-token step compiled (CUDA graphs on a GPU), not under --fsdp
    query, query_mask = (t.to(device) for t in encode_prompts(tok, prompts))
    prompt_texts = [prompt_text(tok, prompt) for prompt in prompts]
    compiled = parallel.use_compile(args.compile, device) and not args.fsdp
    with amp, parallel.gathered(models.actor):  # under --fsdp: the actor's parameters gathered once, not per token
        samples = sample(
            models.actor,
            tok,
            query,
            query_mask,
            args.max_new_tokens,
            args.temperature,
            generator=generator,
            compiled=compiled,
        )
    # 2. generation stops each row at its first EOS and pads after it (mask includes the EOS); samples.ended says
    # which rows ended
    mask = samples.mask
    ended = samples.ended
    # 3. no-grad passes of the training forward: old and reference log-probs, values, RM scores
    scored = score_rollout(models, query, query_mask, samples, micro_batch_size, args.temperature, amp)
    logprobs = scored["logprobs"]
    ref_logprobs = scored["ref_logprobs"]
    values = scored.get("values")
    logprob_error = check_logprobs(samples.logprobs, logprobs, mask, dtype)
    # score = each RM's score (its calibration folded into its head), aggregated over an ensemble (--rm-agg), + coef *
    # reward_fn; a response without EOS gets the penalty instead
    member_scores = scored.get("rm_scores")  # (K, B), None without an RM
    rm_scores = torch.zeros(len(prompts), device=device)
    if member_scores is not None:
        rm_scores = aggregate_rm_scores(member_scores, args.rm_agg, args.rm_uwo_coef)
    fn_scores = torch.zeros_like(rm_scores)
    if reward_fn is not None:
        texts = zip(prompt_texts, samples.texts, ended.tolist())  # a conversation: its rendered string
        values_of_fn = [float(reward_fn(p, t, e)) for p, t, e in texts]
        fn_scores = torch.tensor(values_of_fn, device=device)
    scores = rm_scores + args.reward_fn_coef * fn_scores if reward_fn is not None else rm_scores
    scores = torch.where(ended, scores, torch.full_like(scores, args.missing_eos_penalty))
    # 4. rewards: running moments over all history and ranks, normalise, clip (PPO-max §3.2); KL penalty per token
    # unless it goes into the policy loss (--kl-penalty loss, ppo_update)
    reward_moments.update(scores)
    score_norm = normalize_scores(scores, reward_moments.mean, reward_moments.std, args.reward_norm, args.reward_clip)
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
    experience = dict(
        query=query,
        query_mask=query_mask,
        response=samples.response,
        mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        rewards=rewards,
        advantages=advantages,
        scores=scores,
        ended=ended.float(),
        sampler_logprobs=samples.logprobs * mask,
    )
    if values is not None:
        experience["values"] = values
        experience["returns"] = returns
    gold = [gold_fn(p, t, e) for p, t, e in zip(prompt_texts, samples.texts, ended.tolist())] if gold_fn else None
    parts = {}  # the score's two parts, logged apart when there are two; an ensemble's spread
    if reward_fn is not None:
        parts = (
            {"rm_score": rm_scores, "reward_fn": fn_scores} if member_scores is not None else {"reward_fn": fn_scores}
        )
    if member_scores is not None and member_scores.size(0) > 1:
        parts["score_std"] = member_scores.std(0, correction=0)
    metrics = rollout_metrics(experience, scored["entropy"], score_norm, parts, gold, args.mask_truncated)
    metrics["rollout/logprob_err"] = logprob_error
    records = []
    for row, (prompt, text) in enumerate(zip(prompt_texts, samples.texts)):
        record = {"prompt": prompt, "response": text, "ended": bool(ended[row]), "score": scores[row].item()}
        record["gold"] = gold[row] if gold else None
        records.append(record)
    return experience, metrics, records


def rollout_metrics(experience: dict, entropy, score_norm, score_parts: dict, gold, mask_truncated: bool) -> dict:
    """The rollout's DESIGN §6 metrics, global means over every rank's responses and tokens from one all-reduce of
    named sums. score_parts: per-response values (B,) logged as objective/<name>: the RMs' and the reward
    function's own scores when a reward function is given (rm_score, reward_fn), an ensemble's spread (score_std,
    the members' population std); gold: per response (built-in task) or None."""
    mask = experience["mask"]
    logprobs = experience["logprobs"]
    kl_per_sequence = ((logprobs - experience["ref_logprobs"]) * mask).sum(1)  # objective/kl is always the summed k1
    local_sums = {
        "sequences": float(mask.size(0)),
        "score": experience["scores"].sum(),
        "score_norm": score_norm.sum(),
        "kl": kl_per_sequence.sum(),
        "rlhf_reward": experience["rewards"].sum(),
        "entropy": entropy.sum(),
        "tokens": mask.sum(),
        "nll": -logprobs.sum(),
        "ended": experience["ended"].sum(),
        "gold": float(sum(gold)) if gold else 0.0,
    }
    for name, part in score_parts.items():
        local_sums[name] = part.sum()
    if "values" in experience:
        value_error = (experience["returns"] - experience["values"]) * mask
        local_sums["returns"] = experience["returns"].sum()
        local_sums["returns_squared"] = (experience["returns"] ** 2).sum()
        local_sums["value_error"] = value_error.sum()
        local_sums["value_error_squared"] = (value_error**2).sum()
    sums = parallel.all_reduce_dict(local_sums, mask.device)
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
    }
    for name in score_parts:
        metrics[f"objective/{name}"] = sums[name] / sequences
    if "values" in experience:
        returns_variance = sums["returns_squared"] / tokens - (sums["returns"] / tokens) ** 2
        error_variance = sums["value_error_squared"] / tokens - (sums["value_error"] / tokens) ** 2
        metrics["value/explained_variance"] = 1 - error_variance / max(returns_variance, 1e-12)
    if mask_truncated:  # responses without EOS: in the group statistics, not in the policy loss
        metrics["rollout/truncated_frac"] = 1 - sums["ended"] / sequences
    if gold:
        metrics["objective/gold"] = sums["gold"] / sequences
    return metrics


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


def dynamic_sampling(first: dict, draw: Callable, args: Args, prompts_per_rank: int, pad_id: int) -> tuple[dict, dict]:
    """DAPO's dynamic sampling after the iteration's first rollout round: draw() (the next round: experience, metrics,
    samples) until
    every rank has prompts_per_rank informative groups or --max-sample-rounds rounds are spent; returns the
    experience keep_informative_groups builds and rollout/zero_std_frac (of the first round), rollout/sample_rounds."""
    device = first["mask"].device
    rounds = [first]
    group_flags = informative_groups(first["scores"], args.group_size)
    counts = parallel.all_reduce_dict({"groups": len(group_flags), "zero_std": (~group_flags).sum()}, device)
    metrics = {"rollout/zero_std_frac": counts["zero_std"] / counts["groups"]}
    while len(rounds) < args.max_sample_rounds:
        informative = sum(informative_groups(part["scores"], args.group_size).sum() for part in rounds)
        short = parallel.all_reduce_dict({"ranks_short": float(informative < prompts_per_rank)}, device)
        if short["ranks_short"] == 0:
            break
        rounds.append(draw()[0])
    metrics["rollout/sample_rounds"] = len(rounds)
    rows = first["mask"].size(0)
    return keep_informative_groups(rounds, args.group_size, rows, pad_id), metrics


def take_rows(batch: dict, index, width: Optional[int] = None) -> dict:
    """The rows `index` of every tensor of an experience dict; width: response-shaped tensors (B, T) trimmed to their
    first `width` columns (a micro-batch's longest response), the prompts kept whole."""
    taken = {}
    for key, value in batch.items():
        value = value[index]
        if width is not None and value.dim() == 2 and key not in ("query", "query_mask"):
            value = value[:, :width]
        taken[key] = value
    return taken


def global_moments(x: torch.Tensor, mask: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of x over the valid entries of every rank (one all-reduce), as float32 tensors for
    masked_whiten; no valid entry anywhere gives mean 0 and variance 0, not a NaN. The one whitening statistic:
    per minibatch (PPO-max) and once per rollout (TRL, REINFORCE++)."""
    masked = x * mask
    sums = {"count": mask.sum(), "sum": masked.sum(), "sum_squared": (masked**2).sum()}
    totals = parallel.all_reduce_dict(sums, device)
    count = max(totals["count"], 1.0)
    mean = totals["sum"] / count
    variance = totals["sum_squared"] / count - mean**2
    return torch.tensor(mean, dtype=torch.float32, device=device), torch.tensor(
        variance, dtype=torch.float32, device=device
    )


@dataclass(frozen=True)
class LossTerms:
    """What the actor's loss holds besides the clipped policy loss, decided once per update (outside the micro-batch
    loop): beta of the KL in the loss (None: the KL is in the reward) and the entropy bonus weight (0: none)."""

    cliprange: Optional[float]
    cliprange_high: Optional[float]
    dual_clip: Optional[float]
    kl_coef: Optional[float]
    kl_estimator: str  # k3 or k2, when the KL is in the loss
    entropy_coef: float


def actor_loss(logits, logprobs, batch: dict, terms: LossTerms, denom) -> tuple[torch.Tensor, dict]:
    """Every term of the actor's loss on one micro-batch, each aggregated the same way (sum of per-token values times
    batch["weights"], over denom: loss_weights): the clipped policy loss, plus beta * k3 (or k2) against the
    reference (--kl-penalty loss, GRPO), minus entropy_coef * entropy. Returns (loss, stats: the policy loss's stats,
    pg_loss, and kl_loss where present)."""
    mask = batch["loss_mask"]
    weights = batch["weights"]
    pg_weights = weights * batch["tis"] if "tis" in batch else weights  # --tis-cap: the policy loss only
    pg_loss, stats = ppo_policy_loss(
        logprobs,
        batch["logprobs"],
        batch["advantages"],
        mask,
        terms.cliprange,
        weights=pg_weights,
        denom=denom,
        cliprange_high=terms.cliprange_high,
        dual_clip=terms.dual_clip,
    )
    stats["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if terms.kl_coef is not None:  # GRPO: beta * k3 against the reference, aggregated alike
        kl_term = kl_loss(logprobs, batch["ref_logprobs"], mask, weights, denom, terms.kl_coef, terms.kl_estimator)
        stats["kl_loss"] = kl_term.detach()
        loss = loss + kl_term
    if terms.entropy_coef > 0:
        entropy = entropy_from_logits(logits)
        loss = loss - terms.entropy_coef * (entropy * weights).sum() / denom
    return loss, stats


def actor_backward(actor, batch: dict, terms: LossTerms, denom, sync: bool, amp, temperature: float):
    """The actor's loss on one micro-batch and its backward (gradients accumulate; DDP all-reduces where sync).
    Returns (its sums for the metrics, the new log-probs)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    with parallel.grad_sync(actor, sync), amp:
        logits, _ = response_forward(
            actor, batch["query"], batch["query_mask"], batch["response"], batch["mask"], temperature
        )
        logprobs = logprobs_from_logits(logits, batch["response"])
        loss, stats = actor_loss(logits, logprobs, batch, terms, denom)
    # DDP averages gradients over ranks; the losses are global sums, so each backward scales by the world size
    (loss * world_size).backward()
    tokens = batch["loss_mask"].sum()
    sums = {"tokens": tokens, "pg_loss": stats["pg_loss"]}
    for key in ("approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean"):
        sums[key] = _token_sum(stats[key], tokens)
    if "kl_loss" in stats:
        sums["kl_loss"] = stats["kl_loss"]
    return sums, logprobs


def ptx_backward(actor, ptx_batch: tuple, ptx_coef: float, ptx_tokens, amp) -> dict:
    """InstructGPT's PPO-ptx: ptx_coef * the LM loss on one micro-batch of pre-training text (inputs, targets, mask),
    over the step's global ptx token count; never the syncing backward (the policy loss's comes after it)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    inputs, targets, target_mask = ptx_batch
    with parallel.grad_sync(actor, False), amp:
        logits, _ = actor(inputs)
        loss = lm_loss(logits, targets, target_mask, denom=ptx_tokens)
    (ptx_coef * loss * world_size).backward()
    return {"ptx_loss": loss.detach()}


def critic_backward(critic, batch: dict, cliprange_value, denom, sync: bool, amp, temperature: float) -> dict:
    """The clipped value loss on one micro-batch over the step's global token count, and its backward."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    with parallel.grad_sync(critic, sync), amp:
        _, new_values = response_forward(
            critic, batch["query"], batch["query_mask"], batch["response"], batch["mask"], temperature
        )
        vf_loss, vf_stats = ppo_value_loss(
            new_values, batch["values"], batch["returns"], batch["mask"], cliprange_value, denom=denom
        )
    (vf_loss * world_size).backward()
    tokens = batch["mask"].sum()
    return {"vf_loss": vf_loss.detach(), "vf_clipfrac": vf_stats["clipfrac"] * tokens, "tokens": tokens}


def ppo_update(
    actor: Trained,
    critic: Optional[Trained],
    guard: common.StepGuard,
    experience: dict,
    args: Args,
    *,
    micro_batch_size: int,
    train_actor: bool = True,
    generator: Optional[torch.Generator] = None,
    ptx_sampler: Optional[Callable] = None,
    dtype: torch.dtype = torch.float32,
    loss_kl_coef: float = 0.0,
    step: int = 0,
) -> tuple[dict, dict]:
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches, one optimizer step per
    minibatch for the critic and (unless train_actor is False: critic warm-up) the actor, each through its Trained
    entry (the training forward `forward`, compiled and/or DDP; guarded_step over the bare modules). critic is None
    for a critic-free estimator. loss_kl_coef: beta of the KL loss (--kl-penalty loss). A step whose minibatch has no
    token left for the policy loss (--mask-truncated) takes no actor step. ptx_sampler() -> (inputs, targets, mask)
    of one micro-batch of pre-training text (None: no ptx loss). Settings from the resolved args. A model whose global
    grad norm is not finite skips that step (the other still steps); the step counts once in guard.skipped.
    Returns (metrics: global means keyed by DESIGN §6 tags over the steps each model took (policy/* only when the
    actor trained), diagnostics: {"updates": steps every model took, "skipped": steps some model skipped, "first":
    ratio_err, approx_kl and clipfrac of the first micro-batch, which must read 0, 0, 0})."""
    mask = experience["mask"]
    rows_per_rank = mask.size(0)
    device = mask.device
    minibatch_rows = exact_div(rows_per_rank, args.num_minibatches, "rollout rows per rank over --num-minibatches")
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    amp = parallel.autocast(device, dtype)
    actor_forward = actor.model if actor.forward is None else actor.forward
    critic_forward = None
    if critic is not None:
        critic_forward = critic.model if critic.forward is None else critic.forward
    use_ptx = train_actor and args.ptx_coef > 0 and ptx_sampler is not None
    kl_in_loss = loss_kl_coef if args.kl_penalty == "loss" else None
    terms = LossTerms(
        args.cliprange, args.cliprange_high, args.dual_clip, kl_in_loss, args.kl_estimator, args.entropy_coef
    )
    # the policy loss's tokens: --mask-truncated drops the responses without EOS, --dynamic-sampling the groups that
    # only fill the batch; whitening statistics come from these tokens too (with neither flag, every token, bit for
    # bit): a dropped response's advantages never move the update
    loss_mask = mask
    if args.mask_truncated:
        loss_mask = mask * experience["ended"][:, None]
    if args.dynamic_sampling:
        loss_mask = loss_mask * experience["informative"][:, None]
    batch = experience | {"loss_mask": loss_mask}
    tis_metrics = {}
    if args.tis_cap is not None:  # truncated importance sampling: the sampler's and the trainer's numerics differ
        tis, tis_stats = tis_weights(experience["logprobs"], experience["sampler_logprobs"], loss_mask, args.tis_cap)
        batch["tis"] = tis
        tokens = loss_mask.sum()
        sums = parallel.all_reduce_dict(
            {key: value * tokens for key, value in tis_stats.items()} | {"n": tokens}, device
        )
        tis_metrics = {f"policy/{key}": sums[key] / max(sums["n"], 1.0) for key in tis_stats}
    if args.adv_whiten == "rollout":  # once over the whole rollout with global statistics (TRL)
        mean, variance = global_moments(batch["advantages"], loss_mask, device)
        batch["advantages"] = masked_whiten(batch["advantages"], mask, mean=mean, var=variance)
    totals = {"model": {}, "critic": {}}  # this rank's sums over the steps each model took
    steps = {"model": 0, "critic": 0}  # the steps each model took (the same on every rank)
    first = {}
    updates = 0  # optimizer steps every model took
    skipped_before = guard.skipped
    lengths = mask.sum(1).long().tolist()  # one host sync: each micro-batch trims its right padding to its longest row
    for _ in range(args.ppo_epochs):
        permutation = torch.randperm(
            rows_per_rank, generator=generator, device=generator.device if generator else "cpu"
        )
        order = permutation.tolist()
        permutation = permutation.to(device)
        for minibatch in range(args.num_minibatches):
            minibatch_rows_taken = slice(minibatch * minibatch_rows, (minibatch + 1) * minibatch_rows)
            minibatch_batch = take_rows(batch, permutation[minibatch_rows_taken])
            if args.adv_whiten == "minibatch":  # PPO-max: global statistics over the whole minibatch
                mean, variance = global_moments(minibatch_batch["advantages"], minibatch_batch["loss_mask"], device)
                whitened = masked_whiten(
                    minibatch_batch["advantages"], minibatch_batch["mask"], mean=mean, var=variance
                )
                minibatch_batch["advantages"] = whitened
            ptx_batches = [ptx_sampler() for _ in range(grad_accum_steps)] if use_ptx else []
            # the step's global counts (loss denominators): one all-reduce per step
            ptx_tokens = sum((ptx_batch[2].sum() for ptx_batch in ptx_batches), torch.zeros((), device=device))
            minibatch_loss_mask = minibatch_batch["loss_mask"]
            counts = parallel.all_reduce_dict(
                {
                    "tokens": minibatch_batch["mask"].sum(),
                    "ptx_tokens": ptx_tokens,
                    "loss_tokens": minibatch_loss_mask.sum(),
                    "loss_sequences": (minibatch_loss_mask.sum(1) > 0).sum(),
                },
                device,
            )
            token_count = torch.tensor(counts["tokens"], dtype=torch.float32, device=device)
            ptx_token_count = torch.tensor(counts["ptx_tokens"], dtype=torch.float32, device=device)
            loss_token_count = torch.tensor(counts["loss_tokens"], dtype=torch.float32, device=device)
            weights, denom = loss_weights(
                minibatch_loss_mask, args.loss_agg, counts["loss_sequences"], loss_token_count, args.max_new_tokens
            )
            minibatch_batch["weights"] = weights
            # nothing to train the actor on (every response truncated): no actor step, explicitly rather than a NaN
            actor_steps_now = train_actor and counts["loss_tokens"] > 0
            step_sums = {"model": {}, "critic": {}}  # this step's sums per model, kept if that model steps
            for micro in range(grad_accum_steps):
                rows = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
                start = minibatch * minibatch_rows + micro * micro_batch_size
                longest = max(lengths[row] for row in order[start : start + micro_batch_size])  # no host sync
                micro_batch = take_rows(minibatch_batch, rows, longest)
                sync = micro == grad_accum_steps - 1
                if actor_steps_now:
                    if use_ptx:
                        ptx_sums = ptx_backward(actor_forward, ptx_batches[micro], args.ptx_coef, ptx_token_count, amp)
                        _add_all(step_sums["model"], ptx_sums)
                    sums, logprobs = actor_backward(
                        actor_forward, micro_batch, terms, denom, sync, amp, args.temperature
                    )
                    _add_all(step_sums["model"], sums)
                    if not first and sums["tokens"] > 0:  # must be ratio 1, approx_kl 0, clipfrac 0 (DESIGN §5)
                        first = first_micro_batch(logprobs, micro_batch, sums)
                if critic is not None:
                    sums = critic_backward(
                        critic_forward, micro_batch, args.cliprange_value, token_count, sync, amp, args.temperature
                    )
                    _add_all(step_sums["critic"], sums)
            # separate optimizers and clips; each norm is global (after DDP's all-reduce; FSDP2's is a DTensor whose
            # full value is the global norm), so every rank takes the same decision
            stepping = ([actor] if actor_steps_now else []) + ([critic] if critic is not None else [])
            if not stepping:  # critic-free and nothing to train on: neither an update nor a skipped step
                continue
            stepped = common.guarded_step(stepping, guard, step)
            for entry in stepping:
                if entry.name in stepped:
                    _add_all(totals[entry.name], step_sums[entry.name])
                    steps[entry.name] += 1
                else:  # name the bad quantity (the loss sums are this rank's)
                    role = "actor" if entry is actor else "critic"
                    losses = ", ".join(f"{key} {value.item():.3g}" for key, value in step_sums[entry.name].items())
                    print0(f"step {step}: the {role}'s sums when its grad norm was not finite: {losses}")
            updates += len(stepped) == len(stepping)
    metrics = update_metrics(totals, steps, guard, device) | tis_metrics
    return metrics, {"updates": updates, "skipped": guard.skipped - skipped_before, "first": first}


def first_micro_batch(logprobs, batch: dict, sums: dict) -> dict:
    """The first micro-batch of the first update's diagnostics: ratio_err (max |ratio - 1|), approx_kl and clipfrac,
    which must read 0, 0, 0 to float precision (the policy has not moved since it sampled)."""
    mask = batch["loss_mask"]
    ratio_error = ((logprobs - batch["logprobs"]).exp().sub(1).abs() * mask).max()
    tokens = sums["tokens"]
    return {
        "ratio_err": ratio_error.item(),
        "approx_kl": (sums["approx_kl"] / tokens).item(),
        "clipfrac": (sums["clipfrac"] / tokens).item(),
    }


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
        for key in ("approx_kl", "clipfrac", "ratio_mean", "clipfrac_low", "clipfrac_high"):
            metrics[f"policy/{key}"] = summed[f"model/{key}"] / summed["model/tokens"]
        for key, tag in (("kl_loss", "policy/kl_loss"), ("ptx_loss", "ptx/loss")):
            if f"model/{key}" in summed:
                metrics[tag] = summed[f"model/{key}"] / steps["model"]
    return metrics


def _add_all(sums: dict, values: dict) -> None:
    """sums[key] += value for every entry, starting from 0 (running sums that stay on the device: no host sync)."""
    for key, value in values.items():
        sums[key] = sums[key] + value if key in sums else value


def _token_sum(mean: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A per-token mean times its token count, 0 for a micro-batch without tokens (whose mean is 0/0; no host sync)."""
    return torch.where(tokens > 0, mean * tokens, torch.zeros_like(mean))


def iteration_flops(models: Models, sequence_len: int, sequences: int, ppo_epochs: int) -> float:
    """Training-equivalent FLOPs of one PPO iteration for perf/mfu (flops_per_token counts a forward and a backward,
    a forward is a third of it): generation, old and reference log-probs (three actor-sized forwards), the values and
    each RM's score (a forward each), then ppo_epochs forward-backward passes of the actor and the critic over the
    rollout. sequence_len = prompt + response positions; sequences summed over ranks."""
    actor_flops = models.actor.flops_per_token(sequence_len)
    critic_flops = models.critic.flops_per_token(sequence_len) if models.critic is not None else 0
    # an RM's forward reads its scalar head only (logits=False), like the critic's: critic-sized (without a critic,
    # the RM's own count, its LM head included when it has one)
    reward_flops = 0
    for reward_model in models.reward_models:
        reward_flops += critic_flops if models.critic is not None else reward_model.flops_per_token(sequence_len)
    rollout_flops = (3 * actor_flops + critic_flops + reward_flops) / 3
    update_flops = ppo_epochs * (actor_flops + critic_flops)
    return sequences * sequence_len * (rollout_flops + update_flops)


# -----------------------------------------------------------------------------
# main: the set-up in named builders, then the loop


def load_inputs(args: Args) -> tuple[dict, dict, list[dict]]:
    """The SFT checkpoint (the policy's init), the reference's (--ref-ckpt, else the same) and the RM checkpoints
    (none with --rm-ckpt none), checked to share one tokenizer."""
    sft = checkpoints.load_checkpoint(args.sft_ckpt, kind=("sft", "dpo", "ppo"), flag="--sft-ckpt")
    ref = sft
    if args.ref_ckpt is not None:
        ref = checkpoints.load_checkpoint(args.ref_ckpt, kind=("sft", "dpo", "ppo"), flag="--ref-ckpt")
    rms = [checkpoints.load_checkpoint(path, kind="rm", flag="--rm-ckpt") for path in args.rm_ckpt if path != "none"]
    for flag, path, ckpt in [("--ref-ckpt", args.ref_ckpt, ref)] + [
        ("--rm-ckpt", p, c) for p, c in zip(args.rm_ckpt, rms)
    ]:
        if ckpt["tokenizer"] != sft["tokenizer"]:
            raise UserError(
                f"{flag} {path}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s (train it from this SFT "
                "checkpoint)"
            )
    return sft, ref, rms


def build_models(args: Args, sft: dict, ref: dict, rms: list[dict]) -> Models:
    """Every model from the checkpoints already in memory, on the CPU, LoRA and --grad-ckpt applied; the frozen ones
    frozen. PPO-max's critic starts from the first RM (or, with no RM, from the SFT trunk with a fresh head); the
    critic-free estimators build none. With LoRA one base serves two roles: the reference is the actor with its
    adapters off (when it is the actor's init), and the first reward model the critic's base with the RM's own
    (frozen) score head; the other members of an ensemble are full frozen models."""
    actor = hf.model_from_checkpoint(sft)
    parallel.prepare_model(actor, args, "actor")
    lora = args.lora_rank > 0
    reference = BaseView(actor) if lora and ref is sft else hf.model_from_checkpoint(ref)
    critic = None
    if uses_critic(args):
        critic = hf.model_from_checkpoint(rms[0] if rms else sft, lm_head=False, score_head=True)
        parallel.prepare_model(critic, args, "critic")
    reward_models = []
    for k, rm in enumerate(rms):
        if k == 0 and lora and critic is not None:
            reward_models.append(BaseView(critic, score_head=copy.deepcopy(critic.score_head).requires_grad_(False)))
        else:
            reward_models.append(hf.model_from_checkpoint(rm))
    for model in (reference, *reward_models):
        model.requires_grad_(False)
    return Models(actor, reference, critic, reward_models)


def build_optimizers(args: Args, models: Models, max_steps: int, device_type: str) -> tuple[Trained, Optional[Trained]]:
    """The actor's and the critic's (None without one) AdamW, LR schedule and grad-norm clip, as Trained entries (the
    checkpoint keys `model` and `critic`). The actor's schedule starts when it starts moving, after the critic
    warm-up."""
    betas = (0.9, 0.95)
    actor_optimizer = models.actor.configure_optimizers(args.weight_decay, args.lr, betas, device_type)
    actor_schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps, delay=args.critic_warmup_steps)
    actor = Trained("model", models.actor, actor_optimizer, actor_schedule, args.grad_clip)
    if models.critic is None:
        return actor, None
    critic_optimizer = models.critic.configure_optimizers(args.weight_decay, args.critic_lr, betas, device_type)
    critic_schedule = common.LRSchedule(args.critic_lr, args.warmup_steps, max_steps)
    return actor, Trained("critic", models.critic, critic_optimizer, critic_schedule, args.critic_grad_clip)


def load_prompts(args: Args, tok: Tokenizer, block_size: int) -> tuple[list[str], int, list, Optional[Callable]]:
    """(prompts that leave room for --max-new-tokens in the context, how many were too long, the ptx texts encoded,
    the gold reward on the built-in task or None)."""
    builtin = args.prompts is None
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    prompts = [
        row["prompt"] for row in read_jsonl(task["prompts"] if builtin else args.prompts, "prompts", "--prompts")
    ]
    fitting = [prompt for prompt in prompts if len(prompt_ids(tok, prompt)) + args.max_new_tokens <= block_size]
    if not fitting:
        raise UserError(
            f"every prompt is longer than the context minus --max-new-tokens ({block_size} - {args.max_new_tokens} "
            "tokens)"
        )
    ptx_path = args.ptx_data or (task["pretrain"] if builtin else None)
    ptx = []
    if ptx_path:
        ptx, _ = encode_sft(tok, read_jsonl(ptx_path, "text", "--ptx-data"), block_size, mask_prompt=False)
    return fitting, len(prompts) - len(fitting), ptx, gold_reward if builtin else None


@dataclass(frozen=True)
class Sizes:
    """The derived sizes of the run, per rank."""

    rows_per_rank: int  # responses a rank samples per iteration
    prompts_per_rank: int  # rows_per_rank / group_size: a group never straddles two ranks
    micro_batch_size: int  # rows per forward, at most a rank's share of a minibatch
    grad_accum_steps: int  # micro-batches per optimizer step
    ptx_micro_batch_size: int  # pre-training texts per micro-batch (0: no ptx loss)


def batch_sizes(args: Args, has_ptx: bool) -> Sizes:
    """--rollout-batch-size over the launched world size, the group, the minibatches and the micro-batch, each split
    checked with exact_div: a mistake ends here, before any process group."""
    launched = parallel.launched_world_size()
    rows_per_rank = exact_div(args.rollout_batch_size, launched, "--rollout-batch-size over the world size")
    prompts_per_rank = exact_div(rows_per_rank, args.group_size, "--rollout-batch-size/world_size over --group-size")
    minibatch_rows = exact_div(
        rows_per_rank, args.num_minibatches, "--rollout-batch-size/world_size over --num-minibatches"
    )
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)  # never more than a rank's share of a minibatch
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    ptx_micro_batch_size = 0
    if has_ptx:  # checked only when there is a ptx loss to compute
        ptx_micro_batch_size = exact_div(
            args.ptx_batch_size, launched * grad_accum_steps, "--ptx-batch-size over world_size * accum steps"
        )
    return Sizes(rows_per_rank, prompts_per_rank, micro_batch_size, grad_accum_steps, ptx_micro_batch_size)


class PromptStream:
    """This rank's share of the next prompts of the global order (the same on every rank), each repeated group_size
    times in a row (a group's G responses are sampled together)."""

    def __init__(self, prompts: list[str], order: Order, prompts_per_rank: int, group_size: int, d: parallel.Dist):
        self.prompts, self.order, self.per_rank, self.group_size, self.d = (
            prompts,
            order,
            prompts_per_rank,
            group_size,
            d,
        )

    def next(self) -> list[str]:
        global_rows = self.order.take(self.per_rank * self.d.world_size)
        rows = global_rows[self.d.rank * self.per_rank : (self.d.rank + 1) * self.per_rank]
        return [self.prompts[row] for row in rows for _ in range(self.group_size)]


class PtxSampler:
    """This rank's slice of the next global micro-batch of pre-training text: (inputs, targets, target mask) on the
    device, from the global order (saved in the checkpoint)."""

    def __init__(self, texts: list, order: Order, micro_batch_size: int, d: parallel.Dist, pad_id: int):
        self.texts, self.order, self.micro_batch_size, self.d, self.pad_id = texts, order, micro_batch_size, d, pad_id

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, rank = self.micro_batch_size, self.d.rank
        rows = self.order.take(size * self.d.world_size)[rank * size : (rank + 1) * size]
        ids, _ = pad_right([self.texts[row][0] for row in rows], self.pad_id)
        loss_mask, _ = pad_right([self.texts[row][1] for row in rows], 0)
        device = self.d.device
        return ids[:, :-1].to(device), ids[:, 1:].to(device), loss_mask[:, 1:].float().to(device)


def rollout_round(stream: PromptStream, sample_round: Callable, reward_kl_coef: float) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's share of the next prompts (sample_round: rollout with the run's arguments bound)."""
    return sample_round(stream.next(), reward_kl_coef=reward_kl_coef)


def log_samples(logger: common.Logger, samples: list[dict], step: int) -> None:
    """The first samples as a TensorBoard text table and in samples.jsonl."""
    table = []
    for record in samples[:8]:
        line = f"{format_sample(record['prompt'], record['response'], record['ended'])} | score {record['score']:.2f}"
        if record["gold"] is not None:
            line += f" | gold {record['gold']:.2f}"
        table.append(line)
    logger.text("samples", "\n\n".join(table), step)
    logger.samples(step, samples[:16])


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
    # the estimator's defaults, resolved once (printed below; the checkpoint keeps them); --resume: the run's own flags
    args = checkpoints.resume_args(args, "ppo", resolve_args)
    check_args(args)
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)  # refuses to replace a run silently
    common.seed_everything(args.seed)  # before any model is built: a fresh critic head follows --seed
    # 1. checkpoints, tokenizer, models, data (user mistakes surface here, before any process group)
    sft, ref, rms = load_inputs(args)
    tok = Tokenizer.from_state(sft["tokenizer"])
    reward_fn = common.load_reward_fn(args.reward_fn) if args.reward_fn else None
    models = build_models(args, sft, ref, rms)
    prompts, too_long, ptx, gold_fn = load_prompts(args, tok, models.actor.config.block_size)

    # 2. sizes, distributed set-up, optimizers, state
    sizes = batch_sizes(args, has_ptx=bool(ptx) and args.ptx_coef > 0)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    critic_size = f"{models.critic.num_params() / 1e6:.2f} M" if models.critic is not None else "none"
    print0(
        f"ppo: {len(prompts)} prompts ({too_long} too long, skipped) | {len(ptx)} ptx texts | actor "
        f"{models.actor.num_params() / 1e6:.2f} M, critic {critic_size} | rollout {args.rollout_batch_size} = "
        f"{d.world_size} ranks x {args.num_minibatches} minibatches x {sizes.grad_accum_steps} accum x "
        f"{sizes.micro_batch_size} | {max_steps} iterations | rm {args.rm_ckpt} | device {d.device} {dtype}"
    )
    print0(
        f"estimator {args.adv_estimator}: {sizes.prompts_per_rank * d.world_size} prompts x group_size "
        f"{args.group_size} | kl {args.kl_penalty} ({args.kl_estimator}) beta "
        f"{args.kl_coef} | reward_norm {args.reward_norm} clip {args.reward_clip} | adv_whiten {args.adv_whiten} | "
        f"loss_agg {args.loss_agg} | cliprange {args.cliprange}/{args.cliprange_high or args.cliprange} dual_clip "
        f"{args.dual_clip} | mask_truncated {args.mask_truncated} | critic {'yes' if models.critic else 'no'}"
    )
    for model in (models.actor, models.ref, models.critic, *models.reward_models):
        if model is not None:
            model.eval()  # eval mode always: dropout off in all four models
            parallel.place_model(model, args, d, dtype)  # --fsdp shards the frozen models too
    actor, critic = build_optimizers(args, models, max_steps, d.device.type)
    trained = [actor] if critic is None else [actor, critic]
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)  # sampling and shuffling
    kl_controller = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
    reward_moments = RunningMoments()
    detector = CollapseDetector(args.collapse_window, args.collapse_z, args.collapse_lag)
    prompt_stream = PromptStream(prompts, Order(len(prompts), args.seed), sizes.prompts_per_rank, args.group_size, d)
    ptx_sampler = PtxSampler(ptx, Order(max(1, len(ptx)), args.seed + 1), sizes.ptx_micro_batch_size, d, tok.pad_id)
    guard = common.StepGuard()
    run = checkpoints.Run("ppo", args, d, tok, trained, started=t_start)
    step = 0
    updates = 0  # optimizer steps taken
    hashes = {  # what the run started from: --resume refuses a changed input
        "sft_hash": checkpoints.file_sha256(args.sft_ckpt),
        "ref_hash": checkpoints.file_sha256(args.ref_ckpt) if args.ref_ckpt else None,
        "rm_hashes": [checkpoints.file_sha256(path) for path in args.rm_ckpt if path != "none"],
    }
    if args.resume:
        flags = {"sft_hash": "--sft-ckpt", "ref_hash": "--ref-ckpt", "rm_hashes": "--rm-ckpt"}
        ckpt = run.resume({key: (flags[key], digest) for key, digest in hashes.items()}, sampler)
        reward_moments.load_state_dict(ckpt["reward_moments"])
        kl_controller.load_state_dict(ckpt["kl_ctl"])
        data_state = ckpt["data_state"]
        detector.load_state_dict(data_state["collapse"])
        prompt_stream.order = Order(**data_state["prompts"])
        ptx_sampler.order = Order(**data_state["ptx"])
        updates = data_state["updates"]
        guard.skipped = data_state["skipped"]
        step = ckpt["step"]
    # the training forward (compiled on CUDA) also serves the no-grad rollout passes; DDP wraps it for the update
    forward = models.compiled(args.compile, d.device)
    replicated = d.ddp and not args.fsdp  # FSDP2 needs no wrapper
    actor.forward = parallel.replicate(forward.actor, d) if replicated else forward.actor
    if critic is not None:
        critic.forward = parallel.replicate(forward.critic, d) if replicated else forward.critic
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None, console_keys=CONSOLE)
    peak = common.peak_flops(d.device, args.peak_flops)
    sample_round = partial(
        rollout,
        forward,
        tok,
        args=args,
        micro_batch_size=sizes.micro_batch_size,
        generator=sampler,
        reward_moments=reward_moments,
        reward_fn=reward_fn,
        gold_fn=gold_fn,
        dtype=dtype,
    )

    # 3. the loop: rollout (steps 1-5), update (6), then log, samples, collapse check, checkpoint (7)
    first = {}  # the first minibatch of this process's first update
    start_step = step
    samples = []
    while step < max_steps:
        t_rollout = time.time()
        kl_coef = kl_controller.value
        reward_kl_coef = kl_coef if args.kl_penalty == "reward" else 0.0  # in the loss instead: ppo_update
        draw = partial(rollout_round, prompt_stream, sample_round, reward_kl_coef)
        experience, metrics, samples = draw()
        if args.dynamic_sampling:  # DAPO: fresh groups until enough are informative on every rank (the metrics and
            # samples are the first round's: what the policy does)
            experience, sampling_metrics = dynamic_sampling(experience, draw, args, sizes.prompts_per_rank, tok.pad_id)
            metrics |= sampling_metrics
        kl_controller.update(metrics["objective/kl"], args.rollout_batch_size)
        t_update = time.time()
        lr = actor.schedule.at(step)
        common.set_lr(actor.optimizer, lr)
        if critic is not None:
            critic_lr = critic.schedule.at(step)
            common.set_lr(critic.optimizer, critic_lr)
        update_metrics, diagnostics = ppo_update(
            actor,
            critic,
            guard,
            experience,
            args,
            micro_batch_size=sizes.micro_batch_size,
            train_actor=step >= args.critic_warmup_steps,
            generator=sampler,
            ptx_sampler=ptx_sampler if sizes.ptx_micro_batch_size else None,
            dtype=dtype,
            loss_kl_coef=kl_coef,
            step=step,
        )
        first = first or diagnostics["first"]
        step += 1
        updates += diagnostics["updates"]
        t_end = time.time()

        # 7. monitoring; the collapse detector watches the actor's moves only (after the critic warm-up)
        alarm = step > args.critic_warmup_steps and detector.update(
            metrics["objective/kl"], metrics["rollout/response_len"], metrics["rollout/perplexity"]
        )
        sequence_len = experience["query"].size(1) + experience["mask"].size(1)
        sequences = experience["mask"].size(0) * d.world_size
        flops = iteration_flops(models, sequence_len, sequences, args.ppo_epochs)
        metrics |= update_metrics
        if critic is not None:
            metrics["train/critic_lr"] = critic_lr
        metrics |= {
            "train/lr": lr,
            "train/kl_coef": kl_coef,
            "train/updates": updates,
            "train/skipped_steps": guard.skipped,
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
            log_samples(logger, samples, step)
        if alarm and args.stop_on_collapse:
            print0(f"collapse alarm at step {step}: stopping (the last checkpoint saved before it is kept)")
            break
        if (args.save_every and step % args.save_every == 0) or step == max_steps:
            data_state = dict(
                prompts=prompt_stream.order.state_dict(),
                ptx=ptx_sampler.order.state_dict(),
                collapse=detector.state_dict(),
                updates=updates,
                skipped=guard.skipped,
            )
            ppo_state = dict(reward_moments=reward_moments.state_dict(), kl_ctl=kl_controller.state_dict())
            run.save(step, data_state, sampler, **ppo_state, **hashes)

    # 4. a few samples to look at
    for record in samples[:5]:
        text = format_sample(record["prompt"], record["response"], record["ended"])
        print0(f"  {text}  (score {record['score']:.2f})")
    if args.export_hf and d.master:
        checkpoints.export_hf(models.actor, tok, args.export_hf)
    first_line = ", ".join(f"{key} {value:.1e}" for key, value in first.items())
    print0(f"ppo done in {time.time() - t_start:.0f}s: {run.path} | first minibatch of the first update: {first_line}")
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
