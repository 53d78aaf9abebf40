"""The multi-turn task (make multiturn): SFT on the weak player's episodes of the guessing game (guess.py: a secret in
1..20, higher/lower feedback, 4 guesses), then PPO-max, GRPO and RLOO on the game's own environment (guess:Game, the
task's: reward 1 on the secret), then eval.py's episodes of every policy on the held-out secrets, each beside the
optimum (binary search: success 3/4 in 3.45 turns), the weak player (0.4986) and the tilted optimum at its KL.

Budget: every RL run stops at --episodes episodes sampled (train/episodes), two at a time (one thread each), then one
eval.py over the four policies: --seeds episodes on each of the 640 held-out rows (every secret 32 times). Writes
<out_dir>/results.json, rows sft, ppo, grpo and rloo with eval.py's episode columns (success, turns, kl,
episode/invalid, tokens_per_turn, ... each with _se; success_optimum, success_tilted, ...; train_seconds, each
stage's wall time), plus episodes; prints the table. Finished runs are kept: run it again to resume.

python experiments/multiturn.py                          # make multiturn: 8 minutes on 2 cores shared with other work
python experiments/multiturn.py --tiny --out-dir /tmp/m  # the chain with tiny sizes (the test)
"""

import json
import os
import sys
import time
from dataclasses import dataclass

import tyro
from ablation import read_scalars
from rlvr import run, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--task", "guess"]
# the game's sizes (guess.BLOCK_SIZE, MAX_NEW_TOKENS, TURNS): a turn is two digits and the EOS, 4 turns an episode
TURNS = ["--max-new-tokens", "3", "--max-turns", "4"]
# a model of 2 layers of width 64 (0.12 M parameters), 6,000 steps of 32 episodes (about 10 epochs) at lr 6e-3: it
# plays as the weak player does (success 0.512 +- 0.015 against 0.4986); 800 steps of 64 left it at 0.410, 3,000 of 32
# at 0.469, the loss still falling towards the weak player's entropy (0.908 nats a model token)
SFT_MODEL = ["--n-layer", "2", "--n-embd", "64", "--block-size", "24"]
SFT_FLAGS = ["--batch-size", "32", "--micro-batch-size", "32", "--max-steps", "6000", "--lr", "6e-3"]
SFT_FLAGS += ["--eval-every", "0", "--num-samples", "64"]
# every RL run: the environment's reward alone (no RM, no ptx: the task's text is the weak player's), a batch of 64
# episodes; GRPO and RLOO in groups of 8 episodes of one secret
RL_COMMON = ["--rm-ckpt", "none", "--ptx-coef", "0", "--rollout-batch-size", "64", "--log-every", "10"]
RUNS = {
    "ppo": ("train_ppo.py", ["--lr", "5e-4", "--kl-coef", "0.05"]),
    "grpo": ("train_grpo.py", ["--estimator", "grpo", "--group-size", "8", "--lr", "5e-4", "--kl-coef", "0.04"]),
    "rloo": ("train_grpo.py", ["--estimator", "rloo", "--group-size", "8", "--lr", "5e-4", "--kl-coef", "0.05"]),
}
COLUMNS = ["success", "turns", "kl", "episode/invalid", "tokens_per_turn"]


@dataclass
class Args:
    out_dir: str = "out/multiturn"
    """where the runs and results.json go"""
    task_dir: str = "out/data"
    """the built-in tasks' cache folder"""
    episodes: int = 25600
    """--total-episodes of every RL run (episodes sampled): at 12,800 the three ended at 0.58-0.59"""
    seeds: int = 2
    """episodes per held-out row in the evaluation (640 rows)"""
    jobs: int = 2
    """RL runs at a time (one thread each)"""
    tiny: bool = False
    """tiny sizes: the chain runs in about a minute and its numbers mean nothing"""


def sft_command(args: Args, out: str) -> list:
    command = [sys.executable, os.path.join(ROOT, "train_sft.py"), *TASK, "--task-dir", args.task_dir]
    command += ["--out-dir", out, "--overwrite", "--max-new-tokens", "3", *SFT_MODEL]
    return command + (
        ["--n-layer", "1", "--n-embd", "32", "--max-steps", "10", "--num-samples", "16"] if args.tiny else SFT_FLAGS
    )


def rl_command(args: Args, name: str, sft: str) -> list:
    script, flags = RUNS[name]
    command = [sys.executable, os.path.join(ROOT, script), *TASK, "--task-dir", args.task_dir, "--sft-ckpt", sft]
    command += ["--out-dir", os.path.join(args.out_dir, name), "--overwrite", *TURNS, *RL_COMMON, *flags]
    command += ["--total-episodes", str(32 if args.tiny else args.episodes)]
    if args.tiny:
        command += ["--rollout-batch-size", "16", "--micro-batch-size", "8", "--warmup-steps", "1"]
        command += ["--critic-warmup-steps", "1"] if script == "train_ppo.py" else []
    return command


def cell(row: dict, column: str) -> str:
    value, se = row.get(column), row.get(f"{column}_se")
    return "-" if value is None else f"{value:.3f}" + ("" if se is None else f" ± {se:.3f}")


def main(args: Args) -> None:
    started = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    # OMP_NUM_THREADS in the environment wins at every step (the tests' one thread a process)
    given = os.environ.get("OMP_NUM_THREADS")
    env = os.environ | {"OMP_NUM_THREADS": given or "1"}
    # 1. SFT on the weak player's episodes, at OMP_NUM_THREADS too: on 2 cores busy with other work this model ran 8
    # times slower at 2 threads (4 steps a second) than at 1 (32)
    sft = os.path.join(args.out_dir, "sft", "ckpt.pt")
    if not os.path.exists(sft):
        os.makedirs(os.path.dirname(sft), exist_ok=True)
        log_path = os.path.join(os.path.dirname(sft), "stdout.txt")
        wait([(run(sft_command(args, os.path.dirname(sft)), log_path, env), log_path)])
    # 2. the RL runs, --jobs at a time
    todo = [name for name in RUNS if not os.path.exists(os.path.join(args.out_dir, name, "ckpt.pt"))]
    while todo:
        batch, todo = todo[: args.jobs], todo[args.jobs :]
        processes = []
        for name in batch:
            os.makedirs(os.path.join(args.out_dir, name), exist_ok=True)
            log_path = os.path.join(args.out_dir, name, "stdout.txt")
            processes.append((run(rl_command(args, name, sft), log_path, env), log_path))
        wait(processes)
    # 3. every policy's episodes on the held-out secrets, against the optimum, one eval.py
    results_path = os.path.join(args.out_dir, "results.json")
    names = ["sft", *RUNS]
    command = [sys.executable, os.path.join(ROOT, "eval.py"), *TASK, "--task-dir", args.task_dir, "--ref", sft]
    command += ["--policy", sft, *(os.path.join(args.out_dir, name, "ckpt.pt") for name in RUNS), "--names", *names]
    command += ["--rm", "none", "--num-samples", "64" if args.tiny else "640", "--seeds", str(args.seeds), *TURNS]
    if os.path.exists(results_path):
        os.remove(results_path)
    log_path = os.path.join(args.out_dir, "eval.txt")
    wait([(run(command + ["--json", results_path], log_path, env | {"OMP_NUM_THREADS": given or "2"}), log_path)])
    # 4. the runs' own numbers beside eval's
    results = json.load(open(results_path))
    for name in RUNS:
        scalars = read_scalars(os.path.join(args.out_dir, name))
        results[name]["episodes"] = scalars["train/episodes"][-1][1]
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    print("| policy | " + " | ".join(COLUMNS) + " | tilted optimum at its kl | episodes | seconds |")
    print("|---|" + "---|" * (len(COLUMNS) + 3))
    for name in names:
        row = results[name]
        cells = [cell(row, column) for column in COLUMNS] + [f"{row['success_tilted']:.3f}"]
        cells += [str(int(row.get("episodes", 0))), f"{row['train_seconds']:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    optimum = results["sft"]
    print(
        f"| optimum | {optimum['success_optimum']:.3f} | {optimum['turns_optimum']:.3f} | - | 0 | "
        f"{optimum['tokens_per_turn_optimum']:.3f} | - | - | - |"
    )
    print(f"multiturn: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
