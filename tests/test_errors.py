"""User mistakes (DESIGN §8): each ends with one line on stderr, exit code 2, no traceback and no checkpoint written.
The JSONL cases the stage tests already cover (test_sft.py, test_rm.py) are not repeated here."""

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import checkpoints
import common
import train_sft
from task import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = (
    "train_sft.py --n-layer 1 --n-head 2 --n-embd 32 --max-steps 2 --batch-size 8 --micro-batch-size 4 "
    "--eval-every 2 --num-samples 4 --eval-samples 4 --max-new-tokens 8"
)
RM = (
    "train_rm.py --init {sft} --max-steps 2 --batch-size 8 --micro-batch-size 4 --eval-every 2 --eval-pairs 8 "
    "--probe-size 4 --calib-size 16"
)
PPO = (
    "train_ppo.py --sft-ckpt {sft} --rm-ckpt {rm} --max-steps 1 --rollout-batch-size 8 --num-minibatches 2 "
    "--micro-batch-size 4 --ptx-batch-size 4 --max-new-tokens 8"
)
BAD_LINES = {  # file name: (a good first line, a bad second line)
    "sft_utf8.jsonl": (b'{"prompt": "a", "response": "b"}', b'{"prompt": "\xff", "response": "b"}'),
    "pairs_range.jsonl": (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}',
        b'{"prompt": "a", "responses": ["b", "c"], "ranking": [0, 2]}',
    ),
    "prompts_json.jsonl": (b'{"prompt": "a"}', b"{not json"),
    "text_type.jsonl": (b'{"text": "a b"}', b'{"text": 1}'),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, task_dir, tiny_ckpts):
    """Paths for the command templates: bad JSONL files, an RM on another tokenizer, a truncated checkpoint, and out
    dirs holding a checkpoint saved with world size 2."""
    w = tmp_path_factory.mktemp("mistakes")
    for name, lines in BAD_LINES.items():
        (w / name).write_bytes(b"\n".join(lines) + b"\n")
    (w / "empty.jsonl").write_text("")
    rm = torch.load(tiny_ckpts[1], weights_only=False)
    ranks = list(rm["tokenizer"]["ranks"])
    ranks[300], ranks[301] = ranks[301], ranks[300]  # the same size, two merges swapped: another tokenizer
    checkpoints.save_checkpoint(rm | {"tokenizer": {**rm["tokenizer"], "ranks": ranks}}, str(w / "rm_othertok.pt"))
    sft = torch.load(tiny_ckpts[0], weights_only=False)
    checkpoints.save_checkpoint(sft | {"tokenizer": {**sft["tokenizer"], "ranks": ranks}}, str(w / "sft_othertok.pt"))
    (w / "truncated.pt").write_bytes(open(tiny_ckpts[0], "rb").read()[:20000])
    from transformers import LlamaConfig, LlamaForCausalLM  # a model folder saved without its tokenizer

    config = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(str(w / "model_only"))
    for kind in ("sft", "rm", "ppo"):
        checkpoints.save_checkpoint({"kind": kind, "model": {}, "world_size": 2}, str(w / f"ws_{kind}" / "ckpt.pt"))
    return dict(w=str(w), sft=tiny_ckpts[0], rm=tiny_ckpts[1], td=task_dir, tok=build_task(task_dir, 1337)["tokenizer"])


@pytest.mark.parametrize(
    "cmd, message",
    [
        (SFT + " --data {w}/sft_utf8.jsonl --tokenizer {tok}", r"sft_utf8\.jsonl:2: not valid UTF-8"),
        (SFT + " --data {w}/empty.jsonl --tokenizer {tok}", r"empty\.jsonl: no records"),
        (SFT + " --init {w}/truncated.pt", r"--init .*truncated\.pt: not a readable checkpoint"),
        (SFT + " --resume", r"--resume .*ckpt\.pt: no such checkpoint"),
        (SFT + " --init hf:{w}/no_such_model", r"--init hf:.*no_such_model: .*no_such_model: no such folder"),
        (SFT + " --init hf:{w}/model_only", r"model_only holds no tokenizer files \(tokenizer\.json, "),
        (SFT + " --init hf:no-such-org/no-such-model", r"could not load the tokenizer .*HF_HUB_OFFLINE=1 to skip"),
        (SFT + " --data {w}/nofile.jsonl", r"^error: --data .*nofile\.jsonl: no such file"),
        (SFT + " --resume --out-dir {w}/ws_sft", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
        (
            SFT + " --out-dir {w}/ws_sft",
            r"ws_sft/ckpt\.pt exists: pass --resume to continue that run, or --overwrite to",
        ),
        (
            RM + " --data {w}/pairs_range.jsonl",
            r"pairs_range\.jsonl:2: field 'ranking' must be a permutation of 0\.\.1",
        ),
        (RM + " --init {w}/sft_othertok.pt", r"--init .*sft_othertok\.pt: its tokenizer is not the built-in task's"),
        (RM + " --resume --out-dir {w}/ws_rm", r"--resume .*ckpt\.pt: saved with world size 2, now 1"),
        (RM + " --out-dir {w}/ws_rm", r"ws_rm/ckpt\.pt exists: pass --resume to continue that run, or --overwrite to"),
        (PPO + " --prompts {w}/prompts_json.jsonl", r"prompts_json\.jsonl:2: bad JSON"),
        (PPO + " --ptx-data {w}/text_type.jsonl", r"text_type\.jsonl:2: field 'text' must be a string, got int"),
        (PPO.replace("--rm-ckpt {rm}", "--rm-ckpt {sft}"), r"--rm-ckpt .*: is a 'sft' checkpoint, expected rm"),
        (PPO.replace("{rm}", "{w}/rm_othertok.pt"), r"--rm-ckpt .*rm_othertok\.pt: its tokenizer differs from"),
        (
            PPO + " --rollout-batch-size 10 --num-minibatches 4",
            r"--rollout-batch-size/world_size over --num-minibatches: "
            r"10 must divide by 4",
        ),
        (PPO + " --micro-batch-size 2 --ptx-batch-size 3", r"--ptx-batch-size over world_size \* accum steps: 3 must"),
        (PPO + " --resume", r"--resume .*ckpt\.pt: no such checkpoint"),
        (PPO + " --resume --out-dir {w}/ws_rm", r"--resume .*ckpt\.pt: is a 'rm' checkpoint, expected ppo"),
    ],
)
def test_user_mistake_is_one_line_exit_2(tmp_path, files, cmd, message):
    cmd = cmd.format(**files)
    out = re.search(r"--out-dir (\S+)", cmd)
    out = out.group(1) if out else str(tmp_path / "out")
    ckpt = os.path.join(out, "ckpt.pt")
    before = open(ckpt, "rb").read() if os.path.exists(ckpt) else None
    r = subprocess.run(
        shlex.split(f"{sys.executable} {cmd} --task-dir {files['td']} --out-dir {out}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("error: ") and re.search(message, r.stderr), r.stderr
    assert (open(ckpt, "rb").read() if os.path.exists(ckpt) else None) == before  # no checkpoint written or changed


def test_resume_of_a_finished_run_is_a_user_error(tmp_path, task_dir):
    """It used to end in an UnboundLocalError traceback (no step ran, so no samples to print)."""
    args = train_sft.Args(
        out_dir=str(tmp_path),
        task_dir=task_dir,
        n_layer=1,
        n_head=2,
        n_embd=32,
        batch_size=8,
        micro_batch_size=4,
        max_steps=1,
        eval_every=1,
        num_samples=4,
        eval_samples=4,
        max_new_tokens=8,
    )
    train_sft.main(args)
    with pytest.raises(common.UserError, match=r"already at step 1 of 1 \(raise --max-steps\)"):
        train_sft.main(train_sft.Args(**{**args.__dict__, "resume": True}))


def test_help_lists_the_stage_flags_first_and_points_at_no_code():
    """--help: a stage's own flags (what to train from, the algorithm) before the 19 shared ones (--compile, --fsdp,
    --lora-*, ...); help texts name values, not code (no "see ESTIMATOR_DEFAULTS"); --init lists hf:<name-or-path>."""
    for script, own in (("train_ppo.py", "--sft-ckpt"), ("train_sft.py", "--init")):
        r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.index(own) < r.stdout.index("--compile") < r.stdout.index("--fsdp"), script
        assert "ESTIMATOR_DEFAULTS" not in r.stdout, script
        if script == "train_sft.py":
            assert "hf:<name-or-path>" in r.stdout.replace("│", "").replace(" ", "").replace("\n", "")
