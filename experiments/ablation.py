"""PPO-max ablation and KL-coefficient sweep on the built-in task.

Every run is the real `train_ppo.py` from the same SFT and RM checkpoints, with the same seeds and budget; only the
flags of one trick change. Each run leaves its TensorBoard files under out/ablation/<name>/<seed> (they overlay in one
`tensorboard --logdir out/ablation`) and a summary.json; finished runs are skipped, so the script resumes. At the end
it prints (and writes to out/ablation/ablation.md) two markdown tables: the ablation, and the gold-versus-KL frontier.

python experiments/ablation.py                       # after `make demo` (uses out/sft and out/rm); about 1 h on 2 cores
python experiments/ablation.py --seeds 1 2 3 --jobs 2 # 2 runs at a time, 1 thread each
python experiments/ablation.py --only ppo_max vanilla --no-sweep --extra="--total-episodes 6400"
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> the train_ppo.py flags that switch tricks off (PPO-max = the defaults)
VARIANTS = {
    "ppo_max": [],
    "vanilla": [
        "--kl-coef",
        "0",
        "--reward-norm",
        "none",
        "--reward-clip",
        "None",
        "--cliprange-value",
        "None",
        "--critic-warmup-steps",
        "0",
        "--ptx-coef",
        "0",
        "--grad-clip",
        "0",
        "--critic-grad-clip",
        "0",
        "--adv-whiten",
        "rollout",
    ],
    "no_kl": ["--kl-coef", "0"],
    "no_reward_norm_clip": ["--reward-norm", "none", "--reward-clip", "None"],
    "no_critic_warmup": ["--critic-warmup-steps", "0"],
    "no_ptx": ["--ptx-coef", "0"],
    "no_grad_clip": ["--grad-clip", "0", "--critic-grad-clip", "0"],
    "rollout_whiten": ["--adv-whiten", "rollout"],
}
# the sweep's other points; kl 0 and 0.1 are the no_kl and ppo_max runs above
SWEEP = [0.01, 0.03, 0.3, 1.0]
KL_COEF = 0.1  # every run's beta unless the variant sets it (the ablation was measured at 0.1; the default is now 0.3)


@dataclass
class Args:
    out_dir: str = "out/ablation"
    """where runs go: <out_dir>/<name>/<seed>"""
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the SFT policy every run starts from"""
    rm_ckpt: str = "out/rm/ckpt.pt"
    """the reward model every run optimises"""
    task_dir: str = "out/data"
    """the built-in task's cache folder"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """training seeds (the same for every variant)"""
    sweep_seeds: Optional[list[int]] = None
    """seeds of the --kl-coef sweep (default: the first of --seeds)"""
    only: Optional[list[str]] = None
    """run only these variants (names: ppo_max vanilla no_kl no_reward_norm_clip no_critic_warmup no_ptx no_grad_clip
    rollout_whiten)"""
    sweep: bool = True
    """also run the --kl-coef sweep"""
    jobs: int = 1
    """runs at a time"""
    threads: Optional[int] = None
    """torch threads per run (default: cores // jobs)"""
    last: int = 10
    """final numbers are means over the last this many iterations"""
    extra: str = ""
    """more train_ppo.py flags for every run, one string (e.g. --extra "--total-episodes 6400")"""


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of one run's event files: tag -> [(step, value)] sorted by step (later files win)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items()) for tag in acc.Tags()["scalars"]}


def first_alarm(s: dict, run_args: dict) -> Optional[int]:
    """Replay train_ppo's CollapseDetector (as it is now) over a run's logged KL, length and perplexity, from the end
    of its critic warm-up, as main() feeds it: every run is judged by the same detector, whenever it ran (a
    train_grpo.py run, which has no detector, with train_ppo's default settings and no warm-up)."""
    sys.path.insert(0, ROOT)
    from train_ppo import Args, CollapseDetector

    settings = [run_args.get(key, getattr(Args, key)) for key in ("collapse_window", "collapse_z", "collapse_lag")]
    warmup = run_args.get("critic_warmup_steps", 0)
    det = CollapseDetector(*settings)
    series = zip(s["objective/kl"], s["rollout/response_len"], s["rollout/perplexity"])
    for (step, kl), (_, length), (_, ppl) in series:
        if step > warmup and det.update(kl, length, ppl):
            return step
    return None


def summarize(run_dir: str, last: int) -> dict:
    """Final means over the last iterations, the peak of gold, and the first collapse alarm of one finished run."""
    import torch

    s = read_scalars(run_dir)

    def tail(tag: str) -> float:
        return sum(v for _, v in s[tag][-last:]) / len(s[tag][-last:])

    run_args = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=False)["args"]
    alarm = first_alarm(s, run_args)
    gold = s["objective/gold"]
    peak_step, peak = max(gold, key=lambda sv: sv[1])
    return {
        "gold": tail("objective/gold"),
        "score": tail("objective/score"),
        "kl": tail("objective/kl"),
        "response_len": tail("rollout/response_len"),
        "perplexity": tail("rollout/perplexity"),
        "first_alarm": alarm,
        "gold_peak": peak,
        "gold_peak_step": peak_step,
        "iterations": gold[-1][0],
    }


def run_one(args: Args, name: str, seed: int, flags: list[str], threads: int) -> Optional[subprocess.Popen]:
    """Start one train_ppo.py run unless it has finished before (summary.json). Returns the process or None."""
    run_dir = os.path.join(args.out_dir, name, str(seed))
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return None
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train_ppo.py"),
        "--out-dir",
        run_dir,
        "--seed",
        str(seed),
        "--sft-ckpt",
        args.sft_ckpt,
        "--rm-ckpt",
        args.rm_ckpt,
        "--task-dir",
        args.task_dir,
        "--log-every",
        "50",
        "--kl-coef",
        str(KL_COEF),
        *flags,
        *shlex.split(args.extra),
    ]
    os.makedirs(run_dir, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    log = open(os.path.join(run_dir, "stdout.txt"), "w")
    print(f"start {name}/{seed}: {' '.join(flags) or '(defaults)'}", flush=True)
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    p.run_dir, p.label, p.t0 = run_dir, f"{name}/{seed}", time.time()
    return p


def finish(p: subprocess.Popen, last: int) -> None:
    if p.returncode != 0:
        raise SystemExit(f"{p.label} failed (exit {p.returncode}); see {p.run_dir}/stdout.txt")
    summary = summarize(p.run_dir, last) | {"seconds": time.time() - p.t0}
    with open(os.path.join(p.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"done {p.label} in {summary['seconds']:.0f}s: gold {summary['gold']:.3f} kl {summary['kl']:.2f} "
        f"first alarm {summary['first_alarm']}",
        flush=True,
    )


def spread(xs: list) -> str:
    """mean ± half-range over seeds (or the single value)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    r = (max(xs) - min(xs)) / 2
    fmt = (lambda v: f"{v:.1f}") if abs(m) >= 10 else (lambda v: f"{v:.3f}" if abs(m) < 1 else f"{v:.2f}")
    return fmt(m) if len(xs) == 1 else f"{fmt(m)} ± {fmt(r)}"


def tables(args: Args, runs: dict[str, dict[int, dict]], sweep: dict[float, dict[int, dict]]) -> str:
    lines = [
        f"Final = mean of the last {args.last} iterations' rollouts; ± = half the range over seeds "
        f"{args.seeds}; alarm = first collapse-alarm iteration per seed (- = none).",
        "",
        "| variant | gold | RM score | KL (nats) | length | perplexity | gold peak (iteration) | first alarm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_seed in runs.items():
        r = list(by_seed.values())

        def col(k: str, r=r) -> str:
            return spread([x[k] for x in r])

        alarms = ", ".join(str(x["first_alarm"]) if x["first_alarm"] else "-" for x in r)
        peaks = ", ".join(f"{x['gold_peak']:.2f} ({x['gold_peak_step']})" for x in r)
        lines.append(
            f"| {name} | {col('gold')} | {col('score')} | {col('kl')} | {col('response_len')} | "
            f"{col('perplexity')} | {peaks} | {alarms} |"
        )
    if sweep:
        lines += [
            "",
            "KL-coefficient sweep (gold vs KL frontier; kl 0 = no_kl, 0.1 = ppo_max):",
            "",
            "| kl_coef | gold | RM score | KL (nats) | length | perplexity | first alarm |",
            "|---|---|---|---|---|---|---|",
        ]
        for coef, by_seed in sorted(sweep.items()):
            r = list(by_seed.values())

            def col(k: str, r=r) -> str:
                return spread([x[k] for x in r])

            alarms = ", ".join(str(x["first_alarm"]) if x["first_alarm"] else "-" for x in r)
            lines.append(
                f"| {coef:g} | {col('gold')} | {col('score')} | {col('kl')} | {col('response_len')} | "
                f"{col('perplexity')} | {alarms} |"
            )
    return "\n".join(lines)


def main(args: Args) -> None:
    for path, flag in ((args.sft_ckpt, "--sft-ckpt"), (args.rm_ckpt, "--rm-ckpt")):
        if not os.path.exists(path):
            raise SystemExit(f"{flag} {path}: not found (run `make demo` first, or pass the checkpoints)")
    names = args.only or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: unknown; choose from {' '.join(VARIANTS)}")
    sweep_seeds = args.sweep_seeds or args.seeds[:1]
    todo = [(n, s, VARIANTS[n]) for n in names for s in args.seeds]
    if args.sweep:
        todo += [(f"kl_{c:g}", s, ["--kl-coef", str(c)]) for c in SWEEP for s in sweep_seeds]
    threads = args.threads or max(1, (os.cpu_count() or 2) // args.jobs)
    running: list[subprocess.Popen] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            p = run_one(args, *todo.pop(0), threads)
            if p is not None:
                running.append(p)
        time.sleep(1)
        for p in [p for p in running if p.poll() is not None]:
            running.remove(p)
            finish(p, args.last)

    # the tables are recomputed from the event files (summary.json marks a finished run)

    def load(name: str, seed: int) -> dict:
        return summarize(os.path.join(args.out_dir, name, str(seed)), args.last)

    runs = {n: {s: load(n, s) for s in args.seeds} for n in names}
    sweep = {}
    if args.sweep:
        sweep = {c: {s: load(f"kl_{c:g}", s) for s in sweep_seeds} for c in SWEEP}
        for c, n in ((0.0, "no_kl"), (0.1, "ppo_max")):
            if n in runs:
                sweep[c] = {s: runs[n][s] for s in sweep_seeds if s in runs[n]}
    md = tables(args, runs, sweep)
    with open(os.path.join(args.out_dir, "ablation.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main(tyro.cli(Args))
