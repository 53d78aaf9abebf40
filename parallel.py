"""Devices and parallelism, plain torch: DDP and FSDP2 set-up under torchrun (gloo on CPU, nccl on GPU), batch splits
over ranks (an RL rollout's too), the dtype, torch.compile, model placement (--fsdp sharding, --lora-rank,
--grad-ckpt), gradient accumulation without a sync (and an RL update's micro-batches), and the collectives the stages
use (named sums in one all-reduce, moments over every rank). Dtypes and sharding: docs/design.md §7.
"""

import os
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import CommonArgs, UserError, exact_div, print0
from lora import BaseView, add_lora


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


@dataclass(frozen=True)
class RolloutSizes:
    """An RL run's derived sizes, per rank."""

    prompts_per_rank: int  # a rank's responses per iteration / group_size: a group never straddles two ranks
    micro_batch_size: int  # rows per forward, at most a rank's share of a minibatch
    grad_accum_steps: int  # micro-batches per optimizer step
    ptx_micro_batch_size: int  # pre-training texts per micro-batch (0: no ptx loss)


def rollout_split(args, group_size: int, has_ptx: bool) -> RolloutSizes:
    """--rollout-batch-size over the launched world size, the group, the minibatches and the micro-batch (batch_split's
    rule: capped at a rank's share of a minibatch), each split checked with exact_div: a mistake ends here, before
    any process group."""
    launched = launched_world_size()
    rows_per_rank = exact_div(args.rollout_batch_size, launched, "--rollout-batch-size over the world size")
    prompts_per_rank = exact_div(rows_per_rank, group_size, "--rollout-batch-size/world_size over --group-size")
    minibatch_rows = exact_div(
        rows_per_rank, args.num_minibatches, "--rollout-batch-size/world_size over --num-minibatches"
    )
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    ptx_micro_batch_size = 0
    if has_ptx:  # checked only when there is a ptx loss to compute
        ptx_micro_batch_size = exact_div(
            args.ptx_batch_size, launched * grad_accum_steps, "--ptx-batch-size over world_size * accum steps"
        )
    return RolloutSizes(prompts_per_rank, micro_batch_size, grad_accum_steps, ptx_micro_batch_size)


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
    if dev.type == "cuda":  # no TF32: --dtype float32 means fp32 (bf16 autocast runs its matmuls in bf16 anyway)
        torch.cuda.set_device(dev)
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world_size, dev, ddp)


def use_compile(setting: str, device: torch.device) -> bool:
    """--compile auto | on | off: auto compiles on CUDA only."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype}: expected auto, float32 or bfloat16")
    return getattr(torch, dtype)


def full_precision(dtype: torch.dtype) -> bool:
    """fp32 with fp32 matmuls: no autocast, and no TF32 (torch's default, which setup_dist keeps)."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


# -----------------------------------------------------------------------------
# models: LoRA and activation checkpointing, placement, sharding, the training forward


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


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks FSDP2 shards one by one: GPT's transformer.h, or the Hugging Face model's decoder layers
    (its ModuleList of n_layer modules)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == model.config.n_layer:
            return module
    raise ValueError("no ModuleList of n_layer blocks in the model")


def is_sharded(model) -> bool:
    """An FSDP2 module (torch's FSDPModule)? Read without importing FSDP2, which costs a second at every start-up:
    until something imports it (shard_model, under --fsdp), no module is sharded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def shard_model(model: torch.nn.Module, d: Dist, dtype: torch.dtype) -> torch.nn.Module:
    """--fsdp: FSDP2 on each block, then on the root (embeddings, final norm, heads), in place. Under bf16 the
    parameters are gathered in bf16 and gradients reduced in fp32 (MixedPrecisionPolicy); autocast stays on around
    the forward for the ops it keeps in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
        if is_sharded(module):
            module.reshard()
    return model


def store_low_precision(
    model: torch.nn.Module, dtype: torch.dtype, everything: bool = False, frozen_only: bool = False
) -> torch.nn.Module:
    """A frozen model stored in dtype, in place: every matrix (linear layers, embeddings, heads), which autocast
    casts at every op anyway; norms and biases stay fp32. everything: the 1-D parameters too (--fsdp).
    frozen_only: only the parameters that do not train (a LoRA model's base). Returns the model."""
    for parameter in model.parameters():
        if frozen_only and parameter.requires_grad:
            continue
        if parameter.is_floating_point() and (everything or parameter.dim() >= 2):
            parameter.data = parameter.data.to(dtype)
    return model


def place_model(model: torch.nn.Module, args: CommonArgs, d: Dist, dtype: torch.dtype, frozen: bool = False) -> None:
    """The model onto the device: under --fsdp sharded block by block, else moved whole. frozen: stored in dtype
    under bf16, as is a LoRA model's frozen base (not under --fsdp). A LoRA BaseView moves only its own head."""
    low_precision = dtype != torch.float32 and not isinstance(model, BaseView)
    if low_precision and frozen:
        store_low_precision(model, dtype, everything=args.fsdp)
    elif low_precision and args.lora_rank > 0 and not args.fsdp:  # a LoRA model's frozen base, adapters in fp32
        store_low_precision(model, dtype, frozen_only=True)
    if args.fsdp and not isinstance(model, BaseView):
        shard_model(model, d, dtype)
    else:
        model.to(d.device)


@contextmanager
def gathered(model: torch.nn.Module):
    """Under FSDP2, every parameter gathered once for a whole generation (the decode calls the blocks outside the
    root forward) and freed after it; a BaseView gathers the model it shares. A no-op for an unsharded model."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, BaseView):
        model = model.shared[0]
    if not is_sharded(model) or getattr(model, "gathered", False):  # nested: the outer one frees
        yield
        return
    sharded = [module for module in model.modules() if is_sharded(module)]
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


# dynamo caches graphs per code object, and every model of a run is an entry of GPT.forward's: 6 + K for PPO with K
# reward models, so the default limit of 8 would leave an ensemble's last members eager
RECOMPILE_LIMIT = 64


def compile_forward(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile of a training forward with dynamic shapes: every batch, sequence length and logits_to_keep is
    one graph, so a run compiles each call signature once (bench/recompiles.py)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(model, dynamic=True)


def wrap_model(model: torch.nn.Module, d: Dist, compile: str) -> torch.nn.Module:
    """The training forward: torch.compile (--compile), then DDP under torchrun. Generation, evaluation and saving use
    the raw module."""
    if use_compile(compile, d.device):
        model = compile_forward(model)
    return wrap_ddp(model, d)


def wrap_ddp(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """A training forward under torchrun, DDP-wrapped (FSDP2 needs no wrapper), with the gradients as views into DDP's
    all-reduce buckets: no second copy of every gradient. Alone, the forward itself."""
    if d.ddp and not is_sharded(getattr(model, "_orig_mod", model)):
        device_ids = [d.local_rank] if d.device.type == "cuda" else None
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return model


def backward_global(loss: torch.Tensor) -> None:
    """The backward of a loss over the global batch (a sum over every rank's rows divided by a global count): DDP
    averages gradients over ranks, so the loss is scaled by the world size first."""
    (loss * (dist.get_world_size() if dist.is_initialized() else 1)).backward()


def grad_sync(model: torch.nn.Module, sync: bool):
    """Gradient accumulation: DDP all-reduces only where sync (the last micro-batch of a step), through the public
    no_sync(); a plain module needs no context."""
    bare = getattr(model, "_orig_mod", model)
    if is_sharded(bare):  # FSDP2 has no no_sync(): reduce-scatter on the last micro-batch only
        bare.set_requires_gradient_sync(sync)
        return nullcontext()
    if sync or not isinstance(model, DDP):
        return nullcontext()
    return model.no_sync()


# -----------------------------------------------------------------------------
# an RL update's micro-batches


def take_rows(batch: dict, index, width: Optional[int] = None) -> dict:
    """The rows `index` of every tensor of an experience dict; width: response-shaped tensors (B, T) trimmed to their
    first `width` columns (a micro-batch's longest response), the prompts kept whole."""
    taken = {}
    for key, value in batch.items():
        value = value[index]
        if width is not None and value.dim() == 2 and key not in ("query", "query_mask"):
            value = value[:, :width]
        taken[key] = value
    return taken


def micro_batch_widths(lengths: list[int], order: list[int], micro_batch_size: int) -> list[int]:
    """Each micro-batch's longest response over a shuffled rollout (lengths per row, read from the device once per
    update; order: the epoch's permutation as a list): the width its right padding is trimmed to."""
    return [
        max(lengths[row] for row in order[s : s + micro_batch_size]) for s in range(0, len(order), micro_batch_size)
    ]


# -----------------------------------------------------------------------------
# collectives


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (identity without DDP); returns x."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_stack(values: list[torch.Tensor | float], device) -> torch.Tensor:
    """Sums over ranks in one all-reduce, stacked as float64 on device and left there: no host sync."""
    stacked = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).detach() for value in values])
    return all_reduce_sum(stacked)


def global_moments(x: torch.Tensor, mask: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of x over the valid entries of every rank (one all-reduce, float64 on device: no host
    sync), as float32 tensors; no valid entry anywhere gives mean 0 and variance 0, not a NaN."""
    masked = x * mask
    count, total, total_squared = all_reduce_stack([mask.sum(), masked.sum(), (masked**2).sum()], device)
    count = count.clamp(min=1.0)
    mean = total / count
    variance = total_squared / count - mean**2
    return mean.float(), variance.float()


def all_reduce_dict(sums: dict[str, torch.Tensor | float], device) -> dict[str, float]:
    """Named sums over ranks in one all-reduce (float64, stacked in key order on device; identity without DDP), read
    on the host: one host sync."""
    return dict(zip(sums, all_reduce_stack(list(sums.values()), device).tolist()))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def cleanup_dist() -> None:
    """The end of a distributed run: a barrier and a short GIL-free sleep before destroy_process_group, so gloo's
    workers finish freeing the last collective first (a deadlock at exit otherwise, pytorch/pytorch#56297)."""
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)
        dist.destroy_process_group()
