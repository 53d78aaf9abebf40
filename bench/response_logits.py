"""The actor's training step with the lm head on every position against the lm head on the response only
(`logits_to_keep`, what model.response_forward does), alternated in one process on the same weights and batch.

PPO needs logits only where response tokens are predicted (positions P-1 .. P+R-2); with real prompts much longer
than responses, the lm head over the prompt is a large share of the FLOPs and the (B, T, V) logits of the memory.
Last line: `response_logits: all_s=<median> response_only_s=<median> speedup=<all/response_only>`.

python bench/response_logits.py                    # GPT-2 small shape, prompt 256, response 64, batch 4, 2 threads
python bench/response_logits.py --prompt-len 16 --resp-len 48 --layers 8 --dim 512 --heads 4 --vocab 8192  # shape L
"""

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_throughput import Shape  # noqa: E402

from model import GPT, GPTConfig, logprobs_from_logits  # noqa: E402


@dataclass
class Args(Shape):
    """ppo_throughput's shape flags, at GPT-2 small with a long prompt by default."""

    layers: int = 12
    heads: int = 12
    dim: int = 768
    vocab: int = 50257
    prompt_len: int = 256
    resp_len: int = 64
    batch: int = 4
    reps: int = 3
    """timed steps per variant (alternated), after one warm-up each"""


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    P, R = args.prompt_len, args.resp_len
    model = GPT(
        GPTConfig(
            block_size=max(args.n_positions, P + R),
            vocab_size=args.vocab,
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.dim,
        )
    )
    x = torch.randint(0, args.vocab, (args.batch, P + R))
    mask, response = torch.ones_like(x), x[:, P:]

    def step(response_only: bool) -> float:
        t = time.perf_counter()
        if response_only:
            logits = model(x, mask, logits_to_keep=R + 1)[0][:, :-1]
        else:
            logits = model(x, mask)[0][:, P - 1 : -1]
        logprobs_from_logits(logits, response).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    step(True), step(False)
    times = {False: [], True: []}
    for _ in range(args.reps):
        for variant in (False, True):
            times[variant].append(step(variant))
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"[result] lm head on all {P + R} positions: {' '.join(f'{t:.2f}' for t in times[False])} s; on the "
        f"{R + 1} response positions: {' '.join(f'{t:.2f}' for t in times[True])} s"
    )
    print(f"response_logits: all_s={a:.3f} response_only_s={b:.3f} speedup={a / b:.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
