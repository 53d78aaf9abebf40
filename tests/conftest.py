import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from test_hf import gpt2_dir, llama_dir  # noqa: E402, F401  tiny Hugging Face model folders, shared with test_interop


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """The built-in task, built once per test session (it is deterministic and cached)."""
    from task import build_task

    d = str(tmp_path_factory.mktemp("data"))
    build_task(d, 1337)
    return d


@pytest.fixture(scope="session")
def tiny_ckpts(task_dir, tmp_path_factory):
    """(sft.pt, rm.pt): tiny random GPTs (1 layer, 32 wide) in the SFT and RM checkpoint layouts on the built-in
    task's tokenizer; for tests that need a checkpoint to start from but no trained weights (resume, user mistakes)."""
    from dataclasses import asdict

    import torch

    import checkpoints
    from data import load_tokenizer
    from model import GPT, GPTConfig
    from task import build_task

    tok, d, paths = load_tokenizer(build_task(task_dir, 1337)["tokenizer"]), tmp_path_factory.mktemp("tiny_ckpts"), []
    for seed, kind in enumerate(("sft", "rm")):
        torch.manual_seed(seed)
        cfg = GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, score_head=kind == "rm")
        paths.append(str(d / f"{kind}.pt"))
        checkpoints.save_checkpoint(
            dict(
                kind=kind,
                model=GPT(cfg).state_dict(),
                model_config=asdict(cfg),
                tokenizer=tok.state(),
                args={},
                step=0,
                optimizer={},
                scheduler={},
                rng=[],
                data_state={},
                world_size=1,
                seconds=0.0,
                score_offset=0.0,
            ),
            paths[-1],
        )
    return tuple(paths)
