"""train_dpo.py: dpo_loss against the formulas of docs/design.md §5c, response log-probs that padding does not change
(so reference log-probs per batch equal precomputed ones), K-wise expansion, user mistakes, a tiny smoke run whose
checkpoint eval.py accepts, IPO on K-wise user data, Hugging Face inits, a NaN step, 2 ranks against 1, and
kill-and-resume; KTO's loss and gradients against a written-out loop, its reference point global per step (a step
the same whatever the micro-batch), the unpaired reader and a tiny KTO run."""

import json
import math
import os
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_same_weights,
    exits_2_with_one_line,
    kill_and_resume,
    one_and_two_ranks,
    read_scalars,
    run_here,
)

import common
import data
import eval as ev
import task
import tokenizer
import train_dpo
from model import GPT, GPTConfig

DPO_TAGS = [
    "train/loss",
    "train/nll_loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "val/loss",
    "val/accuracy",
    "val/gold",
    "val/kl",
    "val/valid_frac",
    "train/lr",
    "train/grad_norm",
    "train/skipped_steps",
    "perf/tokens_per_sec",
    "perf/mfu",
]
TINY = dict(
    batch_size=8,
    micro_batch_size=4,
    max_steps=6,
    warmup_steps=2,
    log_every=1,
    eval_every=3,
    eval_pairs=16,
    num_samples=8,
    eval_samples=8,
    max_new_tokens=16,
    lr=1e-3,
)
TINY_FLAGS = (
    "--batch-size 8 --micro-batch-size 2 --warmup-steps 2 --log-every 1 --eval-pairs 16 --num-samples 8 "
    "--eval-samples 8 --max-new-tokens 16 --lr 1e-3"
)


# -----------------------------------------------------------------------------
# math


def naive_losses(h: list, beta: float, loss_type: str, label_smoothing: float) -> list:
    def log_sigmoid(x):
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))

    if loss_type == "ipo":
        return [(x - 1 / (2 * beta)) ** 2 for x in h]
    return [-(1 - label_smoothing) * log_sigmoid(beta * x) - label_smoothing * log_sigmoid(-beta * x) for x in h]


@pytest.mark.parametrize("loss_type, beta, label_smoothing", [("dpo", 0.1, 0.0), ("dpo", 0.5, 0.2), ("ipo", 0.3, 0.0)])
def test_dpo_loss_matches_the_formulas(loss_type, beta, label_smoothing):
    g = torch.Generator().manual_seed(0)
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = (torch.randn(50, generator=g) * 5 for _ in range(4))
    weights = torch.rand(50, generator=g)
    h = ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)).tolist()
    losses = naive_losses(h, beta, loss_type, label_smoothing)
    inputs = (policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type, label_smoothing)
    loss, stats = train_dpo.dpo_loss(*inputs)
    assert loss.item() == pytest.approx(sum(losses) / 50, rel=1e-5)
    w = weights.tolist()
    weighted, stats_weighted = train_dpo.dpo_loss(*inputs, weights)
    assert weighted.item() == pytest.approx(sum(a * b for a, b in zip(losses, w)) / sum(w), rel=1e-5)
    with_denom, stats_denom = train_dpo.dpo_loss(*inputs, weights, denom=7.0)
    assert with_denom.item() == pytest.approx(sum(a * b for a, b in zip(losses, w)) / 7, rel=1e-5)
    # rewards are β·(log π - log π_ref), weighted like the loss; accuracy counts a tie half
    chosen = [beta * (a - b) for a, b in zip(policy_chosen.tolist(), ref_chosen.tolist())]
    rejected = [beta * (a - b) for a, b in zip(policy_rejected.tolist(), ref_rejected.tolist())]
    weighted_chosen = sum(x * y for x, y in zip(chosen, w)) / sum(w)
    weighted_rejected = sum(x * y for x, y in zip(rejected, w)) / sum(w)
    assert stats_weighted["rewards/chosen"].item() == pytest.approx(weighted_chosen, rel=1e-5, abs=1e-6)
    assert stats_weighted["rewards/rejected"].item() == pytest.approx(weighted_rejected, rel=1e-5, abs=1e-6)
    margins = [c - r for c, r in zip(chosen, rejected)]
    assert stats["rewards/margin"].item() == pytest.approx(sum(margins) / 50, rel=1e-5)
    assert stats["rewards/accuracy"].item() == pytest.approx(sum(m > 0 for m in margins) / 50)
    assert stats_denom["rewards/accuracy"].item() == pytest.approx(sum(y for m, y in zip(margins, w) if m > 0) / 7)
    tie, tie_stats = train_dpo.dpo_loss(*(torch.zeros(3) for _ in range(4)), beta, loss_type, label_smoothing)
    assert tie_stats["rewards/accuracy"].item() == 0.5
    if loss_type == "dpo":  # policy = reference: log 2 whatever β and ε
        assert tie.item() == pytest.approx(math.log(2))


def test_dpo_loss_finite_at_large_margins():
    """β·h = ±200: the loss and its gradient stay finite (logsigmoid), with the known limits; IPO too."""
    policy_chosen = torch.tensor([20.0, -20.0], requires_grad=True)
    zeros = torch.zeros(2)
    for loss_type, label_smoothing in [("dpo", 0.0), ("dpo", 0.1), ("ipo", 0.0)]:
        per_pair = [
            train_dpo.dpo_loss(
                policy_chosen[i : i + 1], zeros[:1], zeros[:1], zeros[:1], 10.0, loss_type, label_smoothing
            )[0]
            for i in range(2)
        ]
        policy_chosen.grad = None
        sum(per_pair).backward()
        assert all(math.isfinite(loss.item()) for loss in per_pair) and torch.isfinite(policy_chosen.grad).all()
        if loss_type == "dpo":
            eps = label_smoothing
            assert per_pair[0].item() == pytest.approx(eps * 200, abs=1e-4)
            assert per_pair[1].item() == pytest.approx((1 - eps) * 200, abs=1e-4)


def tiny_model(vocab_size: int = 50) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=64)).eval()


def naive_response_logprob(model, seq: list, n_prompt: int) -> float:
    """Σ log π(token) over the response tokens of one unpadded sequence, the plain way."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([seq]))
    logprobs = F.log_softmax(logits[0].double(), -1)
    return sum(logprobs[t - 1, seq[t]].item() for t in range(n_prompt, len(seq)))


def random_records(n: int, generator) -> list:
    """Encoded pair records (data.encode_prefs layout) of ragged lengths over a 50-token vocabulary (EOS 49)."""
    records = []
    for _ in range(n):
        n_prompt = int(torch.randint(2, 9, (1,), generator=generator))
        prompt = torch.randint(0, 49, (n_prompt,), generator=generator).tolist()
        seqs = [prompt + torch.randint(0, 49, (int(k),), generator=generator).tolist() + [49] for k in (3, 11)]
        records.append((seqs, n_prompt, data.ranking_pairs([0, 1]), 0, {}))
    return records


def test_response_logprobs_do_not_change_with_padding():
    """Per-sequence log-probs in a right-padded batch (with the pad id outside the vocabulary) equal the unpadded
    one-at-a-time sums over the response tokens including EOS; the per-token mean divides by the response length.
    So a reference scored per micro-batch equals one precomputed once over the data in any other grouping."""
    model = tiny_model()
    records = random_records(6, torch.Generator().manual_seed(1))
    naive = [naive_response_logprob(model, seq, n_prompt) for seqs, n_prompt, *_ in records for seq in seqs]
    lengths = [len(seq) - n_prompt for seqs, n_prompt, *_ in records for seq in seqs]
    with torch.no_grad():
        ids, targets_mask, *_ = train_dpo.collate(records, pad_id=51)
        precomputed = train_dpo.sequence_logprobs(model, ids, targets_mask, average=False)
        mean = train_dpo.sequence_logprobs(model, ids, targets_mask, average=True)
        per_batch = torch.zeros(len(naive))
        for start in (0, 2, 4):  # micro-batches of 2 records, sorted by length as in training
            indices = sorted(range(start, start + 2), key=lambda i: train_dpo.longest_sequence(records[i]))
            ids, targets_mask, *_ = train_dpo.collate([records[i] for i in indices], pad_id=51)
            logprobs = train_dpo.sequence_logprobs(model, ids, targets_mask, average=False).view(2, 2)
            for record_index, pair in zip(indices, logprobs):
                per_batch[2 * record_index : 2 * record_index + 2] = pair
    assert precomputed.tolist() == pytest.approx(naive, abs=1e-4)
    assert mean.tolist() == pytest.approx([x / n for x, n in zip(naive, lengths)], abs=1e-5)
    assert per_batch.tolist() == pytest.approx(precomputed.tolist(), abs=1e-5)


def test_kwise_records_expand_to_weighted_pairs(task_dir):
    tok = tokenizer.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    rows = [
        {"prompt": "Review of", "chosen": " the plot", "rejected": " i hated"},
        {"prompt": "Review of The", "responses": [" a", " b b", " c c c"], "ranking": [1, 2, 0]},
    ]
    examples, _ = data.encode_prefs(tok, rows, 64)
    ids, targets_mask, chosen, rejected, weights, best = train_dpo.collate(examples, tok.pad_id)
    assert ids.shape[0] == 5
    assert list(zip(chosen.tolist(), rejected.tolist())) == [(0, 1), (3, 4), (3, 2), (4, 2)]
    assert weights.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    assert best.tolist() == [0, 3]  # the rows of the chosen response and of ranking[0] (the NLL term's targets)
    # the targets are the responses and their EOS: the prompt (with its BOS) is never scored
    n_prompt = [len(tok.encode(row["prompt"], bos=True)) for row in rows]
    responses = [r for row in rows for r in data.responses_of(row)]
    assert targets_mask.sum(1).tolist() == [len(tok.encode(r)) + 1 for r in responses]
    assert targets_mask[0, : n_prompt[0] - 1].sum() == 0 and targets_mask[2, n_prompt[1] - 1] == 1
    # the batch loss is the naive per-record loop: each record weighs 1 in all
    g = torch.Generator().manual_seed(0)
    policy, ref = torch.randn(5, generator=g), torch.randn(5, generator=g)
    loss, _ = train_dpo.dpo_loss(
        policy[chosen], policy[rejected], ref[chosen], ref[rejected], 0.5, weights=weights, denom=2.0
    )
    margin = policy - ref
    naive = -F.logsigmoid(0.5 * (margin[0] - margin[1])) - sum(
        F.logsigmoid(0.5 * (margin[a] - margin[b])) / 3 for a, b in [(3, 4), (3, 2), (4, 2)]
    )
    assert loss.item() == pytest.approx(naive.item() / 2, rel=1e-5)


def naive_kto(policy: torch.Tensor, ref: torch.Tensor, labels: list, z0: float, beta: float, weights: tuple):
    """The KTO loss example by example (Ethayarajh et al. 2024, eq. 8), in scalar ops autograd can follow."""
    total = 0.0
    for i, desirable in enumerate(labels):
        r = policy[i] - ref[i]
        if desirable:
            total = total + weights[0] * (1 - torch.sigmoid(beta * (r - z0)))
        else:
            total = total + weights[1] * (1 - torch.sigmoid(beta * (z0 - r)))
    return total / len(labels)


@pytest.mark.parametrize("kl_shift, weights", [(0.5, (1.0, 1.0)), (-3.0, (1.0, 1.0)), (2.0, (1.5, 0.7))])
def test_kto_loss_and_its_gradient_match_a_loop(kl_shift, weights):
    """Random log-probs with mixed labels: the loss, its gradient and the rewards equal the loop's; z0 is the
    mismatched pairs' mean log-ratio clamped at 0 (kl_shift -3: a negative mean, z0 = 0)."""
    g = torch.Generator().manual_seed(0)
    policy, ref = torch.randn(12, generator=g) * 3, torch.randn(12, generator=g) * 3
    labels = (torch.rand(12, generator=g) < 0.4).tolist()
    kl_logratios = (torch.randn(12, generator=g) + kl_shift).tolist()
    z0 = max(0.0, sum(kl_logratios) / 12)
    assert (z0 == 0.0) == (kl_shift < 0)
    beta = 0.1
    leaf = policy.clone().requires_grad_(True)
    desirable = torch.tensor(labels)
    loss, stats = train_dpo.kto_loss(leaf, ref, desirable, torch.tensor(z0), beta, *weights)
    loss.backward()
    naive_leaf = policy.clone().requires_grad_(True)
    naive = naive_kto(naive_leaf, ref, labels, z0, beta, weights)
    naive.backward()
    assert loss.item() == pytest.approx(naive.item(), rel=1e-6)
    assert leaf.grad.tolist() == pytest.approx(naive_leaf.grad.tolist(), rel=1e-5, abs=1e-8)
    rewards = [beta * (p - r) for p, r in zip(policy.tolist(), ref.tolist())]
    good = [x for x, label in zip(rewards, labels) if label]
    bad = [x for x, label in zip(rewards, labels) if not label]
    assert stats["rewards/desirable"].item() == pytest.approx(sum(good) / len(good), rel=1e-5)
    assert stats["rewards/undesirable"].item() == pytest.approx(sum(bad) / len(bad), rel=1e-5)
    # the step's global counts replace the batch's: the sums over micro-batches are the step's means
    denoms = (30.0, 10.0, 20.0)
    with_denoms, stats_denoms = train_dpo.kto_loss(policy, ref, desirable, z0, beta, *weights, denoms)
    assert with_denoms.item() == pytest.approx(naive.item() * 12 / 30, rel=1e-6)
    assert stats_denoms["rewards/desirable"].item() == pytest.approx(sum(good) / 10, rel=1e-5)
    # at the reference (r = 0, z0 = 0) every example costs λ/2
    at_ref, _ = train_dpo.kto_loss(ref, ref, desirable, 0.0, beta, *weights)
    expected = sum(weights[0] if label else weights[1] for label in labels) / 24
    assert at_ref.item() == pytest.approx(expected, rel=1e-6)


def kto_records(generator) -> list:
    """Encoded KTO records (data.encode_kto layout) from random_records: pairs (desirable, undesirable) and unpaired
    completions of either label."""
    records = []
    for i, (seqs, n_prompt, *_) in enumerate(random_records(6, generator)):
        if i % 3 == 0:
            records.append((seqs, n_prompt, [True, False], {}))
        else:
            records.append((seqs[i % 2 : i % 2 + 1], n_prompt, [i % 2 == 0], {}))
    return records


def kto_step(policy, ref, records: list, args, micro_batch_size: int):
    """One KTO step as main runs it on one rank: z0 from all the step's mismatched pairs, then each micro-batch's
    loss and backward -> (z0, the step's loss, the gradients)."""
    policy.zero_grad()
    kl_examples = train_dpo.mismatched(records, 64)
    z0 = train_dpo.reference_point(policy, ref, kl_examples, micro_batch_size, 51, nullcontext())
    denoms = train_dpo.kto_denoms(records)
    ordered = sorted(records, key=train_dpo.longest_sequence)
    loss = 0.0
    for start in range(0, len(ordered), micro_batch_size):
        batch = train_dpo.kto_collate(ordered[start : start + micro_batch_size], pad_id=51)
        sums = train_dpo.kto_backward(policy, ref, batch, args, denoms, z0, True, nullcontext())
        loss += sums["train/loss"].item()
    return z0.item(), loss, [p.grad.clone() for p in policy.parameters()]


def test_kto_step_is_the_same_whatever_the_micro_batch():
    """z0 is global per step: micro-batches of 2 records and one of the whole batch give the same z0 (the naive mean
    of the mismatched pairs' log-ratios, clamped at 0 when the policy and reference trade places), loss and
    gradients."""
    ref = tiny_model().requires_grad_(False)
    torch.manual_seed(1)
    policy = GPT(ref.config).eval()
    records = kto_records(torch.Generator().manual_seed(2))
    args = train_dpo.Args(loss="kto", beta=0.1, kto_desirable_weight=1.3)
    whole = kto_step(policy, ref, records, args, micro_batch_size=6)
    split = kto_step(policy, ref, records, args, micro_batch_size=2)
    assert whole[0] > 0.05  # a z0 per micro-batch of 2 records would differ: 0.40, 0 and 0.06
    assert split[0] == pytest.approx(whole[0], abs=1e-5) and split[1] == pytest.approx(whole[1], rel=1e-5)
    for a, b in zip(whole[2], split[2]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    # z0 against the plain loop over the mismatched sequences: one order clamps to 0, the other does not
    kl_examples = train_dpo.mismatched(records, 64)
    mean_logratio = sum(
        naive_response_logprob(policy, seq, n_prompt) - naive_response_logprob(ref, seq, n_prompt)
        for seqs, n_prompt, *_ in kl_examples
        for seq in seqs
    ) / sum(len(seqs) for seqs, *_ in kl_examples)
    swapped = train_dpo.reference_point(ref, policy, kl_examples, 4, 51, nullcontext()).item()
    assert (whole[0], swapped) == pytest.approx((max(0, mean_logratio), max(0, -mean_logratio)), abs=1e-4)
    # the mismatched pairs: each record's responses after the next record's prompt
    assert kl_examples[0][0][0] == records[1][0][0][: records[1][1]] + records[0][0][0][records[0][1] :]


def test_kto_reads_unpaired_records_and_preferences(tmp_path, task_dir):
    """Kind kto: TRL's unpaired {"prompt", "completion", "label"} (strings or messages) and every preference layout; a
    pair gives its chosen as desirable and its rejected as undesirable, a ranking its top and bottom. A label that is
    not a bool is one line naming the file, the line and the field."""
    user = [{"role": "user", "content": "hi"}]
    reply = [{"role": "assistant", "content": "hello"}]
    rows = [
        {"prompt": "Review of", "completion": " the plot", "label": True},
        {"prompt": user, "completion": reply, "label": False},
        {"prompt": "Review of", "chosen": " good", "rejected": " bad"},
        {"prompt": "Review of The", "responses": [" a", " b b", " c c c"], "ranking": [1, 2, 0]},
    ]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    read = data.read_jsonl(str(path), "kto")
    assert read == rows
    tok = tokenizer.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    examples, skipped = data.encode_kto(tok, read[:1] + read[2:], 64)
    assert skipped == 0 and [labels for _, _, labels, _ in examples] == [[True], [True, False], [True, False]]
    n_prompt = examples[2][1]
    assert [tok.decode(seq[n_prompt:-1]) for seq in examples[2][0]] == [" b b", " a"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "label": 1}) + "\n")
    with pytest.raises(common.UserError) as error:
        data.read_jsonl(str(bad), "kto")
    message = str(error.value)
    assert message.startswith(f"{bad}:2: field 'label' must be true") and "\n" not in message
    bad.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(common.UserError, match=r":1: missing field 'label'"):
        data.read_jsonl(str(bad), "kto")


# -----------------------------------------------------------------------------
# runs


def test_a_signal_saves_before_the_evaluation(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    """As in SFT: a SIGTERM seen at the end of an --eval-every step saves it and exits 143 before the held-out
    sampling runs."""
    requests, evaluations = [], []

    def requested(self, device):
        requests.append(1)
        return 15 if len(requests) == 3 else 0

    def recording(*args, **kwargs):
        evaluations.append(len(requests))
        return real(*args, **kwargs)

    real = train_dpo.sample_responses
    monkeypatch.setattr(common.StopSignal, "requested", requested)
    monkeypatch.setattr(train_dpo, "sample_responses", recording)
    out = str(tmp_path / "dpo")
    with pytest.raises(SystemExit) as stopped:
        train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, init=tiny_ckpts[0], **TINY))
    assert stopped.value.code == 143
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 3 and evaluations == []


def test_dpo_smoke(tmp_path, task_dir, tiny_ckpts):
    out = str(tmp_path / "dpo")
    hf_dir = str(tmp_path / "hf")
    train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, init=tiny_ckpts[0], export_hf=hf_dir, **TINY))
    assert os.path.exists(os.path.join(hf_dir, "config.json"))  # --export-hf: a causal LM folder
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["kind"] == "dpo" and ckpt["step"] == 6 and ckpt["world_size"] == 1
    json.dumps(ckpt["args"]), json.dumps(ckpt["tokenizer"])  # primitives only
    # a policy every later tool accepts: eval.py loads it as one; it moved away from the reference
    policy, tok, _ = ev.load_model(os.path.join(out, "ckpt.pt"), "--policy", torch.device("cpu"))
    init = torch.load(tiny_ckpts[0], weights_only=False)["model"]
    assert policy.config.lm_head and not policy.config.score_head
    assert any(not torch.equal(init[key], value) for key, value in ckpt["model"].items())
    scalars = read_scalars(out)
    for tag in DPO_TAGS:
        assert tag in scalars and all(math.isfinite(v) for v in scalars[tag]), tag
    # the first step starts at the reference: DPO's loss log 2 (plus the NLL term), every implicit reward 0 (ties 1/2)
    dpo_loss = scalars["train/loss"][0] - train_dpo.Args.nll_coef * scalars["train/nll_loss"][0]
    assert dpo_loss == pytest.approx(math.log(2), abs=1e-5)
    assert scalars["rewards/accuracy"][0] == 0.5 and scalars["rewards/margin"][0] == 0.0
    assert len(scalars["val/gold"]) == 2 and len(scalars["train/loss"]) == 6
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 8 and {"step", "prompt", "response", "ended", "kl", "gold", "valid"} <= set(samples[0])
    assert sum(s["gold"] for s in samples) / 8 == pytest.approx(scalars["val/gold"][-1], abs=1e-5)


def test_kto_smoke(tmp_path, task_dir, tiny_ckpts):
    """--loss kto on the built-in task's pairs: at the first step the policy is the reference, so z0 = 0, every
    reward is 0 and the KTO loss is 1/2 (plus the NLL term); its metrics are logged and finite."""
    out = str(tmp_path / "kto")
    tiny = {**TINY, "max_steps": 3, "eval_every": 3}
    train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, init=tiny_ckpts[0], loss="kto", **tiny))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["kind"] == "dpo" and ckpt["step"] == 3 and ckpt["args"]["beta"] == train_dpo.DEFAULT_BETA["kto"]
    scalars = read_scalars(out)
    tags = ["train/loss", "train/nll_loss", "train/kto_z0", "rewards/desirable", "rewards/undesirable"]
    for tag in tags + ["val/loss", "val/accuracy", "val/gold", "val/kl", "val/valid_frac"]:
        assert tag in scalars and all(math.isfinite(v) for v in scalars[tag]), tag
    kto_loss = scalars["train/loss"][0] - train_dpo.Args.nll_coef * scalars["train/nll_loss"][0]
    assert kto_loss == pytest.approx(0.5, abs=1e-5) and scalars["train/kto_z0"][0] == 0.0
    assert scalars["rewards/desirable"][0] == 0.0 and scalars["rewards/undesirable"][0] == 0.0


@pytest.mark.slow
def test_dpo_ipo_on_kwise_user_data(tmp_path, tiny_ckpts):
    rows = []
    for i in range(40):
        if i % 2:
            rows.append({"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"})
        else:
            rows.append({"prompt": f"Q{i}:", "responses": [" no", " yes", " maybe"], "ranking": [1, 2, 0]})
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "ipo")
    args = train_dpo.Args(out_dir=out, data=str(path), init=tiny_ckpts[0], loss="ipo", nll_coef=0.5, **TINY)
    train_dpo.main(args)
    scalars = read_scalars(out)
    assert "val/gold" not in scalars  # built-in task only
    for tag in ("train/loss", "train/nll_loss", "val/loss", "val/accuracy"):
        assert all(math.isfinite(v) for v in scalars[tag]), tag
    # at the reference IPO's loss is (1/(2β))², plus the NLL term (per token, over whole responses: > 0)
    ipo_loss = scalars["train/loss"][0] - 0.5 * scalars["train/nll_loss"][0]
    assert ipo_loss == pytest.approx((1 / (2 * train_dpo.DEFAULT_BETA["ipo"])) ** 2, rel=1e-5)
    assert 0 < scalars["train/nll_loss"][0] < 20


@pytest.mark.slow
@pytest.mark.parametrize("init", ["gpt2_dir", "llama_dir"])
def test_dpo_from_hugging_face_models(tmp_path, init, request):
    """--init a local GPT-2 folder (native GPT) or hf:<folder> (the adapter, here a tiny Llama) on user pairs: the
    checkpoint is a dpo policy eval.py loads, with the model's own tokenizer."""
    path = tmp_path / "prefs.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"}) + "\n" for i in range(24))
    )
    folder = request.getfixturevalue(init)
    spec = folder if init == "gpt2_dir" else f"hf:{folder}"
    out = str(tmp_path / "dpo")
    tiny = {**TINY, "max_steps": 2, "eval_pairs": 4}
    train_dpo.main(train_dpo.Args(out_dir=out, data=str(path), init=spec, **tiny))
    _, _, ckpt = ev.load_model(os.path.join(out, "ckpt.pt"), "--policy", torch.device("cpu"))
    assert ckpt["kind"] == "dpo" and ckpt["step"] == 2
    assert all(math.isfinite(v) for v in read_scalars(out)["train/loss"])


@pytest.mark.slow
def test_dpo_nan_step_is_skipped(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    calls = {"n": 0}
    real_loss = train_dpo.dpo_loss

    def flaky_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 5 else loss), stats  # step 3: two micro-batches a step

    monkeypatch.setattr(train_dpo, "dpo_loss", flaky_loss)
    out = str(tmp_path / "o")
    train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, init=tiny_ckpts[0], **{**TINY, "eval_every": 6}))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 6 and ckpt["data_state"]["skipped"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert read_scalars(out)["train/skipped_steps"] == [0, 0, 1, 1, 1, 1]


def test_user_mistakes_are_one_line(tmp_path, task_dir, tiny_ckpts, capsys, monkeypatch):
    with pytest.raises(common.UserError, match="--label-smoothing applies to --loss dpo"):
        train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "a"), loss="ipo", label_smoothing=0.1))
    with pytest.raises(common.UserError, match=r"is a 'rm' checkpoint, expected sft or dpo or ppo or grpo$"):
        train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "b"), init=tiny_ckpts[1], task_dir=task_dir))
    err = exits_2_with_one_line("train_dpo.py", ["--beta", "0", "--out-dir", f"{tmp_path}/c"], capsys, monkeypatch)
    assert err.strip().splitlines() == ["error: --beta 0: the KL strength must be > 0"]
    assert not os.path.exists(tmp_path / "c")


def test_kto_mistakes_are_one_line(tmp_path):
    with pytest.raises(common.UserError, match="--label-smoothing applies to --loss dpo, not kto"):
        train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "a"), loss="kto", label_smoothing=0.1))
    with pytest.raises(common.UserError, match=r"^--kto-undesirable-weight 0: a loss weight must be > 0$"):
        train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "b"), loss="kto", kto_undesirable_weight=0.0))
    with pytest.raises(common.UserError, match=r"^--kto-desirable-weight -1: a loss weight must be > 0$"):
        train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "c"), loss="kto", kto_desirable_weight=-1.0))


@pytest.mark.slow
def test_dpo_ddp_matches_single_process(tmp_path, task_dir, tiny_ckpts):
    """2 ranks (gloo) with the same global batch end with the same weights and logged statistics as 1 process."""
    flags = f"--task-dir {task_dir} --init {tiny_ckpts[0]} {TINY_FLAGS} --max-steps 3 --eval-every 3"
    one_and_two_ranks("train_dpo.py", flags, tmp_path)
    one = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert two["world_size"] == 2 and len(two["rng"]) == 2
    for key in one["model"]:
        assert torch.allclose(one["model"][key], two["model"][key], atol=1e-5), key
    scalars_one, scalars_two = read_scalars(str(tmp_path / "one")), read_scalars(str(tmp_path / "two"))
    for tag in ("train/loss", "train/grad_norm", "rewards/margin", "rewards/accuracy", "val/loss", "val/accuracy"):
        assert scalars_two[tag] == pytest.approx(scalars_one[tag], rel=1e-4, abs=1e-5), (
            tag
        )  # margins: differences of fp32 log-prob sums, a few 1e-6 apart when the batch splits differently


@pytest.mark.slow
def test_dpo_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts):
    base = (
        f"{sys.executable} train_dpo.py --task-dir {task_dir} --init {tiny_ckpts[0]} {TINY_FLAGS} --max-steps 12 "
        "--eval-every 6 --save-every 1"
    )
    run_here(f"{base} --out-dir {tmp_path}/full")
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=4)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()
