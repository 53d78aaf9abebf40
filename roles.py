"""The models an RL stage runs, by role: the policy (actor, LM head), its frozen reference and the frozen reward
models (scalar heads: one, the K members of an ensemble, or none with --rm-ckpt none), built from their checkpoints;
their training forwards under --compile; and the sampler, a frozen bf16 copy of the actor that generates the rollouts
under bf16, refreshed after every update. A module of its own: parallel.py imports nothing of hf.py, and
checkpoints.py imports parallel.py.
"""

import copy
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

import hf
import parallel
from checkpoints import POLICY_KINDS, load_checkpoint
from common import UserError
from lora import BaseView, merge_lora, merged_state_dict


@dataclass
class Models:
    """The roles both RL stages have. Under LoRA the reference is the actor with its adapters off (lora.BaseView), and
    PPO's first reward model its critic's base with the RM's head. sampler: what generates the rollouts when it is not
    the actor itself, a bf16 copy of it (with_sampler)."""

    actor: torch.nn.Module
    ref: torch.nn.Module
    reward_models: list[torch.nn.Module]
    sampler: Optional[torch.nn.Module] = None

    def frozen(self) -> list[torch.nn.Module]:
        return [self.ref, *self.reward_models]

    def compiled(self, setting: str, device: torch.device) -> "Models":
        """The training forward of each role: torch.compile'd under --compile (a LoRA view switches its base's
        adapters in eager code around the call: not compiled), else the modules themselves. The rollout's no-grad
        passes run it, so the sampler's log-probs are checked against the very forward the update differentiates."""
        if not parallel.use_compile(setting, device):
            return self
        reward_models = [compile_role(m) for m in self.reward_models]
        return Models(compile_role(self.actor), compile_role(self.ref), reward_models, self.sampler)

    def with_sampler(self, dtype: torch.dtype, fsdp: bool) -> "Models":
        """Under bf16 (not --fsdp, whose sharded actor gathers its parameters in bf16 for the rollout already): a
        frozen copy of the actor stored in bf16 (parallel.store_low_precision; LoRA adapters merged) that generates
        the rollouts, so the decode reads 2 bytes a parameter and casts nothing; refresh_sampler copies the actor in
        after every update, in place."""
        if dtype == torch.float32 or fsdp:
            return self
        sampler = merge_lora(copy.deepcopy(self.actor)).requires_grad_(False).eval()
        return replace(self, sampler=parallel.store_low_precision(sampler, dtype))


def policy_checkpoint(spec: str, flag: str) -> dict:
    """A policy's init as a checkpoint dict: our .pt file, or a pretrained model (hf:<name-or-path>, gpt2, ...) as
    an sft checkpoint with no training state."""
    if spec.endswith(".pt"):
        return load_checkpoint(spec, kind=POLICY_KINDS, flag=flag)
    if spec == "scratch":
        raise UserError(f"{flag} scratch: an RL run starts from a trained policy (a .pt checkpoint or hf:<path>)")
    model, tok, _ = hf.load_init(spec, flag=flag)
    return {"kind": "sft", "model": model.state_dict(), "model_config": asdict(model.config), "tokenizer": tok.state()}


def load_inputs(args) -> tuple[dict, dict, list[dict]]:
    """An RL run's inputs (args: rollout.RolloutArgs) as checkpoint dicts: the policy's init, the reference's
    (--ref-ckpt, else the same) and the RMs' (none with --rm-ckpt none), checked to share one tokenizer."""
    sft = policy_checkpoint(args.sft_ckpt, "--sft-ckpt")
    ref = sft
    if args.ref_ckpt is not None:
        ref = policy_checkpoint(args.ref_ckpt, "--ref-ckpt")
    rms = [load_checkpoint(path, kind="rm", flag="--rm-ckpt") for path in args.rm_ckpt if path != "none"]
    others = [("--ref-ckpt", args.ref_ckpt, ref)] + [("--rm-ckpt", p, c) for p, c in zip(args.rm_ckpt, rms)]
    for flag, path, ckpt in others:
        if ckpt["tokenizer"] != sft["tokenizer"]:
            raise UserError(
                f"{flag} {path}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s (train it from this SFT "
                "checkpoint)"
            )
    return sft, ref, rms


@torch.no_grad()
def refresh_sampler(models: Models) -> None:
    """The actor's weights (adapters merged) into its bf16 sampler, in place (copy_: static caches and CUDA graphs
    keep their addresses, no recompile); the actor's fp32 master weights and optimizer state are untouched."""
    if models.sampler is not None:
        models.sampler.load_state_dict(merged_state_dict(models.actor))


def compile_role(model):
    """parallel.compile_forward, except for a LoRA view and a missing role."""
    return model if model is None or isinstance(model, BaseView) else parallel.compile_forward(model)


def build_policy(args, sft: dict, ref: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy (LoRA and --grad-ckpt applied) and its frozen reference from the checkpoints in memory, on the CPU.
    Under LoRA the reference is the policy with its adapters off when it is the policy's init (lora.BaseView)."""
    actor = hf.model_from_checkpoint(sft)
    parallel.prepare_model(actor, args, "actor")
    lora = args.lora_rank > 0
    reference = BaseView(actor) if lora and ref is sft else hf.model_from_checkpoint(ref)
    return actor, reference.requires_grad_(False)


def build_reward_models(args, rms: list[dict], rm_base=None) -> list[torch.nn.Module]:
    """The frozen reward models from their checkpoints in memory, on the CPU. Under LoRA with rm_base (PPO's critic,
    built from the first RM) the first member is that base with the RM's own frozen score head (lora.BaseView); the
    other members of an ensemble are full frozen models."""
    reward_models = []
    for k, rm in enumerate(rms):
        if k == 0 and args.lora_rank > 0 and rm_base is not None:
            head = copy.deepcopy(rm_base.score_head).requires_grad_(False)
            reward_models.append(BaseView(rm_base, score_head=head))
        else:
            reward_models.append(hf.model_from_checkpoint(rm))
    return [model.requires_grad_(False) for model in reward_models]


def place(models: Models, args, d: parallel.Dist, dtype: torch.dtype, critic=None) -> Models:
    """Every role on the device in eval mode (dropout off in every model): what trains (the actor, PPO's critic) in
    fp32, what is frozen stored in bf16 under bf16 (docs/design.md §7), all of it sharded under --fsdp; then, under
    bf16, the sampler (with_sampler)."""
    trained = [models.actor] + ([critic] if critic is not None else [])
    for model in trained + models.frozen():
        model.eval()
        frozen = not any(model is other for other in trained)
        parallel.place_model(model, args, d, dtype, frozen=frozen)
    return models.with_sampler(dtype, args.fsdp)
