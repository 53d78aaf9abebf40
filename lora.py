"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): low-rank adapters on linear layers and the token
embedding, the base frozen, written here (no peft). `add_lora` puts them on any model (a native `model.GPT` or the
Hugging Face adapter of hf.py); checkpoints store the adapters, and their reader merges them onto the rebuilt base
(`merged_state_dict`; under bf16 a reader keeps them unmerged: a small update would round away in a bf16 base);
`BaseView` is the frozen base as a module of its own (PPO's reference and reward model, DPO's
reference).
"""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def lora_pair(base: Tensor, rank: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Adapters for a base weight (out, in): A (r, in) initialised like an nn.Linear's weight and B (out, r) at zero,
    so B A = 0 and an adapted model starts equal to its base."""
    lora_a = nn.Parameter(torch.empty(rank, base.shape[1], device=base.device, dtype=base.dtype))
    lora_b = nn.Parameter(torch.zeros(base.shape[0], rank, device=base.device, dtype=base.dtype))
    nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))  # nn.Linear's own init
    return lora_a, lora_b


def at_least_fp32(tensor: Tensor) -> Tensor:
    """A bf16 (or fp16) tensor in fp32; fp32 and fp64 as they are. What a merge adds in: merged into a bf16 base, an
    update under half the grid's spacing at a weight would round back to the weight."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def plus_update(output: Tensor, update: Tensor) -> Tensor:
    """An adapted layer's output: the base's plus the adapter's update. Under autocast the base's output is bf16, on
    bf16's grid, where an update under half its spacing would round away: the sum is in fp32. Outside autocast (fp32
    runs, FSDP2's bf16 parameters) as before, bit for bit."""
    if torch.is_autocast_enabled(output.device.type):
        return output.float() + update.float()
    return output + update


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update: y = x Wᵀ + b + (alpha / r) · x Aᵀ Bᵀ, with A and B from lora_pair. With
    lora_enabled False it is the base alone (PPO's reference is the actor with its adapters off). It is an nn.Linear:
    weight and bias keep their names, and the adapters add `lora_a`, `lora_b` beside them."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight  # the base's own tensors: no copy
        self.bias = base.bias
        self.lora_a, self.lora_b = lora_pair(base.weight, rank)
        self.scaling = alpha / rank
        self.lora_enabled = True

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if not self.lora_enabled:
            return y
        return plus_update(y, F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling)

    def merged_weight(self) -> Tensor:
        """The base weight plus the update, in fp32 over a bf16 base (at_least_fp32)."""
        return at_least_fp32(self.weight) + at_least_fp32(self.lora_b @ self.lora_a) * self.scaling


class LoRAEmbedding(nn.Embedding):
    """nn.Embedding plus a low-rank update of its table (num, dim): E + (alpha / r) · B A, A and B from lora_pair.
    When the LM head is tied to this table (GPT: lm_head.weight is wte.weight), pass the head's LoRALinear as `tied`:
    the two share A and B, so the input and output embeddings move together and stay one matrix when merged."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float, tied: LoRALinear | None = None):
        super().__init__(base.num_embeddings, base.embedding_dim, padding_idx=base.padding_idx, device="meta")
        self.weight = base.weight
        if tied is not None:
            self.lora_a, self.lora_b = tied.lora_a, tied.lora_b  # the same Parameters: one adapter, two uses
        else:
            self.lora_a, self.lora_b = lora_pair(base.weight, rank)
        self.scaling = alpha / rank
        self.lora_enabled = True

    def forward(self, idx: Tensor) -> Tensor:
        x = super().forward(idx)
        if not self.lora_enabled:
            return x
        return plus_update(x, F.embedding(idx, self.lora_b) @ self.lora_a * self.scaling)

    merged_weight = LoRALinear.merged_weight  # the same fold: weight + (alpha / r) B A


HEAD_NAMES = ("lm_head", "score_head", "score")  # adapted only through a tied embedding target; scalar heads train


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str] | None = None) -> list[str]:
    """Put adapters on the model in place and freeze everything but them and the scalar head. targets: the modules'
    last name parts, linear layers (c_attn, q_proj, ...) or the token embedding (wte, embed_tokens; a tied LM head
    shares its adapter); None = every nn.Linear outside the heads. Returns the adapted names; no match: ValueError."""
    adapted = []
    for name, module in list(model.named_modules()):
        last = name.rsplit(".", 1)[-1]
        if type(module) is nn.Embedding and targets is not None and last in targets:
            linears = [(other_name, other) for other_name, other in model.named_modules() if type(other) is nn.Linear]
            tied = [other_name for other_name, other in linears if other.weight is module.weight]
            head = None
            if tied:  # an LM head tied to this table shares its adapter
                head = LoRALinear(model.get_submodule(tied[0]), rank, alpha)
                model.set_submodule(tied[0], head)
                adapted.append(tied[0])
            model.set_submodule(name, LoRAEmbedding(module, rank, alpha, tied=head))
            adapted.append(name)
        elif type(module) is nn.Linear and last not in HEAD_NAMES and (targets is None or last in targets):
            model.set_submodule(name, LoRALinear(module, rank, alpha))
            adapted.append(name)
    if not adapted:
        raise ValueError(f"no linear layer or embedding matches the LoRA targets {targets}")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name or name.startswith("score_head."))
    return adapted


def lora_layers(model: nn.Module) -> list[LoRALinear | LoRAEmbedding]:
    return [module for module in model.modules() if isinstance(module, (LoRALinear, LoRAEmbedding))]


@contextmanager
def lora_disabled(model: nn.Module):
    """The base model inside: every adapter of `model` off, restored on exit."""
    layers = lora_layers(model)
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.lora_enabled = True


def merged_state_dict(model: nn.Module, state: dict | None = None) -> dict:
    """The state dict a model without adapters would have: every adapter folded into its weight, the lora_ keys
    dropped. What a LoRA checkpoint's reader gets (hf.merged_weights), so later stages, eval.py under fp32 and
    export_hf see merged weights, in fp32 over a bf16 base (at_least_fp32). state: the model's full state dict if
    gathered elsewhere (FSDP2), else model.state_dict()."""
    state = dict(model.state_dict() if state is None else state)
    merged = {}  # base weight's storage -> merged weight: a tied embedding and LM head stay one tensor
    for name, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRAEmbedding)):
            lora_a, lora_b = state.pop(f"{name}.lora_a"), state.pop(f"{name}.lora_b")
            weight = state[f"{name}.weight"]
            if weight.data_ptr() not in merged:
                update = at_least_fp32(lora_b @ lora_a) * module.scaling
                merged[weight.data_ptr()] = (at_least_fp32(weight) + update).detach()
            state[f"{name}.weight"] = merged[weight.data_ptr()]
    return state


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put a plain nn.Linear or nn.Embedding back in its place (in place;
    returns the model). A tied embedding and LM head get one merged weight, still tied."""
    merged = {}  # id(base weight) -> merged Parameter
    for name, module in list(model.named_modules()):
        if not isinstance(module, (LoRALinear, LoRAEmbedding)):
            continue
        if id(module.weight) not in merged:
            merged[id(module.weight)] = nn.Parameter(module.merged_weight(), requires_grad=False)
        if isinstance(module, LoRALinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            plain.bias = module.bias
        else:
            plain = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device="meta")
        plain.weight = merged[id(module.weight)]
        model.set_submodule(name, plain)
    return model


class BaseView(nn.Module):
    """The frozen base under a LoRA-adapted model, as a module of its own, without a second copy of its weights: PPO's
    reference is BaseView(actor), its reward model BaseView(critic, the RM's own score head). forward runs the shared
    model with its adapters off (and this view's scalar head in place of the model's)."""

    def __init__(self, model: nn.Module, score_head: nn.Module | None = None):
        super().__init__()
        self.shared = [model]  # a list: not a submodule, so the view owns no parameters but its head
        self.score_head = score_head
        self.config = model.config

    @contextmanager
    def _base(self):
        model = self.shared[0]
        own_head = model.score_head
        if self.score_head is not None:
            model.score_head = self.score_head
        try:
            with lora_disabled(model):
                yield model
        finally:
            model.score_head = own_head

    def forward(self, *args, **kwargs):
        with self._base() as model:
            return model(*args, **kwargs)
