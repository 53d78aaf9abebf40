"""Checkpoints (docs/design.md §4): the checkpoint dict every stage writes and reads back (Run.save, Run.resume), model
and optimizer state (a LoRA model's adapters and the record of its base, FSDP2's sharded optimizer state through DCP),
atomic saves, RNG state, the --resume flag check (resume_args), fingerprints of what a run started from, and
--export-hf.
"""

import hashlib
import os
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from common import CommonArgs, LRSchedule, Trained, UserError, check_task, is_master, print0
from lora import lora_layers, merge_lora, merged_state_dict
from parallel import Dist, is_sharded
from tokenizer import export_tokenizer


def file_sha256(path: str) -> str:
    """The sha256 of a file: checkpoints record the hashes of the checkpoints they started from (--resume checks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def init_fingerprint(spec: str) -> Optional[str]:
    """What a run started from, for --resume to compare: the sha256 of a .pt checkpoint; for a Hugging Face folder
    (hf:<path>, a local folder, or a hub name's cached snapshot) the sha256 over its files' names and sha256s (config,
    weights, tokenizer); None for scratch or a hub name that is not cached."""
    if spec == "scratch":
        return None
    if spec.endswith(".pt"):
        return file_sha256(spec)
    path = spec.removeprefix("hf:")
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True)
        except Exception:  # not a hub name, or not in the cache
            return None
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if os.path.isfile(os.path.join(path, name)):
            digest.update(f"{name}:{file_sha256(os.path.join(path, name))}\n".encode())
    return digest.hexdigest()


def prepare_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """Before any work: a fresh run refuses an out_dir holding ckpt.pt unless overwrite (which deletes it, its logs
    and sharded optimizer folders); an earlier run's logs without ckpt.pt and interrupted saves' temp files go.
    Rank 0 deletes, the others only check."""
    if not os.path.isdir(out_dir):
        return
    if is_master():
        for name in os.listdir(out_dir):
            if name.startswith("ckpt.pt.tmp."):
                os.remove(os.path.join(out_dir, name))
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if resume:
        return
    if not os.path.exists(ckpt_path):  # a run that died before its first save: its logs would mix with this one's
        stale = [name for name in os.listdir(out_dir) if name.startswith("events.out.tfevents.")]
        stale += [name for name in os.listdir(out_dir) if name == "samples.jsonl"]
        if stale and is_master():
            for name in stale:
                os.remove(os.path.join(out_dir, name))
            print0(f"{out_dir}: removed {len(stale)} log file(s) of an earlier run that saved no checkpoint")
        return
    if not overwrite:
        raise UserError(f"{ckpt_path} exists: pass --resume to continue that run, or --overwrite to start over")
    if not is_master():
        return
    for name in os.listdir(out_dir):
        if name.startswith("events.out.tfevents.") or name in ("samples.jsonl", "ckpt.pt"):
            os.remove(os.path.join(out_dir, name))
        elif name.endswith(".dcp"):
            shutil.rmtree(os.path.join(out_dir, name))


# -----------------------------------------------------------------------------
# --resume: the run's own flags

NOT_COMPARED = ("out_dir", "resume", "overwrite")
# flags that change no trained weight: they may differ on --resume and are printed
BOOKKEEPING = (
    "log_every",
    "save_every",
    "eval_every",
    "sample_every",
    "export_hf",
    "device",
    "compile",
    "peak_flops",
    "task_dir",
    "micro_batch_size",
    "num_samples",
    "eval_samples",
    "eval_pairs",
    "probe_size",
)
BUDGET = ("max_steps", "total_episodes", "epochs")  # the step budget: may change; the LR schedule is re-timed
POLICY_KINDS = ("sft", "dpo", "ppo", "grpo")  # the checkpoint kinds any stage may start a policy from


def resume_args(args: CommonArgs, kind: str, resolve: Optional[Callable] = None) -> CommonArgs:
    """A stage's args as its run continues. Without --resume: resolve(args). With it, a flag not given (args.given;
    from Python, a field at its default) takes the checkpoint's value; a given one that changes the run's math and
    differs from the saved one raises UserError. resolve fills flag-dependent defaults on both sides first."""
    resolve = resolve or (lambda given: given)
    if not args.resume:
        return resolve(args)
    if args.overwrite:
        raise UserError("--resume continues the run in --out-dir, --overwrite starts it over: pass one of them")
    path = os.path.join(args.out_dir, "ckpt.pt")
    given = getattr(args, "given", None)  # the flags a command line gave (cli.parse); None when called from Python
    saved = load_checkpoint(path, kind=kind, flag="--resume", mmap=True).get("args", {})
    defaults = type(args)()
    names = [f.name for f in fields(args) if f.name in saved and f.name not in NOT_COMPARED]
    saved_args = resolve(replace(defaults, **{name: saved[name] for name in names}))
    if given is None:
        at_default = [name for name in names if getattr(args, name) == getattr(defaults, name)]
    else:
        at_default = [name for name in names if name not in given]
    args = resolve(replace(args, **{name: getattr(saved_args, name) for name in at_default}))
    refused, allowed = [], []
    for name in names:
        old, new = getattr(saved_args, name), getattr(args, name)
        if old != new:
            change = f"--{name.replace('_', '-')} {old} -> {new}"
            (allowed if name in BOOKKEEPING + BUDGET else refused).append(change)
    if refused:
        raise UserError(
            f"--resume {path}: {', '.join(refused)}: these change what the run computes (start a new run with "
            "another --out-dir, or --overwrite)"
        )
    inherited = [name for name in at_default if getattr(args, name) != getattr(defaults, name)]
    if inherited:
        shown = " ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in inherited)
        print0(f"resume: the checkpoint's settings where no flag says otherwise: {shown}")
    if allowed:
        print0(f"resume: changed since the last sitting: {', '.join(allowed)}")
    return args


def task_from_checkpoint(args: CommonArgs, path: Optional[str], flag: str) -> CommonArgs:
    """args with the built-in task the checkpoint at path ran on where the command line gives no --task (from
    Python: --task at its default); a given --task that differs is refused. Its --task-config likewise, but a given
    one that differs is taken (a harder configuration of the same dataset is a curriculum). A path that is not one
    of our checkpoint files (scratch, hf:, a folder) records no task: args as they are. Then --task and
    --task-config are checked (common.check_task)."""
    saved = {}
    if path is not None and os.path.isfile(path):
        saved = load_checkpoint(path, flag=flag, mmap=True).get("args", {})
    if saved.get("task") is None:  # a checkpoint written from Python may record none
        saved = {}
    given = getattr(args, "given", None)
    defaults = type(args)()
    inherited = {}
    for name in ("task", "task_config"):
        if name not in saved or saved[name] == getattr(args, name):
            continue
        option = "--" + name.replace("_", "-")
        if (name not in given) if given is not None else getattr(args, name) == getattr(defaults, name):
            print0(f"{option} {saved[name]}: the one {flag} {path} was trained on")
            inherited[name] = saved[name]
        elif name == "task":
            raise UserError(
                f"--task {args.task}: {flag} {path} was trained on --task {saved[name]} (drop --task, or pass one)"
            )
        else:
            print0(f"{option} {args.task_config}: not the {saved[name]} {flag} {path} was trained on")
    resolved = replace(args, **inherited)
    if given is not None:
        resolved.given = given
    check_task(resolved)
    return resolved


# -----------------------------------------------------------------------------
# RNG state


def rng_state(generator: Optional[torch.Generator] = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def all_rng_states(generator: Optional[torch.Generator] = None) -> list:
    """Every rank's rng_state, gathered for the checkpoint (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return [rng_state(generator)]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(generator))
    return states


def set_rng_state(state: dict, generator: Optional[torch.Generator] = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


# -----------------------------------------------------------------------------
# model and optimizer state


def base_specs(kind: str, args) -> dict:
    """The spec each model a stage trains was built from, by checkpoint key: --init in SFT, RM and DPO; --sft-ckpt for
    PPO's and GRPO's policy; PPO's critic the first --rm-ckpt, or the policy's init with --rm-ckpt none (train_ppo.py's
    critic_init)."""
    if kind in ("sft", "rm", "dpo"):
        return {"model": args.init}
    reward_models = [path for path in args.rm_ckpt if path != "none"]
    return {"model": args.sft_ckpt, "critic": reward_models[0] if reward_models else args.sft_ckpt}


def lora_base(model: torch.nn.Module, spec: str, args: CommonArgs) -> Optional[dict]:
    """What a LoRA model's checkpoint keeps of its frozen base instead of its weights (docs/design.md §4): the spec it
    was built from and its fingerprint, its heads, the dtype its matrices are stored in (bf16 under bf16) and the
    adapters' settings. None without LoRA, or from scratch (random weights no spec rebuilds)."""
    if not lora_layers(model) or spec == "scratch":
        return None
    frozen_matrix = next(p for p in model.parameters() if not p.requires_grad and p.dim() >= 2)
    return dict(
        spec=spec,
        sha256=init_fingerprint(spec),
        lm_head=model.config.lm_head,
        score_head=model.config.score_head,
        dtype=str(frozen_matrix.dtype).removeprefix("torch."),
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
    )


def check_base(base: dict, needed_by: str) -> None:
    """A LoRA checkpoint's base as it is now against its record: missing, or changed since (its fingerprint differs),
    is a UserError naming it and the checkpoint that needs it. A base saved without a fingerprint (a hub name not in
    the cache) is not checked."""
    if base["sha256"] is None:
        return
    try:
        fingerprint = init_fingerprint(base["spec"])
    except OSError:  # a .pt file that is gone
        fingerprint = None
    if fingerprint is None:
        raise UserError(
            f"{needed_by} holds LoRA adapters only, and its base {base['spec']} is missing (put it back at that path, "
            "relative to where you run)"
        )
    if fingerprint != base["sha256"]:
        raise UserError(
            f"{needed_by} holds LoRA adapters only, and its base {base['spec']} changed since it was trained (sha256 "
            "differs): its adapters fit the old weights"
        )


def model_state(model: torch.nn.Module, key: str = "model", base: Optional[dict] = None) -> dict:
    """A model's checkpoint entries: `key` = its full state dict, adapters merged; with LoRA `<key>_lora` = the
    trainable parameters (adapters, scalar head), which a resume loads onto the base rebuilt from --init. With a
    `base` record (lora_base) the LoRA entry alone: a reader merges it onto the base (hf.model_state_dict). Under
    --fsdp every rank calls it; rank 0 gets the entries, the others {}."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not state:  # not rank 0
            return {}
    else:
        state = model.state_dict()
    entries = {}
    if base is None:
        entries[key] = merged_state_dict(model, state)
    if lora_layers(model):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        entries[f"{key}_lora"] = {name: value.detach() for name, value in state.items() if name in trainable}
    return entries


def training_state(entry: Trained, out_dir: str, base: Optional[dict] = None) -> dict:
    """model_state plus the optimizer's state (`optimizer` for the model, `<name>_optimizer` for another name, e.g.
    critic_optimizer): what a checkpoint in out_dir holds of one trained model. Every rank calls it under --fsdp."""
    key = entry.key("optimizer")
    optimizer = optimizer_state(entry.model, entry.optimizer, out_dir, key)
    return model_state(entry.model, entry.name, base) | {key: optimizer}


def load_model_state(model: torch.nn.Module, ckpt: dict, key: str = "model") -> None:
    """The inverse of model_state on a model built as at the start of the run (the same --init, --lora-rank)."""
    lora = bool(lora_layers(model))
    if lora and f"{key}_lora" not in ckpt:
        raise UserError("--resume with --lora-rank: the checkpoint holds no adapters (it was not a LoRA run)")
    state = ckpt[f"{key}_lora"] if lora else ckpt[key]
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=not lora)
        missing, unexpected = set_model_state_dict(model, state, options=options)
    else:
        missing, unexpected = model.load_state_dict(state, strict=not lora)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if unexpected or any(name in missing for name in trainable):
        raise UserError("--resume: the checkpoint's adapters do not match --lora-rank/--lora-targets")


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, name: str) -> dict:
    """The optimizer's state for a checkpoint in out_dir. Under --fsdp every rank writes its shard with DCP into a
    new folder beside ckpt.pt and the entry is {"dcp": the folder's name}."""
    if not is_sharded(model):
        return optimizer.state_dict()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    folder = [f"{name}.{uuid.uuid4().hex[:12]}.dcp"]  # a fresh name: the folder ckpt.pt names now stays whole
    dist.broadcast_object_list(folder, src=0)
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(out_dir, folder[0]))
    return {"dcp": folder[0]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, ckpt_dir: str) -> None:
    """The inverse of optimizer_state; ckpt_dir: the folder of the checkpoint that holds `state`."""
    sharded = is_sharded(model)
    if sharded != ("dcp" in state):
        raise UserError(f"--resume: the checkpoint was saved {'with' if 'dcp' in state else 'without'} --fsdp")
    if not sharded:
        optimizer.load_state_dict(state)
        return
    folder = os.path.join(ckpt_dir, state["dcp"])
    if not os.path.isdir(folder):
        raise UserError(f"--resume: {folder}, the sharded optimizer state beside the checkpoint, is missing")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    sharded_state = get_optimizer_state_dict(model, optimizer)  # the layout DCP loads into, shard by shard
    dcp.load(sharded_state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, sharded_state)


# -----------------------------------------------------------------------------
# the checkpoint


def save_checkpoint(obj: dict, path: str) -> None:
    """Atomic save: write a temp file, fsync it, os.replace; a kill at any moment leaves the old file or the new one.
    Then the sharded optimizer folders beside it (optimizer_state under --fsdp) that the new file does not name go."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    named = {entry["dcp"] for entry in obj.values() if isinstance(entry, dict) and "dcp" in entry}
    for name in os.listdir(folder):
        if name.endswith(".dcp") and name not in named:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def load_checkpoint(path: str, kind: Optional[str | tuple] = None, flag: str = "--init", mmap: bool = False) -> dict:
    """Load one of our checkpoints (our own files: weights_only=False); a missing or wrong-kind file is a UserError.
    mmap: tensors stay on disk until read (to look at a checkpoint's args without loading its weights)."""
    if not os.path.isfile(path) and flag == "--resume":  # e.g. a run killed before its first save
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise UserError(f"--resume {path}: no checkpoint: no run there to resume (start it without --resume)")
        raise UserError(
            f"--resume {path}: no checkpoint: the run there stopped before it saved one (--save-every 0 saves at the "
            "end only); start it over with --overwrite, with --save-every N to be able to resume it"
        )
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such checkpoint (run the previous stage first, or pass the right path)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"{flag} {path}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or "kind" not in ckpt or ("model" not in ckpt and "model_lora" not in ckpt):
        raise UserError(f"{flag} {path}: not a checkpoint written by this repo")
    kinds = (kind,) if isinstance(kind, str) else kind
    if kinds is not None and ckpt["kind"] not in kinds:
        raise UserError(f"{flag} {path}: is a '{ckpt['kind']}' checkpoint, expected {' or '.join(kinds)}")
    ckpt["path"] = path  # not saved: where it was read from, for a LoRA checkpoint's missing base to name
    return ckpt


def load_resume(path: str, kind: str, world_size: int, max_steps: int, inputs: dict) -> dict:
    """--resume: the checkpoint at path, refused if saved with another world size, if it already reached max_steps,
    or if an input checkpoint it started from changed. inputs: {ckpt key of a sha256: (the flag to name, the sha256
    now)}."""
    ck = load_checkpoint(path, kind=kind, flag="--resume")
    if ck["world_size"] != world_size:
        raise UserError(f"--resume {path}: saved with world size {ck['world_size']}, now {world_size}")
    if ck["step"] >= max_steps:
        raise UserError(f"--resume {path}: already at step {ck['step']} of {max_steps} (raise --max-steps)")
    for key, (flag, digest) in inputs.items():
        if ck[key] != digest:
            raise UserError(f"--resume {path}: {flag} changed since the run started (sha256 differs)")
    return ck


@dataclass
class Run:
    """One stage's run as its checkpoints see it: the checkpoint dict it writes and reads back, over the models it
    trains. Its wall time is this sitting's (from `started`) plus the earlier sittings' that a resume reads back."""

    kind: str  # sft | rm | dpo | ppo
    args: CommonArgs  # the resolved args, saved as they are
    d: Dist
    tokenizer: object  # tokenizer.Tokenizer: its state() rebuilds it
    trained: list[Trained]
    started: float
    earlier_seconds: float = 0.0
    bases: Optional[dict] = None  # lora_base of each trained model by name, computed at the first save (rank 0)

    @property
    def path(self) -> str:
        return os.path.join(self.args.out_dir, "ckpt.pt")

    def seconds(self) -> float:
        return self.earlier_seconds + time.time() - self.started

    def save(self, step: int, data_state: dict, generator: Optional[torch.Generator] = None, **extra) -> None:
        """Write out_dir/ckpt.pt: kind; per trained model its weights (a LoRA model: its adapters, and in `base` the
        record that rebuilds its base), optimizer state (Trained's keys), `<name>_config` and its LR schedule;
        tokenizer, args, step, every rank's RNG states (and `generator`'s), data_state, world_size, seconds, and the
        stage's own keys (`extra`). Every rank calls it (under --fsdp each gathers the weights and writes its optimizer
        shard); rank 0 writes the file."""
        rng = all_rng_states(generator)
        if self.bases is None and self.d.master:  # the fingerprints hash the bases: once a run, on rank 0
            specs = base_specs(self.kind, self.args)
            self.bases = {entry.name: lora_base(entry.model, specs[entry.name], self.args) for entry in self.trained}
        bases = self.bases or {}
        entries = {}
        for entry in self.trained:
            entries |= training_state(entry, self.args.out_dir, bases.get(entry.name))
        if not self.d.master:
            return
        checkpoint = dict(kind=self.kind, **entries)
        if any(bases.values()):
            checkpoint["base"] = {name: base for name, base in bases.items() if base is not None}
        for entry in self.trained:
            checkpoint[f"{entry.name}_config"] = asdict(entry.model.config)
            checkpoint[entry.key("scheduler")] = entry.schedule.state_dict()
        checkpoint |= dict(
            tokenizer=self.tokenizer.state(),
            args=asdict(self.args),
            step=step,
            rng=rng,
            data_state=data_state,
            world_size=self.d.world_size,
            seconds=self.seconds(),
            **extra,
        )
        save_checkpoint(checkpoint, self.path)

    def resume(self, inputs: dict, generator: Optional[torch.Generator] = None) -> dict:
        """--resume: the checkpoint restored into every trained model, its optimizer and LR schedule (re-timed when
        the step budget changed), and this rank's RNG states; returns it for the stage's own keys. inputs: {ckpt key
        of a sha256: (the flag to name, the sha256 now)}."""
        ckpt = load_resume(self.path, self.kind, self.d.world_size, self.trained[0].schedule.max_steps, inputs)
        step = ckpt["step"]
        for entry in self.trained:
            load_model_state(entry.model, ckpt, entry.name)
            load_optimizer_state(entry.model, entry.optimizer, ckpt[entry.key("optimizer")], self.args.out_dir)
            saved = LRSchedule(**ckpt[entry.key("scheduler")])
            if saved.max_steps != entry.schedule.max_steps:
                retimed = saved.retimed(step, entry.schedule.max_steps)
                print0(
                    f"resume: {entry.name}'s step budget {saved.max_steps} -> {retimed.max_steps}: its LR schedule "
                    f"is re-timed from step {step} (lr {saved.at(step):.3g} there as before, then the cosine to its "
                    f"end at step {retimed.max_steps})"
                )
                saved = retimed
            entry.schedule = saved
        set_rng_state(ckpt["rng"][self.d.rank], generator)
        self.earlier_seconds = ckpt["seconds"]
        print0(f"resumed from {self.path} at step {step}")
        return ckpt


# -----------------------------------------------------------------------------
# an RL stage's inputs


def input_hashes(args) -> dict:
    """What an RL run started from, kept in its checkpoints: --resume refuses a changed input (HASH_FLAGS)."""
    return {
        "sft_hash": init_fingerprint(args.sft_ckpt),
        "ref_hash": init_fingerprint(args.ref_ckpt) if args.ref_ckpt else None,
        "rm_hashes": [file_sha256(path) for path in args.rm_ckpt if path != "none"],
    }


HASH_FLAGS = {"sft_hash": "--sft-ckpt", "ref_hash": "--ref-ckpt", "rm_hashes": "--rm-ckpt"}


def export_hf(model, tok, out_dir: str) -> None:
    """--export-hf: model.export_hf with the tokenizer's EOS; transformers reads an RM's score at the last token that
    is not its pad id: the tokenizer's pad when that is a vocab id other than EOS, else 0 (right-pad with it)."""
    merge_lora(model)  # the end of the run: adapters fold into the weights for good
    vocab = model.config.vocab_size
    pad = tok.pad_id if 0 <= tok.pad_id < vocab and tok.pad_id != tok.eos_id else None
    model.export_hf(out_dir, eos_id=tok.eos_id, pad_id=pad)
    written = export_tokenizer(tok, out_dir)
    print0(f"exported a Hugging Face model to {out_dir} (transformers' from_pretrained loads it); {written}")
