import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import checkpoints
import common
import hf
import parallel
from common import LRSchedule, StepGuard, Trained, UserError, exact_div, guarded_step


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


def test_init_grammar_rejects_unknown():
    with pytest.raises(UserError, match="--init nonsense: expected"):
        hf.load_init("nonsense")


def test_peak_flops_measured_on_cpu():
    assert common.peak_flops(torch.device("cpu"), 123.0) == 123.0
    assert common.peak_flops(torch.device("cpu")) > 1e8


def test_all_reduce_dict_one_process():
    sums = {"loss": torch.tensor(1.5), "tokens": 7, "accuracy": torch.tensor(0.25, dtype=torch.float64)}
    assert parallel.all_reduce_dict(sums, torch.device("cpu")) == {"loss": 1.5, "tokens": 7.0, "accuracy": 0.25}


def _all_reduce_dict_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sums = {"b": torch.tensor(float(rank + 1)), "a": 10.0 * (rank + 1)}
    queue.put(parallel.all_reduce_dict(sums, torch.device("cpu")))
    dist.destroy_process_group()


def test_all_reduce_dict_two_gloo_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_all_reduce_dict_worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join(60)
    assert results == [{"b": 3.0, "a": 30.0}] * 2
    assert all(list(result) == ["b", "a"] for result in results)  # the caller's key order


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


def test_logger_console_keys(tmp_path, capsys):
    metrics = {"policy/loss": 0.5, "value/loss": 2.0, "objective/kl": 0.125, "perf/mfu": 0.25}
    logger = common.Logger(str(tmp_path / "all"), master=True)
    logger.log(3, metrics, max_steps=10)
    assert capsys.readouterr().out == "step 00003/00010 | policy/loss 0.5 | value/loss 2 | kl 0.125 | mfu 0.25\n"
    logger.close()
    logger = common.Logger(str(tmp_path / "some"), master=True, console_keys=("objective/kl", "nope", "policy/loss"))
    logger.log(3, metrics)
    assert capsys.readouterr().out == "step 00003 | kl 0.125 | loss 0.5\n"
    logger.close()


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
