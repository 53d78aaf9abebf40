"""The critic-free family: GRPO, Dr. GRPO, RLOO and REINFORCE++, with DAPO's tricks as flags. No critic: each response's
advantage comes from the scores of the others.

Each iteration samples G responses to each prompt from the policy (a group, sampled together on one rank), scores
them (reward model(s) and/or --reward-fn), and gives every token of response i one advantage from comparing its score
with its group's: GRPO (Shao et al. 2024) A_i = (R_i - mean_group R) / (std_group R + 1e-4); Dr. GRPO (Liu et al.
2025) without the division and with the loss summed over a fixed length; RLOO (Ahmadian et al. 2024) A_i = R_i - the
mean of the group's other responses; REINFORCE++ (Hu 2025) the reward-to-go of per-token rewards, whitened over the
rollout (with G > 1 the group mean subtracted first); VinePPO (Kazemnejad et al. 2024) Monte-Carlo values in place
of a critic: a step's (a sentence's) advantage is its rewards + V(after it) - V(before it), V(s) the mean return of
--vine-k continuations sampled from s; REBEL (Gao et al. 2024) no surrogate but a least-squares regression of a
pair's log-ratio gap onto its reward gap. Then clipped policy-gradient steps: DAPO's clip-higher, dynamic sampling
and overlong filtering, dual-clip, three loss aggregations, the KL in the loss (k3 or k2) or in the reward (k1), and
ptx as in PPO-max; --policy-loss swaps PPO's token ratio for GSPO's sequence ratio (Zheng et al. 2025), CISPO's
clipped, detached weight (MiniMax 2025) or DPPO's trust region on the token's probability (Qi et al. 2026). Steps
1-3 (generate, score, log-probs) are rollout.rollout; docs/design.md §5b says more.

Departures from the papers: sizes and beta are tuned for the built-in task (GRPO's G = 64 and beta = 0.04 are a
model-scale recipe); each estimator's defaults are RECIPES below.

python train_grpo.py                                                  # GRPO: groups of 4, k3 KL in the loss
python train_grpo.py --no-grpo-std-norm --loss-agg seq_sum_norm       # Dr. GRPO
python train_grpo.py --estimator rloo                                 # RLOO
python train_grpo.py --estimator reinforce_pp                         # REINFORCE++ (--group-size 4: a group baseline)
python train_grpo.py --loss-agg token_mean --cliprange-high 0.28 --dynamic-sampling --mask-truncated   # DAPO
python train_grpo.py --no-grpo-std-norm --kl-coef 0 --loss-agg token_mean --cliprange None           # nanochat's
python train_grpo.py --estimator vineppo --vine-k 4                   # VinePPO: values from 4 continuations a step
python train_grpo.py --estimator rebel --rebel-eta 1.0                # REBEL: pairs of responses, least squares
python train_grpo.py --policy-loss gspo --cliprange 3e-4 --cliprange-high 4e-4   # GSPO, the paper's eps
python train_grpo.py --policy-loss cispo --cliprange 1 --cliprange-high 0.28 --loss-agg token_mean   # CISPO
python train_grpo.py --policy-loss dppo_tv --cliprange 0.15           # DPPO-Binary-TV, the paper's delta
python train_grpo.py --policy-loss dppo_kl --cliprange 0.05           # DPPO-Binary-KL, the paper's delta
python train_grpo.py --estimator distill --ref-ckpt out/ppo/ckpt.pt --rm-ckpt none   # distillation from a teacher
"""

import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch
import torch.distributed as dist

import checkpoints
import cli
import common
import parallel
import rollout
from common import Trained, UserError, exact_div, format_sample, print0
from data import builtin_task
from model import entropy_from_logits, lm_loss, masked_mean, row_extent

# each estimator's recipe: what a flag left at None becomes. beta in the loss (k3) and in the reward (k1) are not on
# one scale; tuned on the built-in task, reinforce_pp keeps PPO-max's 0.3
RECIPES = {
    "grpo": dict(
        group_size=4, kl_penalty="loss", kl_coef=0.15, reward_norm="none", adv_whiten="none", loss_agg="seq_mean"
    ),
    "rloo": dict(
        group_size=4, kl_penalty="reward", kl_coef=0.3, reward_norm="none", adv_whiten="none", loss_agg="token_mean"
    ),
    "reinforce_pp": dict(
        group_size=1, kl_penalty="reward", kl_coef=0.3, reward_norm="norm", adv_whiten="rollout", loss_agg="token_mean"
    ),
    # vineppo: one response a prompt, Monte-Carlo values for credit; k1 in the reward as PPO-max, no whitening (the
    # values are the baseline)
    "vineppo": dict(
        group_size=1, kl_penalty="reward", kl_coef=0.3, reward_norm="norm", adv_whiten="none", loss_agg="token_mean"
    ),
    # rebel: pairs of responses to one prompt; k1 in the reward, as the paper; --rebel-eta on normalised scores
    "rebel": dict(
        group_size=2, kl_penalty="reward", kl_coef=0.3, reward_norm="norm", adv_whiten="none", loss_agg="pair_mean"
    ),
    # distill: on-policy distillation, the reference is the teacher (--ref-ckpt); each sampled token's advantage is
    # its own -(logp - teacher_logp), the reverse KL's, with no discount (Agarwal et al. 2024; Thinking Machines 2025)
    "distill": dict(
        group_size=1, kl_penalty="reward", kl_coef=1.0, reward_norm="none", adv_whiten="none", loss_agg="token_mean"
    ),
}
# what a flag left at None becomes, for --help: each estimator's value
RECIPE_DEFAULTS = {
    key: "None: the recipe's, " + ", ".join(f"{name} {row[key]}" for name, row in RECIPES.items())
    for key in RECIPES["grpo"]
}
RECIPE_DEFAULTS["kl_estimator"] = "None: k3 with the KL in the loss, k1 in the reward"


@dataclass
class Args(rollout.RolloutArgs):
    out_dir: str = "out/grpo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- the estimator; a flag left at None takes the estimator's recipe, printed at start-up
    estimator: Literal[tuple(RECIPES)] = "grpo"
    """grpo | rloo | reinforce_pp (REINFORCE++) | vineppo (Monte-Carlo values) | rebel (pairwise regression) | distill
    (on-policy distillation toward --ref-ckpt, the teacher, with --rm-ckpt none)"""
    group_size: Optional[int] = None
    """responses sampled per prompt, consecutive rows of one rank; prompts per iteration = rollout_batch_size / G"""
    grpo_std_norm: bool = True
    """grpo only: divide by the group's std (--no-grpo-std-norm: Dr. GRPO, with --loss-agg seq_sum_norm)"""
    gamma: float = 1.0
    """reinforce_pp: the discount of the reward-to-go"""
    vine_k: int = 4
    """vineppo: continuations sampled from each step's start; V(s) is the mean of their returns"""
    vine_chunk: int = 16
    """vineppo on arith and on --prompts: a step is this many tokens (on reviews: a sentence, through its '.')"""
    rebel_eta: float = 1.0
    """rebel: eta of the regression (1/eta)(log-ratio gap) ~ (reward gap), rewards on the normalised scale
    (--reward-norm) minus beta * sum k1: a smaller eta takes smaller steps"""
    # --- scores and KL
    reward_norm: Optional[Literal["none", "scale", "norm"]] = None
    """normalise scores with running moments over all history: scale = s/std, norm = (s-mean)/std"""
    reward_clip: Optional[float] = 5.0
    """clip normalised scores to +-this (None: off); raw scores (--reward-norm none) are never clipped"""
    kl_coef: Optional[float] = None
    """beta of the KL penalty against the reference"""
    kl_penalty: Optional[Literal["loss", "reward"]] = None
    """where the KL goes: beta * k (k3 or k2) per token on the current log-probs in the loss (GRPO), or -beta * k1
    in the rewards (R_i = s_i - beta * sum_t k1)"""
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = None
    """the KL in the loss: k3 = (r - 1) - log r, r = ref_p / p, or k2 = d^2 / 2 with d = logp - ref_logp (None: k3;
    in the reward only k1 = d, the one whose expected gradient there is the KL's: docs/design.md §5d)"""
    # --- the policy loss
    policy_loss: Literal["ppo", "gspo", "cispo", "dppo_tv", "dppo_kl"] = "ppo"
    """ppo: the clipped token ratio | gspo: the clipped sequence ratio (pi/pi_old)^(1/|y|), --loss-agg seq_mean |
    cispo: -sg(clipped ratio) * A * logp, every token's gradient kept; the clip is --cliprange/--cliprange-high |
    dppo_tv, dppo_kl: -sg(min(ratio, 20)) * A * logp on the tokens whose probability moved less than delta in total
    variation or binary KL, delta --cliprange/--cliprange-high (the paper's: 0.15 tv, 0.05 kl)"""
    loss_agg: Optional[Literal["token_mean", "seq_mean", "seq_sum_norm", "pair_mean"]] = None
    """the loss over the step's global batch: mean over tokens, mean over sequences of their token mean, or sum over
    tokens / (max_new_tokens * sequences) (Dr. GRPO); rebel's alone: the mean over pairs"""
    adv_whiten: Optional[Literal["rollout", "none"]] = None
    """whiten advantages over the whole rollout with global statistics (REINFORCE++'s normalisation), or not"""
    cliprange: Optional[float] = 0.2
    """policy ratio clip epsilon (None: no clip, the plain policy gradient -A*ratio)"""
    cliprange_high: Optional[float] = None
    """DAPO clip-higher: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] (None: cliprange)"""
    dual_clip: Optional[float] = None
    """dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the per-token loss is capped at -c*A (None: off)"""
    entropy_coef: float = 0.0
    """the entropy bonus: -coef x the policy's entropy a token in the policy loss, aggregated as it (0: off; PPO-max
    leaves it out: the KL penalty keeps the policy spread, and the paper finds the bonus sensitive)"""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (G > 1): a group whose G scores are all equal carries no signal; sample fresh groups until
    the iteration has rollout_batch_size / G informative ones or --max-sample-rounds are spent (then the first
    round's other groups fill the batch without a policy loss)"""
    max_sample_rounds: int = 3
    """--dynamic-sampling only: the most rollouts per iteration"""
    # --- optimisation
    ppo_epochs: int = 1
    """passes over each rollout"""
    lr: float = 5e-4
    """learning rate (linear warm-up, then cosine to 10%)"""
    warmup_steps: int = 5
    """learning-rate warm-up, in iterations"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices"""
    grad_clip: float = 1.0
    """grad-norm clip (0: off)"""


def resolve_args(args: Args) -> Args:
    """A copy of args where every flag left at None holds its estimator's RECIPES value, and the KL estimator that of
    its placement (k3 in the loss, k1 in the reward): run once at start-up (checkpoints.resume_args, on the saved
    args too), so everything after it, and the checkpoint, see the resolved values."""
    recipe = RECIPES[args.estimator]
    resolved = {key: value if getattr(args, key) is None else getattr(args, key) for key, value in recipe.items()}
    args = replace(args, **resolved)
    if args.kl_estimator is None:
        return replace(args, kl_estimator="k3" if args.kl_penalty == "loss" else "k1")
    return args


GROUP_ESTIMATORS = ("grpo", "rloo")  # advantages from comparing a prompt's G responses: G >= 2


def check_args(args: Args) -> None:
    """Settings no run can mean (on resolve_args' resolved args): a one-line UserError naming the flag, before any
    work."""
    estimator = args.estimator
    rollout.check_rollout_args(args, scored=estimator != "distill")
    defaults = type(args)  # the dataclass: each flag's default
    if estimator == "distill":
        check_distill_args(args)
    if args.kl_penalty == "loss" and args.kl_estimator == "k1":
        raise UserError("--kl-estimator k1 in the loss: its expected gradient is zero; use k2 or k3")
    if args.kl_penalty == "reward" and args.kl_estimator != "k1":
        raise UserError(
            f"--kl-estimator {args.kl_estimator} in the reward: as a detached penalty its gradient works against the "
            "KL (docs/design.md §5d); the reward takes k1, or put k2/k3 in the loss with --kl-penalty loss"
        )
    if args.group_size < 1 or (estimator in GROUP_ESTIMATORS and args.group_size < 2):
        raise UserError(f"--group-size {args.group_size}: {estimator} compares responses within a group, use >= 2")
    if args.dynamic_sampling and args.group_size < 2:
        raise UserError(f"--dynamic-sampling compares a group's scores: use --group-size >= 2, not {args.group_size}")
    if args.max_sample_rounds < 1:
        raise UserError(f"--max-sample-rounds {args.max_sample_rounds}: use >= 1")
    if args.max_sample_rounds != defaults.max_sample_rounds and not args.dynamic_sampling:
        raise UserError(f"--max-sample-rounds {args.max_sample_rounds}: it applies to --dynamic-sampling only")
    if not args.grpo_std_norm and estimator != "grpo":
        raise UserError(f"--no-grpo-std-norm applies to --estimator grpo, not {estimator}")
    if estimator != "vineppo" and (args.vine_k, args.vine_chunk) != (defaults.vine_k, defaults.vine_chunk):
        raise UserError(f"--vine-k and --vine-chunk apply to --estimator vineppo, not {estimator}")
    if estimator == "vineppo" and rollout.env_spec(args) is not None:
        raise UserError(f"--estimator vineppo with --env {rollout.env_spec(args)}: no environment restarts mid-episode")
    if args.vine_k < 1 or args.vine_chunk < 1:
        raise UserError(f"--vine-k {args.vine_k} --vine-chunk {args.vine_chunk}: use >= 1")
    if estimator != "rebel" and args.rebel_eta != defaults.rebel_eta:
        raise UserError(f"--rebel-eta applies to --estimator rebel, not {estimator}")
    if args.rebel_eta <= 0:
        raise UserError(f"--rebel-eta {args.rebel_eta}: the regression divides by it, use > 0")
    if (args.loss_agg == "pair_mean") != (estimator == "rebel"):
        raise UserError(f"--loss-agg {args.loss_agg} with {estimator}: rebel's loss is a mean over pairs (pair_mean)")
    if estimator == "rebel":
        check_rebel_args(args)
    if args.cliprange is not None and args.cliprange <= 0:
        raise UserError(f"--cliprange {args.cliprange}: use > 0 (None: no clip)")
    if args.cliprange_high is not None and (args.cliprange is None or args.cliprange_high <= 0):
        raise UserError(
            f"--cliprange-high {args.cliprange_high}: the upper bound 1 + eps needs eps > 0 and a --cliprange"
        )
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise UserError(f"--dual-clip {args.dual_clip}: the cap -c*A needs c > 1")
    if args.dual_clip is not None and args.policy_loss != "ppo":
        raise UserError(
            f"--dual-clip with --policy-loss {args.policy_loss}: it caps PPO's clipped token loss, ppo only"
        )
    if args.policy_loss.startswith("dppo") and args.cliprange is None:
        raise UserError(f"--cliprange None with --policy-loss {args.policy_loss}: its trust region needs a delta > 0")
    if args.policy_loss == "gspo" and args.loss_agg != "seq_mean":
        raise UserError(
            f"--loss-agg {args.loss_agg} with --policy-loss gspo: its loss is a mean over sequences, use seq_mean"
        )
    if args.kl_coef < 0:
        raise UserError(f"--kl-coef {args.kl_coef}: beta is the strength of a penalty, use >= 0")
    if args.ppo_epochs < 1:
        raise UserError(f"--ppo-epochs {args.ppo_epochs}: passes over each rollout, use >= 1")
    if not 0 <= args.gamma <= 1:
        raise UserError(f"--gamma {args.gamma}: a discount lies in [0, 1]")


def check_distill_args(args: Args) -> None:
    """Distillation's reward is the teacher's log-probs alone: a teacher is given, and no score is mixed in."""
    if args.ref_ckpt is None:
        raise UserError(
            "--estimator distill: give the teacher as --ref-ckpt (a policy sharing the student's tokenizer)"
        )
    if args.rm_ckpt != ["none"] or args.reward_fn is not None:
        raise UserError(
            "--estimator distill: the reward is the teacher's log-probs; use --rm-ckpt none, no --reward-fn"
        )
    if args.kl_penalty != "reward":
        raise UserError("--estimator distill: the reverse KL is the reward (--kl-penalty reward)")
    if args.missing_eos_penalty is not None:
        raise UserError("--estimator distill: no score is read, so --missing-eos-penalty would do nothing")


def distill_advantages(logprobs, teacher_logprobs, mask, kl_coef: float) -> torch.Tensor:
    """(B, T) -> (B, T): each sampled token's -kl_coef * (logp - teacher_logp), 0 on padding; no discount, so a
    token is credited with its own reverse-KL term only."""
    return -kl_coef * kl_estimate(logprobs, teacher_logprobs, mask, "k1")


def check_rebel_args(args: Args) -> None:
    """REBEL regresses whole pairs with the KL in the reward: the flags that clip, reweight or drop tokens, or move
    the KL, are refused, each in one line."""
    defaults = type(args)
    if args.group_size % 2:
        raise UserError(
            f"--group-size {args.group_size}: rebel pairs a group's responses (1st with 2nd, 3rd with 4th, "
            "...), use an even size"
        )
    refused = {
        "--cliprange": (args.cliprange != defaults.cliprange, "its regression has no ratio to clip"),
        "--cliprange-high": (args.cliprange_high is not None, "its regression has no ratio to clip"),
        "--dual-clip": (args.dual_clip is not None, "its regression has no ratio to clip"),
        "--kl-penalty loss": (args.kl_penalty == "loss", "the KL goes in its reward (k1), as the paper has it"),
        "--adv-whiten rollout": (args.adv_whiten == "rollout", "whitening would rescale its regression targets"),
        "--mask-truncated": (args.mask_truncated, "a pair is regressed whole, no response's tokens dropped"),
        "--dynamic-sampling": (args.dynamic_sampling, "a pair is regressed whole, no group kept without a loss"),
        "--tis-cap": (args.tis_cap is not None, "its loss is over sequences, with no token weights"),
        "--entropy-coef": (args.entropy_coef != 0, "its loss is a regression, with no token term beside it"),
        f"--policy-loss {args.policy_loss}": (args.policy_loss != "ppo", "its loss is a regression, with no ratio"),
    }
    for flag, (given, why) in refused.items():
        if given:
            raise UserError(f"{flag} with --estimator rebel: {why}")


# -----------------------------------------------------------------------------
# the estimators' math: pure functions, imported by tests. Tensors are (B, T) over response tokens, mask 1.0 = real
# token (a model token: in a multi-turn episode the environment's tokens between turns are 0, docs/design.md §5b);
# scores (N,) with rows g*G .. g*G+G-1 one prompt's group


class RunningMoments:
    """Running mean and std of every score seen (parallel Welford / Chan et al.), merged across DDP ranks: the moments
    --reward-norm normalises the scores with (REINFORCE++'s recipe, PPO-max §3.2)."""

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
    """scores (B,) normalised with running moments, then clipped to +-clip (None: no clip). mode none | scale = s/std
    | norm = (s - mean)/std. A std under 1e-6 (every score seen so far equal) counts as 1, never s/1e-8."""
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


def kl_estimate(logprobs, ref_logprobs, mask, estimator: str) -> torch.Tensor:
    """Per-token estimates (B, T) of KL(pi || ref), 0 on padding, d = logp - ref_logp: k1 = d; k2 = d^2 / 2;
    k3 = (r - 1) - log r, r = ref_p / p. http://joschu.net/blog/kl-approx.html"""
    log_ratio = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown kl estimator {estimator!r}")
    return kl * mask


def split_turn_rewards(turn_rewards, mask):
    """turn_rewards (B, T), each turn's reward on its last model token (a row sums to the episode's return) -> (the
    last turn's (B,), on the episode's last model token; the earlier turns' (B, T), 0 there and off the mask)."""
    last = (row_extent(mask) - 1).clamp(min=0)[:, None]  # (B, 1) the episode's last model token
    earlier = (turn_rewards * mask).scatter(1, last, 0.0)
    return turn_rewards.gather(1, last).squeeze(1), earlier


def shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, turn_rewards=None) -> torch.Tensor:
    """scores (B,), the rest (B, T) -> rewards (B, T), 0 off the mask: -kl_coef * k1 per token, plus the score on the
    last model token (the EOS), plus turn_rewards (B, T) where given: a multi-turn episode's earlier turns' rewards,
    each on its turn's last model token. A row sums to the episode's return minus kl_coef * its summed k1."""
    rewards = -kl_coef * kl_estimate(logprobs, ref_logprobs, mask, "k1")
    if turn_rewards is not None:
        rewards = rewards + turn_rewards
    last = (row_extent(mask) - 1).clamp(min=0)  # (B,) index of the last model token
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask


def group_advantages(scores, group_size: int, estimator: str, std_norm: bool = True) -> torch.Tensor:
    """scores (N,) = the R_i -> advantages (N,). rloo: R_i - mean over the group's other responses
    (G >= 2); grpo: (R_i - group mean) / (group std + 1e-4), unbiased std, without the division when std_norm is
    False (Dr. GRPO); reinforce_pp: R_i - group mean (REINFORCE++'s group baseline, G > 1)."""
    grouped = scores.view(-1, group_size)  # (N / G, G)
    if estimator == "rloo":
        return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)).flatten()
    if estimator not in ("grpo", "reinforce_pp"):
        raise ValueError(f"no group advantage for estimator {estimator!r}")
    advantages = grouped - grouped.mean(1, keepdim=True)
    if estimator == "grpo" and std_norm:
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    return advantages.flatten()


def reward_to_go(rewards, mask, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns: rewards, mask (B, T) -> (B, T) sum over t' >= t of gamma^(t'-t) * rewards[t'] within each
    right-padded row, 0 off the mask; t' - t counts model tokens: the environment's tokens inside a row (mask 0) pass
    the running sum through unchanged, as compute_gae's in train_ppo.py."""
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.size(1))):
        returns[:, t] = (rewards[:, t] + gamma * running) * mask[:, t]
        running = torch.where(mask[:, t].bool(), returns[:, t], running)
    return returns


def reinforce_pp_advantages(
    scores, logprobs, ref_logprobs, mask, group_size: int, kl_coef: float, gamma: float, turn_rewards=None
):
    """REINFORCE++ before its whitening (Hu 2025): scores (B,), the rest (B, T) -> (B, T) reward-to-go of the per-token
    rewards, 0 on padding. turn_rewards (B, T): a multi-turn episode's earlier turns' rewards (split_turn_rewards), so
    an episode's return is scores + their sum. With group_size > 1 the score first loses its group's mean return
    (REINFORCE++-baseline, as OpenRLHF's reinforce_baseline: the mean is the returns', the KL stays per token)."""
    if group_size > 1 and turn_rewards is None:
        scores = group_advantages(scores, group_size, "reinforce_pp")
    elif group_size > 1:  # the baseline compares whole episodes: their returns' group mean, off the last turn's reward
        returns = scores + (turn_rewards * mask).sum(1)  # (B,)
        scores = scores - returns.view(-1, group_size).mean(1).repeat_interleave(group_size)
    rewards = shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, turn_rewards)
    return reward_to_go(rewards, mask, gamma)


def loss_weights(
    mask, agg: str, n_seq, n_tok, max_new_tokens: int, max_turns: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (B, T) -> (weights (B, T), denom): sum(loss * weights) / denom over all micro-batches and ranks of an
    optimizer step is its aggregated loss (every loss term's). n_seq, n_tok: the step's global counts of kept
    sequences and model tokens. token_mean: mask / n_tok; seq_mean: (mask / len_i) / n_seq, len_i row i's model
    tokens; seq_sum_norm: mask / (max_turns * max_new_tokens * n_seq) (Dr. GRPO's constant, an episode's most)."""
    if agg == "token_mean":
        return mask, n_tok
    if agg == "seq_mean":
        lengths = mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1); an empty row has weight 0 anyway
        return mask / lengths, n_seq
    if agg == "seq_sum_norm":
        return mask, max_turns * max_new_tokens * n_seq
    if agg == "pair_mean":  # rebel: its loss is a sum over pairs (rebel_loss)
        return mask, n_seq / 2
    raise ValueError(f"unknown loss aggregation {agg!r}")


def ratio_bounds(cliprange, cliprange_high=None) -> tuple[float, float]:
    """The interval [1 - cliprange, 1 + (cliprange_high or cliprange)] a ratio is clipped to; cliprange None: (0, inf),
    no clip."""
    if cliprange is None:
        return 0.0, math.inf
    return 1.0 - cliprange, 1.0 + (cliprange if cliprange_high is None else cliprange_high)


def ratio_stats(ratio, log_ratio, mask, clipped_low, clipped_high) -> dict:
    """policy_loss's stats from the token ratios and the clip's flags, all (B, T): clipfrac, clipfrac_low,
    clipfrac_high, approx_kl, ratio_mean, each a mean over the mask."""
    return {
        "clipfrac": masked_mean((clipped_low | clipped_high).float(), mask),
        "clipfrac_low": masked_mean(clipped_low.float(), mask),
        "clipfrac_high": masked_mean(clipped_high.float(), mask),
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
    }


def policy_loss(
    logprobs, old_logprobs, advantages, mask, cliprange, weights, denom, cliprange_high=None, dual_clip=None
):
    """Clipped surrogate l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps_high)) per token, all (B, T), eps_high =
    cliprange_high or cliprange (cliprange None: no clip); dual_clip c: l = min(l, -c*A) where A < 0. Returns
    (sum(l * weights) / denom, stats: clipfrac, clipfrac_low, clipfrac_high, approx_kl, ratio_mean)."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # masked before the exponential
    ratio = torch.exp(log_ratio)
    lower, upper = ratio_bounds(cliprange, cliprange_high)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, lower, upper)
    token_losses = torch.max(pg_losses, pg_losses2)
    if dual_clip is not None:
        capped = torch.min(token_losses, -dual_clip * advantages)
        token_losses = torch.where(advantages < 0, capped, token_losses)
    pg_loss = (token_losses * weights).sum() / denom
    with torch.no_grad():
        clipped = pg_losses2 > pg_losses  # only where the ratio lies outside [lower, upper]
        stats = ratio_stats(ratio, log_ratio, mask, clipped & (ratio < lower), clipped & (ratio > upper))
    return pg_loss, stats


# the recipe (the module docstring) clips at the paper's eps, --cliprange 3e-4 --cliprange-high 4e-4: a sequence ratio,
# the geometric mean of the token ratios, moves far less than any one of them
def gspo_loss(logprobs, old_logprobs, advantages, mask, cliprange, weights, denom, cliprange_high=None):
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071), GSPO-token's form: policy_loss's clipped surrogate
    on s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)), s_i = exp(mean_t (logp - old_logp)) over row i's mask; all (B, T).
    Its value is s_i, so the clip is per sequence; with seq_mean weights the loss is the paper's mean over sequences.
    Returns (loss, policy_loss's stats plus seq_clipfrac: the share of kept sequences clipped)."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # masked before the exponential
    sequence_log_ratio = log_ratio.sum(1) / mask.sum(1).clamp(min=1)  # (B,) log s_i, the mean over real tokens
    # value 0, gradient that of logp: the token's share of the sequence ratio's gradient
    token_log_ratio = torch.where(mask.bool(), logprobs - logprobs.detach(), 0.0)
    ratio = torch.exp(sequence_log_ratio.detach()[:, None] + token_log_ratio)  # (B, T), each row's value s_i
    lower, upper = ratio_bounds(cliprange, cliprange_high)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, lower, upper)
    token_losses = torch.max(pg_losses, pg_losses2)
    pg_loss = (token_losses * weights).sum() / denom
    with torch.no_grad():
        clipped = (pg_losses2 > pg_losses) & mask.bool()
        stats = ratio_stats(torch.exp(log_ratio), log_ratio, mask, clipped & (ratio < lower), clipped & (ratio > upper))
        kept_sequences = (mask.sum(1) > 0).sum().clamp(min=1)
        stats["seq_clipfrac"] = clipped.any(1).sum() / kept_sequences
    return pg_loss, stats


# the recipe: MiniMax set no lower bound on the weight (eps_low large, here --cliprange 1: a weight >= 0) and tuned
# eps_high alone; 0.28 is Trinity-RFT's cispo default and DAPO's clip-higher (SkyRL's cispo example takes 5)
def cispo_loss(logprobs, old_logprobs, advantages, mask, cliprange, weights, denom, cliprange_high=None):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585, eq. 4): l = -sg(clip(rho, 1-eps, 1+eps_high)) * A * logp
    per token, all (B, T): the clip bounds a detached weight and drops no token's gradient. Returns
    (sum(l * weights) / denom, policy_loss's stats; clipfrac: the tokens whose weight was clipped)."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # masked before the exponential
    ratio = torch.exp(log_ratio)
    lower, upper = ratio_bounds(cliprange, cliprange_high)
    is_weight = torch.clamp(ratio, lower, upper).detach()  # a constant for the gradient, clipped or not
    token_losses = -is_weight * advantages * torch.where(mask.bool(), logprobs, 0.0)
    pg_loss = (token_losses * weights).sum() / denom
    with torch.no_grad():
        stats = ratio_stats(ratio, log_ratio, mask, ratio < lower, ratio > upper)
    return pg_loss, stats


# DPPO's cap C on the importance weight min(rho, C), a truncation in place of dual-clip (the paper's §5.4); verl's
# compute_policy_loss_dppo_tv / _kl read it from clip_ratio_c, 20 when unset: here it is fixed, --dual-clip refused
DPPO_WEIGHT_CAP = 20.0


def dppo_kept(logprobs, old_logprobs, advantages, delta_low: float, delta_high: float, divergence: str):
    """DPPO's trust region on the sampled token's probability, all (B, T): True where the token keeps its gradient.
    tv: pi - pi_old <= delta_high where A > 0, >= -delta_low where A <= 0; kl: the binary KL b(pi_old, pi) <=
    delta_high or pi <= pi_old where A > 0, b <= delta_low or pi >= pi_old where A <= 0."""
    probs = torch.exp(logprobs)
    old_probs = torch.exp(old_logprobs)
    if divergence == "tv":
        change = probs - old_probs
        return torch.where(advantages > 0, change <= delta_high, change >= -delta_low)
    if divergence != "kl":
        raise ValueError(f"unknown DPPO divergence {divergence!r}")
    # as verl: 1e-8 on both sides of the second term's ratio, finite when a probability is 1 (the paper's has none)
    rest = torch.log((1 - old_probs + 1e-8) / (1 - probs + 1e-8))
    binary_kl = old_probs * (old_logprobs - logprobs) + (1 - old_probs) * rest
    kept_up = (binary_kl <= delta_high) | (probs <= old_probs)
    kept_down = (binary_kl <= delta_low) | (probs >= old_probs)
    return torch.where(advantages > 0, kept_up, kept_down)


# the recipe (the module docstring) is the paper's, from its authors' verl example: delta 0.15 on the TV, 0.05 on the
# binary KL, low = high (left at its default, --cliprange gives 0.2 / 0.2)
def dppo_loss(
    logprobs, old_logprobs, advantages, mask, cliprange, weights, denom, cliprange_high=None, divergence="tv"
):
    """DPPO (Qi et al. 2026, https://arxiv.org/abs/2602.04879) as verl computes it: l = -A * sg(min(rho, 20)) * logp
    per token dppo_kept keeps (delta_low = cliprange, delta_high = cliprange_high or cliprange), 0 on the others, all
    (B, T). Returns (sum(l * weights) / denom, policy_loss's stats; clipfrac: the tokens out of the region)."""
    real = mask.bool()
    logprobs = torch.where(real, logprobs, 0.0)  # masked before the exponentials
    old_logprobs = torch.where(real, old_logprobs, 0.0)
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # as verl, before its exponential
    ratio = torch.exp(log_ratio)
    delta_high = cliprange if cliprange_high is None else cliprange_high
    kept = dppo_kept(logprobs.detach(), old_logprobs, advantages, cliprange, delta_high, divergence)
    is_weight = torch.clamp(ratio, max=DPPO_WEIGHT_CAP).detach()
    token_losses = -advantages * is_weight * logprobs * kept
    pg_loss = (token_losses * weights).sum() / denom
    with torch.no_grad():
        dropped = real & ~kept
        stats = ratio_stats(ratio, log_ratio, mask, dropped & (advantages <= 0), dropped & (advantages > 0))
    return pg_loss, stats


def kl_loss(logprobs, ref_logprobs, mask, weights, denom, kl_coef: float, estimator: str) -> torch.Tensor:
    """--kl-penalty loss (GRPO): kl_coef * sum(k * weights) / denom, k (k2 or k3) per token on the current
    log-probs (B, T), differentiable in logprobs."""
    if estimator not in ("k2", "k3"):
        raise ValueError(f"kl_loss estimator {estimator!r}: k2 or k3 (k1's expected gradient is zero)")
    return kl_coef * (kl_estimate(logprobs, ref_logprobs, mask, estimator) * weights).sum() / denom


def whiten(advantages, mean, variance) -> torch.Tensor:
    """(A - mean) / sqrt(variance + 1e-8), the moments over every rank's policy-loss tokens (parallel.global_moments):
    REINFORCE++'s normalisation over the rollout."""
    return (advantages - mean) * torch.rsqrt(variance + 1e-8)


def ptx_loss(actor, ptx_batch: tuple, ptx_tokens) -> torch.Tensor:
    """InstructGPT's PPO-ptx term before its coefficient: the LM loss on one micro-batch of pre-training text
    (inputs, targets, target mask), summed over its targets and divided by the step's global ptx token count."""
    inputs, targets, target_mask = ptx_batch
    logits, _ = actor(inputs)
    return lm_loss(logits, targets, target_mask, denom=ptx_tokens)


# VinePPO (Kazemnejad et al. 2024): the value of a state is the mean return of --vine-k continuations sampled from it


def vine_step_end(args: Args, tok) -> Optional[int]:
    """The token that ends a VinePPO step: the built-in task's STEP_END (reviews: '.'), or None on arith and on
    --prompts, whose steps are --vine-chunk tokens."""
    step_end = builtin_task(args).STEP_END if args.prompts is None else None
    return None if step_end is None else tok.encode(step_end)[0]


def vine_steps(response, mask, boundary_id: Optional[int], chunk: int) -> torch.Tensor:
    """response, mask (B, T) -> (B, T) long: the step of each token, from 0 in each row, -1 on padding. A step ends
    with boundary_id (the EOS then a step of its own) or, with boundary_id None, every `chunk` tokens."""
    if boundary_id is None:
        steps = torch.arange(mask.size(1), device=mask.device).expand(mask.size(0), -1) // chunk
    else:
        ends = ((response == boundary_id) & mask.bool()).long()
        steps = ends.cumsum(1) - ends  # a boundary belongs to the step it ends
    return steps.masked_fill(~mask.bool(), -1)


def step_starts(steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """steps (B, T) (vine_steps) -> (rows, step, start), (S,) each: every step of every row, row-major, and the column
    of its first token (the length of the prefix before it: the state a value is estimated at)."""
    before = torch.cat([steps.new_full((steps.size(0), 1), -1), steps[:, :-1]], 1)
    first = (steps != before) & (steps >= 0)
    rows, starts = first.nonzero(as_tuple=True)
    return rows, steps[rows, starts], starts


def continuation_returns(scores, logprobs, ref_logprobs, sampled, kl_coef: float) -> torch.Tensor:
    """(N,) the return of each continuation: its (normalised) score minus kl_coef * k1 summed over the tokens it
    sampled (sampled (N, T); the prefix's rewards are the rollout's own)."""
    return scores - kl_coef * kl_estimate(logprobs, ref_logprobs, sampled, "k1").sum(1)


def continuation_batches(rows: int, max_rows: int, device) -> int:
    """How many rollout calls a rank's `rows` continuations take: the same on every rank (each call has collectives),
    enough that no call holds more than max_rows, and no more than the fewest rows a rank has (no call is empty)."""
    counts = torch.tensor([math.ceil(rows / max_rows), -rows], device=device)
    if dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    most_needed, minus_fewest = counts.tolist()  # one host sync
    return min(most_needed, -minus_fewest)


def vine_advantages(rewards, mask, steps, values) -> torch.Tensor:
    """rewards, mask, steps (B, T) (shape_rewards, vine_steps), values (B, M) V(s) at the start of each row's steps (0
    past its last) -> (B, T): every token of a step takes the step's advantage, the sum of its rewards + V(the next
    step's start) - V(its start), V = 0 after the last step."""
    index = steps.clamp(min=0)
    step_rewards = torch.zeros_like(values).scatter_add(1, index, rewards * mask)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    return (step_rewards + next_values - values).gather(1, index) * mask


# REBEL (Gao et al. 2024): a pair's log-ratio gap regressed onto its reward gap


def pair_gaps(rewards) -> torch.Tensor:
    """rewards (N,), rows (2j, 2j + 1) a pair -> (N,): each row's reward minus its partner's."""
    pairs = rewards.view(-1, 2)
    return torch.stack([pairs[:, 0] - pairs[:, 1], pairs[:, 1] - pairs[:, 0]], 1).flatten()


def rebel_loss(logprobs, old_logprobs, gaps, mask, eta: float, denom):
    """REBEL's loss over pairs (rows 2j, 2j + 1) of one prompt: ((1/eta) * (log-ratio of y - log-ratio of y')
    - gaps)^2 summed over pairs / denom, log-ratios summed over each row's mask (B, T), gaps (B,) from pair_gaps.
    Returns (loss, stats as policy_loss's, nothing clipped)."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)
    sequence_log_ratio = log_ratio.sum(1).view(-1, 2)
    predicted = (sequence_log_ratio[:, 0] - sequence_log_ratio[:, 1]) / eta
    loss = ((predicted - gaps.view(-1, 2)[:, 0]) ** 2).sum() / denom
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        zero = torch.zeros((), device=mask.device)
        stats = {
            "clipfrac": zero,
            "clipfrac_low": zero,
            "clipfrac_high": zero,
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


# -----------------------------------------------------------------------------
# one iteration: rollout (steps 1-5), DAPO's dynamic sampling, update (step 6)


def vineppo_advantages(
    engine: rollout.Engine, args: Args, prompts: list, experience: dict, moments: RunningMoments
) -> tuple:
    """VinePPO: the value of the state before each step of each response (the prompt alone before the first) is the
    mean return of --vine-k continuations the policy samples from it (continuation_returns: scores normalised with
    the run's moments, which they do not update), and each step's tokens take its advantage (vine_advantages)."""
    tok = engine.tok
    t_start = time.time()
    response, mask = experience["response"], experience["mask"]
    steps = vine_steps(response, mask, vine_step_end(args, tok), args.vine_chunk)
    rows, step, starts = step_starts(steps)  # (S,) each: the states
    # each state k times in a row (its k continuations), the response before it as a right-padded prefix
    continued_rows = rows.repeat_interleave(args.vine_k)
    continued_starts = starts.repeat_interleave(args.vine_k)
    width = max(1, int(starts.max()))
    prefix_mask = (torch.arange(width, device=mask.device) < continued_starts[:, None]).to(mask.dtype)
    prefix_ids = response[continued_rows, :width]
    reward_kl_coef = args.kl_coef if args.kl_penalty == "reward" else 0.0
    returns = []
    sampled_tokens = 0
    # decoded in batches of about the rollout's own rows (its KV cache), as many batches on every rank
    batches = continuation_batches(len(continued_rows), len(prompts), mask.device)
    for taken in torch.arange(len(continued_rows), device=mask.device).tensor_split(batches):
        batch_prompts = [prompts[row] for row in continued_rows[taken].tolist()]
        continued, _, _ = rollout.rollout(engine, batch_prompts, (prefix_ids[taken], prefix_mask[taken]))
        columns = torch.arange(continued["mask"].size(1), device=mask.device)
        sampled = continued["mask"] * (columns >= continued_starts[taken, None])  # the tokens this continuation sampled
        scores = continued["scores"]
        if args.reward_norm != "none":
            scores = normalize_scores(scores, moments.mean, moments.std, args.reward_norm, args.reward_clip)
        logprobs, ref_logprobs = continued["logprobs"], continued["ref_logprobs"]
        returns.append(continuation_returns(scores, logprobs, ref_logprobs, sampled, reward_kl_coef))
        sampled_tokens += sampled.sum()
    returns = torch.cat(returns)  # (S * k,)
    values = torch.zeros(mask.size(0), int(steps.max()) + 1, device=mask.device)
    values[rows, step] = returns.view(-1, args.vine_k).mean(1)
    advantages = vine_advantages(experience["rewards"], mask, steps, values)
    sums = {"vine_tokens": sampled_tokens, "vine_responses": float(len(returns)), "vine_s": time.time() - t_start}
    return advantages, sums


@torch.no_grad()
def grpo_rollout(
    engine: rollout.Engine, args: Args, prompts: list, reward_moments: RunningMoments
) -> tuple[dict, dict, list]:
    """Steps 1-5 on this rank's prompts (a group's G copies consecutive): rollout.rollout (1-3), the scores
    normalised (reward_moments updated in place), the KL in the rewards if there, and the estimator's advantages.
    Returns (experience, metrics: global means, records: the responses as dicts)."""
    experience, sums, records = rollout.rollout(engine, prompts)
    mask = experience["mask"]
    # 4. scores (the episodes' returns) normalised with running moments over all history and ranks (REINFORCE++'s
    # recipe), then the rewards: the score on the EOS, -beta * k1 per token when the KL goes into the reward
    # the last turn's reward on the EOS, the earlier turns' (none in an episode of one turn) on their own
    score_norm, turn_rewards = split_turn_rewards(experience["turn_rewards"], mask)
    if args.reward_norm != "none":
        reward_moments.update(experience["scores"])
        mean, std = reward_moments.mean, reward_moments.std
        score_norm = normalize_scores(score_norm, mean, std, args.reward_norm, args.reward_clip)
        # the return's normalisation: every turn over the std, the mean off the last only
        turn_rewards = normalize_scores(turn_rewards, 0.0, std, args.reward_norm, args.reward_clip)
    reward_kl_coef = args.kl_coef if args.kl_penalty == "reward" else 0.0
    rewards = shape_rewards(
        score_norm, experience["logprobs"], experience["ref_logprobs"], mask, reward_kl_coef, turn_rewards
    )
    experience["rewards"] = rewards
    # 5. advantages, by estimator, from R_i = s_i - beta * sum_t k1 (the KL in the reward) or the scores
    sequence_rewards = rewards.sum(1)  # (B,)
    estimator_sums = {}  # an estimator's own metrics: rollout/<name>, perf/<name> for its seconds
    if args.estimator in GROUP_ESTIMATORS:  # grpo, rloo: one advantage a response, on every token
        group = group_advantages(sequence_rewards, args.group_size, args.estimator, args.grpo_std_norm)
        advantages = group[:, None] * mask
    elif args.estimator == "reinforce_pp":  # the reward-to-go; with G > 1 the group mean of the scores as baseline
        logprobs, ref_logprobs = experience["logprobs"], experience["ref_logprobs"]
        advantages = reinforce_pp_advantages(
            score_norm, logprobs, ref_logprobs, mask, args.group_size, reward_kl_coef, args.gamma, turn_rewards
        )
    elif args.estimator == "vineppo":  # Monte-Carlo values from continuations sampled at each step's start
        advantages, estimator_sums = vineppo_advantages(engine, args, prompts, experience, reward_moments)
    elif args.estimator == "rebel":  # the regression's target on every token: the reward gap to the pair's partner
        advantages = pair_gaps(sequence_rewards)[:, None] * mask
    elif args.estimator == "distill":  # the teacher's per-token reverse KL, each token its own
        advantages = distill_advantages(experience["logprobs"], experience["ref_logprobs"], mask, args.kl_coef)
    else:
        raise ValueError(f"--estimator {args.estimator}: a row of RECIPES without a branch in grpo_rollout's step 5")
    experience["advantages"] = advantages
    return_norm = score_norm + turn_rewards.sum(1)  # (B,) normalised returns
    sums |= estimator_sums | {"score_norm": return_norm.sum(), "rlhf_reward": rewards.sum()}
    metrics, totals = rollout.rollout_metrics(sums, mask.device)
    metrics["objective/score_norm"] = totals["score_norm"] / totals["sequences"]
    metrics["objective/rlhf_reward"] = totals["rlhf_reward"] / totals["sequences"]
    for name in estimator_sums:  # vineppo's continuations and their tokens over every rank, its seconds a rank
        if name.endswith("_s"):
            metrics[f"perf/{name}"] = totals[name] / (dist.get_world_size() if dist.is_initialized() else 1)
        else:
            metrics[f"rollout/{name}"] = totals[name]
    if args.mask_truncated:  # responses without EOS: in the group statistics, not in the policy loss
        metrics["rollout/truncated_frac"] = 1 - metrics["rollout/eos_frac"]
    return experience, metrics, records


# DAPO's dynamic sampling (Yu et al. 2025, https://arxiv.org/abs/2503.14476): a group whose G scores are all equal
# carries no advantage to learn from, so sample fresh rounds of groups until there are enough informative ones


def informative_groups(scores, group_size: int) -> torch.Tensor:
    """scores (N,) -> (N / G,) bool: the group's scores are not all equal (DAPO's dynamic sampling keeps these: a group
    of ties has no advantage to learn from)."""
    grouped = scores.view(-1, group_size)  # (N / G, G)
    return (grouped != grouped[:, :1]).any(1)


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


def needs_more_rounds(rounds: list[dict], args, prompts_per_rank: int) -> bool:
    """DAPO's dynamic sampling: another rollout round is due while some rank has fewer than prompts_per_rank
    informative groups over the iteration's rounds and --max-sample-rounds are not spent (one all-reduce)."""
    if len(rounds) >= args.max_sample_rounds:
        return False
    informative = sum(informative_groups(part["scores"], args.group_size).sum() for part in rounds)
    short = parallel.all_reduce_dict({"ranks_short": float(informative < prompts_per_rank)}, rounds[0]["mask"].device)
    return short["ranks_short"] > 0


def zero_std_frac(experience: dict, group_size: int) -> float:
    """The share of groups whose scores are all equal, over every rank (one all-reduce)."""
    group_flags = informative_groups(experience["scores"], group_size)
    counts = {"groups": len(group_flags), "zero_std": (~group_flags).sum()}
    counts = parallel.all_reduce_dict(counts, experience["mask"].device)
    return counts["zero_std"] / counts["groups"]


def actor_backward(actor, batch: dict, args: Args, denom, sync: bool, amp):
    """The policy's loss on one micro-batch, every term over batch["weights"] and denom: the clipped policy loss
    (times the --tis-cap weights), plus beta * k under --kl-penalty loss; and its backward. Returns (sums for the
    metrics, the new log-probs)."""
    mask = batch["loss_mask"]
    weights = batch["weights"]
    pg_weights = weights * batch["tis"] if "tis" in batch else weights  # --tis-cap: the policy loss only
    clip_high, dual_clip = args.cliprange_high, args.dual_clip
    with parallel.grad_sync(actor, sync), amp:
        logits, logprobs = rollout.policy_logprobs(actor, batch, args.temperature)
        advantages = batch["advantages"]
        if args.estimator == "rebel":  # a response's tokens all hold its pair's reward gap (grpo_rollout's step 5)
            loss, stats = rebel_loss(logprobs, batch["logprobs"], advantages[:, 0], mask, args.rebel_eta, denom)
        elif args.policy_loss == "gspo":  # the ratio of the sequence, clipped per sequence
            loss, stats = gspo_loss(
                logprobs, batch["logprobs"], advantages, mask, args.cliprange, pg_weights, denom, clip_high
            )
        elif args.policy_loss == "cispo":  # a clipped, detached weight on every token's log-prob
            loss, stats = cispo_loss(
                logprobs, batch["logprobs"], advantages, mask, args.cliprange, pg_weights, denom, clip_high
            )
        elif args.policy_loss.startswith("dppo"):  # a truncated weight on the log-prob of the tokens in the region
            divergence = args.policy_loss.removeprefix("dppo_")
            loss, stats = dppo_loss(
                logprobs, batch["logprobs"], advantages, mask, args.cliprange, pg_weights, denom, clip_high, divergence
            )
        else:
            loss, stats = policy_loss(
                logprobs, batch["logprobs"], advantages, mask, args.cliprange, pg_weights, denom, clip_high, dual_clip
            )
        sums = {"pg_loss": loss.detach()}
        if args.kl_penalty == "loss":  # GRPO: beta * k3 (or k2) against the reference, aggregated alike
            kl_term = kl_loss(logprobs, batch["ref_logprobs"], mask, weights, denom, args.kl_coef, args.kl_estimator)
            sums["kl_loss"] = kl_term.detach()
            loss = loss + kl_term
        if args.entropy_coef:  # the entropy bonus, aggregated as the policy loss
            entropy = (entropy_from_logits(logits) * weights).sum() / denom
            sums["entropy_bonus"] = entropy.detach()
            loss = loss - args.entropy_coef * entropy
    parallel.backward_global(loss)
    tokens = mask.sum()
    sums["tokens"] = tokens
    for key in ("approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean"):
        sums[key] = torch.where(tokens > 0, stats[key] * tokens, 0.0)  # 0, not 0/0, without tokens
    if "seq_clipfrac" in stats:  # gspo: summed over the kept sequences, as the token stats over tokens
        sequences = (mask.sum(1) > 0).sum()
        sums["sequences"] = sequences
        sums["seq_clipfrac"] = stats["seq_clipfrac"] * sequences
    return sums, logprobs


def ptx_backward(actor, ptx_batch: tuple, args: Args, ptx_tokens, amp) -> dict:
    """--ptx-coef x the ptx loss on one micro-batch of pre-training text, and its backward: never the syncing one (the
    policy loss's comes after it)."""
    with parallel.grad_sync(actor, False), amp:
        loss = ptx_loss(actor, ptx_batch, ptx_tokens)
    parallel.backward_global(args.ptx_coef * loss)
    return {"ptx_loss": loss.detach()}


def grpo_update(
    actor: Trained,
    experience: dict,
    args: Args,
    step: int,
    generator: torch.Generator,
    guard: common.StepGuard,
    ptx_stream,
) -> tuple[dict, dict]:
    """Step 6 on this rank's share of the experience: ppo_epochs x minibatches x micro-batches (shuffled by
    generator), one guarded optimizer step per minibatch (none when no policy-loss token is left), with ptx_stream's
    text under the ptx loss (None: none). Returns (metrics: global means over the steps taken, plus policy/update_kl;
    diagnostics: updates, first_micro_batch: the first micro-batch's ratio_diagnostics, on device)."""
    mask = experience["mask"]
    device = mask.device
    minibatch_rows = exact_div(mask.size(0), args.num_minibatches, "rollout rows per rank over --num-minibatches")
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)  # parallel.rollout_split's rule
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    dtype = parallel.resolve_dtype(args.dtype, device)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    use_ptx = ptx_stream is not None
    # the policy loss's tokens: --mask-truncated drops the responses without EOS, --dynamic-sampling the groups that
    # only fill the batch; whitening statistics come from these tokens too: a dropped response never moves the update
    loss_mask = mask
    if args.mask_truncated:
        loss_mask = mask * rollout.kept_rows(experience)[:, None]
    if args.dynamic_sampling:
        loss_mask = loss_mask * experience["informative"][:, None]
    batch = experience | {"loss_mask": loss_mask}
    metrics = {}
    if args.tis_cap is not None:  # truncated importance sampling: the sampler's and the trainer's numerics differ
        batch["tis"], metrics = rollout.tis_metrics(experience, loss_mask, args.tis_cap, device)
    if args.adv_whiten == "rollout":  # once over the whole rollout with global statistics (REINFORCE++)
        mean, variance = parallel.global_moments(batch["advantages"], loss_mask, device)
        batch["advantages"] = whiten(batch["advantages"], mean, variance)
    totals = defaultdict(float)  # this rank's sums over the steps taken
    first_micro_batch = {}
    updates = 0
    lengths = row_extent(
        experience["attention_mask"]
    ).tolist()  # one host sync: each micro-batch trims its right padding
    for _ in range(args.ppo_epochs):
        if args.estimator == "rebel":  # whole groups permuted: a pair never splits (micro-batches hold whole groups)
            group_size = args.group_size
            groups = torch.randperm(mask.size(0) // group_size, generator=generator, device=generator.device)
            permutation = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()
        else:
            permutation = torch.randperm(mask.size(0), generator=generator, device=generator.device)
        widths = parallel.micro_batch_widths(lengths, permutation.tolist(), micro_batch_size)
        permutation = permutation.to(device)
        # every step's global counts of kept tokens and sequences (loss denominators): one all-reduce an epoch, read
        # on the host (a step with none is not taken)
        minibatch_masks = batch["loss_mask"][permutation].view(args.num_minibatches, minibatch_rows, -1)
        kept_tokens = minibatch_masks.sum((1, 2))
        kept_sequences = (minibatch_masks.sum(2) > 0).sum(1)
        counts_on_device = parallel.all_reduce_stack([kept_tokens, kept_sequences], device)
        counts = counts_on_device.tolist()
        for minibatch in range(args.num_minibatches):
            minibatch_rows_taken = slice(minibatch * minibatch_rows, (minibatch + 1) * minibatch_rows)
            minibatch_batch = parallel.take_rows(batch, permutation[minibatch_rows_taken])
            ptx_batches = [ptx_stream.next() for _ in range(grad_accum_steps)] if use_ptx else []
            loss_tokens, loss_sequences = counts[0][minibatch], counts[1][minibatch]
            if loss_tokens == 0:  # every response dropped: no step, explicitly rather than a NaN
                continue
            if use_ptx:
                ptx_tokens = sum(ptx_batch[2].sum() for ptx_batch in ptx_batches)
                ptx_token_count = parallel.all_reduce_stack([ptx_tokens], device)[0].float()  # left on device
            loss_token_count = counts_on_device[0, minibatch].float()
            weights, denom = loss_weights(
                minibatch_batch["loss_mask"],
                args.loss_agg,
                loss_sequences,
                loss_token_count,
                args.max_new_tokens,
                args.max_turns,
            )
            minibatch_batch["weights"] = weights
            step_sums = defaultdict(float)  # this step's sums, kept if it steps
            for micro in range(grad_accum_steps):
                rows = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
                micro_batch = parallel.take_rows(minibatch_batch, rows, widths[minibatch * grad_accum_steps + micro])
                sync = micro == grad_accum_steps - 1
                if use_ptx:
                    ptx_sums = ptx_backward(actor.forward, ptx_batches[micro], args, ptx_token_count, amp)
                    for key, value in ptx_sums.items():
                        step_sums[key] += value
                sums, logprobs = actor_backward(actor.forward, micro_batch, args, denom, sync, amp)
                for key, value in sums.items():
                    step_sums[key] += value
                if not first_micro_batch:  # must read ratio 1, approx_kl 0, clipfrac 0
                    first_micro_batch = rollout.ratio_diagnostics(
                        logprobs, micro_batch["logprobs"], micro_batch["loss_mask"], sums
                    )
            if common.guarded_step([actor], guard, step):
                for key, value in step_sums.items():
                    totals[key] += value
                updates += 1
            else:  # name the bad quantity (the loss sums are this rank's)
                losses = ", ".join(f"{key} {value.item():.3g}" for key, value in step_sums.items())
                print0(f"step {step}: the actor's sums when its grad norm was not finite: {losses}")
    metrics |= guard.read()
    metrics |= update_metrics(totals, updates, device)
    metrics["policy/update_kl"] = rollout.update_kl(actor.forward, experience, micro_batch_size, args.temperature, amp)
    return metrics, {"updates": updates, "first_micro_batch": first_micro_batch}


def update_metrics(totals: dict, updates: int, device) -> dict:
    """Global means over the steps taken from this rank's sums (one all-reduce; the steps are decided the same on
    every rank). A loss sum is the step's global loss (its denominators are global), a per-token stat sum is over
    tokens."""
    metrics = {}
    if not updates:  # every step skipped: the same on every rank, so no rank waits in a lone collective
        return metrics
    summed = parallel.all_reduce_dict({key: totals[key] for key in sorted(totals)}, device)
    metrics["policy/loss"] = summed["pg_loss"] / updates
    for key in ("approx_kl", "clipfrac", "ratio_mean", "clipfrac_low", "clipfrac_high"):
        metrics[f"policy/{key}"] = summed[key] / summed["tokens"]
    if "seq_clipfrac" in summed:  # gspo: the share of sequences whose clip was active
        metrics["policy/seq_clipfrac"] = summed["seq_clipfrac"] / summed["sequences"]
    if "kl_loss" in summed:
        metrics["policy/kl_loss"] = summed["kl_loss"] / updates
    if "ptx_loss" in summed:
        metrics["ptx/loss"] = summed["ptx_loss"] / updates
    if "entropy_bonus" in summed:  # the entropy the bonus rewards, before its coefficient
        metrics["policy/entropy_bonus"] = summed["entropy_bonus"] / updates
    return metrics


# -----------------------------------------------------------------------------
# main

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
    "perf/rollout_s",
    "perf/update_s",
)


def main(args: Args) -> None:
    t_start = time.time()
    # the estimator's recipe, resolved once (printed below; the checkpoint keeps it); --resume: the run's own flags
    args = checkpoints.task_from_checkpoint(args, args.sft_ckpt, "--sft-ckpt")  # --task: the SFT's unless given
    args = checkpoints.resume_args(args, "grpo", resolve_args)
    check_args(args)
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)  # refuses to replace a run silently
    common.seed_everything(args.seed)

    # checkpoints, tokenizer, data, models (user mistakes surface here, before any process group)
    sft, ref, rms, tok, data = rollout.load_inputs(args)
    models = rollout.build_models(args, sft, ref, rms)  # no critic

    # sizes, distributed set-up, placement, optimizer, the loop's state
    sizes = parallel.rollout_split(args, args.group_size, has_ptx=bool(data.ptx) and args.ptx_coef > 0)
    if args.estimator == "rebel" and sizes.micro_batch_size % args.group_size:
        raise UserError(
            f"--micro-batch-size {sizes.micro_batch_size} (a rank's): rebel keeps a group's pairs in one micro-batch, "
            f"use a multiple of --group-size {args.group_size}"
        )
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.total_episodes // args.rollout_batch_size)
    prompts_per_iteration = args.rollout_batch_size // args.group_size
    common.size_warnings(
        prompts_per_iteration,
        "--rollout-batch-size / --group-size",
        len(data.prompts),
        None,
        args.warmup_steps,
        max_steps,
    )
    print0(
        f"grpo: {len(data.prompts)} prompts ({data.skipped()}) | policy "
        f"{models.actor.num_params() / 1e6:.2f} M | rollout {args.rollout_batch_size} = {d.world_size} ranks x "
        f"{args.num_minibatches} minibatches x {sizes.grad_accum_steps} accum x {sizes.micro_batch_size} | "
        f"{max_steps} iterations | rm {args.rm_ckpt} | device {d.device} {dtype}"
    )
    print0(
        f"estimator {args.estimator}: {sizes.prompts_per_rank * d.world_size} prompts x group_size {args.group_size} "
        f"| kl {args.kl_penalty} ({args.kl_estimator}) beta {args.kl_coef} | reward_norm {args.reward_norm} | "
        f"adv_whiten {args.adv_whiten} | {args.policy_loss} loss, loss_agg {args.loss_agg} | "
        f"cliprange {args.cliprange}/{args.cliprange_high or args.cliprange} dual_clip {args.dual_clip} | "
        f"mask_truncated {args.mask_truncated}"
    )
    if args.estimator == "vineppo":
        step = "a sentence" if vine_step_end(args, tok) is not None else f"--vine-chunk {args.vine_chunk} tokens"
        print0(f"vineppo: values from {args.vine_k} continuations at each step's start; a step: {step}")
    if args.estimator == "rebel":
        print0(f"rebel: eta {args.rebel_eta}, no clip (the cliprange above is unused), pairs of consecutive responses")
    if args.policy_loss.startswith("dppo"):
        region = "the cliprange above is the trust region's delta"
        print0(f"{args.policy_loss}: {region}, the weight min(ratio, {DPPO_WEIGHT_CAP:g}), no dual-clip")
    if args.estimator == "distill":
        print0(f"distill: teacher {args.ref_ckpt}; a token's advantage is -{args.kl_coef:g} * (logp - teacher_logp)")
    print0(rollout.rules(args, data))
    models = rollout.place(models, args, d, dtype)  # under bf16, a bf16 sampler copy of the actor
    optimizer = models.actor.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps)
    actor = Trained("model", models.actor, optimizer, schedule, args.grad_clip)
    loop = rollout.build_loop(args, data, sizes, args.group_size, d, tok.pad_id)  # its generator: sampling, shuffling
    reward_moments = RunningMoments()
    run = checkpoints.Run("grpo", args, d, tok, [actor], started=t_start)
    if args.resume:
        ckpt = loop.resume(run)
        reward_moments.load_state_dict(ckpt["reward_moments"])
        models.refresh_sampler()  # the resumed actor into its bf16 copy, before it samples
    # actor.model holds the parameters and the checkpoint; actor.forward is what the losses call (compiled on CUDA,
    # DDP-wrapped under torchrun); the rollout runs the roles compiled
    compiled = rollout.training_forwards(models, [actor], args.compile, d)
    engine = rollout.Engine(
        compiled, tok, args, sizes.micro_batch_size, loop.generator, dtype, data.reward_fn, data.gold_fn, data.make_env
    )
    logger = common.Logger(args.out_dir, d.master, resume_step=loop.step if args.resume else None, console_keys=CONSOLE)
    peak = common.peak_flops(d.device, args.peak_flops, dtype)

    # the loop: steps 1-5 (grpo_rollout, dynamic sampling), 6 (grpo_update), 7 (log, samples, checkpoint)
    start_step = loop.step
    records = []
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the iteration, exit 128 + signal
    # the budget is --total-episodes responses sampled: dynamic sampling's extra rounds count against it, so such a
    # run ends in fewer iterations than the LR schedule spans (--max-steps, when given, counts iterations alone)
    last = loop.step >= max_steps or (args.max_steps is None and loop.episodes >= args.total_episodes)
    while not last:
        t_rollout = time.time()
        experience, metrics, records = grpo_rollout(engine, args, loop.prompt_stream.next(), reward_moments)
        rounds = [experience]
        if args.dynamic_sampling:  # DAPO: fresh groups until enough are informative on every rank (the metrics and
            # records are the first round's: what the policy does)
            metrics["rollout/zero_std_frac"] = zero_std_frac(experience, args.group_size)
            while needs_more_rounds(rounds, args, sizes.prompts_per_rank):
                rounds.append(grpo_rollout(engine, args, loop.prompt_stream.next(), reward_moments)[0])
            metrics["rollout/sample_rounds"] = len(rounds)
            experience = keep_informative_groups(rounds, args.group_size, experience["mask"].size(0), tok.pad_id)
        t_update = time.time()
        lr = common.step_lr(actor, loop.step)
        updated, diagnostics = grpo_update(
            actor, experience, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
        )
        if not loop.first_micro_batch:  # this process's first update whose first micro-batch has tokens (a host read)
            loop.first_micro_batch = rollout.read_diagnostics(diagnostics["first_micro_batch"])
        models.refresh_sampler()  # the updated actor into its bf16 copy, in place
        loop.step += 1
        loop.updates += diagnostics["updates"]
        loop.episodes += args.rollout_batch_size * len(rounds)
        stopping = stop.requested(d.device)
        last = loop.step >= max_steps or (args.max_steps is None and loop.episodes >= args.total_episodes)
        t_end = time.time()

        # 7. monitoring
        step = loop.step
        times = (t_rollout, t_update, t_end)
        metrics |= common.perf_metrics(models, experience, args.ppo_epochs, times, peak, d.world_size)
        metrics |= updated | {
            "train/lr": lr,
            "train/kl_coef": args.kl_coef,
            "train/updates": loop.updates,
            "train/episodes": loop.episodes,
        }
        if step == start_step + 1:  # the first iteration of this process: how close sampler and trainer agree
            largest, mean = metrics["rollout/logprob_err"], metrics["rollout/logprob_err_mean"]
            print0(f"step {step}: generation vs training-forward log-probs, |diff| max {largest:.1e} mean {mean:.1e}")
        # --*-every N: every N iterations and the last (0: the last only)
        logger.log(step, metrics, max_steps, console=(args.log_every > 0 and step % args.log_every == 0) or last)
        if (args.sample_every > 0 and step % args.sample_every == 0) or last:
            logger.sample_table(step, records)
        if (args.save_every > 0 and step % args.save_every == 0) or last or stopping:
            run.save(step, loop.data_state(), loop.generator, reward_moments=reward_moments.state_dict(), **loop.hashes)
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
    print0(f"grpo done in {time.time() - t_start:.0f}s: {run.path} | first minibatch of the first update: {first_line}")
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args, RECIPE_DEFAULTS))
