"""RLVR on a real pretrained model (make real-rlvr): SmolLM2-135M-Instruct learns the arith task's additions from a
verifier.

The arith task's problems (task arith: 1- and 2-digit operands, its held-out operand pairs for the evaluation) asked
as chat questions, "What is 48 + 7? Answer with the number only.". The verifier reads the response's last integer:
reward 1 when it is the sum and the response ended (its <|im_end|> within --max-new-tokens), else 0. GRPO (LoRA
rank 16) on that reward, then eval.py's pass@1 and pass@8 of the instruct model and the trained policy on held-out
problems, --pass-samples answers each at --temperature. The model is make real's (a 4-bit round trip of the
released weights, out/smollm2). Writes <out_dir>/results.json, one row per policy. Finished steps are kept.

python experiments/real_rlvr.py                          # make real-rlvr
python experiments/real_rlvr.py --tiny --out-dir /tmp/r  # the chain with tiny sizes (the test)
"""

import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real import ROOT, build_model, run, run_dtype, stage, write_rows  # noqa: E402

sys.path.insert(0, ROOT)
import arith  # noqa: E402

REWARD = f"{os.path.abspath(__file__)}:reward"
QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")
INTEGER_RE = re.compile(r"-?\d+")


@dataclass
class Args:
    out_dir: str = "out/real_rlvr"
    """where the prompts, the run and results.json go"""
    model_dir: str = "out/smollm2"
    """the Hugging Face folder of the model (built from the package's GGUF when missing: make smollm2)"""
    train_prompts: int = 512
    """training problems"""
    eval_prompts: int = 64
    """held-out problems of the evaluation"""
    episodes: int = 512
    """responses GRPO samples"""
    group_size: int = 4
    """GRPO's responses per problem"""
    max_new_tokens: int = 24
    """longest response, in tokens"""
    temperature: float = 0.7
    """sampling temperature of training and evaluation"""
    pass_samples: int = 8
    """answers per held-out problem for pass@k (k = 1 and this)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """GRPO's and eval's --dtype, as make real's (auto: bf16 on a GPU, fp32 on CPU). Kept in <out_dir>/dtype: a
    resume in another refuses"""
    tiny: bool = False
    """tiny sizes: the chain runs in a minute and its numbers mean nothing"""


def question(problem: str) -> list[dict]:
    a, b = arith.operands(problem)
    return [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]


def reward(prompt: str, response: str, ended: bool) -> float:
    """1.0 when the response ended and its last integer is the sum the (rendered) prompt asks for, else 0.0."""
    asked = QUESTION_RE.findall(prompt)
    numbers = INTEGER_RE.findall(response.replace(",", ""))
    if not ended or not asked or not numbers:
        return 0.0
    a, b = asked[-1]
    return 1.0 if int(numbers[-1]) == int(a) + int(b) else 0.0


def write_problems(path: str, count: int, held_out: bool, seed: int) -> None:
    rng = random.Random(seed)
    problems = [arith.sample_prompt(rng, 1337, held_out) for _ in range(count)]
    write_rows(path, [{"prompt": question(problem)} for problem in problems])


def main(args: Args) -> None:
    started = time.time()
    model = args.model_dir
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        build_model(model)
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    dtype = run_dtype(out, args.dtype)
    print(f"real_rlvr: GRPO and eval in {dtype}, into {out}", flush=True)
    sizes = dict(train=16, eval=4, episodes=16, samples=2, tokens=8) if args.tiny else None
    train_path, eval_path = os.path.join(out, "prompts.jsonl"), os.path.join(out, "eval_prompts.jsonl")
    write_problems(train_path, sizes["train"] if sizes else args.train_prompts, held_out=False, seed=1)
    eval_count = sizes["eval"] if sizes else args.eval_prompts
    write_problems(eval_path, eval_count, held_out=True, seed=2)
    new_tokens = str(sizes["tokens"] if sizes else args.max_new_tokens)
    sampling = ["--max-new-tokens", new_tokens, "--temperature", str(args.temperature), "--dtype", dtype]
    # GRPO on the verifier's reward, LoRA on the instruct model (the reference is its base)
    ckpt = os.path.join(out, "grpo", "ckpt.pt")
    if not os.path.exists(ckpt):
        flags = ["--sft-ckpt", f"hf:{model}", "--rm-ckpt", "none", "--reward-fn", REWARD, "--prompts", train_path]
        flags += ["--estimator", "grpo", "--group-size", str(args.group_size), "--rollout-batch-size", "32"]
        flags += ["--total-episodes", str(sizes["episodes"] if sizes else args.episodes), *sampling]
        flags += ["--lora-rank", "16", "--lr", "2e-4", "--kl-coef", "0.04", "--micro-batch-size", "16"]
        flags += ["--warmup-steps", "1", "--ptx-coef", "0", "--log-every", "1", "--sample-every", "4"]
        flags += ["--out-dir", os.path.dirname(ckpt), "--overwrite"]
        flags += ["--rollout-batch-size", "8", "--group-size", "2"] if sizes else []
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        run(stage("train_grpo.py", *flags), os.path.join(os.path.dirname(ckpt), "stdout.txt"))
    # pass@1 and pass@k on held-out problems
    results_path = os.path.join(out, "results.json")
    k = sizes["samples"] if sizes else args.pass_samples
    flags = ["--policy", f"hf:{model}", ckpt, "--names", "instruct", "grpo", "--ref", f"hf:{model}", "--rm", "none"]
    flags += ["--reward-fn", REWARD, "--prompts", eval_path, "--num-samples", str(eval_count)]
    flags += [*sampling, "--pass-at", "1", str(k), "--pass-samples", str(k), "--json", results_path, "--show", "5"]
    run(stage("eval.py", *flags), os.path.join(out, "eval.txt"))
    results = json.load(open(results_path))
    results["_meta"] = {"dtype": dtype, "seconds": round(time.time() - started)}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    for name in ("instruct", "grpo"):
        row = results[name]
        print(f"{name}: pass@1 {row['pass@1']:.3f} ± {row['pass@1_se']:.3f}, pass@{k} {row[f'pass@{k}']:.3f}")
    print(f"real_rlvr: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
