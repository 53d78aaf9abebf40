"""Fixtures and helpers the test modules share (a test module never imports another): the built-in task and tiny
checkpoints built once per session, ragged tensors for the math, tiny models and experiences for the RL updates,
event-file readers, the kill-and-resume harness, the in-process user-mistake check, and tiny Hugging Face folders.

Tiers (docs/design.md §9): a test marked `slow` is outside the fast tier (`make test-fast`: the math, the user errors
and one tiny in-process smoke run per stage)."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs one worker a core: one thread each, processes it starts too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2"  # 2 gloo ranks on CPU


# -----------------------------------------------------------------------------
# the built-in task and tiny checkpoints


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """The built-in task at its tiny sizes (task.TINY_SIZES: 1,000 records where the real one has 20,000), built once
    per session in the folder the stages read the real one from: every stage a test starts reads and encodes the
    task's files, a second a process at the real sizes."""
    from task import TASK_VERSION, build_task

    d = str(tmp_path_factory.mktemp("data"))
    tiny = build_task(d, 1337, tiny=True)
    os.rename(os.path.dirname(tiny["tokenizer"]), os.path.join(d, f"v{TASK_VERSION}-seed1337"))
    return d


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """The tiny built-in task's files (name -> path), for the data and task tests."""
    from task import build_task

    return build_task(str(tmp_path_factory.mktemp("tiny_data")), task_seed=1337, tiny=True)


@pytest.fixture(scope="session")
def task_tok(task_dir):
    """The built-in task's tokenizer."""
    from task import build_task
    from tokenizer import load_tokenizer

    return load_tokenizer(build_task(task_dir, 1337)["tokenizer"])


def checkpoint_dict(kind: str, model, tok, **extra) -> dict:
    """A checkpoint in our layout around a model's weights, with empty training state."""
    base = dict(
        kind=kind,
        model=model.state_dict(),
        model_config=asdict(model.config),
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
    return base | extra


@pytest.fixture(scope="session")
def tiny_ckpts(task_tok, tmp_path_factory):
    """(sft.pt, rm.pt): tiny random GPTs (1 layer, 32 wide) in the SFT and RM checkpoint layouts on the built-in
    task's tokenizer; for tests that need a checkpoint to start from but no trained weights (resume, user mistakes)."""
    import checkpoints
    from model import GPT, GPTConfig

    d, paths = tmp_path_factory.mktemp("tiny_ckpts"), []
    for seed, kind in enumerate(("sft", "rm")):
        torch.manual_seed(seed)
        cfg = GPTConfig(vocab_size=task_tok.vocab_size, n_layer=1, n_head=2, n_embd=32, score_head=kind == "rm")
        paths.append(str(d / f"{kind}.pt"))
        checkpoints.save_checkpoint(checkpoint_dict(kind, GPT(cfg), task_tok, score_offset=0.0), paths[-1])
    return tuple(paths)


@pytest.fixture(scope="session")
def tiny_rms(tmp_path_factory, tiny_ckpts):
    """Two RM checkpoints: the tiny RM and a copy with its head negated (an ensemble whose members disagree)."""
    import checkpoints

    rm = torch.load(tiny_ckpts[1], weights_only=False)
    other = {k: v.clone() for k, v in rm["model"].items()}
    other["score_head.weight"] = -other["score_head.weight"]
    path = str(tmp_path_factory.mktemp("rms") / "rm2.pt")
    checkpoints.save_checkpoint(rm | {"model": other}, path)
    return [tiny_ckpts[1], path]


# the RL stages' tiny in-process flags: a rollout of 8, 2 minibatches of 2 micro-batches, 2 epochs
TINY_RL = dict(
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=2,
    ppo_epochs=2,
    max_new_tokens=24,
    warmup_steps=1,
    log_every=1,
    sample_every=2,
)
TINY_PPO = TINY_RL | dict(critic_warmup_steps=1, collapse_window=2)


@pytest.fixture(scope="session")
def trained_sft(tmp_path_factory, task_dir):
    """A tiny SFT policy trained 5 steps on the built-in task (its responses hardly ever end)."""
    import train_sft

    out = str(tmp_path_factory.mktemp("sft"))
    train_sft.main(
        train_sft.Args(
            out_dir=out,
            task_dir=task_dir,
            n_layer=1,
            n_head=2,
            n_embd=32,
            batch_size=8,
            micro_batch_size=8,
            max_steps=5,
            eval_every=5,
            num_samples=8,
            eval_samples=8,
            warmup_steps=1,
            max_new_tokens=16,
        )
    )
    return os.path.join(out, "ckpt.pt")


@pytest.fixture(scope="session")
def grpo_ckpt(tmp_path_factory, task_dir, trained_sft):
    """A kind "grpo" checkpoint: train_grpo.py for one iteration on the gold reward from the tiny SFT policy."""
    import train_grpo

    out = str(tmp_path_factory.mktemp("grpo"))
    args = dict(out_dir=out, task_dir=task_dir, sft_ckpt=trained_sft, rm_ckpt="none", reward_fn="task:gold_reward")
    train_grpo.main(train_grpo.Args(**args, max_steps=1, **TINY_RL))
    return os.path.join(out, "ckpt.pt")


# -----------------------------------------------------------------------------
# ragged tensors for the math


def ragged(B: int = 6, T: int = 7, seed: int = 0):
    """Random (B, T) float64 tensors and a right-padded mask whose rows have lengths 1, T and random ones between."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, T] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    x = [torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(5)]
    return lengths, mask, x


def valid(x, lengths):
    """The valid entries of a right-padded (B, T) tensor, row by row."""
    return [v for b, n in enumerate(lengths) for v in x[b, :n].tolist()]


# -----------------------------------------------------------------------------
# tiny models and experiences for the rollout and the updates


def tiny_gpt(tok, seed: int, **kw):
    """A 1-layer GPT on tok's vocabulary, eval mode, its init from seed."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, **kw)).eval()


def boost_eos(model, eos_id: int, amount: float = 3.0):
    """Raise the EOS logit everywhere by shifting ln_f's bias along wte[eos] (the lm head is tied to wte)."""
    with torch.no_grad():
        w = model.transformer.wte.weight[eos_id]
        model.transformer.ln_f.bias += amount * w / w.norm() ** 2
    return model


def fake_experience(B: int = 8, seed: int = 0):
    """A tiny actor and critic and an experience dict with ragged responses (no tokenizer needed)."""
    from model import GPT, GPTConfig, logprobs_from_logits, response_forward

    torch.manual_seed(seed)
    cfg = dict(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=16)
    actor, critic = GPT(GPTConfig(**cfg)).eval(), GPT(GPTConfig(**cfg, lm_head=False, score_head=True)).eval()
    q_len, r_len = torch.randint(1, 5, (B,)), torch.randint(1, 7, (B,))
    q_len[0], r_len[0], r_len[1] = 4, 6, 1  # a full-width prompt, a full-length and a length-1 response
    query_mask = (torch.arange(4) >= 4 - q_len[:, None]).float()
    mask = (torch.arange(6) < r_len[:, None]).float()
    query = torch.randint(0, 50, (B, 4)).masked_fill(query_mask == 0, 50)
    response = torch.randint(0, 50, (B, 6)).masked_fill(mask == 0, 50)
    with torch.no_grad():
        logits, _ = response_forward(actor, query, query_mask, response, mask, 1.0)
        _, values = response_forward(critic, query, query_mask, response, mask, 1.0)
    exp = dict(
        query=query,
        query_mask=query_mask,
        response=response,
        attention_mask=mask,
        mask=mask,
        values=values * mask,
        logprobs=logprobs_from_logits(logits, response) * mask,
        advantages=torch.randn(B, 6) * mask,
        returns=torch.randn(B, 6) * mask,
    )
    return actor, critic, exp


def critic_free_experience(exp: dict) -> dict:
    """exp plus what a critic-free update reads: reference log-probs and which responses ended (rows 2 and 5 not)."""
    g = torch.Generator().manual_seed(1)
    ref_logprobs = (exp["logprobs"] + 0.3 * torch.randn(exp["mask"].shape, generator=g)) * exp["mask"]
    ended = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    return exp | {"ref_logprobs": ref_logprobs, "ended": ended}


def trained(name: str, model, grad_clip: float = 0.5, lr: float = 1e-2):
    """An update's Trained entry for a model, AdamW at lr."""
    from common import Trained

    return Trained(name, model, torch.optim.AdamW(model.parameters(), lr=lr), grad_clip=grad_clip)


def ppo_update_once(actor, critic, exp, micro_batch_size, **settings) -> dict:
    """One train_ppo.ppo_update over exp (one epoch, one minibatch, micro-batches of micro_batch_size rows) ->
    metrics | diagnostics."""
    import rollout
    import train_ppo

    args = train_ppo.Args(ppo_epochs=1, num_minibatches=1, temperature=1.0, micro_batch_size=micro_batch_size)
    args = replace(args, **settings)
    loop = rollout.Loop(torch.Generator().manual_seed(0), step=args.critic_warmup_steps)
    actor_entry, critic_entry = trained("model", actor), trained("critic", critic)
    metrics, diagnostics = train_ppo.ppo_update(
        actor_entry, critic_entry, exp, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
    )
    first_micro_batch = rollout.read_diagnostics(diagnostics["first_micro_batch"])  # on the host
    return metrics | diagnostics | {"first_micro_batch": first_micro_batch}


def grpo_update_once(actor, exp, micro_batch_size, **settings) -> dict:
    """One train_grpo.grpo_update over exp (one epoch, one minibatch, micro-batches of micro_batch_size rows,
    kl_coef 0.1 unless set) -> metrics | diagnostics."""
    import rollout
    import train_grpo

    settings = dict(kl_coef=0.1) | settings
    args = train_grpo.Args(ppo_epochs=1, num_minibatches=1, temperature=1.0, micro_batch_size=micro_batch_size)
    args = train_grpo.resolve_args(replace(args, **settings))
    loop = rollout.Loop(torch.Generator().manual_seed(0))
    metrics, diagnostics = train_grpo.grpo_update(
        trained("model", actor), exp, args, loop.step, loop.generator, loop.guard, loop.ptx_stream
    )
    first_micro_batch = rollout.read_diagnostics(diagnostics["first_micro_batch"])  # on the host
    return metrics | diagnostics | {"first_micro_batch": first_micro_batch}


# -----------------------------------------------------------------------------
# outputs: event files, processes


def read_events(out_dir: str) -> tuple[dict, dict]:
    """(every scalar tag -> its values in step order, the event files' tag lists by kind)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(out_dir, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in tags["scalars"]}, tags


def read_scalars(out_dir: str) -> dict:
    return read_events(out_dir)[0]


def run(
    cmd: str, cwd: str = ROOT, env=None, timeout: int = 600, one_thread: bool = True
) -> subprocess.CompletedProcess:
    """A command line as a process (unbuffered; one thread per process unless one_thread is False), its output
    captured."""
    env = {**(ENV if one_thread else os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(shlex.split(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, by id (read from /proc): a torchrun launcher and its
    workers, which do not share its process group."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_here(cmd: str) -> None:
    """`<python> <script> <flags>` (a command as kill_and_resume takes it) run to its end in this process, on one thread
    as ENV's processes: the uninterrupted run a killed one is compared with, without a process's start (about 3 s:
    torch, and torch._dynamo, which the first optimizer imports)."""
    import runpy

    _, script, *flags = shlex.split(cmd)
    argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [script, *flags]
    torch.set_num_threads(1)
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)


def one_and_two_ranks(script: str, flags: str, out_dir) -> None:
    """`script flags` to out_dir/two on 2 gloo ranks (torchrun, its own processes) and meanwhile to out_dir/one in this
    process (run_here): the pair a test of data parallelism compares."""
    two = f"{TORCHRUN} {script} {flags}"
    with open(os.path.join(out_dir, "two.err"), "w") as err:
        two_ranks = subprocess.Popen(
            shlex.split(f"{two} --out-dir {out_dir}/two"), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err
        )
        run_here(f"{sys.executable} {script} {flags} --out-dir {out_dir}/one")
        assert two_ranks.wait(timeout=300) == 0, open(os.path.join(out_dir, "two.err")).read()[-2000:]


def kill_and_resume(cmd: str, out_dir: str, min_step: int) -> None:
    """Start cmd, SIGKILL it once a checkpoint of step >= min_step exists (mid-step: saving is every step), resume."""
    proc = subprocess.Popen(shlex.split(cmd), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    while proc.poll() is None:
        try:
            if torch.load(ckpt, weights_only=False)["step"] >= min_step:
                break
        except Exception:  # not there yet (the file appears atomically, never half-written)
            pass
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(ckpt, weights_only=False)["step"]
    r = subprocess.run(shlex.split(cmd + " --resume"), cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ckpt} at step {killed_at}" in r.stdout


def assert_same_weights(a: str, b: str, key: str = "model") -> None:
    """Two checkpoints at the same step with the same trained weights: a LoRA checkpoint's adapters and heads (it
    keeps no merged copy), over the same base."""
    sa, sb = (torch.load(p, weights_only=False) for p in (a, b))
    assert sa["step"] == sb["step"]
    if key not in sa:
        assert sa["base"][key] == sb["base"][key]
        key = f"{key}_lora"
    for k in sa[key]:
        assert torch.allclose(sa[key][k], sb[key][k], atol=1e-5, rtol=0), k


def exits_2_with_one_line(script: str, argv: list, capsys, monkeypatch) -> str:
    """`python <script> <argv>` run in this process (runpy: its own __main__ block, the command line parsed from
    sys.argv): a user mistake exits 2 with one line on stderr, "error: ...", and no traceback (any other exception
    fails the test). Returns that line."""
    import runpy

    monkeypatch.setattr(sys, "argv", [script, *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith("error: "), err
    return err


def offline(monkeypatch, tmp_path) -> dict:
    """HF_HUB_OFFLINE=1 and an empty HF_HOME; huggingface_hub read both at import, so its constants follow."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf_home"
    home.mkdir()
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return env


# -----------------------------------------------------------------------------
# tiny Hugging Face folders: random Llama and GPT-2 weights widened to std 0.3 (greedy paths varied and peaked), a
# word-level tokenizer beside them, no network

HF_V = 97  # embedding rows of every tiny HF model; the tokenizer has 83 tokens (ids 0..82)
HF_EOS, HF_PAD = 1, 2  # the tokenizer's; HF_PAD lies inside the vocab, the tests also pad with ids outside it


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<pad>"] + [f"w{i}" for i in range(80)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    hf_tok.save_pretrained(path)


def write_model(path: str, config) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    write_tokenizer(path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    path = str(tmp_path_factory.mktemp("hf_llama"))
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=HF_V,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=HF_EOS,
        pad_token_id=HF_PAD,
    )
    write_model(path, cfg)
    return path


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> str:
    from transformers import GPT2Config

    path = str(tmp_path_factory.mktemp("hf_gpt2"))
    cfg = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=32,
        vocab_size=HF_V,
        n_positions=64,
        bos_token_id=HF_EOS,
        eos_token_id=HF_EOS,
        pad_token_id=HF_PAD,
    )
    write_model(path, cfg)
    return path


# the keys every stage's checkpoint holds (checkpoints.Run); each stage's tests add their own
RUN_KEYS = {
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


def write_jsonl(path, rows: list) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


HF_WORDS = [f"w{i}" for i in range(3, 83)]  # the test tokenizer's ordinary words (write_tokenizer)


@pytest.fixture(scope="session")
def user_data(tmp_path_factory) -> dict:
    """SFT, preference and prompt JSONL in the tiny word-level tokenizer's words."""
    d, g = tmp_path_factory.mktemp("user_data"), torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(HF_WORDS[i] for i in torch.randint(0, len(HF_WORDS), (n,), generator=g).tolist())

    prompts = [words(4) for _ in range(40)]
    return {
        "sft": write_jsonl(d / "sft.jsonl", [{"prompt": p, "response": " " + words(3)} for p in prompts]),
        "pairs": write_jsonl(
            d / "pairs.jsonl", [{"prompt": p, "chosen": " w10 w11", "rejected": " " + words(3)} for p in prompts]
        ),
        "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in prompts]),
    }


CHAIN_SFT = dict(
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
CHAIN_RM = dict(
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
CHAIN_PPO = dict(
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
    """SFT (from init) -> RM (from the SFT checkpoint, exported to hf_rm) -> PPO (SFT policy, RM score and critic,
    exported to hf_policy) on user data, all in-process; extra: flags every stage gets (--lora-rank, ...). Checks
    PPO's metrics; returns each stage's checkpoint."""
    import math

    import train_ppo
    import train_rm
    import train_sft

    out = {stage: str(tmp_path / stage) for stage in ("sft", "rm", "ppo")}
    ckpt = {stage: os.path.join(out[stage], "ckpt.pt") for stage in out}
    common_args = dict(task_dir=str(tmp_path / "data"), device="cpu", **extra)
    train_sft.main(train_sft.Args(out_dir=out["sft"], init=init, data=user_data["sft"], **common_args, **CHAIN_SFT))
    rm_args = dict(out_dir=out["rm"], init=ckpt["sft"], data=user_data["pairs"], export_hf=str(tmp_path / "hf_rm"))
    train_rm.main(train_rm.Args(**rm_args, **common_args, **CHAIN_RM))
    ppo_args = dict(out_dir=out["ppo"], sft_ckpt=ckpt["sft"], rm_ckpt=ckpt["rm"], prompts=user_data["prompts"])
    train_ppo.main(train_ppo.Args(**ppo_args, **common_args, **CHAIN_PPO, export_hf=str(tmp_path / "hf_policy")))
    scalars = read_scalars(out["ppo"])
    for tag in ("objective/score", "objective/kl", "value/loss", "rollout/response_len"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) for v in scalars[tag]), (tag, scalars.get(tag))
    assert len(scalars["policy/loss"]) == 1 and math.isfinite(scalars["policy/loss"][0])  # after the critic warm-up
    assert "objective/gold" not in scalars  # user prompts: no gold reward
    return {stage: torch.load(p, weights_only=False) for stage, p in ckpt.items()}
