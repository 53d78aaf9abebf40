"""Iterated RLHF with on-policy labels (InstructGPT's and Llama 2's rounds): the reward model is what caps RL
(docs/design.md §5d), and a reward model trained on the policy's own samples is a better one where the policy now lives.

Round 0 is the start: the SFT policy and its reward model(s). Each round r >= 1 then runs, in order:
  1. RL (--rl-stage ppo: train_ppo.py, grpo: train_grpo.py) at the round's beta (--rl-betas), a fresh run from round
     r-1's policy (round 1: the SFT policy) against round r-1's reward model(s), the reference still the SFT policy
     (--ref-ckpt); PPO's critic starts from that reward model, and the optimizers, LR schedule, reward moments and KL
     controller start fresh;
  2. pairs on training prompts: two responses a prompt from the new policy (where the policy went), and
     --tilted-frac of them from the SFT policy tilted by round r-1's reward model(s) at each --tilt-betas (where the
     KL-optimal limit lives, which a policy trained against the next reward model heads for; eval.py --kl-optimal
     samples and scores them, and prints that reward model's limit on those prompts);
  3. labelled by the annotator: the built-in task's simulated human (task.annotate: Bradley-Terry on the gold reward,
     as noisy as the offline labels), a judge of yours (--labeler module:function, fn(prompt, response_a,
     response_b) -> P(a is better), from which the label is drawn), or people (--labeler human); identical pairs and
     pairs with a response that never ended are dropped and counted;
  4. the next reward model(s) trained from the SFT checkpoint on every label so far (the offline pairs and every
     round's), all evaluated on the same held-out pairs;
  5. the round's policy evaluated on the held-out prompts.
Every stage is the stage script itself, run as a subprocess; every round's pairs, reward models, policy and
evaluation are kept under --out-dir/round<r>/, and a step whose output is there is not run again, so the command
resumes where it stopped (a stage stopped by a signal resumes from its last checkpoint). The arguments are kept in
--out-dir/args.json: a rerun that changes one is refused (more --rounds excepted), --overwrite starts over.
--out-dir/results.json holds a row per round, round<r>: gold, kl and valid_frac (each with _se), labels (the
distinct labelled pairs the reward model(s) this round's policy optimised were trained on), new_labels (those the
round collected, for the next ones) and episodes (RL episodes so far).

python train_online.py                                   # after make demo: 3 rounds on the built-in task
python train_online.py --labeler myjudge:prefer          # your judge
python train_online.py --labeler human                   # people: each round stops at round<r>/to_label.jsonl
"""

import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Optional

import torch

import checkpoints
import cli
import common
import hf
from common import UserError, print0, write_atomic, write_jsonl
from data import encode_prompts, prompt_text, read_jsonl
from generate import sample
from model import aggregate_rm_scores
from task import annotate, build_task

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    out_dir: str = "out/online"
    """where every round's pairs, reward models, policy and evaluation go (round<r>/), args.json and results.json"""
    sft_ckpt: str = "out/sft/ckpt.pt"
    """round 0's policy, every round's reference and every reward model's init"""
    rm_ckpt: list[str] = field(default_factory=lambda: ["out/rm/ckpt.pt"])
    """round 0's reward model(s): one, or the members of an ensemble"""
    rounds: int = 3
    """rounds of RL, sampling, labelling and reward-model training (a rerun may raise it)"""
    pairs_per_round: int = 6000
    """pairs sampled a round, before the drops: on-policy (two responses a training prompt) and --tilted-frac of them
    from the tilted SFT policy"""
    tilted_frac: float = 0.5
    """the share of a round's pairs drawn where the KL-optimal limit lives rather than where the policy went: the
    SFT policy's samples tilted by the round's reward model(s), pi ∝ sft exp(score / beta), at each --tilt-betas"""
    tilt_betas: list[float] = field(default_factory=lambda: [0.5, 0.3, 0.2])
    """the betas of the tilted pairs (one pair per beta from each prompt's --tilt-samples; on make demo's RM 1.4,
    2.2 and 2.9 nats from the SFT policy)"""
    tilt_samples: int = 16
    """SFT samples a prompt the tilted pairs are drawn from (their KL is at most log of it)"""
    ensemble: int = 1
    """reward models trained a round, seeds 1..K (an ensemble when K > 1, combined by --rm-agg)"""
    rm_agg: Literal["mean", "min", "uwo"] = "mean"
    """how RL and the evaluation combine an ensemble's scores (--rm-agg of the stages)"""
    rm_uwo_coef: float = 1.0
    """--rm-agg uwo: the weight of the members' variance"""
    labeler: str = "task"
    """task (the built-in task's simulated human) | human (export each round's pairs, import the labels) |
    module:function or path/to/file.py:function, fn(prompt, response_a, response_b) -> P(a is better)"""
    rl_stage: Literal["ppo", "grpo"] = "ppo"
    """each round's RL: train_ppo.py (PPO-max) or train_grpo.py (the critic-free family)"""
    rl_betas: list[float] = field(default_factory=lambda: [0.3, 0.3, 0.1])
    """each round's --kl-coef of its RL stage, the last one repeating for later rounds. On the built-in task, 3
    rounds: gold 0.64 / 0.72 / 0.87 at 2.2 / 2.9 / 8.5 nats (docs/results.md); β 0.15 throughout went to 3.4 nats
    in round 1 already"""
    rl_flags: str = ""
    """more flags of every round's RL stage (its defaults otherwise: 12,800 episodes). A value that starts with --
    goes after an = sign: --rl-flags="--total-episodes 6400" (likewise --rm-flags and --eval-flags)"""
    rm_flags: str = ""
    """train_rm.py flags of every round's reward models (its defaults otherwise: one epoch over all labels so far)"""
    eval_flags: str = ""
    """eval.py flags of every round's evaluation (its defaults otherwise: 512 held-out prompts, one sample each)"""
    data: Optional[str] = None
    """the offline preference JSONL the first reward models were trained on (None: the built-in task's pairs)"""
    eval_data: Optional[str] = None
    """held-out preference JSONL every round's reward models are evaluated on (None: the built-in task's, or with
    --data the last 5% of it, left out of every round's training pairs)"""
    prompts: Optional[str] = None
    """training prompts JSONL the pairs are sampled on (None: the built-in task's RL prompts)"""
    task_seed: int = 1337
    """seed of the built-in task"""
    task_dir: str = "out/data"
    """where the built-in task is cached"""
    seed: int = 1
    """seed of the sampling and the simulated labels (round r samples with seed * 1000 + r)"""
    temperature: float = 1.0
    """sampling temperature of the pairs"""
    max_new_tokens: int = 64
    """longest sampled response"""
    device: str = "auto"
    """auto | cpu | cuda, for the sampling here (the stages take theirs from their flags)"""
    overwrite: bool = False
    """start over in an --out-dir that holds a run (its rounds, args.json and results.json are removed)"""


# -----------------------------------------------------------------------------
# the stages as subprocesses, and signals


class Child:
    """The stage running now. It runs in a session of its own, so a terminal's Ctrl-C reaches this driver alone,
    which passes SIGINT or SIGTERM on to the stage once (the stage saves its step and exits 128 + the signal), waits
    for it and exits the same way; a second signal is passed on too (the stage then stops at once)."""

    process: Optional[subprocess.Popen] = None
    signum = 0

    @classmethod
    def install(cls) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, cls.forward)

    @classmethod
    def forward(cls, signum: int, frame) -> None:
        cls.signum = cls.signum or signum
        if cls.process is not None and cls.process.poll() is None:
            cls.process.send_signal(signum)
        else:
            sys.exit(128 + signum)


def stage_done(out_dir: str) -> bool:
    return os.path.exists(out_dir + ".done")


def run_stage(script: str, flags: list[str], extra: str, log: str, out_dir: Optional[str] = None) -> None:
    """One stage script as a subprocess with this interpreter; its output goes to log; a failure ends the driver
    with the log's last lines. out_dir: the stage's --out-dir, marked done (<out_dir>.done) once it finishes; a stage
    stopped before (a checkpoint there, no mark) continues with --resume, a fresh one starts with --overwrite."""
    resume = out_dir is not None and os.path.exists(os.path.join(out_dir, "ckpt.pt"))
    start = (["--resume"] if resume else ["--overwrite"]) if out_dir is not None else []
    command = [sys.executable, os.path.join(ROOT, script), *flags, *start, *shlex.split(extra)]
    started = time.time()
    with open(log, "a" if resume else "w") as out:
        Child.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        returncode = Child.process.wait()
        Child.process = None
    if Child.signum:
        name = signal.Signals(Child.signum).name
        print0(f"{name}: {script} stopped with its last step saved; run the same command to continue")
        sys.exit(128 + Child.signum)
    if returncode != 0:
        tail = open(log).read().strip().splitlines()[-5:]
        if resume and "already at step" in tail[-1]:  # it had finished before its mark was written
            returncode = 0
        else:
            raise UserError(f"{script} failed (see {log}): " + " / ".join(tail))
    if out_dir is not None:
        write_atomic(out_dir + ".done", "")
    print0(f"  {script} done in {time.time() - started:.0f}s ({log})")


# -----------------------------------------------------------------------------
# pairs and labels


def load_labeler(spec: str) -> Callable:
    """--labeler -> fn(rng, prompt, a, b) -> True when a is preferred: the task's simulated human, or a user's judge
    fn(prompt, a, b) -> P(a is better), from which the label is drawn."""
    if spec == "task":
        return annotate
    judge = common.load_reward_fn(spec, flag="--labeler")

    def draw(rng: random.Random, prompt: str, a: str, b: str) -> bool:
        return rng.random() < float(judge(prompt, a, b))

    return draw


@torch.no_grad()
def sample_pairs(policy_path: str, prompts: list, args: Args, seed: int) -> tuple[list[dict], dict]:
    """Two responses per prompt from the policy (its tempered distribution, batches of 128 prompts): the pairs
    {"prompt", "response_a", "response_b"} to label, and the counts of those dropped (identical responses, a
    response that never ended: the reward model appends EOS to every response it reads)."""
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu")
    device = device if args.device == "auto" else torch.device(args.device)
    policy, tok, _ = hf.load_init(policy_path, flag="--sft-ckpt", kind=checkpoints.POLICY_KINDS)
    policy = policy.to(device).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    pairs, dropped = [], {"identical": 0, "not_ended": 0}
    for start in range(0, len(prompts), 128):
        chunk = prompts[start : start + 128]
        doubled = [prompt for prompt in chunk for _ in range(2)]  # a pair's two responses in one batch
        query, query_mask = (t.to(device) for t in encode_prompts(tok, doubled))
        samples = sample(policy, tok, query, query_mask, args.max_new_tokens, args.temperature, generator=generator)
        ended = samples.ended.tolist()
        for i, prompt in enumerate(chunk):
            a, b = samples.texts[2 * i], samples.texts[2 * i + 1]
            if not (ended[2 * i] and ended[2 * i + 1]):
                dropped["not_ended"] += 1
            elif a == b:
                dropped["identical"] += 1
            else:
                pair = {"prompt": prompt, "response_a": a, "response_b": b}
                if isinstance(prompt, list):  # a conversation: the judge reads it rendered
                    pair["prompt_text"] = prompt_text(tok, prompt)
                pairs.append(pair)
    return pairs, dropped


def tilted_pairs(cache: str, prompts: list, rms: list[str], args: Args, seed: int) -> tuple[list[dict], dict]:
    """Pairs where the limit lives, from eval.py --kl-optimal's sample cache (SFT samples scored by every RM in rms):
    for each prompt and --tilt-betas beta, two ended responses drawn without replacement with weights
    softmax(score / beta). Returns (pairs, dropped: {"identical", "not_ended"} counts)."""
    stored = torch.load(cache, weights_only=False)
    samples = stored["samples"]
    members = torch.tensor([stored["rm_scores"][checkpoints.file_sha256(path)] for path in rms])
    scores = aggregate_rm_scores(members, args.rm_agg, args.rm_uwo_coef)
    by_prompt = {}  # eval.py's prompt_index -> the prompt's samples
    for i, index in enumerate(samples["prompt_index"]):
        by_prompt.setdefault(index, []).append(i)
    kept = prompts  # the prompts eval.py answered: all of them, unless some were too long for the context
    if len(by_prompt) < len(prompts):
        if not all(isinstance(prompt, str) for prompt in prompts):  # a conversation's rendering is not known here
            raise UserError(f"{cache}: eval.py skipped prompts too long for the context; shorten them in --prompts")
        remaining = iter(prompts)  # in order, as eval.py kept them
        kept = [next(p for p in remaining if p == samples["prompt"][rows[0]]) for _, rows in sorted(by_prompt.items())]
    generator = torch.Generator().manual_seed(seed)
    pairs, dropped = [], {"identical": 0, "not_ended": 0}
    for index, rows in sorted(by_prompt.items()):
        prompt = kept[index]
        ended = [i for i in rows if samples["ended"][i]]
        for beta in args.tilt_betas:
            if len(ended) < 2:
                dropped["not_ended"] += 1
                continue
            weights = torch.softmax(scores[ended].double() / beta, 0)
            a, b = (ended[k] for k in torch.multinomial(weights, 2, generator=generator).tolist())
            if samples["response"][a] == samples["response"][b]:
                dropped["identical"] += 1
                continue
            pair = {"prompt": prompt, "response_a": samples["response"][a], "response_b": samples["response"][b]}
            if isinstance(prompt, list):  # a conversation: the judge reads it rendered
                pair["prompt_text"] = samples["prompt"][a]
            pairs.append(pair)
    return pairs, dropped


def round_pairs(args: Args, prompts: list, r: int, folder: str, policy: str, rms: list, eval_base: list):
    """Round r's --pairs-per-round pairs to label and the counts dropped: 1 - --tilted-frac of them from the round's
    policy (sample_pairs), the rest from SFT samples tilted by rms (eval.py --kl-optimal into folder/tilt.pt, then
    tilted_pairs)."""
    seed = args.seed * 1000 + r
    tilted = round(args.pairs_per_round * args.tilted_frac)
    tilt_prompts = math.ceil(tilted / len(args.tilt_betas))  # a pair per beta from each prompt
    count = args.pairs_per_round - tilted + tilt_prompts
    start = (r - 1) * count % len(prompts)
    round_prompts = [prompts[(start + i) % len(prompts)] for i in range(count)]
    to_label, dropped = sample_pairs(policy, round_prompts[tilt_prompts:], args, seed)
    if not tilted:
        return to_label, dropped
    prompts_path, cache = os.path.join(folder, "tilt_prompts.jsonl"), os.path.join(folder, "tilt.pt")
    write_jsonl(prompts_path, [{"prompt": prompt} for prompt in round_prompts[:tilt_prompts]])
    flags = eval_base + ["--policy", args.sft_ckpt, "--names", "sft", "--rm", *rms, "--prompts", prompts_path]
    flags += ["--num-samples", str(tilt_prompts), "--seeds", str(args.tilt_samples), "--seed", str(seed)]
    flags += ["--temperature", str(args.temperature), "--max-new-tokens", str(args.max_new_tokens)]
    flags += ["--kl-optimal", *map(str, args.tilt_betas), "--sample-cache", cache]
    run_stage("eval.py", flags + ["--json", os.path.join(folder, "tilt_limit.json")], "", f"{folder}/tilt.log")
    more, more_dropped = tilted_pairs(cache, round_prompts[:tilt_prompts], rms, args, seed)
    return more + to_label, {key: dropped[key] + more_dropped[key] for key in dropped}


def read_human_labels(path: str, to_label: list[dict]) -> list[bool]:
    """labels.jsonl, the exported pairs with "a_wins" added by people, checked line by line against to_label.jsonl
    (the same pairs in the same order, every one labelled): a_wins per pair, or a one-line UserError path:line."""
    wins = []
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    for (lineno, line), exported in zip(lines, to_label):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: bad JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("a_wins"), bool):
            raise UserError(f'{path}:{lineno}: needs "a_wins": true or false')
        if any(row.get(key) != exported[key] for key in ("prompt", "response_a", "response_b")):
            raise UserError(f"{path}:{lineno}: not the pair on line {lineno} of to_label.jsonl (keep its order)")
        wins.append(row["a_wins"])
    if len(lines) != len(to_label):
        raise UserError(f"{path}: {len(lines)} labelled pairs for {len(to_label)} in to_label.jsonl: label them all")
    return wins


def label_pairs(to_label: list[dict], args: Args, labels_path: str, seed: int) -> Optional[list[dict]]:
    """The labelled pairs {"prompt", "chosen", "rejected"}: drawn from the annotator, or (--labeler human) read from
    labels_path (None until that file exists)."""
    if args.labeler == "human":
        if not os.path.exists(labels_path):
            return None
        wins = read_human_labels(labels_path, to_label)
    else:
        labeler = load_labeler(args.labeler)
        rng = random.Random(seed)
        wins = []
        for row in to_label:  # a conversation's judge reads it rendered
            wins.append(labeler(rng, row.get("prompt_text", row["prompt"]), row["response_a"], row["response_b"]))
    labelled = []
    for row, a_wins in zip(to_label, wins):
        a, b = row["response_a"], row["response_b"]
        if isinstance(row["prompt"], list):  # a conversation's replies are assistant turns
            a, b = [{"role": "assistant", "content": a}], [{"role": "assistant", "content": b}]
        labelled.append({"prompt": row["prompt"], "chosen": a if a_wins else b, "rejected": b if a_wins else a})
    return labelled


# -----------------------------------------------------------------------------
# the run's arguments, rounds and results


def saved_args(args: Args) -> Args:
    """The arguments a run in --out-dir keeps (args.json, written on its first start): a rerun takes the saved value
    of every flag it does not give and refuses a given one that differs (more --rounds excepted, or a flag an older
    args.json lacks); --overwrite starts over."""
    path = os.path.join(args.out_dir, "args.json")
    fresh = args.overwrite or not os.path.exists(path)
    if fresh:
        check_args(args)
    if args.overwrite and os.path.isdir(args.out_dir):
        shutil.rmtree(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    current = {name: value for name, value in asdict(args).items() if name != "overwrite"}
    if fresh:
        write_atomic(path, json.dumps(current, indent=2))
        return args
    saved = json.load(open(path))
    missing = [name for name in current if name not in saved]
    if missing:  # an older train_online.py's run: today's defaults need not be what it ran with
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in missing)
        raise UserError(f"{path}: written by an older train_online.py, without {flags} (--overwrite starts over)")
    given = getattr(args, "given", None)  # None from Python: a field at its default counts as not given
    defaults = Args()
    for name in current:
        if name in saved and (name not in given if given is not None else current[name] == getattr(defaults, name)):
            current[name] = saved[name]
    changed = [
        f"--{name.replace('_', '-')} {saved[name]} -> {current[name]}"
        for name in current
        if name in saved and current[name] != saved[name] and not (name == "rounds" and current[name] > saved[name])
    ]
    if changed:
        raise UserError(f"{path}: {', '.join(changed)}: this run was started otherwise (--overwrite starts over)")
    check_args(Args(**current))
    write_atomic(path, json.dumps(current, indent=2))
    return Args(**current)


def eval_row(eval_json: str, name: str, labels: int, new_labels: int, episodes: int) -> dict:
    """A results.json row from a round's evaluation."""
    entry = json.load(open(eval_json))[name]
    row = {key: entry.get(key) for key in ("gold", "gold_se", "kl", "kl_se", "valid_frac", "valid_frac_se")}
    return row | {"score": entry.get("score"), "labels": labels, "new_labels": new_labels, "episodes": episodes}


def held_out_pairs(args: Args, task: Optional[dict], offline: list[dict]) -> tuple[str, list[dict]]:
    """(the held-out pairs every round's reward models are evaluated on, the offline pairs they train on): the task's
    held-out file, --eval-data, or with --data alone its last 5% (written to --out-dir), left out of training."""
    if args.eval_data is not None:
        return args.eval_data, offline
    if args.data is None:
        return task["pairs_eval"], offline
    n_eval = max(1, len(offline) // 20)
    path = os.path.join(args.out_dir, "eval_pairs.jsonl")
    if not os.path.exists(path):
        write_jsonl(path, offline[-n_eval:])
    return path, offline[:-n_eval]


def check_args(args: Args) -> None:
    """Settings no run can mean, on the flags the run goes on with (a rerun's merged with args.json): one line."""
    if args.rounds < 1 or args.pairs_per_round < 2 or args.ensemble < 1:
        raise UserError("--rounds, --ensemble >= 1 and --pairs-per-round >= 2")
    if not 0 <= args.tilted_frac <= 1 or args.tilt_samples < 2 or not args.tilt_betas or min(args.tilt_betas) <= 0:
        raise UserError("--tilted-frac in [0, 1], --tilt-samples >= 2 and --tilt-betas > 0")
    if not args.rl_betas or "--kl-coef" in args.rl_flags:
        raise UserError("each round's --kl-coef is --rl-betas (one value or more), not in --rl-flags")


def main(args: Args) -> None:
    started = time.time()
    args = saved_args(args)  # checked (check_args) before it is written
    Child.install()
    task = build_task(args.task_dir, args.task_seed) if args.data is None or args.prompts is None else None
    offline = read_jsonl(args.data or task["pairs"], "pairs", "--data")
    eval_pairs, offline = held_out_pairs(args, task, offline)
    prompts = [row["prompt"] for row in read_jsonl(args.prompts or task["prompts"], "prompts", "--prompts")]
    rm_base = ["--task-dir", args.task_dir, "--task-seed", str(args.task_seed), "--init", args.sft_ckpt]
    rm_base += ["--eval-data", eval_pairs]
    results_path = os.path.join(args.out_dir, "results.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    policy, rms = args.sft_ckpt, list(args.rm_ckpt)
    eval_base = ["--ref", args.sft_ckpt, "--task-dir", args.task_dir, "--rm-agg", args.rm_agg]
    eval_base += ["--rm-uwo-coef", str(args.rm_uwo_coef)]
    if "round0" not in results:
        json_path = os.path.join(args.out_dir, "round0_eval.json")
        flags = eval_base + ["--policy", policy, "--names", "round0", "--rm", *rms, "--json", json_path]
        run_stage("eval.py", flags, args.eval_flags, os.path.join(args.out_dir, "round0_eval.log"))
        results["round0"] = eval_row(json_path, "round0", len(offline), 0, 0)
        write_atomic(results_path, json.dumps(results, indent=2))
    labelled_so_far = list(offline)  # what the reward models of the last round trained on
    episodes = 0
    for r in range(1, args.rounds + 1):
        folder = os.path.join(args.out_dir, f"round{r}")
        os.makedirs(folder, exist_ok=True)
        print0(f"round {r}: policy {policy} | reward model(s) {' '.join(rms)}")
        # 1. RL from the last policy, against the last reward model(s), the SFT policy as the reference
        rl_dir = os.path.join(folder, args.rl_stage)
        if not stage_done(rl_dir):
            flags = ["--sft-ckpt", policy, "--ref-ckpt", args.sft_ckpt, "--rm-ckpt", *rms, "--rm-agg", args.rm_agg]
            flags += ["--rm-uwo-coef", str(args.rm_uwo_coef), "--task-dir", args.task_dir, "--out-dir", rl_dir]
            flags += ["--kl-coef", str(args.rl_betas[min(r, len(args.rl_betas)) - 1])]
            run_stage(f"train_{args.rl_stage}.py", flags, args.rl_flags, rl_dir + ".log", rl_dir)
        rl_ckpt = os.path.join(rl_dir, "ckpt.pt")
        rl_run = torch.load(rl_ckpt, map_location="cpu", weights_only=False, mmap=True)
        episodes += rl_run["data_state"].get("episodes", rl_run["step"] * rl_run["args"]["rollout_batch_size"])
        # 2.-3. on-policy pairs, labelled
        pairs_path = os.path.join(folder, "pairs.jsonl")
        if not os.path.exists(pairs_path):
            export = os.path.join(folder, "to_label.jsonl")
            if os.path.exists(export):  # exported before (people are labelling them): the same pairs
                to_label = [json.loads(line) for line in open(export)]
                dropped = json.load(open(os.path.join(folder, "dropped.json")))
            else:
                to_label, dropped = round_pairs(args, prompts, r, folder, rl_ckpt, rms, eval_base)
                write_atomic(os.path.join(folder, "dropped.json"), json.dumps(dropped))
                write_jsonl(export, to_label)
            labels_path = os.path.join(folder, "labels.jsonl")
            labelled = label_pairs(to_label, args, labels_path, seed=args.seed * 1000 + r)
            if labelled is None:
                print0(
                    f'round {r}: {len(to_label)} pairs to label in {folder}/to_label.jsonl: add "a_wins": true or '
                    f"false to each line, save it as {labels_path}, and run this command again"
                )
                return
            write_jsonl(pairs_path, labelled)
            stats = {"sampled": len(to_label) + sum(dropped.values()), "kept": len(labelled), "dropped": dropped}
            write_atomic(os.path.join(folder, "pairs_stats.json"), json.dumps(stats, indent=2))
            print0(f"round {r}: {len(labelled)} of {stats['sampled']} pairs labelled ({dropped} dropped)")
        new_pairs = [json.loads(line) for line in open(pairs_path)]  # written above (maybe none kept)
        # 4. the next reward model(s), from the SFT checkpoint on every label so far
        all_pairs = os.path.join(folder, "pairs_all.jsonl")
        if not os.path.exists(all_pairs):
            write_jsonl(all_pairs, labelled_so_far + new_pairs)
        members = []
        for k in range(1, args.ensemble + 1):
            out = os.path.join(folder, f"rm{k}")
            if not stage_done(out):
                flags = rm_base + ["--data", all_pairs, "--seed", str(k), "--out-dir", out]
                run_stage("train_rm.py", flags, args.rm_flags, out + ".log", out)
            members.append(os.path.join(out, "ckpt.pt"))
        # 5. the round's policy, on the held-out prompts (scored by the reward model(s) it was trained against)
        json_path = os.path.join(folder, "eval.json")
        if not os.path.exists(json_path):
            flags = eval_base + ["--policy", rl_ckpt, "--names", f"round{r}", "--rm", *rms, "--json", json_path]
            run_stage("eval.py", flags, args.eval_flags, os.path.join(folder, "eval.log"))
        results[f"round{r}"] = eval_row(json_path, f"round{r}", len(labelled_so_far), len(new_pairs), episodes)
        write_atomic(results_path, json.dumps(results, indent=2))
        labelled_so_far += new_pairs
        policy, rms = rl_ckpt, members
    print0(f"online done in {time.time() - started:.0f}s: {results_path}")
    for name, row in results.items():
        gold = "-" if row["gold"] is None else f"{row['gold']:.3f} ± {row['gold_se']:.3f}"
        print0(f"  {name}: gold {gold} | kl {row['kl']:.2f} | labels {row['labels']} | episodes {row['episodes']}")


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
