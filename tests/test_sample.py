"""sample.py: a policy checkpoint answers prompts from the command line (--prompt repeated) and a prompts JSONL,
several answers a prompt, greedy at temperature 0 (the same answer each time), a conversational checkpoint rendering
a prompt string as the user's turn, and a missing prompt or a checkpoint without a policy as one line."""

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, checkpoint_dict, run

import checkpoints
import hf
import sample
from common import UserError
from task import build_task


def test_answers_every_prompt_given_and_greedy_answers_agree(tmp_path, trained_sft, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Review of The Silent River (plot):"}) + "\n")
    args = sample.Args(
        ckpt=trained_sft,
        prompt=["Review of The Silent River (music):", "Review of The Red Fox (acting, ending):"],
        prompts=str(prompts),
        answers=2,
        temperature=0.0,
        max_new_tokens=12,
    )
    answers = sample.main(args)
    assert [answer["prompt"] for answer in answers] == [
        p for p in args.prompt + ["Review of The Silent River (plot):"] for _ in range(2)
    ]
    assert all(answers[i]["response"] == answers[i + 1]["response"] for i in range(0, 6, 2))  # greedy: the same
    printed = capsys.readouterr().out
    assert printed.count("  -> ") == 6 and "Review of The Red Fox (acting, ending):" in printed
    sampled = sample.main(sample.Args(ckpt=trained_sft, prompt=["Review of"], answers=8, max_new_tokens=12, seed=3))
    assert len({answer["response"] for answer in sampled}) > 1  # sampled apart


def test_a_conversational_checkpoint_renders_the_prompt_as_the_users_turn(tmp_path, task_dir):
    folder = str(tmp_path / "chat")
    hf.write_tiny_chat_model(folder, build_task(task_dir, 1337)["tokenizer"])
    model, tok, _ = hf.load_init(f"hf:{folder}")
    assert tok.chat
    path = str(tmp_path / "sft.pt")
    checkpoints.save_checkpoint(checkpoint_dict("sft", model, tok), path)
    (answer,) = sample.main(sample.Args(ckpt=path, prompt=["hello there"], max_new_tokens=6, temperature=0.0))
    assert answer["prompt"] == tok.render_text([{"role": "user", "content": "hello there"}], True)


def test_mistakes_are_one_line(tmp_path, tiny_ckpts):
    with pytest.raises(UserError, match="nothing to answer: give --prompt TEXT"):
        sample.main(sample.Args(ckpt=tiny_ckpts[0]))
    with pytest.raises(UserError, match="is a 'rm' checkpoint, expected sft or dpo or ppo or grpo"):
        sample.main(sample.Args(ckpt=tiny_ckpts[1], prompt=["a"]))
    r = run(f"{sys.executable} {os.path.join(ROOT, 'sample.py')} --ckpt {tmp_path}/none.pt --prompt hi")
    assert r.returncode == 2 and r.stderr.startswith("error: --ckpt") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_sample_runs_compiled(trained_sft):
    """--compile on (inductor on CPU here; CUDA graphs on a GPU): the static-cache decode gives the eager answers."""
    settings = dict(ckpt=trained_sft, prompt=["Review of The Silent River (music):"], temperature=0.0, max_new_tokens=8)
    eager = sample.main(sample.Args(**settings, compile="off"))
    compiled = sample.main(sample.Args(**settings, compile="on"))
    assert [a["response"] for a in eager] == [a["response"] for a in compiled]
    torch._dynamo.reset()
