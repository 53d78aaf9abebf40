"""bf16 weights for what does not train (docs/design.md §7): how far the bf16 sampler copy of the actor and the bf16
frozen reference and reward model move the numbers the update sees, against today's fp32 weights under bf16 autocast.

From an SFT and an RM checkpoint (make demo's by default), one rollout batch of held-out prompts, bf16 autocast:
- log-probs: the sampler's own (the decode) against the fp32 actor's training forward under autocast, for the
  sampler being the fp32 actor itself (before) and its bf16 copy (after): max and mean |diff| over response tokens;
- KL at step 0 (the reference is the actor's init): the mean summed k1 per response of the fp32 actor under autocast
  against an fp32 reference under autocast (before: the same arithmetic, 0) and a bf16-stored one (after);
- RM scores: fp32 under autocast (before) and bf16-stored (after), each against the fp32 RM without autocast.

python bench/low_precision.py --sft-ckpt out/sft/ckpt.pt --rm-ckpt out/rm/ckpt.pt --task-dir out/data
Last line: `low_precision: logprob_err_before=<max> logprob_err_after=<max> kl_before=<x> kl_after=<y>
rm_err_before=<max> rm_err_after=<max>`.
"""

import copy
import os
import sys
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf  # noqa: E402
import parallel  # noqa: E402
import rollout  # noqa: E402
from data import read_jsonl  # noqa: E402
from model import last_token_scores, logprobs_from_logits, response_forward  # noqa: E402
from rollout import Models  # noqa: E402
from task import build_task  # noqa: E402


@dataclass
class Args:
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the actor's init and the reference"""
    rm_ckpt: str = "out/rm/ckpt.pt"
    """the reward model"""
    task_dir: str = "out/data"
    """the built-in task's cache (its held-out prompts)"""
    prompts: int = 64
    """responses in the batch"""
    device: str = "cpu"
    """cpu | cuda"""
    seed: int = 0
    """sampling seed"""


@torch.no_grad()
def main(args: Args) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    actor, tok, _ = hf.load_init(args.sft_ckpt, kind=("sft", "dpo", "ppo", "grpo"))
    actor = actor.to(device).eval()
    rm, _, _ = hf.load_init(args.rm_ckpt, lm_head=False, score_head=True, kind="rm")
    rm = rm.to(device).eval()
    prompts = [row["prompt"] for row in read_jsonl(build_task(args.task_dir, 1337)["eval_prompts"], "prompts")]
    settings = rollout.RolloutArgs(compile="off", temperature=1.0)
    models = Models(actor, actor, [])
    bf16 = models.with_sampler(dtype, fsdp=False)
    response_mask = None
    errors, kls, rm_errors = {}, {}, {}
    for name, roles in (("before", models), ("after", bf16)):
        generator = torch.Generator(device=device).manual_seed(args.seed)
        engine = rollout.Engine(roles, tok, settings, args.prompts, generator, dtype)
        responses = rollout.generate_episodes(engine, prompts[: args.prompts])
        samples = responses.samples
        inputs = (responses.query, responses.query_mask, samples.response, samples.mask)
        with amp:
            logits, _ = response_forward(actor, *inputs, 1.0)
        trainer = logprobs_from_logits(logits, samples.response)
        diff = (samples.logprobs - trainer).abs() * samples.mask
        errors[name] = (diff.max().item(), (diff.sum() / samples.mask.sum()).item())
        if response_mask is None:
            kept = responses  # KL and RM scores on the same responses for both
            response_mask = samples.mask
    query, query_mask, response = kept.query, kept.query_mask, kept.samples.response
    ref_bf16 = parallel.store_low_precision(copy.deepcopy(actor), dtype)
    rm_bf16 = parallel.store_low_precision(copy.deepcopy(rm), dtype)
    with amp:  # the update's log-probs: the fp32 actor under autocast
        logits, _ = response_forward(actor, query, query_mask, response, response_mask, 1.0)
    policy = logprobs_from_logits(logits, response)
    sequence, sequence_mask = torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1)
    exact_scores = last_token_scores(rm(sequence, sequence_mask, logits=False)[1], sequence_mask)
    for name, ref, reward in (("before", actor, rm), ("after", ref_bf16, rm_bf16)):
        with amp:
            ref_logits, _ = response_forward(ref, query, query_mask, response, response_mask, 1.0)
            token_scores = reward(sequence, sequence_mask, logits=False)[1]
        ref_logprobs = logprobs_from_logits(ref_logits, response)
        kls[name] = ((policy - ref_logprobs) * response_mask).sum(1).mean().item()
        rm_errors[name] = (last_token_scores(token_scores.float(), sequence_mask) - exact_scores).abs().max().item()
    print(f"[setup] {args.prompts} responses, {int(response_mask.sum())} tokens, device {device}, bf16 autocast")
    for name in ("before", "after"):
        print(
            f"[{name}] sampler log-probs vs the training forward: max {errors[name][0]:.2e} mean {errors[name][1]:.2e}"
            f" | step-0 KL per response {kls[name]:+.2e} | RM score error max {rm_errors[name]:.2e}"
        )
    print(
        f"low_precision: logprob_err_before={errors['before'][0]:.3e} logprob_err_after={errors['after'][0]:.3e} "
        f"kl_before={kls['before']:.3e} kl_after={kls['after']:.3e} rm_err_before={rm_errors['before']:.3e} "
        f"rm_err_after={rm_errors['after']:.3e}"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
