"""generate.py: the KV-cache decode against naive full-forward loops (greedy batched = single = naive, ragged EOS
stops), log-probs of the sampled tokens against a full forward, the response mask, min_new_tokens and the top-k/top-p
filters, reproducibility per batch, inverse-CDF sampling; and the fixed-shape decode (docs/design.md §7): static KV
caches and the one-token step compiled (inductor's CPU backend here; CUDA graphs on a GPU) give the eager decode's
tokens for the same generator, for model.GPT and a Hugging Face Llama. Greedy-equality tests run in float64 on models
with wide random weights (no near-ties, varied greedy paths)."""

import shutil

import pytest
import torch
from conftest import boost_eos

from data import pad_left
from generate import StaticKVCache, generate, sample, sample_tokens, shared_prompts, uniforms
from model import GPT, GPTConfig, logprobs_from_logits

V = 97  # vocab size of every tiny model
PAD = V  # pad id outside the embedding, like GPT-2's tiktoken tokenizer
needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler"
)


def tiny_config(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=32), **kw})


def wide_model(seed: int = 0, **kw) -> GPT:
    """float64 model with std-0.3 matrices: peaked, varied greedy continuations instead of one repeated token."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**kw)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
    return model


def left_pad(seqs: list[list[int]], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    idx = torch.tensor([[pad_id] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[0.0] * (T - len(s)) + [1.0] * len(s) for s in seqs])
    return idx, mask


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def naive_greedy(model: GPT, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Full forward over the whole sequence every step, argmax, stop at EOS."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(max_new_tokens):
        logits, _ = model(ids)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


def row(response: torch.Tensor, mask: torch.Tensor, i: int) -> list[int]:
    return response[i, : int(mask[i].sum())].tolist()


# -----------------------------------------------------------------------------
# the KV-cache decode against naive loops


def test_greedy_batched_equals_single_equals_naive():
    model = wide_model()
    prompts = random_prompts([5, 2, 7, 1, 4, 6])
    max_new = 12
    # EOS: the token that makes the rows stop at the most different steps (or not at all)
    free = [naive_greedy(model, p, max_new, eos_id=-1) for p in prompts]
    eos = max(sorted({t for f in free for t in f}), key=lambda t: len({f.index(t) if t in f else -1 for f in free}))
    naive = [naive_greedy(model, p, max_new, eos) for p in prompts]
    ended = [len(n) for n in naive if n[-1] == eos]
    assert len(set(ended)) >= 2 and len(ended) < len(naive)  # ragged stops, and rows that never stop
    idx, mask = left_pad(prompts)
    response, rmask, logprobs = generate(model, idx, mask, max_new, eos, PAD, temperature=0.0)
    assert response.shape[1] <= max_new
    for i, p in enumerate(prompts):
        assert row(response, rmask, i) == naive[i], f"row {i}"
        assert (response[i, len(naive[i]) :] == PAD).all() and rmask[i, len(naive[i]) :].sum() == 0
        single, smask, slp = generate(model, torch.tensor([p]), None, max_new, eos, PAD, temperature=0.0)
        assert row(single, smask, 0) == naive[i], f"row {i} alone"
        n = len(naive[i])
        assert (slp[0, :n] - logprobs[i, :n]).abs().max() <= 1e-10


def test_sampling_reproducible_per_batch_not_per_row():
    """generate's contract: the same generator state and batch give the same tokens; a row moved elsewhere in the
    batch draws other uniforms (one per row per step) and samples other tokens; greedy does not depend on the batch."""
    model = wide_model()
    prompts = random_prompts([5, 2, 7, 4])
    swapped = [prompts[1], prompts[0]] + prompts[2:]

    def sample(batch: list[list[int]], temperature: float) -> list[list[int]]:
        idx, mask = left_pad(batch)
        generator = torch.Generator().manual_seed(0)
        response, rmask, _ = generate(model, idx, mask, 12, -1, PAD, temperature=temperature, generator=generator)
        return [row(response, rmask, i) for i in range(len(batch))]

    first = sample(prompts, 1.0)
    assert sample(prompts, 1.0) == first
    moved = sample(swapped, 1.0)
    assert moved[1] != first[0] and moved[0] != first[1]  # prompts 0 and 1 swapped places: other tokens
    greedy = sample(prompts, 0.0)
    greedy_moved = sample(swapped, 0.0)
    assert greedy_moved[1] == greedy[0] and greedy_moved[0] == greedy[1]


def sample_and_rescore(model: GPT, temperature: float, **kw) -> tuple:
    idx, mask = left_pad(random_prompts([6, 1, 3, 8, 4, 2, 7, 5]))
    g = torch.Generator().manual_seed(0)
    response, rmask, logprobs = generate(model, idx, mask, 16, 3, PAD, temperature=temperature, generator=g, **kw)
    P, Tn = idx.size(1), response.size(1)
    with torch.no_grad():
        logits, _ = model(torch.cat([idx, response], 1), torch.cat([mask, rmask], 1))
    return response, rmask, logprobs, logits[:, P - 1 : P + Tn - 1]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_generate_logprobs_match_full_forward(temperature):
    torch.manual_seed(0)
    model = boost_eos(GPT(tiny_config()).eval(), eos_id=3, amount=2.0)  # fp32, some rows end early
    response, rmask, logprobs, logits = sample_and_rescore(model, temperature)
    t = temperature if temperature > 0 else 1.0
    ref = torch.log_softmax(logits / t, dim=-1).gather(-1, response.clamp(max=V - 1)[..., None]).squeeze(-1)
    real = rmask.bool()
    assert (logprobs[real] - ref[real]).abs().max() <= 1e-5
    assert (logprobs[~real] == 0).all() and (~real).any()
    assert (logprobs_from_logits(logits, response, t)[real] - ref[real]).abs().max() <= 1e-6


def test_response_mask_and_eos_stop():
    torch.manual_seed(0)
    model = boost_eos(GPT(tiny_config()).eval(), eos_id=3, amount=2.0)
    response, rmask, _, _ = sample_and_rescore(model, 1.0)
    ended = 0
    for i in range(response.size(0)):
        toks = response[i].tolist()
        n = toks.index(3) + 1 if 3 in toks else len(toks)  # up to and including the first EOS
        ended += 3 in toks
        assert rmask[i, :n].tolist() == [1.0] * n and rmask[i, n:].sum() == 0
        assert all(t == PAD for t in toks[n:]) and PAD not in toks[:n]
    assert 0 < ended < response.size(0)
    # every row ends quickly: the loop stops early, at a multiple of 8 steps
    model = boost_eos(model, eos_id=3, amount=20.0)
    response, rmask, _, _ = sample_and_rescore(model, 1.0)
    assert response.size(1) == 8 and rmask[:, -1].sum() == 0
    with pytest.raises(AssertionError, match="leaves no room in the context"):
        generate(model, torch.zeros(1, 64, dtype=torch.long), None, 8, 3, PAD)
    assert all(x.shape == (1, 0) for x in generate(model, torch.zeros(1, 64, dtype=torch.long), None, 0, 3, PAD))


class DigitTokenizer:
    """What sample() needs of a tokenizer: EOS 3, the pad id, and a decode that drops both."""

    eos_id, pad_id = 3, PAD

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids if i not in (self.eos_id, self.pad_id))


def test_each_row_has_its_own_budget_and_sample_skips_a_full_prompt():
    """A long prompt takes at most block_size - its length new tokens and stops there without EOS; the short prompt
    beside it still gets max_new_tokens, the greedy tokens it gets alone. sample() gives a prompt that fills the
    context no response (counted in skipped: no token, not ended, no text) and every other row its own."""
    model = wide_model()  # block_size 64
    long, short = random_prompts([61, 3], seed=2)
    idx, mask = left_pad([long, short])
    response, rmask, _ = generate(model, idx, mask, 10, -1, PAD, temperature=0.0)
    assert rmask.sum(1).tolist() == [3, 10]
    assert row(response, rmask, 0) == naive_greedy(model, long, 3, -1)
    alone, alone_mask, _ = generate(model, torch.tensor([short]), None, 10, -1, PAD, temperature=0.0)
    assert row(response, rmask, 1) == row(alone, alone_mask, 0) == naive_greedy(model, short, 10, -1)
    full = random_prompts([64], seed=3)[0]
    query, query_mask = left_pad([full, short, long])
    samples = sample(model, DigitTokenizer(), query, query_mask, 10, temperature=0.0)
    assert samples.skipped == 1 and samples.mask[0].sum() == 0 and not samples.ended[0] and samples.texts[0] == ""
    assert (samples.response[0] == PAD).all() and (samples.logprobs[0] == 0).all()
    assert row(samples.response, samples.mask, 1) == naive_greedy(model, short, 10, 3)
    assert row(samples.response, samples.mask, 2) == naive_greedy(model, long, 3, 3)
    lengths = samples.mask.sum(1).long()
    assert samples.last.tolist() == (lengths - 1).clamp(min=0).tolist()


def test_min_new_tokens_and_filters():
    torch.manual_seed(0)
    model = boost_eos(GPT(tiny_config()).eval(), eos_id=3, amount=20.0)
    response, rmask, logprobs, logits = sample_and_rescore(model, 1.0, min_new_tokens=6)
    assert (response[:, :6] != 3).all() and (rmask[:, :6] == 1).all()
    assert (response == 3).any(dim=1).all()  # EOS right after
    # log-probs while EOS is suppressed are under that masked distribution
    logits[:, :6, 3] = -float("inf")
    ref = torch.log_softmax(logits, -1).gather(-1, response.clamp(max=V - 1)[..., None]).squeeze(-1)
    assert (logprobs - ref)[rmask.bool()].abs().max() <= 1e-5
    # top_k=1 and a tiny top_p sample the argmax; log-probs stay those of the full distribution
    model = wide_model()
    greedy = sample_and_rescore(model, 0.0)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        out = sample_and_rescore(model, 1.0, **kw)
        assert torch.equal(out[0], greedy[0]) and (out[2] - greedy[2]).abs().max() <= 1e-10
    # top_k=3 samples among the 3 largest logits only
    response, rmask, logprobs, logits = sample_and_rescore(model, 0.7, top_k=3)
    rank = (logits > logits.gather(-1, response.clamp(max=V - 1)[..., None])).sum(-1)
    assert (rank[rmask.bool()] < 3).all()
    # the generator alone decides the samples
    a, b = sample_and_rescore(model, 1.0), sample_and_rescore(model, 1.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    idx, mask = left_pad(random_prompts([6, 1, 3, 8]))
    c = generate(model, idx, mask, 16, 3, PAD, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(c[0], a[0][:4, : c[0].size(1)])


def test_sample_tokens_distribution_and_masked_logits():
    """Inverse-CDF sampling: empirical frequencies match softmax (chi-square-sized tolerance), -inf never sampled."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor(
        [[0.0, 1.0, -float("inf"), 2.0, -1.0], [-float("inf"), -float("inf"), 5.0, -float("inf"), -float("inf")]]
    )
    n = 20000
    toks = torch.stack([sample_tokens(logits, uniforms(2, g, "cpu")) for _ in range(n)])  # (n, 2)
    assert (toks[:, 1] == 2).all() and (toks[:, 0] != 2).all()
    freq = torch.bincount(toks[:, 0], minlength=5).double() / n
    p = torch.softmax(logits[0].double(), -1)
    assert (freq - p).abs().max() <= 4 * (p * (1 - p) / n).sqrt().max()
    # a leading zero-probability token is never chosen, even for u = 0
    g0 = torch.Generator().manual_seed(1)
    sampled = [sample_tokens(torch.tensor([[-float("inf"), 0.0]]), uniforms(1, g0, "cpu")) for _ in range(200)]
    assert (torch.stack(sampled) == 1).all()


# -----------------------------------------------------------------------------
# the fixed-shape decode: static caches, the compiled one-token step (float64 models, docs/design.md §9; 1 layer)

DECODE_EOS, DECODE_PAD, DECODE_V = 5, 60, 50  # the pad id lies outside the vocabulary, as the task's does


def decode_policy(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=DECODE_V, block_size=64, n_layer=1, n_head=2, n_embd=16)).double().eval()
    with torch.no_grad():  # an EOS likely enough that some rows stop early, some run to the end
        direction = model.transformer.wte.weight[DECODE_EOS]
        model.transformer.ln_f.bias += 2.5 * direction / direction.norm() ** 2
    return model


def ragged_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 11, 1, 7, 17, 5]  # widths that pad to one bucket of 16 and past it
    prompts = [torch.randint(6, DECODE_V, (n,), generator=g).tolist() for n in lengths]
    return pad_left(prompts, DECODE_PAD)


def test_static_cache_writes_its_slots_and_reads_whole():
    slots = torch.tensor([1, 2])
    cache = StaticKVCache(2, 3, 6, 4, slots, torch.float64)
    k, v = torch.randn(2, 3, 2, 4, dtype=torch.float64), torch.randn(2, 3, 2, 4, dtype=torch.float64)
    keys, values = cache.update(k, v)
    assert keys.shape == (2, 3, 6, 4) and torch.equal(keys[:, :, 1:3], k) and torch.equal(values[:, :, 1:3], v)
    assert not keys[:, :, [0, 3, 4, 5]].any()  # unwritten slots stay zero
    step = torch.zeros(1, dtype=torch.long)  # then one slot a step, refilled in place
    cache.slots = step
    step.fill_(4)
    cache.update(k[:, :, :1], v[:, :, :1])
    assert torch.equal(cache.k[:, :, 4], k[:, :, 0]) and torch.equal(cache.k[:, :, 1:3], k)


def compiled_against_eager(model, temperature: float) -> tuple:
    """The eager decode's outputs, then the compiled decode's from the same generator state, twice (the second
    compiled call reuses the kept caches); returns (eager, last compiled)."""
    idx, mask = ragged_prompts()
    outputs = {}
    for compiled in (False, True, True):
        generator = torch.Generator().manual_seed(7)
        outputs[compiled] = generate(
            model,
            idx,
            mask,
            20,
            DECODE_EOS,
            DECODE_PAD,
            temperature=temperature,
            generator=generator,
            compiled=compiled,
        )
    return outputs[False], outputs[True]


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_decode_gives_the_eager_tokens(temperature):
    """Greedy and sampled: the same tokens, masks and (to float64 rounding) log-probs as the eager decode from the
    same generator state; some rows end at EOS before the last step."""
    (tokens, masks, logprobs), (tokens_c, masks_c, logprobs_c) = compiled_against_eager(decode_policy(), temperature)
    assert torch.equal(tokens, tokens_c) and torch.equal(masks, masks_c)
    assert torch.allclose(logprobs, logprobs_c, atol=1e-10, rtol=0)
    lengths = masks.sum(1)
    assert (lengths < masks.size(1)).any() and (tokens[torch.arange(6), lengths.long() - 1] == DECODE_EOS).any()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf import HFCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=DECODE_V,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=DECODE_EOS,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # EOS wins where token 20 would lead: some rows stop early, some run to the end
        hf.lm_head.weight.normal_(0.0, 0.5)
        hf.lm_head.weight[DECODE_EOS] = 1.5 * hf.lm_head.weight[20]
    return HFCausalLM(hf)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hf_compiled_decode_gives_the_eager_tokens(temperature):
    """A Hugging Face Llama: a StaticCache and its compiled forward give the DynamicCache decode's tokens."""
    model = tiny_llama()
    assert model.hf._can_compile_fullgraph
    (tokens, masks, logprobs), (tokens_c, masks_c, logprobs_c) = compiled_against_eager(model, temperature)
    assert torch.equal(tokens, tokens_c) and torch.equal(masks, masks_c)
    # the rotary table is float32 in transformers (inv_freq), and inductor's float32 cos/sin round differently
    # (the StaticCache decode run eagerly matches to the last bit)
    assert torch.allclose(logprobs, logprobs_c, atol=1e-6, rtol=0)
    lengths = masks.sum(1)
    assert (lengths < masks.size(1)).any() and (lengths == masks.size(1)).any()


# -----------------------------------------------------------------------------
# a prompt the batch repeats: prefilled once (generate.shared_prompts)


def test_shared_prompts_finds_the_rows_of_each_prompt():
    idx, mask = left_pad([[5, 6], [7], [5, 6], [7], [PAD - 1, 7], [5, 6]])
    first, copy = shared_prompts(idx, mask.bool())
    assert sorted(first.tolist()) == [0, 1, 4]
    assert first[copy].tolist() == [0, 1, 0, 1, 4, 0]  # each row's prompt, by its first row
    assert shared_prompts(*left_pad([[5, 6], [7], [6, 5]])[:1], torch.ones(3, 2, dtype=torch.bool)) is None
    # the same ids with the padding elsewhere are two prompts
    idx = torch.tensor([[PAD, 7, 8], [7, 8, PAD]])
    assert shared_prompts(idx, idx != PAD) is None


@pytest.mark.parametrize(
    "kind, compiled",
    [
        ("gpt", False),
        pytest.param("gpt", True, marks=[pytest.mark.slow, needs_compiler]),
        ("llama", False),
        pytest.param("llama", True, marks=[pytest.mark.slow, needs_compiler]),
    ],
    ids=["gpt", "gpt_compiled", "llama", "llama_compiled"],
)
def test_a_repeated_prompt_is_prefilled_once_and_decodes_as_its_own_rows(monkeypatch, compiled, kind):
    """Five ragged prompts three times each, as GRPO lays out its groups: the prefill runs on five rows, and each row's
    greedy tokens and log-probs are its prompt's generated alone; sampled rows of one prompt draw their own tokens, and
    forced through the decode again they read the sampler's log-probs. model.GPT (eager, and the static caches of the
    compiled decode) and a Hugging Face Llama (its DynamicCache, and the StaticCache of its compiled decode)."""

    model = decode_policy() if kind == "gpt" else tiny_llama()
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(6, DECODE_V, (n,), generator=g).tolist() for n in (5, 2, 7, 1, 4)]
    prompts = [prompt for prompt in distinct for _ in range(3)]
    idx, mask = pad_left(prompts, DECODE_PAD)
    batches = []  # the rows of each forward, the prefill's first
    if kind == "gpt" and not compiled:
        trunk = model._trunk
        monkeypatch.setattr(model, "_trunk", lambda idx, *a: batches.append(idx.size(0)) or trunk(idx, *a))
    elif not compiled:
        forward = model.hf.forward
        monkeypatch.setattr(
            model.hf, "forward", lambda **kw: batches.append(kw["attention_mask"].size(0)) or forward(**kw)
        )
    generate_kw = dict(eos_id=DECODE_EOS, pad_id=DECODE_PAD, compiled=compiled)
    response, rmask, logprobs = generate(model, idx, mask, 10, temperature=0.0, **generate_kw)
    assert compiled or batches[:2] == [5, 15]  # the prefill on one row a prompt, the decode on every row
    for i, prompt in enumerate(prompts):
        alone, amask, alp = generate(model, torch.tensor([prompt]), None, 10, DECODE_EOS, DECODE_PAD, temperature=0.0)
        assert row(response, rmask, i) == row(alone, amask, 0), f"row {i}"
        n = int(amask.sum())
        assert (logprobs[i, :n] - alp[0, :n]).abs().max() <= (1e-6 if compiled else 1e-10)
    generator = torch.Generator().manual_seed(0)
    sampled, smask, slogprobs = generate(model, idx, mask, 10, temperature=1.0, generator=generator, **generate_kw)
    assert len({tuple(row(sampled, smask, i)) for i in range(3)}) > 1  # one prompt, three draws
    assert (smask.sum(1) < smask.size(1)).any()  # some rows ended before the last step
    # the drawn tokens forced through the same decode: the log-probs the sampler read, bit for bit (eval.py's KL)
    forced = generate(model, idx, mask, sampled.size(1), temperature=1.0, forced=sampled, **generate_kw)
    assert all(torch.equal(a, b) for a, b in zip(forced, (sampled, smask, slogprobs)))
