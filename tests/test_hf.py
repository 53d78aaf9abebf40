"""hf.py (any Hugging Face causal LM behind GPT's interface) and GPT's reward-model export, against transformers itself;
the --init grammar; BOS per tokenizer; offline loads as one line; and the whole SFT -> RM -> PPO chain on a tiny random
Llama (`--init hf:<dir>`) and on a tiny random GPT-2 folder (native GPT), exported and reloaded by transformers. Tiny
random Llama and GPT-2 folders written by conftest (weights widened to std 0.3 so greedy paths are varied and peaked), a
word-level tokenizer beside them, no network. Greedy comparisons stop at the first step whose top-two logit gap is ≤
1e-4 (docs/design.md §9): Llama's RMSNorm and rotary tables run in fp32 even in a float64 model. Under torch.compile the
adapter's training forward is one graph (Llama, Qwen2, LoRA) and a compiled PPO run a bounded number."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import HF_EOS, HF_PAD, HF_V, ROOT, checkpoint_dict, offline, run_chain, write_tokenizer

import checkpoints
import common
import data
import hf
import tokenizer
from generate import generate
from hf import HFCausalLM, load_init, model_from_checkpoint
from model import GPT, GPTConfig, logprobs_from_logits

V, EOS, PAD = HF_V, HF_EOS, HF_PAD  # the tiny folders' vocabulary rows, and their tokenizer's EOS and pad ids


def write_bos_tokenizer(path: str) -> None:
    """A Llama-style tokenizer: its own encode starts every text with <s> (a post-processor), like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<pad>", "<s>"] + [f"w{i}" for i in range(80)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    hf_tok.save_pretrained(path)


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("hf_bos_tokenizer"))
    write_bos_tokenizer(path)
    return path


@pytest.fixture(params=["llama", "gpt2"])
def hf_dir(request, llama_dir, gpt2_dir) -> str:
    return {"llama": llama_dir, "gpt2": gpt2_dir}[request.param]


def raw_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    idx = torch.tensor([[pad_id] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in seqs])
    return idx, mask


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 83, (n,), generator=g).tolist() for n in lengths]


# -----------------------------------------------------------------------------
# --init hf:, forward, padding


def test_init_grammar_rejects_unknown():
    with pytest.raises(common.UserError, match="--init nonsense: expected"):
        hf.load_init("nonsense")


def test_load_init_routes(llama_dir, gpt2_dir):
    model, tok, ckpt = load_init(f"hf:{llama_dir}")
    assert isinstance(model, HFCausalLM) and ckpt is None and model.score_head is None
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (EOS, PAD, 83)
    c = model.config
    assert (c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd) == (64, V, 2, 4, 32)
    assert c.hf_config["model_type"] == "llama" and c.hf_name_or_path == llama_dir
    # a plain folder: Llama goes to the adapter, GPT-2 to the native GPT; hf: forces the adapter
    assert isinstance(load_init(llama_dir, score_head=True, lm_head=False)[0], HFCausalLM)
    assert type(load_init(gpt2_dir)[0]) is GPT
    gpt2 = load_init(f"hf:{gpt2_dir}")[0]
    assert isinstance(gpt2, HFCausalLM) and gpt2.config.block_size == 64
    # counts as GPT's: the untied Llama lm head is a matmul (kept), the tied GPT-2 one is wte (kept), wpe dropped
    emb = V * 32
    assert model.num_params() == model.num_params(non_embedding=False) - emb
    assert gpt2.num_params() == gpt2.num_params(non_embedding=False) - 64 * 32
    assert model.flops_per_token(16) == 6 * model.num_params() + 12 * 2 * 4 * 8 * 16
    with pytest.raises(common.UserError, match="no folder .*missing here"):
        load_init(f"hf:{llama_dir}/missing")


def test_forward_matches_transformers_and_padding_invariance(hf_dir):
    model = load_init(f"hf:{hf_dir}", score_head=True)[0].eval()
    raw = raw_hf(hf_dir)
    seqs = prompts([7, 12, 3])
    for pad in (PAD, V + 5):  # a pad id inside the vocab, and one outside it (replaced before the embedding)
        idx, mask = left_pad(seqs, pad)
        with torch.no_grad():
            logits, scores = model(idx, mask)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            ref = raw(input_ids=idx.clamp(max=V - 1), attention_mask=mask, position_ids=pos).logits
            real = mask.bool()
            assert (logits[real] - ref[real]).abs().max() <= 1e-4
            for i, s in enumerate(seqs):  # each row alone, unpadded: same logits and scores
                alone_logits, alone_scores = model(torch.tensor([s]))
                assert (logits[i, real[i]] - alone_logits[0]).abs().max() <= 1e-5
                assert (scores[i, real[i]] - alone_scores[0]).abs().max() <= 1e-5
                assert (alone_logits[0] - raw(torch.tensor([s])).logits[0]).abs().max() <= 1e-4
            # logits_to_keep: the last k positions' logits only (transformers' own argument), scores whole
            kept, kept_scores = model(idx, mask, logits_to_keep=5)
            assert kept.shape == (3, 5, logits.size(-1)) and (kept - logits[:, -5:]).abs().max() <= 1e-5
            assert (kept_scores - scores).abs().max() <= 1e-5
            # the score-only pass (the trunk alone) reads the same hidden state
            none, scores_only = model(idx, mask, logits=False)
            assert none is None and (scores_only[real] - scores[real]).abs().max() <= 1e-5
    # a critic: no logits; its untied lm head (Llama) is frozen so DDP sees no unused parameter
    critic = load_init(f"hf:{hf_dir}", score_head=True, lm_head=False)[0]
    assert critic(idx, mask)[0] is None
    assert all(p.requires_grad for p in critic.hf.get_input_embeddings().parameters())
    assert critic.score_head.bias.item() == 0.0


# -----------------------------------------------------------------------------
# generation


def greedy_agrees(ours: list[int], ref: list[int], gaps: list[float], eos_id: int) -> int:
    """Compare two greedy continuations token for token up to the reference's EOS, stopping at the first step whose
    top-two logit gap is ≤ 1e-4 (a near-tie either side may take). Returns the number of tokens compared."""
    n = 0
    for t, r in enumerate(ref):
        if gaps[t] <= 1e-4:
            break
        assert t < len(ours) and ours[t] == r, f"step {t}: {ours} != {ref}"
        n += 1
        if r == eos_id:
            assert len(ours) == t + 1, "ours did not stop at EOS"
            break
    return n


def test_greedy_generation_matches_transformers(hf_dir):
    model = load_init(f"hf:{hf_dir}")[0].double().eval()
    raw = raw_hf(hf_dir).double()
    seqs = prompts([5, 9, 2, 7], seed=3)
    idx, mask = left_pad(seqs, PAD)
    # an EOS the greedy paths actually produce: the token row 0 emits at step 3 (so rows stop at different steps)
    probe, _, _ = generate(model, idx, mask, 4, eos_id=-1, pad_id=PAD, temperature=0.0)
    eos = int(probe[0, 3])
    new = 20
    response, response_mask, _ = generate(model, idx, mask, new, eos_id=eos, pad_id=PAD, temperature=0.0)
    out = raw.generate(
        input_ids=idx,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    top2 = torch.stack(out.logits, 1).topk(2, dim=-1).values  # (B, steps, 2)
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    compared = 0
    for i, s in enumerate(seqs):
        ours = response[i, : int(response_mask[i].sum())].tolist()
        ref = out.sequences[i, idx.size(1) :].tolist()
        compared += greedy_agrees(ours, ref, gaps[i], eos)
        alone, alone_mask, _ = generate(model, torch.tensor([s]), None, new, eos_id=eos, pad_id=PAD, temperature=0.0)
        greedy_agrees(alone[0, : int(alone_mask[0].sum())].tolist(), ref, gaps[i], eos)
        assert (response[i, int(response_mask[i].sum()) :] == PAD).all()
    assert compared >= 20, f"only {compared} tokens compared: the test lost its power"
    assert response_mask[0].sum() <= 4  # row 0 stopped at its EOS


def test_sampled_logprobs_equal_a_full_forward(llama_dir):
    model = load_init(f"hf:{llama_dir}")[0].double().eval()
    idx, mask = left_pad(prompts([6, 3, 10]), V + 5)
    temperature, P = 0.7, idx.size(1)
    g = torch.Generator().manual_seed(0)
    response, response_mask, logprobs = generate(
        model, idx, mask, 12, eos_id=EOS, pad_id=V + 5, temperature=temperature, top_k=20, min_new_tokens=2, generator=g
    )
    again = generate(
        model,
        idx,
        mask,
        12,
        eos_id=EOS,
        pad_id=V + 5,
        temperature=temperature,
        top_k=20,
        min_new_tokens=2,
        generator=torch.Generator().manual_seed(0),
    )[0]
    assert torch.equal(response, again)  # the explicit generator decides everything
    with torch.no_grad():
        logits, _ = model(torch.cat([idx, response], 1), torch.cat([mask, response_mask.long()], 1))
    logits = logits[:, P - 1 : -1].clone()  # the positions that predict each response token
    logits[:, :2, EOS] = -float("inf")  # EOS suppressed for min_new_tokens: the distribution actually sampled from
    ref = logprobs_from_logits(logits, response, temperature) * response_mask
    assert (ref - logprobs).abs().max() <= 1e-5
    assert (logprobs[response_mask == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_hf_model_decodes_with_its_cache_whatever_grad_ckpt(arch, grad_ckpt, dtype, llama_dir, gpt2_dir):
    """An hf: model with --grad-ckpt keeps its wrapped model in train mode (transformers checkpoints activations in
    train mode only), and transformers' GPT-2 drops its KV cache in train mode with checkpointing on: every decode
    step would see one token. The decode runs the wrapped model in eval mode (HFCausalLM.decoding), so the sampled
    tokens' log-probs equal the training forward's (fp32: 1e-5; bf16 autocast: its rounding, a mean under 0.02
    a token, where a decode without its cache was off by far more), with the flag on and off, the mode restored."""
    model = load_init(f"hf:{llama_dir if arch == 'llama' else gpt2_dir}")[0]
    model.set_grad_ckpt(grad_ckpt)
    model.eval()  # the RL stages' models: eval mode, the wrapped one training under --grad-ckpt
    assert model.hf.training == grad_ckpt
    idx, mask = left_pad(prompts([6, 3, 10]), V + 5)
    amp = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad(), amp:
        g = torch.Generator().manual_seed(0)
        response, response_mask, logprobs = generate(
            model, idx, mask, 12, eos_id=EOS, pad_id=V + 5, temperature=1.0, generator=g
        )
        logits, _ = model(torch.cat([idx, response], 1), torch.cat([mask, response_mask.long()], 1))
    assert model.hf.training == grad_ckpt  # restored
    P = idx.size(1)
    ref = logprobs_from_logits(logits[:, P - 1 : -1].float(), response) * response_mask
    error = (ref - logprobs).abs() * response_mask
    if dtype == torch.float32:
        assert error.max() <= 1e-5
    else:
        assert error.sum() / response_mask.sum() <= 0.02


# -----------------------------------------------------------------------------
# checkpoints and export


def test_checkpoint_round_trip(llama_dir, tmp_path, monkeypatch):
    import transformers

    model, tok, _ = load_init(f"hf:{llama_dir}", score_head=True)
    with torch.no_grad():
        model.score_head.bias.fill_(0.3)
        model.hf.get_input_embeddings().weight.add_(0.01)  # weights that are no longer the folder's
    path = str(tmp_path / "ckpt.pt")
    checkpoints.save_checkpoint(
        dict(kind="rm", model=model.state_dict(), model_config=asdict(model.config), tokenizer=tok.state()), path
    )
    # rebuilt from model_config alone: the hub and the folder's weights are never read
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    again, tok2, ckpt = load_init(path, score_head=True, kind="rm")
    assert isinstance(again, HFCausalLM) and ckpt["kind"] == "rm" and tok2.state() == tok.state()
    idx, mask = left_pad(prompts([4, 8]), PAD)
    with torch.no_grad():
        (a_logits, a_scores), (b_logits, b_scores) = model.eval()(idx, mask), again.eval()(idx, mask)
    assert torch.equal(a_logits, b_logits) and torch.equal(a_scores, b_scores)
    # a critic from it keeps the score head, a load without one drops it, an SFT-style checkpoint gains a fresh one
    critic = load_init(path, score_head=True, lm_head=False)[0]
    assert critic.score_head.bias.item() == pytest.approx(0.3) and not critic.config.lm_head
    sft_like = {**ckpt, "model": {k: v for k, v in ckpt["model"].items() if not k.startswith("score_head.")}}
    rm = model_from_checkpoint(sft_like, score_head=True)
    assert rm.score_head.bias.item() == 0.0
    assert model_from_checkpoint(ckpt, score_head=False).score_head is None


def wrapped(state_dict: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state_dict.items()}


def test_model_from_checkpoint_native(tmp_path):
    """A native checkpoint (a path or the dict) comes back as a GPT, prefixed keys stripped, heads as saved or as
    asked: an lm head dropped, a fresh score head whose init follows the global torch seed."""
    torch.manual_seed(0)
    policy = GPT(GPTConfig(block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=32)).eval()
    ckpt = {"model_config": asdict(policy.config), "model": wrapped(policy.state_dict(), "module._orig_mod.")}
    path = str(tmp_path / "ckpt.pt")
    torch.save(ckpt, path)
    idx = torch.randint(3, V, (2, 9))
    for loaded in (model_from_checkpoint(ckpt), model_from_checkpoint(path)):
        assert type(loaded) is GPT and loaded.score_head is None
        with torch.no_grad():
            assert torch.equal(loaded.eval()(idx)[0], policy(idx)[0])
    torch.manual_seed(7)
    rm = model_from_checkpoint(ckpt, score_head=True)
    torch.manual_seed(7)
    again = model_from_checkpoint(path, score_head=True)
    assert torch.equal(rm.score_head.weight, again.score_head.weight) and rm.score_head.bias.item() == 0.0
    assert rm.score_head.weight.abs().sum() > 0
    critic = model_from_checkpoint(ckpt, lm_head=False, score_head=True)
    assert critic.lm_head is None and torch.equal(
        critic.transformer.h[0].mlp.c_fc.weight, policy.transformer.h[0].mlp.c_fc.weight
    )


def test_model_from_checkpoint_adapter(llama_dir):
    """An adapter checkpoint in PPO's layout (model + critic + critic_config, DDP/compile prefixes) comes back as
    HFCausalLMs: the critic without an lm head as critic_config says, heads dropped or added on request."""
    policy = load_init(f"hf:{llama_dir}")[0].eval()
    critic = load_init(f"hf:{llama_dir}", lm_head=False, score_head=True)[0].eval()
    with torch.no_grad():
        critic.score_head.bias.fill_(0.25)
    ckpt = dict(
        model=wrapped(policy.state_dict(), "_orig_mod.module."),
        model_config=asdict(policy.config),
        critic=wrapped(critic.state_dict(), "module."),
        critic_config=asdict(critic.config),
    )
    idx, mask = left_pad(prompts([4, 8]), PAD)
    rng = torch.get_rng_state()
    loaded_policy = model_from_checkpoint(ckpt).eval()
    assert torch.equal(torch.get_rng_state(), rng)  # no random init of weights it loads: a LoRA init follows the seed
    loaded_critic = model_from_checkpoint(ckpt, key="critic").eval()
    assert isinstance(loaded_policy, HFCausalLM) and isinstance(loaded_critic, HFCausalLM)
    assert loaded_policy.score_head is None and loaded_policy.config.lm_head
    assert not loaded_critic.config.lm_head and loaded_critic.score_head.bias.item() == pytest.approx(0.25)
    with torch.no_grad():
        assert torch.equal(loaded_policy(idx, mask)[0], policy(idx, mask)[0])
        assert torch.equal(loaded_critic(idx, mask)[1], critic(idx, mask)[1])
    # an RM from the policy: a fresh score head from the global seed; a scorer without the lm head
    torch.manual_seed(3)
    rm = model_from_checkpoint(ckpt, score_head=True)
    torch.manual_seed(3)
    assert torch.equal(rm.score_head.weight, model_from_checkpoint(ckpt, score_head=True).score_head.weight)
    assert rm.config.lm_head and rm.score_head.bias.item() == 0.0
    dropped = model_from_checkpoint(ckpt, lm_head=False, score_head=True)
    with torch.no_grad():
        assert dropped(idx, mask)[0] is None and dropped(idx, mask)[1] is not None


def test_load_init_reads_checkpoints_through_model_from_checkpoint(tiny_ckpts, monkeypatch):
    calls = []
    real = hf.model_from_checkpoint

    def spy(ckpt, **kw):
        calls.append(kw)
        return real(ckpt, **kw)

    monkeypatch.setattr(hf, "model_from_checkpoint", spy)
    model, _, ckpt = load_init(tiny_ckpts[0], score_head=True)
    assert (
        calls == [dict(lm_head=True, score_head=True, merge=True)]
        and type(model) is GPT
        and model.score_head is not None
    )


def test_a_checkpoint_exports_with_its_tokenizer(tmp_path, tiny_ckpts):
    """hf.export_checkpoint (python hf.py export CKPT DIR), the README's export of a checkpoint on disk, writes the
    tokenizer beside the weights as --export-hf does: AutoTokenizer loads the same ids (it built an empty GPT-2
    tokenizer before: 'hello' was [])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path / "hf")
    hf.export_checkpoint(tiny_ckpts[0], out)
    tok = tokenizer.Tokenizer.from_state(torch.load(tiny_ckpts[0], weights_only=False)["tokenizer"])
    text = "Review of The Silent River (music): the music was very good."
    assert AutoTokenizer.from_pretrained(out).encode(text) == tok.encode(text) != []
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == tok.vocab_size


def test_hf_export_round_trip(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_init(f"hf:{llama_dir}")[0].eval()
    model.export_hf(str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(3, 83, (2, 9))
    with torch.no_grad():
        assert (model(idx)[0] - hf(idx).logits).abs().max() <= 1e-5


def test_adapter_reward_model_export(llama_dir, tmp_path):
    """An adapter RM exports as LlamaForSequenceClassification: same scores at the last real token, up to the
    calibration bias that its bias-free `score` layer cannot hold (saved as config.score_bias)."""
    from transformers import AutoModelForSequenceClassification

    model = load_init(f"hf:{llama_dir}", score_head=True)[0].eval()
    with torch.no_grad():
        model.score_head.bias.fill_(0.3)
    model.export_hf(str(tmp_path), eos_id=EOS, pad_id=PAD)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == PAD and hf.config.score_bias == pytest.approx(0.3)
    seqs = [p + [EOS] for p in prompts([3, 7, 5])]
    T = max(len(s) for s in seqs)
    idx = torch.tensor([s + [PAD] * (T - len(s)) for s in seqs])  # right-padded, as transformers reads it
    mask = (idx != PAD).long()
    with torch.no_grad():
        ours = model(idx, mask)[1].gather(1, (mask.sum(1) - 1)[:, None]).squeeze(1)
        theirs = hf(idx, attention_mask=mask).logits.squeeze(-1) + hf.config.score_bias
    assert (ours - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("bias", [True, False])
def test_reward_model_export(tmp_path, bias):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = GPT(GPTConfig(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=32, bias=bias, score_head=True)).eval()
    with torch.no_grad():
        for p in rm.parameters():
            p.add_(0.1 * torch.randn_like(p))
        rm.score_head.bias.fill_(0.7)  # a calibrated RM: the bias must survive the bias-free `score` layer
    eos = V - 1
    rm.export_hf(str(tmp_path), eos_id=eos, pad_id=0)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    assert hf.config.pad_token_id == 0 and hf.config.num_labels == 1
    # right-padded responses ending with EOS, padded with id 0 (inside the vocab); transformers reads the last non-pad
    g = torch.Generator().manual_seed(0)
    lengths = [5, 11, 8]
    idx = torch.zeros(3, 11, dtype=torch.long)
    for i, n in enumerate(lengths):
        idx[i, : n - 1] = torch.randint(1, V - 1, (n - 1,), generator=g)
        idx[i, n - 1] = eos
    mask = (torch.arange(11)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        _, scores = rm(idx, mask)
        ours = scores[torch.arange(3), torch.tensor(lengths) - 1]  # the score at the EOS token
        theirs = hf(input_ids=idx).logits.squeeze(-1)
    assert (ours - theirs).abs().max() <= 1e-4
    assert ours.abs().min() > 1e-2  # not trivially zero


# -----------------------------------------------------------------------------
# BOS: decided per tokenizer, recorded in its state, once at the start of every sequence


def test_bos_decided_per_tokenizer(bos_tokenizer_dir, llama_dir):
    tok = tokenizer.load_tokenizer(f"hf:{bos_tokenizer_dir}")
    assert tok.bos_id == 3 and tok.state()["bos_id"] == 3
    assert tok.encode("w1 w2") == [5, 6] and tok.encode("w1 w2", bos=True) == [3, 5, 6]
    again = tokenizer.Tokenizer.from_state(tok.state())
    assert again.bos_id == 3 and again.state() == tok.state()
    # a state saved before the decision existed: no BOS, as the stages that trained on it did, and it round-trips
    old_state = {k: v for k, v in tok.state().items() if k != "bos_id"}
    old = tokenizer.Tokenizer.from_state(old_state)
    assert old.bos_id is None and old.encode("w1", bos=True) == [5] and old.state() == old_state
    with pytest.raises(common.UserError, match="changed"):
        tokenizer.Tokenizer.from_state({**tok.state(), "bos_id": 0})
    # a tokenizer without a BOS token, and GPT-2's that defines one its encode never adds: none
    plain = tokenizer.load_tokenizer(f"hf:{llama_dir}")
    assert plain.bos_id is None and plain.state()["bos_id"] is None
    assert plain.encode("w1", bos=True) == plain.encode("w1")


def test_bos_once_at_the_start_of_every_sequence(bos_tokenizer_dir):
    tok = tokenizer.load_tokenizer(f"hf:{bos_tokenizer_dir}")
    prompt, response = tok.encode("w1 w2"), tok.encode("w3")
    rows = [{"prompt": "w1 w2", "response": "w3"}, {"text": "w4 w5"}]
    (sft_ids, sft_mask), (text_ids, text_mask) = data.encode_sft(tok, rows, 64, mask_prompt=True)[0]
    assert sft_ids == [tok.bos_id] + prompt + response + [tok.eos_id] and sft_mask == [0, 0, 0, 1, 1]
    assert text_ids == [tok.bos_id] + tok.encode("w4 w5") + [tok.eos_id] and text_mask == [0, 1, 1, 1]
    pair = {"prompt": "w1 w2", "chosen": "w3", "rejected": "w4 w5"}
    ((seqs, n_prompt, *_),) = data.encode_prefs(tok, [pair], 64)[0]
    assert n_prompt == 3 and seqs[0] == [tok.bos_id] + prompt + response + [tok.eos_id]
    assert all(seq.count(tok.bos_id) == 1 and seq[0] == tok.bos_id for seq in seqs)


# -----------------------------------------------------------------------------
# offline: every model and tokenizer load is one line that names the flag


@pytest.mark.parametrize(
    "spec, start",
    [("gpt2", "could not load GPT-2 weights"), ("hf:gpt2", "no folder gpt2 here, and could not load the tokenizer")],
)
def test_offline_load_is_one_line(spec, start, monkeypatch, tmp_path):
    """An hf: name says first that no folder of that name is here."""
    offline(monkeypatch, tmp_path)
    with pytest.raises(common.UserError) as e:
        load_init(spec, flag="--init")
    msg = str(e.value)
    assert msg.startswith(f"--init {spec}: {start}") and "offline?" in msg and "\n" not in msg


def test_tokenizer_load_failure_names_the_flag(monkeypatch):
    """GPT-2 weights at hand but not the tiktoken ranks: still one line naming the flag."""
    tiny = GPT(GPTConfig(block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=32))
    monkeypatch.setattr(GPT, "from_pretrained", classmethod(lambda cls, spec, score_head=False: tiny))

    def no_ranks(name):
        raise ValueError("could not fetch r50k_base\nsecond line")

    monkeypatch.setattr(tokenizer.tiktoken, "get_encoding", no_ranks)
    with pytest.raises(common.UserError) as e:
        load_init("gpt2", flag="--init")
    msg = str(e.value)
    assert msg.startswith("--init gpt2: could not load the GPT-2 tokenizer") and "\n" not in msg


@pytest.mark.parametrize("name", ["./out/smollm3", "../smollm3", "/no/such/dir", "out/smol/lm3", "~/smollm3"])
def test_a_path_that_can_only_be_local_never_reaches_transformers(name, monkeypatch, tmp_path):
    offline(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    import transformers

    def no_call(*args, **kwargs):
        raise AssertionError("transformers was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_call)
    monkeypatch.setattr(HFCausalLM, "from_pretrained", no_call)
    with pytest.raises(common.UserError) as error:
        load_init(f"hf:{name}", flag="--sft-ckpt")
    assert str(error.value) == f"--sft-ckpt hf:{name}: no folder {name} here"


@pytest.mark.parametrize("name", ["out/smollm3", "smollm3"])
def test_a_name_that_may_be_a_hub_id_says_first_there_is_no_folder(name, monkeypatch, tmp_path):
    """Before: "could not load the tokenizer 'out/smollm3' (offline? ...)", never that the folder is missing."""
    offline(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    os.makedirs("out/smollm2")  # the folder meant
    with pytest.raises(common.UserError) as error:
        load_init(f"hf:{name}", flag="--sft-ckpt")
    message = str(error.value)
    assert message.startswith(f"--sft-ckpt hf:{name}: no folder {name} here, and could not load the tokenizer ")
    assert "from the hub (offline?" in message and "\n" not in message


def test_a_folder_transformers_cannot_read_is_named_as_a_folder(monkeypatch, tmp_path):
    offline(monkeypatch, tmp_path)
    write_tokenizer(str(tmp_path / "tok_only"))  # a tokenizer and no model
    with pytest.raises(common.UserError) as error:
        load_init(f"hf:{tmp_path / 'tok_only'}", flag="--sft-ckpt")
    message = str(error.value)
    assert message.startswith(f"--sft-ckpt hf:{tmp_path / 'tok_only'}: could not load a causal LM from the folder ")
    assert "offline?" not in message and "\n" not in message


@pytest.mark.slow
def test_offline_train_sft_exits_2_without_traceback(monkeypatch, tmp_path):
    env = offline(monkeypatch, tmp_path)
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "train_sft.py", "--init", "gpt2", "--data", str(path), "--max-steps", "1"]
    cmd += ["--out-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--init gpt2: could not load GPT-2 weights" in proc.stderr


# -----------------------------------------------------------------------------
# the whole chain on Hugging Face models (conftest.run_chain: SFT -> RM -> PPO on user data, in-process)


@pytest.mark.slow
def test_llama_chain_sft_rm_ppo(tmp_path, llama_dir, user_data):
    """`--init hf:<llama>` through SFT, RM and PPO: every checkpoint rebuilds the adapter model
    (hf.model_from_checkpoint dispatches on model_config's hf_config), and the PPO policy is no longer the SFT one."""
    ckpts = run_chain(tmp_path, f"hf:{llama_dir}", user_data)
    assert [ckpts[s]["kind"] for s in ("sft", "rm", "ppo")] == ["sft", "rm", "ppo"]
    for s in ("sft", "rm", "ppo"):
        assert ckpts[s]["model_config"]["hf_config"]["model_type"] == "llama", s
    sft, rm, policy = (model_from_checkpoint(ckpts[s]).eval() for s in ("sft", "rm", "ppo"))
    critic = model_from_checkpoint(ckpts["ppo"], key="critic").eval()
    assert all(isinstance(m, HFCausalLM) for m in (sft, rm, policy, critic))
    assert sft.score_head is None and rm.score_head is not None and rm.config.lm_head
    assert critic.score_head is not None and not critic.config.lm_head
    idx = torch.randint(3, 83, (2, 7))
    with torch.no_grad():
        assert (sft(idx)[0] - policy(idx)[0]).abs().max() > 0  # PPO moved the actor
        assert critic(idx)[0] is None and torch.isfinite(critic(idx)[1]).all()
    # the RM's calibration (folded into the head's bias) survives the round trip
    assert rm.score_head.bias.item() == pytest.approx(-ckpts["rm"]["score_offset"], abs=1e-3)


@pytest.mark.slow
def test_gpt2_chain_then_export(tmp_path, gpt2_dir, user_data):
    """A GPT-2 folder (native GPT) through SFT, RM and PPO; the PPO policy and the RM that the stages exported with
    --export-hf load in transformers with the same logits and scores on padded batches."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ckpts = run_chain(tmp_path, gpt2_dir, user_data)
    policy, rm = GPT.from_checkpoint(ckpts["ppo"]).eval(), GPT.from_checkpoint(ckpts["rm"]).eval()
    assert type(policy) is GPT and type(rm) is GPT and rm.score_head.bias.item() != 0.0  # calibrated
    tok = tokenizer.Tokenizer.from_state(ckpts["ppo"]["tokenizer"])
    assert (tok.eos_id, tok.pad_id) == (EOS, PAD)
    hf_policy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_policy")).eval()
    hf_rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf_rm")).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 83, (n,), generator=g).tolist() + [tok.eos_id] for n in (4, 11, 7)]
    # the policy on a left-padded batch (position ids from the mask, as generation uses it)
    idx, mask = data.pad_left(seqs, tok.pad_id)
    with torch.no_grad():
        ours = policy(idx, mask)[0]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        theirs = hf_policy(input_ids=idx, attention_mask=mask.long(), position_ids=pos).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= 1e-4
    # the RM on a right-padded batch: ours at the EOS token, transformers' at the last non-pad token
    idx, mask = data.pad_right(seqs, tok.pad_id)
    lengths = mask.sum(1).long()
    with torch.no_grad():
        ours = rm(idx, mask)[1][torch.arange(len(seqs)), lengths - 1]
        theirs = hf_rm(input_ids=idx, attention_mask=mask.long()).logits.squeeze(-1)
    assert (ours - theirs).abs().max() <= 1e-4 and ours.abs().max() > 1e-3


# -----------------------------------------------------------------------------
# torch.compile: the adapter's training forward in one graph


def tiny_config(arch: str):
    """A 1-layer, 32-wide Llama or Qwen2 config (grouped-query attention, no BOS) on the tiny vocabulary."""
    from transformers import LlamaConfig, Qwen2Config

    config = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    config |= dict(num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, bos_token_id=None)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**config, eos_token_id=EOS, pad_token_id=PAD)


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_adapter_training_forward_compiles_without_a_graph_break(arch):
    """The forward the RL stages compile (parallel.compile_forward) and call through model.response_forward: a
    left-padded prompt and a right-padded response with their attention mask, position ids from the mask, logits of
    the response positions only (logits_to_keep), scaled by the temperature; the critic's trunk-only scores; and a
    LoRA policy (every projection and the embedding adapted). torch._dynamo.explain finds one graph and no graph
    break in each: a break would split the compiled forward and run the pieces between graphs eagerly."""
    from transformers import AutoModelForCausalLM

    from lora import add_lora
    from model import response_forward

    g = torch.Generator().manual_seed(0)
    query, response = torch.randint(3, 83, (3, 5), generator=g), torch.randint(3, 83, (3, 4), generator=g)
    query_mask, response_mask = torch.ones(3, 5), torch.ones(3, 4)
    query_mask[0, :2] = query_mask[1, :1] = 0  # left padding of the prompts
    response_mask[2, 2:] = 0  # a response that ended early
    for role in ("policy", "critic", "lora"):
        torch.manual_seed(0)
        hf_model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        model = HFCausalLM(hf_model, lm_head=role != "critic", score_head=role == "critic").eval()
        if role == "lora":
            add_lora(model, rank=2, alpha=4.0, targets=ALL_PROJECTIONS)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(response_forward)(model, query, query_mask, response, response_mask, 0.7)
        reasons = [str(reason.reason)[:300] for reason in explained.break_reasons]
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (arch, role, reasons)
        logits, scores = response_forward(model, query, query_mask, response, response_mask, 0.7)
        assert (logits is None) == (role == "critic") and (scores is None) == (role != "critic")
        assert (logits if logits is not None else scores).shape[:2] == (3, 4)  # the response positions only
    torch._dynamo.reset()


# measured on a compiled 1-layer Llama PPO run (torch 2.13, transformers 5.24): 5 frames, 6 graphs (the actor, its
# reference and the critic with dynamic shapes, each call signature once, and the decode step), no graph break
HF_PPO_FRAMES, HF_PPO_GRAPHS, MARGIN = 5, 6, 2


@pytest.mark.slow
def test_a_compiled_hf_ppo_run_compiles_a_bounded_number_of_graphs(tmp_path, user_data, monkeypatch):
    """train_ppo.py --compile on with a Hugging Face policy (tiny Llama, --sft-ckpt an adapter checkpoint): the
    actor, reference and critic forwards (dynamic shapes) and the HF decode step (static cache, fullgraph) are all
    compiled (here with backend="eager": dynamo's graph capture without inductor); over two iterations dynamo
    compiles at most a few frames and graphs, never breaks a graph, and the second iteration compiles nothing new.
    A graph break or a recompile per length would multiply these counts."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import train_ppo

    folder = str(tmp_path / "llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder)
    write_tokenizer(folder)
    model, tok, _ = load_init(f"hf:{folder}")
    sft = str(tmp_path / "sft.pt")
    checkpoints.save_checkpoint(checkpoint_dict("sft", model, tok), sft)
    (tmp_path / "reward.py").write_text("def length(prompt, response, ended):\n    return len(response) / 10\n")
    real_compile, compiled, per_iteration = torch.compile, [], []

    def eager_compile(model=None, **settings):
        settings.pop("mode", None)  # a mode is inductor's
        compiled.append(settings)
        return real_compile(model, backend="eager", **settings)

    real_rollout = train_ppo.ppo_rollout

    def counting_rollout(*args, **kwargs):
        per_iteration.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    monkeypatch.setattr(train_ppo, "ppo_rollout", counting_rollout)
    torch._dynamo.reset()
    counters.clear()
    train_ppo.main(
        train_ppo.Args(
            out_dir=str(tmp_path / "ppo"),
            task_dir=str(tmp_path / "data"),
            sft_ckpt=sft,
            rm_ckpt=["none"],
            reward_fn=f"{tmp_path}/reward.py:length",
            prompts=user_data["prompts"],
            compile="on",
            device="cpu",
            max_steps=2,
            rollout_batch_size=8,
            num_minibatches=2,
            micro_batch_size=4,
            max_new_tokens=8,
            critic_warmup_steps=0,
            warmup_steps=1,
        )
    )
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert compiled == [{"dynamic": True}] * 3 + [{"fullgraph": True}]  # actor, reference, critic; the decode step
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 0 < frames <= HF_PPO_FRAMES + MARGIN and 0 < graphs <= HF_PPO_GRAPHS + MARGIN, (frames, graphs)
    assert per_iteration[1] == (frames, graphs)  # the second iteration compiled nothing new
