"""Supervised fine-tuning: next-token loss on prompt → response demonstrations.

On the built-in task from scratch (the default) the loss covers prompt and response tokens, so one run teaches the
tiny model the language and the task; from a pretrained model or on your own data, prompt tokens are masked out.

python train_sft.py                                                   # built-in task, tiny model, CPU, ~2-3 min
python train_sft.py --init gpt2 --data my_sft.jsonl --out-dir out/sft_gpt2
torchrun --standalone --nproc_per_node 8 train_sft.py --init gpt2 --data my_sft.jsonl
"""

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import tyro

import common
import hf
from common import UserError, print0
from data import Order, encode_sft, load_tokenizer, pad_left, pad_right, read_jsonl
from model import lm_loss
from task import build_task, is_valid


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/sft"
    """where ckpt.pt, TensorBoard event files and samples.jsonl go"""
    # --- data and model
    data: Optional[str] = None
    """SFT JSONL, one {"prompt": str, "response": str} a line (None: the built-in task)"""
    eval_data: Optional[str] = None
    """held-out SFT JSONL for val/loss (None: the built-in task's split, or the last 5% of --data)"""
    init: str = "scratch"
    """scratch | path/to/ckpt.pt | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local GPT-2 folder"""
    tokenizer: Optional[str] = None
    """only with --init scratch on --data: gpt2 | hf:<path> | a tokenizer.json (None: the built-in task's)"""
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
    """steps between val/loss evaluations (and at the end)"""
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
    return ids[:, :-1], ids[:, 1:], loss_mask[:, 1:].float()


def flops_per_token(model, examples: list) -> int:
    """Training FLOPs per input token (perf/mfu): the model's estimate at the mean input length."""
    mean_len = sum(len(ids) - 1 for ids, _ in examples) // len(examples)
    return model.flops_per_token(mean_len)


@torch.no_grad()
def sample_responses(model, tok, prompts: list, temperature: float, max_new_tokens: int, generator, batch: int = 128):
    """Sample one response per prompt with the KV cache; returns [(prompt, response_text, ended)]."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        prompt_ids, prompt_mask = pad_left([tok.encode(prompt, bos=True) for prompt in chunk], tok.pad_id)
        max_new = min(max_new_tokens, model.config.block_size - prompt_ids.shape[1])
        responses, response_mask, _ = model.generate(
            prompt_ids.to(device),
            prompt_mask.to(device),
            max_new,
            tok.eos_id,
            tok.pad_id,
            temperature=temperature,
            generator=generator,
        )
        for prompt, response, mask in zip(chunk, responses.tolist(), response_mask.tolist()):
            length = int(sum(mask))
            ended = length > 0 and response[length - 1] == tok.eos_id
            out.append((prompt, tok.decode(response[: length - 1] if ended else response[:length]), ended))
    return out


# -----------------------------------------------------------------------------
# main


def main(args: Args) -> None:
    t_start = time.time()
    common.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)
    # 1. data, tokenizer and model (user mistakes surface here, before any process group)
    builtin = args.data is None
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    train_rows = read_jsonl(task["sft"] if builtin else args.data, "sft")
    if args.eval_data or builtin:
        eval_rows = read_jsonl(args.eval_data or task["sft_eval"], "sft")
    else:
        n_eval = max(1, len(train_rows) // 20)
        train_rows, eval_rows = train_rows[:-n_eval], train_rows[-n_eval:]
    if builtin:
        prompts = [row["prompt"] for row in read_jsonl(task["eval_prompts"], "prompts")]
    else:
        prompts = [row["prompt"] for row in eval_rows]
    tok = load_tokenizer(args.tokenizer or task["tokenizer"]) if args.init == "scratch" else None
    if args.init == "scratch" and tok is None:
        raise UserError("--init scratch on --data needs --tokenizer (gpt2, hf:<path> or a tokenizer.json)")
    scratch = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    model, tok, _ = hf.load_init(args.init, tokenizer=tok, scratch=scratch)
    # from scratch on the built-in task the model learns the language too: no prompt masking
    mask_prompt = not (builtin and args.init == "scratch")
    block_size = model.config.block_size
    train, n_too_long = encode_sft(tok, train_rows, block_size, mask_prompt)
    evals, _ = encode_sft(tok, eval_rows, block_size, mask_prompt)
    if not train:
        raise UserError(f"{args.data}: every example is longer than the context ({block_size} tokens)")

    # 2. distributed set-up, sizes, optimizer, resume
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, micro_batch_size, grad_accum_steps = common.batch_split(args.batch_size, args.micro_batch_size)
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.epochs * len(train) // args.batch_size)
    print0(
        f"sft: {len(train)} train / {len(evals)} eval examples ({n_too_long} too long, skipped) | "
        f"{model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {micro_batch_size} | {max_steps} steps | device {d.device} {dtype}"
    )
    common.prepare_model(model, args)
    common.place_model(model, args, d, dtype)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
    order = Order(len(train), args.seed)  # the global sample order, the same on every rank
    guard = common.StepGuard()
    step = 0
    seconds = 0.0  # wall time of the earlier sittings of this run
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    init_hash = common.file_sha256(args.init) if args.init.endswith(".pt") else None  # what this run started from
    if args.resume:
        inputs = {"init_hash": (f"--init {args.init}", init_hash)}
        ckpt = common.resume(ckpt_path, "sft", d, max_steps, inputs, model, optimizer, sampler)
        step = ckpt["step"]
        seconds = ckpt["seconds"]
        order = Order(**ckpt["data_state"]["order"])
        guard.skipped = ckpt["data_state"]["skipped"]
    raw_model = model
    model = common.wrap_model(raw_model, d, args.compile)
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None)
    peak_flops = common.peak_flops(d.device, args.peak_flops)
    throughput = common.Throughput(flops_per_token(raw_model, train), peak_flops, d.world_size)

    def save(step: int) -> None:
        rngs = common.all_rng_states(sampler)
        # under --fsdp every rank gathers the weights and saves its optimizer shard; rank 0 writes ckpt.pt
        state = common.training_state(raw_model, optimizer, args.out_dir)
        if d.master:
            common.save_checkpoint(
                dict(
                    kind="sft",
                    **state,
                    model_config=asdict(raw_model.config),
                    init_hash=init_hash,
                    tokenizer=tok.state(),
                    args=asdict(args),
                    step=step,
                    scheduler=dict(lr=args.lr, warmup_steps=args.warmup_steps, max_steps=max_steps),
                    rng=rngs,
                    data_state=dict(order=order.state_dict(), skipped=guard.skipped),
                    world_size=d.world_size,
                    seconds=seconds + time.time() - t_start,
                ),
                ckpt_path,
            )

    @torch.no_grad()
    def evaluate(n_samples: int) -> tuple[dict, list]:
        """val/ metrics over the held-out set and n_samples sampled responses; returns them and this rank's samples."""
        raw_model.eval()
        sums = {"nll": torch.zeros((), device=d.device), "tokens": torch.zeros((), device=d.device), "valid": 0}
        for start in range(d.rank * micro_batch_size, len(evals), d.world_size * micro_batch_size):
            micro_batch = evals[start : start + micro_batch_size]
            inputs, targets, target_mask = (t.to(d.device) for t in collate(micro_batch, tok.pad_id))
            with common.autocast(d.device, dtype):
                logits, _ = raw_model(inputs)
            sums["nll"] += lm_loss(logits, targets, target_mask, denom=1.0)
            sums["tokens"] += target_mask.sum()
        my_prompts = prompts[d.rank : n_samples : d.world_size]
        samples = sample_responses(raw_model, tok, my_prompts, args.temperature, args.max_new_tokens, sampler)
        if builtin:
            sums["valid"] = sum(is_valid(response, ended) for _, response, ended in samples)
        totals = common.all_reduce_dict(sums, d.device)
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
    while step < max_steps:
        if order.pos + args.batch_size > order.n:  # the epoch's remainder is dropped
            order.pos = order.n
        batch = [train[i] for i in order.take(args.batch_size)]
        lr = common.lr_at(step, max_steps, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # the loss is divided by the global count of target tokens of the step (same gradient on any world size)
        target_tokens = sum(sum(loss_mask[1:]) for _, loss_mask in batch)
        my_batch = batch[d.rank * per_rank : (d.rank + 1) * per_rank]
        for micro_step in range(grad_accum_steps):
            micro_batch = my_batch[micro_step * micro_batch_size :][:micro_batch_size]
            inputs, targets, target_mask = (t.to(d.device) for t in collate(micro_batch, tok.pad_id))
            last_micro_step = micro_step == grad_accum_steps - 1
            with common.grad_sync(model, last_micro_step), common.autocast(d.device, dtype):
                logits, _ = model(inputs)
                # DDP averages gradients over ranks: scale up so the result is the sum over the global batch / denom
                loss = lm_loss(logits, targets, target_mask, denom=target_tokens) * d.world_size
                loss.backward()
            window["loss"] += loss.detach() / d.world_size
            window["tokens"] += sum(len(ids) - 1 for ids, _ in micro_batch)
        common.clip_and_step(optimizer, raw_model.parameters(), args.grad_clip, guard, step)
        step += 1
        window_steps += 1

        if step % args.log_every == 0 or step == max_steps:
            totals = common.all_reduce_dict(window, d.device)
            metrics = {"train/loss": totals["loss"] / window_steps, "train/lr": lr}
            logger.log(step, metrics | guard.read() | throughput.read(totals["tokens"]), max_steps)
            window = {"loss": 0.0, "tokens": 0}
            window_steps = 0
        final = step == max_steps
        with throughput.paused():  # perf/ counts training time only
            if step % args.eval_every == 0 or final:
                with common.gathered(raw_model):  # no collectives inside: ranks run unequal numbers of forwards
                    metrics, samples = evaluate(args.num_samples if final else args.eval_samples)
                logger.log(step, metrics, max_steps)
                shown = [f"{prompt}{response}{'' if ended else ' [no EOS]'}" for prompt, response, ended in samples]
                logger.text("samples", "\n\n".join(shown[:8]), step)
            if final:
                records = []
                for prompt, response, ended in samples:
                    valid = is_valid(response, ended) if builtin else None
                    records.append({"prompt": prompt, "response": response, "ended": ended, "valid": valid})
                logger.samples(step, records)
            if (args.save_every and step % args.save_every == 0) or final:
                save(step)

    # 4. a few samples to look at
    for line in shown[:5]:
        print0(f"  {line}")
    if args.export_hf and d.master:
        common.export_hf(raw_model, tok, args.export_hf)
    print0(
        f"sft done in {time.time() - t_start:.0f}s: {ckpt_path}"
        + (f" | val/valid_frac {metrics['val/valid_frac']:.3f}" if builtin else "")
    )
    logger.close()
    common.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
