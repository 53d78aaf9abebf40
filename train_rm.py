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

import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoints
import cli
import common
import hf
import parallel
from common import UserError, print0
from data import (
    Order,
    builtin_files,
    builtin_task,
    drop_tied,
    encode_prefs,
    longest_sequence,
    pad_right,
    read_jsonl,
    read_train_eval,
    responses_of,
    sft_sequence,
)
from model import calibration_error, last_token_scores, lm_loss, score_sequences
from task import PROBE_KINDS, is_task_prompt, probe_texts
from tokenizer import Tokenizer, load_tokenizer, same_tokenizer


@dataclass
class Args(common.CommonArgs):
    out_dir: str = "out/rm"
    """where ckpt.pt, TensorBoard event files and samples.jsonl (scored held-out pairs) go"""
    # --- data and model
    data: Optional[str] = None
    """preference JSONL: {"prompt", "chosen", "rejected"} (strings or messages), TRL's implicit prompt {"chosen",
    "rejected"} (messages sharing their head), or K-wise {"prompt", "responses", "ranking"} (None: built-in)"""
    eval_data: Optional[str] = None
    """held-out preference JSONL (None: the built-in task's split, or the last 5% of --data)"""
    calib_data: Optional[str] = None
    """SFT JSONL whose mean score is folded into the head's bias (None: built-in SFT demos, or --data's chosen)"""
    calib_size: int = 2048
    """calibration examples used (the first ones; 0: all)"""
    init: str = "out/sft/ckpt.pt"
    """path/to/ckpt.pt | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local GPT-2 folder | hf:<name-or-path>
    (gains a fresh score head)"""
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
    head_fit: bool = False
    """fit the score head on the frozen model's features before training (a Bradley-Terry logistic regression on the
    training pairs): the head starts where a linear probe ends, not at random"""
    head_fit_penalty: float = 0.01
    """L2 penalty of --head-fit's regression, on standardised features"""
    # --- evaluation
    eval_every: int = 100
    """steps between evaluations (and at the end; 0: only at the end)"""
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


def weighted_accuracy(gaps: torch.Tensor, weights: torch.Tensor) -> float:
    """Weighted share of pairs (P,) with a positive score gap, a tie counting 1/2."""
    correct = (gaps > 0) + 0.5 * (gaps == 0)
    return (weights * correct).sum().item() / weights.sum().item()


def collate(examples: list, pad_id: int):
    """Every response of every example as one right-padded batch: ids, mask (N, T); chosen and rejected row indices
    and weights (P,) of every pair; lm_mask (N, T), 1 on the best responses' own tokens (response + EOS)."""
    seqs, chosen, rejected, weights, lm_rows = [], [], [], [], []
    for example_seqs, n_prompt, pairs, best, _ in examples:
        base = len(seqs)
        seqs += example_seqs
        for better, worse, weight in pairs:
            chosen.append(base + better)
            rejected.append(base + worse)
            weights.append(weight)
        lm_rows.append((base + best, n_prompt))
    ids, mask = pad_right(seqs, pad_id)
    lm_mask = torch.zeros_like(mask)
    for row, n_prompt in lm_rows:
        lm_mask[row, n_prompt:] = mask[row, n_prompt:]
    return ids, mask, torch.tensor(chosen), torch.tensor(rejected), torch.tensor(weights), lm_mask


@torch.no_grad()
def head_features(model, seqs: list[list[int]], pad_id: int, batch_size: int, device, dtype) -> torch.Tensor:
    """(N, C) the score head's input (the trunk's last hidden state) at each sequence's last token, as score_sequences
    reads the score there: a hook on the head keeps its input."""
    device = torch.device(device)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    kept, features = [], None
    hook = model.score_head.register_forward_hook(lambda module, inputs, output: kept.append(inputs[0]))
    try:
        for start in range(0, len(seqs), batch_size):
            rows = order[start : start + batch_size]
            ids = pad_right([seqs[i] for i in rows], pad_id)[0]  # right padding: causal attention never sees it
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                model(ids.to(device), logits=False)
            hidden = kept.pop()  # (B, T, C)
            last = torch.tensor([len(seqs[i]) - 1 for i in rows], device=device)
            if features is None:
                features = torch.zeros(len(seqs), hidden.size(-1))
            features[rows] = hidden[torch.arange(len(rows), device=device), last].float().cpu()
    finally:
        hook.remove()
    return features


def fit_score_head(features: torch.Tensor, pairs: list, penalty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Bradley-Terry logistic regression on frozen features (N, C), as a score head: w minimising
    Σ weight · softplus(-(z_better - z_worse) · w) / Σ weight + penalty · |w|² on the standardised features z, by
    L-BFGS, then folded back onto the raw features (weight w / std, bias -(w / std) · mean, so head(h) = z · w).
    pairs: (better, worse, weight) rows of features. Returns (weight (C,), bias ())."""
    features = features.double()
    mean, std = features.mean(0), features.std(0) + 1e-6
    z = (features - mean) / std  # (N, C)
    better, worse, weights = (torch.tensor(column, dtype=torch.double) for column in zip(*pairs))
    gaps = z[better.long()] - z[worse.long()]  # (P, C)
    weights = weights / weights.sum()
    w = torch.zeros(z.size(1), dtype=torch.double, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = (weights * F.softplus(-gaps @ w)).sum() + penalty * w.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    weight = w.detach() / std
    return weight, -(weight * mean).sum()


@torch.no_grad()
def fold_score_offset(model, offset: float) -> None:
    """Subtract offset from every score the model gives by folding it into the scalar head's bias."""
    model.score_head.bias -= offset


def pair_backward(model, batch: list, args: Args, denoms: tuple, sync: bool, amp) -> dict:
    """One micro-batch (collate's tensors on the device): the Bradley-Terry loss over the step's global pair count
    plus --lm-coef x the next-token loss of the best responses over their global token count, and its backward.
    Returns sums for the logs: loss, bt_loss, lm_loss and the weighted accuracy (ties 1/2)."""
    ids, mask, chosen, rejected, weights, lm_mask = batch
    pair_denom, lm_denom = denoms
    with parallel.grad_sync(model, sync), amp:
        logits, token_scores = model(ids, logits=args.lm_coef > 0)  # right padding: no attention mask needed
        scores = last_token_scores(token_scores.float(), mask)  # (N,) score at each response's EOS
        bt_loss = preference_loss(scores[chosen], scores[rejected], weights, denom=pair_denom)
        lm_loss_value = bt_loss * 0
        if args.lm_coef > 0:
            lm_loss_value = lm_loss(logits[:, :-1], ids[:, 1:], lm_mask[:, 1:], lm_denom)
        loss = bt_loss + args.lm_coef * lm_loss_value
        parallel.backward_global(loss)
    gaps = scores[chosen] - scores[rejected]
    accuracy = (weights * ((gaps > 0) + 0.5 * (gaps == 0))).sum().detach() / pair_denom
    return {"loss": loss.detach(), "bt_loss": bt_loss.detach(), "lm_loss": lm_loss_value.detach(), "accuracy": accuracy}


def flops_per_token(model, examples: list, lm_coef: float) -> int:
    """Training FLOPs per token (perf/mfu): the model's estimate at the mean sequence length, less the lm head's
    6·V·C when lm_coef is 0 (the forward then computes no logits)."""
    lengths = [len(seq) for seqs, *_ in examples for seq in seqs]
    flops = model.flops_per_token(sum(lengths) // len(lengths))
    if lm_coef == 0 and model.config.lm_head:
        flops -= 6 * model.config.vocab_size * model.config.n_embd
    return flops


def score_on_every_rank(
    model, seqs: list, d: parallel.Dist, pad_id: int, dtype: torch.dtype, read=score_sequences
) -> torch.Tensor:
    """Scores (N,) of token sequences on every rank (read=head_features: the head's inputs (N, C)); rank r reads
    seqs[r::world_size] and the parts are gathered."""
    with parallel.gathered(model):  # rank slices differ in length: no per-forward collectives
        mine = read(model, seqs[d.rank :: d.world_size], pad_id, 64, d.device, dtype)
    if not d.ddp:
        return mine
    parts = [None] * d.world_size
    dist.all_gather_object(parts, mine)
    scores = torch.zeros(len(seqs), *mine.shape[1:])
    for rank, part in enumerate(parts):
        scores[rank :: d.world_size] = part
    return scores


def flat_pairs(examples: list) -> tuple[list[list[int]], list[tuple[int, int, float]]]:
    """Encoded records (data.encode_prefs) -> every sequence in one list, and every (better, worse, weight) pair as
    rows of it."""
    seqs, pairs = [], []
    for example_seqs, _, example_pairs, _, _ in examples:
        pairs += [(len(seqs) + better, len(seqs) + worse, weight) for better, worse, weight in example_pairs]
        seqs += example_seqs
    return seqs, pairs


def read_calibration(args: Args, task: Optional[dict], train_rows: list[dict]) -> list[dict]:
    """The first --calib-size SFT rows whose mean score is folded into the head's bias: --calib-data, the built-in
    task's SFT demonstrations, or on user data the chosen (best) response of each training record."""
    if args.calib_data or task is not None:
        rows = read_jsonl(args.calib_data or task["sft"], "sft", "--calib-data")
    else:
        rows = []
        for row in train_rows:
            best = row.get("ranking", [0])[0]
            rows.append({"prompt": row["prompt"], "response": responses_of(row)[best]})
    return rows[: args.calib_size or None]


def encode_calibration(tok, rows: list[dict], block_size: int) -> list[list[int]]:
    """SFT rows -> [BOS] + prompt + response + EOS id lists, those longer than the context left out."""
    sequences = []
    for row in rows:
        ids = sft_sequence(tok, row)
        if len(ids) <= block_size:
            sequences.append(ids)
    return sequences


def encode_probes(tok, prompts: list[str], size: int, seed: int, block_size: int) -> list[tuple[str, list[int]]]:
    """The hackability probe (built-in task): (kind, ids) of degenerate texts and fluent positive reviews on held-out
    prompts (task.probe_texts), those longer than the context left out."""
    probes = []
    for row in probe_texts(prompts, size, seed=seed):
        ids = tok.encode(row["prompt"], bos=True) + tok.encode(row["response"])
        ids += [tok.eos_id] if row["ended"] else []
        if len(ids) <= block_size:
            probes.append((row["kind"], ids))
    return probes


def pair_metrics(scores: torch.Tensor, evals: list, golds: Optional[list]) -> tuple[dict, torch.Tensor, list]:
    """Held-out metrics of encoded records `evals` (data.encode_prefs) from their sequences' scores (N,): val/accuracy,
    val/margin, val/ece and, with golds (built-in task), the Bayes ceiling and the RM's agreement with the gold order.
    Returns (metrics, gaps (P,) chosen minus rejected, the scored pairs as samples.jsonl records)."""
    pairs = [(record, *pair) for record in range(len(evals)) for pair in evals[record][2]]
    starts = [0]  # each record's first row in the flat list of scored sequences
    for example in evals:
        starts.append(starts[-1] + len(example[0]))
    score_chosen = scores[[starts[record] + better for record, better, _, _ in pairs]]
    score_rejected = scores[[starts[record] + worse for record, _, worse, _ in pairs]]
    weights = torch.tensor([weight for *_, weight in pairs], dtype=torch.double)
    gaps = score_chosen - score_rejected  # (P,)
    metrics = {
        "val/accuracy": weighted_accuracy(gaps, weights),
        "val/margin": (weights * gaps).sum().item() / weights.sum().item(),
        "val/ece": calibration_error(gaps),
    }
    if golds is not None:
        gold_gaps = torch.tensor([golds[record][better] - golds[record][worse] for record, better, worse, _ in pairs])
        metrics["val/bayes_ceiling"] = weighted_accuracy(gold_gaps, weights)
        metrics["val/gold_agreement"] = ((gaps * gold_gaps)[gold_gaps != 0] > 0).double().mean().item()
    scored = []
    for n, (record, better, worse, _) in enumerate(pairs):
        row = evals[record][4]
        texts = responses_of(row)
        scored.append(
            {
                "prompt": row["prompt"],
                "chosen": texts[better],
                "rejected": texts[worse],
                "score_chosen": score_chosen[n].item(),
                "score_rejected": score_rejected[n].item(),
            }
        )
        if golds is not None:
            scored[-1] |= {"gold_chosen": golds[record][better], "gold_rejected": golds[record][worse]}
    return metrics, gaps, scored


def probe_metrics(scores: torch.Tensor, kinds: list[str]) -> tuple[dict, dict]:
    """The probe's scores (N,) and kinds -> (probe/degenerate_score and probe/fluent_score, the mean score by kind)."""
    per_kind = {}
    for kind in PROBE_KINDS:
        per_kind[kind] = scores[[n for n, probe_kind in enumerate(kinds) if probe_kind == kind]].mean().item()
    degenerate = [n for n, kind in enumerate(kinds) if kind != "fluent"]
    metrics = {"probe/degenerate_score": scores[degenerate].mean().item(), "probe/fluent_score": per_kind["fluent"]}
    return metrics, per_kind


# -----------------------------------------------------------------------------
# main


@dataclass
class Data:
    """The RM's records, encoded for its tokenizer and context (load)."""

    train: list  # encode_prefs's examples
    evals: list
    calib: list  # token ids of the calibration responses
    probes: list  # (kind, ids) of the hackability probe (built-in task), or empty
    golds: Optional[list]  # the gold of every held-out response (built-in task), or None
    too_long: int  # training records skipped for the context
    tied: int  # training records dropped for a tie (chosen equal to rejected)


def empty_split_error(name: str, n_rows: int, n_tied: int, block_size: int) -> str:
    """The one line for an empty set of records: which set, and whether its records were tied or too long."""
    if n_rows == 0:
        return f"{name}: no preference record ({n_tied} tied, dropped): give more records, or --eval-data"
    return f"{name}: none of its {n_rows} records fits the context ({block_size} tokens)"


def load(args: Args) -> tuple[torch.nn.Module, Tokenizer, Optional[str], Data]:
    """Step 1: the data, tokenizer and model (--init with a score head), checked before any process group; returns
    them and the init's fingerprint (--resume compares it)."""
    builtin = args.data is None
    task = builtin_files(args, "pairs", "--data") if builtin else None
    task_module = builtin_task(args) if builtin else None
    train_path = task["pairs"] if builtin else args.data
    eval_path = args.eval_data or (task["pairs_eval"] if builtin else None)
    train_rows, eval_rows = read_train_eval(train_path, eval_path, "pairs")
    train_rows, tied = drop_tied(train_rows)
    eval_rows, eval_tied = drop_tied(eval_rows)
    calib_rows = read_calibration(args, task, train_rows)
    if args.init == "scratch" and not builtin:
        raise UserError("--init scratch only works on the built-in task; pass an SFT checkpoint or gpt2")
    task_tok = load_tokenizer(task["tokenizer"]) if builtin else None
    model, tok, _ = hf.load_init(args.init, tokenizer=task_tok, score_head=True, kind=("sft", "rm"))
    difference = same_tokenizer(tok, task_tok, [row["prompt"] for row in train_rows]) if builtin else None
    if difference:
        raise UserError(
            f"--init {args.init}: its tokenizer is not the built-in task's (--task {args.task}, {task['tokenizer']}): "
            f"{difference}"
        )
    block_size = model.config.block_size
    train, too_long = encode_prefs(tok, train_rows, block_size)
    evals, _ = encode_prefs(tok, eval_rows, block_size)
    calib = encode_calibration(tok, calib_rows, block_size)
    if not train:
        raise UserError(empty_split_error(train_path, len(train_rows), tied, block_size))
    held_out = eval_path or f"the held-out 5 % of {train_path}"  # --eval-data, or the last 5 % of --data
    if not evals:
        raise UserError(empty_split_error(held_out, len(eval_rows), eval_tied, block_size))
    if not calib:
        raise UserError(f"{args.calib_data or 'the calibration records'}: none fits the context ({block_size} tokens)")
    probes = []  # hackability probe (built-in task): degenerate texts and fluent positive reviews
    golds = None
    if builtin:
        prompts = [row["prompt"] for row in read_jsonl(task["eval_prompts"], "prompts")]
        if all(is_task_prompt(prompt) for prompt in prompts):
            probes = encode_probes(tok, prompts, args.probe_size, args.task_seed, block_size)
        else:  # arith, or a task of your own in task.py: the probe writes reviews-task texts only
            print0("probe: skipped (the task's prompts are not the reviews task's)")
        golds = [[task_module.gold_reward(ex[4]["prompt"], text, True) for text in responses_of(ex[4])] for ex in evals]
    init_hash = checkpoints.init_fingerprint(args.init)  # what this run started from
    return model, tok, init_hash, Data(train, evals, calib, probes, golds, too_long, tied)


def main(args: Args) -> None:
    t_start = time.time()
    # --resume: the run's own flags, a changed one refused
    args = checkpoints.task_from_checkpoint(args, args.init, "--init")  # --task: the init's unless given
    args = checkpoints.resume_args(args, "rm")
    if args.head_fit and args.fsdp:
        raise UserError("--head-fit writes the score head whole: not with --fsdp")
    checkpoints.prepare_out_dir(args.out_dir, args.resume, args.overwrite)
    common.seed_everything(args.seed)  # before the model: the fresh score head's init
    # 1. data, tokenizer and model (user mistakes surface here, before any process group)
    model, tok, init_hash, data = load(args)
    builtin = args.data is None
    train, evals, calib, probes, golds = data.train, data.evals, data.calib, data.probes, data.golds
    per_kind = {}  # probe score by kind, filled by evaluate()

    # 2. distributed set-up, sizes, optimizer, resume
    # sizes first, against the launched world size: a mistake ends here, before any process group
    per_rank, micro_batch_size, grad_accum_steps = parallel.batch_split(args.batch_size, args.micro_batch_size)
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    max_steps = args.max_steps or max(1, args.epochs * len(train) // args.batch_size)
    common.size_warnings(args.batch_size, "--batch-size", len(train), len(evals), args.warmup_steps, max_steps)
    print0(
        f"rm: {len(train)} train / {len(evals)} eval records ({data.too_long} too long, {data.tied} tied, skipped) | "
        f"{len(calib)} calibration | {model.num_params() / 1e6:.2f} M params | batch {args.batch_size} = "
        f"{d.world_size} ranks x {grad_accum_steps} accum x {micro_batch_size} | {max_steps} steps | "
        f"lm_coef {args.lm_coef} | device {d.device} {dtype}"
    )
    parallel.prepare_model(model, args)
    parallel.place_model(model, args, d, dtype)
    if args.head_fit and not args.resume:  # a resumed run's head is in its checkpoint
        # the head starts where a linear probe of the frozen features ends (LoRA's adapters start at zero)
        seqs, pairs = flat_pairs(train)
        features = score_on_every_rank(model.eval(), seqs, d, tok.pad_id, dtype, read=head_features)
        head_weight, head_bias = fit_score_head(features, pairs, args.head_fit_penalty)
        with torch.no_grad():
            model.score_head.weight.copy_(head_weight[None])
            model.score_head.bias.copy_(head_bias)
        better, worse, weights = (torch.tensor(column) for column in zip(*pairs))
        gaps = (features[better] - features[worse]).double() @ head_weight  # (P,)
        fit_accuracy = weighted_accuracy(gaps, weights.double())
        print0(f"head fit: {len(seqs)} responses, {len(pairs)} pairs | train accuracy {fit_accuracy:.4f}")
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), d.device.type)
    schedule = common.LRSchedule(args.lr, args.warmup_steps, max_steps, min_lr_ratio=0.0)
    trained = common.Trained("model", model, optimizer, schedule, args.grad_clip)
    order = Order(len(train), args.seed)  # the global record order, the same on every rank
    guard = common.StepGuard()
    run = checkpoints.Run("rm", args, d, tok, [trained], started=t_start)
    step = 0
    score_offset = 0.0  # calibration folded into the head's bias so far
    if args.resume:
        ckpt = run.resume({"init_hash": (f"--init {args.init}", init_hash)})
        step = ckpt["step"]
        score_offset = ckpt["score_offset"]
        order = Order(**ckpt["data_state"]["order"])
        guard.skipped = ckpt["data_state"]["skipped"]
    raw_model = model
    model = parallel.wrap_model(raw_model, d, args.compile)
    logger = common.Logger(args.out_dir, d.master, resume_step=step if args.resume else None)
    peak_flops = common.peak_flops(d.device, args.peak_flops, dtype)
    throughput = common.Throughput(flops_per_token(raw_model, train, args.lm_coef), peak_flops, d.world_size)

    score_all = partial(score_on_every_rank, raw_model, d=d, pad_id=tok.pad_id, dtype=dtype)

    def save(step: int) -> None:
        # calibration: fold the calibration mean into the head's bias; the Bradley-Terry loss only sees score
        # differences (and the LM loss never sees the head), so folding mid-run changes no later update
        nonlocal score_offset
        offset = score_all(calib).mean().item()
        fold_score_offset(raw_model, offset)
        score_offset += offset
        data_state = dict(order=order.state_dict(), skipped=guard.skipped)
        run.save(step, data_state, init_hash=init_hash, score_offset=score_offset)

    def evaluate(n_records: int, offset: float) -> tuple[dict, torch.Tensor, list]:
        """Held-out metrics, gaps (P,) and scored pairs of the first n_records records; scores minus offset."""
        records = evals[:n_records]
        scores = score_all([seq for example in records for seq in example[0]]) - offset
        metrics, gaps, scored = pair_metrics(scores, records, golds[:n_records] if builtin else None)
        if probes:
            probe_scores = score_all([ids for _, ids in probes]) - offset
            probe, kinds = probe_metrics(probe_scores, [kind for kind, _ in probes])
            metrics |= probe
            per_kind.update(kinds)
        return metrics, gaps, scored

    # 3. training loop: each step takes the next global batch of the epoch order; rank r owns a slice
    # dropout off: the model stays in eval mode, the only thing the mode changes in a GPT
    model.eval()
    window = {"loss": 0.0, "bt_loss": 0.0, "lm_loss": 0.0, "accuracy": 0.0, "tokens": 0}  # summed since the last log
    amp = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
    window_steps = 0
    stop = common.StopSignal()  # SIGINT/SIGTERM: save the step, exit 128 + signal
    while step < max_steps:
        if order.pos + args.batch_size > order.n:  # the epoch's remainder is dropped
            order.pos = order.n
        batch = [train[i] for i in order.take(args.batch_size)]
        lr = common.step_lr(trained, step)
        # losses are divided by global counts of the step (pairs weigh 1 per record; LM: best-response tokens)
        pair_denom = float(len(batch))
        lm_denom = float(sum(len(seqs[best]) - n_prompt for seqs, n_prompt, _, best, _ in batch))
        # sorted by length: each micro-batch pads to its own longest sequence (the gradient does not depend on it)
        my_batch = sorted(batch[d.rank * per_rank : (d.rank + 1) * per_rank], key=longest_sequence)
        for micro_step in range(grad_accum_steps):
            micro_batch = my_batch[micro_step * micro_batch_size :][:micro_batch_size]
            batch = [t.to(d.device) for t in collate(micro_batch, tok.pad_id)]
            sync = micro_step == grad_accum_steps - 1
            sums = pair_backward(model, batch, args, (pair_denom, lm_denom), sync, amp)
            for key, value in sums.items():
                window[key] += value
            window["tokens"] += sum(len(seq) for seqs, *_ in micro_batch for seq in seqs)
        common.guarded_step([trained], guard, step)
        step += 1
        window_steps += 1
        stopping = stop.requested(d.device)

        if (args.log_every > 0 and step % args.log_every == 0) or step == max_steps:
            totals = parallel.all_reduce_dict(window, d.device)
            metrics = {
                f"train/{name}": totals[name] / window_steps for name in ("loss", "bt_loss", "lm_loss", "accuracy")
            }
            metrics["train/lr"] = lr
            logger.log(step, metrics | guard.read() | throughput.read(totals["tokens"]), max_steps)
            window = dict.fromkeys(window, 0.0)
            window_steps = 0
        final = step == max_steps
        with throughput.paused():  # perf/ counts training time only
            if (args.save_every > 0 and step % args.save_every == 0) or final or stopping:
                save(step)  # also calibrates: the final evaluation sees the checkpoint's scores
            if stopping:
                logger.close()
                stop.exit(stopping, run.path)
            if (args.eval_every > 0 and step % args.eval_every == 0) or final:
                # scores relative to a typical SFT answer: the final save has just folded the calibration in; in
                # between, subtract the mean score of the first calibration examples (cheaper than folding)
                offset = 0.0 if final else score_all(calib[: args.eval_pairs]).mean().item()
                n_records = len(evals) if final else min(args.eval_pairs, len(evals))
                with parallel.gathered(raw_model):  # no collectives inside: ranks run unequal numbers of forwards
                    metrics, gaps, scored = evaluate(n_records, offset)
                logger.log(step, metrics, max_steps)
                if logger.writer is not None:
                    logger.writer.add_histogram("val/score_gap", gaps, step)
                if final:
                    logger.samples(step, scored)

    stop.close()
    # 4. the numbers that matter
    print0(
        f"calibration: score_offset {score_offset:+.4f} (the mean score of {len(calib)} calibration examples) "
        f"folded into score_head.bias"
    )
    if probes:
        print0("probe (mean score by kind): " + " | ".join(f"{kind} {score:+.3f}" for kind, score in per_kind.items()))
    if args.export_hf and d.master:
        checkpoints.export_hf(raw_model, tok, args.export_hf)
    summary = f"rm done in {time.time() - t_start:.0f}s: {run.path} | val/accuracy {metrics['val/accuracy']:.4f}"
    if builtin:
        summary += f" | val/bayes_ceiling {metrics['val/bayes_ceiling']:.4f}"
    if probes:
        summary += (
            f" | probe/degenerate_score {metrics['probe/degenerate_score']:+.3f} | probe/fluent_score "
            f"{metrics['probe/fluent_score']:+.3f}"
        )
    print0(summary)
    logger.close()
    parallel.cleanup_dist()


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
