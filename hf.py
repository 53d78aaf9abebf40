"""Any Hugging Face causal LM (Llama, Qwen, GPT-2, ...) behind the interface of `model.GPT`: forward -> (logits,
scores) with padding handled the same way, an optional scalar head, batched KV-cache generation (its own `prefill`),
parameter and FLOP counts, optimizer groups, our checkpoints and `export_hf`.

`--init hf:<name-or-path>` builds one; a checkpoint whose model_config holds `hf_config` rebuilds one from that config
alone (no hub access). At the end, `model_from_checkpoint`, the loader of our checkpoints (a native `model.GPT` or an
`HFCausalLM`), and `load_init`, which reads every `--init` spec (docs/design.md §2).
"""

import inspect
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from checkpoints import check_base, export_hf, load_checkpoint
from common import UserError
from generate import EVERY_ROW, cache_dtype, decode_compile_mode, static_layout
from lora import add_lora, merged_state_dict
from model import GPT, GPTConfig, strip_wrapper_prefixes
from parallel import store_low_precision
from tokenizer import Tokenizer, hub_error, load_tokenizer


@dataclass
class HFConfig:
    """What the stages read from `model.config`, plus what rebuilds the wrapped model (saved as model_config)."""

    block_size: int  # max_position_embeddings (or n_positions)
    vocab_size: int  # rows of the input embedding = width of the logits
    n_layer: int
    n_head: int
    n_embd: int
    lm_head: bool = True  # logits are computed (policy, reference, reward model)
    score_head: bool = False  # scalar head nn.Linear(n_embd, 1) on the last hidden state (critic, reward model)
    hf_name_or_path: str = ""  # where the weights first came from (for the record)
    hf_config: dict = field(default_factory=dict)  # the HF config's to_dict(): rebuilds the architecture offline


def _no_dropout(hf_config) -> None:
    """Zero every dropout probability the HF config holds: dropout is off in every RLHF stage."""
    for k, v in hf_config.to_dict().items():
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            setattr(hf_config, k, 0.0)


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, lm_head: bool = True, score_head: bool = False, name_or_path: str = ""):
        super().__init__()
        assert lm_head or score_head, "a model needs an lm_head or a score_head (or both)"
        self.hf = hf_model
        c = hf_model.config
        C = c.hidden_size
        self.config = HFConfig(
            block_size=getattr(c, "max_position_embeddings", None) or c.n_positions,
            vocab_size=hf_model.get_input_embeddings().num_embeddings,
            n_layer=c.num_hidden_layers,
            n_head=c.num_attention_heads,
            n_embd=C,
            lm_head=lm_head,
            score_head=score_head,
            hf_name_or_path=name_or_path,
            hf_config=c.to_dict(),
        )
        self.head_dim = getattr(c, "head_dim", None) or C // c.num_attention_heads
        for m in self.hf.modules():  # belt and braces: modules that kept a dropout probability of their own
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        out = self.hf.get_output_embeddings()
        if not lm_head and out is not None and out.weight is not self.hf.get_input_embeddings().weight:
            out.weight.requires_grad_(False)  # an untied lm head a critic never uses: no grads, no DDP complaints
        # the scalar head starts small and unbiased (InstructGPT / summarize_from_feedback), as in model.GPT
        self.score_head = nn.Linear(C, 1) if score_head else None
        if self.score_head is not None:
            nn.init.normal_(self.score_head.weight, mean=0.0, std=1 / math.sqrt(C + 1))
            nn.init.zeros_(self.score_head.bias)
            self.score_head.to(self.hf.dtype)
        self.grad_ckpt = False
        params = inspect.signature(self.hf.forward).parameters  # transformers >= 5.24 renamed past_key_values
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params

    # --- construction

    @classmethod
    def from_pretrained(cls, name_or_path: str, lm_head: bool = True, score_head: bool = False) -> "HFCausalLM":
        """Weights from the hub or a local folder, in fp32 (bf16 comes from autocast), dropout off."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(name_or_path)
        _no_dropout(hf_config)
        hf = AutoModelForCausalLM.from_pretrained(name_or_path, config=hf_config, dtype=torch.float32)
        return cls(hf, lm_head=lm_head, score_head=score_head, name_or_path=name_or_path)

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: str | os.PathLike | dict,
        key: str = "model",
        lm_head: bool | None = None,
        score_head: bool | None = None,
        map_location: str | torch.device = "cpu",
    ) -> "HFCausalLM":
        """The adapter half of model_from_checkpoint (which dispatches on the checkpoint's kind): architecture from
        model_config["hf_config"] (AutoModelForCausalLM.from_config, nothing downloaded), weights from ckpt[key]
        (merged_weights: a LoRA checkpoint's merged onto its base).
        Heads default to what was saved (the lm head as ckpt[f"{key}_config"] says: PPO saves critic_config, else
        model_config); a score head asked for but absent starts fresh (an RM from an SFT model), one not asked for is
        dropped."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        if not isinstance(ckpt, dict):
            ckpt = torch.load(ckpt, map_location=map_location, weights_only=False)  # our own files hold RNG states
        saved_config = ckpt.get(f"{key}_config", ckpt["model_config"])
        state_dict = strip_wrapper_prefixes(merged_weights(ckpt, key))
        lm_head = saved_config["lm_head"] if lm_head is None else lm_head
        score_head = "score_head.weight" in state_dict if score_head is None else score_head
        hf_config = AutoConfig.for_model(**saved_config["hf_config"])
        _no_dropout(hf_config)
        with no_init_weights():  # every weight is loaded below: a random init would cost seconds and draw from the seed
            hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model = cls(hf_model, lm_head, score_head, saved_config.get("hf_name_or_path", ""))
        own = model.state_dict()
        fresh = {k: own[k] for k in own if k.startswith("score_head.") and k not in state_dict}
        model.load_state_dict({k: v for k, v in state_dict.items() if k in own} | fresh)
        return model.to(map_location)

    def export_hf(self, out_dir: str, eos_id: int | None = None, pad_id: int | None = None) -> None:
        """A policy: save_pretrained of the wrapped causal LM. A reward model: an AutoModelForSequenceClassification
        (num_labels=1) whose `score` layer is our head; it reads the score at the last token that is not pad_id, so
        right-pad with it. A bias the `score` layer cannot hold is saved as `score_bias` in config.json and printed."""
        from transformers import AutoModelForSequenceClassification

        assert self.config.lm_head, "export_hf needs an lm head (a policy or a reward model, not a critic)"
        if self.score_head is None:
            self.hf.save_pretrained(out_dir)
            return
        cfg = self.hf.config.__class__.from_dict(self.hf.config.to_dict())
        cfg.num_labels, cfg.pad_token_id = 1, (0 if eos_id != 0 else 1) if pad_id is None else pad_id
        cfg.eos_token_id = cfg.eos_token_id if eos_id is None else eos_id
        assert cfg.pad_token_id != cfg.eos_token_id, f"pad_id {cfg.pad_token_id} must differ from EOS"
        seq = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
        # the body under each head: model.model (Llama, Qwen), model.transformer (GPT-2)
        sequence_trunk = getattr(seq, seq.base_model_prefix)
        causal_trunk = getattr(self.hf, self.hf.base_model_prefix)
        sequence_trunk.load_state_dict(causal_trunk.state_dict())
        with torch.no_grad():
            seq.score.weight.copy_(self.score_head.weight.float())
            bias = float(self.score_head.bias)
            if seq.score.bias is not None:
                seq.score.bias.fill_(bias)
                bias = 0.0
        seq.config.score_bias = bias
        seq.save_pretrained(out_dir)
        if bias:
            print(
                f"export_hf: {type(seq).__name__}'s score layer has no bias: add score_bias {bias:+.4f} "
                f"(config.json) to its scores to get ours"
            )

    # --- what the stages call

    def set_grad_ckpt(self, enabled: bool) -> None:
        """--grad-ckpt through transformers' own per-layer checkpointing (non-reentrant)."""
        self.grad_ckpt = enabled
        if hasattr(self.hf, "activation_checkpointing_enable"):  # transformers >= 5.24's name
            enable, disable = self.hf.activation_checkpointing_enable, self.hf.activation_checkpointing_disable
        else:
            enable, disable = self.hf.gradient_checkpointing_enable, self.hf.gradient_checkpointing_disable
        if enabled:
            enable({"use_reentrant": False})
        else:
            disable()
        self.train(self.training)

    def train(self, mode: bool = True) -> "HFCausalLM":
        """transformers recomputes activations in train mode only: with --grad-ckpt the wrapped model stays in train
        mode (dropout is 0 in every model here, so nothing else changes; PPO keeps its models in eval mode)."""
        super().train(mode)
        if self.grad_ckpt:
            self.hf.train()
        return self

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, tied weights once. non_embedding drops the embedding tables (token and, if any, position)
        except the one that doubles as the lm head in use, and an untied lm head a model without lm_head never uses."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            out = self.hf.get_output_embeddings()
            in_use = out.weight if (self.config.lm_head and out is not None) else None
            tables = [m.weight for m in self.hf.modules() if isinstance(m, nn.Embedding) and m.weight is not in_use]
            n -= sum(w.numel() for w in tables)
            if out is not None and in_use is None and out.weight is not self.hf.get_input_embeddings().weight:
                n -= out.weight.numel()
        return n

    def flops_per_token(self, T: int) -> int:
        """Training FLOPs per token at context T, the PaLM estimate (appendix B): 6N + 12·L·H·Q·T, as model.GPT."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * self.head_dim * T

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float], device_type: str
    ) -> torch.optim.AdamW:
        """AdamW; weight decay on every 2D+ parameter, none on biases and norms (model.GPT's groups)."""
        return GPT.configure_optimizers(self, weight_decay, learning_rate, betas, device_type)

    def _tokens(self, idx: Tensor) -> dict:
        """Token ids -> the HF kwarg that feeds them: input_ids, or for embeddings stored in bf16 (a frozen model,
        parallel.store_low_precision) inputs_embeds in fp32, so the residual stream stays fp32 as under autocast."""
        embedding = self.hf.get_input_embeddings()
        if embedding.weight.dtype in (torch.float32, torch.float64):
            return {"input_ids": idx}
        return {"inputs_embeds": embedding(idx).float()}

    def _inputs(self, idx: Tensor, real: Tensor) -> dict:
        """Padded ids and the mask -> HF kwargs: pad ids replaced by 0 before the embedding, position ids explicit
        from the mask (the HF default would count the left padding)."""
        idx = idx.masked_fill(~real | (idx < 0) | (idx >= self.config.vocab_size), 0)
        pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        return self._tokens(idx) | dict(attention_mask=real.long(), position_ids=pos)

    def forward(
        self, idx: Tensor, attention_mask: Tensor | None = None, logits: bool = True, logits_to_keep: int = 0
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) long, attention_mask (B, T) 1 = real token or None (no padding) -> (logits (B, T, V) or None,
        scores (B, T) or None); padding never changes a real token's outputs. logits_to_keep > 0: logits of the last
        logits_to_keep positions only."""
        T = idx.size(1)
        assert T <= self.config.block_size, f"sequence of length {T} > block_size {self.config.block_size}"
        real = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        inputs = self._inputs(idx, real)
        if attention_mask is None:  # plain causal fast path, positions 0..T-1
            inputs = {key: value for key, value in inputs.items() if key in ("input_ids", "inputs_embeds")}
        want_logits = logits and self.config.lm_head
        if want_logits:  # the full causal LM: its own lm head, logit scaling or soft-capping included
            keep = {"logits_to_keep": logits_to_keep} if self._keep_kw and logits_to_keep > 0 else {}
            out = self.hf(**inputs, use_cache=False, output_hidden_states=self.score_head is not None, **keep)
            out_logits, h = out.logits, (out.hidden_states[-1] if self.score_head is not None else None)
            if logits_to_keep > 0 and out_logits.size(1) > logits_to_keep:  # a model without the argument
                out_logits = out_logits[:, -logits_to_keep:]
        else:  # the trunk alone: no (B, T, V) logits for a critic or a score-only pass
            out_logits, h = None, self.hf.base_model(**inputs, use_cache=False).last_hidden_state  # (B, T, C)
        scores = self.score_head(h).squeeze(-1) if self.score_head is not None else None
        return out_logits, scores

    @contextmanager
    def decoding(self):
        """The wrapped model in eval mode for a decode, its mode restored after: under --grad-ckpt it stays in train
        mode (train), and transformers' GPT-2 (like GPT-Neo, Bloom, Falcon, MPT) drops its KV cache whenever it
        checkpoints activations in train mode, so every decode step would see one token."""
        training = self.hf.training
        self.hf.eval()
        try:
            yield
        finally:
            self.hf.train(training)

    def prefill(self, idx: Tensor, real: Tensor, max_new_tokens: int, compiled: bool, shared=None):
        """generate.generate's prefill through the HF model's own KV cache: returns (the last prompt position's
        logits (B, V), advance(token, step) -> the next logits). compiled: a StaticCache and a compiled one-token
        forward where transformers marks the model compilable (_can_compile_fullgraph), else eager. shared:
        generate.shared_prompts' (first, prompt_of), a distinct prompt prefilled once."""
        if compiled and getattr(self.hf, "_can_compile_fullgraph", False):
            return self._static_prefill(idx, real, max_new_tokens, shared)
        return self._prefill(idx, real, max_new_tokens, shared)

    def _prefill(self, idx: Tensor, real: Tensor, max_new_tokens: int, shared=None):
        """The eager decode: a DynamicCache growing by a token a step; returns (the last prompt position's logits
        (B, V), advance(token, step) -> the next logits)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        B, P = idx.size()
        n_real = real.long().sum(-1)  # (B,) real prompt tokens
        key_real = torch.cat([real, real.new_ones(B, max_new_tokens)], dim=1).long()  # (B, P + max_new_tokens)
        cache = DynamicCache(config=self.hf.config)  # sliding-window and hybrid layers laid out per the config
        plain = cache.layers and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)
        shared = shared if plain else None  # a hybrid model's other states: every row prefilled
        first, prompt_of = shared or EVERY_ROW
        kw = {self._cache_kw: cache, "use_cache": True} | ({"logits_to_keep": 1} if self._keep_kw else {})
        logits = self.hf(**self._inputs(idx[first], real[first]), **kw).logits[:, -1][prompt_of]  # (B, V)
        if shared is not None:
            cache.batch_select_indices(prompt_of)  # each row's copy of its prompt's keys and values

        def advance(tok: Tensor, step: int) -> Tensor:
            # the new token sits at position n_real + step; it sees the real prompt keys and all new keys
            Tk = P + step + 1
            pos = (n_real + step).clamp(max=self.config.block_size - 1)[:, None]  # (B, 1); past a row's budget: unused
            out = self.hf(**self._tokens(tok[:, None]), attention_mask=key_real[:, :Tk], position_ids=pos, **kw)
            return out.logits[:, -1]  # (B, V)

        return logits, advance

    def _static_prefill(self, idx: Tensor, real: Tensor, max_new_tokens: int, shared=None):
        """The fixed-shape decode: prompts left-padded to a multiple of 16, a StaticCache of width + max_new_tokens
        slots, the prefill eager, then the compiled forward at the same shapes every step (one token, its position, the
        whole (B, max_len) key mask). shared: as _prefill's (the distinct prompts prefilled into a StaticCache of
        their own, copied into the kept one)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        idx, real, key_real, width = static_layout(idx, real, max_new_tokens, self.config.block_size)
        key_real = key_real.long()  # (B, max_len)
        n_real = real.long().sum(-1)  # (B,)
        dtype = cache_dtype(idx.device, self.hf.dtype)
        key = (idx.size(0), width + max_new_tokens, dtype, idx.device)  # kept from the last call of this shape
        if getattr(self, "_kept_cache", (None,))[0] != key:
            self._kept_cache = None  # free the old buffers first
            self._kept_cache = (key, StaticCache(config=self.hf.config, max_cache_len=width + max_new_tokens))
        cache = self._kept_cache[1]
        cache.reset()  # zeros, and no slot written yet
        if not all(type(layer) is StaticLayer for layer in cache.layers):
            shared = None  # sliding-window or hybrid layers: every row prefilled
        first, prompt_of = shared or EVERY_ROW
        kw = {self._cache_kw: cache, "use_cache": True} | ({"logits_to_keep": 1} if self._keep_kw else {})
        prefill_kw = kw  # the distinct prompts' own StaticCache when some rows share one
        if shared is not None:
            prefill_kw = kw | {self._cache_kw: StaticCache(config=self.hf.config, max_cache_len=width + max_new_tokens)}
        inputs = self._inputs(idx[first], real[first]) | {"attention_mask": key_real[first]}
        logits = self.hf(**inputs, **prefill_kw).logits[:, -1][prompt_of]  # (B, V)
        if shared is not None:  # each row's copy of its prompt's keys and values, into the kept cache's buffers
            for layer, prefilled in zip(cache.layers, prefill_kw[self._cache_kw].layers):
                keys, values = prefilled.keys[prompt_of], prefilled.values[prompt_of]
                if not layer.is_initialized:
                    layer.lazy_initialization(keys, values)  # allocated at the kept cache's fixed addresses
                layer.keys.copy_(keys)
                layer.values.copy_(values)
                layer.cumulative_length.copy_(prefilled.cumulative_length)
        step_fn = self._compiled_forward(idx.device)

        def advance(tok: Tensor, step: int) -> Tensor:
            pos = (n_real + step).clamp(max=self.config.block_size - 1)[:, None]  # (B, 1); past a row's budget: unused
            out = step_fn(**self._tokens(tok[:, None]), attention_mask=key_real, position_ids=pos, **kw)
            return out.logits[:, -1].clone()  # a copy: a CUDA graph reuses its output buffer

        return logits, advance

    def _compiled_forward(self, device: torch.device):
        """The HF forward compiled once per model and device type (mode="reduce-overhead" on CUDA)."""
        mode = decode_compile_mode(device)
        if getattr(self, "_compiled", None) is None or self._compiled[0] != mode:
            self._compiled = (mode, torch.compile(self.hf.forward, fullgraph=True, mode=mode))
        return self._compiled[1]


# -----------------------------------------------------------------------------
# the checkpoint loader and the --init grammar


def adapted_model(ckpt: dict, key: str = "model") -> torch.nn.Module:
    """A LoRA checkpoint's (adapters only, §4) model `key` as its run held it: the base rebuilt from ckpt["base"][key]
    (recursively when that is a LoRA checkpoint too, merged), checked against its fingerprint, stored in the dtype it
    trained in, with the adapters and trained heads loaded, on the CPU."""
    base = ckpt["base"][key]
    needed_by = ckpt.get("path", "a LoRA checkpoint")
    check_base(base, needed_by)
    flag = f"{needed_by}: its base"
    model, _, _ = load_init(base["spec"], lm_head=base["lm_head"], score_head=base["score_head"], flag=flag)
    add_lora(model, base["lora_rank"], base["lora_alpha"], base["lora_targets"])
    # as parallel.place_model stored a LoRA base under bf16: its frozen matrices in that dtype, adapters in fp32
    store_low_precision(model, getattr(torch, base["dtype"]), frozen_only=True)
    missing, unexpected = model.load_state_dict(ckpt[f"{key}_lora"], strict=False)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if unexpected or any(name in missing for name in trainable):
        raise UserError(f"{needed_by}: its {key}_lora does not fit its base {base['spec']} (a checkpoint edited?)")
    return model


def merged_weights(ckpt: dict, key: str = "model") -> dict:
    """The full state dict of a checkpoint's model `key`: ckpt[key], or for a LoRA checkpoint its adapted model
    merged as lora.merged_state_dict merged it when the run saved: the same tensors, bit for bit (in fp32 over a bf16
    base)."""
    if key in ckpt:
        return ckpt[key]
    return merged_state_dict(adapted_model(ckpt, key))


def model_from_checkpoint(
    ckpt: dict | str | os.PathLike,
    key: str = "model",
    lm_head: bool | None = None,
    score_head: bool | None = None,
    merge: bool = True,
) -> GPT | HFCausalLM:
    """Either kind of model from one of our checkpoints (the dict or a path), on the CPU: an HFCausalLM when
    model_config holds hf_config, else a native GPT; weights from ckpt[key] ("critic" for PPO's), merged onto the
    rebuilt base for a LoRA checkpoint (merged_weights). Heads default to the checkpoint's; True adds an absent one
    (fresh, from the global torch seed), False drops one. merge False: a LoRA checkpoint's adapters kept unmerged over
    its base, as its run's forward had them (a reader under bf16: merged into the bf16 base, a small update rounds
    away; lora.at_least_fp32)."""
    if not isinstance(ckpt, dict):
        path = os.fspath(ckpt)
        ckpt = torch.load(path, map_location="cpu", weights_only=False) | {"path": path}  # our own files: RNG states
    if not merge and key not in ckpt:
        adapted = adapted_model(ckpt, key)
        base = ckpt["base"][key]
        if lm_head in (None, base["lm_head"]) and score_head in (None, base["score_head"]):
            return adapted.requires_grad_(False)  # the heads asked for are the run's
        state = adapted.state_dict()  # else the same weights in a model with the heads asked for
        plain = {name: value for name, value in state.items() if ".lora_" not in name}
        model = model_from_checkpoint(ckpt | {key: plain}, key, lm_head, score_head)
        add_lora(model, base["lora_rank"], base["lora_alpha"], base["lora_targets"])
        model.load_state_dict({name: value for name, value in state.items() if ".lora_" in name}, strict=False)
        return model.requires_grad_(False)
    ckpt = ckpt | {key: merged_weights(ckpt, key)}
    if "hf_config" in ckpt["model_config"]:  # written by the adapter: rebuilt from the config alone
        return HFCausalLM.from_checkpoint(ckpt, key=key, lm_head=lm_head, score_head=score_head)
    return GPT.from_checkpoint(ckpt, key=key, lm_head=lm_head, score_head=score_head)


def export_checkpoint(path: str, out_dir: str) -> None:
    """One of our checkpoints on disk (a policy's or a reward model's) as a Hugging Face folder with its tokenizer,
    what --export-hf writes at the end of a stage (checkpoints.export_hf): `python hf.py export CKPT OUT_DIR`."""
    ckpt = load_checkpoint(path, flag="export")
    model = model_from_checkpoint(ckpt)
    export_hf(model, Tokenizer.from_state(ckpt["tokenizer"]), out_dir)


GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def _model_type(path: str) -> str | None:
    """model_type of a local Hugging Face folder, None if it is not one."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type", "?")
    except (OSError, ValueError):
        return None


def _load_error(flag: str, spec: str, what: str, error: Exception) -> UserError:
    """A failed download or read as one line that names the flag (transformers' own message is many lines); an hf:
    name with no folder of that name here says so first."""
    name = spec.removeprefix("hf:")
    return UserError(f"{flag} {spec}: {hub_error(name, what, error, folder=spec.startswith('hf:'))}")


def _tokenizer(flag: str, spec: str, tokenizer_spec: str | dict) -> Tokenizer:
    """load_tokenizer (a spec) or Tokenizer.from_state (a saved state), its UserError prefixed with the flag."""
    try:
        if isinstance(tokenizer_spec, dict):
            return Tokenizer.from_state(tokenizer_spec)
        return load_tokenizer(tokenizer_spec)
    except UserError as e:
        raise UserError(f"{flag} {spec}: {e}") from None


def load_init(
    spec: str,
    tokenizer=None,
    scratch: dict | None = None,
    score_head: bool = False,
    lm_head: bool = True,
    flag: str = "--init",
    kind: str | tuple | None = None,
    merge: bool = True,
):
    """(model, tokenizer, ckpt or None) from an --init spec: `*.pt` our checkpoint | `gpt2`... or a local GPT-2
    folder (native GPT) | `hf:<name-or-path>` or another local HF folder (HFCausalLM) | `scratch` (a tiny config,
    the given tokenizer). The caller sets the heads. merge: as model_from_checkpoint's."""
    ckpt = None
    if spec.endswith(".pt"):
        ckpt = load_checkpoint(spec, kind=kind, flag=flag)
        model = model_from_checkpoint(ckpt, lm_head=lm_head, score_head=score_head, merge=merge)
        tokenizer = _tokenizer(flag, spec, ckpt["tokenizer"])
    elif spec in GPT2_NAMES or _model_type(spec) == "gpt2":
        try:
            model = GPT.from_pretrained(spec, score_head=score_head)
        except (OSError, ValueError, KeyError) as e:  # not found, offline
            raise _load_error(flag, spec, "GPT-2 weights", e) from None
        has_tok = os.path.isdir(spec) and any(
            os.path.exists(os.path.join(spec, f)) for f in ("tokenizer.json", "vocab.json")
        )
        tokenizer = _tokenizer(flag, spec, f"hf:{spec}" if has_tok else "gpt2")
    elif spec.startswith("hf:") or _model_type(spec):  # any other causal LM, through the adapter
        path = spec.removeprefix("hf:")
        tokenizer = _tokenizer(flag, spec, f"hf:{path}")
        try:
            model = HFCausalLM.from_pretrained(path, lm_head=lm_head, score_head=score_head)
        except (OSError, ValueError, KeyError) as e:  # not found, offline, not a causal LM
            raise _load_error(flag, spec, "a causal LM", e) from None
        if tokenizer.vocab_size > model.config.vocab_size:
            raise UserError(
                f"{flag} {spec}: the tokenizer has {tokenizer.vocab_size} tokens, the model's embedding "
                f"only {model.config.vocab_size}"
            )
    elif spec == "scratch":
        assert tokenizer is not None, "scratch needs a tokenizer"
        model = GPT(
            GPTConfig(
                **{**(scratch or {}), "vocab_size": tokenizer.vocab_size, "lm_head": lm_head, "score_head": score_head}
            )
        )
    else:
        raise UserError(
            f"{flag} {spec}: expected a .pt checkpoint, gpt2[-medium|-large|-xl], a local GPT-2 folder, "
            f"hf:<name-or-path> or scratch"
        )
    return model, tokenizer, ckpt


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_chat_model(out_dir: str, tokenizer: str, n_layer: int = 2, n_embd: int = 64) -> None:
    """A Hugging Face folder to try the conversational path with (docs/usage.md, "A model of your own"): a random
    Llama of n_layer layers and width n_embd, and `tokenizer` (anything tokenizer.load_tokenizer reads) as a Hugging
    Face tokenizer with ChatML's template, <|im_end|> closing a turn."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tokenizer import export_tokenizer

    print(export_tokenizer(load_tokenizer(tokenizer), out_dir))
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    hf_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(out_dir)
    config = LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(hf_tok),
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    print(f"wrote a {n_layer}-layer Llama with a ChatML template to {out_dir} (--init hf:{out_dir})")


def write_from_gguf(gguf_path: str, out_dir: str, num_layers: int | None = None) -> None:
    """A GGUF file (a llama.cpp model, e.g. the SmolLM2 of `make smollm2`) as a Hugging Face folder: the weights
    dequantised to fp32 and the tokenizer; num_layers: its first blocks only (the tests' cut-down copy). Needs the
    `gguf` and `accelerate` packages (requirements-real.txt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise UserError(f"{gguf_path}: no such GGUF file")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    layers = {} if num_layers is None else {"num_hidden_layers": num_layers}  # the blocks past it never built
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **layers)
    # the weights are plain fp32 now: drop the quantisation that save_pretrained refuses
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out_dir)
    print(f"wrote {name} dequantised to {out_dir} (--init hf:{out_dir})")


if __name__ == "__main__":
    import sys

    from common import run_main

    def command(argv: list[str]) -> None:
        if len(argv) == 3 and argv[0] == "tiny-chat":
            write_tiny_chat_model(argv[1], argv[2])
        elif len(argv) == 3 and argv[0] == "export":
            export_checkpoint(argv[1], argv[2])
        elif len(argv) == 3 and argv[0] == "gguf":
            write_from_gguf(argv[1], argv[2])
        else:
            raise UserError(
                "usage: python hf.py tiny-chat OUT_DIR TOKENIZER (e.g. out/data/v2-seed1337/tokenizer.json) | "
                "python hf.py export CKPT OUT_DIR (a policy or a reward model with its tokenizer) | "
                "python hf.py gguf FILE.gguf OUT_DIR"
            )

    run_main(command, sys.argv[1:])
