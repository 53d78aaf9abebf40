"""The commands a reader runs first: every per-stage command of the README, in order, with tiny flags, from a scratch
working directory (and, fast, that each one's tiny flags parse for its stage); and `make demo TINY=1`, the whole
chain."""

import hashlib
import json
import os
import shlex
import shutil
import sys

import pytest
from conftest import ROOT, run

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
TINY_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 4 --eval-every 4 "
    "--num-samples 8 --eval-samples 8 --warmup-steps 1 --log-every 2 --max-new-tokens 32"
)


@pytest.fixture
def offline_gpt2(tmp_path, monkeypatch):
    """A tiny random GPT-2 folder (transformers) and tiktoken's GPT-2 ranks vendored in assets/, no network."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cache = tmp_path / "tiktoken"
    cache.mkdir()
    shutil.copy(os.path.join(ROOT, "assets", "gpt2.tiktoken"), cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    folder = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=128, vocab_size=50257)).save_pretrained(
        folder
    )
    return str(folder)


def readme_commands() -> list:
    """The per-stage commands of the README's 'Per-stage commands' block."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("Per-stage commands")[1].split("```bash")[1].split("```")[0]
    return [line.split("#")[0].strip() for line in block.strip().splitlines() if line.strip()]


README_TINY = {
    "train_sft.py": TINY_FLAGS,
    "train_rm.py": "--max-steps 4 --eval-every 4 --eval-pairs 32 --probe-size 8 --calib-size 32 --batch-size 8 "
    "--micro-batch-size 4 --warmup-steps 1 --log-every 2",
    "train_ppo.py": "--max-steps 3 --rollout-batch-size 8 --micro-batch-size 4 --critic-warmup-steps 1 "
    "--sample-every 2 --max-new-tokens 24 --warmup-steps 1 --log-every 1",
    "train_grpo.py": "--max-steps 3 --rollout-batch-size 8 --micro-batch-size 4 --sample-every 2 --max-new-tokens 24 "
    "--warmup-steps 1 --log-every 1",
    "train_dpo.py": "--max-steps 3 --batch-size 8 --micro-batch-size 4 --warmup-steps 1 --eval-every 3 --eval-pairs 16 "
    "--num-samples 8 --eval-samples 8 --max-new-tokens 16 --log-every 1",
    "eval.py": "--num-samples 16 --max-new-tokens 24",
}


def test_every_readme_command_has_tiny_flags_its_stage_parses(monkeypatch):
    """The fast half of test_readme_commands: each per-stage README command (train_grpo.py's included) maps to one
    script of README_TINY, and the command's own flags with the tiny ones appended parse as that stage parses its
    command line (a tiny flag the stage does not have, such as PPO's --critic-warmup-steps for train_grpo.py, would
    only fail in the slow run). The tiny flags really shrink the run (--max-steps, and eval's --num-samples)."""
    import tyro

    import cli
    import eval as ev
    import train_dpo
    import train_grpo
    import train_ppo
    import train_rm
    import train_sft

    stages = {
        "train_sft.py": train_sft.Args,
        "train_rm.py": train_rm.Args,
        "train_ppo.py": train_ppo.Args,
        "train_grpo.py": train_grpo.Args,
        "train_dpo.py": train_dpo.Args,
        "eval.py": ev.Args,
    }
    assert set(README_TINY) == set(stages)
    scripts = []
    for cmd in readme_commands():
        words = shlex.split(cmd)
        (script,) = [word for word in words if word in README_TINY]  # exactly one script, named as a word
        scripts.append(script)
        argv = words[words.index(script) + 1 :] + shlex.split(README_TINY[script])
        if script == "eval.py":  # eval.py parses with tyro itself
            args = tyro.cli(stages[script], args=argv)
            assert args.num_samples <= 16, cmd
        else:
            monkeypatch.setattr(sys, "argv", [script, *argv])
            args = cli.parse(stages[script])
            assert args.max_steps is not None and args.max_steps <= 4, cmd
    assert "train_grpo.py" in scripts and set(scripts) == set(stages)


@pytest.mark.slow
def test_readme_commands(tmp_path, task_dir, offline_gpt2):
    """Every per-stage README command runs, in order, with tiny flags, from a scratch working directory (so the
    default out/ paths chain the stages); gpt2 -> a tiny local GPT-2, my_*.jsonl -> generated files."""
    my_sft = tmp_path / "my_sft.jsonl"
    my_sft.write_text(
        "".join(json.dumps({"prompt": f"Q{i}: 2+{i}=", "response": f" {2 + i}"}) + "\n" for i in range(40))
    )
    cmds = readme_commands()
    assert any(c.startswith("torchrun") for c in cmds) and any("--init gpt2" in c for c in cmds)
    for cmd in cmds:
        script = next(s for s in README_TINY if s in cmd)
        cmd = cmd.replace("--init gpt2", f"--init {offline_gpt2}").replace("my_sft.jsonl", str(my_sft))
        cmd = cmd.replace("out/data/", f"{task_dir}/")  # the built-in task's files, where the tests keep them
        cmd = cmd.replace(script, os.path.join(ROOT, script)).replace("python ", f"{sys.executable} ", 1)
        cmd = cmd.replace("torchrun ", f"{sys.executable} -m torch.distributed.run ", 1)
        r = run(f"{cmd} {README_TINY[script]} --task-dir {task_dir}", cwd=tmp_path, one_thread=False)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    stages = ["sft", "sft_gpt2", "rm", "dpo", "ppo"] + ["grpo"] * any("train_grpo.py" in c for c in cmds)
    for stage in stages:
        assert os.path.exists(tmp_path / "out" / stage / "ckpt.pt"), stage
    assert set(json.load(open(tmp_path / "out" / "results.json"))) >= {"sft", "ppo"}


@pytest.mark.slow
def test_make_demo_tiny(tmp_path, task_dir):
    """`make demo TINY=1` (with this interpreter, outputs in a temp dir, the session's task as its data) runs and
    prints samples."""
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    r = run(
        f"make -o .venv/.installed demo TINY=1 PY={sys.executable} OUT={tmp_path}/out DATA={task_dir}",
        timeout=600,
        one_thread=False,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "sft done" in r.stdout and os.path.exists(tmp_path / "out" / "sft" / "ckpt.pt")
    assert "the table above means nothing. The real run: make demo" in r.stdout  # and what to run next
