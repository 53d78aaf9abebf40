"""model.py: GPT-2 import/export against transformers, padding invariance, KV-cache generation against naive loops,
log-probs, stopping, sampling filters, checkpoints and optimizer groups. Tiny random models, no downloads.
Greedy-equality tests run in float64 on models with wide random weights (no near-ties, varied greedy paths)."""

import ast
import os
from dataclasses import asdict

import pytest
import torch

from model import GPT, GPTConfig, logprobs_from_logits, padded_causal_mask, sample_tokens

V = 97  # vocab size of every tiny model
PAD = V  # pad id outside the embedding, like GPT-2's tiktoken tokenizer


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


def boost_eos(model: GPT, eos_id: int, amount: float) -> GPT:
    """Raise the EOS logit everywhere by shifting ln_f's bias along wte[eos] (the lm head is tied to wte)."""
    with torch.no_grad():
        w = model.transformer.wte.weight[eos_id]
        model.transformer.ln_f.bias += amount * w / w.norm() ** 2
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
# GPT-2 weights in and out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64, bos_token_id=V - 1, eos_token_id=V - 1
    )
    hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial biases and LayerNorms, so every copy is checked
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("hf_gpt2"))
    hf.save_pretrained(path)
    return path


def test_from_pretrained_matches_transformers(hf_dir):
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    model = GPT.from_pretrained(hf_dir).eval()
    assert model.config.block_size == 64 and model.config.vocab_size == V and model.score_head is None
    idx = torch.randint(0, V, (3, 12))
    with torch.no_grad():
        ref = hf(idx).logits
        logits, scores = model(idx)
    assert scores is None
    assert (logits - ref).abs().max() <= 1e-4
    # left-padded batch: transformers with the same attention mask and position ids, real positions only
    idx, mask = left_pad(random_prompts([12, 7, 3, 1]))
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=idx.masked_fill(mask == 0, 0), attention_mask=mask.long(), position_ids=pos).logits
        logits, _ = model(idx, mask)
    real = mask.bool()
    assert (logits[real] - ref[real]).abs().max() <= 1e-4
    # a score head on top starts small and unbiased
    rm = GPT.from_pretrained(hf_dir, score_head=True)
    assert rm.score_head.bias.item() == 0.0
    assert torch.equal(rm.transformer.h[1].mlp.c_fc.weight, model.transformer.h[1].mlp.c_fc.weight)


@pytest.mark.parametrize("bias", [True, False])
def test_export_hf_roundtrip(tmp_path, bias):
    import transformers

    torch.manual_seed(0)
    model = GPT(tiny_config(bias=bias)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.export_hf(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        assert (model(idx)[0] - hf(idx).logits).abs().max() <= 1e-4
    if bias:  # and back again
        again = GPT.from_pretrained(str(tmp_path)).eval()
        with torch.no_grad():
            assert (again(idx)[0] - model(idx)[0]).abs().max() <= 1e-6
    with pytest.raises(AssertionError, match="lm head"):
        GPT(tiny_config(lm_head=False, score_head=True)).export_hf(str(tmp_path / "critic"))


# -----------------------------------------------------------------------------
# forward: heads, padding


def test_forward_heads_and_padding_invariance():
    torch.manual_seed(0)
    model = GPT(tiny_config(score_head=True)).eval()
    with torch.no_grad():
        model.score_head.weight.normal_()  # make scores vary with the input
    seq = random_prompts([9])[0]
    idx, mask = left_pad([seq, [5] * 3])  # next to a shorter row
    padded, pmask = left_pad([seq, [1, 2]])
    padded = torch.cat([torch.full((2, 5), PAD), padded], dim=1)  # 5 extra left pads
    pmask = torch.cat([torch.zeros(2, 5), pmask], dim=1)
    with torch.no_grad():
        logits, scores = model(torch.tensor([seq]))
        assert logits.shape == (1, 9, V) and scores.shape == (1, 9)
        for ids, m in ((idx, mask), (padded, pmask)):
            lp, sp = model(ids, m)
            assert (lp[0, -9:] - logits[0]).abs().max() <= 1e-5
            assert (sp[0, -9:] - scores[0]).abs().max() <= 1e-5
        # logits_to_keep: the last k positions' logits only, the same numbers; scores stay whole
        for k in (1, 4, 14):
            lk, sk = model(padded, pmask, logits_to_keep=k)
            assert lk.shape == (2, k, V) and torch.allclose(lk, lp[:, -k:], atol=1e-6) and torch.equal(sk, sp)
        # logits=False skips the lm head; a critic has no lm head
        none_logits, s2 = model(padded, pmask, logits=False)
        assert none_logits is None and torch.equal(s2, model(padded, pmask)[1])
        critic = GPT(tiny_config(lm_head=False, score_head=True))
        out_logits, values = critic(padded, pmask)
        assert out_logits is None and values.shape == padded.shape
        assert "lm_head.weight" not in critic.state_dict()
        # whatever the pad id, pad positions see token 0; a left-pad query attends to itself
        assert torch.equal(model(padded.masked_fill(pmask == 0, 7), pmask)[0], model(padded, pmask)[0])
        real = pmask.bool()
        causal = torch.ones(14, 14, dtype=torch.bool).tril()
        expected = (causal & real[:, None, None, :]) | torch.eye(14, dtype=torch.bool)
        assert torch.equal(padded_causal_mask(real), expected) and expected.any(-1).all()
        # pad ids outside the vocab never reach the embedding, with or without a mask
        assert torch.isfinite(model(torch.full((2, 4), PAD))[0]).all()
        assert torch.isfinite(model(padded, pmask)[0]).all()


def test_logprobs_from_logits():
    logits = torch.randn(2, 5, V)
    tokens = torch.randint(0, V, (2, 5))
    for t in (1.0, 0.7):
        ref = torch.log_softmax(logits / t, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        assert (logprobs_from_logits(logits, tokens, t) - ref).abs().max() <= 1e-5
    tokens[0, -1] = PAD  # padding outside the vocab does not crash
    assert torch.isfinite(logprobs_from_logits(logits, tokens)).all()


# -----------------------------------------------------------------------------
# generation


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
    response, rmask, logprobs = model.generate(idx, mask, max_new, eos, PAD, temperature=0.0)
    assert response.shape[1] <= max_new
    for i, p in enumerate(prompts):
        assert row(response, rmask, i) == naive[i], f"row {i}"
        assert (response[i, len(naive[i]) :] == PAD).all() and rmask[i, len(naive[i]) :].sum() == 0
        single, smask, slp = model.generate(torch.tensor([p]), None, max_new, eos, PAD, temperature=0.0)
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
        response, rmask, _ = model.generate(idx, mask, 12, -1, PAD, temperature=temperature, generator=generator)
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
    response, rmask, logprobs = model.generate(idx, mask, 16, 3, PAD, temperature=temperature, generator=g, **kw)
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
    with pytest.raises(AssertionError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), None, 8, 3, PAD)
    assert all(x.shape == (1, 0) for x in model.generate(torch.zeros(1, 64, dtype=torch.long), None, 0, 3, PAD))


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
    c = model.generate(idx, mask, 16, 3, PAD, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(c[0], a[0][:4, : c[0].size(1)])


# -----------------------------------------------------------------------------
# checkpoints, optimizer, FLOPs


def test_from_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = GPT(tiny_config(score_head=True)).eval()
    critic = GPT(tiny_config(lm_head=False, score_head=True)).eval()
    idx = torch.randint(0, V, (2, 10))
    ckpt = {
        "model_config": asdict(model.config),
        "model": {"_orig_mod." + k: v for k, v in model.state_dict().items()},
        "critic": {"module." + k: v for k, v in critic.state_dict().items()},
    }
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with torch.no_grad():
        for loaded in (GPT.from_checkpoint(ckpt), GPT.from_checkpoint(str(tmp_path / "ckpt.pt"))):
            assert loaded.config == model.config
            assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
            out, ref = loaded.eval()(idx), model(idx)
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        loaded = GPT.from_checkpoint(ckpt, key="critic").eval()
        assert loaded.lm_head is None and torch.equal(loaded(idx)[1], critic(idx)[1])
    ckpt["model"]["_orig_mod.transformer.h.0.attn.c_attn.bias"] = torch.zeros(3)  # strict loading
    with pytest.raises(RuntimeError):
        GPT.from_checkpoint(ckpt)


def test_from_checkpoint_head_overrides():
    """Heads default to the state dict's; False drops one, True adds one: a fresh score head from the global torch
    seed (an RM from an SFT model), an lm head tied to the loaded wte (a policy from a critic's trunk)."""
    torch.manual_seed(0)
    policy = GPT(tiny_config()).eval()
    critic = GPT(tiny_config(lm_head=False, score_head=True)).eval()
    ckpt = {"model_config": asdict(policy.config), "model": policy.state_dict(), "critic": critic.state_dict()}
    torch.manual_seed(5)
    rm = GPT.from_checkpoint(ckpt, score_head=True)
    torch.manual_seed(5)
    fresh = GPT(tiny_config(score_head=True))
    assert torch.equal(rm.score_head.weight, fresh.score_head.weight) and rm.score_head.bias.item() == 0.0
    assert torch.equal(rm.transformer.wte.weight, policy.transformer.wte.weight)
    trunk_only = GPT.from_checkpoint(ckpt, key="critic", score_head=False, lm_head=True).eval()
    assert trunk_only.score_head is None and trunk_only.lm_head.weight is trunk_only.transformer.wte.weight
    assert torch.equal(trunk_only.transformer.wte.weight, critic.transformer.wte.weight)
    scorer = GPT.from_checkpoint(ckpt, key="critic", lm_head=False)
    assert scorer.lm_head is None and scorer.score_head is not None
    no_lm = GPT.from_checkpoint(ckpt, lm_head=False, score_head=True)  # the policy's trunk, a fresh head, no lm head
    assert no_lm.lm_head is None and "lm_head.weight" not in no_lm.state_dict()
    hf_ckpt = {**ckpt, "model_config": {**ckpt["model_config"], "hf_config": {"model_type": "llama"}}}
    with pytest.raises(ValueError, match="hf.model_from_checkpoint"):
        GPT.from_checkpoint(hf_ckpt)


def test_model_imports_nothing_of_ours():
    """model.py is the ground floor (DESIGN §1): no import of hf, data, common or any other module of this repo,
    at the top or inside a function."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = {name.removesuffix(".py") for name in os.listdir(root) if name.endswith(".py")} | {"tests", "bench"}
    with open(os.path.join(root, "model.py")) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else node.module.split(".")[0])
    assert "hf" in ours and "data" in ours  # the scan sees the repo's modules
    assert not imported & (ours | {"."}), f"model.py imports {sorted(imported & (ours | {'.'}))}"


def test_configure_optimizers_and_flops():
    model = GPT(tiny_config(score_head=True))
    opt = model.configure_optimizers(0.1, 3e-4, (0.9, 0.95), "cpu")
    seen = [id(p) for group in opt.param_groups for p in group["params"]]
    assert len(seen) == len(set(seen)) and set(seen) == {id(p) for p in model.parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert opt.defaults["fused"]  # one fused kernel on CPU too; it must step like the per-tensor loop
    ref = GPT(tiny_config(score_head=True))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=False,
    )
    idx = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            logits, scores = m(idx)
            (logits.logsumexp(-1).mean() + scores.pow(2).mean()).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)  # steps move weights ~3e-4 each
    cfg = model.config
    n_all = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == n_all
    assert model.num_params() == n_all - cfg.block_size * cfg.n_embd  # wte counts: it is the lm head
    critic = GPT(tiny_config(lm_head=False, score_head=True))
    assert critic.num_params() == model.num_params() - V * cfg.n_embd
    head_dim = cfg.n_embd // cfg.n_head
    assert model.flops_per_token(64) == 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_head * head_dim * 64


def test_sample_tokens_distribution_and_masked_logits():
    """Inverse-CDF sampling: empirical frequencies match softmax (chi-square-sized tolerance), -inf never sampled."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor(
        [[0.0, 1.0, -float("inf"), 2.0, -1.0], [-float("inf"), -float("inf"), 5.0, -float("inf"), -float("inf")]]
    )
    n = 20000
    toks = torch.stack([sample_tokens(logits, g) for _ in range(n)])  # (n, 2)
    assert (toks[:, 1] == 2).all() and (toks[:, 0] != 2).all()
    freq = torch.bincount(toks[:, 0], minlength=5).double() / n
    p = torch.softmax(logits[0].double(), -1)
    assert (freq - p).abs().max() <= 4 * (p * (1 - p) / n).sqrt().max()
    # a leading zero-probability token is never chosen, even for u = 0
    g0 = torch.Generator().manual_seed(1)
    assert (torch.stack([sample_tokens(torch.tensor([[-float("inf"), 0.0]]), g0) for _ in range(200)]) == 1).all()
