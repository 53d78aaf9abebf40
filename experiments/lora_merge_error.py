"""How much of a LoRA run's update bf16 keeps. A LoRA run under bf16 stores its frozen base in bf16, so the base sits
on bf16's grid: merged into it (a merged export read in bf16; a later stage built on the checkpoint, whose frozen
base is stored in bf16), an update under half the grid's spacing at a weight rounds back to the weight. Unmerged
(the trainer's forward, the bf16 sampler's and eval.py's under bf16), each adapted layer adds the adapter's output to
the base's in fp32 (lora.at_least_fp32), which keeps it.

python experiments/lora_merge_error.py --ckpt out/real_rlvr/chain_sum/grpo/ckpt.pt \
    --prompts out/real_rlvr/data/rg-v1-chain_sum-141e5589b4-seed1337/eval_prompts.jsonl

Prints, over every adapted matrix, the relative error of the update after a merge into the base's dtype
(||merged - W - BA·s|| / ||BA·s||, 0: nothing lost, 1: all of it) and the share of the entries the merge leaves
unchanged. With --prompts, the KL to the policy without the adapters (nats a token over --answer, after each prompt)
of three forwards: fp32 with the adapters unmerged (the policy the adapters hold), bf16 autocast unmerged (the
trainer's, the sampler's, eval.py's), bf16 merged."""

import copy
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoints import load_checkpoint  # noqa: E402
from common import UserError, run_main  # noqa: E402
from data import prompt_ids, read_jsonl  # noqa: E402
from hf import load_init  # noqa: E402
from lora import add_lora, lora_disabled, lora_layers, merge_lora  # noqa: E402
from parallel import store_low_precision  # noqa: E402


@dataclass
class Args:
    ckpt: str
    """a LoRA run's checkpoint (its adapters over a base it names)"""
    dtype: str = "bfloat16"
    """the dtype the merge rounds to"""
    prompts: Optional[str] = None
    """a prompts JSONL: measure the KL of each forward to the policy without the adapters on its first 48 prompts
    (the base in --dtype, the forwards fp32 and bf16 autocast)"""
    answer: str = "<answer>17</answer>"
    """the response the KL is read over, after each prompt"""


def merge_error(model) -> tuple[float, float]:
    """Over a model's adapters: (the update's relative error after lora's own merge, rounded to the base's dtype; the
    share of the base's entries the merge leaves unchanged)."""
    lost, total, unchanged, entries = 0.0, 0.0, 0, 0
    seen = set()  # a tied LM head shares its embedding's weight and adapter: counted once
    for layer in lora_layers(model):
        if layer.weight.data_ptr() in seen:
            continue
        seen.add(layer.weight.data_ptr())
        with torch.no_grad():
            update = (layer.lora_b.float() @ layer.lora_a.float()) * layer.scaling
            kept = layer.merged_weight().to(layer.weight.dtype).float() - layer.weight.float()
        lost += (kept - update).norm().item() ** 2
        total += update.norm().item() ** 2
        unchanged += (kept == 0).sum().item()
        entries += kept.numel()
    return (lost / total) ** 0.5, unchanged / entries


def answer_logprobs(model, ids: list[int], start: int, autocast: bool) -> torch.Tensor:
    """(T, V) log-probs of the next token at each answer position (ids[start:] the answer)."""
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(torch.tensor([ids]))[0][0, start - 1 : -1]
    return F.log_softmax(logits.float(), dim=-1)


def kl(policy: torch.Tensor, base: torch.Tensor) -> float:
    """KL(policy || base) a token, from (T, V) log-probs."""
    return (policy.exp() * (policy - base)).sum(-1).mean().item()


def without_adapters(model, ids: list[int], start: int, autocast: bool) -> torch.Tensor:
    with lora_disabled(model):
        return answer_logprobs(model, ids, start, autocast)


def main(args: Args) -> None:
    ckpt = load_checkpoint(args.ckpt, flag="--ckpt")
    if "model_lora" not in ckpt:
        raise UserError(f"--ckpt {args.ckpt}: not a LoRA checkpoint (no model_lora)")
    record = ckpt["base"]["model"]
    model, tok, _ = load_init(record["spec"], lm_head=record["lm_head"], score_head=record["score_head"])
    add_lora(model, record["lora_rank"], record["lora_alpha"], record["lora_targets"])
    store_low_precision(model, getattr(torch, args.dtype), frozen_only=True)  # the base as a run in that dtype keeps it
    model.load_state_dict(ckpt["model_lora"], strict=False)
    model.eval()
    error, unchanged = merge_error(model)
    print(
        f"{args.ckpt}: after a {args.dtype} merge the update's relative error is {error:.3f} and {unchanged:.1%} of "
        "the adapted entries are unchanged"
    )
    if args.prompts is None:
        return
    exact = copy.deepcopy(model).float()
    merged = store_low_precision(merge_lora(copy.deepcopy(model)), torch.bfloat16)
    kls = {"fp32 unmerged": [], "bf16 unmerged (trainer, sampler, eval.py)": [], "bf16 merged": []}
    for row in read_jsonl(args.prompts, "prompts")[:48]:
        prompt = prompt_ids(tok, row["prompt"])
        ids = prompt + tok.encode(args.answer) + [tok.eos_id]
        start = len(prompt)
        exact_base, base = without_adapters(exact, ids, start, False), without_adapters(model, ids, start, True)
        kls["fp32 unmerged"].append(kl(answer_logprobs(exact, ids, start, False), exact_base))
        kls["bf16 unmerged (trainer, sampler, eval.py)"].append(kl(answer_logprobs(model, ids, start, True), base))
        kls["bf16 merged"].append(kl(answer_logprobs(merged, ids, start, True), base))
    for name, values in kls.items():
        print(f"  KL to the policy without the adapters, {name}: {sum(values) / len(values):.4f} nats a token")


if __name__ == "__main__":
    run_main(main, tyro.cli(Args))
