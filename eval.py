"""Evaluate policies (and a reward model) on held-out prompts, measured against the built-in task's gold reward.

Policy mode: each --policy samples one response per held-out prompt (fixed seed, temperature 1 by default); we report
the gold reward, the RM score, the KL to the reference, length, perplexity, EOS and grammatical fractions, distinct-2
and the gold-judged win rate against the reference answering the same prompts.

python eval.py                                                          # SFT vs PPO, defaults of the earlier stages
python eval.py --policy out/sft/ckpt.pt out/ppo/ckpt.pt --names sft ppo --ref out/sft/ckpt.pt --rm out/rm/ckpt.pt \
    --json out/results.json
python eval.py --pairs                                                  # reward-model mode: accuracy, calibration
"""

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import tyro

import common
import hf
from common import UserError
from data import build_task, calibration_error, encode_prefs, gold_reward, is_valid, pad_left, read_jsonl, responses_of
from model import logprobs_from_logits, response_forward, score_seqs, sequence_scores


@dataclass
class Args:
    # --- what to evaluate
    policy: list[str] = field(default_factory=lambda: ["out/sft/ckpt.pt", "out/ppo/ckpt.pt"])
    """policy checkpoints (.pt of any stage with an LM head)"""
    names: Optional[list[str]] = None
    """a name per policy for the table and JSON (None: sft, ppo, ... from the checkpoints' kinds)"""
    ref: str = "out/sft/ckpt.pt"
    """reference policy for kl and win_rate_vs_ref"""
    rm: Optional[str] = "out/rm/ckpt.pt"
    """reward model for `score` ("none": skip)"""
    pairs: bool = False
    """reward-model mode: accuracy, margin, calibration and Bayes ceiling of --rm on held-out preference pairs"""
    pairs_data: Optional[str] = None
    """preference JSONL for --pairs (None: the built-in task's held-out pairs)"""
    prompts: Optional[str] = None
    """prompt JSONL ({"prompt": str}) to sample on (None: the built-in task's held-out prompts; gold needs those)"""
    # --- sampling
    num_samples: int = 512
    """prompts sampled (one response each)"""
    temperature: float = 1.0
    """sampling temperature (kl and perplexity are measured at it)"""
    max_new_tokens: int = 64
    """longest response"""
    batch_size: int = 128
    """prompts per generation batch"""
    seed: int = 1234
    """sampling seed (the same for every policy)"""
    task_seed: int = 1337
    """seed of the built-in task"""
    task_dir: str = "out/data"
    """where the built-in task is cached"""
    device: str = "auto"
    """auto | cpu | cuda"""
    json: Optional[str] = None
    """write the numbers to this JSON file (merged into an existing one)"""
    show: int = 3
    """sample texts printed per policy"""


# -----------------------------------------------------------------------------
# metrics on samples: pure functions, imported by tests


def distinct_n(responses: list, n: int = 2) -> float:
    """Unique n-grams / all n-grams over all responses (token id lists); 0 when there are none."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def win_rate(gold: list, ref_gold: list) -> float:
    """Share of prompts where the policy's gold beats the reference's; ties count half."""
    return sum(1.0 if g > r else 0.5 if g == r else 0.0 for g, r in zip(gold, ref_gold)) / len(gold)


@torch.no_grad()
def sample_policy(model, tok, prompts: list, args: Args, device, ref=None, rm=None) -> dict:
    """One response per prompt; per-sample lists of everything the metrics need."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    out = {k: [] for k in ("prompt", "response", "tokens", "ended", "logprob_sum", "n", "kl", "score")}
    for i in range(0, len(prompts), args.batch_size):
        chunk = prompts[i : i + args.batch_size]
        query, qmask = (t.to(device) for t in pad_left([tok.encode(p) for p in chunk], tok.pad_id))
        max_new = min(args.max_new_tokens, model.config.block_size - query.size(1))
        response, rmask, logprobs = model.generate(
            query, qmask, max_new, tok.eos_id, tok.pad_id, temperature=args.temperature, generator=g
        )
        n = rmask.sum(1).long()
        ended = (response.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1) == tok.eos_id) & (n > 0)
        kl = torch.zeros(len(chunk), device=device)
        if ref is not None:  # k1 summed over the sequence, at the sampling temperature
            ref_logits = response_forward(ref, query, qmask, response, rmask, args.temperature)[0]
            ref_logprobs = logprobs_from_logits(ref_logits, response)
            kl = ((logprobs - ref_logprobs) * rmask).sum(1)
        score = torch.full((len(chunk),), float("nan"), device=device)
        if rm is not None:
            _, s = rm(torch.cat([query, response], 1), torch.cat([qmask, rmask], 1), logits=False)
            score = sequence_scores(s, torch.cat([qmask, rmask], 1))
        for b, p in enumerate(chunk):
            ids = response[b, : n[b]].tolist()
            body = ids[:-1] if ended[b] else ids
            out["prompt"].append(p)
            out["response"].append(tok.decode(body))
            out["tokens"].append(ids)
        out["ended"] += ended.tolist()
        out["logprob_sum"] += logprobs.sum(1).tolist()
        out["n"] += n.tolist()
        out["kl"] += kl.tolist()
        out["score"] += score.tolist()
    return out


def policy_metrics(s: dict, builtin: bool, ref_gold: Optional[list]) -> dict:
    """The table's numbers from sample_policy's lists (gold/valid_frac None off the built-in task)."""
    N = len(s["prompt"])
    gold = [gold_reward(p, r, e) for p, r, e in zip(s["prompt"], s["response"], s["ended"])] if builtin else None
    scores = [x for x in s["score"] if not math.isnan(x)]
    return {
        "gold": sum(gold) / N if builtin else None,
        "score": sum(scores) / len(scores) if scores else None,
        "kl": sum(s["kl"]) / N,
        "response_len": sum(s["n"]) / N,
        "perplexity": math.exp(-sum(s["logprob_sum"]) / max(1, sum(s["n"]))),
        "eos_frac": sum(s["ended"]) / N,
        "valid_frac": sum(is_valid(r, e) for r, e in zip(s["response"], s["ended"])) / N if builtin else None,
        "distinct_2": distinct_n(s["tokens"], 2),
        "win_rate_vs_ref": win_rate(gold, ref_gold) if builtin and ref_gold is not None else None,
    }, gold


def load_model(path: str, flag: str, device, want: str = "lm"):
    """A GPT from one of our checkpoints (its LM or its scalar head), eval mode, and the checkpoint."""
    if not path.endswith(".pt"):
        raise UserError(f"{flag} {path}: expected a .pt checkpoint of this repo")
    model, tok, ckpt = hf.load_init(
        path, lm_head=want == "lm", score_head=want == "score", flag=flag, kind=("sft", "ppo") if want == "lm" else "rm"
    )
    return model.to(device).eval(), tok, ckpt


def print_table(results: dict) -> None:
    cols = [
        "gold",
        "score",
        "kl",
        "response_len",
        "perplexity",
        "eos_frac",
        "valid_frac",
        "distinct_2",
        "win_rate_vs_ref",
        "seconds",
    ]
    rows = {k: v for k, v in results.items() if k != "rm"}
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    print("| policy | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


# -----------------------------------------------------------------------------
# main


def main(args: Args) -> dict:
    t0 = time.time()
    common.seed_everything(args.seed)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    builtin = args.prompts is None
    task = build_task(args.task_dir, args.task_seed) if builtin or (args.pairs and args.pairs_data is None) else None
    results = {}
    if args.pairs:
        results["rm"] = rm_metrics(args, task, device)
        print("| rm | " + " | ".join(f"{k} {v:.3f}" for k, v in results["rm"].items() if v is not None) + " |")
        return write_json(args.json, results)
    # 1. prompts, reference and reward model
    rows = read_jsonl(args.prompts or task["eval_prompts"], "prompts")
    prompts = [r["prompt"] for r in rows][: args.num_samples]
    names = args.names or [os.path.basename(os.path.dirname(p)) or f"policy{i}" for i, p in enumerate(args.policy)]
    if len(names) != len(args.policy):
        raise UserError(f"--names: {len(names)} names for {len(args.policy)} policies")
    ref, ref_tok, _ = load_model(args.ref, "--ref", device)
    rm = None
    if args.rm and args.rm != "none":
        rm, rm_tok, _ = load_model(args.rm, "--rm", device, want="score")
        if rm_tok.state() != ref_tok.state():
            raise UserError(f"--rm {args.rm}: its tokenizer differs from the reference's ({args.ref})")
    # 2. the reference answers the same prompts (win rate), then each policy
    ref_samples = sample_policy(ref, ref_tok, prompts, args, device)
    _, ref_gold = policy_metrics(ref_samples, builtin, None)
    for name, path in zip(names, args.policy):
        model, tok, ckpt = load_model(path, "--policy", device)
        if tok.state() != ref_tok.state():
            raise UserError(f"--policy {path}: its tokenizer differs from the reference's ({args.ref})")
        samples = sample_policy(model, tok, prompts, args, device, ref=ref, rm=rm)
        metrics, _ = policy_metrics(samples, builtin, ref_gold)
        results[name] = {**metrics, "seconds": round(ckpt.get("seconds", 0.0), 1)}
        for p, r, e in list(zip(samples["prompt"], samples["response"], samples["ended"]))[: args.show]:
            print(f"[{name}] {p}{r}{'' if e else ' [no EOS]'}")
    print_table(results)
    print(f"eval: {len(prompts)} prompts x {len(args.policy)} policies in {time.time() - t0:.0f}s")
    return write_json(args.json, results)


def write_json(path: Optional[str], results: dict) -> dict:
    """Merge results into the JSON file at path (atomically); returns results."""
    if path:
        merged = json.load(open(path)) if os.path.exists(path) else {}
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**merged, **results}, f, indent=2)
        os.replace(tmp, path)
    return results


@torch.no_grad()
def rm_metrics(args: Args, task: Optional[dict], device) -> dict:
    """Reward-model mode: accuracy (pair weights of K-wise records, ties 1/2), mean margin, ECE and, on the built-in
    task, the empirical Bayes ceiling (the gold reward's own accuracy on the drawn labels) on the same pairs."""
    if not args.rm or args.rm == "none":
        raise UserError("--pairs needs --rm")
    rm, tok, ckpt = load_model(args.rm, "--rm", device, want="score")
    rows = read_jsonl(args.pairs_data or task["pairs_eval"], "pairs")
    examples, _ = encode_prefs(tok, rows, rm.config.block_size)
    scores = score_seqs(rm, [s for ex in examples for s in ex[0]], tok.pad_id, args.batch_size, device, torch.float32)
    gaps, g_gaps, weights, start = [], [], [], 0
    for seqs, _, pairs, _, row in examples:
        gold = [gold_reward(row["prompt"], r, True) for r in responses_of(row)] if args.pairs_data is None else None
        for i, j, w in pairs:
            gaps.append(scores[start + i] - scores[start + j])
            g_gaps.append(gold[i] - gold[j] if gold else 0.0)
            weights.append(w)
        start += len(seqs)
    gaps, g_gaps, w = torch.tensor(gaps), torch.tensor(g_gaps), torch.tensor(weights, dtype=torch.double)
    acc = lambda g: ((w * ((g > 0).double() + 0.5 * (g == 0).double())).sum() / w.sum()).item()  # noqa: E731
    return {
        "accuracy": acc(gaps),
        "margin": ((w * gaps).sum() / w.sum()).item(),
        "ece": calibration_error(gaps),
        "bayes_ceiling": acc(g_gaps) if args.pairs_data is None else None,
        "pairs": len(gaps),
        "seconds": round(ckpt.get("seconds", 0.0), 1),
    }


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
