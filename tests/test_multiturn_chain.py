"""make multiturn's chain (experiments/multiturn.py --tiny): SFT on the guessing game's episodes, PPO-max, GRPO and
RLOO on its environment, eval.py against the optimum; results.json's rows, and a second run resumes."""

import json
import sys

import pytest
from conftest import run


@pytest.mark.slow
def test_multiturn_chain_with_tiny_sizes(tmp_path):
    out = tmp_path / "out"
    command = (
        f"{sys.executable} experiments/multiturn.py --tiny --out-dir {out} --task-dir {tmp_path / 'data'} --seeds 1"
    )
    r = run(command, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.load(open(out / "results.json"))
    assert set(results) == {"sft", "ppo", "grpo", "rloo"}
    for row in results.values():
        for key in ("success", "turns", "kl", "episode/invalid", "tokens_per_turn"):
            assert row[key] is not None and f"{key}_se" in row, key
        assert row["success_optimum"] == 0.75 and row["turns_optimum"] == 3.45
        assert 0.49 < row["success_tilted"] <= 0.75 and row["num_samples"] == 64
    assert all(results[name]["episodes"] >= 32 for name in ("ppo", "grpo", "rloo"))
    assert "| optimum | 0.750 | 3.450 |" in r.stdout
    # finished runs are kept: the second run evaluates again and trains nothing
    again = run(command, timeout=600)
    assert again.returncode == 0 and "start ppo" not in again.stdout and "start sft" not in again.stdout
