"""Interop and scale (issue #6): the Anthropic-HH converter, the whole SFT -> RM -> PPO chain on a tiny random Llama
(`--init hf:<dir>`) and on a tiny random GPT-2 folder (native GPT) with both results exported and reloaded by
transformers, and PPO under 2 torchrun ranks. Tiny models written by the tests (test_hf's writers), no network."""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
from test_hf import EOS, PAD

import checkpoints
import common
import data
import task
import train_ppo
import train_rm
import train_sft
from hf import HFCausalLM, model_from_checkpoint
from lora import add_lora
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows: list) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def read_scalars(out_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(out_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# -----------------------------------------------------------------------------
# Anthropic-HH -> preference JSONL

H, A = "\n\nHuman:", "\n\nAssistant:"


def test_hh_to_pair():
    # multi-turn: the prompt is the whole shared dialogue up to and including the last "Assistant:"
    dialogue = f"{H} hi{A} hello!{H} how do I bake bread?{A}"
    pair = data.hh_to_pair(dialogue + " Knead, rest, bake.", dialogue + " No idea.")
    assert pair == {"prompt": dialogue, "chosen": " Knead, rest, bake.", "rejected": " No idea."}
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} a{A} no")["prompt"] == f"{H} a{A}"  # one turn
    # an earlier assistant turn inside the answers' shared prefix stays in the prompt, the answers only differ last
    assert data.hh_to_pair(f"{H} a{A} b{H} c{A} d", f"{H} a{A} b{H} c{A} e")["prompt"] == f"{H} a{A} b{H} c{A}"
    # skipped: the dialogues differ before the last turn, no assistant turn, an empty answer, the same answer
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} b{A} no") is None
    assert data.hh_to_pair(f"{H} a{A} b{H} c{A} d", f"{H} a{A} x{H} c{A} e") is None
    assert data.hh_to_pair(f"{H} a yes", f"{H} a no") is None
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} a{A}") is None
    assert data.hh_to_pair(f"{H} a{A}  \n", f"{H} a{A} no") is None
    assert data.hh_to_pair(f"{H} a{A} same", f"{H} a{A} same") is None


def hh_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "data.py", *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_convert_hh_cli(tmp_path):
    d1 = f"{H} what is 2+2?{A}"
    d2 = f"{H} hi{A} hello{H} tell me a joke{A}"
    records = [
        {"chosen": d1 + " 4", "rejected": d1 + " 5"},
        {"chosen": f"{H} a{A} b", "rejected": f"{H} c{A} d"},  # no shared prompt: skipped
        {"chosen": d2 + " Why did the chicken...", "rejected": d2 + ""},  # empty answer: skipped
        {"chosen": d2 + " A pun.", "rejected": d2 + " No.", "extra": 1},
    ]
    src, dst = write_jsonl(tmp_path / "hh.jsonl", records), tmp_path / "pairs.jsonl"
    r = hh_cli("hh", src, dst)
    assert (
        r.returncode == 0
        and r.stdout.strip() == f"wrote 2 pairs to {dst} (2 skipped: no shared prompt, an empty or a tied answer)"
    ), r.stdout + r.stderr
    pairs = data.read_jsonl(str(dst), "pairs")  # what train_rm.py --data reads
    assert pairs == [
        {"prompt": d1, "chosen": " 4", "rejected": " 5"},
        {"prompt": d2, "chosen": " A pun.", "rejected": " No."},
    ]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # written through a temp file and os.replace
    assert data.convert_hh(src, str(dst)) == (2, 2)
    # a bad line: one line on stderr, exit code 2 (like every stage), nothing written
    with open(src, "a") as f:
        f.write('{"chosen": "x", "rejected": 3}\n')
    os.remove(dst)
    r = hh_cli("hh", src, dst)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {src}:5: field 'rejected' must be a string") and not os.path.exists(dst)


GOOD = json.dumps({"chosen": f"{H} a{A} yes", "rejected": f"{H} a{A} no"}) + "\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (
            GOOD + '{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": 3}\n',
            r"hh\.jsonl:2: field 'rejected' must be a string, got int",
        ),
        (GOOD + '{"chosen": "x"}\n', r"hh\.jsonl:2: missing field 'rejected'"),
        (GOOD + "\n{not json\n", r"hh\.jsonl:3: bad JSON"),
        (GOOD + '["chosen", "rejected"]\n', r"hh\.jsonl:2: expected a JSON object"),
        (GOOD.encode() + b'{"chosen": "\xff"}\n', r"hh\.jsonl:2: not valid UTF-8"),
        ("\n", r"hh\.jsonl: no records"),
        (json.dumps({"chosen": f"{H} a{A} b", "rejected": f"{H} c{A} d"}) + "\n", r"hh\.jsonl: no usable record"),
    ],
)
def test_convert_hh_user_mistakes(tmp_path, content, message):
    src, dst = tmp_path / "hh.jsonl", tmp_path / "pairs.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(common.UserError, match=message):
        data._cli(["hh", str(src), str(dst)])
    assert not os.path.exists(dst)  # nothing written from a bad file


def test_convert_hh_usage_errors(tmp_path):
    for argv, message in [
        (["hh", str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")], "no such file"),
        (["hh", "in.jsonl"], "usage: python data.py hh"),
        (["sft", "in.jsonl", "out.jsonl"], "usage: python data.py hh"),
    ]:
        with pytest.raises(common.UserError, match=message):
            data._cli(argv)
    src = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": f"{H} a{A} yes", "rejected": f"{H} a{A} no"}])
    with pytest.raises(common.UserError, match="nowhere/pairs.jsonl: cannot write"):
        data._cli(["hh", src, str(tmp_path / "nowhere" / "pairs.jsonl")])


# -----------------------------------------------------------------------------
# the whole chain on Hugging Face models

WORDS = [f"w{i}" for i in range(3, 83)]  # the test tokenizer's ordinary words (test_hf.write_tokenizer)


@pytest.fixture(scope="module")
def user_data(tmp_path_factory) -> dict:
    """SFT, preference and prompt JSONL in the tiny word-level tokenizer's words."""
    d, g = tmp_path_factory.mktemp("user_data"), torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    prompts = [words(4) for _ in range(40)]
    return {
        "sft": write_jsonl(d / "sft.jsonl", [{"prompt": p, "response": " " + words(3)} for p in prompts]),
        "pairs": write_jsonl(
            d / "pairs.jsonl", [{"prompt": p, "chosen": " w10 w11", "rejected": " " + words(3)} for p in prompts]
        ),
        "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in prompts]),
    }


SFT = dict(
    batch_size=8,
    micro_batch_size=4,
    max_steps=3,
    eval_every=3,
    num_samples=4,
    eval_samples=4,
    warmup_steps=1,
    log_every=1,
    max_new_tokens=6,
    lr=1e-3,
)
RM = dict(
    batch_size=8,
    micro_batch_size=4,
    max_steps=3,
    eval_every=3,
    eval_pairs=8,
    calib_size=16,
    warmup_steps=1,
    log_every=1,
    lr=1e-3,
)
PPO = dict(
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=2,
    max_new_tokens=6,
    critic_warmup_steps=1,
    warmup_steps=1,
    log_every=1,
    sample_every=2,
    collapse_window=2,
    max_steps=2,
)


def run_chain(tmp_path, init: str, user_data: dict, **extra) -> dict:
    """SFT (from init) -> RM (from the SFT checkpoint) -> PPO (SFT policy, RM score and critic), all in-process;
    extra: flags every stage gets (--lora-rank, --grad-ckpt, ...)."""
    out = {stage: str(tmp_path / stage) for stage in ("sft", "rm", "ppo")}
    ckpt = {stage: os.path.join(out[stage], "ckpt.pt") for stage in out}
    common_args = dict(task_dir=str(tmp_path / "data"), device="cpu", **extra)
    train_sft.main(train_sft.Args(out_dir=out["sft"], init=init, data=user_data["sft"], **common_args, **SFT))
    train_rm.main(
        train_rm.Args(
            out_dir=out["rm"],
            init=ckpt["sft"],
            data=user_data["pairs"],
            **common_args,
            **RM,
            export_hf=str(tmp_path / "hf_rm"),
        )
    )
    train_ppo.main(
        train_ppo.Args(
            out_dir=out["ppo"],
            sft_ckpt=ckpt["sft"],
            rm_ckpt=ckpt["rm"],
            prompts=user_data["prompts"],
            **common_args,
            **PPO,
            export_hf=str(tmp_path / "hf_policy"),
        )
    )
    scalars = read_scalars(out["ppo"])
    for tag in ("objective/score", "objective/kl", "value/loss", "rollout/response_len"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) for v in scalars[tag]), (tag, scalars.get(tag))
    assert len(scalars["policy/loss"]) == 1 and math.isfinite(scalars["policy/loss"][0])  # after the critic warm-up
    assert "objective/gold" not in scalars  # user prompts: no gold reward
    return {stage: torch.load(p, weights_only=False) for stage, p in ckpt.items()}


def test_llama_chain_sft_rm_ppo(tmp_path, llama_dir, user_data):
    """`--init hf:<llama>` through SFT, RM and PPO: every checkpoint rebuilds the adapter model
    (hf.model_from_checkpoint dispatches on model_config's hf_config), and the PPO policy is no longer the SFT one."""
    ckpts = run_chain(tmp_path, f"hf:{llama_dir}", user_data)
    assert [ckpts[s]["kind"] for s in ("sft", "rm", "ppo")] == ["sft", "rm", "ppo"]
    for s in ("sft", "rm", "ppo"):
        assert ckpts[s]["model_config"]["hf_config"]["model_type"] == "llama", s
    sft, rm, policy = (model_from_checkpoint(ckpts[s]).eval() for s in ("sft", "rm", "ppo"))
    critic = model_from_checkpoint(ckpts["ppo"], key="critic").eval()
    assert all(isinstance(m, HFCausalLM) for m in (sft, rm, policy, critic))
    assert sft.score_head is None and rm.score_head is not None and rm.config.lm_head
    assert critic.score_head is not None and not critic.config.lm_head
    idx = torch.randint(3, 83, (2, 7))
    with torch.no_grad():
        assert (sft(idx)[0] - policy(idx)[0]).abs().max() > 0  # PPO moved the actor
        assert critic(idx)[0] is None and torch.isfinite(critic(idx)[1]).all()
    # the RM's calibration (folded into the head's bias) survives the round trip
    assert rm.score_head.bias.item() == pytest.approx(-ckpts["rm"]["score_offset"], abs=1e-3)


def test_llama_chain_with_lora_and_grad_ckpt(tmp_path, llama_dir, user_data):
    """--lora-rank and --grad-ckpt on the Hugging Face adapter through SFT, RM and PPO: adapters on q/k/v/o, the MLP
    projections and the (untied) token embedding, checkpoints with merged weights (plain adapter models load them)
    and the adapters beside them, and an export with the unmerged actor's logits."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
    ckpts = run_chain(
        tmp_path, f"hf:{llama_dir}", user_data, lora_rank=2, lora_alpha=4, lora_targets=targets, grad_ckpt=True
    )
    for stage in ("sft", "rm", "ppo"):
        adapters = ckpts[stage]["model_lora"]
        assert any(name.endswith("q_proj.lora_a") for name in adapters), stage
        assert any(name.endswith("embed_tokens.lora_b") for name in adapters), stage
        assert not any("lora_" in name for name in ckpts[stage]["model"]), stage
    assert any(name.endswith("lora_b") for name in ckpts["ppo"]["critic_lora"])
    sft, policy = (model_from_checkpoint(ckpts[s]).eval() for s in ("sft", "ppo"))
    idx = torch.randint(3, 83, (2, 7))
    with torch.no_grad():
        assert (sft(idx)[0] - policy(idx)[0]).abs().max() > 0  # the adapters moved the actor
    # the merged export against the unmerged actor: the SFT model (PPO's base) with PPO's adapters on it
    from transformers import AutoModelForCausalLM

    add_lora(sft, rank=2, alpha=4, targets=targets)
    sft.load_state_dict(ckpts["ppo"]["model_lora"], strict=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_policy").eval()
    assert exported.config.model_type == "llama"
    with torch.no_grad():
        assert (sft(idx)[0] - exported(idx).logits).abs().max() <= 1e-4


def test_gpt2_chain_then_export(tmp_path, gpt2_dir, user_data):
    """A GPT-2 folder (native GPT) through SFT, RM and PPO; the PPO policy and the RM that the stages exported with
    --export-hf load in transformers with the same logits and scores on padded batches."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ckpts = run_chain(tmp_path, gpt2_dir, user_data)
    policy, rm = GPT.from_checkpoint(ckpts["ppo"]).eval(), GPT.from_checkpoint(ckpts["rm"]).eval()
    assert type(policy) is GPT and type(rm) is GPT and rm.score_head.bias.item() != 0.0  # calibrated
    tok = data.Tokenizer.from_state(ckpts["ppo"]["tokenizer"])
    assert (tok.eos_id, tok.pad_id) == (EOS, PAD)
    hf_policy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_policy")).eval()
    hf_rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf_rm")).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 83, (n,), generator=g).tolist() + [tok.eos_id] for n in (4, 11, 7)]
    # the policy on a left-padded batch (position ids from the mask, as generation uses it)
    idx, mask = data.pad_left(seqs, tok.pad_id)
    with torch.no_grad():
        ours = policy(idx, mask)[0]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        theirs = hf_policy(input_ids=idx, attention_mask=mask.long(), position_ids=pos).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= 1e-4
    # the RM on a right-padded batch: ours at the EOS token, transformers' at the last non-pad token
    idx, mask = data.pad_right(seqs, tok.pad_id)
    lengths = mask.sum(1).long()
    with torch.no_grad():
        ours = rm(idx, mask)[1][torch.arange(len(seqs)), lengths - 1]
        theirs = hf_rm(input_ids=idx, attention_mask=mask.long()).logits.squeeze(-1)
    assert (ours - theirs).abs().max() <= 1e-4 and ours.abs().max() > 1e-3


# -----------------------------------------------------------------------------
# PPO under torchrun, 2 ranks (gloo on CPU)


def test_ppo_two_ranks_torchrun(tmp_path, task_dir):
    """train_ppo.py under torchrun with 2 CPU ranks (built-in task, ptx on, a tiny random SFT policy and RM) runs to the
    end: a checkpoint with both ranks' RNG states and finite metrics."""
    tok = data.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=64)
    base = dict(
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
    )
    sft, rm = str(tmp_path / "sft.pt"), str(tmp_path / "rm.pt")
    checkpoints.save_checkpoint(base | dict(kind="sft", model=GPT(cfg).state_dict()), sft)
    rm_model = GPT(GPTConfig(**{**asdict(cfg), "score_head": True}))
    checkpoints.save_checkpoint(base | dict(kind="rm", model=rm_model.state_dict(), score_offset=0.0), rm)
    out = tmp_path / "ppo"
    cmd = (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 train_ppo.py --task-dir "
        f"{task_dir} --sft-ckpt {sft} --rm-ckpt {rm} --out-dir {out} --max-steps 2 --rollout-batch-size 8 "
        "--num-minibatches 2 --micro-batch-size 2 --max-new-tokens 12 --critic-warmup-steps 1 --warmup-steps 1 "
        "--ptx-batch-size 4 --log-every 1 --sample-every 2 --collapse-window 2 --device cpu"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(shlex.split(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt["kind"] == "ppo" and ckpt["step"] == 2 and ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    scalars = read_scalars(str(out))
    for tag in ("objective/score", "objective/kl", "objective/gold", "value/loss"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) for v in scalars[tag]), tag
    for tag in ("policy/loss", "ptx/loss"):  # the actor trains after the 1-iteration critic warm-up
        assert len(scalars[tag]) == 1 and math.isfinite(scalars[tag][0]), tag
    assert scalars["train/updates"][-1] == 2 * 2  # 2 iterations x 2 minibatches x 1 epoch


def test_lora_resume_refuses_a_changed_base_folder(tmp_path, llama_dir, user_data):
    """A LoRA SFT run from a Hugging Face folder records the folder's fingerprint (it used to record no hash for a
    non-.pt --init): resuming after the folder's weights changed would load the adapters onto other weights, and is
    refused; the unchanged folder resumes."""
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "base")
    shutil.copytree(llama_dir, base)
    args = train_sft.Args(
        out_dir=str(tmp_path / "sft"),
        init=f"hf:{base}",
        data=user_data["sft"],
        task_dir=str(tmp_path / "data"),
        lora_rank=2,
        **(SFT | {"max_steps": 2}),
    )
    train_sft.main(args)
    assert torch.load(tmp_path / "sft" / "ckpt.pt", weights_only=False)["init_hash"] is not None
    resume = replace(args, resume=True, max_steps=3)
    hf_model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        hf_model.get_input_embeddings().weight.add_(0.01)
    hf_model.save_pretrained(base)
    with pytest.raises(common.UserError, match=r"--init hf:.*base changed since the run started"):
        train_sft.main(resume)
    shutil.rmtree(base)
    shutil.copytree(llama_dir, base)
    train_sft.main(resume)
    assert torch.load(tmp_path / "sft" / "ckpt.pt", weights_only=False)["step"] == 3
