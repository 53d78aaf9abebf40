"""train_sft.py: a tiny in-process smoke run (checkpoint, metrics, samples), the prompt masked on user data, bad data
and flags as one-line errors, the FLOPs per token by hand, --overwrite and --resume, 2 DDP ranks against 1, a NaN
step skipped, and kill-and-resume. (The README's commands and `make demo TINY=1`: test_pipeline.py.)"""

import json
import math
import os
import re
import shlex
import sys

import pytest
import torch
from conftest import (
    RUN_KEYS,
    TORCHRUN,
    assert_same_weights,
    exits_2_with_one_line,
    kill_and_resume,
    read_scalars,
    run,
    run_here,
)

import train_sft
from model import GPT

TINY = dict(
    n_layer=1,
    n_head=2,
    n_embd=32,
    batch_size=8,
    micro_batch_size=4,
    max_steps=6,
    eval_every=3,
    num_samples=16,
    eval_samples=8,
    warmup_steps=2,
    log_every=2,
    max_new_tokens=48,
)
TINY_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 4 --eval-every 4 "
    "--num-samples 8 --eval-samples 8 --warmup-steps 1 --log-every 2 --max-new-tokens 32"
)
CKPT_KEYS = RUN_KEYS


def test_sft_smoke(tmp_path, task_dir):
    out = str(tmp_path / "sft")
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, **TINY))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "sft" and ckpt["step"] == 6 and ckpt["world_size"] == 1
    model = GPT.from_checkpoint(ckpt)
    assert model.config.n_layer == 1 and model.config.lm_head and not model.config.score_head
    json.dumps(ckpt["args"]), json.dumps(ckpt["tokenizer"])  # primitives only
    scalars = read_scalars(out)
    for tag in [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/skipped_steps",
        "perf/tokens_per_sec",
        "perf/mfu",
        "val/loss",
        "val/ppl",
        "val/valid_frac",
    ]:
        assert tag in scalars and all(math.isfinite(v) for v in scalars[tag]), tag
    assert scalars["train/loss"][-1] < scalars["train/loss"][0]
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 16 and {"prompt", "response", "ended", "valid"} <= set(samples[0])


def test_a_signal_saves_before_the_evaluation(tmp_path, task_dir, monkeypatch):
    """A SIGTERM seen at the end of an --eval-every step (step 2) saves that step first and exits 143: the sampling
    evaluation, which could outlast a cluster's grace period, does not run. (Evaluations draw from a generator of
    their own, seeded the same each time, so the skipped one changes no later one: a resume stays exact.)"""
    import common

    requests, evaluations = [], []

    def requested(self, device):  # called once at the end of every step: the signal arrives during step 2
        requests.append(1)
        return 15 if len(requests) == 2 else 0

    def recording(*args, **kwargs):
        evaluations.append(len(requests))
        return real(*args, **kwargs)

    real = train_sft.sample_responses
    monkeypatch.setattr(common.StopSignal, "requested", requested)
    monkeypatch.setattr(train_sft, "sample_responses", recording)
    out = str(tmp_path / "sft")
    with pytest.raises(SystemExit) as stopped:
        train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, **(TINY | {"eval_every": 2})))
    assert stopped.value.code == 143
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 2 and evaluations == []


def test_sft_masks_prompt_on_user_data(tmp_path, task_dir):
    """From a checkpoint on user data the prompt is masked: only response tokens + EOS are targets."""
    from data import encode_sft
    from task import build_task
    from tokenizer import load_tokenizer

    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    ((ex, mask),) = encode_sft(tok, [{"prompt": "Review of", "response": " the plot"}], 64, mask_prompt=True)[0]
    assert len(ex) == 5 and mask == [0, 0, 1, 1, 1]
    # the loss averages over targets only: changing a masked target changes nothing
    logits = torch.randn(1, 4, tok.vocab_size)
    x = torch.tensor([ex])
    m = torch.tensor([mask[1:]], dtype=torch.float)
    y2 = x[:, 1:].clone()
    y2[0, 0] = 7
    assert torch.allclose(train_sft.lm_loss(logits, x[:, 1:], m), train_sft.lm_loss(logits, y2, m))


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad\.jsonl:2: "),
        ('{"prompt": "a"}', r"bad\.jsonl:2: .*response"),
        ('{"prompt": 3, "response": "b"}', r"bad\.jsonl:2: .*prompt"),
    ],
)
def test_bad_sft_data_is_one_line_exit_2(tmp_path, line, message, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n' + line + "\n")
    argv = ["--data", str(bad), "--tokenizer", "gpt2", "--out-dir", f"{tmp_path}/o"]
    err = exits_2_with_one_line("train_sft.py", argv, capsys, monkeypatch)
    assert re.search(message, err), err
    assert not os.path.exists(tmp_path / "o" / "ckpt.pt")


def test_bad_flags_are_one_line_errors(tmp_path, task_dir, capsys, monkeypatch):
    for cmd, message in [
        (f"--init nonsense --out-dir {tmp_path}/o", "--init nonsense: expected"),
        (f"--init {tmp_path}/missing.pt", "no such checkpoint"),
        ("--batch-size 10 --micro-batch-size 4 --max-steps 1", "must divide by 4"),
    ]:
        argv = ["--task-dir", task_dir, "--out-dir", f"{tmp_path}/o", *shlex.split(cmd)]
        assert message in exits_2_with_one_line("train_sft.py", argv, capsys, monkeypatch)


@pytest.mark.slow
def test_ddp_matches_single_process(tmp_path, task_dir):
    """2 ranks (gloo) with the same global batch end with the same weights as 1 process; the micro-batch only splits
    the work (1 process: 4 accumulation steps of 2; 2 ranks: --micro-batch-size 8 is capped at a rank's share, 4)."""
    flags = f"--task-dir {task_dir} {TINY_FLAGS} --max-steps 3 --batch-size 8"
    run_here(f"{sys.executable} train_sft.py {flags} --micro-batch-size 2 --out-dir {tmp_path}/one")
    r2 = run(f"{TORCHRUN} train_sft.py {flags} --micro-batch-size 8 --out-dir {tmp_path}/two")
    assert r2.returncode == 0, r2.stderr[-2000:]
    a = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert b["world_size"] == 2 and len(b["rng"]) == 2
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-4), k


def hand_count_params(n_layer: int, n_embd: int, vocab_size: int) -> int:
    """Non-embedding weights of a GPT with biases, counted by hand: per block c_attn C·3C+3C, c_proj C·C+C, c_fc
    C·4C+4C, mlp c_proj 4C·C+C, two LayerNorms 2·2C; then ln_f 2C and the lm head V·C (tied to wte, counted once)."""
    C = n_embd
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C
    return n_layer * per_block + 2 * C + vocab_size * C


def test_flops_per_token_hand_count():
    """6 FLOPs per weight per token (forward 2, backward 4) plus attention 12·L·C·T (PaLM appendix B), counted by
    hand on a tiny config; FlopCounterMode on one training step agrees up to the bias and LayerNorm terms (it counts
    matmuls only; attention through the math kernel, whose matmuls it sees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from model import GPTConfig, lm_loss

    L, C, V, B, T = 2, 32, 50, 3, 9
    model = GPT(GPTConfig(vocab_size=V, n_layer=L, n_head=2, n_embd=C, block_size=16))
    examples = [([1] * (T + 1), [1] * (T + 1))] * B  # inputs are ids[:-1]: T tokens each
    assert train_sft.flops_per_token(model, examples) == 6 * hand_count_params(L, C, V) + 12 * L * C * T
    inputs, targets, target_mask = train_sft.collate(examples, pad_id=0)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits, _ = model(inputs)
        lm_loss(logits, targets, target_mask).backward()
    matmul_weights = L * 12 * C * C + V * C
    assert counter.get_total_flops() == B * T * (6 * matmul_weights + 12 * L * C * T)


@pytest.mark.slow
def test_overwrite_and_resume(tmp_path, task_dir):
    """A fresh run into a folder with a checkpoint needs --overwrite (test_errors.py: the refusal), which clears the
    old event files and samples; --resume still continues."""
    out = tmp_path / "sft"
    args = train_sft.Args(out_dir=str(out), task_dir=task_dir, **{**TINY, "max_steps": 2, "eval_every": 2})
    train_sft.main(args)
    (old_events,) = [name for name in os.listdir(out) if name.startswith("events.out.tfevents.")]
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 99}\n')
    with pytest.raises(train_sft.UserError, match=r"ckpt\.pt exists: pass --resume to continue that run, or --over"):
        train_sft.main(args)
    train_sft.main(train_sft.Args(**{**args.__dict__, "overwrite": True}))
    events = [name for name in os.listdir(out) if name.startswith("events.out.tfevents.")]
    assert len(events) == 1 and events != [old_events]
    assert [json.loads(line)["step"] for line in open(out / "samples.jsonl")] == [2] * TINY["num_samples"]
    train_sft.main(train_sft.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 4
    assert [json.loads(line)["step"] for line in open(out / "samples.jsonl")] == [2] * 16 + [4] * 16


# -----------------------------------------------------------------------------
# reliability: a run killed at a random moment resumes exactly; a non-finite step is skipped and counted

SFT_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 120 --eval-every 40 "
    "--num-samples 8 --eval-samples 8 --warmup-steps 5 --log-every 10 --max-new-tokens 24 --save-every 1"
)


@pytest.mark.slow
def test_sft_kill_and_resume_is_exact(tmp_path, task_dir):
    base = f"{sys.executable} train_sft.py --task-dir {task_dir} {SFT_FLAGS}"
    run_here(f"{base} --out-dir {tmp_path}/full")
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=30)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    # the resumed run's samples file has no duplicate lines
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 8


@pytest.mark.slow
def test_sft_nan_step_is_skipped(tmp_path, task_dir, monkeypatch):
    calls = {"n": 0}
    real_loss = train_sft.lm_loss

    def flaky_loss(logits, targets, mask, denom=None):
        calls["n"] += 1
        loss = real_loss(logits, targets, mask, denom)
        return loss * float("nan") if calls["n"] in (5, 6) else loss  # step 3 (two micro-batches a step)

    monkeypatch.setattr(train_sft, "lm_loss", flaky_loss)
    out = str(tmp_path / "o")
    train_sft.main(
        train_sft.Args(
            out_dir=out,
            task_dir=task_dir,
            n_layer=1,
            n_head=2,
            n_embd=32,
            batch_size=8,
            micro_batch_size=4,
            max_steps=6,
            eval_every=6,
            num_samples=4,
            eval_samples=4,
            log_every=1,
            max_new_tokens=16,
        )
    )
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 6 and ckpt["data_state"]["skipped"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    # train/grad_norm averages the steps taken: none at step 3 (logged every step), so no value there, never a NaN
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(out)
    events.Reload()
    grad_norms = {event.step: event.value for event in events.Scalars("train/grad_norm")}
    assert sorted(grad_norms) == [1, 2, 4, 5, 6] and all(math.isfinite(v) for v in grad_norms.values())
    assert [event.value for event in events.Scalars("train/skipped_steps")] == [0, 0, 1, 1, 1, 1]
