"""Reliability: a run killed at a random moment resumes exactly; a non-finite step is skipped and counted."""

import os
import shlex
import signal
import subprocess
import sys
import time

import torch

import train_sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_FLAGS = ("--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 120 --eval-every 40 "
             "--num-samples 8 --eval-samples 8 --warmup-steps 5 --log-every 10 --max-new-tokens 24 --save-every 1")


def kill_and_resume(cmd: str, out_dir: str, min_step: int) -> None:
    """Start cmd, SIGKILL it once a checkpoint of step >= min_step exists (mid-step: saving is every step), resume."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(shlex.split(cmd), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    while proc.poll() is None:
        try:
            if torch.load(ckpt, weights_only=False)["step"] >= min_step:
                break
        except Exception:  # not there yet (the file appears atomically, never half-written)
            pass
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(ckpt, weights_only=False)["step"]
    r = subprocess.run(shlex.split(cmd + " --resume"), cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ckpt} at step {killed_at}" in r.stdout


def assert_same_weights(a: str, b: str, key: str = "model") -> None:
    sa, sb = (torch.load(p, weights_only=False) for p in (a, b))
    assert sa["step"] == sb["step"]
    for k in sa[key]:
        assert torch.allclose(sa[key][k], sb[key][k], atol=1e-5, rtol=0), k


def test_sft_kill_and_resume_is_exact(tmp_path, task_dir):
    base = f"{sys.executable} train_sft.py --task-dir {task_dir} {SFT_FLAGS}"
    r = subprocess.run(shlex.split(f"{base} --out-dir {tmp_path}/full"), cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=30)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    # the resumed run's samples file has no duplicate lines
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 8


def test_sft_nan_step_is_skipped(tmp_path, task_dir, monkeypatch):
    calls = {"n": 0}
    real_loss = train_sft.lm_loss

    def flaky_loss(logits, targets, mask, denom=None):
        calls["n"] += 1
        loss = real_loss(logits, targets, mask, denom)
        return loss * float("nan") if calls["n"] in (5, 6) else loss  # step 3 (two micro-batches a step)

    monkeypatch.setattr(train_sft, "lm_loss", flaky_loss)
    out = str(tmp_path / "o")
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, n_layer=1, n_head=2, n_embd=32, batch_size=8,
                                  micro_batch_size=4, max_steps=6, eval_every=6, num_samples=4, eval_samples=4,
                                  log_every=1, max_new_tokens=16))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 6 and ckpt["data_state"]["skipped"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
