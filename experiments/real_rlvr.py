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
from real import ROOT, build_model, run, run_dtype, stage  # noqa: E402
from rg_screen import CANDIDATES  # noqa: E402
from rlvr import RUNS  # noqa: E402

sys.path.insert(0, ROOT)
from common import write_atomic  # noqa: E402


@dataclass
class Args:
    out_dir: str = "out/real_rlvr"
    """where the task files, the runs and results.json go"""
    model_dir: str = "out/smollm2"
    """the Hugging Face folder of the model (built from the package's GGUF when missing: make smollm2)"""
    tasks: list[str] = field(default_factory=lambda: ["chain_sum", "leg_counting"])
    """reasoning-gym datasets, at rg_screen.py's configurations (CANDIDATES); these two: their format SFT's pass@1 is
    inside 0.05-0.6 (0.109 and 0.055 on 16 questions, docs/results.md), where RL has room both ways, and their answers
    spread (letter_counting's 0.453 was mostly the answer 1: GRPO collapsed onto it). leg_counting took countdown's
    place: 512 episodes moved neither, and countdown's 150-token prompts made its chain twice chain_sum's"""
    sft_steps: int = 24
    """the format SFT's steps (batch 8, LoRA rank 16)"""
    episodes: int = 512
    """responses GRPO samples a task (episodes, with --feedback-turns)"""
    losses: list[str] = field(default_factory=lambda: ["grpo"])
    """the GRPO runs on each task at equal episodes, by make rlvr's row names (experiments/rlvr.py's RUNS: grpo, dapo,
    gspo, cispo, dppo_tv, dppo_kl); make real-rlvr trains grpo, make real-rlvr-losses all six on chain_sum"""
    feedback_turns: int = 0
    """K > 0: also GRPO in the feedback game (--env rg:Retry --max-turns K: a wrong attempt is answered by the
    scorer's verdict and tried again, up to K attempts), and every policy evaluated in it: first_try and solved"""
    game_prompts: int = 256
    """--feedback-turns: held-out questions of the feedback game's evaluation, one episode each"""
    group_size: int = 8
    """GRPO's responses per question"""
    lr: float = 2e-4
    """GRPO's learning rate (LoRA rank 16)"""
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


def with_value(flags: list[str], flag: str, value: str) -> list[str]:
    """flags with flag's value replaced by value."""
    index = flags.index(flag)
    return [*flags[: index + 1], value, *flags[index + 2 :]]


def train_task(args: Args, out: str, name: str, dtype: str, sizes: dict) -> dict:
    """The format SFT, each --losses GRPO run (and the feedback game's with --feedback-turns) and eval.py on one
    task: eval's rows (sft, then a row a run) with their seconds."""
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
    # GRPO's runs on the scorer's reward, LoRA on the SFT policy (their reference), at equal episodes
    common = [*task, "--sft-ckpt", sft, "--rm-ckpt", "none", *sampling, "--rollout-batch-size", str(sizes["batch"])]
    common += ["--total-episodes", str(sizes["episodes"]), "--micro-batch-size", str(sizes["batch"])]
    common += ["--lora-rank", "16", "--lr", str(args.lr), "--warmup-steps", "1", "--ptx-coef", "0"]
    common += ["--log-every", "1", "--sample-every", "4"]
    runs = {loss: [*common, "--reward-fn", "rg:score", *loss_flags(loss, sizes)] for loss in args.losses}
    if args.feedback_turns:  # GRPO in the feedback game: a wrong attempt answered by its verdict, up to K attempts
        game = ["--env", "rg:Retry", "--max-turns", str(args.feedback_turns)]
        runs["grpo_feedback"] = [*common, *game, *loss_flags("grpo", sizes)]
    checkpoints = {"sft": sft}
    for policy, flags in runs.items():
        checkpoints[policy] = os.path.join(out, name, policy, "ckpt.pt")
        if not os.path.exists(checkpoints[policy]):
            out_dir = os.path.dirname(checkpoints[policy])
            os.makedirs(out_dir, exist_ok=True)
            run(stage("train_grpo.py", *flags, "--out-dir", out_dir, "--overwrite"), f"{out_dir}/stdout.txt")
    # pass@1 and pass@k on held-out questions, before (the SFT policy) and after
    k = str(sizes["samples"])
    flags = [*task, "--ref", sft, "--rm", "none", *sampling]
    flags += ["--num-samples", str(sizes["eval"]), "--pass-at", "1", k, "--pass-samples", k, "--show", "8"]
    rows = evaluate(
        out, name, "results.json", flags, {p: c for p, c in checkpoints.items() if p in ["sft", *args.losses]}
    )
    if args.feedback_turns:  # the SFT policy, the first loss's and the game's in the game: first_try and solved
        flags = [*task, "--ref", sft, "--rm", "none", *sampling, *game, "--num-samples", str(sizes["game"])]
        played = {policy: checkpoints[policy] for policy in ("sft", args.losses[0], "grpo_feedback")}
        game_rows = evaluate(out, name, "feedback.json", flags + ["--show", "4"], played)
        rows |= {f"{policy}/feedback": row for policy, row in game_rows.items()}
    return rows


def loss_flags(loss: str, sizes: dict) -> list[str]:
    """train_grpo.py's flags of a --losses name: make rlvr's row of that name (experiments/rlvr.py's RUNS), at this
    run's group size."""
    script, flags = RUNS[loss]
    return with_value(flags, "--group-size", str(sizes["group"]))


def evaluate(out: str, name: str, file: str, flags: list[str], checkpoints: dict) -> dict:
    """eval.py's rows of the policies ({policy: checkpoint}) with flags, kept in <out>/<name>/<file>: a rerun
    evaluates only the policies the file lacks."""
    path = os.path.join(out, name, file)
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    missing = {policy: checkpoint for policy, checkpoint in checkpoints.items() if policy not in rows}
    if missing:
        part = os.path.join(out, name, f"eval_{'_'.join(missing)}.json")
        policies = ["--policy", *missing.values(), "--names", *missing, "--json", part]
        run(stage("eval.py", *flags, *policies), part.replace(".json", ".txt"))
        with open(part) as f:
            rows |= json.load(f)
        write_atomic(path, json.dumps(rows, indent=2))
    return {policy: rows[policy] for policy in checkpoints}


def main(args: Args) -> None:
    started = time.time()
    if not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        build_model(args.model_dir)
    unknown = [name for name in args.tasks if name not in CANDIDATES]
    if unknown:
        sys.exit(f"error: --tasks {unknown[0]}: not one of rg_screen.py's candidates ({', '.join(CANDIDATES)})")
    unknown = [loss for loss in args.losses if loss not in RUNS or RUNS[loss][0] != "train_grpo.py"]
    if unknown:
        known = ", ".join(name for name, (script, _) in RUNS.items() if script == "train_grpo.py")
        sys.exit(f"error: --losses {unknown[0]}: not one of make rlvr's GRPO rows ({known})")
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
        game=args.game_prompts,
    )
    if args.tiny:
        sizes = dict(sft_steps=2, episodes=8, group=2, batch=4, eval=2, samples=2, tokens=8, game=2)
    results = {}
    for name in args.tasks:
        results[name] = train_task(args, out, name, dtype, sizes)
        results_path = os.path.join(out, "results.json")
        meta = {"dtype": dtype, "seconds": round(time.time() - started), "configs": {n: CANDIDATES[n] for n in results}}
        with open(results_path, "w") as f:
            json.dump(results | {"_meta": meta}, f, indent=2)
    k = sizes["samples"]
    for name, rows in results.items():
        for policy, row in rows.items():
            if policy.endswith("/feedback"):
                stats = ("episode/first_try", "episode/solved", "episode/attempts")
            else:
                stats = ("pass@1", f"pass@{k}", "gold")
            cells = [f"{stat} {row[stat]:.3f} ± {row[stat + '_se']:.3f}" for stat in stats]
            extra = (
                f", valid_frac {row['valid_frac']:.3f}" if "valid_frac" in row and row["valid_frac"] is not None else ""
            )
            print(f"{name} {policy}: " + ", ".join(cells) + extra + f", kl {row['kl']:.2f}")
    print(f"real_rlvr: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
