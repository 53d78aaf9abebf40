"""How much of the preference signal a frozen model's features hold: a linear probe, the yardstick of make real's RM.

Every response of make real's preference files is read by the frozen model; its last hidden state at the response's
last token (the end-of-turn token, where the RM reads its score) is standardised, and a Bradley-Terry logistic
regression (r = w . h, L2 penalty) is fitted to the training pairs (a ranking's every pair) by L-BFGS. Prints the
held-out accuracy for a random --fractions of the training pairs: if it climbs with the pairs, the RM lacks data
before it lacks features. --features mean averages the hidden states over the response instead, and --features words
reads no model: the response's token counts, a bag of words, the form of VADER's own lexicon.

python experiments/rm_probe.py                      # on out/real (after make real)
python experiments/rm_probe.py --penalty 0.1
python experiments/rm_probe.py --features words
"""

import json
import math
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import prompt_ids, ranking_pairs, response_ids, responses_of  # noqa: E402
from hf import HFCausalLM  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Args:
    model_dir: str = "out/smollm2"
    """the frozen model (a Hugging Face folder)"""
    train: str = "out/real/pairs.jsonl"
    """training preferences (pairs or rankings)"""
    eval: str = "out/real/pairs_eval.jsonl"
    """held-out preferences"""
    penalty: float = 0.01
    """L2 penalty on w (features standardised)"""
    fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    """fractions of the training pairs to fit on (each but 1.0 averaged over 5 draws)"""
    features: Literal["last", "mean", "words"] = "last"
    """last: the frozen model's last hidden state at the response's last token; mean: its mean over the response's
    tokens; words: the response's counts of the tokens seen twice or more in the training responses (no model)"""


def encode(tok, path: str) -> tuple[list[list[int]], list[int], list[tuple[int, int]]]:
    """Every response as prompt + response ids, where each response starts in them, and every (better, worse) pair as
    indices into them."""
    sequences, starts, pairs = [], [], []
    for line in open(path):
        row = json.loads(line)
        base = len(sequences)
        prompt = prompt_ids(tok, row["prompt"])
        for response in responses_of(row):
            sequences.append(prompt + response_ids(tok, row["prompt"], response))
            starts.append(len(prompt))
        pairs += [(base + better, base + worse) for better, worse, _ in ranking_pairs(row.get("ranking", [0, 1]))]
    return sequences, starts, pairs


@torch.no_grad()
def hidden_features(
    model: HFCausalLM, sequences: list[list[int]], starts: list[int], pool: str, batch_size: int = 16
) -> torch.Tensor:
    """(N, C) the final hidden state at each sequence's last token (pool "last"; right padding: causal attention
    never sees it), or its mean over the response's tokens (pool "mean")."""
    rows = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])
        hidden = model.hf.model(ids).last_hidden_state
        for i, s in enumerate(batch):
            rows.append(hidden[i, len(s) - 1] if pool == "last" else hidden[i, starts[start + i] : len(s)].mean(0))
    return torch.stack(rows)


def word_counts(sequences: list[list[int]], starts: list[int], vocabulary: dict[int, int]) -> torch.Tensor:
    """(N, len(vocabulary)) each response's count of every token in vocabulary (token -> column)."""
    counts = torch.zeros(len(sequences), len(vocabulary))
    for row, (sequence, start) in enumerate(zip(sequences, starts)):
        for token in sequence[start:]:
            if token in vocabulary:
                counts[row, vocabulary[token]] += 1
    return counts


def fit(features: torch.Tensor, pairs: list[tuple[int, int]], penalty: float) -> torch.Tensor:
    """w minimising mean softplus(-(h_better - h_worse) . w) + penalty |w|^2."""
    better, worse = (torch.tensor(index) for index in zip(*pairs))
    gaps = features[better] - features[worse]
    w = torch.zeros(features.size(1), requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=200)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.softplus(-gaps @ w).mean() + penalty * w.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return w.detach()


def accuracy(features: torch.Tensor, pairs: list[tuple[int, int]], w: torch.Tensor) -> float:
    better, worse = (torch.tensor(index) for index in zip(*pairs))
    return ((features[better] - features[worse]) @ w > 0).float().mean().item()


def main(args: Args) -> None:
    torch.manual_seed(0)
    tok = load_tokenizer(f"hf:{args.model_dir}")
    train_sequences, train_starts, train_pairs = encode(tok, args.train)
    eval_sequences, eval_starts, eval_pairs = encode(tok, args.eval)
    if args.features == "words":
        seen = Counter(token for s, start in zip(train_sequences, train_starts) for token in s[start:])
        vocabulary = {token: column for column, token in enumerate(t for t, count in seen.items() if count >= 2)}
        train_features = word_counts(train_sequences, train_starts, vocabulary)
        eval_features = word_counts(eval_sequences, eval_starts, vocabulary)
    else:
        model = HFCausalLM.from_pretrained(args.model_dir).eval()
        train_features = hidden_features(model, train_sequences, train_starts, args.features)
        eval_features = hidden_features(model, eval_sequences, eval_starts, args.features)
    mean, std = train_features.mean(0), train_features.std(0) + 1e-6
    train_features, eval_features = (train_features - mean) / std, (eval_features - mean) / std
    rng = random.Random(0)
    for fraction in args.fractions:
        draws = 1 if fraction >= 1 else 5
        scores = []
        for _ in range(draws):
            subset = [pair for pair in train_pairs if fraction >= 1 or rng.random() < fraction]
            scores.append(accuracy(eval_features, eval_pairs, fit(train_features, subset, args.penalty)))
        held_out = sum(scores) / draws
        standard_error = math.sqrt(held_out * (1 - held_out) / len(eval_pairs))  # binomial, pairs as independent
        print(
            f"rm_probe ({args.features}, {train_features.size(1)} features): {fraction:.2f} of the pairs "
            f"(~{round(fraction * len(train_pairs))}): held-out accuracy {held_out:.3f} ± {standard_error:.3f} "
            f"on {len(eval_pairs)} pairs"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
