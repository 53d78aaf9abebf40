"""How much of a LoRA run's update survives a merge into bf16 weights: the bf16 sampler of the RL stages
(rollout.Models.with_sampler) and eval.py under --dtype bfloat16 use the actor with its adapters merged into its base,
and a base stored in bf16 (a LoRA run under bf16 keeps its frozen matrices in that dtype) sits on bf16's grid, so an
update smaller than half the grid's spacing at a weight rounds back to the weight.

python experiments/lora_merge_error.py --ckpt out/real_rlvr/chain_sum/grpo/ckpt.pt

Prints, over every adapted matrix, the relative error of the update after the merge (||merged - W - BA·s|| /
||BA·s||, 0: nothing lost, 1: all of it) and the share of the matrix's entries the merge leaves unchanged."""

import os
import sys
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoints import load_checkpoint  # noqa: E402
from common import run_main  # noqa: E402
from hf import load_init  # noqa: E402


@dataclass
class Args:
    ckpt: str
    """a LoRA run's checkpoint (its adapters over a base it names)"""
    dtype: str = "bfloat16"
    """the dtype the merge rounds to"""


def main(args: Args) -> None:
    ckpt = load_checkpoint(args.ckpt, flag="--ckpt")
    if "model_lora" not in ckpt:
        raise SystemExit(f"error: --ckpt {args.ckpt}: not a LoRA checkpoint (no model_lora)")
    record = ckpt["base"]["model"]
    base = load_init(record["spec"], lm_head=record["lm_head"], score_head=record["score_head"])[0].state_dict()
    scaling = record["lora_alpha"] / record["lora_rank"]
    dtype = getattr(torch, args.dtype)
    lost, total, unchanged, entries = 0.0, 0.0, 0, 0
    for key, lora_a in ckpt["model_lora"].items():
        if not key.endswith(".lora_a"):
            continue
        name = key.removesuffix(".lora_a")
        weight = base[f"{name}.weight"].to(dtype)
        update = (ckpt["model_lora"][f"{name}.lora_b"].float() @ lora_a.float()) * scaling
        update = update if update.shape == weight.shape else update.T  # an embedding's adapter is transposed
        kept = (weight + update.to(dtype)).float() - weight.float()
        lost += (kept - update).norm().item() ** 2
        total += update.norm().item() ** 2
        unchanged += (kept == 0).sum().item()
        entries += kept.numel()
    print(
        f"{args.ckpt}: {entries:,} adapted entries; after a {args.dtype} merge the update's relative error is "
        f"{(lost / total) ** 0.5:.3f} and {unchanged / entries:.1%} of the entries are unchanged"
    )


if __name__ == "__main__":
    run_main(main, tyro.cli(Args))
