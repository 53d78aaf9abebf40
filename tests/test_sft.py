"""Smoke tests of train_sft.py: in-process runs with tiny flags, the README's commands, user mistakes, DDP."""

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import train_sft
from model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(
    n_layer=1,
    n_head=2,
    n_embd=32,
    batch_size=8,
    micro_batch_size=4,
    max_steps=6,
    eval_every=3,
    num_samples=16,
    eval_samples=8,
    warmup_steps=2,
    log_every=2,
    max_new_tokens=48,
)
TINY_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 4 --max-steps 4 --eval-every 4 "
    "--num-samples 8 --eval-samples 8 --warmup-steps 1 --log-every 2 --max-new-tokens 32"
)
CKPT_KEYS = {
    "kind",
    "model",
    "model_config",
    "tokenizer",
    "args",
    "step",
    "optimizer",
    "scheduler",
    "rng",
    "data_state",
    "world_size",
    "seconds",
}
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


def read_scalars(out_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(out_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_sft_smoke(tmp_path, task_dir):
    out = str(tmp_path / "sft")
    train_sft.main(train_sft.Args(out_dir=out, task_dir=task_dir, **TINY))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert CKPT_KEYS <= set(ckpt) and ckpt["kind"] == "sft" and ckpt["step"] == 6 and ckpt["world_size"] == 1
    model = GPT.from_checkpoint(ckpt)
    assert model.config.n_layer == 1 and model.config.lm_head and not model.config.score_head
    json.dumps(ckpt["args"]), json.dumps(ckpt["tokenizer"])  # primitives only
    scalars = read_scalars(out)
    for tag in [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/skipped_steps",
        "perf/tokens_per_sec",
        "perf/mfu",
        "val/loss",
        "val/ppl",
        "val/valid_frac",
    ]:
        assert tag in scalars and all(math.isfinite(v) for v in scalars[tag]), tag
    assert scalars["train/loss"][-1] < scalars["train/loss"][0]
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 16 and {"prompt", "response", "ended", "valid"} <= set(samples[0])


def test_sft_masks_prompt_on_user_data(tmp_path, task_dir):
    """From a checkpoint on user data the prompt is masked: only response tokens + EOS are targets."""
    from data import encode_sft, load_tokenizer
    from task import build_task

    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    ((ex, mask),) = encode_sft(tok, [{"prompt": "Review of", "response": " the plot"}], 64, mask_prompt=True)[0]
    assert len(ex) == 5 and mask == [0, 0, 1, 1, 1]
    # the loss averages over targets only: changing a masked target changes nothing
    logits = torch.randn(1, 4, tok.vocab_size)
    x = torch.tensor([ex])
    m = torch.tensor([mask[1:]], dtype=torch.float)
    y2 = x[:, 1:].clone()
    y2[0, 0] = 7
    assert torch.allclose(train_sft.lm_loss(logits, x[:, 1:], m), train_sft.lm_loss(logits, y2, m))


def run(cmd: str, cwd=ROOT, env=None, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(shlex.split(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad\.jsonl:2: "),
        ('{"prompt": "a"}', r"bad\.jsonl:2: .*response"),
        ('{"prompt": 3, "response": "b"}', r"bad\.jsonl:2: .*prompt"),
    ],
)
def test_bad_sft_data_is_one_line_exit_2(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n' + line + "\n")
    r = run(f"{sys.executable} train_sft.py --data {bad} --tokenizer gpt2 --out-dir {tmp_path}/o")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert re.search(message, r.stderr), r.stderr
    assert not os.path.exists(tmp_path / "o" / "ckpt.pt")


def test_bad_flags_are_one_line_errors(tmp_path):
    for cmd, message in [
        (f"--init nonsense --out-dir {tmp_path}/o", "--init nonsense: expected"),
        (f"--init {tmp_path}/missing.pt", "no such checkpoint"),
        ("--batch-size 10 --micro-batch-size 4 --max-steps 1", "must divide by 4"),
    ]:
        r = run(f"{sys.executable} train_sft.py --task-dir {tmp_path}/data --out-dir {tmp_path}/o {cmd}")
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


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
    "train_dpo.py": "--max-steps 3 --batch-size 8 --micro-batch-size 4 --warmup-steps 1 --eval-every 3 --eval-pairs 16 "
    "--num-samples 8 --eval-samples 8 --max-new-tokens 16 --log-every 1",
    "eval.py": "--num-samples 16 --max-new-tokens 24",
}


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
        cmd = cmd.replace(script, os.path.join(ROOT, script)).replace("python ", f"{sys.executable} ", 1)
        cmd = cmd.replace("torchrun ", f"{sys.executable} -m torch.distributed.run ", 1)
        r = run(f"{cmd} {README_TINY[script]} --task-dir {task_dir}", cwd=tmp_path)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    for stage in ("sft", "sft_gpt2", "rm", "dpo", "ppo"):
        assert os.path.exists(tmp_path / "out" / stage / "ckpt.pt"), stage
    assert set(json.load(open(tmp_path / "out" / "results.json"))) >= {"sft", "ppo"}


def test_ddp_matches_single_process(tmp_path, task_dir):
    """2 ranks (gloo) with the same global batch end with the same weights as 1 process; the micro-batch only splits
    the work (1 process: 4 accumulation steps of 2; 2 ranks: --micro-batch-size 8 is capped at a rank's share, 4)."""
    flags = f"--task-dir {task_dir} {TINY_FLAGS} --max-steps 3 --batch-size 8"
    r1 = run(f"{sys.executable} train_sft.py {flags} --micro-batch-size 2 --out-dir {tmp_path}/one")
    r2 = run(
        f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 train_sft.py {flags} "
        f"--micro-batch-size 8 --out-dir {tmp_path}/two",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr[-2000:] + r2.stderr[-2000:]
    a = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert b["world_size"] == 2 and len(b["rng"]) == 2
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-4), k


def test_make_demo_tiny(tmp_path):
    """`make demo TINY=1` (with this interpreter, outputs in a temp dir) runs and prints samples."""
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    r = run(
        f"make -o .venv/.installed demo TINY=1 PY={sys.executable} OUT={tmp_path}/out DATA={tmp_path}/data", timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "sft done" in r.stdout and os.path.exists(tmp_path / "out" / "sft" / "ckpt.pt")


def hand_count_params(n_layer: int, n_embd: int, vocab_size: int) -> int:
    """Non-embedding weights of a GPT with biases, counted by hand: per block c_attn C·3C+3C, c_proj C·C+C, c_fc
    C·4C+4C, mlp c_proj 4C·C+C, two LayerNorms 2·2C; then ln_f 2C and the lm head V·C (tied to wte, counted once)."""
    C = n_embd
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C
    return n_layer * per_block + 2 * C + vocab_size * C


def test_flops_per_token_hand_count():
    """6 FLOPs per weight per token (forward 2, backward 4) plus attention 12·L·C·T (PaLM appendix B), counted by
    hand on a tiny config; FlopCounterMode on one training step agrees up to the bias and LayerNorm terms (it counts
    matmuls only; attention through the math kernel, whose matmuls it sees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from model import GPTConfig, lm_loss

    L, C, V, B, T = 2, 32, 50, 3, 9
    model = GPT(GPTConfig(vocab_size=V, n_layer=L, n_head=2, n_embd=C, block_size=16))
    examples = [([1] * (T + 1), [1] * (T + 1))] * B  # inputs are ids[:-1]: T tokens each
    assert train_sft.flops_per_token(model, examples) == 6 * hand_count_params(L, C, V) + 12 * L * C * T
    inputs, targets, target_mask = train_sft.collate(examples, pad_id=0)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits, _ = model(inputs)
        lm_loss(logits, targets, target_mask).backward()
    matmul_weights = L * 12 * C * C + V * C
    assert counter.get_total_flops() == B * T * (6 * matmul_weights + 12 * L * C * T)


def test_overwrite_and_resume(tmp_path, task_dir):
    """A fresh run into a folder with a checkpoint needs --overwrite (test_errors.py: the refusal), which clears the
    old event files and samples; --resume still continues."""
    out = tmp_path / "sft"
    args = train_sft.Args(out_dir=str(out), task_dir=task_dir, **{**TINY, "max_steps": 2, "eval_every": 2})
    train_sft.main(args)
    (old_events,) = [name for name in os.listdir(out) if name.startswith("events.out.tfevents.")]
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 99}\n')
    with pytest.raises(train_sft.UserError, match=r"ckpt\.pt exists: pass --resume to continue that run, or --over"):
        train_sft.main(args)
    train_sft.main(train_sft.Args(**{**args.__dict__, "overwrite": True}))
    events = [name for name in os.listdir(out) if name.startswith("events.out.tfevents.")]
    assert len(events) == 1 and events != [old_events]
    assert [json.loads(line)["step"] for line in open(out / "samples.jsonl")] == [2] * TINY["num_samples"]
    train_sft.main(train_sft.Args(**{**args.__dict__, "max_steps": 4, "resume": True}))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 4
    assert [json.loads(line)["step"] for line in open(out / "samples.jsonl")] == [2] * 16 + [4] * 16
