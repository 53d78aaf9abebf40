"""Decode throughput, eager against compiled (docs/design.md §7 "GPU throughput"): `generate` of a randomly initialised
model (model.GPT, or a Hugging Face Llama behind hf.HFCausalLM: --arch llama) with the eager decode (a KV cache growing
a token a step) and with compiled=True (static KV caches and the one-token step compiled; mode="reduce-overhead", CUDA
graphs, on a GPU). Random prompts of --prompt-len tokens, responses of exactly --resp-len tokens (the EOS id lies
outside the vocabulary), temperature 1.

The step time is (a call of --resp-len tokens - a call of 1 token) / (--resp-len - 1): the prefill taken out. Each
step reads every weight once and the KV cache so far, so the achieved bandwidth is (weight bytes as stored + the
mean KV bytes read) / step time, against the card's HBM peak (a table of known GPUs; none on CPU). --weights fp32
keeps fp32 weights under bf16 autocast, as PPO's rollout decodes its fp32 actor (each linear casts its weight first:
8 bytes of traffic per parameter, counted here as the 4 stored); --weights bf16 stores them in bf16 (the bytes a
decode must read at least). Compiled frames and graphs are counted over the compiled calls (dynamo's counters).

python bench/decode.py                                            # a tiny GPT on 2 CPU threads
python bench/decode.py --device cuda --dtype bfloat16 --weights bf16 --arch llama --layers 16 --heads 32 \
    --kv-heads 8 --dim 2048 --intermediate 8192 --vocab 128256 --n-positions 1024 --batch 64 --prompt-len 128 \
    --resp-len 256                                                # Llama-3.2-1B's shape on a GPU

Last line: `decode: eager_tok_per_s=<x> compiled_tok_per_s=<y> speedup=<y/x> compiled_hbm_frac=<achieved/peak or
nan>`.

--vs-hf instead times our eager decode against transformers' own `model.generate` (sampling, KV cache) on the same
weights (the GPT exported with export_hf and loaded as a GPT2LMHeadModel, or the Llama that hf.HFCausalLM wraps),
alternating call by call after one warm-up call each, medians of --reps calls, fp32, temperature 1, no top-k/top-p,
exactly --resp-len tokens. Last line: `decode_vs_hf: ours_tok_per_s=<x> hf_tok_per_s=<y> ratio=<x/y>` (the peer row
of bench/compare_trl.sh).

python bench/decode.py --vs-hf                                    # shape S on 2 CPU threads
python bench/decode.py --vs-hf --model-dir out/smollm2 --batch 16 --prompt-len 64 --resp-len 48   # SmolLM2-135M

--greedy-check instead decodes greedily (temperature 0) from the same model and prompts with compiled=False and
compiled=True and holds the token ids equal; otherwise it prints the first divergence (the earliest step, then the
lowest row) with both ids and the eager forward's logit margin between them there, and exits 1. A divergence whose
margin is at most --tie-margin is a rounding tie (a random model's logits are close to flat: bf16 flips such ties),
counted, not failed. Last line: `greedy: rows_equal=<n>/<B> ties=<n> first_divergence=<row, step or none>`.

python bench/decode.py --greedy-check                             # a tiny GPT on the CPU, inductor's backend
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_throughput import Shape, build_model  # noqa: E402

import parallel  # noqa: E402
from generate import generate  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HBM_PEAK_BYTES = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10G": 0.6e12, "4090": 1.0e12}


@dataclass
class Args(Shape):
    device: str = "cpu"
    """cpu | cuda"""
    dtype: str = "float32"
    """float32 | bfloat16 (autocast)"""
    weights: Literal["fp32", "bf16"] = "fp32"
    """how the weights are stored: fp32 (under --dtype bfloat16 autocast casts them per op, as PPO's rollout) or bf16
    (matrices in bf16, norms and biases fp32: parallel.store_low_precision, the stages' sampler copy)"""
    reps: int = 3
    """timed calls per mode and length, after one warm-up call (the compile)"""
    vs_hf: bool = False
    """time our eager decode against transformers' model.generate on the same weights instead (fp32)"""
    model_dir: str | None = None
    """a Hugging Face folder (make smollm2: out/smollm2) whose real weights replace the random model; --vocab is its
    vocabulary"""
    greedy_check: bool = False
    """compare the compiled decode's greedy token ids with the eager decode's instead (exit 1 on a divergence)"""
    tie_margin: float = 0.0
    """--greedy-check: a divergence where the eager forward's logits of the two ids lie within this is a rounding
    tie, not a failure (0: every divergence fails)"""


def hbm_peak(device: torch.device) -> float:
    """The card's HBM bandwidth in bytes/s from the table, nan when unknown (and on CPU)."""
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in HBM_PEAK_BYTES.items() if key in name), float("nan"))


def against_transformers(args: Args, model, prompts, mask, generator) -> None:
    """Our eager decode against transformers' model.generate on the same weights, alternating call by call."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    B, P, R, V = args.batch, args.prompt_len, args.resp_len, args.vocab
    if args.arch == "gpt":
        with tempfile.TemporaryDirectory() as folder:
            model.export_hf(folder)
            peer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        peer = model.hf
    peer.generation_config.eos_token_id = peer.generation_config.pad_token_id = None  # never stop early
    config = GenerationConfig(max_new_tokens=R, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True)
    with torch.no_grad():  # same weights: the same next-token distribution at the prompt's end
        assert (model(prompts)[0][:, -1] - peer(prompts).logits[:, -1]).abs().max() <= 1e-4

    def ours():
        assert generate(model, prompts, mask, R, V, V + 1, generator=generator)[0].shape == (B, R)

    def theirs():
        with torch.no_grad():
            out = peer.generate(input_ids=prompts, attention_mask=mask, generation_config=config)
        assert out.shape == (B, P + R)

    times = {"ours": [], "hf": []}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, call in (("ours", ours), ("hf", theirs)):
            start = time.perf_counter()
            call()
            if rep > 0:
                times[name].append(time.perf_counter() - start)
    rates = {}
    for name, seconds in times.items():
        rates[name] = B * R / statistics.median(seconds)
        print(f"[result] {name}: call seconds {' '.join(f'{x:.3f}' for x in seconds)} -> {rates[name]:.0f} tok/s")
    ratio = rates["ours"] / rates["hf"]
    print(f"decode_vs_hf: ours_tok_per_s={rates['ours']:.1f} hf_tok_per_s={rates['hf']:.1f} ratio={ratio:.2f}")


def first_divergence(eager: torch.Tensor, compiled: torch.Tensor) -> Optional[tuple[int, int]]:
    """(row, step) of the first differing token id of two (B, R) decodes: the earliest step, then the lowest row;
    None when they are equal."""
    differs = (eager != compiled).cpu()
    if not differs.any():
        return None
    step = int(differs.any(0).nonzero()[0])
    row = int(differs[:, step].nonzero()[0])
    return row, step


def logit_margin(model, prompt: torch.Tensor, response: torch.Tensor, eager_id: int, compiled_id: int) -> float:
    """The eager forward's logit of eager_id minus compiled_id after prompt (P,) and response (S,): how close to a
    tie the two decodes' choice was."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, response])[None])[0][0, -1].float()  # (V,)
    return (logits[eager_id] - logits[compiled_id]).item()


def greedy_check(args: Args, model, prompts, mask, dtype: torch.dtype) -> int:
    """Greedy decodes, eager then compiled, from the same model and prompts: 0 when every row is equal or ends at a
    tie within --tie-margin, else 1; prints the first divergence, every failing one, and the rows' agreement."""
    B, R, V = args.batch, args.resp_len, args.vocab
    autocast = torch.autocast(prompts.device.type, dtype=dtype, enabled=dtype != torch.float32)
    tokens = {}
    with autocast:
        for compiled in (False, True):
            tokens[compiled] = generate(model, prompts, mask, R, V, V + 1, temperature=0.0, compiled=compiled)[0]
    eager, fast = tokens[False], tokens[True]
    first = first_divergence(eager, fast)
    ties, failures = 0, 0
    for row in range(B):
        divergence = first_divergence(eager[row : row + 1], fast[row : row + 1])
        if divergence is None:
            continue
        step = divergence[1]
        eager_id, compiled_id = eager[row, step].item(), fast[row, step].item()
        with autocast:
            margin = logit_margin(model, prompts[row], eager[row, :step], eager_id, compiled_id)
        tie = abs(margin) <= args.tie_margin
        ties += tie
        failures += not tie
        if (row, step) == first or not tie:
            window = slice(max(0, step - 3), step + 3)
            verdict = "a tie" if tie else "FAILS"
            print(
                f"[result] row {row} step {step}: eager id {eager_id}, compiled id {compiled_id}, eager's logit "
                f"margin {margin:.2e} ({verdict} at --tie-margin {args.tie_margin:g}); from step {window.start}: "
                f"eager {eager[row, window].tolist()}, compiled {fast[row, window].tolist()}",
                flush=True,
            )
    where = "none" if first is None else f"row {first[0]} step {first[1]}"
    print(f"greedy: rows_equal={B - ties - failures}/{B} ties={ties} failures={failures} first_divergence={where}")
    return 1 if failures else 0


def main(args: Args) -> None:
    from torch._dynamo.utils import counters

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.model_dir is None:
        model = build_model(args, device).eval().requires_grad_(False)
    else:  # a real model behind the same adapter the hf: stages use
        from hf import HFCausalLM

        model = HFCausalLM.from_pretrained(args.model_dir).to(device).eval().requires_grad_(False)
        args.arch, args.vocab = "llama", model.config.vocab_size
    B, P, R, V = args.batch, args.prompt_len, args.resp_len, args.vocab
    if args.weights == "bf16":  # the stages' sampler copy: matrices in bf16, norms and biases fp32
        parallel.store_low_precision(model, torch.bfloat16)
    prompts = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(args.seed)).to(device)
    mask = torch.ones_like(prompts)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.vs_hf:
        return against_transformers(args, model, prompts, mask, generator)
    if args.greedy_check:
        sys.exit(greedy_check(args, model, prompts, mask, dtype))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(compiled: bool, new_tokens: int) -> float:
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            tokens = generate(model, prompts, mask, new_tokens, V, V + 1, generator=generator, compiled=compiled)[0]
        sync()
        assert tokens.shape == (B, new_tokens), "every response must be exactly the requested length"
        return time.perf_counter() - start

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_heads = args.kv_heads or args.heads if args.arch == "llama" else args.heads
    kv_elem = 2 if dtype == torch.bfloat16 or args.weights == "bf16" else 4
    mean_keys = P + R / 2  # keys read per step, averaged over the steps
    kv_bytes = 2 * args.layers * B * mean_keys * kv_heads * (args.dim // args.heads) * kv_elem
    peak = hbm_peak(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"[setup] torch={torch.__version__} device={device} ({card}) threads={torch.get_num_threads()} "
        f"arch={args.arch} params {params / 1e6:.1f} M "
        f"weights {args.weights} autocast {args.dtype} | B={B} P={P} R={R} | bytes/step: weights "
        f"{weight_bytes / 1e9:.3f} GB + KV {kv_bytes / 1e9:.3f} GB | HBM peak {peak / 1e12:.2f} TB/s",
        flush=True,
    )
    results = {}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        counters.clear()
        timed(compiled, R)  # warm-up: the compile, the CUDA graph recording
        timed(compiled, 1)
        full = statistics.median(timed(compiled, R) for _ in range(args.reps))
        prefill = statistics.median(timed(compiled, 1) for _ in range(args.reps))
        step = (full - prefill) / (R - 1)
        bandwidth = (weight_bytes + kv_bytes) / step
        results[name] = {"tok_per_s": B * R / full, "step_ms": 1e3 * step, "bandwidth": bandwidth}
        frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
        print(
            f"[result] {name:8s} {B * R / full:10.0f} tok/s  call {full:.3f} s (prefill {prefill:.3f} s)  "
            f"step {1e3 * step:.2f} ms  {bandwidth / 1e9:.0f} GB/s  {100 * bandwidth / peak:.0f}% of HBM  "
            f"compiled frames {frames} graphs {graphs}",
            flush=True,
        )
    eager, fast = results["eager"], results["compiled"]
    print(
        f"decode: eager_tok_per_s={eager['tok_per_s']:.1f} compiled_tok_per_s={fast['tok_per_s']:.1f} "
        f"speedup={fast['tok_per_s'] / eager['tok_per_s']:.2f} compiled_hbm_frac={fast['bandwidth'] / peak:.3f}"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
