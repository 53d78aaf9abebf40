"""model.py: GPT-2 import/export against transformers, the heads and padding invariance of the forward, log-probs,
checkpoints and head overrides, optimizer groups and FLOPs, the RM ensemble aggregation, and that model.py imports
nothing of ours. Tiny random models, no downloads. (Decoding is generate.py's: test_generate.py.)"""

import ast
import os
from dataclasses import asdict

import pytest
import torch

from model import (
    GPT,
    GPTConfig,
    aggregate_rm_scores,
    left_pack,
    logprobs_from_logits,
    packed_response_logits,
    padded_causal_mask,
    response_forward,
)

V = 97  # vocab size of every tiny model
PAD = V  # pad id outside the embedding, like GPT-2's tiktoken tokenizer


def tiny_config(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=32), **kw})


def left_pad(seqs: list[list[int]], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    idx = torch.tensor([[pad_id] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[0.0] * (T - len(s)) + [1.0] * len(s) for s in seqs])
    return idx, mask


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


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


def test_packed_rows_give_the_response_forward_logits():
    """left_pack puts each row's prompt (left-padded) and response (right-padded) together at the right end, as wide
    as the longest row's real tokens; packed_response_logits then gives response_forward's logits at every real
    response position (float64), for ragged prompts and responses (an empty response included)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16)).double().eval()
    q_len, r_len = torch.tensor([5, 1, 3, 2]), torch.tensor([2, 6, 0, 4])
    query_mask = (torch.arange(5) >= 5 - q_len[:, None]).double()
    response_mask = (torch.arange(6) < r_len[:, None]).double()
    query = torch.randint(0, 50, (4, 5)).masked_fill(query_mask == 0, 50)
    response = torch.randint(0, 50, (4, 6)).masked_fill(response_mask == 0, 50)
    ids, mask = left_pack(torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1))
    assert ids.size(1) == int((q_len + r_len).max())  # 7, not 5 + 6
    for row in range(4):
        real = torch.cat([query[row][query_mask[row].bool()], response[row][response_mask[row].bool()]])
        assert torch.equal(ids[row][mask[row].bool()], real) and mask[row, -len(real) :].all()
    with torch.no_grad():
        want, _ = response_forward(model, query, query_mask, response, response_mask, 0.7)
        got = packed_response_logits(model, ids, mask, response_mask, 0.7)
    assert got.shape == want.shape
    real = response_mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-10)


def test_logprobs_from_logits():
    logits = torch.randn(2, 5, V)
    tokens = torch.randint(0, V, (2, 5))
    for t in (1.0, 0.7):
        ref = torch.log_softmax(logits / t, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        assert (logprobs_from_logits(logits, tokens, t) - ref).abs().max() <= 1e-5
    tokens[0, -1] = PAD  # padding outside the vocab does not crash
    assert torch.isfinite(logprobs_from_logits(logits, tokens)).all()


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
    """model.py is the ground floor (docs/design.md §1): no import of hf, data, common or any other module of this repo,
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


def test_aggregate_rm_scores_against_loops():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 9, generator=g, dtype=torch.float64)
    got = {agg: aggregate_rm_scores(scores, agg, 0.7) for agg in ("mean", "min", "uwo")}
    for b in range(9):
        members = scores[:, b].tolist()
        mean = sum(members) / 4
        variance = sum((x - mean) ** 2 for x in members) / 4  # the population variance
        assert got["mean"][b].item() == pytest.approx(mean, abs=1e-12)
        assert got["min"][b].item() == min(members)
        assert got["uwo"][b].item() == pytest.approx(mean - 0.7 * variance, abs=1e-12)
    one = scores[:1]
    for agg in ("mean", "min", "uwo"):  # one member is its own score
        assert torch.equal(aggregate_rm_scores(one, agg, 0.7), one[0])
    with pytest.raises(ValueError, match="unknown RM aggregation"):
        aggregate_rm_scores(scores, "max")
