"""Direct preference optimisation: the offline baseline beside PPO, trained on preference pairs with no reward model.

The policy starts from --init (the SFT model) and a frozen copy of it is the reference. With
h = (log π(y_c) - log π_ref(y_c)) - (log π(y_r) - log π_ref(y_r)), the DPO loss is -log σ(β·h) (Rafailov et al. 2023,
https://arxiv.org/abs/2305.18290), with --label-smoothing ε the conservative cDPO mix
(1-ε)·(-log σ(βh)) + ε·(-log σ(-βh)); --loss ipo is (h - 1/(2β))² over per-token mean log-probs (Azar et al. 2023,
https://arxiv.org/abs/2310.12036, as TRL does). K-wise rankings expand to all their pairs, weighted to sum to 1 per
prompt, as in the reward model. Reference log-probs come from a no-grad forward of the same batch. --loss kto
(Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306) needs no pairs: with r = log π(y) - log π_ref(y) summed,
a desirable y costs λ_D·(1 - σ(β(r - z0))) and an undesirable one λ_U·(1 - σ(β(z0 - r))), z0 = max(0, a detached KL
estimate from mismatched prompt-completion pairs of the step).

python train_dpo.py                                                   # built-in task, from out/sft/ckpt.pt, CPU
python train_dpo.py --loss ipo                                        # IPO, its own default β
python train_dpo.py --loss kto --data my_unpaired.jsonl               # KTO on {"prompt", "completion", "label"}
python train_dpo.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl --lr 1e-6 --out-dir out/dpo_gpt2
torchrun --standalone --nproc_per_node 8 train_dpo.py --init out/sft_gpt2/ckpt.pt --data my_pairs.jsonl
"""

import copy
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F

import checkpoints
import cli
import common
import hf
import parallel
from common import UserError, format_sample, print0
from data import (
    Order,
    builtin_files,
    builtin_task,
    drop_tied,
    encode_kto,
    encode_prefs,
    encode_prompts,
    longest_sequence,
    pad_right,
    read_jsonl,
    read_train_eval,
)
from generate import sample
from lora import BaseView
from model import logprobs_from_logits, response_forward
from tokenizer import Tokenizer, load_tokenizer, same_tokenizer

DEFAULT_BETA = {"dpo": 0.3, "ipo": 0.5, "kto": 0.1}  # --beta None (IPO's β works on per-token mean log-probs)


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/dpo"
    """where ckpt.pt, TensorBoard event files and samples.jsonl (sampled held-out responses) go"""
    # --- data and model
    data: Optional[str] = None
    """preference JSONL: {"prompt", "chosen", "rejected"} (strings or messages), TRL's implicit prompt {"chosen",
    "rejected"} (messages sharing their head), or K-wise {"prompt", "responses", "ranking"}; with --loss kto also
    TRL's unpaired {"prompt", "completion", "label": bool} (None: built-in)"""
    eval_data: Optional[str] = None
    """held-out preference JSONL (None: the built-in task's split, or the last 5% of --data)"""
    init: str = "out/sft/ckpt.pt"
    """the policy to train and the frozen reference: path/to/ckpt.pt | gpt2 | gpt2-medium | ... | hf:<name-or-path>"""
    # --- the loss
    loss: Literal["dpo", "ipo", "kto"] = "dpo"
    """dpo: -log σ(β·h) over summed log-probs | ipo: (h - 1/(2β))² over per-token mean log-probs | kto: Kahneman-Tversky
    on desirable and undesirable responses (a pair's chosen and rejected, a ranking's top and bottom, or unpaired)"""
    beta: Optional[float] = None
    """KL strength β (None: 0.3 for dpo, 0.5 for ipo, tuned on the built-in task with --nll-coef 1; 0.1 for kto,
    the paper's)"""
    label_smoothing: float = 0.0
    """cDPO: the share ε of labels assumed flipped, in [0, 0.5) (dpo only)"""
    nll_coef: float = 1.0
    """weight of the next-token loss on each record's best response (RPO, Pang et al. 2024,
    https://arxiv.org/abs/2404.19733), as a token mean over the step's best responses (TRL's rpo_alpha), not the
    paper's per-sequence normalisation: it keeps the chosen text likely while the pairs push the rejected text down
    (0: plain DPO / IPO, which breaks the built-in task's grammar within 50 steps); with kto, on the desirable
    responses only, a token mean over the step's desirable tokens"""
    kto_desirable_weight: float = 1.0
    """kto: λ_D, the weight of a desirable response's loss (the paper keeps λ_D·n_D / (λ_U·n_U) in [1, 4/3])"""
    kto_undesirable_weight: float = 1.0
    """kto: λ_U, the weight of an undesirable response's loss"""
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
    """steps between evaluations (and at the end; 0: only at the end)"""
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
    for dpo, per-token means for ipo) -> (loss, stats): the weighted mean over pairs, denom replacing the sum of
    weights; stats (rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin) weighted the same way."""
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


def kto_loss(
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    denoms: Optional[tuple] = None,
) -> tuple[torch.Tensor, dict]:
    """Per-sequence summed log-probs (N,) under the policy and the reference, desirable (N,) bool, z0 the detached
    reference point -> (loss, stats): λ_D·(1 - σ(β(r - z0))) or λ_U·(1 - σ(β(z0 - r))) summed over the example count.
    denoms = (examples, desirable, undesirable) replaces this batch's counts (the step's global ones)."""
    logratios = policy_logprobs.float() - ref_logprobs.float()  # (N,)
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    if denoms is None:
        n_desirable = float(desirable.sum())
        denoms = (float(len(losses)), n_desirable, len(losses) - n_desirable)
    n_examples, n_desirable, n_undesirable = denoms
    rewards = (beta * logratios).detach()
    stats = {
        "rewards/desirable": rewards[desirable].sum() / max(n_desirable, 1),
        "rewards/undesirable": rewards[~desirable].sum() / max(n_undesirable, 1),
    }
    return losses.sum() / n_examples, stats


def response_batch(seqs: list, n_prompts: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences right-padded -> ids (N, T) and targets_mask (N, T-1), 1 where the target ids[:, t+1] is a response
    token (past the sequence's n_prompt prompt tokens)."""
    ids, mask = pad_right(seqs, pad_id)
    for row, n_prompt in enumerate(n_prompts):
        mask[row, :n_prompt] = 0.0
    return ids, mask[:, 1:]


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
    ids, targets_mask = response_batch(seqs, n_prompts, pad_id)
    return (
        ids,
        targets_mask,
        torch.tensor(chosen),
        torch.tensor(rejected),
        torch.tensor(weights),
        torch.tensor(best_rows),
    )


def kto_collate(examples: list, pad_id: int):
    """Every sequence of every encoded KTO record (data.encode_kto) as one right-padded batch: ids (N, T) and
    targets_mask (N, T-1) as in collate, desirable (N,) bool; chosen and rejected (P,) the rows of each record that
    holds a desirable and an undesirable response (a pair, a ranking's top and bottom), for the held-out accuracy."""
    seqs, n_prompts, labels, chosen, rejected = [], [], [], [], []
    for example_seqs, n_prompt, example_labels, _ in examples:
        if example_labels == [True, False]:
            chosen.append(len(seqs))
            rejected.append(len(seqs) + 1)
        seqs += example_seqs
        n_prompts += [n_prompt] * len(example_seqs)
        labels += example_labels
    ids, targets_mask = response_batch(seqs, n_prompts, pad_id)
    as_rows = partial(torch.tensor, dtype=torch.long)
    return ids, targets_mask, torch.tensor(labels, dtype=torch.bool), as_rows(chosen), as_rows(rejected)


def mismatched(examples: list, block_size: int) -> list:
    """KTO's KL examples (Ethayarajh et al. 2024 §4.1; TRL's KL dataset): each encoded KTO record's responses after the
    next record's prompt (the last record's after the first's), cut to block_size; the same layout as the records."""
    kl_examples = []
    for i, (seqs, n_prompt, labels, row) in enumerate(examples):
        next_seqs, next_n_prompt, *_ = examples[(i + 1) % len(examples)]
        head = next_seqs[0][:next_n_prompt]
        kl_examples.append(([(head + seq[n_prompt:])[:block_size] for seq in seqs], next_n_prompt, labels, row))
    return kl_examples


def sequence_logprobs(model, ids: torch.Tensor, targets_mask: torch.Tensor, average: bool) -> torch.Tensor:
    """ids (N, T) right-padded, targets_mask (N, T-1) -> (N,) the log-prob of each response: summed over its tokens,
    or their mean (average, IPO). Right padding needs no attention mask: causal attention never looks ahead."""
    logits, _ = model(ids[:, :-1].contiguous())  # contiguous: a sliced input is a compiled graph more (model.left_pack)
    logprobs = logprobs_from_logits(logits, ids[:, 1:]) * targets_mask  # (N, T-1), 0 off the response
    if average:
        return logprobs.sum(1) / targets_mask.sum(1).clamp(min=1)
    return logprobs.sum(1)


@torch.no_grad()
def reference_point(policy, ref, kl_examples: list, micro_batch_size: int, pad_id: int, amp) -> torch.Tensor:
    """KTO's z0 = max(0, mean of log π(y'|x) - log π_ref(y'|x)) over one step's mismatched pairs: a no-grad pass over
    this rank's share (kl_examples), summed over ranks, before any loss of the step is formed."""
    device = next(policy.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(kl_examples), micro_batch_size):
        micro_batch = kl_examples[start : start + micro_batch_size]
        ids, targets_mask, *_ = (t.to(device) for t in kto_collate(micro_batch, pad_id))
        with amp:
            policy_logprobs = sequence_logprobs(policy, ids, targets_mask, average=False)
            ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average=False)
        total += (policy_logprobs.double() - ref_logprobs.double()).sum()
    count = sum(len(seqs) for seqs, *_ in kl_examples)
    total, count = parallel.all_reduce_stack([total, count], device)
    return (total / count.clamp(min=1)).clamp(min=0).float()


@torch.no_grad()
def sample_responses(policy, ref, tok, prompts: list, temperature: float, max_new_tokens: int, generator, task) -> list:
    """One response per prompt (KV cache, batches of 128): {"prompt", "response" (text without EOS), "ended", "kl",
    "gold", "valid"} with kl the sum over response tokens of log π - log π_ref at the sampling temperature (k1) and
    the built-in task's gold reward and validity (task: its module, data.TASKS)."""
    device = next(policy.parameters()).device
    records = []
    for start in range(0, len(prompts), 128):
        chunk = prompts[start : start + 128]
        query, query_mask = (t.to(device) for t in encode_prompts(tok, chunk))
        samples = sample(policy, tok, query, query_mask, max_new_tokens, temperature, generator=generator)
        ref_logits, _ = response_forward(ref, query, query_mask, samples.response, samples.mask, temperature)
        ref_logprobs = logprobs_from_logits(ref_logits, samples.response)
        kl = ((samples.logprobs - ref_logprobs) * samples.mask).sum(1).tolist()
        for prompt, text, ended, row_kl in zip(chunk, samples.texts, samples.ended.tolist(), kl):
            record = {"prompt": prompt, "response": text, "ended": ended, "kl": row_kl}
            record["gold"] = task.gold_reward(prompt, text, ended)
            record["valid"] = task.is_valid(text, ended)
            records.append(record)
    return records


@torch.no_grad()
def heldout_sums(policy, ref, evals: list, loss_fn: Callable, average: bool, micro_batch_size: int, pad_id: int, amp):
    """The DPO loss and implicit-reward accuracy summed over encoded held-out records (each record's pairs weigh 1,
    as in training), micro-batch by micro-batch: {"loss", "accuracy", "records"} (and gold, kl, valid at 0 for the
    samples to fill)."""
    device = next(policy.parameters()).device
    sums = {"loss": 0.0, "accuracy": 0.0, "records": 0, "gold": 0.0, "kl": 0.0, "valid": 0}
    for start in range(0, len(evals), micro_batch_size):
        micro_batch = evals[start : start + micro_batch_size]
        ids, targets_mask, chosen, rejected, weights, _ = (t.to(device) for t in collate(micro_batch, pad_id))
        with amp:
            policy_logprobs = sequence_logprobs(policy, ids, targets_mask, average)
            ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average)
        loss, stats = loss_fn(
            policy_logprobs[chosen],
            policy_logprobs[rejected],
            ref_logprobs[chosen],
            ref_logprobs[rejected],
            weights=weights,
            denom=1.0,
        )
        sums["loss"] += loss
        sums["accuracy"] += stats["rewards/accuracy"]
        sums["records"] += len(micro_batch)
    return sums


@torch.no_grad()
def kto_heldout_sums(policy, ref, evals: list, kl_evals: list, args: Args, micro_batch_size: int, pad_id: int, amp):
    """The held-out KTO loss against the held-out set's own z0 (over kl_evals), and on records holding a pair the
    accuracy of β·r (ties 1/2). Returns sums {"loss", "examples", "accuracy", "pairs"} (gold, kl, valid at 0)."""
    device = next(policy.parameters()).device
    z0 = reference_point(policy, ref, kl_evals, micro_batch_size, pad_id, amp)
    sums = {"loss": 0.0, "examples": 0, "accuracy": 0.0, "pairs": 0, "gold": 0.0, "kl": 0.0, "valid": 0}
    for start in range(0, len(evals), micro_batch_size):
        micro_batch = evals[start : start + micro_batch_size]
        ids, targets_mask, desirable, chosen, rejected = (t.to(device) for t in kto_collate(micro_batch, pad_id))
        with amp:
            policy_logprobs = sequence_logprobs(policy, ids, targets_mask, average=False)
            ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average=False)
        weights = (args.kto_desirable_weight, args.kto_undesirable_weight)
        loss, _ = kto_loss(policy_logprobs, ref_logprobs, desirable, z0, args.beta, *weights, denoms=(1, 1, 1))
        logratios = policy_logprobs.float() - ref_logprobs.float()
        margins = logratios[chosen] - logratios[rejected]
        sums["loss"] += loss
        sums["examples"] += len(desirable)
        sums["accuracy"] += ((margins > 0) + 0.5 * (margins == 0)).sum()
        sums["pairs"] += len(chosen)
    return sums


def pair_backward(policy, ref, batch: list, args: Args, denoms: tuple, sync: bool, amp) -> dict:
    """One micro-batch of pairs (collate's tensors on the device): the DPO/IPO loss over the step's global pair count
    plus --nll-coef x the next-token loss of the best responses over the step's global count of their tokens (RPO),
    and its backward (gradients accumulate; DDP all-reduces where sync). Returns the terms' sums for the logs."""
    ids, targets_mask, chosen, rejected, weights, best = batch
    pair_denom, nll_denom = denoms
    average = args.loss == "ipo"  # per-token mean log-probs (IPO), else sums
    with torch.no_grad(), amp:
        ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average)
    with parallel.grad_sync(policy, sync), amp:
        policy_logprobs = sequence_logprobs(policy, ids, targets_mask, average)
        loss, stats = dpo_loss(
            policy_logprobs[chosen],
            policy_logprobs[rejected],
            ref_logprobs[chosen],
            ref_logprobs[rejected],
            beta=args.beta,
            loss_type=args.loss,
            label_smoothing=args.label_smoothing,
            weights=weights,
            denom=pair_denom,
        )
        # RPO: the next-token loss of the best responses, a token mean over the whole step's best responses (TRL's
        # rpo_alpha), not Pang et al.'s per-sequence normalisation (their summed log-probs; IPO's are per-token means,
        # scaled back to sums)
        best_logprobs = policy_logprobs[best] * (targets_mask[best].sum(1) if average else 1)
        nll_loss = -best_logprobs.sum() / nll_denom
        loss = loss + args.nll_coef * nll_loss
        parallel.backward_global(loss)
    return {"train/loss": loss.detach(), "train/nll_loss": nll_loss.detach()} | stats


def kto_denoms(batch: list) -> tuple[tuple, float]:
    """A step's global counts of encoded KTO records: (examples, desirable, undesirable) and the desirable responses'
    tokens (the NLL term's denominator, at least 1)."""
    labels = [label for _, _, record_labels, _ in batch for label in record_labels]
    n_desirable = float(sum(labels))
    nll_tokens = sum(
        len(seq) - n_prompt
        for seqs, n_prompt, record_labels, _ in batch
        for seq, label in zip(seqs, record_labels)
        if label
    )
    return (float(len(labels)), n_desirable, len(labels) - n_desirable), max(float(nll_tokens), 1.0)


def kto_backward(policy, ref, batch: list, args: Args, denoms: tuple, z0: torch.Tensor, sync: bool, amp) -> dict:
    """One micro-batch of KTO examples (kto_collate's tensors on the device): the KTO loss against the step's
    reference point z0 over the step's global counts (kto_denoms), plus --nll-coef x the next-token loss of the
    desirable responses over the step's global count of their tokens, and its backward (as pair_backward)."""
    ids, targets_mask, desirable, _, _ = batch
    example_denoms, nll_denom = denoms
    weights = (args.kto_desirable_weight, args.kto_undesirable_weight)
    with torch.no_grad(), amp:
        ref_logprobs = sequence_logprobs(ref, ids, targets_mask, average=False)
    with parallel.grad_sync(policy, sync), amp:
        policy_logprobs = sequence_logprobs(policy, ids, targets_mask, average=False)
        loss, stats = kto_loss(policy_logprobs, ref_logprobs, desirable, z0, args.beta, *weights, example_denoms)
        nll_loss = -policy_logprobs[desirable].sum() / nll_denom
        loss = loss + args.nll_coef * nll_loss
        parallel.backward_global(loss)
    return {"train/loss": loss.detach(), "train/nll_loss": nll_loss.detach()} | stats


def flops_per_token(model, examples: list, no_grad_forwards: int = 1) -> int:
    """Training FLOPs per token (perf/mfu): the model's estimate at the mean sequence length (6 per weight), plus 2
    per weight for each no-grad forward: the reference's (DPO), and for KTO also the policy's and the reference's over
    the mismatched pairs."""
    lengths = [len(seq) for seqs, *_ in examples for seq in seqs]
    mean_length = sum(lengths) // len(lengths)
    return model.flops_per_token(mean_length) * (6 + 2 * no_grad_forwards) // 6


# -----------------------------------------------------------------------------
# main


def resolve_beta(args: Args) -> Args:
    """--beta None is the loss's own default (DEFAULT_BETA); the checkpoint keeps the value used."""
    return replace(args, beta=DEFAULT_BETA[args.loss] if args.beta is None else args.beta)


def check_args(args: Args) -> None:
    """Settings no run can use: one line each, before any work."""
    if not args.beta > 0:
        raise UserError(f"--beta {args.beta:g}: the KL strength must be > 0")
    if not 0 <= args.label_smoothing < 0.5:
        raise UserError(f"--label-smoothing {args.label_smoothing:g}: the flipped-label share must be in [0, 0.5)")
    if args.label_smoothing > 0 and args.loss != "dpo":
        raise UserError(f"--label-smoothing applies to --loss dpo, not {args.loss}")
    for flag, weight in (
        ("--kto-desirable-weight", args.kto_desirable_weight),
        ("--kto-undesirable-weight", args.kto_undesirable_weight),
    ):
        if not weight > 0:
            raise UserError(f"{flag} {weight:g}: a loss weight must be > 0")
    if args.init == "scratch":
        raise UserError("--init scratch: DPO starts from a trained policy (an SFT checkpoint, gpt2 or hf:...)")


@dataclass
class Data:
    """DPO's records, encoded for its tokenizer and context (load)."""

    train: list  # data.encode_prefs's examples (--loss kto: data.encode_kto's)
    evals: list  # the first --eval-pairs held-out ones
    prompts: list  # held-out prompts to sample from (built-in task), or empty
    too_long: int  # training records skipped for the context
    tied: int  # training records dropped for a tie (chosen equal to rejected)


def load(args: Args) -> tuple[torch.nn.Module, Tokenizer, Optional[str], Data]:
    """Step 1: the preference data, tokenizer and policy (--init), checked before any process group; returns them and
    the init's fingerprint (--resume compares it)."""
    builtin = args.data is None
    task = builtin_files(args, "pairs", "--data") if builtin else None
    train_path = task["pairs"] if builtin else args.data
    eval_path = args.eval_data or (task["pairs_eval"] if builtin else None)
    kto = args.loss == "kto"
    train_rows, eval_rows = read_train_eval(train_path, eval_path, "kto" if kto else "pairs")
    train_rows, tied = drop_tied(train_rows)
    eval_rows, _ = drop_tied(eval_rows)
    task_tok = load_tokenizer(task["tokenizer"]) if builtin else None
    model, tok, _ = hf.load_init(args.init, tokenizer=task_tok, score_head=False, kind=checkpoints.POLICY_KINDS)
    difference = same_tokenizer(tok, task_tok, [row["prompt"] for row in train_rows]) if builtin else None
    if difference:
        raise UserError(
            f"--init {args.init}: its tokenizer is not the built-in task's (--task {args.task}, {task['tokenizer']}): "
            f"{difference}"
        )
    init_hash = checkpoints.init_fingerprint(args.init)  # what this run started from
    block_size = model.config.block_size
    encode = encode_kto if kto else encode_prefs
    train, too_long = encode(tok, train_rows, block_size)
    evals, _ = encode(tok, eval_rows, block_size)
    if not train or not evals:
        raise UserError(
            f"{train_path}: no preference record (or no held-out one) fits the context ({block_size} tokens)"
        )
    prompts = [row["prompt"] for row in read_jsonl(task["eval_prompts"], "prompts")] if builtin else []
    return model, tok, init_hash, Data(train, evals[: args.eval_pairs], prompts, too_long, tied)


def main(args: Args) -> None:
    t_start = time.time()
    args = checkpoints.task_from_checkpoint(args, args.init, "--init")  # --task: the init's unless given
    args = checkpoints.resume_args(args, "dpo", resolve_beta)  # --resume: the run's own flags, a changed one refused
    check_args(args)
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)
    # 1. data, tokenizer, policy and reference (user mistakes surface here, before any process group)
    model, tok, init_hash, data = load(args)
    builtin = args.data is None
    task = builtin_task(args) if builtin else None  # gold and validity of the held-out samples
    train, evals, prompts = data.train, data.evals, data.prompts
    parallel.prepare_model(model, args)
    if args.lora_rank > 0:
        ref = BaseView(model)  # the adapters off: the init itself, no second copy of its weights
    else:
        ref = copy.deepcopy(model).requires_grad_(False)  # the frozen reference: the init, also on --resume
    average = args.loss == "ipo"  # per-token mean log-probs (IPO), else sums
    kto = args.loss == "kto"
    # the held-out loss: dpo_loss's (kto's is kto_heldout_sums')
    loss_fn = (
        None if kto else partial(dpo_loss, beta=args.beta, loss_type=args.loss, label_smoothing=args.label_smoothing)
    )
    collate_fn = kto_collate if kto else collate
    block_size = model.config.block_size
    kl_evals = mismatched(evals, block_size) if kto else []  # the held-out set's mismatched pairs (its own z0)

    # 2. distributed set-up, sizes, optimizer, resume
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, micro_batch_size, grad_accum_steps = parallel.batch_split(args.batch_size, args.micro_batch_size)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, int(args.epochs * len(train)) // args.batch_size)
    common.size_warnings(args.batch_size, "--batch-size", len(train), len(evals), args.warmup_steps, max_steps)
    print0(
        f"dpo: {len(train)} train / {len(evals)} eval records ({data.too_long} too long, {data.tied} tied, skipped) | "
        f"{model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = {d.world_size} ranks x "
        f"{grad_accum_steps} accum x {micro_batch_size} | {max_steps} steps | loss {args.loss} beta {args.beta:g} "
        f"label_smoothing {args.label_smoothing:g} nll_coef {args.nll_coef:g} | device {d.device} {dtype}"
    )
    ref.eval()
    parallel.place_model(model, args, d, dtype)
    parallel.place_model(ref, args, d, dtype, frozen=True)  # stored in bf16 under bf16
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps, min_lr_ratio=0.0)
    trained = common.Trained("model", model, optimizer, schedule, args.grad_clip)
    order = Order(len(train), args.seed)  # the global record order, the same on every rank
    guard = common.StepGuard()
    run = checkpoints.Run("dpo", args, d, tok, [trained], started=t_start)
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
    flops = flops_per_token(raw_model, train, no_grad_forwards=3 if kto else 1)
    throughput = common.Throughput(flops, peak_flops, d.world_size)

    @torch.no_grad()
    def evaluate(n_samples: int) -> tuple[dict, list]:
        """val/ metrics: the loss and implicit-reward accuracy on the held-out pairs (rank r takes records r, r+world,
        ...); on the built-in task, gold, kl and valid_frac of n_samples sampled held-out responses. Returns them and
        this rank's samples."""
        my_evals = evals[d.rank :: d.world_size]
        amp = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
        if kto:
            my_kl_evals = kl_evals[d.rank :: d.world_size]
            sums = kto_heldout_sums(raw_model, ref, my_evals, my_kl_evals, args, micro_batch_size, tok.pad_id, amp)
        else:
            sums = heldout_sums(raw_model, ref, my_evals, loss_fn, average, micro_batch_size, tok.pad_id, amp)
        samples = []
        if builtin:
            my_prompts = prompts[d.rank : n_samples : d.world_size]
            # the same draws at every evaluation: its samples depend on the model only, never on a stop and a resume
            generator = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
            with amp:  # the reference's forward (bf16 weights under --dtype bfloat16)
                samples = sample_responses(
                    raw_model, ref, tok, my_prompts, args.temperature, args.max_new_tokens, generator, task
                )
            for key in ("gold", "kl", "valid"):
                sums[key] = sum(sample[key] for sample in samples)
        totals = parallel.all_reduce_dict(sums, d.device)
        if kto:  # the loss per example; the accuracy on the records that hold a pair, if any
            metrics = {"val/loss": totals["loss"] / totals["examples"]}
            if totals["pairs"]:
                metrics["val/accuracy"] = totals["accuracy"] / totals["pairs"]
        else:
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
    # dropout off: the model stays in eval mode, the only thing the mode changes in a GPT
    model.eval()
    stat_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
    if kto:
        stat_names = ("rewards/desirable", "rewards/undesirable", "train/kto_z0")
    window = dict.fromkeys(("train/loss", "train/nll_loss", *stat_names, "tokens"), 0.0)  # summed since the last log
    amp = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
    window_steps = 0
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the step, exit 128 + signal
    while step < max_steps:
        if order.pos + args.batch_size > order.n:  # the epoch's remainder is dropped
            order.pos = order.n
        batch = [train[i] for i in order.take(args.batch_size)]
        lr = common.step_lr(trained, step)
        if kto:
            # the step's reference point, from all its mismatched pairs on every rank, before any loss is formed
            my_kl_examples = mismatched(batch, block_size)[d.rank * per_rank : (d.rank + 1) * per_rank]
            z0 = reference_point(model, ref, my_kl_examples, micro_batch_size, tok.pad_id, amp)
            window["train/kto_z0"] += z0 / d.world_size  # the same on every rank: the log's all-reduce sums it
            backward = partial(kto_backward, denoms=kto_denoms(batch), z0=z0)
        else:
            # losses are divided by global counts of the step (pairs weigh 1 per record; NLL: best-response tokens)
            pair_denom = float(len(batch))
            nll_denom = float(sum(len(seqs[best]) - n_prompt for seqs, n_prompt, _, best, _ in batch))
            backward = partial(pair_backward, denoms=(pair_denom, nll_denom))
        # sorted by length: each micro-batch pads to its own longest sequence (the gradient does not depend on it)
        my_batch = sorted(batch[d.rank * per_rank : (d.rank + 1) * per_rank], key=longest_sequence)
        for micro_step in range(grad_accum_steps):
            micro_batch = my_batch[micro_step * micro_batch_size :][:micro_batch_size]
            batch = [t.to(d.device) for t in collate_fn(micro_batch, tok.pad_id)]
            sync = micro_step == grad_accum_steps - 1
            sums = backward(model, ref, batch, args, sync=sync, amp=amp)
            for key, value in sums.items():
                window[key] += value
            window["tokens"] += sum(len(seq) for seqs, *_ in micro_batch for seq in seqs)
        common.guarded_step([trained], guard, step)
        step += 1
        window_steps += 1
        stopping = stop.requested(d.device)

        if (args.log_every > 0 and step % args.log_every == 0) or step == max_steps:
            totals = parallel.all_reduce_dict(window, d.device)
            metrics = {name: totals[name] / window_steps for name in ("train/loss", "train/nll_loss", *stat_names)}
            metrics["train/lr"] = lr
            logger.log(step, metrics | guard.read() | throughput.read(totals["tokens"]), max_steps)
            window = dict.fromkeys(window, 0.0)
            window_steps = 0
        final = step == max_steps
        with throughput.paused():  # perf/ counts training time only
            if stopping:  # a signal: the save first, inside the grace period (this step's evaluation is skipped)
                run.save(step, dict(order=order.state_dict(), skipped=guard.skipped), init_hash=init_hash)
                logger.close()
                stop.exit(stopping, run.path)
            if (args.eval_every > 0 and step % args.eval_every == 0) or final:
                with parallel.gathered(raw_model), parallel.gathered(ref):  # ranks run unequal numbers of forwards
                    metrics, samples = evaluate(args.num_samples if final else args.eval_samples)
                logger.log(step, metrics, max_steps)
                shown = [format_sample(s["prompt"], s["response"], s["ended"]) for s in samples]
                logger.text("samples", "\n\n".join(shown[:8]), step)
            if final:
                logger.samples(step, samples)
            if (args.save_every > 0 and step % args.save_every == 0) or final:
                run.save(step, dict(order=order.state_dict(), skipped=guard.skipped), init_hash=init_hash)

    stop.close()
    # 4. a few samples to look at, and the numbers that matter
    for line in shown[:5]:
        print0(f"  {line}")
    if args.export_hf and d.master:
        checkpoints.export_hf(raw_model, tok, args.export_hf)
    summary = f"dpo done in {time.time() - t_start:.0f}s: {run.path}"
    if "val/accuracy" in metrics:  # kto on unpaired held-out records has none
        summary += f" | val/accuracy {metrics['val/accuracy']:.4f}"
    if builtin:
        summary += (
            f" | val/gold {metrics['val/gold']:+.3f} | val/kl {metrics['val/kl']:.2f} | "
            f"val/valid_frac {metrics['val/valid_frac']:.3f}"
        )
    print0(summary)
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
