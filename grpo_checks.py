"""train_grpo.py's flag checks: the settings no run of the critic-free family can mean, refused in one line naming
the flag before any work (resolve_args' resolved args), REBEL's refusals among them."""

import rollout
from common import UserError

GROUP_ESTIMATORS = ("grpo", "rloo")  # advantages from comparing a prompt's G responses: G >= 2 (step 5: ADVANTAGES)


def check_args(args, advantages: dict) -> None:
    """Settings no run can mean (on train_grpo.py's resolved args; advantages: its ADVANTAGES): a one-line UserError
    naming the flag, before any work."""
    rollout.check_rollout_args(args)
    defaults = type(args)  # the dataclass: each flag's default
    estimator = args.estimator
    if estimator not in advantages:
        raise UserError(
            f"--estimator {estimator}: RECIPES has it, but step 5 has no advantage for it (add its function to "
            "ADVANTAGES in train_grpo.py)"
        )
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
    if args.kl_coef < 0:
        raise UserError(f"--kl-coef {args.kl_coef}: beta is the strength of a penalty, use >= 0")
    if args.ppo_epochs < 1:
        raise UserError(f"--ppo-epochs {args.ppo_epochs}: passes over each rollout, use >= 1")
    if not 0 <= args.gamma <= 1:
        raise UserError(f"--gamma {args.gamma}: a discount lies in [0, 1]")


def check_rebel_args(args) -> None:
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
    }
    for flag, (given, why) in refused.items():
        if given:
            raise UserError(f"{flag} with --estimator rebel: {why}")
