"""Plumbing every stage shares: the user-error type, the shared flags, printing, seeding, the NaN-guarded optimizer
step, logging, the LR schedule, MFU, reward functions and environments. The command line is cli.py's.
"""

import ctypes
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist


class UserError(Exception):
    """A user mistake (bad data, flags or checkpoint): the message is one line; scripts print it and exit 2."""


@dataclass
class CommonArgs:
    """Flags every stage shares (docs/design.md §4)."""

    # --- run
    out_dir: str = "out"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    seed: int = 1337
    """run seed (init, data order, sampling); per-rank sampling seeds are seed*1000+rank"""
    task: str = "reviews"
    """the built-in task when no data is given: reviews (task.py, a continuous gold reward), arith (arith.py,
    addition with a verifier: gold is the accuracy), guess (guess.py, a multi-turn game: SFT, RL and eval only) or
    rg:NAME (rg.py, the reasoning-gym dataset NAME in chat, for a pretrained model: SFT, RL and eval only); keep it
    the same across stages, a checkpoint records it"""
    task_config: Optional[str] = None
    """--task rg:NAME: the generator's configuration, a JSON object such as '{"min_terms": 2, "max_terms": 3}' (None:
    reasoning-gym's defaults); a checkpoint records it, and a later stage takes it unless given"""
    task_seed: int = 1337
    """seed of the built-in task (grammar draws, splits, tokenizer); keep it the same across stages"""
    task_dir: str = "out/data"
    """where the built-in task's data and tokenizer are cached"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (auto: cuda if present, else cpu; under torchrun each rank takes cuda:LOCAL_RANK)"""
    dtype: str = "auto"
    """auto | float32 | bfloat16 (auto: bf16 autocast on GPU, fp32 on CPU)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the training forward (dynamic shapes) and, in PPO's rollouts, the one-token decode step (static
    KV caches; CUDA graphs on a GPU; not under --fsdp): auto = on CUDA only (on CPU it costs more than it saves), on =
    on CPU too (inductor's CPU backend: for tests and the curious)"""
    fsdp: bool = False
    """shard every model's parameters, gradients and optimizer state over the ranks with FSDP2 (under torchrun; gloo
    on CPU, nccl on GPU; bf16 the FSDP2 way: parameters gathered in bf16, gradients reduced in fp32). Checkpoints
    still hold full weights"""
    grad_ckpt: bool = False
    """activation checkpointing: keep each block's input only and recompute the block in the backward (less memory,
    about a third more compute)"""
    lora_rank: int = 0
    """train low-rank adapters of this rank on a frozen base (0: full fine-tuning); checkpoints hold the adapters and
    the name and hash of the base, which every reader rebuilds and merges them onto"""
    lora_alpha: float = 16.0
    """LoRA scale alpha: the update is (alpha / rank) B A"""
    lora_targets: Optional[list[str]] = None
    """the modules LoRA adapts, by last name part: linear layers (GPT: c_attn c_proj c_fc; Llama: q_proj k_proj v_proj
    o_proj gate_proj up_proj down_proj) and the token embedding (GPT: wte, Llama: embed_tokens; a tied LM head shares
    its adapter, its base stays frozen); None: every linear layer but the heads"""
    max_steps: Optional[int] = None
    """stop after this many steps (optimizer steps in SFT/RM, iterations in PPO); None: the stage's default schedule"""
    save_every: int = 0
    """save ckpt.pt every N steps (0: only at the end)"""
    resume: bool = False
    """continue from out_dir/ckpt.pt (same world size)"""
    overwrite: bool = False
    """start over in an --out-dir that holds a checkpoint, clearing its old event files and samples"""
    log_every: int = 10
    """print and log training metrics every N steps (0: only the last)"""
    peak_flops: Optional[float] = None
    """peak FLOP/s for perf/mfu (None: a table for known GPUs, a short matmul measurement on CPU)"""
    export_hf: Optional[str] = None
    """at the end, also write the model as a Hugging Face folder here (policy: causal LM; RM: sequence classifier)"""


BUILTIN_TASKS = ("reviews", "arith", "guess")  # data.TASKS's names; rg:NAME is a reasoning-gym dataset (rg.py)


def check_task(args) -> None:
    """--task and --task-config as a stage reads them, or a one-line error naming the flag."""
    if args.task not in BUILTIN_TASKS and not (args.task.startswith("rg:") and len(args.task) > len("rg:")):
        raise UserError(
            f"--task {args.task}: expected reviews, arith, guess or rg:NAME (the reasoning-gym dataset NAME, e.g. "
            "rg:chain_sum)"
        )
    if args.task_config is not None and not args.task.startswith("rg:"):
        raise UserError(
            f"--task-config configures a reasoning-gym dataset: give --task rg:NAME, not --task {args.task}"
        )


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temp file and os.replace: a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_jsonl(path: str, rows: list[dict]) -> None:
    """One JSON object a line, written atomically (write_atomic)."""
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def exact_div(a: int, b: int, what: str) -> int:
    """a / b when it divides exactly, else a one-line user error that says how to fix it."""
    if b <= 0 or a % b != 0:
        raise UserError(f"{what}: {a} must divide by {b}")
    return a // b


def is_master() -> bool:
    """Rank 0 (also before init_process_group: torchrun sets RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs) -> None:
    if is_master():
        print(*args, **kwargs, flush=True)


def run_main(main: Callable, args) -> None:
    """Run a stage's main(args); a UserError becomes one line on stderr (rank 0 only) and exit code 2."""
    try:
        keep_freed_memory()
        offline_unless_reachable(args)
        main(args)
    except UserError as e:
        if is_master():
            print(f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def keep_freed_memory() -> None:
    """Without a GPU, under glibc: malloc keeps freed memory for the next allocation. By default a block over 32 MB
    (a micro-batch's logits at SmolLM2's vocabulary) is mapped afresh each time and page-faults in again: SmolLM2's
    PPO update took 7.2-9.3 s an iteration so, 6.1-6.3 s kept (docs/design.md §7). A process then keeps about its
    peak memory, as torch's CUDA allocator does on a GPU."""
    if torch.cuda.is_available() or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no block mapped on its own
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: the heap's top not given back under 2 GB


def hub_names(args) -> list[str]:
    """The Hugging Face hub names among a stage's flags: hf:<name> values that are not a local path."""
    values = []
    for value in vars(args).values() if hasattr(args, "__dict__") else args:
        values += value if isinstance(value, list) else [value]
    return [v[3:] for v in values if isinstance(v, str) and v.startswith("hf:") and not os.path.exists(v[3:])]


def offline_unless_reachable(args, timeout: float = 2.0) -> None:
    """HF_HUB_OFFLINE=1 when a flag names a hub model and the hub does not answer a TCP connect within timeout: the
    load then reads the local cache at once (offline, transformers spent 51 s on retries before its error)."""
    names = hub_names(args)
    if not names or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return
    except OSError:
        pass
    os.environ["HF_HUB_OFFLINE"] = "1"
    # huggingface_hub reads the variable at import: follow it if it came first
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    print0(f"{endpoint.hostname} does not answer: hf:{names[0]} from the local cache only (HF_HUB_OFFLINE=1)")


def size_warnings(
    batch: int, batch_flag: str, records: int, eval_records: Optional[int], warmup: int, steps: int, delay: int = 0
):
    """Sizes that run but are likely a mistake, one line each at start-up: a batch of more records than the data
    holds (every step repeats some), a held-out set of one record, a warm-up as long as the steps that train (the
    learning rate never reaches --lr). delay: PPO's critic warm-up, steps of the run before the actor trains."""
    if batch > records:
        print0(f"warning: {batch_flag} {batch} is more than the {records} records the data holds: a step repeats some")
    if eval_records == 1:
        print0("warning: the held-out set is one record: its metrics say little")
    trained = steps - delay
    after = f" after --critic-warmup-steps {delay}" if delay else ""
    if trained <= 0:
        print0(f"warning: --critic-warmup-steps {delay} covers the whole run ({_steps(steps)}): the actor never trains")
    elif warmup >= trained:
        reason = "the learning rate never reaches --lr"
        print0(f"warning: --warmup-steps {warmup} >= the {_steps(trained)} that train{after}: {reason}")


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def shown_prompt(prompt) -> str:
    """A prompt as samples show it: a string as it is; a conversation as its last user message, not the rendered
    template (whose default system turn, SmolLM2's, would open every sample)."""
    if isinstance(prompt, str):
        return prompt
    users = [message["content"] for message in prompt if message["role"] == "user"]
    last = users[-1] if users else prompt[-1]["content"]
    return f"user: {last}\nassistant: "


def format_sample(prompt: str, response: str, ended: bool) -> str:
    """prompt (shown_prompt's) + response as printed and logged, marked when the response has no EOS."""
    return f"{prompt}{response}{'' if ended else ' [no EOS]'}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# -----------------------------------------------------------------------------
# stopping on a signal


class StopSignal:
    """SIGINT or SIGTERM stops a run at the end of its step: the stage saves, exits 128 + signal, and --resume
    continues it; a second signal exits at once. requested() all-reduces the flag so every rank stops at one step."""

    def __init__(self):
        self.signum = 0
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (a stage called from a thread stops as it ends)
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._handle)

    def close(self) -> None:
        """The handlers from before, back in place (a stage's main() called twice in one process leaves none)."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum
        print(f"{signal.Signals(signum).name}: stopping after this step to save it (again: stop at once)", flush=True)

    def requested(self, device: torch.device) -> int:
        """The signal any rank has received (0: none), the same on every rank."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor(self.signum, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def exit(self, signum: int, path: str) -> None:
        """After the save: one line with the command that continues the run, then exit 128 + signum on every rank."""
        print0(f"stopped by {signal.Signals(signum).name} with {path} saved; continue with: {resume_command(path)}")
        self.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        sys.exit(128 + signum)


def resume_command(path: str, argv: Optional[list[str]] = None) -> str:
    """The command line that continues the run saved at path: this one (sys.argv), without --overwrite, with the
    run's --out-dir and --resume (under torchrun, give it the same launcher)."""
    argv = list(sys.argv if argv is None else argv)
    words = [word for word in argv[1:] if word not in ("--overwrite", "--resume")]
    out_dir = os.path.dirname(path) or "."
    if not any(word == "--out-dir" or word.startswith("--out-dir=") for word in words):
        words += ["--out-dir", out_dir]
    return shlex.join(["python", os.path.basename(argv[0]), *words, "--resume"])


# -----------------------------------------------------------------------------
# reward functions (--reward-fn)


def is_finite_number(value) -> bool:
    """What a reward must be: an int or a float (not a bool), neither nan nor inf."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def shorten(text: str, width: int = 60) -> str:
    """text quoted as repr quotes it (one line: newlines escaped), cut after width characters with '...'."""
    return repr(text) if len(text) <= width else repr(text[:width]) + "..."


def call_user_code(name: str, context: str, fn: Callable, *args):
    """fn(*args), fn the user's code (--reward-fn, an environment's step): an exception it raises is one UserError,
    `<name> raised <type> (<message>) at <file>:<line> on <context>`, where the traceback's last frame is."""
    try:
        return fn(*args)
    except Exception as e:  # the user's code: any mistake there is theirs to see in one line
        frame = traceback.extract_tb(e.__traceback__)[-1]
        path = os.path.relpath(frame.filename)
        where = f"{frame.filename if path.startswith('..') else path}:{frame.lineno}"
        message = f" ({str(e).splitlines()[0][:80]})" if str(e).strip() else ""
        raise UserError(f"{name} raised {type(e).__name__}{message} at {where} on {context}") from None


def checked_reward(name: str, fn: Callable, prompt: str, response: str, ended: bool) -> float:
    """fn(prompt, response, ended), the user's reward: a raise, or a value that is not a finite number, is one
    UserError naming the function, the prompt and the answer."""
    context = f"prompt {shorten(prompt)} answer {shorten(response)}"
    value = call_user_code(name, context, fn, prompt, response, ended)
    if not is_finite_number(value):
        raise UserError(f"{name} returned {repr(value)[:60]} on {context}: expected a finite number (a float)")
    return float(value)


def load_reward_fn(spec: str, sample_prompt: Optional[str] = None, flag: str = "--reward-fn") -> Callable:
    """--reward-fn module:function or path/to/file.py:function -> fn(prompt, response, ended) -> float, a module
    found from the current folder or the repo's. With sample_prompt it is tried at once on that prompt and an empty
    response: a bad signature, exception or non-finite value is a UserError."""
    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise UserError(f"{flag} {spec}: expected module:function or path/to/file.py:function, e.g. task:gold_reward")
    try:
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise UserError(f"{flag} {spec}: {source}: no such file")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(source)[:-3], source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            for folder in (os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
                if folder not in sys.path:
                    sys.path.append(folder)
            module = importlib.import_module(source)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise UserError(f"{flag} {spec}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise UserError(f"{flag} {spec}: {name} is not a function")
    for ended in (True, False) if sample_prompt is not None else ():
        call = f"{flag} {spec}: {name}(the first prompt, '', ended={ended})"
        try:
            value = fn(sample_prompt, "", ended)
        except Exception as e:  # the user's code: any mistake there is theirs to see in one line
            raise UserError(f"{call} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        if not is_finite_number(value):
            raise UserError(f"{call} returned {value!r}: expected a finite number (a float)")
    return fn


# -----------------------------------------------------------------------------
# environments (--env): multi-turn episodes, docs/usage.md "How to extend"


def load_env(spec: str, first_row: dict, max_turns: int, flag: str = "--env") -> Callable:
    """--env module:NAME or path/to/file.py:NAME (found as --reward-fn's function is) -> make(row), which builds
    NAME(row) as a CheckedEnv. NAME(first_row).step("", False) is tried at once; max_turns under 1 is refused."""
    if max_turns < 1:
        raise UserError(f"--max-turns {max_turns}: the model's turns an episode may take, use >= 1")
    factory = load_reward_fn(spec, flag=flag)  # the loader only: no sample prompt, so nothing is called

    def make(row: dict) -> CheckedEnv:
        return CheckedEnv(f"{flag} {spec}", factory, row)

    make(first_row).step("", False)
    return make


class CheckedEnv:
    """One episode's environment, NAME(row), whose mistakes are one UserError naming the environment, the turn and
    the prompt: a raise (building it or in step: call_user_code), a step that is not (observation, reward, done[,
    info]), a reward that is not a finite number. step returns the four items, info {} when the environment gave
    none."""

    def __init__(self, name: str, factory: Callable, row: dict):
        self.name = name
        self.prompt = shorten(str(row.get("prompt")))
        self.turn = 0
        self.env = call_user_code(f"{name}: building it", f"the prompt {self.prompt}", factory, row)

    def step(self, response: str, ended: bool) -> tuple[Optional[str], float, bool, dict]:
        self.turn += 1
        where = f"{self.name}: step at turn {self.turn}"
        context = f"the prompt {self.prompt} and the response {shorten(response)}"
        result = call_user_code(where, context, self.env.step, response, ended)
        if not isinstance(result, tuple) or len(result) not in (3, 4):
            shape = "expected (observation, reward, done) or with an info dict"
            raise UserError(f"{where} returned {repr(result)[:80]}: {shape}, on {context}")
        observation, reward, done, *rest = result
        info = rest[0] if rest else {}
        if observation is not None and not isinstance(observation, str):
            raise UserError(f"{where} returned the observation {repr(observation)[:80]}: expected a str or None")
        if not is_finite_number(reward):
            raise UserError(f"{where} returned the reward {reward!r}: expected a finite number (a float), on {context}")
        if not isinstance(info, dict) or not all(is_finite_number(value) for value in info.values()):
            raise UserError(f"{where} returned the info {repr(info)[:80]}: expected a dict of finite numbers")
        return observation, float(reward), bool(done), info


# -----------------------------------------------------------------------------
# the optimizer step and its NaN guard


@dataclass
class Trained:
    """One model a stage trains, as the shared skeleton (guarded_step here, checkpoints.Run's save and resume)
    sees it. Its checkpoint entries are `<name>` (the weights; not in a LoRA run's, which has `base`), `<name>_lora`
    (LoRA: the trainable parameters) and `<name>_optimizer` (`optimizer` for the model named `model`)."""

    name: str
    model: torch.nn.Module  # the bare module (not compiled, not DDP): its parameters are the trained ones
    optimizer: torch.optim.Optimizer
    schedule: Optional["LRSchedule"] = None  # the learning rate per step (saved and resumed with the model)
    grad_clip: float = 0.0  # global grad-norm clip (0: off)
    forward: Optional[torch.nn.Module] = None  # what the losses call: `model` itself, or it compiled and DDP-wrapped

    def __post_init__(self):
        if self.forward is None:
            self.forward = self.model

    def key(self, part: str) -> str:
        """This model's checkpoint key for part (optimizer, scheduler): the part itself for the model named `model`,
        `<name>_<part>` for the others (critic_optimizer)."""
        return part if self.name == "model" else f"{self.name}_{part}"


@dataclass
class StepGuard:
    """The NaN guard's state: optimizer steps skipped for a non-finite gradient, in all (saved,
    logged as train/skipped_steps) and in a row, and each model's grad norms of the steps it took since the last
    read."""

    skipped: int = 0
    skipped_in_row: int = 0
    grad_norms: dict[str, list[float]] = field(default_factory=dict)

    def read(self, tags: Optional[dict[str, str]] = None) -> dict[str, float]:
        """Each model's mean grad norm over the steps it took since the last read, tagged by tags[name] (default:
        the model named `model` as train/grad_norm; a model that took no step has no value), and
        train/skipped_steps; starts the next interval."""
        tags = tags or {"model": "train/grad_norm"}
        metrics = {tags[name]: sum(norms) / len(norms) for name, norms in self.grad_norms.items() if norms}
        metrics["train/skipped_steps"] = self.skipped
        self.grad_norms = {}
        return metrics


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's clip_grad_norm_ returns the global norm as one), any other tensor itself. Read
    without importing DTensor (a second at start-up): none exists until something imports it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def guarded_step(trained: list[Trained], guard: StepGuard, step: int) -> set[str]:
    """One optimizer step of every model in `trained`: clip its global grad norm (one host sync for all), step it
    if finite, zero its grads. A non-finite step counts once in guard.skipped; 10 in a row stop the run. Returns the
    names of the models that stepped."""
    grad_norms = []
    for entry in trained:
        grad_norm = torch.nn.utils.clip_grad_norm_(entry.model.parameters(), entry.grad_clip or math.inf)
        grad_norms.append(full_tensor(grad_norm).float())
    stepped = set()
    for entry, grad_norm in zip(trained, torch.stack(grad_norms).tolist()):
        if math.isfinite(grad_norm):
            entry.optimizer.step()
            stepped.add(entry.name)
            guard.grad_norms.setdefault(entry.name, []).append(grad_norm)
        else:
            print0(f"step {step}: non-finite {entry.name} grad norm ({grad_norm}), step skipped")
        entry.optimizer.zero_grad(set_to_none=True)
    if len(stepped) == len(trained):
        guard.skipped_in_row = 0
        return stepped
    guard.skipped += 1
    guard.skipped_in_row += 1
    if guard.skipped_in_row >= 10:
        raise RuntimeError(
            f"{guard.skipped_in_row} non-finite steps in a row: lower the learning rate or check the data (the last "
            "checkpoint saved is the last good one)"
        )
    return stepped


# -----------------------------------------------------------------------------
# logging


def _wait_for_a_later_second(out_dir: str) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the second its file was created
    (events.out.tfevents.<second>.<host>.<pid>.<n>): a resumed run's file is read after the dead run's, and its purge
    applies, only if it starts in a later second. Waits (under a second) until it does."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    seconds = [int(name.split(".")[3]) for name in names if name.startswith("events.out.tfevents.")]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)


class Logger:
    """TensorBoard scalars, the console line `step 00042/00500 | loss 1.23 | ...` and out_dir/samples.jsonl, all
    written by rank 0 only. It owns samples.jsonl: a fresh run starts it empty; a resumed run keeps the records of
    steps <= resume_step, and TensorBoard hides the scalars of later steps the same way, so no step appears twice.
    Both files are opened at the first write or at close: a run that fails before its first step (a reward function
    that raises) leaves its folder as its last checkpoint left it."""

    def __init__(
        self,
        out_dir: str,
        master: bool,
        resume_step: Optional[int] = None,
        console_keys: Optional[tuple[str, ...]] = None,
    ):
        self.writer = None
        self.master = master
        self.out_dir = out_dir
        self.resume_step = resume_step
        self.console_keys = console_keys
        self.started = time.time()  # this sitting's clock: a resumed run's pace counts its own steps
        self.first_step = resume_step or 0
        self.samples_path = os.path.join(out_dir, "samples.jsonl")

    def open(self):
        """Rank 0's SummaryWriter, opened at the first call with samples.jsonl started; None on the other ranks."""
        if self.writer is not None or not self.master:
            return self.writer
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides the scalars logged after its checkpoint (steps > resume_step); those of the checkpoint's
        # own step were logged before it was saved and stay
        resume_step = self.resume_step
        purge_step = None if resume_step is None else resume_step + 1
        if resume_step is not None:
            _wait_for_a_later_second(self.out_dir)
        self.writer = SummaryWriter(self.out_dir, purge_step=purge_step)  # creates out_dir
        kept = [] if resume_step is None else _records_up_to(self.samples_path, resume_step)
        write_atomic(self.samples_path, "".join(kept))
        return self.writer

    def log(self, step: int, metrics: dict, max_steps: Optional[int] = None, console: bool = True) -> None:
        """Every metric to TensorBoard; the console line shows console_keys (those present, in that order) or all."""
        if self.open() is None:
            return
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, float(value), step)
        if not console:
            return
        shown = list(metrics) if self.console_keys is None else [tag for tag in self.console_keys if tag in metrics]
        # keys are the tags' last parts, the whole tag where a last part repeats (policy/loss, value/loss)
        last_parts = [tag.split("/")[-1] for tag in shown]
        keys = [part if last_parts.count(part) == 1 else tag for part, tag in zip(last_parts, shown)]
        head = f"step {step:05d}" + (f"/{max_steps:05d}" if max_steps else "")
        fields = [f"{key} {_fmt(metrics[tag])}" for key, tag in zip(keys, shown)]
        steps_left = max_steps - step if max_steps else None
        clock = progress(time.time() - self.started, step - self.first_step, steps_left)
        print(" | ".join([head] + fields + clock), flush=True)

    def samples(self, step: int, records: list[dict]) -> None:
        """Append {"step": step, **record} to samples.jsonl, one JSON line per record."""
        if self.open() is None:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **record}) + "\n" for record in records)

    def sample_table(self, step: int, records: list[dict]) -> None:
        """An RL stage's responses (rollout.rollout's records): the first 8 as a TensorBoard text table, the first 16
        in samples.jsonl."""
        table = []
        for record in records[:8]:
            line = (
                f"{format_sample(record['prompt'], record['response'], record['ended'])} | score {record['score']:.2f}"
            )
            if record["gold"] is not None:
                line += f" | gold {record['gold']:.2f}"
            table.append(line)
        self.text("samples", "\n\n".join(table), step)
        self.samples(step, records[:16])

    def text(self, tag: str, text: str, step: int) -> None:
        if self.open() is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        """A run that ends without a step (resumed at its last) still ends with its files, as one that logged."""
        if self.open() is not None:
            self.writer.close()


def _records_up_to(path: str, step: int) -> list[str]:
    """The lines of a samples.jsonl whose record has step <= step (a partial last line, from a kill, is dropped)."""
    if not os.path.exists(path):
        return []
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            if json.loads(line)["step"] <= step:
                kept.append(line)
    return kept


def progress(elapsed: float, steps_done: int, steps_left: Optional[int]) -> list[str]:
    """The step line's clock: ["elapsed 1m05s", "left 3m20s"], the rest at this sitting's mean pace so far."""
    fields = [f"elapsed {_clock(elapsed)}"]
    if steps_left is not None and steps_done > 0:
        fields.append(f"left {_clock(elapsed / steps_done * steps_left)}")
    return fields


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _fmt(v: float) -> str:
    v = float(v) + 0.0  # -0.0 as 0
    return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}".rstrip("0").rstrip(".")


# -----------------------------------------------------------------------------
# LR schedule and MFU


@dataclass
class LRSchedule:
    """Linear warm-up to lr, then cosine decay to lr * min_lr_ratio at max_steps (steps count from 0). delay: steps
    before the schedule starts (PPO's actor waits out the critic warm-up). A resume with another step budget re-times
    the cosine (retimed): from the resumed step it continues from where it was to the new end. The checkpoint's
    `scheduler` entry is its state_dict()."""

    lr: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float = 0.1
    delay: int = 0
    start_step: Optional[int] = None  # where the cosine's progress is start_progress (None: the end of the warm-up)
    start_progress: float = 0.0

    def progress(self, step: int) -> float:
        """The cosine's progress in [0, 1] at `step` (after the delay)."""
        start = self.warmup_steps if self.start_step is None else self.start_step
        span = max(1, self.max_steps - self.delay - start)
        return min(1.0, self.start_progress + (1 - self.start_progress) * (step - start) / span)

    def at(self, step: int) -> float:
        """The learning rate of optimizer step `step`."""
        step = max(0, step - self.delay)
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = self.progress(step)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def retimed(self, step: int, max_steps: int) -> "LRSchedule":
        """The schedule of a run resumed at `step` with a new budget max_steps: the same up to step, then the cosine
        from its progress there to its end at max_steps (the warm-up, if not over, stays as it was)."""
        local = max(0, step - self.delay)
        if local <= self.warmup_steps:
            return LRSchedule(**(self.state_dict() | {"max_steps": max_steps}))
        anchor = {"start_step": local, "start_progress": self.progress(local), "max_steps": max_steps}
        return LRSchedule(**(self.state_dict() | anchor))

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def step_lr(trained: Trained, step: int) -> float:
    """The learning rate of a trained model's schedule at this step, set on its optimizer; returns it."""
    lr = trained.schedule.at(step)
    for group in trained.optimizer.param_groups:
        group["lr"] = lr
    return lr


class Throughput:
    """perf/tokens_per_sec and perf/mfu over the training time since the last read; time inside
    `with throughput.paused():` (evaluation, saving) is left out."""

    def __init__(self, flops_per_token: float, peak_flops: float, world_size: int):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = world_size
        self.seconds = 0.0
        self.started = time.time()
        # on CPU the peak is measured at start-up: a busy machine lowers it, and every perf/mfu reading rises with it
        print0(f"perf/mfu against a peak of {peak_flops / 1e9:.4g} GFLOP/s per device (--peak-flops sets it)")

    @contextmanager
    def paused(self):
        self.seconds += time.time() - self.started
        try:
            yield
        finally:
            self.started = time.time()

    def read(self, tokens: float) -> dict[str, float]:
        """The rates of `tokens` (summed over ranks) trained since the last read; starts the next interval."""
        now = time.time()
        tokens_per_sec = tokens / (self.seconds + now - self.started)
        self.seconds, self.started = 0.0, now
        mfu = tokens_per_sec * self.flops_per_token / (self.peak_flops * self.world_size)
        return {"perf/tokens_per_sec": tokens_per_sec, "perf/mfu": mfu}


# dense bf16 peak FLOP/s of known GPUs (per device)
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, override: Optional[float] = None, dtype: torch.dtype = torch.float32) -> float:
    """Peak FLOP/s for MFU: --peak-flops, else a table for known GPUs, else a 0.2 s matmul measurement in the run's
    dtype (CPU: bf16 matmuls run about 2x fp32's on a CPU that has them, and an fp32 peak would read MFU above 1)."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return 100e12  # unknown GPU: say so in the docs; pass --peak-flops for a true figure
    return matmul_flops(dtype=dtype)


def matmul_flops(sizes: tuple = (512,), trials: int = 5, seconds: float = 0.04, dtype=torch.float32) -> float:
    """Best achieved matmul FLOP/s on CPU in dtype over square sizes, the best of a few short trials each (a busy
    machine lowers some of them, rarely all). bench/ppo_throughput.py measures longer and larger for its peak."""
    best = 0.0
    for n in sizes:
        # drawn in fp32 then cast: the global generator moves as it did before dtype was an argument (runs repeat)
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        for _ in range(trials):
            iters, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a @ b
                iters += 1
            best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best


def iteration_flops(models, sequence_len: int, sequences: int, epochs: int, critic=None) -> float:
    """Training-equivalent FLOPs of one RL iteration for perf/mfu: the rollout's forwards (generation, policy and
    reference log-probs, RM scores, critic values; a forward a third of flops_per_token), then `epochs` updates of
    the actor and critic. models: rollout.Models; sequence_len: prompt + response; sequences: over ranks."""
    actor_flops = models.actor.flops_per_token(sequence_len)
    critic_flops = critic.flops_per_token(sequence_len) if critic is not None else 0
    # an RM's forward reads its scalar head only (logits=False), like the critic's: critic-sized (without a critic,
    # the RM's own count, its LM head included when it has one)
    reward_flops = 0
    for reward_model in models.reward_models:
        reward_flops += critic_flops if critic is not None else reward_model.flops_per_token(sequence_len)
    rollout_flops = (3 * actor_flops + critic_flops + reward_flops) / 3
    update_flops = epochs * (actor_flops + critic_flops)
    return sequences * sequence_len * (rollout_flops + update_flops)


def perf_metrics(models, experience: dict, epochs: int, times: tuple, peak: float, world_size: int):
    """perf/ of one RL iteration: its rollout and update seconds, tokens per second and MFU (iteration_flops against
    the peak of every rank); times: the iteration's start, the update's start and the end."""
    t_rollout, t_update, t_end = times
    sequence_len = experience["query"].size(1) + experience["mask"].size(1)
    sequences = experience["mask"].size(0) * world_size
    flops = iteration_flops(models, sequence_len, sequences, epochs, critic=models.critic)
    return {
        "perf/rollout_s": t_update - t_rollout,
        "perf/update_s": t_end - t_update,
        "perf/tokens_per_sec": sequences * sequence_len / (t_end - t_rollout),
        "perf/mfu": flops / (t_end - t_rollout) / (peak * world_size),
    }
