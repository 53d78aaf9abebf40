"""train_rm.py: the preference math against naive references, padding invariance, K-wise expansion, calibration,
the hackability probe's data, the FLOPs per token by hand, user mistakes, a tiny smoke run, K-wise user data, 2 DDP
ranks against 1, and kill-and-resume."""

import json
import math
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    RUN_KEYS,
    assert_same_weights,
    exits_2_with_one_line,
    kill_and_resume,
    one_and_two_ranks,
    read_events,
    read_scalars,
    run_here,
    write_jsonl,
)

import data
import hf
import task
import train_rm
from model import GPT, GPTConfig, calibration_error, last_token_scores, score_sequences

RM_TAGS = [
    "train/loss",
    "train/bt_loss",
    "train/lm_loss",
    "train/accuracy",
    "val/accuracy",
    "val/margin",
    "val/ece",
    "val/bayes_ceiling",
    "val/gold_agreement",
    "probe/degenerate_score",
    "probe/fluent_score",
    "train/lr",
    "train/grad_norm",
    "train/skipped_steps",
    "perf/tokens_per_sec",
    "perf/mfu",
]
CKPT_KEYS = RUN_KEYS | {
    "score_offset",
}
TINY = dict(
    batch_size=8,
    micro_batch_size=4,
    max_steps=6,
    warmup_steps=2,
    log_every=2,
    eval_every=3,
    eval_pairs=32,
    probe_size=8,
    calib_size=128,
)


@pytest.fixture(scope="module")
def tok(task_tok):
    return task_tok


@pytest.fixture(scope="module")
def sft_ckpt(tiny_ckpts):
    """A tiny random GPT saved in the SFT checkpoint layout (the RM only needs a trunk and a tokenizer)."""
    return tiny_ckpts[0]


# -----------------------------------------------------------------------------
# math


def test_preference_loss_matches_logsigmoid():
    g = torch.Generator().manual_seed(0)
    r_c, r_r, w = torch.randn(100, generator=g) * 3, torch.randn(100, generator=g) * 3, torch.rand(100, generator=g)
    naive = [-math.log(1 / (1 + math.exp(-(a - b)))) for a, b in zip(r_c.tolist(), r_r.tolist())]
    assert train_rm.preference_loss(r_c, r_r).item() == pytest.approx(sum(naive) / 100, rel=1e-5)
    weighted = sum(x * y for x, y in zip(naive, w.tolist())) / w.sum().item()
    assert train_rm.preference_loss(r_c, r_r, w).item() == pytest.approx(weighted, rel=1e-5)
    with_denom = train_rm.preference_loss(r_c, r_r, w, denom=7.0).item()
    assert with_denom == pytest.approx(weighted * w.sum().item() / 7, rel=1e-5)
    # finite at any margin, gradient too: -log σ(200) ≈ 0, -log σ(-200) = 200
    r = torch.tensor([200.0, -200.0], requires_grad=True)
    losses = [train_rm.preference_loss(r[i : i + 1], torch.zeros(1)) for i in range(2)]
    assert losses[0].item() == pytest.approx(0.0, abs=1e-30) and losses[1].item() == pytest.approx(200.0)
    sum(losses).backward()
    assert torch.isfinite(r.grad).all() and r.grad.tolist() == pytest.approx([0.0, -1.0])


def test_sequence_scores_ignore_padding():
    """Left-padded prompts + right-padded responses score exactly like the unpadded sequences (at the EOS)."""
    torch.manual_seed(0)
    V, pad, eos = 50, 51, 49  # pad outside the embedding, like the task tokenizer
    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=64, score_head=True)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, eos, (n,), generator=g).tolist() for n in (3, 7, 5)]
    responses = [torch.randint(0, eos, (n,), generator=g).tolist() + [eos] for n in (6, 1, 9)]
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.tensor([[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)])
    mask = torch.tensor(
        [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)) for p, r in zip(prompts, responses)],
        dtype=torch.float,
    )
    with torch.no_grad():
        padded = last_token_scores(model(ids, mask)[1], mask)
        single = [model(torch.tensor([p + r]))[1][0, -1].item() for p, r in zip(prompts, responses)]
        # right padding alone needs no attention mask (what training and score_sequences do)
        right = score_sequences(model, [p + r for p, r in zip(prompts, responses)], pad, 2, "cpu", torch.float32)
    assert padded.tolist() == pytest.approx(single, abs=1e-5)
    assert right.tolist() == pytest.approx(single, abs=1e-5)


def test_head_features_are_the_heads_input():
    """Ragged sequences batched with right padding: the features, read through the head, are score_sequences's
    scores, and each one is its sequence's own (alone, unpadded)."""
    torch.manual_seed(0)
    V, pad = 50, 51  # pad outside the embedding, like the task tokenizer
    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=64, score_head=True)).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 2, 14, 5, 1)]
    features = train_rm.head_features(model, seqs, pad, 2, "cpu", torch.float32)  # (N, C)
    scores = score_sequences(model, seqs, pad, 2, "cpu", torch.float32)
    with torch.no_grad():
        through_head = model.score_head(features).squeeze(-1)
    assert features.shape == (5, 32) and through_head.tolist() == pytest.approx(scores.tolist(), abs=1e-5)
    alone = torch.cat([train_rm.head_features(model, [seq], pad, 1, "cpu", torch.float32) for seq in seqs])
    torch.testing.assert_close(features, alone, atol=1e-5, rtol=1e-5)


def test_fit_score_head_is_the_penalised_optimum():
    """Features at scales from 1e-2 to 1e4 and offsets to ±1e4, weighted pairs: the folded head scores z · w on the
    standardised features, and w zeroes the gradient of the naive penalised loss (convex: its minimum)."""
    g = torch.Generator().manual_seed(0)
    N, C, penalty = 40, 4, 0.05
    scale, offset = torch.tensor([1e-2, 1.0, 1e4, 3.0]), torch.tensor([0.0, 1e4, -1e4, 5.0])
    features = (torch.randn(N, C, generator=g) * scale + offset).double()
    pairs = []
    for _ in range(60):
        better, worse = torch.randperm(N, generator=g)[:2].tolist()
        pairs.append((better, worse, torch.rand(1, generator=g).item() + 0.1))
    head_weight, head_bias = train_rm.fit_score_head(features, pairs, penalty)
    mean, std = features.mean(0), features.std(0) + 1e-6
    z = (features - mean) / std
    w = (head_weight * std).requires_grad_()
    assert (features @ head_weight + head_bias).tolist() == pytest.approx((z @ w).tolist(), abs=1e-6)
    total = sum(weight for *_, weight in pairs)
    loss = sum(weight * -F.logsigmoid((z[better] - z[worse]) @ w) for better, worse, weight in pairs) / total
    (gradient,) = torch.autograd.grad(loss + penalty * (w**2).sum(), w)
    assert gradient.abs().max().item() < 1e-5 and w.abs().max().item() > 0.1


def test_ranking_pairs_and_kwise_batch(tok):
    assert data.ranking_pairs([0, 1]) == [(0, 1, 1.0)]
    assert data.ranking_pairs([1, 0]) == [(1, 0, 1.0)]
    pairs = data.ranking_pairs([2, 0, 3, 1])
    assert [(i, j) for i, j, _ in pairs] == [(2, 0), (2, 3), (2, 1), (0, 3), (0, 1), (3, 1)]
    assert all(w == pytest.approx(1 / 6) for *_, w in pairs)
    rows = [
        {"prompt": "Review of", "chosen": " the plot", "rejected": " i hated"},
        {"prompt": "Review of The", "responses": [" a", " b b", " c c c"], "ranking": [1, 2, 0]},
    ]
    examples, skipped = data.encode_prefs(tok, rows, 64)
    assert skipped == 0 and len(data.encode_prefs(tok, rows, 4)[0]) == 0  # too long for 4 tokens: skipped
    ids, mask, ci, ri, w, lm_mask = train_rm.collate(examples, tok.pad_id)
    seqs = [tok.encode(r["prompt"]) + tok.encode(x) + [tok.eos_id] for r in rows for x in data.responses_of(r)]
    assert ids.shape[0] == 5 and all(ids[n, : len(s)].tolist() == s for n, s in enumerate(seqs))
    assert mask.sum(1).tolist() == [len(s) for s in seqs]
    # pairs point at the right rows: record 0 → rows 0, 1; record 1 → rows 2..4, best = response 1 (row 3)
    assert list(zip(ci.tolist(), ri.tolist())) == [(0, 1), (3, 4), (3, 2), (4, 2)]
    assert w.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])  # each record's weights sum to 1
    # the LM term covers the best responses' own tokens (response + EOS) and nothing else
    n_prompt = [len(tok.encode(r["prompt"])) for r in rows]
    want = torch.zeros_like(mask)
    want[0, n_prompt[0] : len(seqs[0])] = 1
    want[3, n_prompt[1] : len(seqs[3])] = 1
    assert torch.equal(lm_mask, want)
    # the batch loss is the naive per-record weighted loop
    r = torch.randn(5)
    naive = -F.logsigmoid(r[0] - r[1]) - sum(F.logsigmoid(r[a] - r[b]) / 3 for a, b in [(3, 4), (3, 2), (4, 2)])
    assert train_rm.preference_loss(r[ci], r[ri], w, denom=2.0).item() == pytest.approx(naive.item() / 2, rel=1e-5)


def test_calibration_error_known_answers():
    # 75 % of pairs with gap +g, 25 % with -g: calibrated when σ(g) = 0.75, ECE = |0.75 - 0.9| when σ(g) = 0.9
    for p, want in [(0.75, 0.0), (0.9, 0.15), (0.6, 0.15)]:
        g = math.log(p / (1 - p))
        gaps = torch.tensor([g] * 300 + [-g] * 100)
        assert calibration_error(gaps) == pytest.approx(want, abs=1e-6)
    assert calibration_error(torch.zeros(10)) == pytest.approx(0.0)  # p = 0.5, half the outcomes 1


def test_fold_score_offset_known_answer():
    """A head with weight 0 and bias 3 scores every sequence 3: the offset is 3 and folding it gives 0 everywhere;
    on a random head, folding the measured mean shifts every score by exactly that amount."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=32, block_size=32, score_head=True)).eval()
    seqs = [torch.randint(0, 49, (n,)).tolist() + [49] for n in (3, 9, 5, 12)]
    before = score_sequences(model, seqs, 51, 3, "cpu", torch.float32)
    offset = before.mean().item()
    train_rm.fold_score_offset(model, offset)
    after = score_sequences(model, seqs, 51, 3, "cpu", torch.float32)
    assert after.tolist() == pytest.approx((before - offset).tolist(), abs=1e-6)
    assert after.mean().item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.score_head.weight.zero_(), model.score_head.bias.fill_(3.0)
    assert score_sequences(model, seqs, 51, 3, "cpu", torch.float32).mean().item() == pytest.approx(3.0)
    train_rm.fold_score_offset(model, 3.0)
    assert score_sequences(model, seqs, 51, 3, "cpu", torch.float32).abs().max().item() == 0.0


def test_load_init_adds_fresh_score_head(sft_ckpt):
    model, _, _ = hf.load_init(sft_ckpt, score_head=True)
    sft = torch.load(sft_ckpt, weights_only=False)["model"]
    assert model.config.lm_head and model.config.score_head
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sft.items())  # the trunk and LM head are the SFT's
    assert torch.equal(model.score_head.bias, torch.zeros(1))
    assert model.score_head.weight.std().item() == pytest.approx(1 / math.sqrt(32 + 1), rel=0.35)


def test_probe_texts(task_dir):
    rows = data.read_jsonl(task.build_task(task_dir, 1337)["eval_prompts"], "prompts")
    prompts = [r["prompt"] for r in rows]
    texts = task.probe_texts(prompts, 64, seed=3)
    assert texts == task.probe_texts(prompts, 64, seed=3) and texts != task.probe_texts(prompts, 64, seed=4)
    assert [t["kind"] for t in texts] == [k for k in task.PROBE_KINDS for _ in range(64)]
    negative = {w for table in (task.ADJECTIVES, task.VERBS) for w, p in table.items() if p < 0}
    for t in texts:
        words = set(re.findall(r"[a-z]+", t["response"]))
        assert not words & negative and words & {w for w, p in task.ADJECTIVES.items() if p > 0} | {
            "loved",
            "adored",
            "liked",
            "enjoyed",
        }
        gold = task.gold_reward(t["prompt"], t["response"], t["ended"])
        if t["kind"] == "fluent":
            assert task.is_valid(t["response"], True) and gold >= 0.5
        else:  # the gold punishes every degenerate kind whatever its words
            assert gold == -1.0 and not task.is_valid(t["response"], t["ended"])
    sentences = [t["response"].strip().rstrip(".").split(". ") for t in texts]
    assert all(len(s) >= 5 for s, t in zip(sentences, texts) if t["kind"] in ("repeat", "long"))
    assert all(len(set(s)) == 1 for s, t in zip(sentences, texts) if t["kind"] == "repeat")
    assert all(t["ended"] == (t["kind"] != "no_eos") for t in texts)


# -----------------------------------------------------------------------------
# user mistakes and smoke runs


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "chosen": "b"}', r"bad\.jsonl:2: missing field 'rejected'"),
        ('{"prompt": "a", "chosen": 3, "rejected": "c"}', r"bad\.jsonl:2: field 'chosen' must be a string"),
        (
            '{"prompt": "a", "responses": ["b", "c", "d"], "ranking": [0, 2, 2]}',
            r"bad\.jsonl:2: field 'ranking' must be",
        ),
    ],
)
def test_bad_preference_file_is_one_line_exit_2(tmp_path, line, message, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    err = exits_2_with_one_line("train_rm.py", ["--data", str(bad), "--out-dir", f"{tmp_path}/o"], capsys, monkeypatch)
    assert re.search(message, err), err
    assert not os.path.exists(tmp_path / "o")


def test_an_empty_held_out_split_is_named(tmp_path, tiny_ckpts, capsys, monkeypatch):
    """4 pairs whose last (the 5 % held out) is tied: the error names the empty held-out set and the tie (it said no
    record fits the context, of records 15 tokens long)."""
    pairs = [{"prompt": "the film", "chosen": " was good.", "rejected": " was bad."}] * 3
    pairs.append({"prompt": "the film", "chosen": " was good.", "rejected": " was good."})
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    argv = ["--data", path, "--init", tiny_ckpts[0], "--out-dir", f"{tmp_path}/o"]
    err = exits_2_with_one_line("train_rm.py", argv, capsys, monkeypatch)
    assert f"the held-out 5 % of {path}: no preference record (1 tied, dropped)" in err, err


def test_rm_smoke(tmp_path, task_dir, sft_ckpt, tok):
    out, held_out = str(tmp_path / "rm"), tmp_path / "pairs_eval.jsonl"
    with open(task.build_task(task_dir, 1337)["pairs_eval"]) as f:  # the first 150 held-out pairs
        held_out.write_text("".join(f.readline() for _ in range(150)))
    train_rm.main(train_rm.Args(out_dir=out, task_dir=task_dir, init=sft_ckpt, eval_data=str(held_out), **TINY))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "rm" and ckpt["step"] == 6 and ckpt["world_size"] == 1
    json.dumps(ckpt["args"]), json.dumps(ckpt["tokenizer"])  # primitives only
    model = GPT.from_checkpoint(ckpt).eval()
    assert model.config.lm_head and model.config.score_head
    # the offset is folded into the bias (Bradley-Terry never moves the bias) and the calibration mean is now 0
    assert model.score_head.bias.item() == pytest.approx(-ckpt["score_offset"], abs=1e-3)
    calib = [
        tok.encode(r["prompt"]) + tok.encode(r["response"]) + [tok.eos_id]
        for r in data.read_jsonl(task.build_task(task_dir, 1337)["sft"], "sft")[:128]
    ]
    assert score_sequences(model, calib, tok.pad_id, 64, "cpu", torch.float32).mean().item() == pytest.approx(
        0.0, abs=1e-4
    )
    scalars, tags = read_events(out)
    histograms = tags["histograms"]
    for tag in RM_TAGS:
        assert tag in scalars and all(math.isfinite(v) for v in scalars[tag]), tag
    assert "val/score_gap" in histograms
    assert len(scalars["val/accuracy"]) == 2 and len(scalars["train/loss"]) == 3
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 150 and {
        "prompt",
        "chosen",
        "rejected",
        "score_chosen",
        "score_rejected",
        "gold_chosen",
        "gold_rejected",
    } <= set(samples[0])
    acc = sum(
        (s["score_chosen"] > s["score_rejected"]) + 0.5 * (s["score_chosen"] == s["score_rejected"]) for s in samples
    ) / len(samples)
    assert acc == pytest.approx(scalars["val/accuracy"][-1], abs=1e-6)


@pytest.mark.slow
def test_rm_kwise_user_data(tmp_path, sft_ckpt):
    """K-wise and pairwise records mixed in one user file: trains, calibrates on the best responses, scores pairs."""
    rows = []
    for i in range(40):
        if i % 2:
            rows.append({"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"})
        else:
            rows.append({"prompt": f"Q{i}:", "responses": [" no", " yes", " maybe"], "ranking": [1, 2, 0]})
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "rm")
    train_rm.main(train_rm.Args(out_dir=out, data=str(path), init=sft_ckpt, **{**TINY, "max_steps": 4}))
    scalars = read_scalars(out)
    assert "val/bayes_ceiling" not in scalars and "probe/fluent_score" not in scalars  # built-in task only
    assert all(math.isfinite(v) for tag in ("train/loss", "val/accuracy", "val/ece") for v in scalars[tag])
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 4  # held out: the last 5 % (2 records), a 3-way ranking (3 pairs) and a pair
    assert {(s["chosen"], s["rejected"]) for s in samples} <= {(" yes", " no"), (" yes", " maybe"), (" maybe", " no")}


def test_rm_head_fit_starts_from_the_probe(tmp_path, sft_ckpt, tok, capsys, monkeypatch):
    """--head-fit at lr 0: the checkpoint's head is fit_score_head on the trunk's features (bias less the calibration
    offset); under --fsdp it is one line and exit 2."""
    rows = [{"prompt": f"Q{i}:", "responses": [" no", " yes", " maybe"], "ranking": [1, 2, 0]} for i in range(20)]
    rows += [{"prompt": f"R{i}:", "chosen": " good", "rejected": " bad"} for i in range(20)]
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = str(tmp_path / "rm")
    flags = {**TINY, "max_steps": 1, "warmup_steps": 0, "eval_every": 0}
    train_rm.main(train_rm.Args(out_dir=out, data=path, init=sft_ckpt, head_fit=True, lr=0.0, **flags))
    assert "head fit: " in capsys.readouterr().out
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    model = GPT.from_checkpoint(ckpt).eval()
    train, _ = data.encode_prefs(tok, rows[:38], model.config.block_size)  # 5 % held out
    seqs, pairs = train_rm.flat_pairs(train)
    features = train_rm.head_features(model, seqs, tok.pad_id, 64, "cpu", torch.float32)
    head_weight, head_bias = train_rm.fit_score_head(features, pairs, 0.01)
    assert model.score_head.weight[0].tolist() == pytest.approx(head_weight.tolist(), abs=1e-4)
    assert model.score_head.bias.item() + ckpt["score_offset"] == pytest.approx(head_bias.item(), abs=1e-4)
    argv = ["--data", path, "--init", sft_ckpt, "--head-fit", "--fsdp", "--out-dir", f"{tmp_path}/o"]
    assert "--head-fit" in exits_2_with_one_line("train_rm.py", argv, capsys, monkeypatch)


@pytest.mark.slow
def test_rm_ddp_matches_single_process(tmp_path, task_dir, sft_ckpt):
    """2 ranks (gloo) with the same global batch end with the same weights and calibration as 1 process."""
    flags = (
        f"--task-dir {task_dir} --init {sft_ckpt} --max-steps 3 --batch-size 8 --micro-batch-size 2 "
        "--warmup-steps 1 --eval-every 3 --eval-pairs 16 --probe-size 4 --calib-size 64 --log-every 1"
    )
    one_and_two_ranks("train_rm.py", flags, tmp_path)
    a = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert b["world_size"] == 2 and len(b["rng"]) == 2
    assert b["score_offset"] == pytest.approx(a["score_offset"], abs=1e-4)
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-4), k
    one, two = read_scalars(str(tmp_path / "one")), read_scalars(str(tmp_path / "two"))
    for tag in ("train/grad_norm", "train/loss", "train/accuracy", "val/accuracy"):  # Adam would hide a scale error
        assert two[tag] == pytest.approx(one[tag], rel=1e-4), tag


@pytest.mark.parametrize("lm_coef", [0.5, 0.0])
def test_flops_per_token_hand_count(lm_coef):
    """The RM's training FLOPs per token, counted by hand on a tiny config: 6 per weight (trunk, score head, and the lm
    head only when lm_coef > 0: with 0 no logits are computed) plus attention 12·L·C·T at the mean length; and
    FlopCounterMode on one training step (matmuls only; attention through the math kernel, whose matmuls it sees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from model import lm_loss

    L, C, V, T = 2, 32, 50, 9
    model = GPT(GPTConfig(vocab_size=V, n_layer=L, n_head=2, n_embd=C, block_size=16, score_head=True))
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C
    trunk = L * per_block + 2 * C  # blocks and ln_f
    lm_head = V * C if lm_coef > 0 else 0
    score_head = C + 1
    example = ([[1] * T, [2] * T], 3, [(0, 1, 1.0)], 0, {})  # (sequences, prompt length, pairs, best, row)
    want = 6 * (trunk + lm_head + score_head) + 12 * L * C * T
    assert train_rm.flops_per_token(model, [example] * 4, lm_coef) == want
    ids, mask, chosen, rejected, weights, lm_mask = train_rm.collate([example] * 2, pad_id=0)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits, token_scores = model(ids, logits=lm_coef > 0)
        scores = last_token_scores(token_scores, mask)
        loss = train_rm.preference_loss(scores[chosen], scores[rejected], weights)
        if lm_coef > 0:
            loss = loss + lm_coef * lm_loss(logits[:, :-1], ids[:, 1:], lm_mask[:, 1:])
        loss.backward()
    matmul_weights = L * 12 * C * C + lm_head + C
    assert counter.get_total_flops() == ids.numel() * (6 * matmul_weights + 12 * L * C * T)


# -----------------------------------------------------------------------------
# reliability: a run killed at a random moment resumes exactly

RM_FLAGS = (
    "--batch-size 8 --micro-batch-size 4 --max-steps 40 --warmup-steps 2 --eval-every 15 --eval-pairs 8 "
    "--probe-size 4 --calib-size 32 --log-every 10 --save-every 1"
)


@pytest.mark.slow
def test_rm_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts):
    held_out = tmp_path / "pairs_eval.jsonl"
    with open(task.build_task(task_dir, 1337)["pairs_eval"]) as f:  # a small held-out set keeps the final eval short
        held_out.write_text("".join(f.readline() for _ in range(32)))
    base = (
        f"{sys.executable} train_rm.py --task-dir {task_dir} --init {tiny_ckpts[0]} --eval-data {held_out} {RM_FLAGS}"
    )
    run_here(f"{base} --out-dir {tmp_path}/full")
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=12)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    assert abs(full["score_offset"] - killed["score_offset"]) < 1e-5
    for k, v in full["data_state"].items():
        assert torch.equal(v, killed["data_state"][k]) if k == "perm" else v == killed["data_state"][k], k
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()
