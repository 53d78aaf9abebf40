"""RLVR on a real pretrained model (make real-rlvr): SmolLM2-135M-Instruct trained by GRPO on reasoning-gym tasks,
rewarded by their own scorers.

Each task is a reasoning-gym dataset at experiments/rg_screen.py's small configuration (--task rg:NAME, rg.py): the
question as the user turn under reasoning-gym's "direct" system prompt, the answer the last <answer>...</answer>, the
reward reasoning-gym's score of it (--reward-fn rg:score), pass@k counting a score of 1. The instruct model never
writes the tags (rg_screen.py: 0 of 16 parsed), so each task starts with a format SFT: --sft-steps of LoRA SFT on the
task's demonstrations (batch 8), the policy GRPO starts from and its reference. Then GRPO (LoRA rank 16), and
eval.py's pass@1 and pass@k, mean score, parse rate (valid_frac) and KL of the SFT and GRPO policies on held-out
questions (another seed's, none of them trained on), --pass-samples answers each at --temperature, samples of right
and wrong answers shown. The model is make real's (a 4-bit round trip of the released weights, out/smollm2). Writes
<out_dir>/results.json, one row per task and policy. Finished steps are kept.

python experiments/real_rlvr.py                          # make real-rlvr
python experiments/real_rlvr.py --tiny --out-dir /tmp/r  # the chain with tiny sizes (the test)
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real import build_model, run, run_dtype, stage  # noqa: E402
from rg_screen import CANDIDATES  # noqa: E402


@dataclass
class Args:
    out_dir: str = "out/real_rlvr"
    """where the task files, the runs and results.json go"""
    model_dir: str = "out/smollm2"
    """the Hugging Face folder of the model (built from the package's GGUF when missing: make smollm2)"""
    tasks: list[str] = field(default_factory=lambda: ["chain_sum", "letter_counting"])
    """reasoning-gym datasets, at rg_screen.py's configurations (CANDIDATES); these two: their format SFT's pass@1 is
    inside 0.05-0.6 (0.109 and 0.453 on 16 questions, docs/results.md), where RL has room both ways"""
    sft_steps: int = 24
    """the format SFT's steps (batch 8, LoRA rank 16)"""
    episodes: int = 512
    """responses GRPO samples a task"""
    group_size: int = 8
    """GRPO's responses per question"""
    eval_prompts: int = 64
    """held-out questions of the evaluation"""
    max_new_tokens: int = 32
    """longest response, in tokens"""
    temperature: float = 0.7
    """sampling temperature of training and evaluation"""
    pass_samples: int = 8
    """answers per held-out question for pass@k (k = 1 and this)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """the stages' --dtype, as make real's (auto: bf16 on a GPU, fp32 on CPU). Kept in <out_dir>/dtype: a resume in
    another refuses"""
    tiny: bool = False
    """tiny sizes: the chain runs in a minute or two and its numbers mean nothing"""


def task_flags(out: str, name: str) -> list[str]:
    return ["--task", f"rg:{name}", "--task-config", json.dumps(CANDIDATES[name]), "--task-dir", f"{out}/data"]


def train_task(args: Args, out: str, name: str, dtype: str, sizes: dict) -> dict:
    """The format SFT, GRPO and eval.py on one task: eval's rows (sft, grpo) with their seconds."""
    task, model = task_flags(out, name), f"hf:{args.model_dir}"
    sampling = ["--max-new-tokens", str(sizes["tokens"]), "--temperature", str(args.temperature), "--dtype", dtype]
    sft = os.path.join(out, name, "sft", "ckpt.pt")
    if not os.path.exists(sft):
        flags = [*task, "--init", model, "--lora-rank", "16", "--lora-alpha", "32", "--lr", "2e-4"]
        flags += ["--batch-size", "8", "--micro-batch-size", "8", "--max-steps", str(sizes["sft_steps"])]
        flags += ["--warmup-steps", "2", "--eval-every", str(sizes["sft_steps"]), "--num-samples", "8"]
        flags += ["--eval-samples", "8", "--max-new-tokens", str(sizes["tokens"]), "--dtype", dtype]
        flags += ["--out-dir", os.path.dirname(sft), "--overwrite"]
        os.makedirs(os.path.dirname(sft), exist_ok=True)
        run(stage("train_sft.py", *flags), os.path.join(os.path.dirname(sft), "stdout.txt"))
    # GRPO on the scorer's reward, LoRA on the SFT policy (its reference)
    grpo = os.path.join(out, name, "grpo", "ckpt.pt")
    if not os.path.exists(grpo):
        flags = [*task, "--sft-ckpt", sft, "--rm-ckpt", "none", "--reward-fn", "rg:score", *sampling]
        flags += [
            "--estimator",
            "grpo",
            "--group-size",
            str(sizes["group"]),
            "--rollout-batch-size",
            str(sizes["batch"]),
        ]
        flags += ["--total-episodes", str(sizes["episodes"]), "--micro-batch-size", str(sizes["batch"])]
        flags += ["--lora-rank", "16", "--lr", "2e-4", "--kl-coef", "0.04", "--warmup-steps", "1", "--ptx-coef", "0"]
        flags += ["--log-every", "1", "--sample-every", "4", "--out-dir", os.path.dirname(grpo), "--overwrite"]
        os.makedirs(os.path.dirname(grpo), exist_ok=True)
        run(stage("train_grpo.py", *flags), os.path.join(os.path.dirname(grpo), "stdout.txt"))
    # pass@1 and pass@k on held-out questions, before (the SFT policy) and after
    path = os.path.join(out, name, "results.json")
    if not os.path.exists(path):
        k = str(sizes["samples"])
        flags = [*task, "--policy", sft, grpo, "--names", "sft", "grpo", "--ref", sft, "--rm", "none", *sampling]
        flags += ["--num-samples", str(sizes["eval"]), "--pass-at", "1", k, "--pass-samples", k, "--show", "8"]
        flags += ["--json", path]
        run(stage("eval.py", *flags), os.path.join(out, name, "eval.txt"))
    with open(path) as f:
        return json.load(f)


def main(args: Args) -> None:
    started = time.time()
    if not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        build_model(args.model_dir)
    unknown = [name for name in args.tasks if name not in CANDIDATES]
    if unknown:
        sys.exit(f"error: --tasks {unknown[0]}: not one of rg_screen.py's candidates ({', '.join(CANDIDATES)})")
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    dtype = run_dtype(out, args.dtype)
    print(f"real_rlvr: SFT, GRPO and eval in {dtype} on {', '.join(args.tasks)}, into {out}", flush=True)
    sizes = dict(
        sft_steps=args.sft_steps,
        episodes=args.episodes,
        group=args.group_size,
        batch=32,
        eval=args.eval_prompts,
        samples=args.pass_samples,
        tokens=args.max_new_tokens,
    )
    if args.tiny:
        sizes = dict(sft_steps=2, episodes=8, group=2, batch=4, eval=2, samples=2, tokens=8)
    results = {}
    for name in args.tasks:
        results[name] = train_task(args, out, name, dtype, sizes)
        results_path = os.path.join(out, "results.json")
        meta = {"dtype": dtype, "seconds": round(time.time() - started), "configs": {n: CANDIDATES[n] for n in results}}
        with open(results_path, "w") as f:
            json.dump(results | {"_meta": meta}, f, indent=2)
    k = sizes["samples"]
    for name, rows in results.items():
        for policy in ("sft", "grpo"):
            row = rows[policy]
            cells = [f"{stat} {row[stat]:.3f} ± {row[stat + '_se']:.3f}" for stat in ("pass@1", f"pass@{k}", "gold")]
            print(f"{name} {policy}: " + ", ".join(cells) + f", valid_frac {row['valid_frac']:.3f}, kl {row['kl']:.2f}")
    print(f"real_rlvr: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
