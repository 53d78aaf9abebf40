"""The GPU code path, run on CPU (issue #16): every stage a few steps under bf16 autocast, and the compiled training
forward (inductor's CPU backend) of SFT and of the PPO update against eager fp32. Compiling costs tens of seconds
per graph here, so the compiled tests use 1-layer models and one static shape each (DESIGN §9)."""

import copy
import logging
import math
import os
import shutil
from dataclasses import replace

import pytest
import torch
from test_ppo import fake_experience, read_scalars, update_once
from torch._dynamo.utils import counters

import train_dpo
import train_ppo
import train_rm
import train_sft

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler"
)


def finite_checkpoint(path: str, key: str = "model") -> dict:
    ckpt = torch.load(path, weights_only=False)
    assert all(torch.isfinite(value).all() for value in ckpt[key].values())
    return ckpt


def test_every_stage_runs_under_bf16_autocast(tmp_path, task_dir):
    """SFT (from scratch) -> RM, DPO -> PPO (gae and grpo), all with --dtype bfloat16 on CPU: the autocast path runs,
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
    for estimator in ("gae", "grpo"):
        out = str(tmp_path / f"ppo_{estimator}")
        train_ppo.main(
            train_ppo.Args(
                out_dir=out,
                task_dir=task_dir,
                sft_ckpt=sft_ckpt,
                rm_ckpt=rm_ckpt,
                adv_estimator=estimator,
                dtype="bfloat16",
                max_steps=2,
                rollout_batch_size=8,
                num_minibatches=2,
                micro_batch_size=4,
                ptx_batch_size=4,
                max_new_tokens=12,
                critic_warmup_steps=0,
                warmup_steps=1,
                log_every=1,
                sample_every=1,
                tis_cap=2.0,
            )
        )
        finite_checkpoint(os.path.join(out, "ckpt.pt"))
        scalars = read_scalars(out)
        assert all(math.isfinite(value) for value in scalars["policy/loss"])
        # --tis-cap 2 under bf16: the sampler and the trainer disagree a little, the weights stay near 1
        assert all(0.5 < value <= 2.0 for value in scalars["policy/tis_weight_mean"])
        assert all(0.0 <= value < 0.5 for value in scalars["policy/tis_clipfrac"])


@needs_compiler
def test_compiled_ppo_update_matches_eager():
    """One PPO update (actor and critic, one static micro-batch) through torch.compile's inductor CPU backend equals the
    eager one: statistics to 1e-4 relative and weights to 1e-5. Inductor fuses kernels and reorders fp32 reductions,
    which moves results by a few ulps (~1e-7 relative), and AdamW's first step is ±lr·sign(g) where g is not tiny."""
    actor, critic, exp = fake_experience()
    compiled_actor, compiled_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    eager = update_once(actor, critic, exp, micro_batch_size=8)
    torch._dynamo.reset()
    counters.clear()
    compiled = update_once(torch.compile(compiled_actor), torch.compile(compiled_critic), exp, micro_batch_size=8)
    assert counters["stats"]["unique_graphs"] > 0
    for name, value in eager.items():
        assert compiled[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for model, twin in ((actor, compiled_actor), (critic, compiled_critic)):
        for (name, weight), twin_weight in zip(model.state_dict().items(), twin.state_dict().values()):
            assert torch.allclose(weight, twin_weight, atol=1e-5), name


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


@needs_compiler
def test_compiled_ppo_compiles_each_call_once_whatever_the_lengths(tmp_path, task_dir, monkeypatch):
    """PPO with --compile on over iterations whose response lengths vary (a 1-layer policy whose EOS is likely): the
    training forward is compiled with dynamic shapes, so once every call signature has run (the rollout's no-grad
    passes, the critic's update, then the actor's and its ptx) the count of compiled frames stops growing and never
    reaches dynamo's recompile limit. With static shapes it recompiled at each new length: 8 frames in 8 iterations and
    the limit hit once (bench/recompiles.py, the code before this). The rollout's decode step compiles once too."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import recompiles

    sft, rm = recompiles.tiny_checkpoints(str(tmp_path), task_dir, eos_boost=4.0)
    frames, graphs, widths, errors = [], [], [], []  # per iteration: compiles so far, widths, log-prob errors
    real_rollout, real_take_rows = train_ppo.rollout, train_ppo.take_rows

    def rollout(*args, **kwargs):
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

    monkeypatch.setattr(train_ppo, "rollout", rollout)
    monkeypatch.setattr(train_ppo, "take_rows", take_rows)
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
    assert total <= train_ppo.parallel.RECOMPILE_LIMIT and hits.hits == 0
    assert len(errors) == 5 and max(errors) < 1e-4, errors  # fp32: sampler and trainer agree
