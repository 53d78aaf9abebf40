"""The policy update on the gold reward itself (docs/results.md, "The policy update"): with the reward model out of
the picture (--rm-ckpt none --reward-fn task:gold_reward), how close each variant of the update comes to gold's
KL-optimal limit at its own KL, and how far each of its updates moves the policy.

Every run is the real train_ppo.py (or train_grpo.py) from the same SFT checkpoint at --kl-coef 0.1 unless a variant
says otherwise, then eval.py on the held-out prompts (and, with --train-prompts, on training prompts too). The limit
comes from eval.py --kl-optimal on the same SFT (its JSON, --limit-json: rows sft_opt_gold_b<beta>), interpolated
linearly in KL. Each row: gold ± se, KL, valid_frac, gold's limit at that KL and the gap, the off-aspect share
(eval.py's off_aspect), the responses scored (the rollout's and VinePPO's continuations) and the tokens generated,
the wall time, the mean and the course (quarters of the run) of policy/update_kl (KL(pi_old || pi_new) per response
after each update) and of policy/clipfrac.

python experiments/update.py --limit-json out/limit.json                      # every variant, 12,800 episodes
python experiments/update.py --only default ptx0 --episodes 25600 --seeds 1 2  # a confirmation
"""

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro
from ablation import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLD = ["--rm-ckpt", "none", "--reward-fn", "task:gold_reward"]

# name -> (script, flags); every run adds GOLD, --kl-coef 0.1 (unless given), --total-episodes and --seed
VARIANTS = {
    "default": ("train_ppo.py", []),
    "ptx0": ("train_ppo.py", ["--ptx-coef", "0"]),
    "lr1.5e-3": ("train_ppo.py", ["--lr", "1.5e-3"]),
    "epochs4": ("train_ppo.py", ["--ppo-epochs", "4"]),
    "minibatches1": ("train_ppo.py", ["--num-minibatches", "1"]),
    "minibatches8": ("train_ppo.py", ["--num-minibatches", "8", "--micro-batch-size", "8"]),
    "rollout256": ("train_ppo.py", ["--rollout-batch-size", "256", "--num-minibatches", "8"]),
    "critic_lr1e-3": ("train_ppo.py", ["--critic-lr", "1e-3"]),
    "critic_warmup20": ("train_ppo.py", ["--critic-warmup-steps", "20"]),
    "lam1": ("train_ppo.py", ["--lam", "1.0"]),
    "no_reward_norm": ("train_ppo.py", ["--reward-norm", "none", "--reward-clip", "None"]),
    "no_whiten": ("train_ppo.py", ["--adv-whiten", "none"]),
    "cliprange0.1": ("train_ppo.py", ["--cliprange", "0.1"]),
    "rloo": ("train_grpo.py", ["--estimator", "rloo"]),
    "grpo": ("train_grpo.py", ["--estimator", "grpo"]),
    "vineppo": ("train_grpo.py", ["--estimator", "vineppo"]),
    "rebel": ("train_grpo.py", ["--estimator", "rebel"]),
    "rebel_eta0.3": ("train_grpo.py", ["--estimator", "rebel", "--rebel-eta", "0.3"]),
    "rebel_eta3": ("train_grpo.py", ["--estimator", "rebel", "--rebel-eta", "3"]),
    "vineppo_k2": ("train_grpo.py", ["--estimator", "vineppo", "--vine-k", "2"]),
}


@dataclass
class Args:
    out_dir: str = "out/update"
    """where runs go: <out_dir>/<variant>/<episodes>/<seed>"""
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the SFT policy every run starts from (and the KL reference)"""
    task_dir: str = "out/data"
    """the built-in task's cache folder"""
    limit_json: str = "out/limit.json"
    """eval.py --kl-optimal's JSON on the same SFT (rows sft_opt_gold_b<beta>)"""
    episodes: int = 12800
    """--total-episodes of every run"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds of every variant"""
    only: Optional[list[str]] = None
    """run only these variants (the keys of VARIANTS)"""
    jobs: int = 2
    """runs at a time (one thread each on 2 cores; OMP_NUM_THREADS in the environment wins)"""
    train_prompts: bool = False
    """also evaluate on 512 training prompts (generalisation)"""
    extra: str = ""
    """more flags for every run, one string"""
    eval_prompts: Optional[str] = None
    """evaluate on this prompt file instead of eval.py's default (the first 512 held-out prompts): a search's own
    prompts, e.g. held-out prompts 512-1023 cut from eval_prompts.jsonl, so the reported rows stay unseen"""


def limit_curve(path: str) -> list[tuple[float, float]]:
    """[(kl, gold)] of gold's KL-optimal limit, sorted by KL."""
    rows = json.load(open(path))
    points = [(row["kl"], row["gold"]) for name, row in rows.items() if "_opt_gold_b" in name]
    return sorted(points)


def limit_at(curve: list[tuple[float, float]], kl: float) -> Optional[float]:
    """The limit's gold at a KL, linear between the measured points (None outside them)."""
    for (kl_a, gold_a), (kl_b, gold_b) in zip(curve, curve[1:]):
        if kl_a <= kl <= kl_b:
            return gold_a + (gold_b - gold_a) * (kl - kl_a) / (kl_b - kl_a)
    return None


def commands(args: Args, name: str, seed: int, out: str) -> list[list[str]]:
    script, flags = VARIANTS[name]
    python = sys.executable
    train = [python, os.path.join(ROOT, script), "--sft-ckpt", args.sft_ckpt, *GOLD, "--task-dir", args.task_dir]
    train += ["--out-dir", out, "--overwrite", "--seed", str(seed), "--total-episodes", str(args.episodes)]
    train += ["--log-every", "50"] + ([] if "--kl-coef" in flags else ["--kl-coef", "0.1"])
    train += [*flags, *shlex.split(args.extra)]
    evaluate = [python, os.path.join(ROOT, "eval.py"), "--task-dir", args.task_dir, "--ref", args.sft_ckpt]
    evaluate += ["--policy", os.path.join(out, "ckpt.pt"), "--names", name, "--rm", "none"]
    evaluate += ["--prompts", args.eval_prompts] if args.eval_prompts else []
    runs = [train, evaluate + ["--json", os.path.join(out, "eval.json")]]
    if args.train_prompts:
        from task import build_task

        prompts = build_task(args.task_dir, 1337)["prompts"]
        runs.append(evaluate + ["--prompts", prompts, "--json", os.path.join(out, "eval_train.json")])
    return runs


def course(series: list[tuple[int, float]], parts: int = 4) -> str:
    """The means of a series over consecutive parts of the run."""
    values = [value for _, value in series]
    size = max(1, len(values) // parts)
    means = [sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, size * parts, size)]
    return " / ".join(f"{m:.2g}" for m in means)


def summarize(args: Args, name: str, out: str, seconds: float) -> dict:
    result = json.load(open(os.path.join(out, "eval.json")))[name]
    scalars = read_scalars(out)
    update_kl = scalars.get("policy/update_kl", [])
    clipfrac = scalars.get("policy/clipfrac", [])
    row = {key: result.get(key) for key in ("gold", "gold_se", "kl", "valid_frac", "off_aspect")}
    episodes = [value for _, value in scalars["train/episodes"]]
    rollout_tokens = sum(
        length * (episodes[i] - (episodes[i - 1] if i else 0))
        for i, (_, length) in enumerate(scalars["rollout/response_len"])
    )
    vine_responses = sum(value for _, value in scalars.get("rollout/vine_responses", []))
    row |= {
        "scored": episodes[-1] + vine_responses,
        "tokens": rollout_tokens + sum(value for _, value in scalars.get("rollout/vine_tokens", [])),
    }
    row |= {
        "update_kl_mean": sum(v for _, v in update_kl) / max(1, len(update_kl)),
        "update_kl_course": course(update_kl),
    }
    row |= {"clipfrac_mean": sum(v for _, v in clipfrac) / max(1, len(clipfrac)), "clipfrac_course": course(clipfrac)}
    if args.train_prompts:
        train = json.load(open(os.path.join(out, "eval_train.json")))[name]
        row |= {"train_gold": train["gold"], "train_gold_se": train["gold_se"], "train_kl": train["kl"]}
    return row | {"seconds": seconds}


def main(args: Args) -> None:
    names = args.only or list(VARIANTS)
    todo = [(name, seed) for name in names for seed in args.seeds]
    running = []
    while todo or running:
        while todo and len(running) < args.jobs:
            name, seed = todo.pop(0)
            out = os.path.join(args.out_dir, name, str(args.episodes), str(seed))
            if os.path.exists(os.path.join(out, "summary.json")):
                continue
            os.makedirs(out, exist_ok=True)
            queue = commands(args, name, seed, out)
            log = open(os.path.join(out, "stdout.txt"), "w")
            threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // args.jobs))
            env = os.environ | {"OMP_NUM_THREADS": threads}
            print(f"start {name}/{seed}", flush=True)
            process = subprocess.Popen(queue[0], stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((process, queue[1:], log, env, name, out, time.time()))
        time.sleep(1)
        for entry in list(running):
            process, queue, log, env, name, out, started = entry
            if process.poll() is None:
                continue
            running.remove(entry)
            if process.returncode != 0:
                raise SystemExit(f"{name} failed (exit {process.returncode}); see {out}/stdout.txt")
            if queue:
                process = subprocess.Popen(queue[0], stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append((process, queue[1:], log, env, name, out, started))
                continue
            row = summarize(args, name, out, time.time() - started)
            json.dump(row, open(os.path.join(out, "summary.json"), "w"), indent=1)
            print(f"done {name} in {row['seconds']:.0f}s: gold {row['gold']:.3f} kl {row['kl']:.2f}", flush=True)
    curve = limit_curve(args.limit_json) if os.path.exists(args.limit_json) else []
    lines = [
        f"{args.episodes} episodes, beta 0.1 unless the variant sets it; gold on eval.py's held-out prompts",
        "",
        "| variant | seed | gold | KL | valid | limit at KL | gap | off-aspect | scored | tokens | minutes | "
        "update KL (mean; quarters) | clipfrac (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for seed in args.seeds:
            out = os.path.join(args.out_dir, name, str(args.episodes), str(seed))
            row = json.load(open(os.path.join(out, "summary.json")))
            limit = limit_at(curve, row["kl"])
            gap = "-" if limit is None else f"{limit - row['gold']:.3f}"
            limit_text = "-" if limit is None else f"{limit:.3f}"
            lines.append(
                f"| {name} | {seed} | {row['gold']:.3f} ± {row['gold_se']:.3f} | {row['kl']:.2f} | "
                f"{row['valid_frac']:.3f} | {limit_text} | {gap} | {row['off_aspect']:.3f} | {row['scored']:,.0f} | "
                f"{row['tokens']:,.0f} | {row['seconds'] / 60:.1f} | {row['update_kl_mean']:.3g}; "
                f"{row['update_kl_course']} | {row['clipfrac_mean']:.3g} |"
            )
    table = "\n".join(lines)
    open(os.path.join(args.out_dir, f"update_{args.episodes}.md"), "w").write(table + "\n")
    print(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
