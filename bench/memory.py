"""Bytes per GPU of a PPO run: what four models and two optimizers hold under plain DDP, --fsdp on N
ranks, LoRA (--lora-rank), and both, for GPT-2 124 M and Llama-shaped 1 B and 7 B, and a check of the same model
against train_ppo.py's measured peak RSS on CPU.

The model (fp32 master weights for what trains; bf16 is autocast or FSDP2's parameter dtype):
  weights    4 bytes x (actor + critic) + 2 bytes x (reference + RM) and the actor's bf16 sampler copy
             (docs/design.md §7: what does not train is stored in bf16; --frozen-fp32: 4 bytes for all four and no
             copy, as before);
             LoRA: two frozen bases (actor = reference, critic = RM) in bf16, the sampler copy; under --fsdp the
             frozen models' shards in bf16, no copy, LoRA's bases fp32
  training   (4 grad + 8 Adam) bytes x trainable parameters (actor and critic; LoRA: adapters and the value head)
  --fsdp     both / ranks, plus the gathered working set: the whole actor during generation (parameters gathered once
             per rollout, in the parameter dtype) or, in the update, the root (embeddings, heads) and two blocks with
             their unsharded fp32 gradients
  activations one micro-batch of the update (Korthikanti et al. 2022: 34·b·T·C bytes per layer in 16-bit, without the
             attention-score term that SDPA avoids; fp32 doubles it), the response logits (three b·T·V fp32 buffers),
             and the generation's KV cache; --grad-ckpt keeps one layer input per layer plus one layer's activations
At start-up the host holds, before sharding, every full model it built (models are built on the host and sharded
block by block onto the device: a GPU sees only shards), and DDP broadcasts each model it wraps through 250 MB
buckets; the CPU check compares max(start-up, run) with the measured peak RSS minus the RSS just before the first
model is built (the loaded checkpoints and an imported torch are not the models').

python bench/memory.py            # the tables: 8 ranks, micro-batch 4 x 1024 tokens, bf16; with and without --grad-ckpt
python bench/memory.py --check    # + train_ppo.py on CPU in each mode on 1 and 2 ranks (about 5 min)
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Optional

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoints  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    ffn: int
    """MLP hidden size"""
    kv_heads: int
    gated: bool
    """three MLP matrices (SwiGLU) instead of two"""
    tied: bool
    """the LM head is the embedding"""
    positions: int = 0
    """learned position embeddings (GPT-2), 0 for RoPE"""

    def block_params(self) -> int:
        head_dim = self.n_embd // self.n_head
        attention = self.n_embd * (self.n_embd + 2 * self.kv_heads * head_dim) + self.n_embd * self.n_embd
        mlp = (3 if self.gated else 2) * self.n_embd * self.ffn
        return attention + mlp + 4 * self.n_embd  # norms (and GPT-2's biases, roughly)

    def root_params(self, lm_head: bool = True) -> int:
        embeddings = (self.vocab_size + self.positions) * self.n_embd
        head = self.vocab_size * self.n_embd if lm_head and not self.tied else 0
        return embeddings + head + 2 * self.n_embd

    def params(self, lm_head: bool = True) -> int:
        return self.n_layer * self.block_params() + self.root_params(lm_head)

    def lora_params(self, rank: int) -> int:
        """Adapters on every linear layer of the blocks (the default --lora-targets)."""
        head_dim = self.n_embd // self.n_head
        C, kv = self.n_embd, self.kv_heads * head_dim
        if self.gated:  # q, k, v, o, gate, up, down
            pairs = [(C, C), (C, kv), (C, kv), (C, C), (C, self.ffn), (C, self.ffn), (self.ffn, C)]
        else:  # c_attn, attn.c_proj, c_fc, mlp.c_proj
            pairs = [(C, 3 * C), (C, C), (C, self.ffn), (self.ffn, C)]
        return self.n_layer * sum(rank * (fan_in + fan_out) for fan_in, fan_out in pairs)


SHAPES = {
    "gpt2-124M": Shape("gpt2-124M", 12, 768, 12, 50257, 3072, 12, False, True, 1024),
    "llama-1B": Shape("llama-1B", 16, 2048, 32, 128256, 8192, 8, True, True),  # Llama 3.2 1B's shape
    "llama-7B": Shape("llama-7B", 32, 4096, 32, 32000, 11008, 32, True, False),  # Llama 2 7B's shape
}


@dataclass
class Setting:
    ranks: int = 8
    micro_batch_size: int = 4
    """sequences per micro-batch of the update"""
    seq_len: int = 1024
    """prompt + response tokens"""
    response_len: int = 512
    generation_batch: int = 16
    """sequences generated at once per rank (the KV cache)"""
    bf16: bool = True
    """16-bit activations and gathered parameters (False: fp32, as the CPU check runs)"""
    lora_rank: int = 8
    grad_ckpt: bool = False
    frozen_bf16: bool = True
    """what does not train stored in bf16 and a bf16 sampler copy of the actor (the stages under bf16 since the
    low-precision change); False: every model in fp32, the actor sampling itself (before)"""


def predict(shape: Shape, setting: Setting, fsdp: bool, lora: bool, ranks: int) -> dict:
    """Bytes per rank by part, the run's peak and the host's build peak."""
    policy = shape.params()
    critic = shape.params(lm_head=False) + shape.n_embd + 1
    reward = shape.params() + shape.n_embd + 1
    low = 2 if setting.bf16 else 4
    frozen = low if setting.frozen_bf16 else 4  # bytes a parameter of what does not train
    sampler = low * policy if setting.frozen_bf16 and setting.bf16 and not fsdp else 0  # the bf16 copy, replicated
    if lora:
        base = frozen if not fsdp else 4  # the bases of a LoRA model stay fp32 under --fsdp
        weights = base * (policy + critic) + 4 * (shape.n_embd + 1)  # two bases, and the RM's own head
        trainable = 2 * shape.lora_params(setting.lora_rank) + shape.n_embd + 1
        built = 4 * (policy + critic)
    else:
        weights = 4 * (policy + critic) + frozen * (policy + reward)
        trainable = policy + critic
        built = 4 * (2 * policy + critic + reward)
    training = 12 * trainable
    shards = ranks if fsdp else 1
    parts = {"weights": weights / shards + sampler, "grads+adam": training / shards}
    C, L = shape.n_embd, shape.n_layer
    b, T = setting.micro_batch_size, setting.seq_len
    per_layer = 34 * b * T * C * (low / 2)
    layers = (L * 2 * b * T * C * low / 2 + per_layer) if setting.grad_ckpt else L * per_layer
    logits = 3 * 4 * b * setting.response_len * shape.vocab_size
    parts["activations"] = layers + logits
    kv_cache = 2 * L * setting.generation_batch * T * C * low
    generation = kv_cache + (low * policy if fsdp else 0)  # the actor gathered for the whole rollout
    update = 0
    if fsdp:  # the root and two blocks gathered, with fp32 gradients for them
        update = (low + 4) * (shape.root_params() + 2 * shape.block_params())
    parts["gathered"] = max(generation, update + parts["activations"]) - parts["activations"]
    run = sum(parts.values())
    if not fsdp:  # DDP's start-up broadcast of each wrapped model goes through 250 MB buckets (a transient copy)
        built = max(built, weights + sampler) + min(250e6, 4 * policy)
    return {"parts": parts, "run": run, "build": built}


def decode_bytes(shape: Shape) -> str:
    """The weight bytes a decoding step reads (one new token for the whole batch), and the four roles' weights on one
    GPU under DDP, at every shape: fp32 actor under autocast (before: 4 bytes a parameter read, and autocast writes and
    reads a bf16 copy of each matrix at every step) against the bf16 sampler copy (after: 2 bytes)."""
    policy = shape.params()
    before = Setting(frozen_bf16=False)
    after = Setting()
    weights = [predict(shape, setting, False, False, 1)["parts"]["weights"] / GB for setting in (before, after)]
    return (
        f"| {shape.name} | {policy / 1e9:.2f} B | {4 * policy / GB:.2f} (+ {4 * policy / GB:.2f} cast) | "
        f"{2 * policy / GB:.2f} | {weights[0]:.1f} | {weights[1]:.1f} |"
    )


def table(setting: Setting) -> str:
    modes = [("DDP (any GPU count)", False, False), ("LoRA (DDP)", False, True)]
    modes += [(f"FSDP x {setting.ranks}", True, False), (f"LoRA + FSDP x {setting.ranks}", True, True)]
    lines = [
        f"PPO bytes per GPU (GB), {setting.ranks} ranks for FSDP, micro-batch {setting.micro_batch_size} x "
        f"{setting.seq_len} tokens ({setting.response_len} response), generation batch {setting.generation_batch}, "
        f"{'bf16' if setting.bf16 else 'fp32'} activations, LoRA rank {setting.lora_rank} on every linear layer"
        f"{', --grad-ckpt' if setting.grad_ckpt else ''}; fits = under 80 GB",
        "",
        "| shape | params | " + " | ".join(name for name, *_ in modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for shape in SHAPES.values():
        cells = []
        for _, fsdp, lora in modes:
            gb = predict(shape, setting, fsdp, lora, setting.ranks)["run"] / GB
            cells.append(f"{gb:.1f}{'' if gb < 80 else ' (no)'}")
        lines.append(f"| {shape.name} | {shape.params() / 1e9:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the check: train_ppo.py on CPU, one iteration, peak RSS per rank

CHECK_SHAPE = Shape("check", 12, 768, 12, 563, 3072, 12, False, True, 256)  # GPT-shaped, the built-in vocabulary
CHECK = Setting(ranks=2, micro_batch_size=4, seq_len=40, response_len=16, generation_batch=16, bf16=False)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def probe(sft: str, rm: str, task_dir: str, out_dir: str, fsdp: bool, lora: bool) -> None:
    """One PPO iteration under torchrun; prints this rank's {baseline, peak} as JSON. The final save gathers and
    writes nothing (its full-state buffers are the checkpoint's, not the run's)."""
    import hf
    import train_ppo

    baseline = {}
    build = hf.model_from_checkpoint

    def first_build(*args, **kwargs):
        baseline.setdefault("rss", rss_bytes())
        return build(*args, **kwargs)

    train_ppo.hf.model_from_checkpoint = first_build
    checkpoints.model_state = lambda model, key="model": {}
    checkpoints.optimizer_state = lambda *args: {}
    args = train_ppo.Args(
        sft_ckpt=sft,
        rm_ckpt=rm,
        task_dir=task_dir,
        out_dir=out_dir,
        overwrite=True,
        max_steps=1,
        critic_warmup_steps=0,
        rollout_batch_size=CHECK.generation_batch * int(os.environ.get("WORLD_SIZE", "1")),
        num_minibatches=CHECK.generation_batch // CHECK.micro_batch_size,
        micro_batch_size=CHECK.micro_batch_size,
        ppo_epochs=1,
        max_new_tokens=CHECK.response_len,
        ptx_coef=0.0,
        fsdp=fsdp,
        lora_rank=CHECK.lora_rank if lora else 0,
    )
    train_ppo.main(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("PROBE " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "baseline": baseline["rss"], "peak": peak}))


def make_checkpoints(folder: str, task_dir: str) -> tuple[str, str]:
    """Random SFT and RM checkpoints of CHECK_SHAPE on the built-in task's tokenizer."""
    from model import GPT, GPTConfig
    from task import build_task
    from tokenizer import load_tokenizer

    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    shape = CHECK_SHAPE
    paths = []
    for kind in ("sft", "rm"):
        config = GPTConfig(
            vocab_size=tok.vocab_size,
            block_size=shape.positions,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            n_embd=shape.n_embd,
            score_head=kind == "rm",
        )
        path = os.path.join(folder, f"{kind}.pt")
        state = dict(kind=kind, model=GPT(config).state_dict(), model_config=asdict(config), tokenizer=tok.state())
        state |= dict(args={}, step=0, optimizer={}, scheduler={}, rng=[], data_state={}, world_size=1, seconds=0.0)
        checkpoints.save_checkpoint(state | dict(score_offset=0.0), path)
        paths.append(path)
    return paths[0], paths[1]


def check(task_dir: str) -> str:
    lines = [
        f"CPU check: {CHECK_SHAPE.n_layer} layers x {CHECK_SHAPE.n_embd}, {CHECK_SHAPE.params() / 1e6:.0f} M params a "
        f"model, fp32, {CHECK.generation_batch} responses of {CHECK.response_len} tokens a rank, micro-batch "
        f"{CHECK.micro_batch_size}; measured = peak RSS - RSS before the first model (GB, the largest rank)",
        "",
        "| mode | ranks | predicted (run / start-up) | measured | measured / predicted |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        sft, rm = make_checkpoints(folder, task_dir)
        for name, fsdp, lora in (
            ("DDP", False, False),
            ("FSDP", True, False),
            ("LoRA", False, True),
            ("LoRA+FSDP", True, True),
        ):
            for ranks in (1, 2):
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                command += [os.path.abspath(__file__), "--probe", "--task-dir", task_dir, "--sft", sft, "--rm", rm]
                command += ["--out-dir", os.path.join(folder, f"{name}{ranks}")]
                command += (["--fsdp"] if fsdp else []) + (["--lora"] if lora else [])
                # a fixed mmap threshold: glibc then returns every freed tensor to the OS, so RSS follows what is
                # alive (with its default, a freed model's memory stays mapped and RSS measures the allocator)
                env = os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
                result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
                probes = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("PROBE ")]
                if result.returncode != 0 or len(probes) != ranks:
                    raise SystemExit(f"{name} on {ranks} ranks failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
                measured = max(p["peak"] - p["baseline"] for p in probes)
                prediction = predict(CHECK_SHAPE, replace(CHECK, ranks=ranks), fsdp, lora, ranks)
                expected = max(prediction["run"], prediction["build"])
                lines.append(
                    f"| {name} | {ranks} | {prediction['run'] / GB:.2f} / {prediction['build'] / GB:.2f} | "
                    f"{measured / GB:.2f} | {measured / expected:.2f} |"
                )
                print(lines[-1], flush=True)
    return "\n".join(lines)


def probe_grad_ckpt(enabled: bool, batch: int, seq_len: int) -> None:
    """One forward and backward of the check shape's GPT on (batch, seq_len) tokens; prints the peak RSS above the
    RSS after building the model and its gradients' first allocation (so only activations differ)."""
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    shape = CHECK_SHAPE
    config = GPTConfig(
        vocab_size=563, block_size=seq_len, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd
    )
    model = GPT(config)
    model.set_grad_ckpt(enabled)
    tokens = torch.randint(0, 563, (batch, seq_len))
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    baseline = rss_bytes()
    logits, _ = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("PROBE " + json.dumps({"baseline": baseline, "peak": peak, "loss": loss.item()}))


def grad_ckpt_check(batch: int = 8, seq_len: int = 256) -> str:
    results = {}
    for enabled in (False, True):
        command = [sys.executable, os.path.abspath(__file__), "--probe-grad-ckpt", str(int(enabled))]
        env = os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        probe_line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
        results[enabled] = json.loads(probe_line[6:])
    off, on = ((r["peak"] - r["baseline"]) / GB for r in (results[False], results[True]))
    return (
        f"--grad-ckpt, one forward and backward of the check shape on {batch} x {seq_len} tokens (fp32, CPU): "
        f"activation peak {off:.2f} GB without, {on:.2f} GB with ({on / off:.2f}x); loss "
        f"{results[False]['loss']:.6f} vs {results[True]['loss']:.6f}"
    )


@dataclass
class Args:
    ranks: int = 8
    """ranks of the FSDP columns"""
    micro_batch_size: int = 4
    seq_len: int = 1024
    grad_ckpt: bool = False
    check: bool = False
    """also measure train_ppo.py on CPU (the check shape, 1 and 2 ranks, every mode)"""
    task_dir: str = "out/data"
    # the probe's own flags (one rank of a check run)
    probe: bool = False
    sft: Optional[str] = None
    rm: Optional[str] = None
    out_dir: str = "out/memory"
    fsdp: bool = False
    lora: bool = False
    probe_grad_ckpt: Optional[int] = None


def main(args: Args) -> None:
    if args.probe:
        probe(args.sft, args.rm, args.task_dir, args.out_dir, args.fsdp, args.lora)
        return
    if args.probe_grad_ckpt is not None:
        probe_grad_ckpt(bool(args.probe_grad_ckpt), 8, 256)
        return
    setting = Setting(ranks=args.ranks, micro_batch_size=args.micro_batch_size, grad_ckpt=args.grad_ckpt)
    setting = replace(setting, seq_len=args.seq_len, response_len=args.seq_len // 2)
    print(table(setting))
    print()
    print(table(replace(setting, grad_ckpt=True)))
    print()
    print(table(replace(setting, frozen_bf16=False)) + "\n(before: every model fp32, the actor sampling itself)")
    print()
    print("| shape | params | decode GB/step before | after | 4 roles' weights GB before | after |")
    print("|---|---|---|---|---|---|")
    print("\n".join(decode_bytes(shape) for shape in SHAPES.values()))
    if args.check:
        print()
        print(check(args.task_dir))
        print()
        print(grad_ckpt_check())


if __name__ == "__main__":
    main(tyro.cli(Args))
