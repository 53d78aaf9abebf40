"""GPT language model, nanoGPT-shaped, for every RLHF role: policy and reference (LM head), critic (scalar head),
reward model (both heads); the response forward, log-probs, the LM loss and reward-model scoring; GPT-2 weights
through transformers (`from_pretrained`, `export_hf`) and our native checkpoints (`from_checkpoint`). Positions,
padding and heads: docs/design.md §2.

References:
1) OpenAI's GPT-2 TensorFlow implementation: https://github.com/openai/gpt-2/blob/master/src/model.py
2) nanoGPT: https://github.com/karpathy/nanoGPT/blob/master/model.py
"""

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

# GPT-2 stores these as Conv1D (in, out); we use nn.Linear (out, in)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    """A state dict saved from a wrapped module -> the bare module's keys: the leading "_orig_mod." (torch.compile)
    and "module." (DDP) are stripped, in either wrapping order. Every checkpoint loader (here and in hf.py) uses it."""
    stripped = {}
    for name, value in state_dict.items():
        for prefix in ("_orig_mod.", "module.", "_orig_mod."):
            name = name.removeprefix(prefix)
        stripped[name] = value
    return stripped


@dataclass
class GPTConfig:
    block_size: int = 128
    vocab_size: int = 1024
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2
    lm_head: bool = True  # next-token head, tied to wte (policy, reference, reward model)
    score_head: bool = False  # scalar head nn.Linear(n_embd, 1) (critic, reward model)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, f"n_embd {config.n_embd} must divide by n_head {config.n_head}"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, kv_cache=None) -> Tensor:
        """attn_mask: bool (B, 1, T, Tk), True = attend; None = plain causal over x itself. kv_cache: a decode's
        cache of this layer (generate.py): it takes this step's keys and values and returns every key and value to
        attend to."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, nh, Tk, hs)
        assert attn_mask is not None or k.size(2) == T, "a query over cached keys needs an explicit attn_mask"
        if T == 1 and kv_cache is not None and x.device.type == "cpu":  # CPU decode: plain math beats the fused kernel
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, 1, Tk)
            y = att.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v  # (B, nh, 1, hs)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=attn_mask is None,
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, kv_cache=None) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, kv_cache)
        return x + self.mlp(self.ln_2(x))


def padded_causal_mask(real: Tensor) -> Tensor:
    """real: bool (B, T), True = real token -> bool (B, 1, T, T): causal AND key is real, OR the diagonal,
    so a left-pad query attends to itself and no attention row is fully masked."""
    T = real.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=real.device)
    return (causal & real[:, None, None, :]) | eye  # (B, 1, T, T)


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """logits (B, T, V), tokens (B, T) -> (B, T) log_softmax(logits / temperature) gathered at tokens, in fp32 or wider.
    Ids outside [0, V) (padding) give the log-prob of id 0: mask them."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits / temperature if temperature != 1.0 else logits  # no (B, T, V) copy at temperature 1
    tokens = tokens.masked_fill((tokens < 0) | (tokens >= logits.size(-1)), 0)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of softmax(logits)."""
    return torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)


def lm_loss(logits: Tensor, targets: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Sum of masked next-token NLL / denom (default: the number of valid targets), the LM loss of every stage.
    logits (B, T, V), targets and mask (B, T); targets where mask is 0 may be pad ids outside the vocabulary."""
    targets = targets.masked_fill(mask == 0, 0)
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(mask)
    return (nll * mask).sum() / (mask.sum() if denom is None else denom)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the valid entries (mask 1.0 = real)."""
    return (x * mask).sum() / mask.sum()


def response_forward(model, query, query_mask, response, response_mask, temperature: float):
    """One training-style forward over cat(query left-padded, response right-padded). Response token t is predicted
    at position P+t-1, so the lm head runs on the last T+1 positions only (never on the prompt).
    Returns (logits / temperature (B, T, V) fp32 or None, scores (B, T) or None)."""
    P, T = query.size(1), response.size(1)
    logits, scores = model(
        torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1), logits_to_keep=T + 1
    )
    if logits is not None:
        logits = logits[:, :-1].float()
        logits = logits / temperature if temperature != 1.0 else logits
    return logits, None if scores is None else scores[:, P - 1 : -1].float()


def left_pack(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows (B, W) whose real tokens (mask 1.0) have gaps (a left-padded prompt, a right-padded response) -> the same
    tokens in order, left-padded, as wide as the longest row's real tokens (one host sync), contiguous."""
    order = torch.sort(mask, dim=1, stable=True).indices  # (B, W) padding first, real tokens in order
    width = max(1, int(mask.sum(1).max()))
    # contiguous: a column slice keeps the row stride W, and a compiled forward guards on it (a graph more)
    return ids.gather(1, order)[:, -width:].contiguous(), mask.gather(1, order)[:, -width:].contiguous()


def packed_response_logits(model, ids: Tensor, mask: Tensor, response_mask: Tensor, temperature: float) -> Tensor:
    """response_forward's logits over rows packed by left_pack (ids, mask (B, W)), gathered so response token t of
    row b is at [b, t] (response_mask (B, T) right-padded). Returns logits / temperature (B, T, V), fp32 or wider;
    meaningless where response_mask is 0."""
    T = response_mask.size(1)
    keep = min(T, ids.size(1) - 1) + 1  # a response of R tokens is predicted from the last R + 1 positions but one
    lengths = response_mask.sum(1).long()  # (B,)
    logits, _ = model(ids, mask, logits_to_keep=keep)
    index = ((keep - 1 - lengths)[:, None] + torch.arange(T, device=ids.device)).clamp(0, keep - 1)  # (B, T)
    logits = logits.gather(1, index[:, :, None].expand(-1, -1, logits.size(-1))).float()
    return logits / temperature if temperature != 1.0 else logits


def row_extent(mask: Tensor) -> Tensor:
    """mask (B, T) -> (B,) long: one past the last column where mask is 1, 0 for a row without one. A right-padded
    response's length; in a multi-turn episode (the environment's tokens 0 between model turns) it ends at the
    episode's last model token, where mask.sum(1) would fall short by the environment's tokens."""
    return (mask.bool() * torch.arange(1, mask.size(1) + 1, device=mask.device)).amax(1)


def last_token_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores, mask (B, T) -> (B,): the score at the last real token of each row (the EOS), wherever the padding is
    (left-padded prompts, right-padded responses)."""
    last = (row_extent(mask) - 1).clamp(min=0)  # (B,) last index with mask 1
    return scores.gather(1, last[:, None]).squeeze(1)


@torch.no_grad()
def score_sequences(model, seqs: list[list[int]], pad_id: int, batch_size: int, device, dtype) -> torch.Tensor:
    """Scores (N,) of token sequences at their last token (the EOS; the last response token for a no-EOS text).
    Sorted by length to waste little on padding; right padding needs no attention mask (causal attention never
    looks ahead at the pads). dtype: bf16 runs under autocast."""
    device = torch.device(device)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = torch.zeros(len(seqs))
    for start in range(0, len(seqs), batch_size):
        rows = order[start : start + batch_size]
        ids = nn.utils.rnn.pad_sequence([torch.tensor(seqs[i]) for i in rows], batch_first=True, padding_value=pad_id)
        mask = (torch.arange(ids.size(1)) < torch.tensor([len(seqs[i]) for i in rows])[:, None]).long()  # (B, T)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, scores = model(ids.to(device), logits=False)
        out[rows] = last_token_scores(scores.float(), mask.to(device)).cpu()
    return out


def calibration_error(gaps: torch.Tensor, n_bins: int = 10) -> float:
    """Expected calibration error of P(chosen ≻ rejected) = σ(gap), gaps (N,) = r_chosen - r_rejected on held-out
    pairs. Each pair enters in both orders, (σ(gap), 1) and (σ(-gap), 0), so the observed frequency is defined;
    ECE = Σ_b n_b/N |observed_b - predicted_b| over n_bins equal bins of [0, 1] (Guo et al. 2017)."""
    probs = torch.cat([torch.sigmoid(gaps.double()), torch.sigmoid(-gaps.double())])
    outcome = torch.cat([torch.ones_like(gaps, dtype=torch.double), torch.zeros_like(gaps, dtype=torch.double)])
    bins = (probs * n_bins).long().clamp(max=n_bins - 1)
    n = torch.bincount(bins, minlength=n_bins).double()
    gap_sum = torch.bincount(bins, weights=outcome - probs, minlength=n_bins)
    return (gap_sum.abs().sum() / n.sum()).item()


def aggregate_rm_scores(scores: Tensor, agg: str, coef: float = 0.0) -> Tensor:
    """An ensemble of K reward models' scores (K, B) -> (B,): mean; min (the worst case over
    members); uwo = mean - coef * the members' population variance (uncertainty-weighted optimisation, Coste et al.
    2023, https://arxiv.org/abs/2310.02743). One member (K = 1) is its own score under all three."""
    if agg == "mean":
        return scores.mean(0)
    if agg == "min":
        return scores.min(0).values
    if agg == "uwo":
        return scores.mean(0) - coef * scores.var(0, correction=0)
    raise ValueError(f"unknown RM aggregation {agg!r}: expected mean, min or uwo")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.lm_head or config.score_head, "a GPT needs an lm_head or a score_head (or both)"
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False) if config.lm_head else None
        self.score_head = nn.Linear(config.n_embd, 1) if config.score_head else None
        self.grad_ckpt = False  # --grad-ckpt: activation checkpointing per block (set_grad_ckpt)
        if self.lm_head is not None:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf, 2017)
        # init all weights, then the GPT-2 paper's scaled init of the residual projections
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        # the scalar head starts small and unbiased (InstructGPT / summarize_from_feedback)
        if self.score_head is not None:
            torch.nn.init.normal_(self.score_head.weight, mean=0.0, std=1 / math.sqrt(config.n_embd + 1))
            torch.nn.init.zeros_(self.score_head.bias)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_grad_ckpt(self, enabled: bool) -> None:
        """Activation checkpointing per block in every forward with grad (the KV-cache generation never)."""
        self.grad_ckpt = enabled

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, tied weights once. non_embedding drops wpe, and wte too unless it doubles as the lm head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
            if self.lm_head is None:
                n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self, T: int) -> int:
        """Training FLOPs per token at context T, the PaLM estimate (appendix B): 6N + 12·L·H·Q·T,
        N = num_params(non_embedding=True) (non-embedding weights plus the lm head if present)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    def _trunk(self, idx: Tensor, pos: Tensor, attn_mask: Tensor | None, kv_caches: list | None = None) -> Tensor:
        """idx, pos (B, T) long (pos may be (T,)) -> final hidden states (B, T, C) after ln_f."""
        idx = idx.masked_fill((idx < 0) | (idx >= self.config.vocab_size), 0)  # pad ids may lie outside the vocab
        residual = torch.promote_types(self.transformer.wte.weight.dtype, torch.float32)  # fp32 for bf16 weights too
        x = self.transformer.wte(idx).to(residual) + self.transformer.wpe(pos).to(residual)
        x = self.transformer.drop(x)  # (B, T, C)
        recompute = self.grad_ckpt and torch.is_grad_enabled() and kv_caches is None
        for i, block in enumerate(self.transformer.h):
            if recompute:  # --grad-ckpt: keep only the block's input, recompute the rest in the backward
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, use_reentrant=False)
            else:
                x = block(x, attn_mask, None if kv_caches is None else kv_caches[i])
        return self.transformer.ln_f(x)

    def forward(
        self, idx: Tensor, attention_mask: Tensor | None = None, logits: bool = True, logits_to_keep: int = 0
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) long, attention_mask (B, T) 1 = real token or None (no padding) -> (logits (B, T, V) or None,
        scores (B, T) or None); padding never changes a real token's outputs. logits_to_keep > 0: logits of the last
        logits_to_keep positions only, (B, logits_to_keep, V)."""
        T = idx.size(1)
        assert T <= self.config.block_size, f"sequence of length {T} > block_size {self.config.block_size}"
        if attention_mask is None:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            h = self._trunk(idx, pos, None)  # plain causal fast path
        else:
            real = attention_mask.bool()
            idx = idx.masked_fill(~real, 0)
            pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T) position ids from the mask
            h = self._trunk(idx, pos, padded_causal_mask(real))
        keep = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        out_logits = self.lm_head(keep) if logits and self.lm_head is not None else None
        scores = self.score_head(h).squeeze(-1) if self.score_head is not None else None
        return out_logits, scores

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float], device_type: str
    ) -> torch.optim.AdamW:
        """AdamW; weight decay on every 2D+ parameter (matmuls, embeddings), none on biases and LayerNorms."""
        params = [p for p in self.parameters() if p.requires_grad]  # tied weights once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # fused: one kernel for all parameters (2.8x faster than the per-tensor loop on CPU, bench/README.md)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cuda", "cpu"))

    @classmethod
    def from_pretrained(cls, name_or_dir: str, score_head: bool = False) -> "GPT":
        """GPT-2 weights from Hugging Face: "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl" or a local GPT-2 folder."""
        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(name_or_dir, dtype=torch.float32)
        c = hf.config
        assert c.activation_function in ("gelu_new", "gelu_pytorch_tanh"), f"unsupported {c.activation_function=}"
        assert c.layer_norm_epsilon == 1e-5, f"unsupported layer_norm_epsilon {c.layer_norm_epsilon}"
        assert not c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx is not supported"
        config = GPTConfig(
            block_size=c.n_positions,
            vocab_size=c.vocab_size,
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_embd=c.n_embd,
            bias=True,
            score_head=score_head,
        )
        model = cls(config)
        sd_hf = hf.state_dict()
        with torch.no_grad():
            for k, p in model.state_dict().items():
                if k.startswith(("lm_head.", "score_head.")):
                    continue  # lm_head is tied to wte; the score head keeps its fresh init
                w = sd_hf[k]
                p.copy_(w.t() if k.endswith(CONV1D_WEIGHTS) else w)
        assert torch.equal(sd_hf["lm_head.weight"], sd_hf["transformer.wte.weight"]), "lm_head must be tied to wte"
        return model

    def export_hf(self, out_dir: str, eos_id: int | None = None, pad_id: int | None = None) -> None:
        """Write a folder (config + safetensors) transformers loads with identical outputs: a GPT2LMHeadModel, or with a
        score head a GPT2ForSequenceClassification. eos_id: default vocab_size - 1. pad_id: a vocab id other than EOS
        (default 0, or 1 if 0 is the EOS); right-pad RM inputs with it."""
        from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

        assert self.lm_head is not None, "export_hf needs an lm head (a policy or a reward model, not a critic)"
        cfg = self.config
        eos_id = cfg.vocab_size - 1 if eos_id is None else eos_id
        pad_id = (1 if eos_id == 0 else 0) if pad_id is None else pad_id
        rm = self.score_head is not None
        assert not rm or (0 <= pad_id < cfg.vocab_size and pad_id != eos_id), f"pad_id {pad_id}: a vocab id, not EOS"
        hf_config = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            **(dict(num_labels=1, pad_token_id=pad_id) if rm else {}),
        )
        hf = GPT2ForSequenceClassification(hf_config) if rm else GPT2LMHeadModel(hf_config)
        sd = self.state_dict()
        with torch.no_grad():
            for k, p in hf.state_dict().items():
                if k == "lm_head.weight":
                    continue  # tied to wte
                if k == "score.weight":
                    p.copy_(sd["score_head.weight"])
                    continue
                if k not in sd:  # bias=False: GPT-2 has biases, zero them
                    assert k.endswith(".bias"), f"no weight for {k}"
                    p.zero_()
                    continue
                w = sd[k]
                p.copy_(w.t() if k.endswith(CONV1D_WEIGHTS) else w)
            if rm:  # `score` has no bias: w·(ln_f(x) + b·w/‖w‖²) = w·ln_f(x) + b, every score unchanged
                w, b = self.score_head.weight[0], self.score_head.bias[0]
                hf.transformer.ln_f.bias += b * w / w.norm() ** 2
        hf.save_pretrained(out_dir)

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: str | os.PathLike | dict,
        map_location: str | torch.device = "cpu",
        key: str = "model",
        lm_head: bool | None = None,
        score_head: bool | None = None,
    ) -> "GPT":
        """A native GPT from one of our checkpoints (a path or the dict): config from ckpt["model_config"], weights
        from ckpt[key], loaded strictly. Heads default to the state dict's; True adds an absent one (a fresh score
        head from the global torch seed), False drops one. A Hugging Face model's checkpoint is a ValueError."""
        if not isinstance(ckpt, dict):
            ckpt = torch.load(ckpt, map_location=map_location, weights_only=False)  # our own files hold RNG states
        if "hf_config" in ckpt["model_config"]:
            raise ValueError(
                "this checkpoint holds a Hugging Face model (its model_config has hf_config): "
                "load it with hf.model_from_checkpoint, which rebuilds either kind"
            )
        if key not in ckpt:
            raise ValueError(
                f"this checkpoint holds LoRA adapters only ({key}_lora and base): load it with "
                "hf.model_from_checkpoint, which rebuilds the base and merges them"
            )
        state_dict = strip_wrapper_prefixes(ckpt[key])
        lm_head = "lm_head.weight" in state_dict if lm_head is None else lm_head
        score_head = "score_head.weight" in state_dict if score_head is None else score_head
        model = cls(replace(GPTConfig(**ckpt["model_config"]), lm_head=lm_head, score_head=score_head))
        own = model.state_dict()
        # a head not asked for is dropped; any other unexpected or missing key is still an error
        kept = {k: v for k, v in state_dict.items() if k in own or not k.startswith(("lm_head.", "score_head."))}
        if lm_head:
            kept["lm_head.weight"] = kept["transformer.wte.weight"]  # tied: a critic's wte becomes the lm head
        fresh = {k: own[k] for k in own if k.startswith("score_head.") and k not in kept}
        model.load_state_dict(kept | fresh)
        return model.to(map_location) if isinstance(map_location, (str, torch.device)) else model
