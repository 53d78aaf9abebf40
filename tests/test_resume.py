"""Reliability: a run killed at a random moment resumes exactly; a non-finite step is skipped and counted."""

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoints
import common
import task
import train_ppo
import train_sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 120 --eval-every 40 "
    "--num-samples 8 --eval-samples 8 --warmup-steps 5 --log-every 10 --max-new-tokens 24 --save-every 1"
)
RM_FLAGS = (
    "--batch-size 8 --micro-batch-size 4 --max-steps 40 --warmup-steps 2 --eval-every 15 --eval-pairs 8 "
    "--probe-size 4 --calib-size 32 --log-every 10 --save-every 1"
)
PPO_FLAGS = (
    "--max-steps 12 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 "
    "--max-new-tokens 16 --critic-warmup-steps 2 --warmup-steps 2 --sample-every 1 --log-every 4 "
    "--kl-target 1.0 --kl-horizon 100 --collapse-window 3 --save-every 1"
)


def run(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        shlex.split(cmd), cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


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
    r = subprocess.run(
        shlex.split(f"{base} --out-dir {tmp_path}/full"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
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


def test_rm_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts):
    held_out = tmp_path / "pairs_eval.jsonl"
    with open(task.build_task(task_dir, 1337)["pairs_eval"]) as f:  # a small held-out set keeps the final eval short
        held_out.write_text("".join(f.readline() for _ in range(32)))
    base = (
        f"{sys.executable} train_rm.py --task-dir {task_dir} --init {tiny_ckpts[0]} --eval-data {held_out} {RM_FLAGS}"
    )
    r = run(f"{base} --out-dir {tmp_path}/full")
    assert r.returncode == 0, r.stderr[-3000:]
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=12)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    assert abs(full["score_offset"] - killed["score_offset"]) < 1e-5
    for k, v in full["data_state"].items():
        assert torch.equal(v, killed["data_state"][k]) if k == "perm" else v == killed["data_state"][k], k
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()


# a critic-free estimator with the §5b flags on (Dr. GRPO's aggregation, KL in the loss, clip-higher, dual-clip); the
# tiny random policy never ends a response, so its actor moves through the ptx loss and the entropy bonus
CRITIC_FREE_FLAGS = (
    "--adv-estimator grpo --group-size 2 --no-grpo-std-norm --loss-agg seq_sum_norm --cliprange-high 0.28 "
    "--dual-clip 3 --entropy-coef 0.01"
)


# LoRA on actor and critic (the reference and the RM are their bases), the tied embedding adapter among them, with
# activation checkpointing
LORA_FLAGS = "--lora-rank 4 --lora-alpha 8 --lora-targets c_attn c_proj c_fc wte --grad-ckpt"


# DAPO's dynamic sampling: the tiny random policy seldom ends a response, so most groups score the missing-EOS
# penalty alike and are not informative; iterations sample extra rounds (more RNG draws and prompts)
DYNAMIC_FLAGS = "--adv-estimator grpo --group-size 2 --dynamic-sampling --max-sample-rounds 3"


@pytest.mark.parametrize(
    "estimator_flags", ["", CRITIC_FREE_FLAGS, LORA_FLAGS, DYNAMIC_FLAGS], ids=["gae", "grpo", "lora", "dynamic"]
)
def test_ppo_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts, estimator_flags):
    sft, rm = tiny_ckpts
    base = f"{sys.executable} train_ppo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} {PPO_FLAGS}"
    base = f"{base} {estimator_flags}"
    r = run(f"{base} --out-dir {tmp_path}/full")
    assert r.returncode == 0, r.stderr[-3000:]
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=5)
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    keys = ("model",) if estimator_flags in (CRITIC_FREE_FLAGS, DYNAMIC_FLAGS) else ("model", "critic")
    if estimator_flags == LORA_FLAGS:  # the adapters themselves, and the merged weights above
        keys += ("model_lora", "critic_lora")
    assert ("critic" in full) == ("critic" in keys)
    for key in keys:
        assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt", key)
    for key in ("reward_moments", "kl_ctl"):
        for k, v in full[key].items():
            assert abs(v - killed[key][k]) <= 1e-5 * max(1.0, abs(v)), (key, k)
    updates = full["data_state"]["updates"]
    assert killed["data_state"]["updates"] == updates
    if estimator_flags == DYNAMIC_FLAGS:  # a minibatch with no informative group is no step
        assert 0 < updates <= 12 * 2
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "full"))
        events.Reload()
        assert max(event.value for event in events.Scalars("rollout/sample_rounds")) > 1  # extra rounds were drawn
    else:
        assert updates == 12 * 2
    assert full["data_state"]["prompts"] == killed["data_state"]["prompts"]
    assert full["data_state"]["ptx"] == killed["data_state"]["ptx"]
    # samples.jsonl: no duplicate lines, 8 per iteration, the very lines of the uninterrupted run
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 12 * 8
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()


def test_ppo_kill_between_samples_and_save_leaves_no_duplicates(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    """A kill after an iteration's samples are appended but before its checkpoint: the resume drops them, redoes it."""

    class Killed(BaseException):
        pass

    real_save, calls = checkpoints.save_checkpoint, {"n": 0}

    def dying_save(obj, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Killed
        real_save(obj, path)

    monkeypatch.setattr(checkpoints, "save_checkpoint", dying_save)
    args = train_ppo.Args(
        out_dir=str(tmp_path),
        task_dir=task_dir,
        sft_ckpt=tiny_ckpts[0],
        rm_ckpt=tiny_ckpts[1],
        max_steps=4,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        ptx_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
        sample_every=1,
        save_every=1,
    )
    with pytest.raises(Killed):
        train_ppo.main(args)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 2
    train_ppo.main(train_ppo.Args(**{**args.__dict__, "resume": True}))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")]
    assert steps == sorted(steps) and [steps.count(s) for s in (1, 2, 3, 4)] == [8, 8, 8, 8]


def test_ppo_resume_refuses_other_world_size_changed_inputs_and_a_finished_run(tmp_path, task_dir, tiny_ckpts):
    sft, rm = str(tmp_path / "sft.pt"), str(tmp_path / "rm.pt")
    shutil.copy(tiny_ckpts[0], sft), shutil.copy(tiny_ckpts[1], rm)
    args = train_ppo.Args(
        out_dir=str(tmp_path / "ppo"),
        task_dir=task_dir,
        sft_ckpt=sft,
        rm_ckpt=rm,
        max_steps=1,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        ptx_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
    )
    train_ppo.main(args)
    resume, path = train_ppo.Args(**{**args.__dict__, "resume": True, "max_steps": 2}), tmp_path / "ppo" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=False)
    checkpoints.save_checkpoint(ckpt | {"world_size": 2}, str(path))
    with pytest.raises(common.UserError, match="saved with world size 2, now 1"):
        train_ppo.main(resume)
    checkpoints.save_checkpoint(ckpt, str(path))
    for flag, p in (("--sft-ckpt", sft), ("--rm-ckpt", rm)):  # the same weights re-saved: another file all the same
        original = open(p, "rb").read()
        checkpoints.save_checkpoint(torch.load(p, weights_only=False) | {"seconds": 1.0}, p)
        with pytest.raises(common.UserError, match=f"--resume {path}: {flag} changed since the run started"):
            train_ppo.main(resume)
        open(p, "wb").write(original)
    train_ppo.main(resume)  # unchanged inputs: resumes
    assert torch.load(path, weights_only=False)["step"] == 2
    with pytest.raises(common.UserError, match="already at step 2 of 2"):  # a finished run
        train_ppo.main(resume)


def test_rm_resume_refuses_a_changed_init(tmp_path, task_dir, tiny_ckpts):
    """The RM records the sha256 of its --init checkpoint; --resume after that file changed is a one-line error."""
    import train_rm

    sft = str(tmp_path / "sft.pt")
    shutil.copy(tiny_ckpts[0], sft)
    args = train_rm.Args(
        out_dir=str(tmp_path / "rm"),
        task_dir=task_dir,
        init=sft,
        max_steps=1,
        batch_size=8,
        micro_batch_size=4,
        eval_every=1,
        eval_pairs=8,
        probe_size=4,
        calib_size=16,
    )
    train_rm.main(args)
    assert torch.load(tmp_path / "rm" / "ckpt.pt", weights_only=False)["init_hash"] == checkpoints.file_sha256(sft)
    checkpoints.save_checkpoint(torch.load(sft, weights_only=False) | {"seconds": 1.0}, sft)
    with pytest.raises(common.UserError, match=r"--init .*sft\.pt changed since the run started"):
        train_rm.main(train_rm.Args(**{**args.__dict__, "resume": True, "max_steps": 2}))


def test_ppo_nan_step_is_skipped_and_the_run_finishes(tmp_path, task_dir, tiny_ckpts, monkeypatch):
    """One NaN policy loss (monkeypatched) in a whole PPO run: that actor step is skipped and counted, the run ends
    normally; a NaN every time stops the run after 10 skipped optimizer steps in a row (the shared guard)."""
    real, calls = train_ppo.ppo_policy_loss, {"n": 0}

    def one_nan(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 3 else loss), stats

    monkeypatch.setattr(train_ppo, "ppo_policy_loss", one_nan)
    args = train_ppo.Args(
        out_dir=str(tmp_path / "one"),
        task_dir=task_dir,
        sft_ckpt=tiny_ckpts[0],
        rm_ckpt=tiny_ckpts[1],
        max_steps=3,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        ptx_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
    )
    train_ppo.main(args)
    ckpt = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3 and ckpt["data_state"]["skipped"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    calls["n"], always = -(10**9), lambda *a, **k: (lambda loss, st: (loss * float("nan"), st))(*real(*a, **k))
    monkeypatch.setattr(train_ppo, "ppo_policy_loss", always)
    with pytest.raises(RuntimeError, match="10 non-finite steps in a row"):
        train_ppo.main(train_ppo.Args(**{**args.__dict__, "out_dir": str(tmp_path / "all"), "max_steps": 20}))


# -----------------------------------------------------------------------------
# --resume continues the run it finds: a changed flag that changes the math is refused (DESIGN §8)


def tiny_ppo(out_dir: str, task_dir: str, tiny_ckpts: tuple, **flags) -> train_ppo.Args:
    settings = dict(
        out_dir=out_dir,
        task_dir=task_dir,
        sft_ckpt=tiny_ckpts[0],
        rm_ckpt=tiny_ckpts[1],
        max_steps=2,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        ptx_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
    )
    return train_ppo.Args(**(settings | flags))


def test_ppo_resume_refuses_changed_math_and_allows_a_longer_budget(tmp_path, task_dir, tiny_ckpts, capsys):
    """A finished gae run: --resume with another estimator or lr is one line naming each flag with its saved and new
    value (it used to drop the critic, or take effect at once); with --overwrite too, refused; a longer budget
    continues, says that the LR schedule is re-timed, and the schedule goes on from the lr it had."""
    out = str(tmp_path / "ppo")
    train_ppo.main(tiny_ppo(out, task_dir, tiny_ckpts, log_every=1))
    saved = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    resume = dict(out_dir=out, task_dir=task_dir, resume=True, max_steps=4)  # every other flag at its default
    with pytest.raises(common.UserError, match=r"--adv-estimator gae -> rloo"):
        train_ppo.main(train_ppo.Args(**resume, adv_estimator="rloo"))
    with pytest.raises(common.UserError, match=r"--kl-coef 0\.3 -> 0\.1, --lr 0\.0005 -> 0\.05: these change"):
        train_ppo.main(train_ppo.Args(**resume, lr=0.05, kl_coef=0.1))
    with pytest.raises(common.UserError, match=r"--resume continues the run .* --overwrite starts it over"):
        train_ppo.main(train_ppo.Args(**resume, overwrite=True))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 2  # nothing written
    capsys.readouterr()
    train_ppo.main(train_ppo.Args(**resume))  # the saved sft/rm checkpoints and sizes, a longer budget
    printed = capsys.readouterr().out
    assert "resume: changed since the last sitting: --max-steps 2 -> 4" in printed
    assert "--rollout-batch-size 8" in printed and "re-timed from step 2" in printed
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 4 and ckpt["args"]["rollout_batch_size"] == 8 and ckpt["args"]["max_steps"] == 4
    old, new = common.LRSchedule(**saved["scheduler"]), common.LRSchedule(**ckpt["scheduler"])
    assert new.max_steps == 4 and new.at(2) == pytest.approx(old.at(2), abs=1e-15)


def test_ppo_resume_without_the_estimator_flag_continues_that_estimator(tmp_path, task_dir, tiny_ckpts):
    """A GRPO run resumed with --resume alone (no --adv-estimator grpo) continues as GRPO, without a critic; it used
    to build one and end in a KeyError: 'critic' traceback."""
    out = str(tmp_path / "grpo")
    train_ppo.main(tiny_ppo(out, task_dir, tiny_ckpts, adv_estimator="grpo"))
    train_ppo.main(train_ppo.Args(out_dir=out, task_dir=task_dir, resume=True, max_steps=3))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 3 and ckpt["args"]["adv_estimator"] == "grpo" and ckpt["args"]["group_size"] == 4
    assert "critic" not in ckpt and ckpt["args"]["kl_penalty"] == "loss"


def test_sft_resume_without_its_model_flags_builds_the_saved_shape(tmp_path, task_dir):
    """A tiny SFT run resumed with --resume alone builds the saved 1-layer model (it used to end in a 47-line
    size-mismatch traceback)."""
    out = str(tmp_path / "sft")
    flags = dict(n_layer=1, n_head=2, n_embd=32, batch_size=8, micro_batch_size=4, eval_every=2, num_samples=4)
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, max_steps=2, eval_samples=4, **flags))
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, resume=True, max_steps=3))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 3 and ckpt["model_config"]["n_layer"] == 1 and ckpt["args"]["batch_size"] == 8


def test_dpo_lora_resume_refuses_another_alpha(tmp_path, task_dir, tiny_ckpts):
    """A DPO LoRA run resumed with another --lora-alpha would merge its adapters at another scale: refused."""
    import train_dpo

    out = str(tmp_path / "dpo")
    flags = dict(
        init=tiny_ckpts[0],
        lora_rank=2,
        batch_size=8,
        micro_batch_size=4,
        eval_every=2,
        eval_pairs=8,
        num_samples=4,
        eval_samples=4,
        max_new_tokens=8,
        warmup_steps=1,
    )
    train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, max_steps=2, **flags))
    with pytest.raises(common.UserError, match=r"--lora-alpha 16\.0 -> 4\.0"):
        train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, resume=True, max_steps=3, lora_alpha=4.0))
    train_dpo.main(train_dpo.Args(out_dir=out, task_dir=task_dir, resume=True, max_steps=3))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 3


def test_overwrite_removes_the_temp_file_of_a_killed_save(tmp_path, task_dir):
    """A kill during a save leaves ckpt.pt.tmp.<pid>, which is never a checkpoint: --overwrite (and --resume)
    remove it."""
    out = tmp_path / "sft"
    out.mkdir()
    checkpoints.save_checkpoint({"kind": "sft", "model": {}}, str(out / "ckpt.pt"))
    (out / "ckpt.pt.tmp.12345").write_bytes(b"half a checkpoint")
    checkpoints.prepare_out_dir(str(out), resume=True, overwrite=False)
    assert sorted(os.listdir(out)) == ["ckpt.pt"]
    (out / "ckpt.pt.tmp.12345").write_bytes(b"half a checkpoint")
    checkpoints.prepare_out_dir(str(out), resume=False, overwrite=True)
    assert os.listdir(out) == []
