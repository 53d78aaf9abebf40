"""The gold-versus-KL frontier on the built-in task: every method at several KL strengths, from the same
SFT and RM checkpoints and the same budget, each point measured by `eval.py` on the held-out prompts.

A method is one entry of METHODS: the script it trains with, its flags, the strengths it sweeps (PPO's --kl-coef,
DPO's --beta, best-of-N's N) and the middle strength that gets a second seed. Runs go to
<out_dir>/<method>/<strength>/<seed> with their TensorBoard files, stdout.txt, eval.json and a summary.json; finished
runs are skipped, so the script resumes. At the end it writes <out_dir>/frontier.md (the table) and frontier.png
(gold against KL, one line per method) and prints the table.

python experiments/frontier.py                  # after `make demo` (uses out/sft and out/rm); about 2 h on 2 cores
python experiments/frontier.py --only ppo_max grpo --jobs 1
python experiments/frontier.py --table-only     # redraw the table and the plot from finished runs
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
from ablation import first_alarm, read_scalars, spread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE = ["--rm-ckpt", "none", "--reward-fn", "task:gold_reward"]
LIMIT_BETAS = (1.0, 0.5, 0.3, 0.2, 0.15, 0.1, 0.075, 0.05, 0.03)
GOLD_FLOOR = -0.2  # the plot's floor: a collapsed run (gold down to -1) would squeeze the frontier into a strip


@dataclass(frozen=True)
class Method:
    kind: str
    """ppo (train_ppo.py, strength = --kl-coef), grpo (train_grpo.py, strength = --kl-coef), dpo (train_dpo.py,
    strength = --beta), bon (eval.py's best-of-N
    from the SFT policy, strength = N) or limit (eval.py --kl-optimal: the KL-regularised optimum from the SFT
    policy's samples, strength = beta, flags = the reward signal: gold or rm)"""
    strengths: tuple
    """the sweep, strongest KL control first"""
    middle: Optional[float]
    """the strength that gets the extra seeds (None: the first seed only)"""
    flags: tuple = ()
    """the method's own flags"""


# adding a method is one entry; PPO's reward-KL betas 0.3/0.1/0.03 span about 2-8 nats (docs/results.md,
# "Ablation"); the loss-KL estimators (grpo, dr_grpo) use k3 on the current log-probs, whose beta is on another
# scale: a first pass found GRPO at 3 nats for 0.15 and collapsing at 0.05 (11 nats), Dr. GRPO under 3 nats down to
# 0.015 (its per-token gradient is smaller), hence their longer sweeps
METHODS = {
    "ppo_max": Method("ppo", (0.3, 0.1, 0.03), 0.1),
    "grpo": Method("grpo", (0.3, 0.15, 0.08, 0.05, 0.015), 0.15),
    "dr_grpo": Method("grpo", (0.15, 0.05, 0.015, 0.0), 0.05, ("--no-grpo-std-norm", "--loss-agg", "seq_sum_norm")),
    "rloo": Method("grpo", (0.3, 0.1, 0.03), 0.1, ("--estimator", "rloo")),
    "reinforce_pp": Method("grpo", (0.3, 0.1, 0.03), 0.1, ("--estimator", "reinforce_pp")),
    # REBEL on the learned RM (the KL in the reward, as PPO-max's): on gold it gains the most per episode
    "rebel": Method("grpo", (0.3, 0.1, 0.03), 0.1, ("--estimator", "rebel")),
    # DAPO's recipe (its loss aggregation, clip-higher, dynamic sampling, overlong filtering) and GRPO's advantages
    # under GSPO's sequence-ratio loss (the paper's eps), under CISPO's clipped-weight loss and under DPPO's trust
    # region on the token's probability (total variation, the paper's delta 0.15)
    "dapo": Method(
        "grpo",
        (0.3, 0.15, 0.05),
        0.15,
        ("--loss-agg", "token_mean", "--cliprange-high", "0.28", "--dynamic-sampling", "--mask-truncated"),
    ),
    "gspo": Method(
        "grpo", (0.3, 0.15, 0.05), 0.15, ("--policy-loss", "gspo", "--cliprange", "3e-4", "--cliprange-high", "4e-4")
    ),
    "cispo": Method(
        "grpo",
        (0.3, 0.15, 0.05),
        0.15,
        ("--policy-loss", "cispo", "--cliprange", "1", "--cliprange-high", "0.28", "--loss-agg", "token_mean"),
    ),
    "dppo_tv": Method("grpo", (0.3, 0.15, 0.05), 0.15, ("--policy-loss", "dppo_tv", "--cliprange", "0.15")),
    "ppo_max_oracle": Method("ppo", (0.3, 0.1), None, ORACLE),
    "grpo_oracle": Method("grpo", (0.15, 0.05), None, ORACLE),
    # the Monte-Carlo and the regression updates (train_grpo.py --estimator vineppo | rebel), on gold itself: do they
    # close the optimiser's gap (docs/results.md, "The policy update, diagnosed on gold")?
    "vineppo_oracle": Method("grpo", (0.3, 0.1), None, (*ORACLE, "--estimator", "vineppo")),
    "rebel_oracle": Method("grpo", (0.3, 0.1), None, (*ORACLE, "--estimator", "rebel")),
    "dpo": Method("dpo", (1.0, 0.3, 0.1), 0.3),
    # KTO on the same pairs (chosen desirable, rejected undesirable); its beta moves the policy the other way round:
    # 0.1 ended at 0.49 nats and 0.3 at 0.75 in the same 156 steps (docs/results.md), so the sweep rises
    "kto": Method("dpo", (0.1, 0.3, 1.0), 0.3, ("--loss", "kto")),
    "best_of_n": Method("bon", (1, 4, 16, 64), 16),
    # the two limits (docs/design.md §5d): tilted by the gold reward, what any method can reach at that KL; tilted by
    # the RM, what a perfect optimiser of this RM reaches, scored on gold
    "limit_gold": Method("limit", LIMIT_BETAS, None, ("gold",)),
    "limit_rm": Method("limit", LIMIT_BETAS, None, ("rm",)),
}


@dataclass
class Args:
    out_dir: str = "out/frontier"
    """where runs go: <out_dir>/<method>/<strength>/<seed>"""
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the SFT policy every run starts from (and the KL reference)"""
    rm_ckpt: str = "out/rm/ckpt.pt"
    """the reward model every run optimises (the oracle runs optimise the gold reward instead)"""
    task_dir: str = "out/data"
    """the built-in task's cache folder"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """the first seed runs every strength, the rest the middle strength only"""
    only: Optional[list[str]] = None
    """run only these methods (names: the keys of METHODS)"""
    jobs: int = 2
    """runs at a time"""
    threads: Optional[int] = None
    """torch threads per run (default: cores // jobs)"""
    eval_samples: int = 512
    """held-out prompts sampled per point by eval.py"""
    bon_samples: int = 256
    """held-out prompts for best-of-N (each gets max(N) samples)"""
    limit_samples: int = 256
    """SFT samples per held-out prompt for the two limits (eval.py --kl-optimal --seeds), drawn once and cached"""
    table_only: bool = False
    """start nothing: write the table and the plot from the finished runs"""
    extra: str = ""
    """more flags for every RL run (train_ppo.py, train_grpo.py), one string (e.g. --extra "--total-episodes 6400")"""


def run_dir(args: Args, method: str, strength: float, seed: int) -> str:
    return os.path.join(args.out_dir, method, f"{strength:g}", str(seed))


def commands(args: Args, method: str, strength: float, seed: int) -> list[list[str]]:
    """The processes one point runs, in order: train (not for best-of-N), then eval.py into eval.json."""
    spec = METHODS[method]
    out = run_dir(args, method, strength, seed)
    python = sys.executable
    evaluate = [python, os.path.join(ROOT, "eval.py"), "--task-dir", args.task_dir, "--ref", args.sft_ckpt]
    evaluate += ["--rm", args.rm_ckpt, "--json", os.path.join(out, "eval.json")]
    if spec.kind == "bon":
        evaluate += ["--policy", args.sft_ckpt, "--names", "sft", "--num-samples", str(args.bon_samples)]
        return [evaluate + ["--best-of-n", *map(str, spec.strengths)]]
    if spec.kind == "limit":  # both limits share one set of samples (the cache), each only scores them
        evaluate += ["--policy", args.sft_ckpt, "--names", "sft", "--num-samples", str(args.eval_samples)]
        evaluate += ["--seeds", str(args.limit_samples), "--sample-cache", os.path.join(args.out_dir, "limit.pt")]
        return [evaluate + ["--kl-optimal", *map(str, spec.strengths)]]
    if spec.kind == "dpo":
        train = [python, os.path.join(ROOT, "train_dpo.py"), "--init", args.sft_ckpt, "--beta", f"{strength:g}"]
    else:
        script = "train_ppo.py" if spec.kind == "ppo" else "train_grpo.py"
        train = [python, os.path.join(ROOT, script), "--sft-ckpt", args.sft_ckpt]
        train += [] if "--rm-ckpt" in spec.flags else ["--rm-ckpt", args.rm_ckpt]
        train += ["--kl-coef", f"{strength:g}", "--log-every", "50", *shlex.split(args.extra)]
    train += ["--out-dir", out, "--overwrite", "--task-dir", args.task_dir, "--seed", str(seed), *spec.flags]
    evaluate += ["--policy", os.path.join(out, "ckpt.pt"), "--names", method, "--num-samples", str(args.eval_samples)]
    return [train, evaluate]


def time_to_fraction(
    series: list, start: float, fraction: float = 0.9, window: int = 5, min_gain: float = 0.1
) -> Optional[float]:
    """Seconds from `start` (the run's first logged event) until the moving average (over `window` points) of a gold
    series first covers `fraction` of the way from its first value to its final one (the mean of its last `window`
    points); None for a run that gained less than min_gain. series = [(wall seconds, gold)]."""
    if len(series) < window:
        return None
    values = [value for _, value in series]
    first = values[0]
    final = sum(values[-window:]) / window
    if final - first < min_gain:
        return None
    for i in range(window, len(values) + 1):
        if sum(values[i - window : i]) / window >= first + fraction * (final - first):
            return series[i - 1][0] - start
    return None


def event_series(out: str) -> tuple[dict[str, list], float]:
    """tag -> [(wall seconds, value)] of a run's event files, and the wall time of its first event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(out, size_guidance={"scalars": 0})
    accumulator.Reload()
    series = {
        tag: [(event.wall_time, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
    return series, min(points[0][0] for points in series.values())


def summarize(args: Args, method: str, strength: float, seed: int, seconds: float) -> dict:
    """strength -> eval.py's numbers for one point, with its training wall time, time to 90% of its gold and first
    alarm (best-of-N: every N of the method, from the one sampling run)."""
    import torch

    spec = METHODS[method]
    out = run_dir(args, method, strength, seed)
    with open(os.path.join(out, "eval.json")) as f:
        results = json.load(f)
    if spec.kind == "bon":
        return {n: row_of(results[f"sft_bon{n}"], seconds) for n in spec.strengths}
    if spec.kind == "limit":
        return {beta: row_of(results[f"sft_opt_{spec.flags[0]}_b{beta:g}"], seconds) for beta in spec.strengths}
    row = row_of(results[method], seconds)
    if spec.kind in ("ppo", "grpo"):
        series, start = event_series(out)
        row["time_to_90"] = time_to_fraction(series["objective/gold"], start)
        run_args = torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=False)["args"]
        row["first_alarm"] = first_alarm(read_scalars(out), run_args) or None
    return {strength: row}  # (DPO measures gold at two evaluations a run: too coarse for a time to 90%)


def row_of(result: dict, seconds: float) -> dict:
    row = {key: result.get(key) for key in ("gold", "gold_se", "score", "kl", "valid_frac", "response_len")}
    return row | {"seconds": seconds, "time_to_90": None, "first_alarm": None, "warning": result.get("warning")}


def start(args: Args, point: tuple, threads: int) -> Optional[subprocess.Popen]:
    """Start one point's first command unless its summary.json exists; `advance` runs the rest."""
    out = run_dir(args, *point)
    if os.path.exists(os.path.join(out, "summary.json")):
        return None
    os.makedirs(out, exist_ok=True)
    print(f"start {'/'.join(map(str, point))}", flush=True)
    return launch(point, commands(args, *point), threads, open(os.path.join(out, "stdout.txt"), "w"), [])


def launch(point: tuple, queue: list, threads: int, log, seconds: list) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(queue[0], stdout=log, stderr=subprocess.STDOUT, env=env)
    process.point, process.queue, process.threads, process.log = point, queue[1:], threads, log
    process.seconds, process.t0 = seconds, time.time()
    return process


def advance(args: Args, process: subprocess.Popen) -> Optional[subprocess.Popen]:
    """After one command of a point: the next command's process, or None once the point is summarised."""
    out = run_dir(args, *process.point)
    if process.returncode != 0:
        raise SystemExit(
            f"{'/'.join(map(str, process.point))} failed (exit {process.returncode}); see {out}/stdout.txt"
        )
    seconds = process.seconds + [time.time() - process.t0]
    if process.queue:
        return launch(process.point, process.queue, process.threads, process.log, seconds)
    process.log.close()
    summary = summarize(args, *process.point, seconds[0])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for strength, row in summary.items():
        print(f"done {process.point[0]}/{strength}/{process.point[2]}: gold {row['gold']:.3f} kl {row['kl']:.2f}")
    return None


def points(args: Args, names: list[str]) -> list[tuple]:
    """(method, strength, seed) of every run: each strength with the first seed, the middle with the others
    (best-of-N: one sampling run for all its N, named by the largest)."""
    todo = []
    for name in names:
        spec = METHODS[name]
        if spec.kind in ("bon", "limit"):
            todo.append((name, max(spec.strengths), args.seeds[0]))
            continue
        todo += [(name, strength, args.seeds[0]) for strength in spec.strengths]
    for name in names:  # the extra seeds last: a run cut short has every method's line first
        spec = METHODS[name]
        if spec.kind not in ("bon", "limit") and spec.middle is not None:
            todo += [(name, spec.middle, seed) for seed in args.seeds[1:]]
    return todo


def load(args: Args, names: list[str]) -> dict[str, dict[float, list[dict]]]:
    """method -> strength -> the finished seeds' rows."""
    rows = {}
    for name, strength, seed in points(args, names):
        path = os.path.join(run_dir(args, name, strength, seed), "summary.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            summary = json.load(f)
        seconds = next(iter(summary.values()))["seconds"]
        summary = summarize(args, name, strength, seed, seconds)  # from the run's files, by the code as it is now
        for key, row in summary.items():
            rows.setdefault(name, {}).setdefault(float(key), []).append(row)
    return rows


def table(rows: dict[str, dict[float, list[dict]]], args: Args) -> str:
    lines = [
        f"Every point is eval.py on {args.eval_samples} held-out prompts (best-of-N: {args.bon_samples}); gold ± its "
        "standard error for one seed, ± half the range over seeds where there are two; KL to the SFT policy in nats "
        "(best-of-N: the bound log N - (N-1)/N plus the pick's own KL); time = training wall time (best-of-N: "
        "sampling; runs shared 2 cores two at a time); to 90% = from the first logged step until the rollouts' gold "
        "(5-iteration moving average) covers 90% of its gain (- = a gain under 0.1, or DPO: it measures gold twice "
        "a run); alarm = first collapse-alarm iteration (- = none).",
        "",
        "| method | strength | gold | RM score | KL (nats) | valid_frac | length | time (s) | to 90% (s) | alarm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_strength in rows.items():
        for strength, runs in by_strength.items():
            if len(runs) == 1:
                gold = f"{runs[0]['gold']:.3f} ± {runs[0]['gold_se']:.3f}"
            else:
                gold = spread([run["gold"] for run in runs])
            alarms = ", ".join(str(run["first_alarm"]) if run["first_alarm"] else "-" for run in runs)
            cells = [spread([run[key] for run in runs]) for key in ("score", "kl", "valid_frac", "response_len")]
            cells += [spread([run[key] for run in runs]) for key in ("seconds", "time_to_90")]
            lines.append(f"| {name} | {strength:g} | {gold} | {' | '.join(cells)} | {alarms} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict[float, list[dict]]], sft_gold: Optional[float], path: str) -> None:
    """Gold against sqrt(KL) (Gao et al. 2022's d: where the methods live, 0-5 nats, gets most of the width; the
    ticks read in nats), one line per method (points = strengths, seeds averaged; error bars = gold's SE), the two
    limits as lines beside them: gold's (what any method can reach at that KL) and the RM's (a perfect optimiser of
    this RM), their estimates past log M (flagged by eval.py) left out. Left: the methods on the learned RM; right:
    the runs trained on gold itself (the *_oracle methods), against gold's limit: the optimiser's own gap."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(12, 5.4), dpi=110, sharey=True)
    for name, by_strength in rows.items():
        kls, golds, errors = [], [], []
        for runs in by_strength.values():
            if any(run.get("warning") for run in runs):
                continue
            kls.append(sum(run["kl"] for run in runs) / len(runs))
            golds.append(sum(run["gold"] for run in runs) / len(runs))
            errors.append(max(run["gold_se"] for run in runs))
        order = sorted(range(len(kls)), key=lambda i: kls[i])
        x = [math.sqrt(max(kls[i], 0.0)) for i in order]
        y = [golds[i] for i in order]
        if name.startswith("limit"):
            style = dict(color="black", linewidth=2.2 if name == "limit_gold" else 1.4)
            style["linestyle"] = "-" if name == "limit_gold" else "--"
            label = "limit: tilted by gold" if name == "limit_gold" else "limit: tilted by the RM (a perfect optimiser)"
            for panel in panels if name == "limit_gold" else panels[:1]:
                panel.plot(x, y, label=label, zorder=1, **style)
            continue
        panel = panels[1] if "oracle" in name else panels[0]
        drawn = len(panel.containers)  # the method lines already on it: past the ten colours, dashed with squares
        color, fmt = f"C{drawn % 10}", "o-" if drawn < 10 else "s--"
        yerr = [errors[i] for i in order]
        shown = [max(gold, GOLD_FLOOR) for gold in y]
        panel.errorbar(x, shown, yerr=yerr, fmt=fmt, color=color, markersize=4, capsize=2, label=name, zorder=2)
        for x_point, gold in zip(x, y):
            if gold < GOLD_FLOOR:  # a collapsed run: drawn on the floor, its gold written above it
                panel.annotate(
                    f"{gold:.2f}",
                    (x_point, GOLD_FLOOR),
                    xytext=(0, 5),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                )
    ticks = [0, 0.5, 1, 2, 4, 8, 16]
    titles = ("Trained on the learned RM", "Trained on gold itself (--reward-fn task:gold_reward)")
    for panel, title in zip(panels, titles):
        if sft_gold is not None:
            panel.axhline(sft_gold, color="grey", linewidth=0.8, linestyle=":", label="sft")
        panel.set_xticks([math.sqrt(t) for t in ticks], [f"{t:g}" for t in ticks])
        panel.set_xlabel("KL to the SFT policy (nats per response; the axis is its square root)")
        panel.set_title(title, fontsize=10)
        panel.grid(alpha=0.3)
        panel.set_ylim(GOLD_FLOOR - 0.05, 1.0)
        panel.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    panels[0].set_ylabel("gold reward (held-out prompts)")
    figure.suptitle("Gold vs KL on the built-in task, equal episodes, beside the KL-optimal limits", fontsize=11)
    figure.tight_layout()
    figure.savefig(path)


def main(args: Args) -> None:
    for path, flag in ((args.sft_ckpt, "--sft-ckpt"), (args.rm_ckpt, "--rm-ckpt")):
        if not os.path.exists(path):
            raise SystemExit(f"{flag} {path}: not found (run `make demo` first, or pass the checkpoints)")
    names = args.only or list(METHODS)
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: unknown; choose from {' '.join(METHODS)}")
    todo = [] if args.table_only else points(args, names)
    threads = args.threads or max(1, (os.cpu_count() or 2) // args.jobs)
    running: list[subprocess.Popen] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            process = start(args, todo.pop(0), threads)
            if process is not None:
                running.append(process)
        time.sleep(1)
        for process in [process for process in running if process.poll() is not None]:
            running.remove(process)
            following = advance(args, process)
            if following is not None:
                running.append(following)

    rows = load(args, names)
    markdown = table(rows, args)
    with open(os.path.join(args.out_dir, "frontier.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    sft_gold = None
    bon = os.path.join(run_dir(args, "best_of_n", max(METHODS["best_of_n"].strengths), args.seeds[0]), "eval.json")
    if os.path.exists(bon):
        with open(bon) as f:
            sft_gold = json.load(f)["sft"]["gold"]
    plot(rows, sft_gold, os.path.join(args.out_dir, "frontier.png"))
    print(f"wrote {args.out_dir}/frontier.md and frontier.png")


if __name__ == "__main__":
    main(tyro.cli(Args))
