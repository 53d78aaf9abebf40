"""The fixed-shape decode (DESIGN §7, "GPU throughput"): static KV caches and the one-token step compiled (inductor's
CPU backend here; mode="reduce-overhead", CUDA graphs, on a GPU) give the eager decode's tokens for the same
generator, greedy and sampled, over ragged prompts with rows stopping at EOS. float64 models (DESIGN §9), 1 layer."""

import shutil

import pytest
import torch

from data import pad_left
from model import GPT, GPTConfig, StaticKVCache

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler"
)
EOS, PAD, V = 5, 60, 50  # the pad id lies outside the vocabulary, as the task's does


def tiny_policy(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=1, n_head=2, n_embd=16)).double().eval()
    with torch.no_grad():  # an EOS likely enough that some rows stop early, some run to the end
        direction = model.transformer.wte.weight[EOS]
        model.transformer.ln_f.bias += 2.5 * direction / direction.norm() ** 2
    return model


def ragged_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 11, 1, 7, 17, 5]  # widths that pad to one bucket of 16 and past it
    prompts = [torch.randint(6, V, (n,), generator=g).tolist() for n in lengths]
    return pad_left(prompts, PAD)


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


@needs_compiler
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_decode_gives_the_eager_tokens(temperature):
    """Greedy and sampled: the same tokens, masks and (to float64 rounding) log-probs as the eager decode from the
    same generator state; some rows end at EOS before the last step."""
    model = tiny_policy()
    idx, mask = ragged_prompts()
    outputs = {}
    for compiled in (False, True, True):  # the second compiled call reuses the kept caches
        generator = torch.Generator().manual_seed(7)
        outputs[compiled] = model.generate(
            idx, mask, 20, EOS, PAD, temperature=temperature, generator=generator, compiled=compiled
        )
    (tokens, masks, logprobs), (tokens_c, masks_c, logprobs_c) = outputs[False], outputs[True]
    assert torch.equal(tokens, tokens_c) and torch.equal(masks, masks_c)
    assert torch.allclose(logprobs, logprobs_c, atol=1e-10, rtol=0)
    lengths = masks.sum(1)
    assert (lengths < masks.size(1)).any() and (tokens[torch.arange(6), lengths.long() - 1] == EOS).any()


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
        vocab_size=V,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # EOS wins where token 20 would lead: some rows stop early, some run to the end
        hf.lm_head.weight.normal_(0.0, 0.5)
        hf.lm_head.weight[EOS] = 1.5 * hf.lm_head.weight[20]
    return HFCausalLM(hf)


@needs_compiler
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hf_compiled_decode_gives_the_eager_tokens(temperature):
    """A Hugging Face Llama: a StaticCache and its compiled forward give the DynamicCache decode's tokens."""
    model = tiny_llama()
    assert model.hf._can_compile_fullgraph
    idx, mask = ragged_prompts()
    outputs = {}
    for compiled in (False, True, True):  # the second compiled call reuses the kept caches
        generator = torch.Generator().manual_seed(7)
        outputs[compiled] = model.generate(
            idx, mask, 20, EOS, PAD, temperature=temperature, generator=generator, compiled=compiled
        )
    (tokens, masks, logprobs), (tokens_c, masks_c, logprobs_c) = outputs[False], outputs[True]
    assert torch.equal(tokens, tokens_c) and torch.equal(masks, masks_c)
    # the rotary table is float32 in transformers (inv_freq), and inductor's float32 cos/sin round differently
    # (the StaticCache decode run eagerly matches to the last bit)
    assert torch.allclose(logprobs, logprobs_c, atol=1e-6, rtol=0)
    lengths = masks.sum(1)
    assert (lengths < masks.size(1)).any() and (lengths == masks.size(1)).any()
