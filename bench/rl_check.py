"""The critic-free stage on a GPU (`bash bench/gpu_check.sh rl`), or on the CPU at the same sizes as a stand-in: a
small SFT and RM on the built-in task, then train_grpo.py as GRPO, GSPO, CISPO, on-policy distillation, VinePPO (its
continuations) and DAPO's dynamic sampling in the stages' own dtype (bf16 on a GPU) with --compile auto (compiled
training forward and decode, CUDA graphs, on a GPU); GRPO in fp32, whose sampler and training forward must agree
to 1e-3 in log-prob (rollout.check_logprobs raises past it, and this check reads the bound again from the events);
and a kill-and-resume (SIGKILL once a checkpoint of step >= 2 exists, then --resume) whose final model must equal an
uninterrupted run's tensor for tensor. Each run has its own timeout inside --limit; a table of what passed, with
its seconds, largest log-prob difference and tokens/s, comes last, whatever failed.

python bench/rl_check.py --device cuda                          # what gpu_check.sh rl runs
OMP_NUM_THREADS=2 python bench/rl_check.py --device cpu         # the same sizes on the CPU

Last line: `rl_check: <passed>/<runs> passed in <seconds> s`; exit 1 when any run failed.
"""

import glob
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rollout import FP32_LOGPROB_BOUND  # noqa: E402  check_logprobs' own bound in fp32


@dataclass
class Args:
    device: str = "cuda"
    """cuda | cpu (the stand-in: the same sizes, compile off as --compile auto leaves it there)"""
    out_dir: str = "/tmp/gpu_check/rl"
    """the runs' folders, replaced at start"""
    task_dir: str = "/tmp/gpu_check/data"
    """the built-in task's files (built there on first use)"""
    limit: int = 240
    """seconds for the whole check: each run's timeout is its own share or what is left, the smaller"""
    share_scale: float = 1.0
    """each run's share of --limit times this (a CPU stand-in, slower than the GPU the shares were set for)"""


# the SFT and RM the RL runs start from: only a policy that ends some responses, and a reward that tells them apart
SFT_FLAGS = (
    "--n-layer 2 --n-head 2 --n-embd 64 --max-steps 30 --batch-size 32 --micro-batch-size 32 --warmup-steps 5 "
    "--eval-every 30 --num-samples 16 --eval-samples 16"
)
RM_FLAGS = "--max-steps 10 --batch-size 16 --eval-every 10 --eval-pairs 64 --probe-size 16 --calib-size 64"
# every RL run: 3 iterations of 16 responses, 2 minibatches of 2 micro-batches, a save every iteration
RL_FLAGS = (
    "--max-steps 3 --rollout-batch-size 16 --num-minibatches 2 --micro-batch-size 4 --ppo-epochs 1 "
    "--max-new-tokens 24 --warmup-steps 1 --log-every 1 --sample-every 3 --save-every 1"
)
# name, train_grpo.py flags, seconds: the critic-free family's distinct code paths (the losses, the teacher, the
# continuations, the extra sampling rounds). GSPO's, CISPO's and dynamic sampling's forwards are GRPO's (compile wraps
# the forwards, not the loss): they run eager, so the section's time goes to the compiles that differ
RL_RUNS = [
    ("grpo", "--estimator grpo", 30),
    ("gspo", "--estimator grpo --policy-loss gspo --cliprange 3e-4 --cliprange-high 4e-4 --compile off", 20),
    ("cispo", "--estimator grpo --policy-loss cispo --cliprange 1 --cliprange-high 0.28 --compile off", 20),
    ("distill", "--estimator distill --rm-ckpt none --ref-ckpt {teacher}", 25),
    ("vineppo", "--estimator vineppo --vine-k 2", 35),
    ("dynamic", "--estimator grpo --dynamic-sampling --max-sample-rounds 3 --compile off", 20),
    ("fp32", "--estimator grpo --dtype float32", 30),
]
KILL_AT_STEP = 2


@dataclass
class Row:
    name: str
    passed: bool
    seconds: float
    figures: str


def run_stage(command: str, limit: float) -> tuple[int, str]:
    """(returncode, stdout and stderr) of a command line; 124 when it ran past limit seconds."""
    try:
        done = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return 124, f"out of time ({limit:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def last_lines(output: str) -> str:
    """A failed run's last two lines on one line, for the table."""
    return " / ".join(output.strip().splitlines()[-2:])[-200:]


def read_scalars(out_dir: str) -> dict[str, list[float]]:
    """Every scalar tag of a run's event files: tag -> values in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "events.out.tfevents.*"))):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(event.value for event in events.Scalars(tag))
    return scalars


def run_figures(name: str, out_dir: str, fp32: bool) -> tuple[bool, str]:
    """(passed, figures) of a finished RL run from its events: every scalar finite, the largest sampler/trainer
    log-prob difference (held to 1e-3 in fp32), the median tokens/s after the first iteration (the compile), and
    what only some estimators log."""
    scalars = read_scalars(out_dir)
    bad = sorted(tag for tag, values in scalars.items() if not all(math.isfinite(v) for v in values))
    logprob_err = max(scalars.get("rollout/logprob_err", [math.nan]))
    tokens_per_sec = statistics.median(scalars.get("perf/tokens_per_sec", [math.nan, math.nan])[1:] or [math.nan])
    figures = f"logprob_err max {logprob_err:.1e} | {tokens_per_sec:,.0f} tok/s"
    if name == "vineppo":
        figures += f" | vine_responses {sum(scalars.get('rollout/vine_responses', [0])):.0f}"
    if name == "dynamic":
        figures += f" | sample_rounds max {max(scalars.get('rollout/sample_rounds', [0])):.0f}"
    passed = not bad and math.isfinite(logprob_err) and not (fp32 and logprob_err > FP32_LOGPROB_BOUND)
    if bad:
        figures += f" | not finite: {', '.join(bad[:3])}"
    if fp32 and logprob_err > FP32_LOGPROB_BOUND:
        figures += f" | above the fp32 bound {FP32_LOGPROB_BOUND:.0e}"
    return passed, figures


def last_value(out_dir: str, tag: str) -> tuple[bool, str]:
    """(passed, figures) of a finished SFT or RM run: its last value of tag, which must be finite."""
    value = read_scalars(out_dir).get(tag, [math.nan])[-1]
    return math.isfinite(value), f"{tag} {value:.3f}"


def compare_checkpoints(full_path: str, resumed_path: str) -> tuple[bool, str]:
    """(bit-equal, figures): the two checkpoints' steps, updates and model tensors (torch.equal, the max |diff|
    where one differs; tests/test_grpo.py's kill-and-resume holds CPU runs to 1e-5)."""
    full, resumed = (torch.load(path, map_location="cpu", weights_only=False) for path in (full_path, resumed_path))
    same_steps = full["step"] == resumed["step"] and full["data_state"] == resumed["data_state"]
    differing = [key for key in full["model"] if not torch.equal(full["model"][key], resumed["model"][key])]
    largest = max(((full["model"][k] - resumed["model"][k]).abs().max().item() for k in differing), default=0.0)
    figures = f"step {resumed['step']}, {len(full['model']) - len(differing)}/{len(full['model'])} tensors equal"
    if differing:
        figures += f", max |diff| {largest:.1e} in {differing[0]}"
    if not same_steps:
        figures += f", data_state {resumed['data_state']} against {full['data_state']}"
    return same_steps and not differing, figures


def kill_and_resume(command: str, out_dir: str, limit: float) -> tuple[bool, str]:
    """Start command, SIGKILL it once its checkpoint reaches KILL_AT_STEP (saving is every step), then --resume."""
    deadline = time.time() + limit
    checkpoint = os.path.join(out_dir, "ckpt.pt")
    process = subprocess.Popen(shlex.split(command), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_at = None
    while process.poll() is None and time.time() < deadline:
        try:  # the file appears atomically, never half-written
            killed_at = torch.load(checkpoint, map_location="cpu", weights_only=False)["step"]
        except (FileNotFoundError, EOFError, RuntimeError):
            killed_at = None
        if killed_at is not None and killed_at >= KILL_AT_STEP:
            break
        time.sleep(0.05)
    if process.poll() is not None:
        return False, f"the run ended before it could be killed: {process.stderr.read().decode()[-300:]}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    if killed_at is None or killed_at < KILL_AT_STEP:
        return False, f"out of time before step {KILL_AT_STEP}"
    returncode, output = run_stage(f"{command} --resume", deadline - time.time())
    if returncode != 0:
        return False, f"--resume exited {returncode}: {last_lines(output)}"
    if f"resumed from {checkpoint} at step {killed_at}" not in output:
        return False, f"--resume did not say it resumed from step {killed_at}: {last_lines(output)}"
    return True, f"killed at step {killed_at}"


def resumed_against_uninterrupted(command: str, out: str, left) -> tuple[bool, str]:
    """(passed, figures): command killed and resumed in out/killed, then run whole in out/uninterrupted, their final
    checkpoints compared; left(share) gives a part's timeout."""
    passed, figures = kill_and_resume(f"{command} --out-dir {out}/killed", f"{out}/killed", left(45))
    if not passed:
        return False, figures
    returncode, output = run_stage(f"{command} --out-dir {out}/uninterrupted", left(30))
    if returncode != 0:
        return False, f"the uninterrupted run exited {returncode}: {last_lines(output)}"
    equal, compared = compare_checkpoints(f"{out}/uninterrupted/ckpt.pt", f"{out}/killed/ckpt.pt")
    return equal, f"{figures}; {compared}"


def print_table(rows: list[Row]) -> None:
    width = max(len(row.name) for row in rows)
    print(f"\nrl_check: {'run':{width}s}  result  seconds  figures")
    for row in rows:
        result = "pass" if row.passed else "FAIL"
        print(f"rl_check: {row.name:{width}s}  {result:6s}  {row.seconds:7.1f}  {row.figures}")


def main(args: Args) -> None:
    start = time.time()
    out, py = args.out_dir, sys.executable
    common = f"--device {args.device} --task-dir {args.task_dir}"
    rows = []

    def left(share: float) -> float:
        return max(1.0, min(share * args.share_scale, args.limit - (time.time() - start)))

    def stage(name: str, command: str, share: float, check) -> bool:
        began = time.time()
        returncode, output = run_stage(command, left(share))
        passed, figures = check() if returncode == 0 else (False, f"exit {returncode}: {last_lines(output)}")
        rows.append(Row(name, passed, time.time() - began, figures))
        print(f"rl_check: [{name}] {'pass' if passed else 'FAIL'} {figures}", flush=True)
        return passed

    subprocess.run(["rm", "-rf", out])
    # 1. the starting points
    sft, rm = f"{out}/sft/ckpt.pt", f"{out}/rm/ckpt.pt"
    built = stage(
        "sft",
        f"{py} train_sft.py {common} --out-dir {out}/sft {SFT_FLAGS}",
        40,
        lambda: last_value(f"{out}/sft", "val/valid_frac"),
    )
    built = built and stage(
        "rm",
        f"{py} train_rm.py {common} --out-dir {out}/rm --init {sft} {RM_FLAGS}",
        25,
        lambda: last_value(f"{out}/rm", "val/accuracy"),
    )
    # 2. the critic-free family; the distillation's teacher is the GRPO run's policy
    base = f"{py} train_grpo.py {common} --sft-ckpt {sft} --rm-ckpt {rm} {RL_FLAGS}"
    for name, flags, share in RL_RUNS if built else []:
        flags = flags.format(teacher=f"{out}/grpo/ckpt.pt")
        command = f"{base} {flags} --out-dir {out}/{name}"
        stage(name, command, share, lambda name=name: run_figures(name, f"{out}/{name}", "float32" in flags))
    # 3. kill and resume: the GRPO run's flags twice, one SIGKILLed mid-run and resumed
    if built:
        began = time.time()
        passed, figures = resumed_against_uninterrupted(f"{base} --estimator grpo --seed 1", out, left)
        rows.append(Row("kill-resume", passed, time.time() - began, figures))
    print_table(rows)
    passed = sum(row.passed for row in rows)
    total = len(rows) if built else len(rows) + len(RL_RUNS) + 1
    print(f"rl_check: {passed}/{total} passed in {time.time() - start:.0f} s on {args.device}")
    if passed < total:
        sys.exit(1)


if __name__ == "__main__":
    main(tyro.cli(Args))
