#!/usr/bin/env python3
"""Reference: raw HF `model.generate` sampling throughput for a tiny random GPT-2 on CPU.

Same shapes as trl_ppo_bench.py. Two modes are timed on the same prompts:
  plain     generate(do_sample=True, top_k=0, top_p=1, use_cache=True), fixed length (no EOS)
  trl_like  the same plus return_dict_in_generate=True, output_scores=True, which is exactly how TRL's
            PPO rollout calls generate (it keeps the [B, R, vocab] processed logits to get logprobs)

Example:
    python hf_generate_bench.py --prompt-len 16 --resp-len 48 --batch 64 --threads 2

Final line: `hf_generate_bench: plain_tok_per_s=<x> trl_like_tok_per_s=<y> peak_rss_mb=<z>`
(tokens = batch * resp_len new tokens per call; median over --reps calls per mode after one warm-up round;
the two modes are interleaved call by call).
"""

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--resp-len", type=int, default=48)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="timed calls per mode (after one warm-up call)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def main():
    args = parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    B, P, R, V = args.batch, args.prompt_len, args.resp_len, args.vocab

    config = GPT2Config(
        vocab_size=V,
        n_positions=args.n_positions,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # as TRL does with stop_token=None: never stop early
    model.generation_config.pad_token_id = None
    prompts = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(args.seed))
    attn = torch.ones_like(prompts)
    base = dict(max_new_tokens=R, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0, use_cache=True)
    modes = {
        "plain": GenerationConfig(**base),
        "trl_like": GenerationConfig(**base, return_dict_in_generate=True, output_scores=True),
    }
    print(
        f"[setup] transformers={transformers.__version__} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"attn={model.config._attn_implementation} params={sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"layers={args.layers} heads={args.heads} dim={args.dim} vocab={V} B={B} P={P} R={R}",
        flush=True,
    )

    # Modes are interleaved call by call so that drift (allocator warm-up, clocks, noise) hits both alike.
    times = {name: [] for name in modes}
    for rep in range(args.reps + 1):
        for name, gcfg in modes.items():
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=prompts, attention_mask=attn, generation_config=gcfg)
            dt = time.perf_counter() - t
            seqs = out.sequences if hasattr(out, "sequences") else out
            assert seqs.shape == (B, P + R), seqs.shape  # fixed length: no early stop
            if rep > 0:  # the first round is warm-up
                times[name].append(dt)
    results = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        results[name] = B * R / med
        print(
            f"[result] {name}: call seconds {' '.join(f'{x:.3f}' for x in ts)} | median {med:.3f}s "
            f"-> {results[name]:.0f} new tok/s",
            flush=True,
        )

    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        f"hf_generate_bench: plain_tok_per_s={results['plain']:.1f} trl_like_tok_per_s={results['trl_like']:.1f} "
        f"peak_rss_mb={peak_rss_mb:.0f}"
    )


if __name__ == "__main__":
    main()
