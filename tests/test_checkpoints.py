"""checkpoints.py: atomic saves and kind-checked loads, RNG state, --overwrite and temp-file clean-up, and the --resume
rules (docs/design.md §8): a changed flag that changes the math is refused with one line naming each flag (the
estimator, beta, lr, a LoRA alpha), a longer budget continues and re-times the LR schedule, --resume with --overwrite
is refused, a changed input or another world size is refused, --resume alone continues the saved run (its estimator,
its model shape), and from the command line a given flag counts whatever its value; a fresh run's removal of a dead
run's logs; the policy kinds every stage starts from (checkpoints.POLICY_KINDS)."""

import os
import shutil
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import TINY_RL, exits_2_with_one_line, read_scalars

import checkpoints
import cli
import common
import eval as ev
import train_dpo
import train_grpo
import train_ppo
import train_rm
import train_sft
from common import UserError


def test_resume_without_a_checkpoint_says_what_happened(tmp_path):
    """--resume of a run killed before its first save (--save-every 0 saves at the end only) says so (it said "run
    the previous stage first"); a folder with no run says that."""
    import train_sft

    (tmp_path / "killed").mkdir()
    with pytest.raises(UserError, match="no checkpoint: the run there stopped before it saved one"):
        checkpoints.resume_args(train_sft.Args(out_dir=str(tmp_path / "killed"), resume=True), "sft")
    with pytest.raises(UserError, match="no checkpoint: no run there to resume"):
        checkpoints.resume_args(train_sft.Args(out_dir=str(tmp_path / "never"), resume=True), "sft")


def test_atomic_save_and_load(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoints.save_checkpoint({"kind": "sft", "model": {"w": torch.ones(2)}}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind
    ck = checkpoints.load_checkpoint(path, kind="sft")
    assert torch.equal(ck["model"]["w"], torch.ones(2))
    with pytest.raises(UserError, match="is a 'sft' checkpoint, expected rm"):
        checkpoints.load_checkpoint(path, kind="rm", flag="--rm-ckpt")
    with pytest.raises(UserError, match="no such checkpoint"):
        checkpoints.load_checkpoint(str(tmp_path / "nope.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        checkpoints.load_checkpoint(str(tmp_path / "junk.pt"))


def test_rng_state_round_trip():
    g = torch.Generator().manual_seed(3)
    state = checkpoints.rng_state(g)
    a = (torch.rand(3), torch.rand(3, generator=g))
    checkpoints.set_rng_state(state, g)
    b = (torch.rand(3), torch.rand(3, generator=g))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_prepare_out_dir(tmp_path):
    out = str(tmp_path)
    checkpoints.prepare_out_dir(out, resume=False, overwrite=False)  # nothing there: fine
    for name in ("ckpt.pt", "samples.jsonl", "events.out.tfevents.1.host", "notes.txt"):
        (tmp_path / name).write_text("x")
    with pytest.raises(UserError, match=r"ckpt\.pt exists: pass --resume to continue that run, or --overwrite to"):
        checkpoints.prepare_out_dir(out, resume=False, overwrite=False)
    checkpoints.prepare_out_dir(out, resume=True, overwrite=False)  # --resume: left for load_resume
    assert len(os.listdir(out)) == 4
    checkpoints.prepare_out_dir(out, resume=False, overwrite=True)
    assert os.listdir(out) == ["notes.txt"]


def test_a_fresh_run_removes_the_logs_of_an_earlier_run_that_saved_no_checkpoint(tmp_path, capsys):
    """A run that died before its first save leaves event files and samples.jsonl but no ckpt.pt. A fresh run there
    (no --resume) removes them and says so, so TensorBoard never shows the dead run's steps beside the new run's;
    other files stay. --resume leaves the logs alone (the resumed run purges past its checkpoint itself)."""
    out = str(tmp_path / "run")
    dead = common.Logger(out, master=True)
    for step in range(1, 6):
        dead.log(step, {"train/loss": 99.0}, console=False)
    dead.samples(3, [{"text": "old"}])
    dead.close()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    logs = sorted(name for name in os.listdir(out) if name != "notes.txt")
    assert len(logs) == 2 and logs[0].startswith("events.out.tfevents.") and logs[1] == "samples.jsonl"
    checkpoints.prepare_out_dir(out, resume=True, overwrite=False)
    assert sorted(os.listdir(out)) == sorted(logs + ["notes.txt"])
    capsys.readouterr()
    checkpoints.prepare_out_dir(out, resume=False, overwrite=False)
    assert os.listdir(out) == ["notes.txt"]
    assert capsys.readouterr().out == f"{out}: removed 2 log file(s) of an earlier run that saved no checkpoint\n"
    fresh = common.Logger(out, master=True)
    fresh.log(1, {"train/loss": 1.0}, console=False)
    fresh.close()
    assert read_scalars(out) == {"train/loss": [1.0]}  # the new run's step alone
    assert open(os.path.join(out, "samples.jsonl")).read() == ""


def test_overwrite_removes_the_temp_file_of_a_killed_save(tmp_path):
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


def test_policy_kinds_are_every_policy_stage():
    assert checkpoints.POLICY_KINDS == ("sft", "dpo", "ppo", "grpo")


# -----------------------------------------------------------------------------
# --resume continues the run it finds: a changed flag that changes the math is refused (docs/design.md §8)


SAVED_SFT = dict(n_layer=1, n_head=2, n_embd=32, lr=1e-3, batch_size=8, micro_batch_size=4, log_every=1, max_steps=4)


@pytest.fixture
def saved_sft_run(tmp_path) -> str:
    """An out dir whose ckpt.pt is an SFT run's as resume_args reads it (kind, args; no weights needed), saved with
    a 1-layer shape, lr 1e-3 (the default is 2e-3) and --log-every 1."""
    out = tmp_path / "sft"
    saved = asdict(train_sft.Args(out_dir=str(out), **SAVED_SFT))
    checkpoints.save_checkpoint({"kind": "sft", "model": {}, "args": saved, "step": 2}, str(out / "ckpt.pt"))
    return str(out)


def resume_from_the_command_line(monkeypatch, out: str, *flags: str) -> train_sft.Args:
    """`python train_sft.py --resume --out-dir out <flags>` as the script parses it (cli.parse records the given
    flags), through checkpoints.resume_args."""
    monkeypatch.setattr(sys, "argv", ["train_sft.py", "--resume", "--out-dir", out, *flags])
    return checkpoints.resume_args(cli.parse(train_sft.Args), "sft")


def test_resume_takes_the_saved_value_of_every_flag_the_command_line_does_not_give(saved_sft_run, monkeypatch, capsys):
    """`--resume` alone on the command line continues the saved run: every flag it does not give takes the
    checkpoint's value (shape, lr, sizes), and the start-up line lists those that differ from the defaults."""
    args = resume_from_the_command_line(monkeypatch, saved_sft_run)
    assert {name: getattr(args, name) for name in SAVED_SFT} == SAVED_SFT
    printed = capsys.readouterr().out
    assert "resume: the checkpoint's settings where no flag says otherwise: " in printed
    assert "--n-layer 1" in printed and "--lr 0.001" in printed


def test_resume_accepts_a_given_flag_at_its_saved_value(saved_sft_run, monkeypatch, capsys):
    """A flag the command line gives with the value the run was saved with (here lr and the shape, spelled
    differently: --lr=0.001) is no change: accepted, nothing reported as changed; a given bookkeeping flag that
    differs (--log-every) applies and is printed."""
    args = resume_from_the_command_line(monkeypatch, saved_sft_run, "--lr=0.001", "--n-layer", "1", "--log-every", "5")
    assert (args.lr, args.n_layer, args.n_embd, args.log_every) == (1e-3, 1, 32, 5)
    printed = capsys.readouterr().out
    assert "resume: changed since the last sitting: --log-every 1 -> 5" in printed and "--lr 0.001 ->" not in printed


def test_resume_refuses_a_given_flag_that_changes_the_math_even_at_its_default(saved_sft_run, monkeypatch):
    """A flag the command line gives counts as given whatever its value: --lr 0.002 is the dataclass default, yet it
    differs from the saved 0.001, so it is refused (from Python, where nothing records what was given, a field at its
    default would silently take the saved value); each such flag is named with its saved and its new value, in one
    line."""
    with pytest.raises(UserError) as error:
        resume_from_the_command_line(monkeypatch, saved_sft_run, "--lr", "0.002", "--n-layer", "2")
    message = str(error.value)
    assert "--n-layer 1 -> 2, --lr 0.001 -> 0.002: these change what the run computes" in message
    assert "\n" not in message
    python_args = train_sft.Args(out_dir=saved_sft_run, resume=True, lr=2e-3)  # the same, from Python: inherited
    assert checkpoints.resume_args(python_args, "sft").lr == 1e-3


def test_resume_refusal_is_one_line_from_the_script(saved_sft_run, monkeypatch, capsys):
    """The same refusal through train_sft.py's own __main__ (cli.parse, then run_main): exit 2, one line naming the
    flag, before anything is built (the checkpoint here holds no weights at all)."""
    flags = ["--resume", "--out-dir", saved_sft_run, "--n-embd", "64"]
    err = exits_2_with_one_line("train_sft.py", flags, capsys, monkeypatch)
    assert "--n-embd 32 -> 64: these change what the run computes" in err


# 2 iterations of 8 responses, 8 tokens at most
TINY = dict(
    max_steps=2,
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=4,
    ptx_batch_size=4,
    max_new_tokens=8,
    warmup_steps=1,
)


def tiny_ppo(out_dir: str, task_dir: str, tiny_ckpts: tuple, **flags) -> train_ppo.Args:
    settings = dict(out_dir=out_dir, task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_ckpts[1])
    return train_ppo.Args(**(settings | TINY | dict(critic_warmup_steps=1) | flags))


@pytest.mark.slow
def test_ppo_resume_refuses_changed_math_and_allows_a_longer_budget(tmp_path, task_dir, tiny_ckpts, capsys):
    """A finished PPO run: --resume with another beta or lr is one line naming each flag with its saved and new value
    (it used to take effect at once); with --overwrite too, refused; a longer budget continues, says that the LR
    schedule is re-timed, and the schedule goes on from the lr it had."""
    out = str(tmp_path / "ppo")
    train_ppo.main(tiny_ppo(out, task_dir, tiny_ckpts, log_every=1))
    saved = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    resume = dict(out_dir=out, task_dir=task_dir, resume=True, max_steps=4)  # every other flag at its default
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


@pytest.mark.slow
def test_grpo_resume_refuses_another_estimator_and_continues_without_the_flag(tmp_path, task_dir, tiny_ckpts):
    """A GRPO run: --resume with another --estimator is refused in one line (it would change every advantage);
    --resume alone (no --estimator, no recipe flag) continues as GRPO with the saved recipe, without a critic (the
    old train_ppo.py used to build one and end in a KeyError: 'critic' traceback)."""
    out = str(tmp_path / "grpo")
    train_grpo.main(
        train_grpo.Args(out_dir=out, task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_ckpts[1], **TINY)
    )
    resume = dict(out_dir=out, task_dir=task_dir, resume=True, max_steps=3)
    with pytest.raises(common.UserError, match=r"--estimator grpo -> rloo: these change"):
        train_grpo.main(train_grpo.Args(**resume, estimator="rloo"))
    train_grpo.main(train_grpo.Args(**resume))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["kind"] == "grpo" and ckpt["step"] == 3 and ckpt["args"]["estimator"] == "grpo"
    assert ckpt["args"]["group_size"] == 4 and ckpt["args"]["kl_penalty"] == "loss" and "critic" not in ckpt


@pytest.mark.slow
def test_ppo_resume_refuses_other_world_size_changed_inputs_and_a_finished_run(tmp_path, task_dir, tiny_ckpts):
    sft, rm = str(tmp_path / "sft.pt"), str(tmp_path / "rm.pt")
    shutil.copy(tiny_ckpts[0], sft), shutil.copy(tiny_ckpts[1], rm)
    args = tiny_ppo(str(tmp_path / "ppo"), task_dir, (sft, rm), max_steps=1)
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


@pytest.mark.slow
def test_rm_resume_refuses_a_changed_init(tmp_path, task_dir, tiny_ckpts):
    """The RM records the sha256 of its --init checkpoint; --resume after that file changed is a one-line error."""
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


@pytest.mark.slow
def test_sft_resume_without_its_model_flags_builds_the_saved_shape(tmp_path, task_dir):
    """A tiny SFT run resumed with --resume alone builds the saved 1-layer model (it used to end in a 47-line
    size-mismatch traceback)."""
    out = str(tmp_path / "sft")
    flags = dict(n_layer=1, n_head=2, n_embd=32, batch_size=8, micro_batch_size=4, eval_every=2, num_samples=4)
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, max_steps=2, eval_samples=4, **flags))
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, resume=True, max_steps=3))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 3 and ckpt["model_config"]["n_layer"] == 1 and ckpt["args"]["batch_size"] == 8


@pytest.mark.slow
def test_dpo_lora_resume_refuses_another_alpha(tmp_path, task_dir, tiny_ckpts):
    """A DPO LoRA run resumed with another --lora-alpha would merge its adapters at another scale: refused."""
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


# -----------------------------------------------------------------------------
# the policy kinds: every stage starts from any policy checkpoint, a critic-free ppo one included


@pytest.mark.slow
def test_a_critic_free_ppo_checkpoint_is_a_policy(tmp_path, task_dir, grpo_ckpt):
    """A critic-free run of the older train_ppo.py saved kind "ppo" with --adv-estimator grpo (here a tiny GRPO
    checkpoint rewritten so): train_grpo.py (--sft-ckpt), train_dpo.py (--init) and eval.py (--policy) take it as a
    policy; and a kind "grpo" checkpoint is a --sft-ckpt of train_ppo.py."""
    old = tmp_path / "old_ppo"
    old.mkdir()
    ckpt = torch.load(grpo_ckpt, weights_only=False)
    old_args = ckpt["args"] | {"adv_estimator": "grpo"}
    checkpoints.save_checkpoint(ckpt | {"kind": "ppo", "args": old_args}, str(old / "ckpt.pt"))
    policy = str(old / "ckpt.pt")
    gold = dict(task_dir=task_dir, rm_ckpt="none", reward_fn="task:gold_reward", max_steps=1)
    train_grpo.main(train_grpo.Args(out_dir=str(tmp_path / "grpo"), sft_ckpt=policy, **gold, **TINY_RL))
    assert torch.load(tmp_path / "grpo" / "ckpt.pt", weights_only=False)["step"] == 1
    dpo = dict(batch_size=8, micro_batch_size=4, max_steps=1, eval_every=1, eval_pairs=8, num_samples=4)
    dpo |= dict(eval_samples=4, max_new_tokens=8)
    train_dpo.main(train_dpo.Args(out_dir=str(tmp_path / "dpo"), task_dir=task_dir, init=policy, **dpo))
    assert torch.load(tmp_path / "dpo" / "ckpt.pt", weights_only=False)["step"] == 1
    rows = ev.main(ev.Args(policy=[policy], names=["old"], ref=policy, rm="none", num_samples=4, task_dir=task_dir))
    assert abs(rows["old"]["kl"]) < 1e-4  # the policy against itself
    ppo = tmp_path / "ppo"
    train_ppo.main(train_ppo.Args(out_dir=str(ppo), sft_ckpt=grpo_ckpt, **gold, **TINY_RL, critic_warmup_steps=0))
    assert torch.load(ppo / "ckpt.pt", weights_only=False)["step"] == 1
