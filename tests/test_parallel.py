"""parallel.py and the GPU code path on CPU: all_reduce_dict over 2 gloo ranks; the RL updates of both
stages (train_ppo.ppo_update, train_grpo.grpo_update) over 2 ranks under DDP and FSDP2 equal one rank on the same
global batch, and reward moments merge across ranks; --fsdp under torchrun (the same weights as one process, an
exact resume after SIGKILL, full-weight checkpoints any later stage loads, every stage sharded); every stage under
bf16 autocast; the compiled training forward (inductor's CPU backend) against eager fp32. Compiling costs tens of
seconds per graph here, so the compiled tests use 1-layer models and one static shape each (docs/design.md §9)."""

import copy
import io
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import (
    ENV,
    ROOT,
    TORCHRUN,
    critic_free_experience,
    fake_experience,
    free_port,
    grpo_update_once,
    kill_process_tree,
    ppo_update_once,
    read_scalars,
    run,
    run_here,
)
from torch._dynamo.utils import counters

import hf
import parallel
import train_dpo
import train_grpo
import train_ppo
import train_rm
import train_sft
from task import build_task
from tokenizer import Tokenizer
from train_ppo import RunningMoments

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler"
)


def succeeds(cmd: str) -> None:
    result = run(cmd)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


# -----------------------------------------------------------------------------
# all_reduce_dict


def test_all_reduce_dict_one_process():
    sums = {"loss": torch.tensor(1.5), "tokens": 7, "accuracy": torch.tensor(0.25, dtype=torch.float64)}
    assert parallel.all_reduce_dict(sums, torch.device("cpu")) == {"loss": 1.5, "tokens": 7.0, "accuracy": 0.25}


# over 2 gloo ranks: in the ranks of test_two_gloo_ranks_equal_one_big_batch below (one spawn for both)


# -----------------------------------------------------------------------------
# the RL updates over 2 gloo ranks against one rank

# the critic-free updates checked over ranks: GRPO with the §5b flags on (per-sequence aggregation, KL in the loss,
# clip-higher, dual-clip, overlong filtering), REINFORCE++ (advantages whitened over the rollout's global statistics)
CRITIC_FREE = {
    "grpo": dict(estimator="grpo", cliprange_high=0.28, dual_clip=2.0, mask_truncated=True),
    "reinforce_pp": dict(estimator="reinforce_pp", mask_truncated=True),
    "rebel": dict(estimator="rebel", group_size=2),  # pairs of rows, the loss over the global pair count
}


def _two_rank_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sums = {"b": torch.tensor(float(rank + 1)), "a": 10.0 * (rank + 1)}
    reduced = parallel.all_reduce_dict(sums, torch.device("cpu"))
    updates = {wrap: updates_on_this_rank(rank, wrap) for wrap in ("ddp", "fsdp")}
    buf = io.BytesIO()  # plain bytes: tensors through a queue would need the worker alive to be received
    torch.save((reduced, updates), buf)
    q.put(buf.getvalue())
    dist.destroy_process_group()


def updates_on_this_rank(rank: int, wrap: str) -> tuple:
    """This rank's reward moments and its updates on its half of the experience, the models wrapped in DDP or FSDP2:
    (moments, PPO-max's stats, its actor's and critic's full weights, {critic-free name: (stats, full weights)})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    d = parallel.Dist(rank, rank, 2, torch.device("cpu"), True)

    def wrapped(model):  # DDP replicates (as the stages do), FSDP2 shards (blocks, then the root) as --fsdp does
        if wrap == "ddp":
            return DDP(model, gradient_as_bucket_view=True)
        return parallel.shard_model(model, d, torch.float32)

    def full_state(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def half(experience: dict) -> dict:
        return {key: value[rank * 4 : (rank + 1) * 4] for key, value in experience.items()}

    # reward moments: rank 0 sees 7 then 12 scores, rank 1 sees 3 then 1
    torch.manual_seed(0)
    data = [torch.randn(n, dtype=torch.float64) for n in (7, 3, 12, 1)]
    moments = RunningMoments()
    moments.update(data[rank])
    moments.update(data[2 + rank])
    # one PPO-max update on this rank's half of the experience
    actor, critic, exp = fake_experience()
    stats = ppo_update_once(wrapped(actor), wrapped(critic), half(exp), 2)
    # critic-free updates on this rank's half: sequence counts and lengths of the seq_mean weights, the whitening
    # statistics and the kept tokens are global
    free = {}
    for name, flags in CRITIC_FREE.items():
        free_actor, _, free_exp = fake_experience()
        free_stats = grpo_update_once(wrapped(free_actor), half(critic_free_experience(free_exp)), 2, **flags)
        free[name] = (free_stats, full_state(free_actor))
    return moments.state_dict(), stats, full_state(actor), full_state(critic), free


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_big_batch():
    """Reward moments merged across 2 ranks equal one big batch; the same global minibatch split over 2 ranks x 2
    micro-batches gives the 1-rank update (weights, losses, clip fractions, grad norms), for PPO-max's ppo_update
    (actor and critic) and for train_grpo's grpo_update (GRPO with the §5b flags on, REINFORCE++, REBEL); under DDP and
    under FSDP2 (--fsdp). The same two ranks check all_reduce_dict: the sums, in the caller's key order."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = [torch.load(io.BytesIO(q.get()), weights_only=False) for _ in range(2)]  # read before join: big pickles
    for p in procs:
        p.join(60)
    reduced = [reduced for reduced, _ in ranks]
    assert reduced == [{"b": 3.0, "a": 30.0}] * 2
    assert all(list(result) == ["b", "a"] for result in reduced)  # the caller's key order
    results = [updates[wrap] for _, updates in ranks for wrap in ("ddp", "fsdp")]
    torch.manual_seed(0)
    big = torch.cat([torch.randn(n, dtype=torch.float64) for n in (7, 3, 12, 1)])
    actor, critic, exp = fake_experience()
    want = ppo_update_once(actor, critic, exp, micro_batch_size=4)
    free_want = {}
    for name, flags in CRITIC_FREE.items():
        free_actor, _, free_exp = fake_experience()
        free_stats = grpo_update_once(free_actor, critic_free_experience(free_exp), 4, **flags)
        assert "value/loss" not in free_stats and free_stats["updates"] == 1, name
        free_want[name] = (free_stats, free_actor.state_dict())
    assert "policy/kl_loss" in free_want["grpo"][0]  # GRPO's KL is in the loss
    for moments, stats, actor_sd, critic_sd, free in results:
        for name, (free_stats, free_actor_sd) in free.items():
            wanted, wanted_sd = free_want[name]
            keys = ("policy/loss", "policy/kl_loss", "policy/approx_kl", "policy/clipfrac_low", "train/grad_norm")
            for k in (k for k in keys if k in wanted):
                assert free_stats[k] == pytest.approx(wanted[k], rel=1e-4, abs=1e-6), (name, k)
            for k, v in wanted_sd.items():
                assert torch.allclose(free_actor_sd[k], v, atol=1e-5), (name, k)
        rm = RunningMoments()
        rm.load_state_dict(moments)
        assert rm.count == 23 and rm.mean == pytest.approx(big.mean().item(), abs=1e-12)
        assert rm.std == pytest.approx(big.std(correction=0).item(), abs=1e-12)
        for k in (
            "policy/loss",
            "value/loss",
            "policy/approx_kl",
            "policy/clipfrac",
            "value/clipfrac",
            "train/grad_norm",
            "value/grad_norm",
        ):
            assert stats[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
        for mine, ref in ((actor_sd, actor.state_dict()), (critic_sd, critic.state_dict())):
            for k in ref:
                assert torch.allclose(mine[k], ref[k], atol=1e-5), k


# -----------------------------------------------------------------------------
# --fsdp (FSDP2 over 2 gloo ranks under torchrun)

SFT_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 2 --eval-every 40 --num-samples 8 "
    "--eval-samples 8 --log-every 5 --max-new-tokens 16 --warmup-steps 2"
)


def weights(path, key: str = "model") -> dict:
    return torch.load(path, weights_only=False)[key]


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


def loads_in_one_process(path) -> None:
    """A checkpoint of a sharded run holds full weights: it loads in this process, finite, any LoRA merged."""
    ckpt = torch.load(path, weights_only=False)
    model = hf.model_from_checkpoint(ckpt)
    assert all(torch.isfinite(p).all() for p in model.parameters()), path
    assert not any("lora_" in name for name in hf.merged_weights(ckpt)), path  # merged


@pytest.mark.slow
def test_sft_fsdp_equals_one_process_and_resumes_after_sigkill(tmp_path, task_dir):
    base = f"train_sft.py --task-dir {task_dir} {SFT_FLAGS} --max-steps 16"
    run_here(f"{sys.executable} {base} --out-dir {tmp_path}/single")
    succeeds(f"{TORCHRUN} {base} --fsdp --out-dir {tmp_path}/sharded")  # saving at the end only: the reference
    single, sharded = weights(tmp_path / "single" / "ckpt.pt"), weights(tmp_path / "sharded" / "ckpt.pt")
    assert_close(single, sharded, atol=1e-4)  # full weights in the checkpoint, whatever the sharding
    # SIGKILL torchrun and both workers mid-run, then --resume: the uninterrupted run's weights
    cmd = f"{TORCHRUN} {base} --fsdp --out-dir {tmp_path}/killed --save-every 1"
    process = subprocess.Popen(shlex.split(cmd), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = tmp_path / "killed" / "ckpt.pt"
    while process.poll() is None:
        try:
            if torch.load(ckpt, weights_only=False)["step"] >= 5:
                break
        except Exception:  # not written yet (it appears atomically)
            pass
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    kill_process_tree(process.pid)  # torchrun and both workers at once (they do not share its process group)
    process.wait()
    killed_at = torch.load(ckpt, weights_only=False)["step"]
    assert killed_at < 16
    succeeds(f"{cmd} --resume")
    resumed = torch.load(ckpt, weights_only=False)
    assert resumed["step"] == 16
    assert_close(resumed["model"], sharded, atol=1e-6)
    # the optimizer state: one shard per rank in a DCP folder beside ckpt.pt, the only one left (the older ones and
    # any the kill cut short are gone)
    folder = resumed["optimizer"]["dcp"]
    assert sorted(os.listdir(tmp_path / "killed" / folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [name for name in os.listdir(tmp_path / "killed") if name.endswith(".dcp")] == [folder]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", ["", "--lora-rank 4 --lora-targets c_attn wte --dtype bfloat16"], ids=["fp32", "lora_bf16"]
)
def test_every_stage_runs_sharded(tmp_path, task_dir, tiny_ckpts, extra):
    """RM, DPO and PPO (with a critic) under --fsdp on 2 ranks, full precision, and with LoRA under bf16 mixed
    precision (FSDP2's MixedPrecisionPolicy); each checkpoint loads in one process. The full-precision run also
    resumes PPO from its sharded optimizer states and refuses a checkpoint copied without them. train_grpo.py
    (critic-free) under --fsdp: the VinePPO and the multi-turn tests below, whose checkpoints load the same way."""
    sft, rm = tiny_ckpts
    pairs = "--batch-size 8 --micro-batch-size 2 --max-steps 3 --eval-every 3 --eval-pairs 8 --log-every 1"
    succeeds(
        f"{TORCHRUN} train_rm.py --task-dir {task_dir} --init {sft} --out-dir {tmp_path}/rm {pairs} --probe-size 4 "
        f"--calib-size 32 --fsdp {extra}"
    )
    succeeds(
        f"{TORCHRUN} train_dpo.py --task-dir {task_dir} --init {sft} --out-dir {tmp_path}/dpo {pairs} --num-samples 4 "
        f"--eval-samples 4 --max-new-tokens 8 --fsdp {extra}"
    )
    rl = (
        f"--task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} --max-steps 2 --rollout-batch-size 8 "
        "--num-minibatches 2 --micro-batch-size 2 --ptx-batch-size 4 --max-new-tokens 8 --warmup-steps 1 "
        f"--log-every 1 --sample-every 1 --fsdp {extra}"
    )
    ppo = f"{TORCHRUN} train_ppo.py {rl} --critic-warmup-steps 1"
    succeeds(f"{ppo} --out-dir {tmp_path}/gae")
    if not extra:  # resume does not depend on the precision or LoRA: checked once
        succeeds(
            f"{ppo} --out-dir {tmp_path}/gae --resume --max-steps 3"
        )  # both optimizers back from their DCP folders
        resumed = torch.load(tmp_path / "gae" / "ckpt.pt", weights_only=False)
        assert resumed["step"] == 3
        folders = sorted(name for name in os.listdir(tmp_path / "gae") if name.endswith(".dcp"))
        assert folders == sorted([resumed["optimizer"]["dcp"], resumed["critic_optimizer"]["dcp"]])
        shutil.rmtree(tmp_path / "gae" / resumed["critic_optimizer"]["dcp"])  # a checkpoint copied without its folders
        result = run(f"{ppo} --out-dir {tmp_path}/gae --resume --max-steps 4")
        assert (
            result.returncode != 0 and "the sharded optimizer state beside the checkpoint, is missing" in result.stderr
        )
    for stage in ("rm", "dpo", "gae"):
        loads_in_one_process(tmp_path / stage / "ckpt.pt")


def succeeds_within(cmd: str, seconds: float) -> None:
    """cmd exits 0 within seconds; one that hangs is killed with its workers (a timeout, not a stuck CI job)."""
    process = subprocess.Popen(shlex.split(cmd), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output = process.communicate(timeout=seconds)[0].decode()
    except subprocess.TimeoutExpired:
        kill_process_tree(process.pid)
        process.communicate()
        pytest.fail(f"no exit within {seconds} s (a hang): {cmd}")
    assert process.returncode == 0, output[-3000:]


@pytest.mark.slow
def test_vineppo_under_fsdp_with_states_that_differ_between_ranks(tmp_path, task_dir, tiny_ckpts):
    """VinePPO on 2 FSDP ranks whose responses have different numbers of steps, so each rank continues its own number
    of states: it hung at its first iteration (every scoring micro-batch an all-gather the other rank never joined).
    An odd global count of states proves the two ranks' differed."""
    sft, rm = tiny_ckpts
    ckpt = torch.load(sft, weights_only=False)
    eos_row = ckpt["model"]["transformer.wte.weight"][Tokenizer.from_state(ckpt["tokenizer"]).eos_id]
    ckpt["model"]["transformer.ln_f.bias"] += 2.0 * eos_row / eos_row.norm() ** 2  # ragged responses (boost_eos)
    torch.save(ckpt, tmp_path / "sft.pt")
    with open(build_task(task_dir, 1337)["prompts"]) as f:
        (tmp_path / "prompts.jsonl").write_text("".join(f.readlines()[:64]))
    cmd = (
        f"{TORCHRUN} train_grpo.py --sft-ckpt {tmp_path}/sft.pt --rm-ckpt {rm} --prompts {tmp_path}/prompts.jsonl "
        "--estimator vineppo --vine-k 2 --vine-chunk 1 --max-steps 2 --rollout-batch-size 8 --num-minibatches 2 "
        f"--micro-batch-size 2 --max-new-tokens 8 --warmup-steps 1 --log-every 1 --fsdp --out-dir {tmp_path}/vine"
    )
    succeeds_within(cmd, 120)
    states = [responses / 2 for responses in read_scalars(str(tmp_path / "vine"))["rollout/vine_responses"]]
    assert len(states) == 2 and any(count % 2 == 1 for count in states), states
    loads_in_one_process(tmp_path / "vine" / "ckpt.pt")  # single-turn train_grpo.py under --fsdp, an RM scoring


# an episode of 1 to 3 turns by its prompt's length: each rank's episodes end at their own turns
RAGGED_ENV = """
class Ragged:
    def __init__(self, row):
        self.turns, self.turn = 1 + len(row["prompt"]) % 3, 0

    def step(self, response, ended):
        self.turn += 1
        done = self.turn == self.turns
        return (None if done else " again"), len(response) / 10, done
"""


@pytest.mark.slow
def test_multiturn_grpo_and_ppo_under_fsdp_equal_ddp(tmp_path, task_dir, tiny_ckpts):
    """GRPO and PPO over episodes of 1 to 3 turns on 2 ranks: under --fsdp the whole episode loop runs inside one
    gather of the policy (no collective a turn), so ranks whose episodes end at different turns finish together, and
    the weights equal 2 DDP ranks' (atol 1e-5: the gradient's reduction order); each sharded checkpoint loads in one
    process."""
    (tmp_path / "ragged_env.py").write_text(RAGGED_ENV)
    sft, _ = tiny_ckpts
    rl = (
        f"--task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt none --env {tmp_path}/ragged_env.py:Ragged --max-turns 3 "
        "--max-steps 2 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 2 --ptx-batch-size 4 "
        "--max-new-tokens 6 --warmup-steps 1 --log-every 1"
    )
    stages = {"grpo": "train_grpo.py --estimator grpo --group-size 2", "ppo": "train_ppo.py --critic-warmup-steps 1"}
    for stage, script in stages.items():
        for wrap in ("", "--fsdp"):
            succeeds_within(f"{TORCHRUN} {script} {rl} {wrap} --out-dir {tmp_path}/{stage}{wrap}", 300)
        turns = read_scalars(str(tmp_path / f"{stage}--fsdp"))["episode/turns"]
        assert any(1 < value < 3 for value in turns), turns  # episodes of several lengths
        trained = weights(tmp_path / stage / "ckpt.pt")
        assert not torch.equal(trained["lm_head.weight"], weights(sft)["lm_head.weight"])  # the policy moved
        assert_close(trained, weights(tmp_path / f"{stage}--fsdp" / "ckpt.pt"), 1e-5)
        loads_in_one_process(tmp_path / f"{stage}--fsdp" / "ckpt.pt")
        if stage == "ppo":
            critic = weights(tmp_path / stage / "ckpt.pt", "critic")
            assert_close(critic, weights(tmp_path / f"{stage}--fsdp" / "ckpt.pt", "critic"), 1e-5)


# -----------------------------------------------------------------------------
# the GPU code path on CPU: bf16 autocast, the compiled training forward


def finite_checkpoint(path: str, key: str = "model") -> dict:
    ckpt = torch.load(path, weights_only=False)
    assert all(torch.isfinite(value).all() for value in ckpt[key].values())
    return ckpt


@pytest.mark.slow
def test_every_stage_runs_under_bf16_autocast(tmp_path, task_dir):
    """SFT (from scratch) -> RM, DPO -> PPO-max and GRPO, all with --dtype bfloat16 on CPU: the autocast path runs,
    every loss and weight stays finite, and SFT's first loss is within 2% of fp32's (bf16 keeps 8 bits of mantissa,
    ~0.4% per rounding; the loss is a mean over hundreds of tokens, so its error stays well inside 2%)."""
    sft = train_sft.Args(
        task_dir=task_dir,
        n_layer=1,
        n_head=2,
        n_embd=32,
        batch_size=8,
        micro_batch_size=4,
        max_steps=3,
        eval_every=3,
        num_samples=4,
        eval_samples=4,
        log_every=1,
        max_new_tokens=16,
        lr=3e-3,
    )
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = str(tmp_path / f"sft_{dtype}")
        train_sft.main(replace(sft, out_dir=out, dtype=dtype))
        losses[dtype] = read_scalars(out)["train/loss"]
        finite_checkpoint(os.path.join(out, "ckpt.pt"))
    assert losses["bfloat16"][0] == pytest.approx(losses["float32"][0], rel=2e-2)
    sft_ckpt = str(tmp_path / "sft_bfloat16" / "ckpt.pt")
    tiny_pairs = dict(batch_size=8, micro_batch_size=4, max_steps=3, eval_every=3, eval_pairs=8, log_every=1)
    train_rm.main(
        train_rm.Args(
            out_dir=str(tmp_path / "rm"),
            task_dir=task_dir,
            init=sft_ckpt,
            dtype="bfloat16",
            probe_size=4,
            calib_size=32,
            **tiny_pairs,
        )
    )
    rm_ckpt = str(tmp_path / "rm" / "ckpt.pt")
    finite_checkpoint(rm_ckpt)
    dpo = train_dpo.Args(
        out_dir=str(tmp_path / "dpo"),
        task_dir=task_dir,
        init=sft_ckpt,
        dtype="bfloat16",
        num_samples=4,
        eval_samples=4,
        max_new_tokens=16,
        **tiny_pairs,
    )
    train_dpo.main(dpo)
    finite_checkpoint(str(tmp_path / "dpo" / "ckpt.pt"))
    rl = dict(
        task_dir=task_dir,
        sft_ckpt=sft_ckpt,
        rm_ckpt=rm_ckpt,
        dtype="bfloat16",
        max_steps=2,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        ptx_batch_size=4,
        max_new_tokens=12,
        warmup_steps=1,
        log_every=1,
        sample_every=1,
        tis_cap=2.0,
    )
    for stage in ("ppo", "grpo"):
        out = str(tmp_path / stage)
        if stage == "ppo":
            train_ppo.main(train_ppo.Args(out_dir=out, critic_warmup_steps=0, **rl))
        else:
            train_grpo.main(train_grpo.Args(out_dir=out, estimator="grpo", **rl))
        finite_checkpoint(os.path.join(out, "ckpt.pt"))
        scalars = read_scalars(out)
        assert all(math.isfinite(value) for value in scalars["policy/loss"])
        # --tis-cap 2 under bf16: the sampler and the trainer disagree a little, the weights stay near 1
        assert all(0.5 < value <= 2.0 for value in scalars["policy/tis_weight_mean"])
        assert all(0.0 <= value < 0.5 for value in scalars["policy/tis_clipfrac"])


@pytest.mark.slow
@needs_compiler
def test_compiled_ppo_update_matches_eager():
    """One PPO update (actor and critic, one static micro-batch) through torch.compile's inductor CPU backend equals the
    eager one: statistics to 1e-4 relative and weights to 1e-5. Inductor fuses kernels and reorders fp32 reductions,
    which moves results by a few ulps (~1e-7 relative), and AdamW's first step is ±lr·sign(g) where g is not tiny."""
    actor, critic, exp = fake_experience()
    compiled_actor, compiled_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    eager = ppo_update_once(actor, critic, exp, micro_batch_size=8)
    torch._dynamo.reset()
    counters.clear()
    compiled_pair = (torch.compile(compiled_actor), torch.compile(compiled_critic))
    compiled = ppo_update_once(*compiled_pair, exp, micro_batch_size=8)
    assert counters["stats"]["unique_graphs"] > 0
    for name, value in eager.items():
        assert compiled[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for model, twin in ((actor, compiled_actor), (critic, compiled_critic)):
        for (name, weight), twin_weight in zip(model.state_dict().items(), twin.state_dict().values()):
            assert torch.allclose(weight, twin_weight, atol=1e-5), name


@pytest.mark.slow
@needs_compiler
def test_compiled_sft_matches_eager(tmp_path, task_dir):
    """train_sft.py --compile on (1 layer, two steps: a graph for the first batch's length, one dynamic-shape graph
    after that) against --compile off: the same losses to 1e-4 relative (the tolerance above) and finite weights."""
    sft = train_sft.Args(
        task_dir=task_dir,
        n_layer=1,
        n_head=2,
        n_embd=32,
        batch_size=4,
        micro_batch_size=4,
        max_steps=2,
        eval_every=2,
        num_samples=2,
        eval_samples=4,
        log_every=1,
        max_new_tokens=8,
    )
    losses = {}
    for setting in ("off", "on"):
        torch._dynamo.reset()
        counters.clear()
        out = str(tmp_path / setting)
        train_sft.main(replace(sft, out_dir=out, compile=setting))
        assert (counters["stats"]["unique_graphs"] > 0) == (setting == "on")  # dynamo compiled only when asked
        losses[setting] = read_scalars(out)["train/loss"]
        finite_checkpoint(os.path.join(out, "ckpt.pt"))
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-4)


@pytest.mark.slow
@needs_compiler
def test_compiled_ppo_compiles_each_call_once_whatever_the_lengths(tmp_path, task_dir, monkeypatch):
    """PPO with --compile on over iterations whose response lengths vary (a 1-layer policy whose EOS is likely): the
    training forward is compiled with dynamic shapes, so once every call signature has run (the rollout's no-grad
    passes, the critic's update, then the actor's and its ptx) the count of compiled frames stops growing and never
    reaches dynamo's recompile limit. With static shapes it recompiled at each new length: 8 frames in 8 iterations and
    the limit hit once (bench/recompiles.py, the code before this). The rollout's decode step compiles once too."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import recompiles

    sft, rm = recompiles.tiny_checkpoints(str(tmp_path), task_dir, eos_boost=4.0)
    frames, graphs, widths, errors = [], [], [], []  # per iteration: compiles so far, widths, log-prob errors
    real_rollout, real_take_rows = train_ppo.ppo_rollout, parallel.take_rows

    def counting_rollout(*args, **kwargs):
        frames.append(counters["frames"]["total"])
        graphs.append(counters["stats"]["unique_graphs"])
        widths.append(set())
        experience, metrics, samples = real_rollout(*args, **kwargs)
        errors.append(metrics["rollout/logprob_err"])  # the compiled decode's log-probs against the training forward
        return experience, metrics, samples

    def take_rows(batch, index, width=None):
        taken = real_take_rows(batch, index, width)
        if width is not None:  # a micro-batch: its prompts and responses, trimmed to its longest response
            widths[-1].add(taken["query"].size(1) + taken["response"].size(1))
        return taken

    monkeypatch.setattr(train_ppo, "ppo_rollout", counting_rollout)
    monkeypatch.setattr(parallel, "take_rows", take_rows)
    hits = recompiles.LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    torch._dynamo.reset()
    counters.clear()
    try:
        train_ppo.main(
            train_ppo.Args(
                out_dir=str(tmp_path / "ppo"),
                task_dir=task_dir,
                sft_ckpt=sft,
                rm_ckpt=[rm],
                compile="on",
                max_steps=5,
                rollout_batch_size=8,
                num_minibatches=2,
                micro_batch_size=2,
                ptx_batch_size=4,
                max_new_tokens=24,
                critic_warmup_steps=1,
                warmup_steps=1,
            )
        )
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
    total = counters["frames"]["total"]
    later = set().union(*widths[2:])
    assert len(later) >= 3 and not later <= widths[1], widths  # new lengths after every signature has compiled
    assert frames[2:] == [total] * 3 and graphs[2:] == [counters["stats"]["unique_graphs"]] * 3
    # one graph per frame (no graph break), plus the decode step's one graph (compiled_decode: fixed shapes, and these
    # prompts pad to one width)
    assert counters["stats"]["unique_graphs"] == total + 1
    # GPT.forward once per call signature: the actor, reference, RM and critic in the rollout (no grad), the critic's
    # and the actor's updates, ptx (no mask), + the decode step = 8; a sliced (non-contiguous) input was one more
    # each for the packed rows and ptx (14 frames before model.left_pack made its rows contiguous)
    assert total == 8, total
    assert total <= train_ppo.parallel.RECOMPILE_LIMIT and hits.hits == 0
    assert len(errors) == 5 and max(errors) < 1e-4, errors  # fp32: sampler and trainer agree


# -----------------------------------------------------------------------------
# a user's reward function that raises on one rank only

ONE_RANK_RAISES = """import os


def score(prompt, response, ended):
    if response and os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot score this")
    return 0.5
"""


@pytest.mark.slow
def test_a_reward_function_that_raises_on_one_rank_exits_2_on_both(tmp_path, task_dir, tiny_ckpts):
    """Rank 1's --reward-fn raises mid-run, rank 0's never: the ranks agree on it in one all-reduce after scoring, so
    both exit 2 at once (neither waits in the other's next collective), rank 0 prints the one line naming the function,
    its file and line, the prompt and the answer, and neither prints a traceback. The ranks are plain processes with
    torchrun's variables (torchrun would SIGTERM the second rank once the first exits)."""
    (tmp_path / "reward.py").write_text(ONE_RANK_RAISES)
    flags = (
        f"train_grpo.py --sft-ckpt {tiny_ckpts[0]} --rm-ckpt none --reward-fn {tmp_path}/reward.py:score --task-dir "
        f"{task_dir} --out-dir {tmp_path}/run --max-steps 2 --rollout-batch-size 8 --num-minibatches 2 "
        "--micro-batch-size 2 --max-new-tokens 8 --warmup-steps 1 --device cpu"
    )
    port = free_port()
    ranks = []
    for rank in range(2):
        env = ENV | dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env |= dict(MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        command = [sys.executable, *shlex.split(flags)]
        ranks.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outputs = [process.communicate(timeout=300) for process in ranks]
    finally:  # a rank left waiting on the other would hold gloo's 30-minute timeout
        for process in ranks:
            process.kill()
    errors = [err.decode() for _, err in outputs]
    assert [process.returncode for process in ranks] == [2, 2], errors
    assert errors[1] == "" and len(errors[0].splitlines()) == 1, errors
    head = f"error: --reward-fn {tmp_path}/reward.py:score raised ValueError (rank 1 cannot score this) at "
    assert errors[0].startswith(head + f"{tmp_path}/reward.py:6 on prompt '"), errors[0]
    assert "' answer '" in errors[0] and not (tmp_path / "run" / "ckpt.pt").exists()
