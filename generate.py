"""Batched KV-cache generation over left-padded prompts, for `model.GPT` and (through its own `prefill`)
`hf.HFCausalLM`: the static caches and compiled one-token step of the fixed-shape decode (docs/design.md §7), the
sampling loop every generate shares, and `sample`: generate -> which rows ended -> text without EOS.

A decode calls `GPT._trunk(idx, pos, attn_mask, kv_caches)`, whose attention hands each layer's keys and values to
`kv_cache.update(k, v)` and attends to what it returns.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import padded_causal_mask


class KVCache:
    """Keys and values of one layer, preallocated as (B, nh, max_len, hs) on the first update, filled left to right."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.pos = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            B, nh, _, hs = k.shape
            self.k = k.new_empty(B, nh, self.max_len, hs)
            self.v = v.new_empty(B, nh, self.max_len, hs)
        T = k.size(2)
        assert self.pos + T <= self.max_len, f"kv cache overflow: {self.pos} + {T} > {self.max_len}"
        self.k[:, :, self.pos : self.pos + T] = k
        self.v[:, :, self.pos : self.pos + T] = v
        self.pos += T
        return self.k[:, :, : self.pos], self.v[:, :, : self.pos]  # (B, nh, pos, hs)

    def copy_rows(self, rows: Tensor) -> None:
        """Row i of the cache becomes row rows[i] (a shared prefill handed to every row of its prompt)."""
        self.k, self.v = self.k[rows], self.v[rows]


class StaticKVCache(nn.Module):
    """Keys and values of one layer at fixed shapes for the compiled decode: zero buffers (B, nh, max_len, hs),
    written at `slots` (a long tensor the caller refills in place) and read whole, so every step has the same shapes."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_size: int, slots: Tensor, dtype: torch.dtype):
        super().__init__()
        device = slots.device
        self.register_buffer("k", torch.zeros(batch, n_head, max_len, head_size, device=device, dtype=dtype))
        self.register_buffer("v", torch.zeros(batch, n_head, max_len, head_size, device=device, dtype=dtype))
        self.slots = slots

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        return self.k, self.v  # (B, nh, max_len, hs)


# -----------------------------------------------------------------------------
# the compiled one-token step and its fixed layout


def decode_one_token(model, token: Tensor, pos: Tensor, key_mask: Tensor, caches: list) -> Tensor:
    """The fixed-shape decode step (gpt-fast's): token, pos (B, 1) long, key_mask (B, 1, 1, max_len) bool (the slots
    this token attends to), caches (StaticKVCache per layer, written at their slots) -> logits (B, V) of the next
    token. It draws no random number: sampling stays outside, eager, from the caller's generator."""
    h = model._trunk(token, pos, key_mask, caches)
    return model.lm_head(h[:, -1])


_compiled_decode = {}  # mode -> decode_one_token compiled once per process


def decode_compile_mode(device: torch.device) -> str:
    """torch.compile's mode for a decode step: "reduce-overhead" on CUDA (CUDA graphs: no kernel launch per op),
    inductor's default on CPU (for tests: --compile on)."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def compiled_decode(device: torch.device):
    """decode_one_token compiled with fullgraph, in decode_compile_mode."""
    mode = decode_compile_mode(device)
    if mode not in _compiled_decode:
        _compiled_decode[mode] = torch.compile(decode_one_token, fullgraph=True, mode=mode)
    return _compiled_decode[mode]


def static_layout(idx: Tensor, real: Tensor, max_new_tokens: int, block_size: int):
    """The compiled decode's layout (model.GPT's and hf.HFCausalLM's): prompts idx and real (B, P) left-padded to a
    multiple of 16 within the context (a few widths compile; the slots a prompt leaves empty are masked) -> (idx,
    real (B, width), key_real (B, width + max_new_tokens): the keys a response token may attend to, width)."""
    B, P = idx.size()
    width = max(P, min(-(-P // 16) * 16, block_size - max_new_tokens))
    idx = F.pad(idx, (width - P, 0), value=0)
    real = F.pad(real, (width - P, 0), value=False)
    key_real = torch.cat([real, real.new_ones(B, max_new_tokens)], dim=1)
    return idx, real, key_real, width


def cache_dtype(device: torch.device, weights_dtype: torch.dtype) -> torch.dtype:
    """The dtype a static KV cache holds: autocast's where it is on (the keys and values it computes), else the
    weights'."""
    autocast = torch.is_autocast_enabled(device.type)
    return torch.get_autocast_dtype(device.type) if autocast else weights_dtype


# -----------------------------------------------------------------------------
# the prompts a batch repeats: prefilled once


def shared_prompts(idx: Tensor, real: Tensor) -> tuple[Tensor, Tensor] | None:
    """Rows that hold one prompt (GRPO's group, VinePPO's continuations of a prefix, eval.py's seeds of a prompt) share
    its prefill: it runs on one row of each distinct prompt and its KV cache is copied to the others. Returns (first
    (U,): one row of each distinct prompt, prompt_of (B,): each row's distinct prompt, an index into first), or None
    when every row is a prompt of its own."""
    B = idx.size(0)
    key = idx.masked_fill(~real, -1)  # where the padding is matters, not its id (-1 is no token's)
    distinct, prompt_of = torch.unique(key, dim=0, return_inverse=True)
    if distinct.size(0) == B:
        return None
    rows = torch.arange(B, device=idx.device)
    first = torch.full((distinct.size(0),), B, device=idx.device).scatter_reduce(0, prompt_of, rows, "amin")
    return first, prompt_of


EVERY_ROW = (slice(None), slice(None))  # shared_prompts' (first, prompt_of) when nothing is shared: each row its own


# -----------------------------------------------------------------------------
# model.GPT's prefills: each returns (the last prompt position's logits (B, V), advance(token, step) -> next logits)


def eager_prefill(model, idx: Tensor, real: Tensor, max_new_tokens: int, shared=None):
    """The eager decode: the prompts through the trunk once into a KV cache that grows by a token a step. shared:
    shared_prompts' (first, prompt_of), a distinct prompt prefilled once."""
    B, P = idx.size()
    n_real = real.long().sum(-1)  # (B,) real prompt tokens
    key_real = torch.cat([real, real.new_ones(B, max_new_tokens)], dim=1)  # (B, P + max_new_tokens)
    kv_caches = [KVCache(P + max_new_tokens) for _ in range(model.config.n_layer)]
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    first, prompt_of = shared or EVERY_ROW
    h = model._trunk(idx[first].masked_fill(~real[first], 0), pos[first], padded_causal_mask(real[first]), kv_caches)
    h = h[prompt_of]
    for cache in kv_caches:
        cache.copy_rows(prompt_of)

    def advance(tok: Tensor, step: int) -> Tensor:
        # the new token sits at position n_real + step (a row past its budget: any position, its output is unused)
        # and attends to the real prompt keys and all new keys
        Tk = P + step + 1
        pos = (n_real + step).clamp(max=model.config.block_size - 1)[:, None]
        h = model._trunk(tok[:, None], pos, key_real[:, None, None, :Tk], kv_caches)
        return model.lm_head(h[:, -1])

    return model.lm_head(h[:, -1]), advance


def static_prefill(model, idx: Tensor, real: Tensor, max_new_tokens: int, cache_len: int | None = None, shared=None):
    """The fixed-shape decode (generate's compiled=True): the prompts left-padded to a multiple of 16 (the slots a
    prompt leaves empty are masked), a StaticKVCache per layer, the prefill eager; advance runs compiled_decode with
    the same shapes at every step. cache_len: the caches' length whatever the prompts' width (run_episodes: the
    context, one shape every turn), the slots past the prompt and the new tokens masked. shared: as eager_prefill's
    (the distinct prompts prefilled into caches of their own, copied into the kept ones)."""
    if cache_len is None:
        idx, real, key_real, width = static_layout(idx, real, max_new_tokens, model.config.block_size)
        max_len = width + max_new_tokens
    else:
        B, width = idx.size()
        max_len = max(cache_len, width + max_new_tokens)  # a prompt too long for the context: one more shape
        key_real = torch.cat([real, real.new_ones(B, max_new_tokens)], dim=1)  # (B, width + max_new_tokens)
        key_real = F.pad(key_real, (0, max_len - width - max_new_tokens), value=False)  # (B, max_len)
    n_real = real.long().sum(-1)  # (B,)
    device = idx.device
    dtype = cache_dtype(device, model.lm_head.weight.dtype)
    caches, step_slot = static_caches(model, idx.size(0), max_len, dtype, device)
    first, prompt_of = shared or EVERY_ROW
    prefill_caches = caches
    if shared is not None:
        n_head, head_size = caches[0].k.size(1), caches[0].k.size(3)
        prefill_caches = [StaticKVCache(first.numel(), n_head, max_len, head_size, step_slot, dtype) for _ in caches]
    for cache in prefill_caches:
        cache.slots = torch.arange(width, device=device)  # the prefill writes the prompt's slots
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, width)
    prefill_mask = F.pad(padded_causal_mask(real[first]), (0, max_len - width), value=False)  # (U, 1, width, max_len)
    h = model._trunk(idx[first].masked_fill(~real[first], 0), pos[first], prefill_mask, prefill_caches)
    h = h[prompt_of]
    for cache, prefilled in zip(caches, prefill_caches):
        if prefilled is not cache:
            cache.k.copy_(prefilled.k[prompt_of])
            cache.v.copy_(prefilled.v[prompt_of])
        cache.slots = step_slot  # then one slot a step, refilled in place
    step_fn = compiled_decode(device)
    slot_ids = torch.arange(max_len, device=device)

    def advance(tok: Tensor, step: int) -> Tensor:
        step_slot.fill_(width + step)  # the new token's slot; it attends to the real prompt and every new key
        key_mask = (key_real & (slot_ids <= width + step))[:, None, None, :]  # (B, 1, 1, max_len)
        pos = (n_real + step).clamp(max=model.config.block_size - 1)[:, None]  # past a row's budget: unused
        return step_fn(model, tok[:, None], pos, key_mask, caches).clone()

    return model.lm_head(h[:, -1]), advance


def static_caches(model, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
    """The StaticKVCache of each layer and the step's slot tensor, zeroed: kept on the model from its last call of
    the same shape, so a CUDA graph recorded once replays on the same addresses (a new allocation would record
    anew)."""
    key = (batch, max_len, dtype, device)
    if getattr(model, "_kept_caches", (None,))[0] != key:
        model._kept_caches = None  # free the old buffers first
        head_size = model.config.n_embd // model.config.n_head
        step_slot = torch.zeros(1, dtype=torch.long, device=device)
        caches = [
            StaticKVCache(batch, model.config.n_head, max_len, head_size, step_slot, dtype)
            for _ in range(model.config.n_layer)
        ]
        model._kept_caches = (key, caches, step_slot)
    _, caches, step_slot = model._kept_caches
    for cache in caches:
        cache.k.zero_()
        cache.v.zero_()
    return caches, step_slot


# -----------------------------------------------------------------------------
# sampling


Generators = torch.Generator | list[torch.Generator] | None  # one stream for the batch, one a row, or the global


def uniforms(rows: int, generator: Generators, device, steps: int = 1) -> Tensor:
    """(rows, steps) float64 uniforms in [0, 1): from one generator (None: the global RNG), or each row's from its own
    (a list of CPU generators: a row's draws then depend on nothing else in its batch)."""
    if isinstance(generator, list):
        assert len(generator) == rows, f"{len(generator)} generators for {rows} rows"
        draws = [torch.rand(steps, generator=row_generator, dtype=torch.float64) for row_generator in generator]
        return torch.stack(draws).to(device)
    return torch.rand(rows, steps, generator=generator, device=device, dtype=torch.float64)


def sample_tokens(logits: Tensor, u: Tensor) -> Tensor:
    """One token per row from softmax(logits) (B, V) -> (B,), by inverse CDF with the row's uniform u (B, 1) in [0, 1)
    (uniforms); a -inf logit is never sampled."""
    cdf = F.softmax(logits, dim=-1, dtype=torch.float64).cumsum(-1)  # (B, V)
    u = torch.minimum(u * cdf[:, -1:], cdf[:, -1:] * (1 - 1e-12))  # (B, 1) strictly below the total: no p = 0 pick
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """Keep the top_k largest logits, then the smallest set whose probability reaches top_p; the rest -> -inf."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before a token already reaches top_p (the top one stays)
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return logits


def decode_loop(
    logits: Tensor,
    advance,
    budget: Tensor,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_new_tokens: int,
    generator: Generators,
    forced: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The sampling loop every generate shares (model.GPT's, hf.HFCausalLM's; eager or compiled decode): logits
    (B, V) of each prompt's next token from the prefill, advance(token (B,), step) -> the next logits, budget (B,)
    long: the new tokens each row may take (it is finished after them, ended or not). forced (B, Tf): take these
    tokens instead of drawing (a row's EOS still ends it): their log-probs as the decode reads them. Returns
    generate's (response, response_mask, logprobs)."""
    finished = budget <= 0
    max_new_tokens = int(budget.max())  # one host sync: the steps to run
    rows = budget.size(0)
    row_draws = None  # a generator a row: each row's uniforms for every step in one draw (not one a row and step)
    if isinstance(generator, list) and temperature > 0 and forced is None:
        row_draws = uniforms(rows, generator, logits.device, max_new_tokens)
    tokens, masks, logprobs = [], [], []
    for step in range(max_new_tokens):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits = logits / temperature if temperature > 0 else logits
        if step < min_new_tokens:
            logits[:, eos_id] = -float("inf")
        if forced is not None:  # a finished row's padding is fed as its EOS (its tokens are padding after it anyway)
            tok = forced[:, step].masked_fill(finished, eos_id)  # (B,)
        elif temperature > 0:  # the random draw: eager, from the caller's generator
            u = row_draws[:, step : step + 1] if row_draws is not None else uniforms(rows, generator, logits.device)
            tok = sample_tokens(filter_logits(logits, top_k, top_p), u)  # (B,)
        else:
            tok = logits.argmax(dim=-1)  # (B,)
        lp = logits.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (B,)
        tokens.append(tok.masked_fill(finished, pad_id))
        masks.append((~finished).to(lp.dtype))
        logprobs.append(lp.masked_fill(finished, 0.0))
        finished = finished | (tok == eos_id) | (budget <= step + 1)
        if step == max_new_tokens - 1 or ((step + 1) % 8 == 0 and finished.all()):
            break  # host sync only every 8 steps
        logits = advance(tok, step)  # (B, V)
    return torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logprobs, 1)


@torch.no_grad()
def generate(
    model,
    idx: Tensor,
    attention_mask: Tensor | None,
    max_new_tokens: int | Tensor,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_new_tokens: int = 0,
    generator: Generators = None,
    compiled: bool = False,
    cache_len: int | None = None,
    forced: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample from model (GPT or HFCausalLM) for left-padded prompts idx, attention_mask (B, P) (None: no padding).
    max_new_tokens: an int or a (B,) per-row budget. generator: one, one a row, or None (the global RNG, as in
    uniforms). compiled: static KV caches, cache_len long where given (model.GPT's; None: the prompt's width bucket
    and the new tokens). Rows that repeat a prompt share its prefill (shared_prompts). forced (B, Tf), pad_id after a
    row's end: score these tokens instead of drawing, at most Tf of them (decode_loop).
    Returns response (B, Tn) long (pad_id after EOS), response_mask (B, Tn) float (EOS included), logprobs (B, Tn)
    under the full tempered distribution (0 on padding)."""
    assert model.config.lm_head, "generate needs a model with an lm head"
    B, P = idx.size()
    real = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    room = model.config.block_size - real.long().sum(-1)  # (B,) each row's own room in the context
    asked = torch.as_tensor(max_new_tokens, device=idx.device).clamp(min=0)  # () or (B,)
    if forced is not None:
        asked = asked.clamp(max=forced.size(1))
    budget = torch.minimum(room, asked)  # (B,) each row's new tokens
    least, steps, most_asked = torch.stack([room.min(), budget.max(), asked.max()]).tolist()  # one host sync
    assert P <= model.config.block_size and least > 0 or most_asked <= 0, (
        f"a prompt of {P} tokens leaves no room in the context of {model.config.block_size}: sample() skips it"
    )
    if steps <= 0:  # nothing to generate
        return idx.new_empty(B, 0), torch.zeros(B, 0, device=idx.device), torch.zeros(B, 0, device=idx.device)
    shared = shared_prompts(idx, real)
    if hasattr(model, "prefill"):  # hf.HFCausalLM: its own caches, the wrapped model in eval mode while it decodes
        with model.decoding():
            logits, advance = model.prefill(idx, real, steps, compiled, shared)
            return decode_loop(
                logits, advance, budget, eos_id, pad_id, temperature, top_k, top_p, min_new_tokens, generator, forced
            )
    if compiled:
        logits, advance = static_prefill(model, idx, real, steps, cache_len, shared)
    else:
        logits, advance = eager_prefill(model, idx, real, steps, shared)
    return decode_loop(
        logits, advance, budget, eos_id, pad_id, temperature, top_k, top_p, min_new_tokens, generator, forced
    )


@dataclass
class Samples:
    """What `sample` returns: a batch of generated responses and what every caller derives from them."""

    response: Tensor  # (B, Tn) long, pad_id after a row's EOS
    mask: Tensor  # (B, Tn) float, 1 on real tokens, the EOS included
    logprobs: Tensor  # (B, Tn) the sampled tokens' log-probs under the full tempered distribution, 0 on padding
    last: Tensor  # (B,) long, index of each row's last real token (its EOS when it ended)
    ended: Tensor  # (B,) bool, the row ended with EOS
    texts: list[str]  # each response decoded without its EOS
    skipped: int = 0  # prompts that left no room for a token: no response (ended False, text "")


@torch.no_grad()
def sample(
    model, tok, query: Tensor, query_mask: Tensor, max_new_tokens: int | Tensor, temperature: float = 1.0, **kw
) -> Samples:
    """generate over left-padded prompts (query, query_mask (B, P)), EOS and padding from tok; kw goes to generate.
    Returns Samples; a prompt with no room for a token gets no response and counts in `skipped`."""
    fits = query_mask.sum(1) < model.config.block_size  # (B,) room for at least one token
    skipped = int((~fits).sum())  # one host sync
    kept_query, kept_mask = query, query_mask
    if skipped:  # the rest without them, their left padding trimmed to the longest kept prompt
        width = max(1, int(query_mask[fits].sum(1).max())) if skipped < len(fits) else 1
        kept_query, kept_mask = query[fits][:, -width:], query_mask[fits][:, -width:]
        if isinstance(max_new_tokens, Tensor):  # a budget per row
            max_new_tokens = max_new_tokens[fits]
        if isinstance(kw.get("generator"), list):  # a generator per row
            kw["generator"] = [row_generator for row_generator, kept in zip(kw["generator"], fits.tolist()) if kept]
        if kw.get("forced") is not None:  # tokens to score, a row each
            kw["forced"] = kw["forced"][fits]
    response, mask, logprobs = generate(
        model, kept_query, kept_mask, max_new_tokens, tok.eos_id, tok.pad_id, temperature=temperature, **kw
    )
    if skipped:  # back to one row per prompt: a skipped row has no token
        full = response.new_full((len(fits), response.size(1)), tok.pad_id)
        response = full.index_copy(0, fits.nonzero().squeeze(1), response)
        mask = mask.new_zeros(full.shape).index_copy(0, fits.nonzero().squeeze(1), mask)
        logprobs = logprobs.new_zeros(full.shape).index_copy(0, fits.nonzero().squeeze(1), logprobs)
    lengths = mask.sum(1).long()
    last = (lengths - 1).clamp(min=0)
    last_token = response.gather(1, last[:, None]).squeeze(1) if response.size(1) else lengths  # no token: no EOS
    ended = (last_token == tok.eos_id) & (lengths > 0)
    texts = [tok.decode(row) for row in response.tolist()]  # decode drops the pad and EOS ids
    return Samples(response, mask, logprobs, last, ended, texts, skipped)


# -----------------------------------------------------------------------------
# continuing partial responses (the rollout's token prefixes)


def continuation_budget(prefix_ids, prefix_mask, max_new_tokens: int, eos_id: int) -> torch.Tensor:
    """(B,) long: the tokens left of max_new_tokens after each row's prefix, 0 for a prefix that ends with EOS."""
    lengths = prefix_mask.sum(1).long()
    last = torch.arange(prefix_ids.size(1), device=lengths.device) == (lengths - 1)[:, None]  # (B, Tp)
    ended = ((prefix_ids == eos_id) & last).any(1)
    return (max_new_tokens - lengths).clamp(min=0).masked_fill(ended, 0)


def join_samples(tok, prefix_ids, prefix_mask, continued: Samples) -> tuple[Samples, torch.Tensor]:
    """Each row's prefix (B, Tp) and its continuation, both right-padded, as one right-padded response: the
    continuation's tokens follow the prefix's last real one, the sampler's log-probs are 0 on the prefix. Returns the
    joined Samples and the mask of the sampled tokens (B, T), T the longest row."""
    B, Tc = continued.mask.shape
    columns = prefix_mask.sum(1).long()[:, None] + torch.arange(Tc, device=prefix_mask.device)  # (B, Tc)
    continuation_mask = continued.mask.to(prefix_mask.dtype)
    blank = torch.zeros_like(torch.cat([prefix_mask, prefix_mask.new_zeros(B, Tc)], 1))  # (B, Tp + Tc)
    mask = torch.cat([prefix_mask, prefix_mask.new_zeros(B, Tc)], 1).scatter(1, columns, continuation_mask)
    sampled = blank.scatter(1, columns, continuation_mask)
    logprobs = blank.scatter(1, columns, continued.logprobs.to(blank.dtype))
    padding = prefix_ids.new_full((B, Tc), tok.pad_id)
    response = torch.cat([prefix_ids.masked_fill(prefix_mask == 0, tok.pad_id), padding], 1)
    response = response.scatter(1, columns, continued.response)  # a continuation's padding lands past its row's end
    width = max(1, int(mask.sum(1).max()))
    response, mask, sampled, logprobs = (tensor[:, :width] for tensor in (response, mask, sampled, logprobs))
    lengths = mask.sum(1).long()
    last = (lengths - 1).clamp(min=0)
    ended = (response.gather(1, last[:, None]).squeeze(1) == tok.eos_id) & (lengths > 0)
    texts = [tok.decode(row) for row in response.tolist()]  # decode drops the pad and EOS ids
    return Samples(response, mask, logprobs, last, ended, texts, continued.skipped), sampled


# -----------------------------------------------------------------------------
# episodes: several turns against an environment (docs/usage.md "How to extend", an environment)


def observation_ids(tok, observation: str) -> list[int]:
    """An observation's ids, encoded once: a tokenizer without a chat template, its text (it follows the model's EOS
    directly); a chat tokenizer, the next user turn of its template and the assistant header, read as what the
    template renders after an assistant turn's end-of-turn token."""
    if not tok.chat:
        return tok.encode(observation)
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    head = tok.render(probe, False)
    whole = tok.render(probe + [{"role": "user", "content": observation}], True)
    end = max(i for i, token in enumerate(head) if token == tok.eos_id) + 1  # through the assistant's end-of-turn
    assert whole[:end] == head[:end], f"tokenizer {tok.name}: its template re-renders an earlier turn"
    return whole[end:]


@dataclass
class Episodes:
    """What `run_episodes` returns. Token tensors are (B, T) over the whole sequence: the prompt as given (left-padded,
    prompt_width columns), then the model's and the observations' tokens, right-padded."""

    sequences: Tensor  # (B, T) long, pad_id on padding
    attention_mask: Tensor  # (B, T) float, 1 on prompt, model and observation tokens
    mask: Tensor  # (B, T) float, the loss mask: 1 on the model's tokens only
    logprobs: Tensor  # (B, T) the sampler's log-probs of the model's tokens (full tempered distribution), 0 elsewhere
    rewards: Tensor  # (B, T) each turn's reward on that turn's last model token, 0 elsewhere
    returns: Tensor  # (B,) the sum of an episode's turn rewards
    turns: Tensor  # (B,) long, the model turns taken
    truncated: Tensor  # (B,) bool, ended because the next observation and a turn did not fit the context
    ended: Tensor  # (B, max_turns) bool, each turn ended with the end-of-turn token (False past the last turn)
    info: dict  # key -> (B,) float, the last value the environment's info gave (NaN: never given)
    turn_texts: list  # per episode, each turn's text without its end-of-turn token
    observations: list  # per episode, each appended observation's text
    prompt_width: int  # the prompt's columns in the sequence tensors

    def last_turn_ended(self) -> Tensor:
        """(B,) bool: the episode's last turn ended with the end-of-turn token (False for an episode of no turn)."""
        last_turn = (self.turns - 1).clamp(min=0)[:, None]
        return self.ended.gather(1, last_turn).squeeze(1) & (self.turns > 0)


MODEL, OBSERVATION = 1, 2  # what a token after the prompt is


@torch.no_grad()
def run_episodes(
    model, tok, query: Tensor, query_mask: Tensor, envs: list, max_turns: int, max_new_tokens: int, **kw
) -> Episodes:
    """Episodes over left-padded prompts (query, query_mask (B, P)), one environment a row (env.step(response, ended)
    -> (observation, reward, done[, info])). Each turn `sample`s every live row's whole history (a fresh prefill: the
    history grows, the decode stays generate's at the batch's shape), hands each row its turn's text and appends the
    observation's ids. An episode ends when its environment says done, after max_turns, or when the next observation
    and a full turn of max_new_tokens cannot fit the context (truncated). kw goes to sample (temperature, generator,
    compiled, ...)."""
    B = query.size(0)
    block_size = model.config.block_size
    cache_len = block_size if max_turns > 1 else None  # one turn: the decode's own width, as a single response's
    query_rows, query_mask_rows = query.tolist(), query_mask.tolist()  # one host read each, however many rows
    histories = [[token for token, real in zip(*row) if real] for row in zip(query_rows, query_mask_rows)]
    after = [[] for _ in range(B)]  # (token, kind, logprob, reward) of each token after the prompt
    turns = [0] * B
    ended = torch.zeros(B, max_turns, dtype=torch.bool)
    truncated = [len(history) >= block_size for history in histories]  # no room for a token: no turn at all
    info, turn_texts, observations = {}, [[] for _ in range(B)], [[] for _ in range(B)]
    live = [b for b in range(B) if not truncated[b]]
    logprob_dtype = torch.float32  # the sampler's (float64 for a float64 model)
    decoded_width = 1  # the widest turn's decode (its response tensor's columns)
    for turn in range(max_turns):
        if not live:
            break
        # 1. every live row's history through the decode, left-padded again; a finished row keeps its last token and
        # no budget, so each turn decodes the batch's shape (compiled: one graph, its caches the context long when
        # there are several turns)
        rows = [histories[b] if b in live else histories[b][-1:] for b in range(B)]
        width = max(len(row) for row in rows)
        idx = query.new_tensor([[tok.pad_id] * (width - len(row)) + row for row in rows])
        idx_mask = query_mask.new_tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        budget = torch.tensor([max_new_tokens if b in live else 0 for b in range(B)], device=query.device)
        samples = sample(model, tok, idx, idx_mask, budget, cache_len=cache_len, **kw)
        logprob_dtype = samples.logprobs.dtype
        decoded_width = max(decoded_width, samples.response.size(1))
        # the turn on the host in one read a tensor, whatever the batch (a read a row would grow with it)
        lengths, turn_ended = samples.mask.sum(1).long().tolist(), samples.ended.tolist()
        response_rows, logprob_rows = samples.response.tolist(), samples.logprobs.tolist()
        still_live = []
        for b in live:
            # 2. the turn's tokens as sampled, then the environment's answer on the turn's last token
            n = lengths[b]
            tokens, logprobs = response_rows[b][:n], logprob_rows[b][:n]
            observation, reward, done, *rest = envs[b].step(samples.texts[b], turn_ended[b])
            for key, value in (rest[0] if rest else {}).items():
                info.setdefault(key, [float("nan")] * B)[b] = float(value)
            after[b] += [(token, MODEL, logprob, 0.0) for token, logprob in zip(tokens, logprobs)]
            after[b][-1] = (*after[b][-1][:3], float(reward))
            histories[b] += tokens
            turns[b] += 1
            ended[b, turn] = turn_ended[b]
            turn_texts[b].append(samples.texts[b])
            if done or turn == max_turns - 1:
                continue
            # 3. the observation, encoded once, when it and a whole turn fit the context
            text = observation or ""
            ids = observation_ids(tok, text)
            if len(histories[b]) + len(ids) + max_new_tokens > block_size:
                truncated[b] = True
                continue
            after[b] += [(token, OBSERVATION, 0.0, 0.0) for token in ids]
            histories[b] += ids
            observations[b].append(text)
            still_live.append(b)
        live = still_live
    tensors = episode_tensors(query, query_mask, after, tok.pad_id, logprob_dtype, decoded_width)
    return Episodes(
        **tensors,
        turns=torch.tensor(turns, device=query.device),
        truncated=torch.tensor(truncated, device=query.device),
        ended=ended.to(query.device),
        info={key: torch.tensor(values, device=query.device) for key, values in info.items()},
        turn_texts=turn_texts,
        observations=observations,
        prompt_width=query.size(1),
    )


def episode_tensors(
    query: Tensor, query_mask: Tensor, after: list, pad_id: int, dtype: torch.dtype, least_width: int = 1
) -> dict:
    """Episodes' token tensors from each row's (token, kind, logprob, reward) after its prompt: sequences,
    attention_mask, mask, logprobs, rewards (B, P + the longest row's tokens after its prompt, or least_width if more:
    run_episodes passes its widest decode's, so an episode of one turn is as wide as a single response; log-probs and
    rewards in dtype), returns (B,)."""
    B, width = query.size(0), max(least_width, max(len(row) for row in after))
    response = torch.full((B, width), pad_id, dtype=torch.long)
    kinds = torch.zeros(B, width, dtype=torch.long)
    logprobs = torch.zeros(B, width, dtype=torch.float64)
    rewards = torch.zeros(B, width, dtype=torch.float64)
    for b, row in enumerate(after):
        if row:
            tokens, row_kinds, row_logprobs, row_rewards = zip(*row)
            response[b, : len(row)] = torch.tensor(tokens)
            kinds[b, : len(row)] = torch.tensor(row_kinds)
            logprobs[b, : len(row)] = torch.tensor(row_logprobs, dtype=torch.float64)
            rewards[b, : len(row)] = torch.tensor(row_rewards, dtype=torch.float64)
    device = query.device
    prompt_zeros = torch.zeros_like(query_mask, dtype=dtype)
    return {
        "sequences": torch.cat([query, response.to(device)], 1),
        "attention_mask": torch.cat([query_mask.to(dtype), (kinds > 0).to(device, dtype)], 1),
        "mask": torch.cat([prompt_zeros, (kinds == MODEL).to(device, dtype)], 1),
        "logprobs": torch.cat([prompt_zeros, logprobs.to(device, dtype)], 1),
        "rewards": torch.cat([prompt_zeros, rewards.to(device, dtype)], 1),
        "returns": rewards.sum(1).to(device, dtype),
    }
