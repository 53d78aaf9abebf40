"""Supervised fine-tuning: next-token loss on prompt → response demonstrations.

On the built-in task from scratch (the default) the loss covers prompt and response tokens, so one run teaches the
tiny model the language and the task; from a pretrained model or on your own data, prompt tokens are masked out.

python train_sft.py                                                   # built-in task, tiny model, CPU, ~2-3 min
python train_sft.py --init gpt2 --data my_sft.jsonl --out-dir out/sft_gpt2
torchrun --standalone --nproc_per_node 8 train_sft.py --init gpt2 --data my_sft.jsonl
"""

import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import hf
from common import UserError, print0
from data import build_task, encode_sft, is_valid, load_tokenizer, pad_left, pad_right, read_jsonl
from model import lm_loss


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
    ids, _ = pad_right([e[0] for e in examples], pad_id)
    lmask, _ = pad_right([e[1] for e in examples], 0)
    return ids[:, :-1], ids[:, 1:], lmask[:, 1:].float()


@torch.no_grad()
def sample_responses(model, tok, prompts: list, temperature: float, max_new_tokens: int, generator, batch: int = 128):
    """Sample one response per prompt with the KV cache; returns [(prompt, response_text, ended)]."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        idx, mask = pad_left([tok.encode(p) for p in chunk], tok.pad_id)
        dev = next(model.parameters()).device
        max_new = min(max_new_tokens, model.config.block_size - idx.shape[1])
        resp, rmask, _ = model.generate(
            idx.to(dev), mask.to(dev), max_new, tok.eos_id, tok.pad_id, temperature=temperature, generator=generator
        )
        for p, r, m in zip(chunk, resp.tolist(), rmask.tolist()):
            n = int(sum(m))
            ended = n > 0 and r[n - 1] == tok.eos_id
            out.append((p, tok.decode(r[: n - 1] if ended else r[:n]), ended))
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
        prompts = [r["prompt"] for r in read_jsonl(task["eval_prompts"], "prompts")]
    else:
        prompts = [r["prompt"] for r in eval_rows]
    tok = load_tokenizer(args.tokenizer or task["tokenizer"]) if args.init == "scratch" else None
    if args.init == "scratch" and tok is None:
        raise UserError("--init scratch on --data needs --tokenizer (gpt2, hf:<path> or a tokenizer.json)")
    scratch = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    model, tok, _ = hf.load_init(args.init, tokenizer=tok, scratch=scratch)
    # from scratch on the built-in task the model learns the language too: no prompt masking
    mask_prompt = not (builtin and args.init == "scratch")
    train, n_skip = encode_sft(tok, train_rows, model.config.block_size, mask_prompt)
    evals, _ = encode_sft(tok, eval_rows, model.config.block_size, mask_prompt)
    if not train:
        raise UserError(f"{args.data}: every example is longer than the context ({model.config.block_size} tokens)")

    # 2. distributed set-up, sizes, optimizer
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, mbs, grad_accum_steps = common.batch_split(args.batch_size, args.micro_batch_size)
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.epochs * len(train) // args.batch_size)
    print0(
        f"sft: {len(train)} train / {len(evals)} eval examples ({n_skip} too long, skipped) | "
        f"{model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {mbs} | {max_steps} steps | device {d.device} {dtype}"
    )
    model.to(d.device)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
    step, seconds, epoch, pos, skipped = 0, 0.0, 0, 0, 0
    perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    init_hash = common.file_sha256(args.init) if args.init.endswith(".pt") else None  # what this run started from
    if args.resume:
        ck = common.load_resume(
            ckpt_path, "sft", d.world_size, max_steps, {"init_hash": (f"--init {args.init}", init_hash)}
        )
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, seconds = ck["step"], ck["seconds"]
        epoch, pos, perm, skipped = (ck["data_state"][k] for k in ("epoch", "pos", "perm", "skipped"))
        common.set_rng_state(ck["rng"][d.rank], sampler)
        print0(f"resumed from {ckpt_path} at step {step}")
    raw_model = model
    if d.device.type == "cuda" and args.compile:
        model = torch.compile(model)
    if d.ddp:
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None)
    peak = common.peak_flops(d.device, args.peak_flops)
    flops_per_token = raw_model.flops_per_token(sum(len(e[0]) for e in train) // len(train))

    def save(step: int) -> None:
        rngs = common.all_rng_states(sampler)
        if d.master:
            common.save_checkpoint(
                dict(
                    kind="sft",
                    model=raw_model.state_dict(),
                    model_config=asdict(raw_model.config),
                    init_hash=init_hash,
                    tokenizer=tok.state(),
                    args=asdict(args),
                    step=step,
                    optimizer=optimizer.state_dict(),
                    scheduler=dict(lr=args.lr, warmup_steps=args.warmup_steps, max_steps=max_steps),
                    rng=rngs,
                    data_state=dict(epoch=epoch, pos=pos, perm=perm, skipped=skipped),
                    world_size=d.world_size,
                    seconds=seconds + time.time() - t_start,
                ),
                ckpt_path,
            )

    @torch.no_grad()
    def evaluate(n_samples: int) -> dict:
        raw_model.eval()
        sums = torch.zeros(3, device=d.device)  # nll sum, token count, valid samples
        for i in range(d.rank * mbs, len(evals), d.world_size * mbs):
            x, y, m = (t.to(d.device) for t in collate(evals[i : i + mbs], tok.pad_id))
            with common.autocast(d.device, dtype):
                logits, _ = raw_model(x)
            sums[0] += lm_loss(logits, y, m, denom=1.0)
            sums[1] += m.sum()
        samples = sample_responses(
            raw_model, tok, prompts[d.rank : n_samples : d.world_size], args.temperature, args.max_new_tokens, sampler
        )
        if builtin:
            sums[2] += sum(is_valid(r, e) for _, r, e in samples)
        common.all_reduce_sum(sums)
        raw_model.train()
        out = {"val/loss": (sums[0] / sums[1]).item(), "val/ppl": (sums[0] / sums[1]).exp().item()}
        if builtin:
            out["val/valid_frac"] = sums[2].item() / n_samples
        return out, samples

    # 3. training loop: each step takes the next global batch of the epoch permutation; rank r owns a slice
    model.train()
    skipped_in_row, t_last, tokens_since = 0, time.time(), 0
    while step < max_steps:
        if pos + args.batch_size > len(train):  # new epoch, new permutation (the remainder is dropped)
            epoch, pos = epoch + 1, 0
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch))
        batch = [train[i] for i in perm[pos : pos + args.batch_size].tolist()]
        pos += args.batch_size
        lr = common.lr_at(step, max_steps, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # the loss is divided by the global count of target tokens of the step (same gradient on any world size)
        denom = sum(sum(m[1:]) for _, m in batch)
        mine = batch[d.rank * per_rank : (d.rank + 1) * per_rank]
        loss_sum = torch.zeros((), device=d.device)
        for micro in range(grad_accum_steps):
            x, y, m = (t.to(d.device) for t in collate(mine[micro * mbs :][:mbs], tok.pad_id))
            sync = micro == grad_accum_steps - 1 or not d.ddp
            with nullcontext() if sync else model.no_sync(), common.autocast(d.device, dtype):
                logits, _ = model(x)
                # DDP averages gradients over ranks: scale up so the result is the sum over the global batch / denom
                loss = lm_loss(logits, y, m, denom=denom) * d.world_size
                loss.backward()
            loss_sum += loss.detach() / d.world_size
            tokens_since += x.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf"))
        # nan/inf guard: the norm is computed after the all-reduce, so every rank takes the same decision
        if torch.isfinite(grad_norm):
            optimizer.step()
            skipped_in_row = 0
        else:
            skipped, skipped_in_row = skipped + 1, skipped_in_row + 1
            print0(f"step {step}: non-finite grad norm ({grad_norm.item()}, loss {loss_sum.item()}), step skipped")
            if skipped_in_row >= 10:
                raise RuntimeError(f"{skipped_in_row} non-finite steps in a row: lower --lr or check the data")
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % args.log_every == 0 or step == max_steps:
            common.all_reduce_sum(loss_sum)
            dt = time.time() - t_last
            tps = tokens_since * d.world_size / dt
            logger.log(
                step,
                {
                    "train/loss": loss_sum.item(),
                    "train/lr": lr,
                    "train/grad_norm": grad_norm.item(),
                    "train/skipped_steps": skipped,
                    "perf/tokens_per_sec": tps,
                    "perf/mfu": tps * flops_per_token / (peak * d.world_size),
                },
                max_steps,
            )
            t_last, tokens_since = time.time(), 0
        final = step == max_steps
        if step % args.eval_every == 0 or final:
            metrics, samples = evaluate(args.num_samples if final else args.eval_samples)
            logger.log(step, metrics, max_steps)
            logger.text("samples", "\n\n".join(f"{p}{r}{'' if e else ' [no EOS]'}" for p, r, e in samples[:8]), step)
            if final:
                records = [
                    {"prompt": p, "response": r, "ended": e, "valid": is_valid(r, e) if builtin else None}
                    for p, r, e in samples
                ]
                logger.samples(step, records)
        if (args.save_every and step % args.save_every == 0) or final:
            save(step)

    # 4. a few samples to look at
    for p, r, e in samples[:5]:
        print0(f"  {p}{r}{'' if e else ' [no EOS]'}")
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
