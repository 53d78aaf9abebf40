"""Plumbing every stage shares: DDP set-up, printing, seeding, checkpoints, logging, LR schedule, MFU.

Nothing algorithmic lives here; each stage's algorithm is inline in its own train_*.py.
"""

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lora import BaseView, add_lora, lora_layers, merge_lora, merged_state_dict


class UserError(Exception):
    """A user mistake (bad data, flags or checkpoint): the message is one line; scripts print it and exit 2."""


@dataclass
class CommonArgs:
    """Flags every stage shares (DESIGN §4)."""

    # --- run
    out_dir: str = "out"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    seed: int = 1337
    """run seed (init, data order, sampling); per-rank sampling seeds are seed*1000+rank"""
    task_seed: int = 1337
    """seed of the built-in task (grammar draws, splits, tokenizer); keep it the same across stages"""
    task_dir: str = "out/data"
    """where the built-in task's data and tokenizer are cached"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (auto: cuda if present, else cpu; under torchrun each rank takes cuda:LOCAL_RANK)"""
    dtype: str = "auto"
    """auto | float32 | bfloat16 (auto: bf16 autocast on GPU, fp32 on CPU)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the training forward: auto = on CUDA only (on CPU it costs more than it saves), on = on CPU too
    (inductor's CPU backend: for tests and the curious)"""
    fsdp: bool = False
    """shard every model's parameters, gradients and optimizer state over the ranks with FSDP2 (under torchrun; gloo
    on CPU, nccl on GPU; bf16 the FSDP2 way: parameters gathered in bf16, gradients reduced in fp32). Checkpoints
    still hold full weights"""
    grad_ckpt: bool = False
    """activation checkpointing: keep each block's input only and recompute the block in the backward (less memory,
    about a third more compute)"""
    lora_rank: int = 0
    """train low-rank adapters of this rank on a frozen base (0: full fine-tuning); checkpoints hold merged weights"""
    lora_alpha: float = 16.0
    """LoRA scale alpha: the update is (alpha / rank) B A"""
    lora_targets: Optional[list[str]] = None
    """the modules LoRA adapts, by last name part: linear layers (GPT: c_attn c_proj c_fc; Llama: q_proj k_proj v_proj
    o_proj gate_proj up_proj down_proj) and the token embedding (GPT: wte, Llama: embed_tokens; a tied LM head shares
    its adapter, its base stays frozen); None: every linear layer but the heads"""
    max_steps: Optional[int] = None
    """stop after this many steps (optimizer steps in SFT/RM, iterations in PPO); None: the stage's default schedule"""
    save_every: int = 0
    """save ckpt.pt every N steps (0: only at the end)"""
    resume: bool = False
    """continue from out_dir/ckpt.pt (same world size)"""
    overwrite: bool = False
    """start over in an --out-dir that holds a checkpoint, clearing its old event files and samples"""
    log_every: int = 10
    """print and log training metrics every N steps"""
    peak_flops: Optional[float] = None
    """peak FLOP/s for perf/mfu (None: a table for known GPUs, a short matmul measurement on CPU)"""
    export_hf: Optional[str] = None
    """at the end, also write the model as a Hugging Face folder here (policy: causal LM; RM: sequence classifier)"""


def export_hf(model, tok, out_dir: str) -> None:
    """--export-hf: model.export_hf with the tokenizer's EOS; transformers reads an RM's score at the last token that
    is not its pad id: the tokenizer's pad when that is a vocab id other than EOS, else 0 (right-pad with it)."""
    merge_lora(model)  # the end of the run: adapters fold into the weights for good
    vocab = model.config.vocab_size
    pad = tok.pad_id if 0 <= tok.pad_id < vocab and tok.pad_id != tok.eos_id else None
    model.export_hf(out_dir, eos_id=tok.eos_id, pad_id=pad)
    print0(f"exported a Hugging Face model to {out_dir} (transformers' from_pretrained loads it)")


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temp file and os.replace: a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def file_sha256(path: str) -> str:
    """The sha256 of a file: checkpoints record the hashes of the checkpoints they started from (--resume checks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def exact_div(a: int, b: int, what: str) -> int:
    """a / b when it divides exactly, else a one-line user error that says how to fix it."""
    if b <= 0 or a % b != 0:
        raise UserError(f"{what}: {a} must divide by {b}")
    return a // b


def is_master() -> bool:
    """Rank 0 (also before init_process_group: torchrun sets RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs) -> None:
    if is_master():
        print(*args, **kwargs, flush=True)


def run_main(main: Callable, args) -> None:
    """Run a stage's main(args); a UserError becomes one line on stderr (rank 0 only) and exit code 2."""
    try:
        main(args)
    except UserError as e:
        if is_master():
            print(f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def prepare_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """Called by every stage before any work: a fresh run (no --resume) refuses an out_dir that holds ckpt.pt, unless
    --overwrite, which deletes its ckpt.pt, samples.jsonl, old TensorBoard event files and sharded optimizer folders
    (rank 0; before any process group, so the other ranks only check)."""
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if resume or not os.path.exists(ckpt_path):
        return
    if not overwrite:
        raise UserError(f"{ckpt_path} exists: pass --resume to continue that run, or --overwrite to start over")
    if not is_master():
        return
    for name in os.listdir(out_dir):
        if name.startswith("events.out.tfevents.") or name in ("samples.jsonl", "ckpt.pt"):
            os.remove(os.path.join(out_dir, name))
        elif name.endswith(".dcp"):
            shutil.rmtree(os.path.join(out_dir, name))


# -----------------------------------------------------------------------------
# devices and DDP


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    ddp: bool

    @property
    def master(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """The world size torchrun announces (1 for a plain process), known before any process group: batch sizes are
    checked against it first, so a mistake ends with one line before init_process_group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batch_split(batch_size: int, micro_batch_size: int) -> tuple[int, int, int]:
    """--batch-size over the launched world size, then over the micro-batch (capped at a rank's share: it never
    exceeds it) -> (rows per rank, micro-batch rows, accumulation steps); a mistake is one line, before any process
    group."""
    per_rank = exact_div(batch_size, launched_world_size(), "--batch-size over the world size")
    mbs = min(micro_batch_size, per_rank)
    return per_rank, mbs, exact_div(per_rank, mbs, "--batch-size/world_size over --micro-batch-size")


def load_resume(path: str, kind: str, world_size: int, max_steps: int, inputs: dict) -> dict:
    """--resume: the checkpoint at path, refused if saved with another world size, if it already reached max_steps,
    or if an input checkpoint it started from changed. inputs: {ckpt key of a sha256: (the flag to name, the sha256
    now)}."""
    ck = load_checkpoint(path, kind=kind, flag="--resume")
    if ck["world_size"] != world_size:
        raise UserError(f"--resume {path}: saved with world size {ck['world_size']}, now {world_size}")
    if ck["step"] >= max_steps:
        raise UserError(f"--resume {path}: already at step {ck['step']} of {max_steps} (raise --max-steps)")
    for key, (flag, digest) in inputs.items():
        if ck.get(key, digest) != digest:  # a checkpoint from before hashes were recorded has none to compare
            raise UserError(f"--resume {path}: {flag} changed since the run started (sha256 differs)")
    return ck


def setup_dist(device: str = "auto") -> Dist:
    """Initialise DDP when launched by torchrun (nccl on GPU, gloo on CPU); a plain process otherwise."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, local_rank, world_size = 0, 0, 1
    if ddp:
        rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available here (use --device cpu)")
    if device == "cuda":
        device = f"cuda:{local_rank}"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world_size, dev, ddp)


def use_compile(setting: str, device: torch.device) -> bool:
    """--compile auto | on | off: auto compiles on CUDA only."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def prepare_model(model: torch.nn.Module, args: CommonArgs, role: str = "model") -> None:
    """--grad-ckpt and --lora-rank on a freshly built model (before the optimizer sees its parameters); a LoRA model
    trains its adapters and its scalar head only. A target that matches nothing is a UserError."""
    if args.fsdp and "RANK" not in os.environ:
        raise UserError("--fsdp shards over torchrun's ranks: launch with torchrun --nproc_per_node N (N may be 1)")
    model.set_grad_ckpt(args.grad_ckpt)
    if args.lora_rank <= 0:
        return
    try:
        adapted = add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets)
    except ValueError as error:
        raise UserError(f"--lora-targets {' '.join(args.lora_targets or [])}: {error}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print0(
        f"{role}: LoRA rank {args.lora_rank} alpha {args.lora_alpha:g} on {len(adapted)} layers | trainable "
        f"{trainable / 1e6:.3f} M of {total / 1e6:.2f} M params ({100 * trainable / total:.2f}%)"
    )


def model_state(model: torch.nn.Module, key: str = "model") -> dict:
    """A model's checkpoint entries: `key` = its full state dict with any adapters merged (what later stages load),
    and with LoRA `<key>_lora` = the trainable parameters (adapters, scalar head), which a resume loads onto the base
    rebuilt from --init: the base is never re-derived from merged weights, so the resume is exact. Under --fsdp every
    rank must call it (the shards are gathered); rank 0 gets the entries, the others empty ones."""
    if isinstance(model, FSDPModule):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not state:  # not rank 0
            return {}
    else:
        state = model.state_dict()
    entries = {key: merged_state_dict(model, state)}
    if lora_layers(model):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        entries[f"{key}_lora"] = {name: value.detach() for name, value in state.items() if name in trainable}
    return entries


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, key: str = "model") -> dict:
    """model_state plus the optimizer's state (`optimizer` for the model, `<key>_optimizer` for another key, e.g.
    critic_optimizer): what a checkpoint in out_dir holds of one trained model. Every rank calls it under --fsdp."""
    optimizer_key = "optimizer" if key == "model" else f"{key}_optimizer"
    return model_state(model, key) | {optimizer_key: optimizer_state(model, optimizer, out_dir, optimizer_key)}


def load_model_state(model: torch.nn.Module, ckpt: dict, key: str = "model") -> None:
    """The inverse of model_state on a model built as at the start of the run (the same --init, --lora-rank)."""
    lora = bool(lora_layers(model))
    if lora and f"{key}_lora" not in ckpt:
        raise UserError("--resume with --lora-rank: the checkpoint holds no adapters (it was not a LoRA run)")
    state = ckpt[f"{key}_lora"] if lora else ckpt[key]
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, strict=not lora)
        missing, unexpected = set_model_state_dict(model, state, options=options)
    else:
        missing, unexpected = model.load_state_dict(state, strict=not lora)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if unexpected or any(name in missing for name in trainable):
        raise UserError("--resume: the checkpoint's adapters do not match --lora-rank/--lora-targets")


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, name: str) -> dict:
    """The optimizer's state for a checkpoint in out_dir. Under --fsdp every rank writes its own shard with DCP into a
    new folder beside ckpt.pt (a 7 B model's gathered optimizer state would not fit one host) and the entry is
    {"dcp": the folder's name}; save_checkpoint removes the folders that the new ckpt.pt no longer names."""
    if not isinstance(model, FSDPModule):
        return optimizer.state_dict()
    folder = [f"{name}.{uuid.uuid4().hex[:12]}.dcp"]  # a fresh name: the folder ckpt.pt names now stays whole
    dist.broadcast_object_list(folder, src=0)
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(out_dir, folder[0]))
    return {"dcp": folder[0]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, ckpt_dir: str) -> None:
    """The inverse of optimizer_state; ckpt_dir: the folder of the checkpoint that holds `state`."""
    sharded = isinstance(model, FSDPModule)
    if sharded != ("dcp" in state):
        raise UserError(f"--resume: the checkpoint was saved {'with' if 'dcp' in state else 'without'} --fsdp")
    if not sharded:
        optimizer.load_state_dict(state)
        return
    folder = os.path.join(ckpt_dir, state["dcp"])
    if not os.path.isdir(folder):
        raise UserError(f"--resume: {folder}, the sharded optimizer state beside the checkpoint, is missing")
    sharded_state = get_optimizer_state_dict(model, optimizer)  # the layout DCP loads into, shard by shard
    dcp.load(sharded_state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, sharded_state)


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks FSDP2 shards one by one: GPT's transformer.h, or the Hugging Face model's decoder layers
    (its ModuleList of n_layer modules)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == model.config.n_layer:
            return module
    raise ValueError("no ModuleList of n_layer blocks in the model")


def shard_model(model: torch.nn.Module, d: Dist, dtype: torch.dtype) -> torch.nn.Module:
    """--fsdp: FSDP2 on each block, then on the root (embeddings, final norm, heads), in place. Under bf16 the
    parameters are gathered in bf16 and gradients reduced in fp32 (MixedPrecisionPolicy); autocast stays on around
    the forward for the ops it keeps in fp32."""
    # our forwards return views (scores.squeeze(-1)) but never modify one in place, which is what FSDP2 warns about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    low_precision = dtype if dtype != torch.float32 else None
    policy = MixedPrecisionPolicy(param_dtype=low_precision, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # FSDP2 sets up its root at the first root forward; generation calls the blocks directly, and a block called
    # first would make itself a root: one token through the whole model now, on every rank
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=d.device))
    for module in model.modules():  # the root keeps its parameters gathered after a forward: free them
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def place_model(model: torch.nn.Module, args: CommonArgs, d: Dist, dtype: torch.dtype) -> None:
    """The model onto the device: under --fsdp sharded block by block (a whole model is never there), else moved
    whole. A LoRA BaseView moves only its own head: its base is placed as a model of its own."""
    if args.fsdp and not isinstance(model, BaseView):
        shard_model(model, d, dtype)
    else:
        model.to(d.device)


@contextmanager
def gathered(model: torch.nn.Module):
    """Under FSDP2, every parameter gathered once for a whole generation and freed after it: generate's token steps
    call the blocks (and the root's own layers) outside the root forward, which would otherwise gather per block and
    per token, or not at all. A no-op for an unsharded model."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, FSDPModule) or getattr(model, "gathered", False):  # nested: the outer one frees
        yield
        return
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in sharded:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    model.gathered = True
    try:
        yield
    finally:
        model.gathered = False
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def wrap_model(model: torch.nn.Module, d: Dist, compile: str) -> torch.nn.Module:
    """The training forward: torch.compile (--compile), then DDP under torchrun. Generation, evaluation and saving use
    the raw module."""
    if use_compile(compile, d.device):
        model = torch.compile(model)
    if d.ddp and not isinstance(getattr(model, "_orig_mod", model), FSDPModule):  # FSDP2 needs no wrapper
        model = replicate(model, d)
    return model


def replicate(model: torch.nn.Module, d: Dist) -> DDP:
    """DDP with the gradients as views into its all-reduce buckets: no second copy of every gradient."""
    device_ids = [d.local_rank] if d.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)


def grad_sync(model: torch.nn.Module, sync: bool):
    """Gradient accumulation: DDP all-reduces only where sync (the last micro-batch of a step), through the public
    no_sync(); a plain module needs no context."""
    bare = getattr(model, "_orig_mod", model)
    if isinstance(bare, FSDPModule):  # FSDP2 has no no_sync(): reduce-scatter on the last micro-batch only
        bare.set_requires_gradient_sync(sync)
        return nullcontext()
    if sync or not isinstance(model, DDP):
        return nullcontext()
    return model.no_sync()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype}: expected auto, float32 or bfloat16")
    return getattr(torch, dtype)


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast context (weights stay fp32); a no-op for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (identity without DDP); returns x."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_dict(sums: dict[str, torch.Tensor | float], device) -> dict[str, float]:
    """Named sums over ranks in one all-reduce (float64, stacked in key order on device; identity without DDP)."""
    stacked = torch.stack(
        [torch.as_tensor(value, dtype=torch.float64, device=device).detach() for value in sums.values()]
    )
    return dict(zip(sums, all_reduce_sum(stacked).tolist()))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def cleanup_dist() -> None:
    """The end of a distributed run. Gloo's worker threads free each finished collective's tensors, which takes the
    GIL; a DDP reducer freed later at the end of main (holding the GIL) destroys the process group and joins those
    threads, and if one is still freeing the last all-gather the two wait for each other forever (pytorch/pytorch
    #56297; seen at exit under a loaded CPU). A barrier, then a short GIL-free sleep, lets them finish first."""
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# seeding and RNG state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(generator: Optional[torch.Generator] = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def all_rng_states(generator: Optional[torch.Generator] = None) -> list:
    """Every rank's rng_state, gathered for the checkpoint (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return [rng_state(generator)]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(generator))
    return states


def set_rng_state(state: dict, generator: Optional[torch.Generator] = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


# -----------------------------------------------------------------------------
# checkpoints


def resume(path: str, kind: str, d: Dist, max_steps: int, inputs: dict, model, optimizer, generator=None) -> dict:
    """--resume: the checkpoint (load_resume's checks) restored into the model, the optimizer and this rank's RNG
    states; returns it for the stage's own keys (step, seconds, data_state, ...)."""
    ckpt = load_resume(path, kind, d.world_size, max_steps, inputs)
    load_model_state(model, ckpt)
    load_optimizer_state(model, optimizer, ckpt["optimizer"], os.path.dirname(path))
    set_rng_state(ckpt["rng"][d.rank], generator)
    print0(f"resumed from {path} at step {ckpt['step']}")
    return ckpt


def save_checkpoint(obj: dict, path: str) -> None:
    """Atomic save: write a temp file, fsync it, os.replace; a kill at any moment leaves the old file or the new one.
    Then the sharded optimizer folders beside it (optimizer_state under --fsdp) that the new file does not name go."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    named = {entry["dcp"] for entry in obj.values() if isinstance(entry, dict) and "dcp" in entry}
    for name in os.listdir(folder):
        if name.endswith(".dcp") and name not in named:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def load_checkpoint(path: str, kind: Optional[str | tuple] = None, flag: str = "--init") -> dict:
    """Load one of our checkpoints (our own files: weights_only=False); a missing or wrong-kind file is a UserError."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such checkpoint (run the previous stage first, or pass the right path)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"{flag} {path}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or "kind" not in ckpt or "model" not in ckpt:
        raise UserError(f"{flag} {path}: not a checkpoint written by this repo")
    kinds = (kind,) if isinstance(kind, str) else kind
    if kinds is not None and ckpt["kind"] not in kinds:
        raise UserError(f"{flag} {path}: is a '{ckpt['kind']}' checkpoint, expected {' or '.join(kinds)}")
    return ckpt


# -----------------------------------------------------------------------------
# the optimizer step and its NaN guard


@dataclass
class StepGuard:
    """The NaN guard's state (DESIGN §8): optimizer steps skipped for a non-finite gradient, in all (saved, logged as
    train/skipped_steps) and in a row, and the grad norms of the steps taken since the last read."""

    skipped: int = 0
    skipped_in_row: int = 0
    grad_norms: list[float] = field(default_factory=list)

    def read(self) -> dict[str, float]:
        """train/grad_norm (the mean over the steps taken since the last read: none, no value) and
        train/skipped_steps; starts the next interval."""
        metrics = {}
        if self.grad_norms:
            metrics["train/grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        metrics["train/skipped_steps"] = self.skipped
        self.grad_norms = []
        return metrics


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's clip_grad_norm_ returns the global norm as one), any other tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_and_step(optimizer, parameters, grad_clip: float, guard: StepGuard, step: int) -> tuple[float, bool]:
    """Clip the global grad norm (grad_clip 0: no clip), step if it is finite, else count the skip; zero the grads.
    The norm is taken after DDP's all-reduce, so every rank decides the same (one host sync). Returns (grad norm,
    stepped); 10 skips in a row stop the run."""
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(parameters, grad_clip or float("inf"))).item()
    stepped = math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
        guard.skipped_in_row = 0
        guard.grad_norms.append(grad_norm)
    else:
        guard.skipped += 1
        guard.skipped_in_row += 1
        print0(f"step {step}: non-finite grad norm ({grad_norm}), step skipped")
        if guard.skipped_in_row >= 10:
            raise RuntimeError(f"{guard.skipped_in_row} non-finite steps in a row: lower --lr or check the data")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


# -----------------------------------------------------------------------------
# logging


class Logger:
    """TensorBoard scalars, the console line `step 00042/00500 | loss 1.23 | ...` and out_dir/samples.jsonl, all
    written by rank 0 only. It owns samples.jsonl: a fresh run starts it empty; a resumed run keeps the records of
    steps <= resume_step, and TensorBoard hides the scalars of later steps the same way, so no step appears twice."""

    def __init__(
        self,
        out_dir: str,
        master: bool,
        resume_step: Optional[int] = None,
        console_keys: Optional[tuple[str, ...]] = None,
    ):
        self.writer = None
        self.console_keys = console_keys
        self.samples_path = os.path.join(out_dir, "samples.jsonl")
        if not master:
            return
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides the scalars logged after its checkpoint (steps > resume_step); those of the checkpoint's
        # own step were logged before it was saved and stay
        purge_step = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(out_dir, purge_step=purge_step)  # creates out_dir
        kept = [] if resume_step is None else _records_up_to(self.samples_path, resume_step)
        write_atomic(self.samples_path, "".join(kept))

    def log(self, step: int, metrics: dict, max_steps: Optional[int] = None, console: bool = True) -> None:
        """Every metric to TensorBoard; the console line shows console_keys (those present, in that order) or all."""
        if self.writer is None:
            return
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, float(value), step)
        if not console:
            return
        shown = list(metrics) if self.console_keys is None else [tag for tag in self.console_keys if tag in metrics]
        # keys are the tags' last parts, the whole tag where a last part repeats (policy/loss, value/loss)
        last_parts = [tag.split("/")[-1] for tag in shown]
        keys = [part if last_parts.count(part) == 1 else tag for part, tag in zip(last_parts, shown)]
        head = f"step {step:05d}" + (f"/{max_steps:05d}" if max_steps else "")
        fields = [f"{key} {_fmt(metrics[tag])}" for key, tag in zip(keys, shown)]
        print(" | ".join([head] + fields), flush=True)

    def samples(self, step: int, records: list[dict]) -> None:
        """Append {"step": step, **record} to samples.jsonl, one JSON line per record."""
        if self.writer is None:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **record}) + "\n" for record in records)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _records_up_to(path: str, step: int) -> list[str]:
    """The lines of a samples.jsonl whose record has step <= step (a partial last line, from a kill, is dropped)."""
    if not os.path.exists(path):
        return []
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            if json.loads(line)["step"] <= step:
                kept.append(line)
    return kept


def _fmt(v: float) -> str:
    v = float(v)
    return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}".rstrip("0").rstrip(".")


# -----------------------------------------------------------------------------
# LR schedule and MFU


def lr_at(step: int, max_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warm-up to lr, then cosine decay to lr*min_lr_ratio at max_steps (step counts from 0)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Throughput:
    """perf/tokens_per_sec and perf/mfu over the training time since the last read; time inside
    `with throughput.paused():` (evaluation, saving) is left out."""

    def __init__(self, flops_per_token: float, peak_flops: float, world_size: int):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = world_size
        self.seconds = 0.0
        self.started = time.time()
        # on CPU the peak is measured at start-up: a busy machine lowers it, and every perf/mfu reading rises with it
        print0(f"perf/mfu against a peak of {peak_flops / 1e9:.4g} GFLOP/s per device (--peak-flops sets it)")

    @contextmanager
    def paused(self):
        self.seconds += time.time() - self.started
        try:
            yield
        finally:
            self.started = time.time()

    def read(self, tokens: float) -> dict[str, float]:
        """The rates of `tokens` (summed over ranks) trained since the last read; starts the next interval."""
        now = time.time()
        tokens_per_sec = tokens / (self.seconds + now - self.started)
        self.seconds, self.started = 0.0, now
        mfu = tokens_per_sec * self.flops_per_token / (self.peak_flops * self.world_size)
        return {"perf/tokens_per_sec": tokens_per_sec, "perf/mfu": mfu}


# dense bf16 peak FLOP/s of known GPUs (per device)
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, override: Optional[float] = None) -> float:
    """Peak FLOP/s for MFU: --peak-flops, else a table for known GPUs, else a 0.2 s fp32 matmul measurement (CPU)."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return 100e12  # unknown GPU: say so in the docs; pass --peak-flops for a true figure
    return matmul_flops()


def matmul_flops(sizes: tuple = (512,), trials: int = 5, seconds: float = 0.04) -> float:
    """Best achieved fp32 matmul FLOP/s on CPU over square sizes, the best of a few short trials each (a busy machine
    lowers some of them, rarely all). bench/ppo_throughput.py measures longer and larger for its peak."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        for _ in range(trials):
            iters, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a @ b
                iters += 1
            best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best
