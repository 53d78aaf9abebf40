"""Reward model: a GPT trunk with a scalar head, trained on preference pairs with the Bradley-Terry loss.

The score of prompt + response is the scalar head at the EOS token. The loss is -log σ(r_chosen - r_rejected) plus
--lm-coef × the next-token loss on the chosen response (the LM-regularised RM of the PPO-max paper,
https://arxiv.org/abs/2307.04964 §4: the RM keeps being a language model). K-wise rankings put all K(K-1)/2 pairs of
a prompt into one batch, weighted to sum to 1 (InstructGPT, https://arxiv.org/abs/2203.02155 §3.5). After training,
the mean score of --calib-data is folded into the head's bias, so a typical SFT answer scores 0.

python train_rm.py                                                    # built-in task, from out/sft/ckpt.pt, CPU
python train_rm.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl --lr 1e-5 --out-dir out/rm_gpt2
torchrun --standalone --nproc_per_node 8 train_rm.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl
"""

import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import hf
from common import UserError, print0
from data import (
    PROBE_KINDS,
    build_task,
    calibration_error,
    encode_prefs,
    gold_reward,
    load_tokenizer,
    pad_right,
    probe_texts,
    read_jsonl,
    responses_of,
)
from model import lm_loss, score_seqs, sequence_scores


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/rm"
    """where ckpt.pt, TensorBoard event files and samples.jsonl (scored held-out pairs) go"""
    # --- data and model
    data: Optional[str] = None
    """preference JSONL: {"prompt", "chosen", "rejected"} or {"prompt", "responses", "ranking"} (None: built-in)"""
    eval_data: Optional[str] = None
    """held-out preference JSONL (None: the built-in task's split, or the last 5% of --data)"""
    calib_data: Optional[str] = None
    """SFT JSONL whose mean score is folded into the head's bias (None: built-in SFT demos, or --data's chosen)"""
    calib_size: int = 2048
    """calibration examples used (the first ones; 0: all)"""
    init: str = "out/sft/ckpt.pt"
    """path/to/ckpt.pt | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local GPT-2 folder (gains a fresh score head)"""
    # --- optimisation
    batch_size: int = 64
    """preference records (prompts) per optimizer step, summed over ranks"""
    micro_batch_size: int = 16
    """records per rank per forward, at most a rank's share of the batch (gradient accumulation makes up the rest; a
    rank's records are sorted by length first, so small micro-batches waste little on padding)"""
    epochs: int = 1
    """passes over the training data (when --max-steps is not given); the LR anneals to 0 at the end"""
    lr: float = 1e-3
    """peak learning rate (warm-up, then cosine to 0); use ~1e-5 for pretrained models"""
    warmup_steps: int = 20
    """linear warm-up steps"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices"""
    grad_clip: float = 1.0
    """global grad-norm clip (0: off)"""
    lm_coef: float = 0.5
    """weight of the next-token loss on the chosen response (0: pure Bradley-Terry)"""
    # --- evaluation
    eval_every: int = 100
    """steps between evaluations (and at the end)"""
    eval_pairs: int = 512
    """held-out records (and calibration examples) scored at each intermediate evaluation (the final one: all)"""
    probe_size: int = 128
    """hackability-probe texts per kind (built-in task)"""


# -----------------------------------------------------------------------------
# reward-model pieces: pure functions, imported by tests


def preference_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    denom: Optional[float] = None,
) -> torch.Tensor:
    """Weighted mean of -log σ(r_chosen - r_rejected) over pairs (N,); logsigmoid keeps it finite at any margin.
    denom replaces the sum of weights (the training loop passes the global pair weight of the step)."""
    nll = -F.logsigmoid(r_chosen.float() - r_rejected.float())  # (N,)
    w = torch.ones_like(nll) if weights is None else weights.to(nll)
    return (w * nll).sum() / (w.sum() if denom is None else denom)


def collate(examples: list, pad_id: int):
    """Every response of every example as one right-padded batch: ids, mask (N, T); chosen and rejected row indices
    and weights (P,) of every pair; lm_mask (N, T), 1 on the best responses' own tokens (response + EOS)."""
    seqs, chosen, rejected, weights, lm_rows = [], [], [], [], []
    for ex_seqs, n_prompt, pairs, best, _ in examples:
        base = len(seqs)
        seqs += ex_seqs
        for i, j, w in pairs:
            chosen.append(base + i), rejected.append(base + j), weights.append(w)
        lm_rows.append((base + best, n_prompt))
    ids, mask = pad_right(seqs, pad_id)
    lm_mask = torch.zeros_like(mask)
    for row, n_prompt in lm_rows:
        lm_mask[row, n_prompt:] = mask[row, n_prompt:]
    return ids, mask, torch.tensor(chosen), torch.tensor(rejected), torch.tensor(weights), lm_mask


@torch.no_grad()
def fold_score_offset(model, offset: float) -> None:
    """Subtract offset from every score the model gives by folding it into the scalar head's bias."""
    model.score_head.bias -= offset


# -----------------------------------------------------------------------------
# main


def main(args: Args) -> None:
    t_start = time.time()
    common.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)  # before the model: the fresh score head's init
    # 1. data, tokenizer and model (user mistakes surface here, before any process group)
    builtin = args.data is None
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    train_rows = read_jsonl(task["pairs"] if builtin else args.data, "pairs")
    if args.eval_data or builtin:
        eval_rows = read_jsonl(args.eval_data or task["pairs_eval"], "pairs")
    else:
        n_eval = max(1, len(train_rows) // 20)
        train_rows, eval_rows = train_rows[:-n_eval], train_rows[-n_eval:]
    if args.calib_data or builtin:
        calib_rows = read_jsonl(args.calib_data or task["sft"], "sft")
    else:  # on user data the chosen (best) responses
        calib_rows = [
            {"prompt": r["prompt"], "response": responses_of(r)[r.get("ranking", [0])[0]]} for r in train_rows
        ]
    calib_rows = calib_rows[: args.calib_size or None]
    if args.init == "scratch" and not builtin:
        raise UserError("--init scratch only works on the built-in task; pass an SFT checkpoint or gpt2")
    task_tok = load_tokenizer(task["tokenizer"]) if builtin else None
    model, tok, _ = hf.load_init(args.init, tokenizer=task_tok, score_head=True, kind=("sft", "rm"))
    if builtin and tok.state() != task_tok.state():
        raise UserError(f"--init {args.init}: its tokenizer is not the built-in task's ({task['tokenizer']})")
    block_size = model.config.block_size
    train, n_skip = encode_prefs(tok, train_rows, block_size)
    evals, _ = encode_prefs(tok, eval_rows, block_size)
    calib = [
        s
        for s in (tok.encode(r["prompt"]) + tok.encode(r["response"]) + [tok.eos_id] for r in calib_rows)
        if len(s) <= block_size
    ]
    if not train or not evals or not calib:
        raise UserError(
            f"{args.data or task['pairs']}: no preference record (or no held-out or calibration one) "
            f"fits the context ({block_size} tokens)"
        )
    probes = []  # hackability probe: (kind, ids), degenerate texts and fluent positive reviews on held-out prompts
    if builtin:
        prompts = [r["prompt"] for r in read_jsonl(task["eval_prompts"], "prompts")]
        for r in probe_texts(prompts, args.probe_size, seed=args.task_seed):
            ids = tok.encode(r["prompt"]) + tok.encode(r["response"]) + ([tok.eos_id] if r["ended"] else [])
            if len(ids) <= block_size:
                probes.append((r["kind"], ids))
    # gold of every held-out pair (built-in task): the Bayes ceiling and the RM's agreement with the gold order
    eval_pairs = [(e, i, j, w) for e in range(len(evals)) for i, j, w in evals[e][2]]
    golds = [[gold_reward(ex[4]["prompt"], r, True) for r in responses_of(ex[4])] for ex in evals] if builtin else None
    per_kind = {}  # probe score by kind, filled by evaluate()

    # 2. distributed set-up, sizes, optimizer
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, mbs, grad_accum_steps = common.batch_split(args.batch_size, args.micro_batch_size)
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.epochs * len(train) // args.batch_size)
    print0(
        f"rm: {len(train)} train / {len(evals)} eval records ({n_skip} too long, skipped) | {len(calib)} calibration"
        f" | {model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {mbs} | {max_steps} steps | lm_coef {args.lm_coef} | "
        f"device {d.device} {dtype}"
    )
    model.to(d.device)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    step, seconds, epoch, pos, skipped, score_offset = 0, 0.0, 0, 0, 0, 0.0
    perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    init_hash = common.file_sha256(args.init) if args.init.endswith(".pt") else None  # what this run started from
    if args.resume:
        ck = common.load_resume(
            ckpt_path, "rm", d.world_size, max_steps, {"init_hash": (f"--init {args.init}", init_hash)}
        )
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, seconds, score_offset = ck["step"], ck["seconds"], ck["score_offset"]
        epoch, pos, perm, skipped = (ck["data_state"][k] for k in ("epoch", "pos", "perm", "skipped"))
        common.set_rng_state(ck["rng"][d.rank])
        print0(f"resumed from {ckpt_path} at step {step}")
    raw_model = model
    if d.device.type == "cuda" and args.compile:
        model = torch.compile(model)
    if d.ddp:
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None)
    peak = common.peak_flops(d.device, args.peak_flops)
    flops_per_token = raw_model.flops_per_token(
        sum(len(s) for ex in train for s in ex[0]) // sum(len(ex[0]) for ex in train)
    )

    def score_all(seqs: list) -> torch.Tensor:
        """Scores (N,) on every rank; rank r scores seqs[r::world_size]."""
        mine = score_seqs(raw_model, seqs[d.rank :: d.world_size], tok.pad_id, 64, d.device, dtype)
        if not d.ddp:
            return mine
        parts, out = [None] * d.world_size, torch.zeros(len(seqs))
        dist.all_gather_object(parts, mine)
        for r, part in enumerate(parts):
            out[r :: d.world_size] = part
        return out

    def save(step: int) -> None:
        # calibration: fold the calibration mean into the head's bias; the Bradley-Terry loss only sees score
        # differences (and the LM loss never sees the head), so folding mid-run changes no later update
        nonlocal score_offset
        offset = score_all(calib).mean().item()
        fold_score_offset(raw_model, offset)
        score_offset += offset
        rngs = common.all_rng_states()
        if d.master:
            common.save_checkpoint(
                dict(
                    kind="rm",
                    model=raw_model.state_dict(),
                    model_config=asdict(raw_model.config),
                    init_hash=init_hash,
                    tokenizer=tok.state(),
                    args=asdict(args),
                    step=step,
                    optimizer=optimizer.state_dict(),
                    scheduler=dict(lr=args.lr, warmup_steps=args.warmup_steps, max_steps=max_steps, min_lr_ratio=0.0),
                    rng=rngs,
                    data_state=dict(epoch=epoch, pos=pos, perm=perm, skipped=skipped),
                    world_size=d.world_size,
                    seconds=seconds + time.time() - t_start,
                    score_offset=score_offset,
                ),
                ckpt_path,
            )

    def evaluate(n_records: int, offset: float) -> tuple[dict, torch.Tensor, list]:
        """Held-out metrics, gaps (P,) and scored pairs of the first n_records records; scores minus offset."""
        pairs = [p for p in eval_pairs if p[0] < n_records]
        starts = [0]
        for ex in evals[:n_records]:
            starts.append(starts[-1] + len(ex[0]))
        scores = score_all([s for ex in evals[:n_records] for s in ex[0]]) - offset
        r_c = scores[[starts[e] + i for e, i, _, _ in pairs]]
        r_r = scores[[starts[e] + j for e, _, j, _ in pairs]]
        w = torch.tensor([p[3] for p in pairs], dtype=torch.double)
        gaps = r_c - r_r  # (P,)
        out = {
            "val/accuracy": (w * ((gaps > 0) + 0.5 * (gaps == 0))).sum().item() / w.sum().item(),
            "val/margin": (w * gaps).sum().item() / w.sum().item(),
            "val/ece": calibration_error(gaps),
        }
        g_gap = torch.tensor([golds[e][i] - golds[e][j] for e, i, j, _ in pairs] if builtin else [])
        if builtin:  # the gold model's accuracy on the drawn labels (ties 1/2); the RM's on the gold order (no ties)
            out["val/bayes_ceiling"] = (w * ((g_gap > 0) + 0.5 * (g_gap == 0))).sum().item() / w.sum().item()
            out["val/gold_agreement"] = ((gaps * g_gap)[g_gap != 0] > 0).double().mean().item()
            probe_scores = score_all([ids for _, ids in probes]) - offset
            kinds = [k for k, _ in probes]
            for k in PROBE_KINDS:
                per_kind[k] = probe_scores[[n for n, x in enumerate(kinds) if x == k]].mean().item()
            degenerate = [n for n, k in enumerate(kinds) if k != "fluent"]
            out["probe/degenerate_score"] = probe_scores[degenerate].mean().item()
            out["probe/fluent_score"] = per_kind["fluent"]
        scored = []  # samples.jsonl records
        for n, (e, i, j, _) in enumerate(pairs):
            row, texts = evals[e][4], responses_of(evals[e][4])
            scored.append(
                {
                    "prompt": row["prompt"],
                    "chosen": texts[i],
                    "rejected": texts[j],
                    "score_chosen": r_c[n].item(),
                    "score_rejected": r_r[n].item(),
                }
            )
            if builtin:
                scored[-1] |= {"gold_chosen": golds[e][i], "gold_rejected": golds[e][j]}
        return out, gaps, scored

    # 3. training loop: each step takes the next global batch of the epoch permutation; rank r owns a slice
    # dropout off (DESIGN §2): the model stays in eval mode, the only thing the mode changes in a GPT
    model.eval()
    skipped_in_row, t_last, tokens_since = 0, time.time(), 0
    sums = torch.zeros(4, device=d.device)  # loss, bt_loss, lm_loss, accuracy summed over the steps since the last log
    steps_since = 0
    while step < max_steps:
        if pos + args.batch_size > len(train):  # new epoch, new permutation (the remainder is dropped)
            epoch, pos = epoch + 1, 0
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch))
        batch = [train[i] for i in perm[pos : pos + args.batch_size].tolist()]
        pos += args.batch_size
        lr = common.lr_at(step, max_steps, args.lr, args.warmup_steps, min_lr_ratio=0.0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # losses are divided by global counts of the step (pairs weigh 1 per record; LM: best-response tokens)
        pair_denom = float(len(batch))
        lm_denom = float(sum(len(ex[0][ex[3]]) - ex[1] for ex in batch))
        # sorted by length: each micro-batch pads to its own longest sequence (the gradient does not depend on it)
        mine = sorted(batch[d.rank * per_rank : (d.rank + 1) * per_rank], key=lambda ex: max(map(len, ex[0])))
        for micro in range(grad_accum_steps):
            ids, mask, ci, ri, w, lm_mask = (t.to(d.device) for t in collate(mine[micro * mbs :][:mbs], tok.pad_id))
            sync = micro == grad_accum_steps - 1 or not d.ddp
            with nullcontext() if sync else model.no_sync(), common.autocast(d.device, dtype):
                logits, scores = model(ids, logits=args.lm_coef > 0)  # right padding: no attention mask needed
                r = sequence_scores(scores.float(), mask)  # (N,) score at each response's EOS
                bt = preference_loss(r[ci], r[ri], w, denom=pair_denom)
                lm = lm_loss(logits[:, :-1], ids[:, 1:], lm_mask[:, 1:], lm_denom) if args.lm_coef > 0 else bt * 0
                loss = bt + args.lm_coef * lm
                # DDP averages gradients over ranks: scale up so the result is the sum over the global batch / denom
                (loss * d.world_size).backward()
            correct = (w * ((r[ci] > r[ri]) + 0.5 * (r[ci] == r[ri]))).sum() / pair_denom
            sums += torch.stack([loss.detach(), bt.detach(), lm.detach(), correct.detach()])
            tokens_since += ids.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf"))
        # nan/inf guard: the norm is computed after the all-reduce, so every rank takes the same decision
        if torch.isfinite(grad_norm):
            optimizer.step()
            skipped_in_row = 0
        else:
            skipped, skipped_in_row = skipped + 1, skipped_in_row + 1
            print0(f"step {step}: non-finite grad norm ({grad_norm.item()}, loss {loss.item()}), step skipped")
            if skipped_in_row >= 10:
                raise RuntimeError(f"{skipped_in_row} non-finite steps in a row: lower --lr or check the data")
        optimizer.zero_grad(set_to_none=True)
        step, steps_since = step + 1, steps_since + 1

        if step % args.log_every == 0 or step == max_steps:
            common.all_reduce_sum(sums)
            dt = time.time() - t_last
            tps = tokens_since * d.world_size / dt
            loss_m, bt_m, lm_m, acc_m = (sums / steps_since).tolist()
            logger.log(
                step,
                {
                    "train/loss": loss_m,
                    "train/bt_loss": bt_m,
                    "train/lm_loss": lm_m,
                    "train/accuracy": acc_m,
                    "train/lr": lr,
                    "train/grad_norm": grad_norm.item(),
                    "train/skipped_steps": skipped,
                    "perf/tokens_per_sec": tps,
                    "perf/mfu": tps * flops_per_token / (peak * d.world_size),
                },
                max_steps,
            )
            sums.zero_()
            t_last, tokens_since, steps_since = time.time(), 0, 0
        final, t_pause = step == max_steps, time.time()
        if (args.save_every and step % args.save_every == 0) or final:
            save(step)  # also calibrates: the final evaluation sees the checkpoint's scores
        if step % args.eval_every == 0 or final:
            # scores relative to a typical SFT answer: the final save has just folded the calibration in; in between,
            # subtract the mean score of the first calibration examples (cheaper than folding)
            offset = 0.0 if final else score_all(calib[: args.eval_pairs]).mean().item()
            metrics, gaps, scored = evaluate(len(evals) if final else min(args.eval_pairs, len(evals)), offset)
            logger.log(step, metrics, max_steps)
            if logger.writer is not None:
                logger.writer.add_histogram("val/score_gap", gaps, step)
            if final:
                logger.samples(step, scored)
        t_last += time.time() - t_pause  # perf/tokens_per_sec counts training time only

    # 4. the numbers that matter
    print0(
        f"calibration: score_offset {score_offset:+.4f} (the mean score of {len(calib)} calibration examples) "
        f"folded into score_head.bias"
    )
    if builtin:
        print0("probe (mean score by kind): " + " | ".join(f"{k} {v:+.3f}" for k, v in per_kind.items()))
    if args.export_hf and d.master:
        common.export_hf(raw_model, tok, args.export_hf)
    print0(
        f"rm done in {time.time() - t_start:.0f}s: {ckpt_path} | val/accuracy {metrics['val/accuracy']:.4f}"
        + (
            f" | val/bayes_ceiling {metrics['val/bayes_ceiling']:.4f} | probe/degenerate_score "
            f"{metrics['probe/degenerate_score']:+.3f} | probe/fluent_score {metrics['probe/fluent_score']:+.3f}"
            if builtin
            else ""
        )
    )
    logger.close()
    common.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
