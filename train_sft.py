"""Supervised fine-tuning: next-token loss on prompt → response demonstrations.

On the built-in task from scratch (the default) the loss covers prompt and response tokens, so one run teaches the
tiny model the language and the task; from a pretrained model or on your own data, prompt tokens are masked out.

python train_sft.py                                                   # built-in task, tiny model, CPU, ~2-3 min
python train_sft.py --init gpt2 --data my_sft.jsonl --out-dir out/sft_gpt2
torchrun --standalone --nproc_per_node 8 train_sft.py --init gpt2 --data my_sft.jsonl
"""

import math
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

import checkpoints
import cli
import common
import hf
import parallel
from common import UserError, format_sample, print0, shown_prompt
from data import (
    Order,
    builtin_task,
    encode_prompts,
    encode_sft,
    pad_right,
    read_jsonl,
    read_train_eval,
    sft_prompt,
)
from generate import sample
from model import lm_loss
from tokenizer import Tokenizer, load_tokenizer


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/sft"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- data and model
    data: Optional[str] = None
    """SFT JSONL, a record a line: {"prompt", "response"} strings, TRL's {"prompt", "completion"} (strings, or
    messages: the completion's turns learned), {"messages": [...]} (every assistant turn learned), or an episode
    {"prompt", "turns": [{"role": "assistant" | "env", "text"}, ...]} (the assistant's turns learned) (None: the
    built-in task)"""
    eval_data: Optional[str] = None
    """held-out SFT JSONL for val/loss (None: the built-in task's split, or the last 5% of --data)"""
    init: str = "scratch"
    """scratch | path/to/ckpt.pt | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local GPT-2 folder |
    hf:<name-or-path> (any Hugging Face causal LM: Llama, Qwen, ...)"""
    tokenizer: Optional[str] = None
    """--init scratch only: gpt2 | hf:<path> | a tokenizer.json (None: the built-in task's; --data needs one)"""
    n_layer: int = 4
    """layers of a scratch model"""
    n_head: int = 4
    """attention heads of a scratch model"""
    n_embd: int = 128
    """width of a scratch model"""
    block_size: int = 128
    """context length of a scratch model"""
    # --- optimisation
    batch_size: int = 64
    """sequences per optimizer step, summed over ranks"""
    micro_batch_size: int = 64
    """sequences per rank per forward, at most a rank's share of the batch (gradient accumulation makes up the rest)"""
    epochs: int = 3
    """passes over the training data (when --max-steps is not given)"""
    lr: float = 2e-3
    """peak learning rate (warm-up, then cosine to 10%); use ~1e-5..5e-5 for pretrained models"""
    warmup_steps: int = 50
    """linear warm-up steps"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices"""
    grad_clip: float = 1.0
    """global grad-norm clip (0: off)"""
    # --- evaluation
    eval_every: int = 200
    """steps between val/loss evaluations (and at the end; 0: only at the end)"""
    num_samples: int = 512
    """responses sampled at the end (held-out prompts, --temperature) for val/valid_frac and samples.jsonl"""
    eval_samples: int = 128
    """responses sampled at each intermediate evaluation"""
    temperature: float = 1.0
    """sampling temperature of the evaluation samples"""
    max_new_tokens: int = 64
    """longest sampled response"""


# -----------------------------------------------------------------------------
# SFT pieces


def collate(examples: list, pad_id: int):
    """(ids, loss_mask) pairs → inputs, targets, target mask, all (B, T-1), right-padded."""
    ids, _ = pad_right([ids for ids, _ in examples], pad_id)
    loss_mask, _ = pad_right([loss_mask for _, loss_mask in examples], 0)
    return ids[:, :-1].contiguous(), ids[:, 1:], loss_mask[:, 1:].float()  # contiguous inputs: see model.left_pack


def flops_per_token(model, examples: list) -> int:
    """Training FLOPs per input token (perf/mfu): the model's estimate at the mean input length."""
    mean_len = sum(len(ids) - 1 for ids, _ in examples) // len(examples)
    return model.flops_per_token(mean_len)


@torch.no_grad()
def sample_responses(model, tok, prompts: list, temperature: float, max_new_tokens: int, generator, batch: int = 128):
    """One response per prompt with the KV cache (batches of `batch`): [(prompt as shown (common.shown_prompt),
    response text without EOS, ended)]."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        query, query_mask = (t.to(device) for t in encode_prompts(tok, chunk))
        samples = sample(model, tok, query, query_mask, max_new_tokens, temperature, generator=generator)
        out += zip([shown_prompt(prompt) for prompt in chunk], samples.texts, samples.ended.tolist())
    return out


# -----------------------------------------------------------------------------
# main


@dataclass
class Data:
    """SFT's records, encoded for its tokenizer and context (load)."""

    task: Optional[ModuleType]  # the built-in task's module (its is_valid: val/valid_frac), or None on --data
    train: list  # encode_sft's examples
    evals: list
    prompts: list  # the held-out prompts the evaluation samples
    too_long: int  # training records skipped for the context


def load(args: Args) -> tuple[torch.nn.Module, Tokenizer, Optional[str], Data]:
    """Step 1: the data, tokenizer and model, checked before any process group; returns them and the init's
    fingerprint (--resume compares it)."""
    builtin = args.data is None
    if builtin and args.task.startswith("rg:") and args.init == "scratch":
        raise UserError(f"--task {args.task} asks a pretrained chat model (--init hf:out/smollm2), not --init scratch")
    task_module = builtin_task(args) if builtin else None
    task = task_module.build_task(args.task_dir, args.task_seed) if builtin else None
    if hasattr(task_module, "check_trainable"):  # rg: a dataset whose own answers score below 1 is refused
        task_module.check_trainable("SFT")
    train_path = task["sft"] if builtin else args.data
    eval_path = args.eval_data or (task["sft_eval"] if builtin else None)
    train_rows, eval_rows = read_train_eval(train_path, eval_path, "sft")
    if builtin:
        prompts = [row["prompt"] for row in read_jsonl(task["eval_prompts"], "prompts")]
    else:
        prompts = [sft_prompt(row) for row in eval_rows]
    if args.init == "scratch" and not builtin and args.tokenizer is None:
        raise UserError(
            "--init scratch on --data needs --tokenizer (gpt2, hf:<path> or a tokenizer.json), or an --init that "
            "brings its own (gpt2, hf:<name-or-path>, a .pt checkpoint)"
        )
    tok = load_tokenizer(args.tokenizer or task["tokenizer"]) if args.init == "scratch" else None
    scratch = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    model, tok, _ = hf.load_init(args.init, tokenizer=tok, scratch=scratch, kind=checkpoints.POLICY_KINDS)
    init_hash = checkpoints.init_fingerprint(args.init)  # what this run started from (--resume compares)
    # from scratch on the built-in task the model learns the language too: no prompt masking
    mask_prompt = not (builtin and args.init == "scratch")
    block_size = model.config.block_size
    train, too_long = encode_sft(tok, train_rows, block_size, mask_prompt)
    evals, _ = encode_sft(tok, eval_rows, block_size, mask_prompt)
    if not train:
        raise UserError(f"{args.data}: every example is longer than the context ({block_size} tokens)")
    return model, tok, init_hash, Data(task_module, train, evals, prompts, too_long)


def main(args: Args) -> None:
    t_start = time.time()
    # --resume: the run's own flags, a changed one refused
    args = checkpoints.task_from_checkpoint(args, args.init, "--init")  # --task: the init's unless given
    args = checkpoints.resume_args(args, "sft")
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)
    # 1. data, tokenizer and model (user mistakes surface here, before any process group)
    model, tok, init_hash, data = load(args)
    task_module, train, evals, prompts = data.task, data.train, data.evals, data.prompts
    builtin = task_module is not None

    # 2. distributed set-up, sizes, optimizer, resume
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, micro_batch_size, grad_accum_steps = parallel.batch_split(args.batch_size, args.micro_batch_size)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.epochs * len(train) // args.batch_size)
    common.size_warnings(args.batch_size, "--batch-size", len(train), len(evals), args.warmup_steps, max_steps)
    print0(
        f"sft: {len(train)} train / {len(evals)} eval examples ({data.too_long} too long, skipped) | "
        f"{model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {micro_batch_size} | {max_steps} steps | device {d.device} {dtype}"
    )
    parallel.prepare_model(model, args)
    parallel.place_model(model, args, d, dtype)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps)
    trained = common.Trained("model", model, optimizer, schedule, args.grad_clip)
    order = Order(len(train), args.seed)  # the global sample order, the same on every rank
    guard = common.StepGuard()
    run = checkpoints.Run("sft", args, d, tok, [trained], started=t_start)
    step = 0
    if args.resume:
        ckpt = run.resume({"init_hash": (f"--init {args.init}", init_hash)})
        step = ckpt["step"]
        order = Order(**ckpt["data_state"]["order"])
        guard.skipped = ckpt["data_state"]["skipped"]
    raw_model = model
    model = parallel.wrap_model(raw_model, d, args.compile)
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None)
    peak_flops = common.peak_flops(d.device, args.peak_flops, dtype)
    throughput = common.Throughput(flops_per_token(raw_model, train), peak_flops, d.world_size)
    amp = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)  # bf16; a no-op for fp32

    @torch.no_grad()
    def evaluate(n_samples: int) -> tuple[dict, list]:
        """val/ metrics over the held-out set and n_samples sampled responses; returns them and this rank's samples."""
        raw_model.eval()
        sums = {"nll": torch.zeros((), device=d.device), "tokens": torch.zeros((), device=d.device), "valid": 0}
        for start in range(d.rank * micro_batch_size, len(evals), d.world_size * micro_batch_size):
            micro_batch = evals[start : start + micro_batch_size]
            inputs, targets, target_mask = (t.to(d.device) for t in collate(micro_batch, tok.pad_id))
            with amp:
                logits, _ = raw_model(inputs)
            sums["nll"] += lm_loss(logits, targets, target_mask, denom=1.0)
            sums["tokens"] += target_mask.sum()
        my_prompts = prompts[d.rank : n_samples : d.world_size]
        # the same draws at every evaluation: its samples depend on the model only, never on a stop and a resume
        generator = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
        with amp:  # --dtype bfloat16: a LoRA run's frozen base is stored in bf16
            samples = sample_responses(raw_model, tok, my_prompts, args.temperature, args.max_new_tokens, generator)
        if builtin:
            sums["valid"] = sum(task_module.is_valid(response, ended) for _, response, ended in samples)
        totals = parallel.all_reduce_dict(sums, d.device)
        raw_model.train()
        val_loss = totals["nll"] / totals["tokens"]
        metrics = {"val/loss": val_loss, "val/ppl": math.exp(val_loss)}
        if builtin:
            metrics["val/valid_frac"] = totals["valid"] / n_samples
        return metrics, samples

    # 3. training loop: each step takes the next global batch of the epoch order; rank r owns a slice
    model.train()
    window = {"loss": 0.0, "tokens": 0}  # summed over the steps since the last log (this rank's share)
    window_steps = 0
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the step, exit 128 + signal
    while step < max_steps:
        if order.pos + args.batch_size > order.n:  # the epoch's remainder is dropped
            order.pos = order.n
        batch = [train[i] for i in order.take(args.batch_size)]
        lr = common.step_lr(trained, step)
        # the loss is divided by the global count of target tokens of the step (same gradient on any world size)
        target_tokens = sum(sum(loss_mask[1:]) for _, loss_mask in batch)
        my_batch = batch[d.rank * per_rank : (d.rank + 1) * per_rank]
        for micro_step in range(grad_accum_steps):
            micro_batch = my_batch[micro_step * micro_batch_size :][:micro_batch_size]
            inputs, targets, target_mask = (t.to(d.device) for t in collate(micro_batch, tok.pad_id))
            last_micro_step = micro_step == grad_accum_steps - 1
            with parallel.grad_sync(model, last_micro_step), amp:
                logits, _ = model(inputs)
                # DDP averages gradients over ranks: scale up so the result is the sum over the global batch / denom
                loss = lm_loss(logits, targets, target_mask, denom=target_tokens) * d.world_size
                loss.backward()
            window["loss"] += loss.detach() / d.world_size
            window["tokens"] += sum(len(ids) - 1 for ids, _ in micro_batch)
        common.guarded_step([trained], guard, step)
        step += 1
        window_steps += 1
        stopping = stop.requested(d.device)

        if (args.log_every > 0 and step % args.log_every == 0) or step == max_steps:
            totals = parallel.all_reduce_dict(window, d.device)
            metrics = {"train/loss": totals["loss"] / window_steps, "train/lr": lr}
            logger.log(step, metrics | guard.read() | throughput.read(totals["tokens"]), max_steps)
            window = {"loss": 0.0, "tokens": 0}
            window_steps = 0
        final = step == max_steps
        with throughput.paused():  # perf/ counts training time only
            if stopping:  # a signal: the save first, inside the grace period (this step's evaluation is skipped)
                run.save(step, dict(order=order.state_dict(), skipped=guard.skipped), init_hash=init_hash)
                logger.close()
                stop.exit(stopping, run.path)
            if (args.eval_every > 0 and step % args.eval_every == 0) or final:
                with parallel.gathered(raw_model):  # no collectives inside: ranks run unequal numbers of forwards
                    metrics, samples = evaluate(args.num_samples if final else args.eval_samples)
                logger.log(step, metrics, max_steps)
                shown = [format_sample(prompt, response, ended) for prompt, response, ended in samples]
                logger.text("samples", "\n\n".join(shown[:8]), step)
            if final:
                records = []
                for prompt, response, ended in samples:
                    valid = task_module.is_valid(response, ended) if builtin else None
                    records.append({"prompt": prompt, "response": response, "ended": ended, "valid": valid})
                logger.samples(step, records)
            if (args.save_every > 0 and step % args.save_every == 0) or final:
                run.save(step, dict(order=order.state_dict(), skipped=guard.skipped), init_hash=init_hash)

    stop.close()
    # 4. a few samples to look at
    for line in shown[:5]:
        print0(f"  {line}")
    if args.export_hf and d.master:
        checkpoints.export_hf(raw_model, tok, args.export_hf)
    print0(
        f"sft done in {time.time() - t_start:.0f}s: {run.path}"
        + (f" | val/valid_frac {metrics['val/valid_frac']:.3f}" if builtin else "")
    )
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
