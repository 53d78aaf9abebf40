"""common.py: exact_div, the LR schedule (and its re-timing on a longer budget), the logger (samples.jsonl, console
keys, resume), the NaN-guarded optimizer step over one and two models, throughput, peak FLOPs and an RL iteration's
FLOPs by hand, StopSignal's SIGINT/SIGTERM handlers, the --*-every rule and `none` for an Optional flag; and
common.run_main's contract across every stage (docs/design.md §8): a user mistake ends with one line on stderr, exit
code 2, no traceback and no checkpoint written; --help lists a stage's own flags first."""

import dataclasses
import json
import math
import os
import platform
import re
import shlex
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, exits_2_with_one_line, offline, run

import checkpoints
import cli
import common
import rollout
import train_grpo
import train_ppo
import train_sft
from common import LRSchedule, StepGuard, Trained, UserError, exact_div, guarded_step
from model import GPT, GPTConfig
from rollout import Models
from task import build_task


def test_exact_div():
    assert exact_div(64, 8, "x") == 8
    with pytest.raises(UserError, match="must divide by 3"):
        exact_div(64, 3, "--batch-size")


def test_lr_schedule_warmup_then_cosine():
    schedule = LRSchedule(1.0, warmup_steps=10, max_steps=100)
    lrs = [schedule.at(s) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay after warm-up
    assert lrs[100] == pytest.approx(0.1)  # floor at min_lr_ratio
    mid = 10 + 45
    assert lrs[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    # delay (PPO's actor during the critic warm-up): the same curve, shifted
    delayed = LRSchedule(1.0, warmup_steps=10, max_steps=105, delay=5)
    assert [delayed.at(s + 5) for s in range(101)] == lrs and delayed.at(0) == lrs[0]


def test_lr_schedule_retimed_for_a_longer_budget():
    """A resume at step 60 of 100 with a budget of 200: the same lr at step 60, then the cosine from where it was
    (progress 50/90) to its floor at step 200, monotone; resumed again (a re-timed schedule re-timed) it still
    continues without a jump; a resume inside the warm-up only moves the end."""
    schedule = LRSchedule(1.0, warmup_steps=10, max_steps=100)
    retimed = schedule.retimed(60, 200)
    assert retimed.at(60) == pytest.approx(schedule.at(60), abs=1e-12)
    assert retimed.start_step == 60 and retimed.max_steps == 200
    tail = [retimed.at(s) for s in range(60, 201)]
    assert all(a >= b for a, b in zip(tail, tail[1:])) and tail[-1] == pytest.approx(0.1)
    progress = 50 / 90 + (1 - 50 / 90) * 70 / 140  # halfway from step 60 to step 200
    assert retimed.at(130) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    again = LRSchedule(**retimed.state_dict()).retimed(130, 300)
    assert again.at(130) == pytest.approx(retimed.at(130), abs=1e-12) and again.at(300) == pytest.approx(0.1)
    early = schedule.retimed(5, 200)
    assert early.at(5) == schedule.at(5) and early.start_step is None and early.max_steps == 200


def test_peak_flops_measured_on_cpu_in_the_runs_dtype(monkeypatch):
    """On CPU the MFU's peak is measured with the matmuls the run does: under --dtype bfloat16, bf16 ones (against an
    fp32 peak a bf16 run read perf/mfu 1.1 on a CPU with bf16 matmuls), from the same draws of the global generator."""
    assert common.peak_flops(torch.device("cpu"), 123.0) == 123.0
    assert common.peak_flops(torch.device("cpu")) > 1e8
    multiplied = []
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: multiplied.append(a.dtype) or matmul(a, b))
    assert common.peak_flops(torch.device("cpu"), dtype=torch.bfloat16) > 1e6
    assert multiplied and set(multiplied) == {torch.bfloat16}
    after = []
    for dtype in (torch.float32, torch.bfloat16):  # the global generator moves alike: a run's draws do not change
        torch.manual_seed(0)
        common.peak_flops(torch.device("cpu"), dtype=dtype)
        after.append(torch.rand(4))
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)


FAULTS_OF_LARGE_BLOCKS = """
import resource, torch
import common


def faults_of_steps() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a training step's pattern: large and small blocks, all freed when the step ends
        logits = torch.ones(16 * 2**20)  # 64 MB, over glibc's 32 MB ceiling for its heap
        activations = [torch.ones(1000) for _ in range(10)]
        gradient = torch.ones(16 * 2**20)
        del logits, activations, gradient
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


default = faults_of_steps()
common.keep_freed_memory()
print(default, faults_of_steps())
"""


@pytest.mark.skipif(torch.cuda.is_available() or platform.libc_ver()[0] != "glibc", reason="glibc CPU runs only")
def test_keep_freed_memory_reuses_large_freed_blocks(tmp_path):
    """20 steps of two 64 MB blocks and small ones, all freed at the step's end, in a fresh process: by default each
    large block page-faults in afresh (16,384 pages of 4 KB a block, 40 blocks); after keep_freed_memory (which
    run_main calls before every stage) the same 20 steps are served from memory already touched once the heap has
    grown by a few blocks."""
    script = tmp_path / "faults.py"
    script.write_text(FAULTS_OF_LARGE_BLOCKS)
    r = run(f"{sys.executable} {script}", env={"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    default, kept = map(int, r.stdout.split())
    assert default > 40 * 16_000 and kept < 8 * 16_384, (default, kept)


def test_logger_owns_samples_jsonl(tmp_path, capsys):
    out = str(tmp_path)
    logger = common.Logger(out, master=True)
    logger.samples(1, [{"text": "a"}, {"text": "b"}])
    logger.samples(2, [{"text": "c"}])
    logger.samples(3, [{"text": "d"}])
    logger.close()
    path = tmp_path / "samples.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 4, "te')  # a kill in the middle of a line
    assert [json.loads(line)["step"] for line in open(path).read().splitlines()[:-1]] == [1, 1, 2, 3]
    common.Logger(out, master=True, resume_step=2).close()  # resumed from step 2: later records go
    assert [json.loads(line) for line in open(path)] == [
        {"step": 1, "text": "a"},
        {"step": 1, "text": "b"},
        {"step": 2, "text": "c"},
    ]
    common.Logger(out, master=True).close()  # a fresh run starts it empty
    assert path.read_text() == ""
    common.Logger(str(tmp_path / "other"), master=False).samples(1, [{"text": "a"}])  # not rank 0: writes nothing
    assert not (tmp_path / "other").exists()


def test_logger_console_keys(tmp_path, capsys, monkeypatch):
    """The console line: the keys, then the sitting's elapsed time and, with max_steps, the time left at its pace (a
    resumed run's pace from its own steps)."""
    metrics = {"policy/loss": 0.5, "value/loss": 2.0, "objective/kl": 0.125, "perf/mfu": 0.25}
    monkeypatch.setattr(common.time, "time", lambda: 1000.0)
    logger = common.Logger(str(tmp_path / "all"), master=True)
    monkeypatch.setattr(common.time, "time", lambda: 1090.0)  # 3 steps in 90 s: 7 more take 210 s
    logger.log(3, metrics, max_steps=10)
    line = "step 00003/00010 | policy/loss 0.5 | value/loss 2 | kl 0.125 | mfu 0.25 | elapsed 1m30s | left 3m30s\n"
    assert capsys.readouterr().out == line
    logger.close()
    logger = common.Logger(str(tmp_path / "some"), master=True, console_keys=("objective/kl", "nope", "policy/loss"))
    logger.log(3, metrics)
    assert capsys.readouterr().out == "step 00003 | kl 0.125 | loss 0.5 | elapsed 0s\n"
    logger.close()
    logger = common.Logger(str(tmp_path / "resumed"), master=True, resume_step=8)
    monkeypatch.setattr(common.time, "time", lambda: 1090.0 + 2 * 3700.0)  # 2 steps of this sitting, 3700 s each
    logger.log(10, {"loss": 1.0}, max_steps=20)
    assert capsys.readouterr().out == "step 00010/00020 | loss 1 | elapsed 2h03m | left 10h16m\n"
    logger.close()


def test_guarded_step_skips_non_finite_steps():
    weight = torch.nn.Parameter(torch.ones(2))
    entry = Trained("model", torch.nn.ParameterList([weight]), torch.optim.SGD([weight], lr=0.1), grad_clip=1.0)
    guard = StepGuard()
    (weight * torch.tensor([3.0, 4.0])).sum().backward()
    assert guarded_step([entry], guard, step=0) == {"model"}
    assert torch.allclose(weight.detach(), torch.tensor([0.94, 0.92])) and weight.grad is None  # clipped to norm 1
    for step in range(1, 10):
        (weight * float("nan")).sum().backward()
        assert guarded_step([entry], guard, step=step) == set()
    assert torch.allclose(weight.detach(), torch.tensor([0.94, 0.92]))
    assert (guard.skipped, guard.skipped_in_row) == (9, 9)
    # train/grad_norm is the mean over the steps taken: the skipped steps' NaN never enters it
    assert guard.read() == {"train/grad_norm": 5.0, "train/skipped_steps": 9}
    assert guard.read() == {"train/skipped_steps": 9}  # no step taken since the last read: no grad norm
    (weight * float("inf")).sum().backward()
    with pytest.raises(RuntimeError, match="10 non-finite steps in a row"):
        guarded_step([entry], guard, step=10)


def test_guarded_step_over_two_models_counts_a_step_once():
    """Two models (PPO's actor and critic): one with a non-finite norm skips, the other still steps, and the step
    counts once as skipped; a step where both step resets the run of skips."""
    actor_weight, critic_weight = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    actor = Trained("model", torch.nn.ParameterList([actor_weight]), torch.optim.SGD([actor_weight], lr=0.1))
    critic = Trained("critic", torch.nn.ParameterList([critic_weight]), torch.optim.SGD([critic_weight], lr=0.1))
    guard = StepGuard()
    (actor_weight * float("nan")).sum().backward()
    critic_weight.sum().backward()
    assert guarded_step([actor, critic], guard, step=0) == {"critic"}
    assert torch.equal(actor_weight.detach(), torch.ones(2)) and torch.allclose(
        critic_weight.detach(), torch.full((2,), 0.9)
    )
    assert (guard.skipped, guard.skipped_in_row) == (1, 1)
    actor_weight.sum().backward()
    critic_weight.sum().backward()
    assert guarded_step([actor, critic], guard, step=1) == {"model", "critic"}
    assert (guard.skipped, guard.skipped_in_row) == (1, 0)
    read = guard.read({"model": "train/grad_norm", "critic": "value/grad_norm"})
    assert read == {
        "train/grad_norm": pytest.approx(2**0.5),
        "value/grad_norm": pytest.approx(2**0.5),
        "train/skipped_steps": 1,
    }


def test_throughput_leaves_pauses_out(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(common.time, "time", lambda: clock["now"])
    throughput = common.Throughput(flops_per_token=10.0, peak_flops=1000.0, world_size=2)
    clock["now"] += 2.0  # training
    with throughput.paused():
        clock["now"] += 50.0  # evaluation
    clock["now"] += 2.0
    assert throughput.read(tokens=400) == {"perf/tokens_per_sec": 100.0, "perf/mfu": 0.5}
    with throughput.paused():  # a pause right after a read (the old bookkeeping made the next interval negative)
        clock["now"] += 50.0
    clock["now"] += 1.0
    assert throughput.read(tokens=100)["perf/tokens_per_sec"] == 100.0


def test_logger_resume_keeps_the_checkpoint_step_and_hides_later_ones(tmp_path):
    """Resuming from a checkpoint saved at step 2 keeps the scalars of steps <= 2 (logged before that save) and hides
    the dead run's step 3, which the resumed run logs again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    logger = common.Logger(out, master=True)
    for step in (1, 2, 3):
        logger.log(step, {"train/loss": float(step)}, console=False)
    logger.close()
    resumed = common.Logger(out, master=True, resume_step=2)
    resumed.log(3, {"train/loss": 30.0}, console=False)
    resumed.close()
    events = EventAccumulator(out)
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_start_up_warns_of_sizes_that_run_but_mislead(capsys):
    """Printed once at start-up: a batch of more records than the data holds, a held-out set of one record, a
    warm-up as long as the run; nothing for sizes that make sense."""
    common.size_warnings(64, "--batch-size", 10, 1, 5, 5)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "warning: --batch-size 64 is more than the 10 records the data holds: a step repeats some",
        "warning: the held-out set is one record: its metrics say little",
        "warning: --warmup-steps 5 >= the 5 steps that train: the learning rate never reaches --lr",
    ]
    common.size_warnings(8, "--batch-size", 10, 4, 2, 5)
    assert capsys.readouterr().out == ""


def test_the_warm_up_warning_counts_steps_that_exist(capsys):
    """PPO's actor trains after the critic warm-up: --max-steps 1 under --critic-warmup-steps 5 says the actor never
    trains (it said "the -4 steps that warm up"), a longer run counts the actor's own steps."""
    common.size_warnings(8, "--rollout-batch-size", 64, None, 5, 1, delay=5)
    warned = "warning: --critic-warmup-steps 5 covers the whole run (1 step): the actor never trains"
    assert capsys.readouterr().out.splitlines() == [warned]
    common.size_warnings(8, "--rollout-batch-size", 64, None, 5, 9, delay=5)
    warned = "warning: --warmup-steps 5 >= the 4 steps that train after --critic-warmup-steps 5: the learning rate"
    assert capsys.readouterr().out.splitlines() == [warned + " never reaches --lr"]
    common.size_warnings(8, "--rollout-batch-size", 64, None, 5, 11, delay=5)
    assert capsys.readouterr().out == ""


def test_samples_show_a_conversations_last_user_message():
    """A conversation's sample is its last user message and the answer, not the rendered template with a default
    system turn; a plain-text prompt stays as it is."""
    conversation = [
        {"role": "system", "content": "You are a helpful AI assistant named SmolLM"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    shown = common.shown_prompt(conversation)
    assert common.format_sample(shown, "4.", True) == "user: What is 2+2?\nassistant: 4."
    assert common.format_sample(common.shown_prompt("Review of X (plot):"), " Dull.", False) == (
        "Review of X (plot): Dull. [no EOS]"
    )


def test_the_stop_message_gives_the_whole_command_to_continue():
    """After a signal's save: the command that continues the run, the script's own flags without --overwrite, its
    --out-dir (added when the default was used) and --resume, quoted for a shell."""
    argv = ["/repo/train_ppo.py", "--rl-flags", "--kl-coef 0.1", "--overwrite", "--max-steps", "9"]
    assert common.resume_command("out/ppo/ckpt.pt", argv) == (
        "python train_ppo.py --rl-flags '--kl-coef 0.1' --max-steps 9 --out-dir out/ppo --resume"
    )
    argv = ["train_sft.py", "--out-dir=runs/a", "--resume"]
    assert common.resume_command("runs/a/ckpt.pt", argv) == "python train_sft.py --out-dir=runs/a --resume"


# -----------------------------------------------------------------------------
# stopping on a signal (docs/design.md §8): common.StopSignal's handlers


def stop_handlers() -> dict:
    return {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


def test_stop_signal_installs_its_handlers_and_close_puts_the_old_ones_back():
    """StopSignal() takes over SIGINT and SIGTERM (a stage must not die mid-step on Ctrl-C or a preemption), and
    close() puts back exactly the handlers from before (a stage's main() called twice in one process, as the tests
    do, must leave none of its own behind)."""
    before = stop_handlers()
    stop = common.StopSignal()
    try:
        assert stop_handlers() == {signum: stop._handle for signum in before}
        assert set(stop.previous) == set(before) and stop.requested(torch.device("cpu")) == 0
    finally:
        stop.close()
    after = stop_handlers()
    assert all(after[signum] is before[signum] for signum in before), (before, after)
    assert stop.previous == {}
    stop.close()  # a second close changes nothing
    assert stop_handlers() == before


def test_stop_signal_outside_the_main_thread_installs_nothing():
    """Python delivers signals to the main thread only, and signal.signal raises ValueError in any other: a stage's
    main() run from a thread must neither crash nor touch the process's handlers, and its close() is harmless."""
    before, seen = stop_handlers(), {}

    def build_and_close():
        try:
            stop = common.StopSignal()
            seen["previous"] = dict(stop.previous)
            seen["during"] = stop_handlers()
            stop.close()
            seen["requested"] = stop.requested(torch.device("cpu"))
        except Exception as e:  # a ValueError from signal.signal: the test fails on it below
            seen["error"] = e

    thread = threading.Thread(target=build_and_close)
    thread.start()
    thread.join()
    assert "error" not in seen, seen.get("error")
    assert seen["previous"] == {} and seen["during"] == before and seen["requested"] == 0
    assert stop_handlers() == before


def test_stop_signal_records_a_sigterm(capsys):
    """A SIGTERM delivered to the process reaches StopSignal's handler: requested() then returns its number (what a
    stage reads at the end of each step to save and exit 128 + 15), and one line says the run stops after this
    step. The handlers are restored whatever happens (a second signal would os._exit the test process)."""
    before = stop_handlers()
    stop = common.StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5.0
        while stop.signum == 0 and time.time() < deadline:  # the handler runs between bytecodes of the main thread
            time.sleep(0.01)
        assert stop.requested(torch.device("cpu")) == signal.SIGTERM
    finally:
        stop.close()
    assert stop_handlers() == before
    assert capsys.readouterr().out == "SIGTERM: stopping after this step to save it (again: stop at once)\n"


# -----------------------------------------------------------------------------
# `none` on the command line


def test_an_optional_flag_given_as_none_parses_to_none(monkeypatch):
    """`--cliprange none` reads like `--rm-ckpt none`: for an Optional field, `none` (as a separate value or after
    =) parses to None, as tyro's own `None` does; a flag that is not Optional keeps the string (--rm-ckpt none is the
    list ["none"]), and every flag spelled counts as given (the --resume rule)."""
    argv = ["train_ppo.py", "--cliprange", "none", "--max-steps=none", "--reward-clip", "None", "--rm-ckpt", "none"]
    monkeypatch.setattr(sys, "argv", argv)
    args = cli.parse(train_ppo.Args)
    assert (args.cliprange, args.max_steps, args.reward_clip) == (None, None, None)
    assert args.rm_ckpt == ["none"] and args.cliprange_value == 0.2  # untouched flags keep their defaults
    assert args.given == {"cliprange", "max_steps", "reward_clip", "rm_ckpt"}
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--cliprange", "0.1", "--export-hf", "none"])
    args = cli.parse(train_ppo.Args)
    assert args.cliprange == 0.1 and args.export_hf is None and args.given == {"cliprange", "export_hf"}


def test_none_as_a_literal_choice_is_kept(monkeypatch):
    """train_grpo.py's --reward-norm and --adv-whiten are Optional (None: the estimator's recipe) over Literals that
    include "none" (no normalisation, no whitening): `--reward-norm none` must mean the choice "none", not None,
    which resolve_args would replace by REINFORCE++'s "norm"."""
    argv = ["train_grpo.py", "--estimator", "reinforce_pp", "--reward-norm", "none", "--adv-whiten", "none"]
    monkeypatch.setattr(sys, "argv", argv)
    resolved = train_grpo.resolve_args(cli.parse(train_grpo.Args))
    assert (resolved.reward_norm, resolved.adv_whiten) == ("none", "none")


# -----------------------------------------------------------------------------
# user mistakes (docs/design.md §8): one line on stderr, exit 2, no traceback, no checkpoint written. The JSONL cases
# the stage tests already cover (test_sft.py, test_rm.py, test_data.py) are not repeated here.

SFT = (
    "train_sft.py --n-layer 1 --n-head 2 --n-embd 32 --max-steps 2 --batch-size 8 --micro-batch-size 4 "
    "--eval-every 2 --num-samples 4 --eval-samples 4 --max-new-tokens 8"
)
RM = (
    "train_rm.py --init {sft} --max-steps 2 --batch-size 8 --micro-batch-size 4 --eval-every 2 --eval-pairs 8 "
    "--probe-size 4 --calib-size 16"
)
ROLLOUT = (
    "--sft-ckpt {sft} --rm-ckpt {rm} --max-steps 1 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 "
    "--ptx-batch-size 4 --max-new-tokens 8"
)
PPO = "train_ppo.py " + ROLLOUT
GRPO = "train_grpo.py " + ROLLOUT
BAD_LINES = {  # file name: (a good first line, a bad second line)
    "sft_utf8.jsonl": (b'{"prompt": "a", "response": "b"}', b'{"prompt": "\xff", "response": "b"}'),
    "pairs_range.jsonl": (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}',
        b'{"prompt": "a", "responses": ["b", "c"], "ranking": [0, 2]}',
    ),
    "prompts_json.jsonl": (b'{"prompt": "a"}', b"{not json"),
    "text_type.jsonl": (b'{"text": "a b"}', b'{"text": 1}'),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, task_dir, tiny_ckpts):
    """Paths for the command templates: bad JSONL files, an RM on another tokenizer, a truncated checkpoint, and out
    dirs holding a checkpoint saved with world size 2."""
    w = tmp_path_factory.mktemp("mistakes")
    for name, lines in BAD_LINES.items():
        (w / name).write_bytes(b"\n".join(lines) + b"\n")
    (w / "empty.jsonl").write_text("")
    rm = torch.load(tiny_ckpts[1], weights_only=False)
    ranks = list(rm["tokenizer"]["ranks"])
    ranks[300], ranks[301] = ranks[301], ranks[300]  # the same size, two merges swapped: another tokenizer
    checkpoints.save_checkpoint(rm | {"tokenizer": {**rm["tokenizer"], "ranks": ranks}}, str(w / "rm_othertok.pt"))
    sft = torch.load(tiny_ckpts[0], weights_only=False)
    checkpoints.save_checkpoint(sft | {"tokenizer": {**sft["tokenizer"], "ranks": ranks}}, str(w / "sft_othertok.pt"))
    (w / "truncated.pt").write_bytes(open(tiny_ckpts[0], "rb").read()[:20000])
    from transformers import LlamaConfig, LlamaForCausalLM  # a model folder saved without its tokenizer

    config = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(str(w / "model_only"))
    for kind in ("sft", "rm", "ppo", "grpo"):
        checkpoints.save_checkpoint({"kind": kind, "model": {}, "world_size": 2}, str(w / f"ws_{kind}" / "ckpt.pt"))
    return dict(w=str(w), sft=tiny_ckpts[0], rm=tiny_ckpts[1], td=task_dir, tok=build_task(task_dir, 1337)["tokenizer"])


def command_line(cmd: str, files: dict, tmp_path) -> tuple[list, str]:
    """A template filled in, with --task-dir and (a stage's; eval.py writes no checkpoint) --out-dir appended, the
    template's own or a fresh folder: (argv, the checkpoint path a mistake must leave as it was)."""
    cmd = cmd.format(**files)
    out = re.search(r"--out-dir (\S+)", cmd)
    out = out.group(1) if out else str(tmp_path / "out")
    out_flag = "" if cmd.startswith("eval.py") else f" --out-dir {out}"
    return shlex.split(f"{cmd} --task-dir {files['td']}{out_flag}"), os.path.join(out, "ckpt.pt")


def read_bytes(path: str):
    return open(path, "rb").read() if os.path.exists(path) else None


@pytest.mark.parametrize(
    "cmd, message",
    [
        (SFT + " --data {w}/sft_utf8.jsonl --tokenizer {tok}", r"sft_utf8\.jsonl:2: not valid UTF-8"),
        (SFT + " --data {w}/empty.jsonl --tokenizer {tok}", r"empty\.jsonl: no records"),
        (SFT + " --init {w}/truncated.pt", r"--init .*truncated\.pt: not a readable checkpoint"),
        (SFT + " --resume", r"--resume .*ckpt\.pt: no checkpoint: "),
        (SFT + " --init hf:{w}/no_such_model", r"--init hf:.*no_such_model: no folder .*no_such_model here"),
        (SFT + " --init hf:{w}/model_only", r"model_only holds no tokenizer files \(tokenizer\.json, "),
        (SFT + " --init hf:no-such-org/no-such-model", r"could not load the tokenizer .*HF_HUB_OFFLINE=1 to skip"),
        (SFT + " --data {w}/nofile.jsonl", r"^error: --data .*nofile\.jsonl: no such file"),
        (SFT + " --resume --out-dir {w}/ws_sft", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
        (
            SFT + " --out-dir {w}/ws_sft",
            r"ws_sft/ckpt\.pt exists: pass --resume to continue that run, or --overwrite to",
        ),
        (
            RM + " --data {w}/pairs_range.jsonl",
            r"pairs_range\.jsonl:2: field 'ranking' must be a permutation of 0\.\.1",
        ),
        (RM + " --init {w}/sft_othertok.pt", r"--init .*sft_othertok\.pt: its tokenizer is not the built-in task's"),
        (RM + " --resume --out-dir {w}/ws_rm", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
        (RM + " --out-dir {w}/ws_rm", r"ws_rm/ckpt\.pt exists: pass --resume to continue that run, or --overwrite to"),
        (PPO + " --prompts {w}/prompts_json.jsonl", r"prompts_json\.jsonl:2: bad JSON"),
        (PPO + " --ptx-data {w}/text_type.jsonl", r"text_type\.jsonl:2: field 'text' must be a string, got int"),
        (PPO.replace("--rm-ckpt {rm}", "--rm-ckpt {sft}"), r"--rm-ckpt .*: is a 'sft' checkpoint, expected rm"),
        (PPO.replace("{rm}", "{w}/rm_othertok.pt"), r"--rm-ckpt .*rm_othertok\.pt: its tokenizer differs from"),
        (
            PPO + " --rollout-batch-size 10 --num-minibatches 4",
            r"--rollout-batch-size/world_size over --num-minibatches: "
            r"10 must divide by 4",
        ),
        (PPO + " --micro-batch-size 2 --ptx-batch-size 3", r"--ptx-batch-size over world_size \* accum steps: 3 must"),
        (PPO + " --resume", r"--resume .*ckpt\.pt: no checkpoint: "),
        (PPO + " --resume --out-dir {w}/ws_rm", r"--resume .*ckpt\.pt: is a 'rm' checkpoint, expected ppo"),
        (PPO + " --resume --out-dir {w}/ws_ppo", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
        (GRPO + " --prompts {w}/prompts_json.jsonl", r"prompts_json\.jsonl:2: bad JSON"),
        (GRPO.replace("--rm-ckpt {rm}", "--rm-ckpt {sft}"), r"--rm-ckpt .*: is a 'sft' checkpoint, expected rm"),
        (GRPO.replace("{rm}", "{w}/rm_othertok.pt"), r"--rm-ckpt .*rm_othertok\.pt: its tokenizer differs from"),
        (GRPO + " --group-size 3", r"--rollout-batch-size/world_size over --group-size: 8 must divide by 3"),
        (GRPO + " --resume", r"--resume .*ckpt\.pt: no checkpoint: "),
        (GRPO + " --resume --out-dir {w}/ws_ppo", r"--resume .*ckpt\.pt: is a 'ppo' checkpoint, expected grpo"),
        (GRPO + " --resume --out-dir {w}/ws_grpo", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
    ],
)
def test_user_mistake_is_one_line_exit_2(tmp_path, files, cmd, message, monkeypatch, capsys):
    """Each command line as `python <script>` runs it, in this process (HF_HUB_OFFLINE=1, as a fresh machine without
    network; test_every_script_exits_2_as_a_process runs a mistake of every script as its own process)."""
    offline(monkeypatch, tmp_path)
    argv, ckpt = command_line(cmd, files, tmp_path)
    before = read_bytes(ckpt)
    script, *flags = argv
    err = exits_2_with_one_line(script, flags, capsys, monkeypatch)
    assert re.search(message, err), err
    assert read_bytes(ckpt) == before  # no checkpoint written or changed


@pytest.mark.slow
@pytest.mark.parametrize(
    "cmd, message",
    [
        (SFT + " --data {w}/nofile.jsonl", r"^error: --data .*nofile\.jsonl: no such file"),
        (RM + " --data {w}/pairs_range.jsonl", r"pairs_range\.jsonl:2: field 'ranking' must be a permutation"),
        ("train_dpo.py --beta 0", r"^error: --beta 0: the KL strength must be > 0$"),
        (PPO + " --prompts {w}/prompts_json.jsonl", r"prompts_json\.jsonl:2: bad JSON"),
        (GRPO + " --kl-penalty reward --kl-estimator k3", r"--kl-estimator k3 in the reward: "),
        ("eval.py --temperature 0", r"^error: --temperature 0: kl and perplexity are measured at the sampling"),
    ],
)
def test_every_script_exits_2_as_a_process(tmp_path, files, cmd, message):
    """The same contract through each script's own __main__ (tyro, then common.run_main), as a process."""
    argv, ckpt = command_line(cmd, files, tmp_path)
    before = read_bytes(ckpt)
    r = run(shlex.join([sys.executable, *argv]), env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("error: ") and re.search(message, r.stderr.strip()), r.stderr
    assert read_bytes(ckpt) == before


@pytest.mark.slow
def test_resume_of_a_finished_run_is_a_user_error(tmp_path, task_dir):
    """It used to end in an UnboundLocalError traceback (no step ran, so no samples to print)."""
    args = train_sft.Args(
        out_dir=str(tmp_path),
        task_dir=task_dir,
        n_layer=1,
        n_head=2,
        n_embd=32,
        batch_size=8,
        micro_batch_size=4,
        max_steps=1,
        eval_every=1,
        num_samples=4,
        eval_samples=4,
        max_new_tokens=8,
    )
    train_sft.main(args)
    with pytest.raises(common.UserError, match=r"already at step 1 of 1 \(raise --max-steps\)"):
        train_sft.main(train_sft.Args(**{**args.__dict__, "resume": True}))


def help_options(script: str) -> tuple[str, list]:
    """`python <script> --help`: (its text, the option names in the order it lists them, as field names)."""
    r = run(f"{sys.executable} {script} --help", env={"COLUMNS": "200"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    names = []
    for line in r.stdout.splitlines():
        match = re.match(r"^ {4}(--[a-z][a-z0-9-]*)", line)  # an option's own line, not its description (8 spaces)
        if match and match.group(1) != "--help":
            names.append(match.group(1)[2:].replace("-", "_"))
    return r.stdout, names


def declaring_class(name: str, classes: tuple) -> int:
    """The index of the first class (the stage's Args, then its bases) that declares the field."""
    return next(i for i, klass in enumerate(classes) if name in klass.__dict__.get("__annotations__", {}))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, classes",
    [
        ("train_ppo.py", (train_ppo.Args, rollout.RolloutArgs, common.CommonArgs)),
        ("train_grpo.py", (train_grpo.Args, rollout.RolloutArgs, common.CommonArgs)),
        ("train_sft.py", (train_sft.Args, common.CommonArgs)),
    ],
)
def test_help_lists_the_stage_flags_first_and_points_at_no_code(script, classes):
    """--help: a stage's own flags (what to train from, the algorithm) first, then RolloutArgs' (what an RL stage
    starts from and samples), then the shared ones (--compile, --fsdp, --lora-*, ...), each group under its heading,
    every field once; help texts name values, not code (no "see RECIPES"): a None that takes the estimator's recipe
    names each estimator's value; --init lists hf:<name-or-path>."""
    text, names = help_options(script)
    fields = [f.name for f in dataclasses.fields(classes[0])]
    assert sorted(names) == sorted(fields), script  # every flag listed once
    groups = [declaring_class(name, classes) for name in names]
    assert groups == sorted(groups) and set(groups) == set(range(len(classes))), (script, list(zip(names, groups)))
    own = "--init" if script == "train_sft.py" else "--sft-ckpt"
    assert text.index(own) < text.index("--compile") < text.index("--fsdp"), script
    assert "ESTIMATOR_DEFAULTS" not in text and "RECIPES" not in text, script
    headings = [f"{script}'s own flags", "Flags both RL stages share", "Flags every stage shares"]
    headings = [heading for heading in headings if heading in text]
    assert len(headings) == len(classes) and headings == sorted(headings, key=text.index), script
    if script == "train_grpo.py":  # a None that means the recipe says so, with each estimator's value
        assert (
            "--group-size INT|None  (default: None: the recipe's, grpo 4, rloo 4, reinforce_pp 1, vineppo 1, rebel 2, "
            "distill 1)" in text
        )
    if script == "train_sft.py":
        assert "hf:<name-or-path>" in text.replace(" ", "").replace("\n", "")


# -----------------------------------------------------------------------------
# FLOPs of an RL iteration (perf/mfu)


def test_iteration_flops_against_a_hand_count():
    """perf/mfu's FLOP count of one iteration on a tiny config, counted by hand: per token a training pass is 6N
    plus 12*L*H*Q*T of attention (PaLM), a forward a third of it; with a critic (PPO-max) the RM's score forward is
    critic-sized, without one (the critic-free family) the RM's own."""
    config = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16)
    actor = GPT(GPTConfig(**config))
    critic = GPT(GPTConfig(**config, lm_head=False, score_head=True))
    reward_model = GPT(GPTConfig(**config, score_head=True))
    block = 12 * 16 * 16 + 9 * 16  # attention (qkv, proj) and MLP (fc, proj) weights plus their biases, per layer
    block += 4 * 16  # two layer norms
    trunk = 2 * block + 2 * 16  # blocks and ln_f (position embeddings are not counted)
    actor_n = trunk + 50 * 16  # the LM head (tied to wte) runs a matmul per token
    critic_n = trunk + 16 + 1  # the scalar head
    seq_len, sequences, epochs = 20, 8, 3
    attention = 12 * 2 * 2 * 8 * seq_len
    actor_per_token = 6 * actor_n + attention
    critic_per_token = 6 * critic_n + attention
    rollout_flops = (3 * actor_per_token + 2 * critic_per_token) / 3  # generation, old, ref; values, RM score
    update = epochs * (actor_per_token + critic_per_token)
    want = sequences * seq_len * (rollout_flops + update)
    assert actor.flops_per_token(seq_len) == actor_per_token
    models = Models(actor, actor, [reward_model])
    got = common.iteration_flops(models, seq_len, sequences, epochs, critic=critic)
    assert got == pytest.approx(want, rel=1e-12)
    # --rm-ckpt none: no RM forward
    without_rm = common.iteration_flops(Models(actor, actor, []), seq_len, sequences, epochs, critic=critic)
    assert want - without_rm == pytest.approx(sequences * seq_len * critic_per_token / 3, rel=1e-12)
    ensemble = common.iteration_flops(Models(actor, actor, [reward_model] * 3), seq_len, sequences, epochs, critic)
    assert ensemble - got == pytest.approx(2 * sequences * seq_len * critic_per_token / 3, rel=1e-12)  # a forward each
    # no critic: generation, old, ref and the RM's own forward (both heads), then the actor's passes alone
    rm_per_token = 6 * (trunk + 50 * 16 + 16 + 1) + attention
    critic_free = common.iteration_flops(models, seq_len, sequences, epochs)
    want = sequences * seq_len * ((3 * actor_per_token + rm_per_token) / 3 + epochs * actor_per_token)
    assert reward_model.flops_per_token(seq_len) == rm_per_token and critic_free == pytest.approx(want, rel=1e-12)


def test_an_unreachable_hub_means_offline_at_once(monkeypatch, tmp_path, capsys):
    """A hub name (hf:org/name) with no answer from the hub: HF_HUB_OFFLINE=1 before the load, so its error comes at
    once (offline it took 51 s of retries); a local folder, or a hub that answers, leaves the setting alone. No
    network: the connect is stubbed."""
    import types

    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def unreachable(address, timeout):
        calls.append(address)
        raise OSError("no route")

    monkeypatch.setattr(common.socket, "create_connection", unreachable)
    common.offline_unless_reachable(types.SimpleNamespace(init=f"hf:{tmp_path}", policy=["out/sft/ckpt.pt"]))
    assert calls == [] and "HF_HUB_OFFLINE" not in os.environ
    common.offline_unless_reachable(["hh", str(tmp_path / "out.jsonl")])  # data.py's main takes its argv
    assert calls == [] and "HF_HUB_OFFLINE" not in os.environ
    common.offline_unless_reachable(types.SimpleNamespace(init="scratch", policy=["hf:Qwen/Qwen2.5-0.5B"]))
    assert calls == [("huggingface.co", 443)] and os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE
    assert "hf:Qwen/Qwen2.5-0.5B from the local cache only (HF_HUB_OFFLINE=1)" in capsys.readouterr().out
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(common.socket, "create_connection", lambda address, timeout: types.SimpleNamespace(close=int))
    common.offline_unless_reachable(types.SimpleNamespace(init="hf:Qwen/Qwen2.5-0.5B"))
    assert "HF_HUB_OFFLINE" not in os.environ
