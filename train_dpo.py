"""Direct preference optimisation: the offline baseline beside PPO, trained on preference pairs with no reward model.

The policy starts from --init (the SFT model) and a frozen copy of it is the reference. With
h = (log π(y_c) - log π_ref(y_c)) - (log π(y_r) - log π_ref(y_r)), the DPO loss is -log σ(β·h) (Rafailov et al. 2023,
https://arxiv.org/abs/2305.18290), with --label-smoothing ε the conservative cDPO mix
(1-ε)·(-log σ(βh)) + ε·(-log σ(-βh)); --loss ipo is (h - 1/(2β))² over per-token mean log-probs (Azar et al. 2023,
https://arxiv.org/abs/2310.12036, as TRL does). K-wise rankings expand to all their pairs, weighted to sum to 1 per
prompt, as in the reward model. Reference log-probs come from a no-grad forward of the same batch.

python train_dpo.py                                                   # built-in task, from out/sft/ckpt.pt, CPU
python train_dpo.py --loss ipo                                        # IPO, its own default β
python train_dpo.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl --lr 1e-6 --out-dir out/dpo_gpt2
torchrun --standalone --nproc_per_node 8 train_dpo.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl
"""

import copy
import os
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import tyro

import common
import hf
from common import UserError, print0
from data import Order, encode_prefs, load_tokenizer, pad_left, pad_right, read_jsonl
from lora import BaseView
from model import logprobs_from_logits, response_forward
from task import build_task, gold_reward, is_valid

DEFAULT_BETA = {"dpo": 0.3, "ipo": 0.5}  # --beta None resolves here (IPO's β works on per-token mean log-probs)


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/dpo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl (sampled held-out responses) go"""
    # --- data and model
    data: Optional[str] = None
    """preference JSONL: {"prompt", "chosen", "rejected"} or {"prompt", "responses", "ranking"} (None: built-in)"""
    eval_data: Optional[str] = None
    """held-out preference JSONL (None: the built-in task's split, or the last 5% of --data)"""
    init: str = "out/sft/ckpt.pt"
    """the policy to train and the frozen reference: path/to/ckpt.pt | gpt2 | gpt2-medium | ... | hf:<name-or-path>"""
    # --- the loss
    loss: Literal["dpo", "ipo"] = "dpo"
    """dpo: -log σ(β·h) over summed log-probs | ipo: (h - 1/(2β))² over per-token mean log-probs"""
    beta: Optional[float] = None
    """KL strength β (None: 0.3 for dpo, 0.5 for ipo; tuned on the built-in task with --nll-coef 1)"""
    label_smoothing: float = 0.0
    """cDPO: the share ε of labels assumed flipped, in [0, 0.5) (dpo only)"""
    nll_coef: float = 1.0
    """weight of the next-token loss on each record's best response, per token (RPO, Pang et al. 2024,
    https://arxiv.org/abs/2404.19733; TRL's rpo_alpha): it keeps the chosen text likely while the pairs push the
    rejected text down (0: plain DPO / IPO, which breaks the built-in task's grammar within 50 steps)"""
    # --- optimisation
    batch_size: int = 64
    """preference records (prompts) per optimizer step, summed over ranks"""
    micro_batch_size: int = 32
    """records per rank per forward, at most a rank's share of the batch (gradient accumulation makes up the rest)"""
    epochs: float = 0.5
    """passes over the training data (when --max-steps is not given); the LR anneals to 0 at the end"""
    lr: float = 5e-4
    """peak learning rate (warm-up, then cosine to 0); use ~5e-7..1e-6 for pretrained models"""
    warmup_steps: int = 10
    """linear warm-up steps"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices"""
    grad_clip: float = 1.0
    """global grad-norm clip (0: off)"""
    # --- evaluation
    eval_every: int = 100
    """steps between evaluations (and at the end)"""
    eval_pairs: int = 512
    """held-out records scored for val/loss and val/accuracy at each evaluation"""
    num_samples: int = 512
    """responses sampled at the end (held-out prompts, --temperature) for val/gold, val/kl, val/valid_frac and
    samples.jsonl (built-in task)"""
    eval_samples: int = 128
    """responses sampled at each intermediate evaluation"""
    temperature: float = 1.0
    """sampling temperature of the evaluation samples"""
    max_new_tokens: int = 64
    """longest sampled response"""


# -----------------------------------------------------------------------------
# DPO pieces: pure functions, imported by tests


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "dpo",
    label_smoothing: float = 0.0,
    weights: Optional[torch.Tensor] = None,
    denom: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """Per-sequence log-probs (P,) of the chosen and rejected responses under the policy and the reference (summed
    over response tokens for dpo, per-token means for ipo) -> (loss, stats). The loss is the weighted mean over pairs;
    denom replaces the sum of weights (the training loop passes the global pair weight of the step), and the stats
    (rewards/chosen, rewards/rejected = β·(log π - log π_ref), rewards/accuracy with ties 1/2, rewards/margin) are
    weighted the same way, so they add up over micro-batches and ranks."""
    chosen_logratios = policy_chosen.float() - ref_chosen.float()  # (P,)
    rejected_logratios = policy_rejected.float() - ref_rejected.float()
    h = chosen_logratios - rejected_logratios
    if loss_type == "dpo":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type {loss_type!r}: expected dpo or ipo")
    w = torch.ones_like(losses) if weights is None else weights.to(losses)
    total = w.sum() if denom is None else denom
    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    correct = (chosen_rewards > rejected_rewards) + 0.5 * (chosen_rewards == rejected_rewards)
    stats = {
        "rewards/chosen": (w * chosen_rewards).sum() / total,
        "rewards/rejected": (w * rejected_rewards).sum() / total,
        "rewards/accuracy": (w * correct).sum() / total,
        "rewards/margin": (w * (chosen_rewards - rejected_rewards)).sum() / total,
    }
    return (w * losses).sum() / total, stats


def collate(examples: list, pad_id: int):
    """Every response of every encoded record (data.encode_prefs) as one right-padded batch: ids (N, T); targets_mask
    (N, T-1), 1 where the target ids[:, t+1] is a response token (the response and its EOS); chosen and rejected
    row indices and weights (P,) of every pair; best (R,) the row of each record's best response."""
    seqs, n_prompts, chosen, rejected, weights, best_rows = [], [], [], [], [], []
    for example_seqs, n_prompt, pairs, best, _ in examples:
        base = len(seqs)
        best_rows.append(base + best)
        seqs += example_seqs
        n_prompts += [n_prompt] * len(example_seqs)
        for better, worse, weight in pairs:
            chosen.append(base + better)
            rejected.append(base + worse)
            weights.append(weight)
    ids, mask = pad_right(seqs, pad_id)
    for row, n_prompt in enumerate(n_prompts):
        mask[row, :n_prompt] = 0.0
    return (
        ids,
        mask[:, 1:],
        torch.tensor(chosen),
        torch.tensor(rejected),
        torch.tensor(weights),
        torch.tensor(best_rows),
    )


def sequence_logprobs(model, ids: torch.Tensor, targets_mask: torch.Tensor, average: bool) -> torch.Tensor:
    """ids (N, T) right-padded, targets_mask (N, T-1) -> (N,) the log-prob of each response: summed over its tokens,
    or their mean (average, IPO). Right padding needs no attention mask: causal attention never looks ahead."""
    logits, _ = model(ids[:, :-1])
    logprobs = logprobs_from_logits(logits, ids[:, 1:]) * targets_mask  # (N, T-1), 0 off the response
    if average:
        return logprobs.sum(1) / targets_mask.sum(1).clamp(min=1)
    return logprobs.sum(1)


def longest_sequence(example) -> int:
    """An encoded record's longest sequence: a rank's records are sorted by it into micro-batches."""
    return max(len(seq) for seq in example[0])


@torch.no_grad()
def sample_responses(policy, ref, tok, prompts: list, temperature: float, max_new_tokens: int, generator) -> list:
    """One response per prompt (KV cache, batches of 128): {"prompt", "response" (text without EOS), "ended", "kl"}
    with kl the sum over response tokens of log π - log π_ref at the sampling temperature (k1)."""
    device = next(policy.parameters()).device
    records = []
    for start in range(0, len(prompts), 128):
        chunk = prompts[start : start + 128]
        query, query_mask = (t.to(device) for t in pad_left([tok.encode(p, bos=True) for p in chunk], tok.pad_id))
        max_new = min(max_new_tokens, policy.config.block_size - query.size(1))
        response, response_mask, logprobs = policy.generate(
            query, query_mask, max_new, tok.eos_id, tok.pad_id, temperature=temperature, generator=generator
        )
        ref_logits, _ = response_forward(ref, query, query_mask, response, response_mask, temperature)
        ref_logprobs = logprobs_from_logits(ref_logits, response)
        kl = ((logprobs - ref_logprobs) * response_mask).sum(1)
        lengths = response_mask.sum(1).long().tolist()
        for row, prompt in enumerate(chunk):
            tokens = response[row, : lengths[row]].tolist()
            ended = len(tokens) > 0 and tokens[-1] == tok.eos_id
            text = tok.decode(tokens[:-1] if ended else tokens)
            records.append({"prompt": prompt, "response": text, "ended": ended, "kl": kl[row].item()})
    return records


def flops_per_token(model, examples: list) -> int:
    """Training FLOPs per token (perf/mfu): the model's estimate at the mean sequence length, plus the reference's
    no-grad forward (a third of a training step's 6 per weight)."""
    lengths = [len(seq) for seqs, *_ in examples for seq in seqs]
    mean_length = sum(lengths) // len(lengths)
    return model.flops_per_token(mean_length) * 4 // 3


# -----------------------------------------------------------------------------
# main


def main(args: Args) -> None:
    t_start = time.time()
    # 0. settings no run can use
    beta = DEFAULT_BETA[args.loss] if args.beta is None else args.beta
    if not beta > 0:
        raise UserError(f"--beta {beta:g}: the KL strength must be > 0")
    if not 0 <= args.label_smoothing < 0.5:
        raise UserError(f"--label-smoothing {args.label_smoothing:g}: the flipped-label share must be in [0, 0.5)")
    if args.label_smoothing > 0 and args.loss != "dpo":
        raise UserError(f"--label-smoothing applies to --loss dpo, not {args.loss}")
    if args.init == "scratch":
        raise UserError("--init scratch: DPO starts from a trained policy (an SFT checkpoint, gpt2 or hf:...)")
    common.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)
    # 1. data, tokenizer, policy and reference (user mistakes surface here, before any process group)
    builtin = args.data is None
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    train_rows = read_jsonl(task["pairs"] if builtin else args.data, "pairs")
    if args.eval_data or builtin:
        eval_rows = read_jsonl(args.eval_data or task["pairs_eval"], "pairs")
    else:
        n_eval = max(1, len(train_rows) // 20)
        train_rows, eval_rows = train_rows[:-n_eval], train_rows[-n_eval:]
    task_tok = load_tokenizer(task["tokenizer"]) if builtin else None
    model, tok, _ = hf.load_init(args.init, tokenizer=task_tok, score_head=False, kind=("sft", "dpo", "ppo"))
    if builtin and tok.state() != task_tok.state():
        raise UserError(f"--init {args.init}: its tokenizer is not the built-in task's ({task['tokenizer']})")
    block_size = model.config.block_size
    train, n_too_long = encode_prefs(tok, train_rows, block_size)
    evals, _ = encode_prefs(tok, eval_rows, block_size)
    if not train or not evals:
        raise UserError(
            f"{args.data or task['pairs']}: no preference record (or no held-out one) fits the context "
            f"({block_size} tokens)"
        )
    evals = evals[: args.eval_pairs]
    prompts = [row["prompt"] for row in read_jsonl(task["eval_prompts"], "prompts")] if builtin else []
    common.prepare_model(model, args)
    if args.lora_rank > 0:
        ref = BaseView(model)  # the adapters off: the init itself, no second copy of its weights
    else:
        ref = copy.deepcopy(model).requires_grad_(False)  # the frozen reference: the init, also on --resume
    average = args.loss == "ipo"  # per-token mean log-probs (IPO), else sums

    # 2. distributed set-up, sizes, optimizer, resume
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, micro_batch_size, grad_accum_steps = common.batch_split(args.batch_size, args.micro_batch_size)
    d = common.setup_dist(args.device)
    dtype = common.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, int(args.epochs * len(train)) // args.batch_size)
    print0(
        f"dpo: {len(train)} train / {len(evals)} eval records ({n_too_long} too long, skipped) | "
        f"{model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {micro_batch_size} | {max_steps} steps | loss {args.loss} beta {beta:g} "
        f"label_smoothing {args.label_smoothing:g} nll_coef {args.nll_coef:g} | device {d.device} {dtype}"
    )
    ref.eval()
    common.place_model(model, args, d, dtype)
    common.place_model(ref, args, d, dtype)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    sampler = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
    order = Order(len(train), args.seed)  # the global record order, the same on every rank
    guard = common.StepGuard()
    step = 0
    seconds = 0.0  # wall time of the earlier sittings of this run
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    init_hash = common.file_sha256(args.init) if args.init.endswith(".pt") else None  # what this run started from
    if args.resume:
        inputs = {"init_hash": (f"--init {args.init}", init_hash)}
        ckpt = common.resume(ckpt_path, "dpo", d, max_steps, inputs, model, optimizer, sampler)
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
                    kind="dpo",
                    **state,
                    model_config=asdict(raw_model.config),
                    init_hash=init_hash,
                    tokenizer=tok.state(),
                    args=asdict(args),
                    step=step,
                    scheduler=dict(lr=args.lr, warmup_steps=args.warmup_steps, max_steps=max_steps, min_lr_ratio=0.0),
                    rng=rngs,
                    data_state=dict(order=order.state_dict(), skipped=guard.skipped),
                    world_size=d.world_size,
                    seconds=seconds + time.time() - t_start,
                ),
                ckpt_path,
            )

    @torch.no_grad()
    def evaluate(n_samples: int) -> tuple[dict, list]:
        """val/ metrics: the loss and implicit-reward accuracy on the held-out pairs (rank r takes records r, r+world,
        ...); on the built-in task, gold, kl and valid_frac of n_samples sampled held-out responses. Returns them and
        this rank's samples."""
        sums = {"loss": 0.0, "accuracy": 0.0, "records": 0, "gold": 0.0, "kl": 0.0, "valid": 0}
        my_evals = evals[d.rank :: d.world_size]
        for start in range(0, len(my_evals), micro_batch_size):
            micro_batch = my_evals[start : start + micro_batch_size]
            ids, targets_mask, chosen, rejected, weights, _ = (t.to(d.device) for t in collate(micro_batch, tok.pad_id))
            with common.autocast(d.device, dtype):
                policy_logprobs = sequence_logprobs(raw_model, ids, targets_mask, average)
                ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average)
            loss, stats = dpo_loss(
                policy_logprobs[chosen],
                policy_logprobs[rejected],
                ref_logprobs[chosen],
                ref_logprobs[rejected],
                beta,
                args.loss,
                args.label_smoothing,
                weights,
                denom=1.0,
            )
            sums["loss"] += loss
            sums["accuracy"] += stats["rewards/accuracy"]
            sums["records"] += len(micro_batch)
        samples = []
        if builtin:
            my_prompts = prompts[d.rank : n_samples : d.world_size]
            samples = sample_responses(raw_model, ref, tok, my_prompts, args.temperature, args.max_new_tokens, sampler)
            for sample in samples:
                sample["gold"] = gold_reward(sample["prompt"], sample["response"], sample["ended"])
                sample["valid"] = is_valid(sample["response"], sample["ended"])
                sums["gold"] += sample["gold"]
                sums["kl"] += sample["kl"]
                sums["valid"] += sample["valid"]
        totals = common.all_reduce_dict(sums, d.device)
        metrics = {
            "val/loss": totals["loss"] / totals["records"],
            "val/accuracy": totals["accuracy"] / totals["records"],
        }
        if builtin:
            num_sampled = min(n_samples, len(prompts))
            metrics["val/gold"] = totals["gold"] / num_sampled
            metrics["val/kl"] = totals["kl"] / num_sampled
            metrics["val/valid_frac"] = totals["valid"] / num_sampled
        return metrics, samples

    # 3. training loop: each step takes the next global batch of the epoch order; rank r owns a slice
    # dropout off (DESIGN §2): the model stays in eval mode, the only thing the mode changes in a GPT
    model.eval()
    stat_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
    window = dict.fromkeys(("train/loss", "train/nll_loss", *stat_names, "tokens"), 0.0)  # summed since the last log
    window_steps = 0
    while step < max_steps:
        if order.pos + args.batch_size > order.n:  # the epoch's remainder is dropped
            order.pos = order.n
        batch = [train[i] for i in order.take(args.batch_size)]
        lr = common.lr_at(step, max_steps, args.lr, args.warmup_steps, min_lr_ratio=0.0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # losses are divided by global counts of the step (pairs weigh 1 per record; NLL: best-response tokens)
        pair_denom = float(len(batch))
        nll_denom = float(sum(len(seqs[best]) - n_prompt for seqs, n_prompt, _, best, _ in batch))
        # sorted by length: each micro-batch pads to its own longest sequence (the gradient does not depend on it)
        my_batch = sorted(batch[d.rank * per_rank : (d.rank + 1) * per_rank], key=longest_sequence)
        for micro_step in range(grad_accum_steps):
            micro_batch = my_batch[micro_step * micro_batch_size :][:micro_batch_size]
            ids, targets_mask, chosen, rejected, weights, best = (
                t.to(d.device) for t in collate(micro_batch, tok.pad_id)
            )
            with torch.no_grad(), common.autocast(d.device, dtype):
                ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average)
            last_micro_step = micro_step == grad_accum_steps - 1
            with common.grad_sync(model, last_micro_step), common.autocast(d.device, dtype):
                policy_logprobs = sequence_logprobs(model, ids, targets_mask, average)
                loss, stats = dpo_loss(
                    policy_logprobs[chosen],
                    policy_logprobs[rejected],
                    ref_logprobs[chosen],
                    ref_logprobs[rejected],
                    beta,
                    args.loss,
                    args.label_smoothing,
                    weights,
                    denom=pair_denom,
                )
                # RPO: the next-token loss of the best responses (their summed log-probs; IPO's are per-token means)
                best_logprobs = policy_logprobs[best] * (targets_mask[best].sum(1) if average else 1)
                nll_loss = -best_logprobs.sum() / nll_denom
                loss = loss + args.nll_coef * nll_loss
                # DDP averages gradients over ranks: scale up so the result is the sum over the global batch / denom
                (loss * d.world_size).backward()
            window["train/loss"] += loss.detach()
            window["train/nll_loss"] += nll_loss.detach()
            for name in stat_names:
                window[name] += stats[name]
            window["tokens"] += sum(len(seq) for seqs, *_ in micro_batch for seq in seqs)
        common.clip_and_step(optimizer, raw_model.parameters(), args.grad_clip, guard, step)
        step += 1
        window_steps += 1

        if step % args.log_every == 0 or step == max_steps:
            totals = common.all_reduce_dict(window, d.device)
            metrics = {name: totals[name] / window_steps for name in ("train/loss", "train/nll_loss", *stat_names)}
            metrics["train/lr"] = lr
            logger.log(step, metrics | guard.read() | throughput.read(totals["tokens"]), max_steps)
            window = dict.fromkeys(window, 0.0)
            window_steps = 0
        final = step == max_steps
        with throughput.paused():  # perf/ counts training time only
            if step % args.eval_every == 0 or final:
                with common.gathered(raw_model), common.gathered(ref):  # ranks run unequal numbers of forwards
                    metrics, samples = evaluate(args.num_samples if final else args.eval_samples)
                logger.log(step, metrics, max_steps)
                shown = [f"{s['prompt']}{s['response']}{'' if s['ended'] else ' [no EOS]'}" for s in samples]
                logger.text("samples", "\n\n".join(shown[:8]), step)
            if final:
                logger.samples(step, samples)
            if (args.save_every and step % args.save_every == 0) or final:
                save(step)

    # 4. a few samples to look at, and the numbers that matter
    for line in shown[:5]:
        print0(f"  {line}")
    if args.export_hf and d.master:
        common.export_hf(raw_model, tok, args.export_hf)
    summary = f"dpo done in {time.time() - t_start:.0f}s: {ckpt_path} | val/accuracy {metrics['val/accuracy']:.4f}"
    if builtin:
        summary += (
            f" | val/gold {metrics['val/gold']:+.3f} | val/kl {metrics['val/kl']:.2f} | "
            f"val/valid_frac {metrics['val/valid_frac']:.3f}"
        )
    print0(summary)
    logger.close()
    common.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, tyro.cli(Args))
