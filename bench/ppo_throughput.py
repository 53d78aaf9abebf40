"""RL iteration throughput: train_ppo.py's own `ppo_rollout(...)` and `ppo_update(...)` (or train_grpo.py's
`grpo_rollout` and `grpo_update` with --estimator grpo | rloo | reinforce_pp) on randomly initialised models.

The flags and the work are those of bench/trl_ppo_bench.py (TRL's PPOTrainer on a random GPT-2): policy,
frozen reference, reward model and critic (initialised from the RM) of one shape, random prompts of --prompt-len
tokens, fp32, responses of exactly --resp-len tokens (the EOS id lies outside the vocabulary, so no row stops early,
as in the TRL benchmark), --ppo-epochs x --mini-batches optimizer steps per iteration. --model-dir: every role from
a real Hugging Face folder (SmolLM2-135M), prompts from its non-special ids; its <|im_end|> is then an ordinary
token, as in trl_ppo_bench.py, whose pad moves off it. Prints the median phase breakdown (generate, scoring forwards,
update) with each phase's FLOPs (PaLM convention, as perf/mfu) and achieved FLOP/s against this machine's measured
fp32 matmul peak, the GEMM floor (`[floor]`: the iteration's linear layers timed alone, see GemmRecorder), then one
line:
`ppo_throughput: sec_per_iter=<median of iterations 2..K> gen_tok_per_s=<batch*resp_len/sec_per_iter> peak_rss_mb=<y>`

python bench/ppo_throughput.py --iters 10                                  # shape S on 2 CPU threads
python bench/ppo_throughput.py --iters 10 --dim 512 --layers 8 --vocab 8192  # shape L
python bench/ppo_throughput.py --iters 10 --estimator grpo                 # critic-free, against the PPO line
python bench/ppo_throughput.py --model-dir out/smollm2 --batch 16 --prompt-len 32 --resp-len 32 --ppo-epochs 1 \
    --mini-batches 2 --iters 4                                            # SmolLM2-135M, against TRL's --model-dir
python bench/ppo_throughput.py --device cuda --dtype bfloat16 --compile --layers 12 --heads 12 --dim 768 \
    --vocab 50257 --resp-len 128 --iters 6                                # GPT-2 small on a GPU
"""

import dataclasses
import functools
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import generate as generation  # noqa: E402
import hf  # noqa: E402
import parallel  # noqa: E402
import rollout  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
from common import Trained  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from rollout import Models  # noqa: E402


@dataclass
class Shape:
    """The model and batch shape, as bench/trl_ppo_bench.py names it (bench/decode.py shares it)."""

    layers: int = 4
    """transformer blocks"""
    heads: int = 4
    """attention heads"""
    dim: int = 256
    """embedding width"""
    vocab: int = 512
    """vocabulary size"""
    n_positions: int = 256
    """context length (block_size)"""
    prompt_len: int = 16
    """prompt tokens (random ids)"""
    resp_len: int = 48
    """response tokens, every row (no early stop)"""
    batch: int = 64
    """prompts per PPO iteration (--rollout-batch-size)"""
    threads: int = 2
    """torch.set_num_threads"""
    seed: int = 1234
    """seed of models, prompts and sampling"""
    arch: Literal["gpt", "llama"] = "gpt"
    """gpt: model.GPT (GPT-2 layout); llama: a Hugging Face Llama built from a config behind hf.HFCausalLM (RMSNorm,
    rotary, SwiGLU, grouped-query attention: the shape of the GPU goals, docs/design.md §7)"""
    kv_heads: int = 0
    """llama: key/value heads (0 = --heads)"""
    intermediate: int = 0
    """llama: SwiGLU width (0 = 4 x --dim)"""


def build_model(shape: Shape, device: torch.device, lm_head: bool = True, score_head: bool = False):
    """A randomly initialised model of the shape: a model.GPT, or an hf.HFCausalLM around a LlamaForCausalLM."""
    if shape.arch == "gpt":
        config = GPTConfig(
            block_size=shape.n_positions,
            vocab_size=shape.vocab,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_embd=shape.dim,
            dropout=0.0,
            bias=True,
            lm_head=lm_head,
            score_head=score_head,
        )
        return GPT(config).to(device)
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf import HFCausalLM

    config = LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.dim,
        intermediate_size=shape.intermediate or 4 * shape.dim,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads or shape.heads,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.n_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device(device):
        return HFCausalLM(LlamaForCausalLM(config), lm_head=lm_head, score_head=score_head)


@dataclass
class Args(Shape):
    iters: int = 6
    """PPO iterations; the first is warm-up"""
    ppo_epochs: int = 4
    """passes over each rollout (--ppo-epochs)"""
    mini_batches: int = 4
    """optimizer steps per epoch (--num-minibatches)"""
    micro_batch: int = 0
    """rows per forward in the update (--micro-batch-size; 0 = a whole minibatch, as the TRL benchmark)"""
    temperature: float = 1.0
    """sampling temperature"""
    device: str = "cpu"
    """cpu | cuda"""
    dtype: str = "float32"
    """float32 | bfloat16 (autocast)"""
    compile: bool = False
    """torch.compile the training forward (dynamic shapes, as train_ppo's --compile) and the rollout's decode step"""
    estimator: Literal["ppo", "grpo", "rloo", "reinforce_pp"] = "ppo"
    """ppo: train_ppo.py (PPO-max, a critic); grpo | rloo | reinforce_pp: train_grpo.py's --estimator (no critic
    built, scored or trained; the same responses per iteration, --batch / group_size prompts)"""
    rm_members: int = 1
    """reward models scoring each rollout (--rm-ckpt a b ...: an ensemble's K forwards a micro-batch)"""
    model_dir: str | None = None
    """a Hugging Face folder (make smollm2: out/smollm2) whose weights every role starts from instead (the RM and
    critic with a fresh score head); its config sets the shape flags"""
    floor: bool = True
    """record the linear layers' GEMM shapes in the warm-up iteration and time them alone: the `[floor]` line (CPU,
    fp32)"""


def pretrained_builder(args: Args, device: torch.device):
    """build(lm_head, score_head) -> a role from --model-dir as an RL stage builds one from --sft-ckpt hf:DIR: the
    folder read once (rollout.policy_checkpoint), each role from it (hf.model_from_checkpoint, a fresh score head
    where asked). Sets the shape flags from the folder's config."""
    pretrained = rollout.policy_checkpoint(f"hf:{args.model_dir}", "--model-dir")
    config = pretrained["model_config"]
    args.arch = "llama"
    args.layers = config["n_layer"]
    args.heads = config["n_head"]
    args.dim = config["n_embd"]
    args.vocab = config["vocab_size"]
    args.kv_heads = config["hf_config"].get("num_key_value_heads") or args.heads

    def build(lm_head: bool = True, score_head: bool = False):
        return hf.model_from_checkpoint(pretrained, lm_head=lm_head, score_head=score_head).to(device)

    return build


def prompt_ids(args: Args) -> torch.Tensor:
    """The ids a prompt is drawn from: the whole vocabulary, or --model-dir's less its special tokens (the same
    prompts as trl_ppo_bench.py's with the same seed)."""
    if args.model_dir is None:
        return torch.arange(args.vocab)
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(args.model_dir).added_tokens_decoder
    return torch.tensor([i for i in range(args.vocab) if i not in special])


class IdTokenizer:
    """Prompts are strings of token ids ("5 17 3"); EOS and pad lie outside the model's vocabulary."""

    def __init__(self, vocab: int):
        self.eos_id = vocab
        self.pad_id = vocab + 1
        self.bos_id = None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


class GemmRecorder:
    """Counts every nn.Linear call of the given CPU models by phase and shape (M rows, in, out, bias, with grad), then
    times each shape alone (forward, plus backward where it trained) with warm caches: the linear layers' GEMMs of an
    iteration with nothing around them, a floor no implementation of the same work gets under on this machine
    (attention's own small GEMMs, a few % of the FLOPs here, are left out, so the true floor is a little higher)."""

    def __init__(self, models):
        self.phase, self.counts = "generate", {}
        linears = {id(m): m for model in models for m in model.modules() if isinstance(m, torch.nn.Linear)}
        self.hooks = [m.register_forward_hook(self._record) for m in linears.values()]

    def _record(self, mod, inp, out):
        x = inp[0]
        key = (
            self.phase,
            x.numel() // x.size(-1),
            mod.in_features,
            mod.out_features,
            mod.bias is not None,
            torch.is_grad_enabled() and mod.weight.requires_grad,
        )
        self.counts[key] = self.counts.get(key, 0) + 1

    def floor(self, reps: int = 10) -> dict:
        for h in self.hooks:
            h.remove()
        out = {"generate": 0.0, "scoring": 0.0, "update": 0.0}
        for (phase, M, k, n, bias, grad), count in self.counts.items():
            x = torch.randn(M, k).requires_grad_(grad)
            w = (torch.randn(n, k) * 0.02).requires_grad_(grad)
            b = torch.zeros(n).requires_grad_(grad) if bias else None
            gy = torch.randn(M, n)

            def once():
                for t in (x, w, b):  # a fresh step: no gradient accumulation
                    if t is not None:
                        t.grad = None
                with torch.set_grad_enabled(grad):
                    y = torch.nn.functional.linear(x, w, b)
                    if grad:
                        y.backward(gy)

            for _ in range(2):
                once()
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                once()
                ts.append(time.perf_counter() - t)
            out[phase] += count * statistics.median(ts)
        return out


def main(args: Args) -> None:
    common.keep_freed_memory()  # as every stage's run_main does
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    B, P, R = args.batch, args.prompt_len, args.resp_len
    mb = B // args.mini_batches
    micro = args.micro_batch or mb
    build = functools.partial(build_model, args, device) if args.model_dir is None else pretrained_builder(args, device)
    policy = build()
    ref = build().requires_grad_(False)
    ref.load_state_dict(policy.state_dict())
    members = [build(False, True).requires_grad_(False) for _ in range(args.rm_members)]
    reward_model = members[0]
    # each stage's own settings object: PPO-max with the values this benchmark has always used, a critic-free
    # estimator with its own recipe (group size, KL placement, normalisation, whitening, aggregation)
    shared = dict(
        max_new_tokens=R,
        temperature=args.temperature,
        missing_eos_penalty=-1.0,
        ppo_epochs=args.ppo_epochs,
        num_minibatches=args.mini_batches,
        grad_clip=1.0,
        compile="on" if args.compile else "off",  # the rollout's decode step too
    )
    critic_free = args.estimator != "ppo"
    if critic_free:
        settings = train_grpo.resolve_args(train_grpo.Args(estimator=args.estimator, **shared))
        group_size = settings.group_size
    else:
        ppo_flags = dict(kl_coef=0.1, reward_norm="norm", reward_clip=5.0, adv_whiten="minibatch", critic_grad_clip=1.0)
        ppo_flags |= dict(critic_warmup_steps=0)  # the actor trains in every timed iteration
        settings = train_ppo.Args(**shared, **ppo_flags)
        group_size = 1
    critic = None
    if not critic_free:
        critic = build(False, True)
        critic.load_state_dict(reward_model.state_dict())  # the critic starts from the RM (as TRL's examples)
        critic_opt = critic.configure_optimizers(0.0, 3e-6, (0.9, 0.95), device.type)
    del build  # under --model-dir it holds the folder's weights, a fifth copy
    models = [m for m in (policy, ref, *members, critic) if m is not None]
    for m in models:
        m.eval()
    actor_opt = policy.configure_optimizers(0.0, 3e-6, (0.9, 0.95), device.type)
    fwd = {m: parallel.compile_forward(m) if args.compile else m for m in models}  # as the stages' --compile
    tok = IdTokenizer(args.vocab)
    g = torch.Generator().manual_seed(args.seed)
    allowed = prompt_ids(args)
    ids = allowed[torch.randint(0, len(allowed), (B // group_size * args.iters, P), generator=g)].tolist()
    prompts = [" ".join(map(str, row)) for row in ids for _ in range(group_size)]  # a group's copies in a row
    generator = torch.Generator(device=device).manual_seed(args.seed)
    moments = train_grpo.RunningMoments() if critic_free else train_ppo.RunningMoments()

    # time generation from outside: wrap generate.generate (the rollout's sample calls it once)
    gen_time = [0.0]
    raw_generate = generation.generate

    def timed_generate(*a, **kw):
        sync()
        t = time.perf_counter()
        if recorder:
            recorder.phase = "generate"
        out = raw_generate(*a, **kw)
        if recorder:
            recorder.phase = "scoring"
        sync()
        gen_time[0] += time.perf_counter() - t
        return out

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    generation.generate = timed_generate
    n_params = policy.num_params()
    policy_size = sum(p.numel() for p in policy.parameters()) / 1e6
    print(
        f"[setup] torch={torch.__version__} threads={torch.get_num_threads()} device={device} dtype={args.dtype} "
        f"compile={args.compile} | policy {policy_size:.2f} M params (x{len(models)} models) layers={args.layers} "
        f"heads={args.heads} dim={args.dim} vocab={args.vocab} | B={B} P={P} R={R} ppo_epochs={args.ppo_epochs} "
        f"mini_batches={args.mini_batches} (minibatch {mb}, micro-batch {micro}) | estimator {args.estimator} "
        f"group_size {group_size} critic {'yes' if critic else 'no'}",
        flush=True,
    )
    rows = []
    # the warm-up iteration also records every linear layer's GEMM shape (the hooks cost a little Python time there)
    recorder = GemmRecorder(models) if args.floor and device.type == "cpu" else None
    floor = None
    if dtype != torch.float32:  # what does not train in bf16, the rollouts from a bf16 copy (as the stages)
        for frozen in (ref, *members):
            parallel.store_low_precision(frozen, dtype)
    forwards = Models(fwd[policy], fwd[ref], [fwd[member] for member in members], critic=fwd.get(critic))
    forwards = forwards.with_sampler(dtype, fsdp=False)
    actor = Trained("model", policy, actor_opt, grad_clip=1.0, forward=fwd[policy])
    engine = rollout.Engine(forwards, tok, settings, B, generator, dtype)  # the rollout: one forward a batch
    update_settings = dataclasses.replace(settings, micro_batch_size=micro, dtype=args.dtype)  # its micro-batches
    for it in range(args.iters):
        gen_time[0] = 0.0
        sync()
        t0 = time.perf_counter()
        batch_prompts = prompts[it * B : (it + 1) * B]
        if critic_free:
            exp, _, _ = train_grpo.grpo_rollout(engine, settings, batch_prompts, reward_moments=moments)
        else:
            exp, _, _ = train_ppo.ppo_rollout(engine, settings, batch_prompts, kl_coef=0.1, reward_moments=moments)
        sync()
        t1 = time.perf_counter()
        assert exp["mask"].shape == (B, R) and bool(exp["mask"].all()), "every response must be exactly R tokens"
        if recorder:
            recorder.phase = "update"
        loop = rollout.Loop(generator)
        if critic_free:
            train_grpo.grpo_update(actor, exp, update_settings, loop.step, loop.generator, loop.guard, loop.ptx_stream)
        else:
            critic_entry = Trained("critic", critic, critic_opt, grad_clip=1.0, forward=fwd[critic])
            train_ppo.ppo_update(
                actor, critic_entry, exp, update_settings, loop.step, loop.generator, loop.guard, loop.ptx_stream
            )
        Models(policy, ref, members, forwards.sampler).refresh_sampler()
        sync()
        t2 = time.perf_counter()
        rows.append({"total": t2 - t0, "generate": gen_time[0], "scoring": t1 - t0 - gen_time[0], "update": t2 - t1})
        print(
            f"[iter {it}] {t2 - t0:.3f}s: generate {gen_time[0]:.3f} scoring {t1 - t0 - gen_time[0]:.3f} "
            f"update {t2 - t1:.3f}",
            flush=True,
        )
        if recorder and it == 0:
            floor, recorder = recorder.floor(), None

    steady = rows[1:] if len(rows) > 1 else rows
    med = {k: statistics.median(r[k] for r in steady) for k in rows[0]}
    # FLOPs, PaLM convention (forward = 1/3 of flops_per_token at the full context L = P + R)
    L = P + R
    fa = policy.flops_per_token(L)
    fc = reward_model.flops_per_token(L)  # critic-sized: the RM's forward, and the critic's when there is one
    critic_share = 1 if critic is not None else 0
    flops = {
        "generate": B * L * fa / 3,
        "scoring": B * L * (2 * fa + (args.rm_members + critic_share) * fc) / 3,
        "update": args.ppo_epochs * B * L * (fa + critic_share * fc),
    }
    # the peak: measured matmuls in --dtype on CPU; the vendor's dense bf16 figure on a GPU (common.GPU_PEAK_FLOPS)
    peak = (
        common.matmul_flops((512, 1024, 2048), trials=3, seconds=0.1, dtype=dtype)
        if device.type == "cpu"
        else common.peak_flops(device)
    )
    # TRL takes the old log-probs from its generation's scores: its scoring phase skips the policy forward
    scoring_without_policy = B * L * (fa + (args.rm_members + critic_share) * fc) / 3
    print(
        f"[flops] generate={flops['generate'] / 1e9:.2f} scoring={flops['scoring'] / 1e9:.2f} "
        f"scoring_without_policy={scoring_without_policy / 1e9:.2f} update={flops['update'] / 1e9:.2f} GFLOP "
        f"peak={peak / 1e9:.1f} GFLOP/s"
    )
    its = " ".join(f"{r['total']:.3f}" for r in rows)
    print(f"[result] iteration seconds: {its} (first = warm-up)")
    source = f"measured, {args.dtype}" if device.type == "cpu" else "vendor, dense bf16"
    print(f"[result] matmul peak ({source}): {peak / 1e9:.1f} GFLOP/s | non-embedding params {n_params / 1e6:.2f} M")
    for k in ("generate", "scoring", "update"):
        print(
            f"[result] {k:9s} {med[k]:7.3f}s ({100 * med[k] / med['total']:4.1f}%)  {flops[k] / 1e9:9.1f} GFLOP  "
            f"{flops[k] / med[k] / 1e9:8.1f} GFLOP/s  {100 * flops[k] / med[k] / peak:5.1f}% of peak"
        )
    print(f"[result] generation-only tok/s = {B * R / med['generate']:.0f}")
    if floor:
        print(
            f"[floor] linear GEMMs alone: generate={floor['generate']:.3f} scoring={floor['scoring']:.3f} "
            f"update={floor['update']:.3f} iteration={sum(floor.values()):.3f} s (measured: "
            f"{100 * sum(floor.values()) / med['total']:.0f}% of our iteration is in them)"
        )
    # decode is bandwidth-bound on a GPU: each step reads the policy's weights and the KV cache so far
    decoder = forwards.sampler if forwards.sampler is not None else policy  # the weights the decode reads
    weight_bytes = sum(p.numel() * p.element_size() for p in decoder.parameters())
    kv_elem = 2 if dtype != torch.float32 else 4
    kv_width = args.dim * (args.kv_heads or args.heads) // args.heads  # grouped-query attention reads fewer keys
    kv_bytes = sum(2 * args.layers * B * (P + t) * kv_width * kv_elem for t in range(R))
    print(
        f"[result] decode traffic {(R * weight_bytes + kv_bytes) / 1e9:.2f} GB (weights {weight_bytes / 1e6:.0f} MB "
        f"x {R} steps + KV cache) -> {(R * weight_bytes + kv_bytes) / med['generate'] / 1e9:.0f} GB/s achieved"
    )
    if args.compile:  # a run's compiles: training-forward frames (dynamic shapes) and graphs (+ the decode step's)
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        print(f"[result] compiled frames {counters['frames']['total']} graphs {graphs} over {args.iters} iterations")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        f"ppo_throughput: sec_per_iter={med['total']:.3f} gen_tok_per_s={B * R / med['total']:.1f} "
        f"peak_rss_mb={peak_rss_mb:.0f}"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
