"""The pure parts of bench/gpu_check.sh's checks: decode.py --greedy-check's first divergence against a loop, its
verdict on a compiled decode made to differ (a failure, or a tie within --tie-margin), and rl_check.py's
kill-and-resume comparison of two checkpoints."""

import os
import sys

import torch
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import decode  # noqa: E402
import rl_check  # noqa: E402


def test_first_divergence_against_a_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        eager = torch.randint(0, 3, (4, 6), generator=g)
        compiled = torch.where(torch.rand(4, 6, generator=g) < 0.1, torch.randint(0, 3, (4, 6), generator=g), eager)
        # the earliest step first, then the lowest row
        expected = next(((r, s) for s in range(6) for r in range(4) if eager[r, s] != compiled[r, s]), None)
        assert decode.first_divergence(eager, compiled) == expected


def tiny_args(**kw) -> decode.Args:
    return decode.Args(layers=1, heads=2, dim=16, vocab=40, n_positions=32, prompt_len=4, resp_len=8, batch=3, **kw)


def check_with_a_flipped_token(monkeypatch, capsys, tie_margin: float) -> tuple[int, str]:
    """greedy_check of a tiny GPT whose 'compiled' decode is the eager one with row 1's step 5 changed."""
    real_generate = decode.generate

    def flipping_generate(*args, compiled: bool = False, **kw):
        tokens, masks, logprobs = real_generate(*args, compiled=False, **kw)
        if compiled:
            tokens = tokens.clone()
            tokens[1, 5] = (tokens[1, 5] + 1) % 40
        return tokens, masks, logprobs

    monkeypatch.setattr(decode, "generate", flipping_generate)
    args = tiny_args(tie_margin=tie_margin)
    torch.manual_seed(0)
    model = decode.build_model(args, torch.device("cpu")).eval()
    prompts = torch.randint(0, 40, (3, 4))
    code = decode.greedy_check(args, model, prompts, torch.ones_like(prompts), torch.float32)
    return code, capsys.readouterr().out


def test_greedy_check_fails_on_a_divergence_and_names_it(monkeypatch, capsys):
    code, out = check_with_a_flipped_token(monkeypatch, capsys, tie_margin=0.0)
    assert code == 1
    assert "row 1 step 5:" in out and "FAILS" in out
    assert out.strip().splitlines()[-1] == "greedy: rows_equal=2/3 ties=0 failures=1 first_divergence=row 1 step 5"


def test_greedy_check_counts_a_divergence_within_the_tie_margin(monkeypatch, capsys):
    code, out = check_with_a_flipped_token(monkeypatch, capsys, tie_margin=1e6)
    assert code == 0 and "a tie" in out
    assert out.strip().splitlines()[-1] == "greedy: rows_equal=2/3 ties=1 failures=0 first_divergence=row 1 step 5"


def test_compare_checkpoints_holds_tensors_bit_equal(tmp_path):
    model = {"a": torch.randn(3), "b": torch.randn(2, 2)}
    full = {"step": 3, "data_state": {"updates": 6}, "model": model}
    torch.save(full, tmp_path / "full.pt")
    torch.save(full | {"model": {k: v.clone() for k, v in model.items()}}, tmp_path / "same.pt")
    assert rl_check.compare_checkpoints(str(tmp_path / "full.pt"), str(tmp_path / "same.pt")) == (
        True,
        "step 3, 2/2 tensors equal",
    )
    nudged = {"a": model["a"], "b": model["b"] + torch.tensor([[0.0, 1e-7], [0.0, 0.0]])}
    torch.save(full | {"model": nudged}, tmp_path / "nudged.pt")
    equal, figures = rl_check.compare_checkpoints(str(tmp_path / "full.pt"), str(tmp_path / "nudged.pt"))
    assert not equal and "1/2 tensors equal" in figures and "in b" in figures
    torch.save(full | {"data_state": {"updates": 5}}, tmp_path / "fewer.pt")
    assert not rl_check.compare_checkpoints(str(tmp_path / "full.pt"), str(tmp_path / "fewer.pt"))[0]
