import math
import os

import pytest
import torch

import common
import hf
from common import UserError, exact_div, lr_at


def test_exact_div():
    assert exact_div(64, 8, "x") == 8
    with pytest.raises(UserError, match="must divide by 3"):
        exact_div(64, 3, "--batch-size")


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay after warm-up
    assert lrs[100] == pytest.approx(0.1)  # floor at min_lr_ratio
    mid = 10 + 45
    assert lrs[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_atomic_save_and_load(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    common.save_checkpoint({"kind": "sft", "model": {"w": torch.ones(2)}}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind
    ck = common.load_checkpoint(path, kind="sft")
    assert torch.equal(ck["model"]["w"], torch.ones(2))
    with pytest.raises(UserError, match="is a 'sft' checkpoint, expected rm"):
        common.load_checkpoint(path, kind="rm", flag="--rm-ckpt")
    with pytest.raises(UserError, match="no such checkpoint"):
        common.load_checkpoint(str(tmp_path / "nope.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        common.load_checkpoint(str(tmp_path / "junk.pt"))


def test_rng_state_round_trip():
    g = torch.Generator().manual_seed(3)
    state = common.rng_state(g)
    a = (torch.rand(3), torch.rand(3, generator=g))
    common.set_rng_state(state, g)
    b = (torch.rand(3), torch.rand(3, generator=g))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_init_grammar_rejects_unknown():
    with pytest.raises(UserError, match="--init nonsense: expected"):
        hf.load_init("nonsense")


def test_peak_flops_measured_on_cpu():
    assert common.peak_flops(torch.device("cpu"), 123.0) == 123.0
    assert common.peak_flops(torch.device("cpu")) > 1e8
