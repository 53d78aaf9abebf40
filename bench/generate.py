"""Generation throughput: our KV-cache `GPT.generate` against transformers' `generate` on the same weights.

A random GPT of the given shape is exported with `export_hf` and loaded as a GPT2LMHeadModel, so both sample from
the same distribution: fp32, temperature 1, no top-k/top-p, the same random prompts, responses of exactly --resp-len
tokens (EOS outside the vocabulary for ours, `eos_token_id=None` for transformers, as bench/
hf_generate_bench.py does). The two are interleaved call by call after one warm-up call each; medians of --reps calls.
Last line: `generate: ours_tok_per_s=<x> hf_tok_per_s=<y> ratio=<x/y>` (new tokens per second, batch * resp_len).

python bench/generate.py                                   # shape S on 2 threads
python bench/generate.py --dim 512 --layers 8 --vocab 8192 # shape L
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_throughput import Shape  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Args(Shape):
    reps: int = 5
    """timed calls per side"""


def main(args: Args) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B, P, R, V = args.batch, args.prompt_len, args.resp_len, args.vocab
    ours = GPT(
        GPTConfig(block_size=args.n_positions, vocab_size=V, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    ).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.export_hf(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = hf.generation_config.pad_token_id = None  # never stop early
    gcfg = GenerationConfig(max_new_tokens=R, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True)
    prompts = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(args.seed))
    mask = torch.ones_like(prompts)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():  # same weights: the same next-token distribution at the prompt's end
        assert (ours(prompts)[0][:, -1] - hf(prompts).logits[:, -1]).abs().max() <= 1e-4

    def run_ours():
        out = ours.generate(prompts, mask, R, eos_id=V, pad_id=V + 1, temperature=1.0, generator=gen)[0]
        assert out.shape == (B, R)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(input_ids=prompts, attention_mask=mask, generation_config=gcfg)
        assert out.shape == (B, P + R)

    print(
        f"[setup] torch={torch.__version__} threads={torch.get_num_threads()} params "
        f"{sum(p.numel() for p in ours.parameters()) / 1e6:.2f} M layers={args.layers} dim={args.dim} vocab={V} "
        f"B={B} P={P} R={R}",
        flush=True,
    )
    times = {"ours": [], "hf": []}
    for rep in range(args.reps + 1):
        for name, fn in (("ours", run_ours), ("hf", run_hf)):
            t = time.perf_counter()
            fn()
            if rep > 0:
                times[name].append(time.perf_counter() - t)
    tps = {}
    for name, ts in times.items():
        tps[name] = B * R / statistics.median(ts)
        print(f"[result] {name}: call seconds {' '.join(f'{x:.3f}' for x in ts)} -> {tps[name]:.0f} new tok/s")
    ratio = tps["ours"] / tps["hf"]
    print(f"generate: ours_tok_per_s={tps['ours']:.1f} hf_tok_per_s={tps['hf']:.1f} ratio={ratio:.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
