"""--fsdp (FSDP2 over 2 gloo ranks under torchrun, issue #16): the same weights as one process with the same global
batch, an exact resume after SIGKILL, full-weight checkpoints any later stage loads, and every stage runs sharded
(LoRA and the critic-free path included). The PPO update's equality with one rank is in test_ppo.py."""

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2"
SFT_FLAGS = (
    "--n-layer 1 --n-head 2 --n-embd 32 --batch-size 8 --micro-batch-size 2 --eval-every 40 --num-samples 8 "
    "--eval-samples 8 --log-every 5 --max-new-tokens 16 --warmup-steps 2"
)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


CAPTURE = dict(cwd=ROOT, capture_output=True, text=True, env=ENV)


def run(cmd: str) -> None:
    result = subprocess.run(shlex.split(cmd), **CAPTURE)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def weights(path, key: str = "model") -> dict:
    return torch.load(path, weights_only=False)[key]


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


def test_sft_fsdp_equals_one_process_and_resumes_after_sigkill(tmp_path, task_dir):
    base = f"train_sft.py --task-dir {task_dir} {SFT_FLAGS} --max-steps 30"
    run(f"{sys.executable} {base} --out-dir {tmp_path}/single")
    run(f"{TORCHRUN} {base} --fsdp --out-dir {tmp_path}/sharded --save-every 1")
    single, sharded = weights(tmp_path / "single" / "ckpt.pt"), weights(tmp_path / "sharded" / "ckpt.pt")
    assert_close(single, sharded, atol=1e-4)  # full weights in the checkpoint, whatever the sharding
    # SIGKILL the whole torchrun process group mid-run, then --resume: the uninterrupted run's weights
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
    # torchrun and both workers at once (the workers do not share torchrun's process group)
    subprocess.run(["pkill", "-KILL", "-f", f"{tmp_path}/killed"])
    process.wait()
    killed_at = torch.load(ckpt, weights_only=False)["step"]
    assert killed_at < 30
    run(f"{cmd} --resume")
    resumed = torch.load(ckpt, weights_only=False)
    assert resumed["step"] == 30
    assert_close(resumed["model"], sharded, atol=1e-6)
    # the optimizer state: one shard per rank in a DCP folder beside ckpt.pt, the only one left (the older ones and
    # any the kill cut short are gone)
    folder = resumed["optimizer"]["dcp"]
    assert sorted(os.listdir(tmp_path / "killed" / folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [name for name in os.listdir(tmp_path / "killed") if name.endswith(".dcp")] == [folder]


@pytest.mark.parametrize(
    "extra", ["", "--lora-rank 4 --lora-targets c_attn wte --dtype bfloat16"], ids=["fp32", "lora_bf16"]
)
def test_every_stage_runs_sharded(tmp_path, task_dir, tiny_ckpts, extra):
    """RM, DPO and PPO (gae, with a critic) under --fsdp on 2 ranks, full precision, and with LoRA under bf16 mixed
    precision (FSDP2's MixedPrecisionPolicy); each checkpoint loads in one process. The full-precision run also
    resumes PPO from its sharded optimizer states, refuses a checkpoint copied without them, and runs grpo
    (critic-free)."""
    sft, rm = tiny_ckpts
    pairs = "--batch-size 8 --micro-batch-size 2 --max-steps 3 --eval-every 3 --eval-pairs 8 --log-every 1"
    run(
        f"{TORCHRUN} train_rm.py --task-dir {task_dir} --init {sft} --out-dir {tmp_path}/rm {pairs} --probe-size 4 "
        f"--calib-size 32 --fsdp {extra}"
    )
    run(
        f"{TORCHRUN} train_dpo.py --task-dir {task_dir} --init {sft} --out-dir {tmp_path}/dpo {pairs} --num-samples 4 "
        f"--eval-samples 4 --max-new-tokens 8 --fsdp {extra}"
    )
    ppo = (
        f"{TORCHRUN} train_ppo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt {rm} --max-steps 2 "
        "--rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 2 --ptx-batch-size 4 --max-new-tokens 8 "
        f"--critic-warmup-steps 1 --warmup-steps 1 --log-every 1 --sample-every 1 --fsdp {extra}"
    )
    run(f"{ppo} --out-dir {tmp_path}/gae")
    if not extra:  # resume does not depend on the precision or LoRA: checked once
        run(f"{ppo} --out-dir {tmp_path}/gae --resume --max-steps 3")  # both optimizers back from their DCP folders
        resumed = torch.load(tmp_path / "gae" / "ckpt.pt", weights_only=False)
        assert resumed["step"] == 3
        folders = sorted(name for name in os.listdir(tmp_path / "gae") if name.endswith(".dcp"))
        assert folders == sorted([resumed["optimizer"]["dcp"], resumed["critic_optimizer"]["dcp"]])
        shutil.rmtree(tmp_path / "gae" / resumed["critic_optimizer"]["dcp"])  # a checkpoint copied without its folders
        result = subprocess.run(shlex.split(f"{ppo} --out-dir {tmp_path}/gae --resume --max-steps 4"), **CAPTURE)
        assert (
            result.returncode != 0 and "the sharded optimizer state beside the checkpoint, is missing" in result.stderr
        )
    stages = ["rm", "dpo", "gae"]
    if not extra:  # critic-free under --fsdp: once, at full precision
        run(f"{ppo} --out-dir {tmp_path}/grpo --adv-estimator grpo --group-size 2")
        stages.append("grpo")
    for stage in stages:
        ckpt = torch.load(tmp_path / stage / "ckpt.pt", weights_only=False)
        model = hf.model_from_checkpoint(ckpt)
        assert all(torch.isfinite(p).all() for p in model.parameters()), stage
        assert not any("lora_" in name for name in ckpt["model"]), stage  # merged
