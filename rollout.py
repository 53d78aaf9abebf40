"""What both RL stages do the same (train_ppo.py: PPO-max; train_grpo.py: the critic-free family): the flags of what
they start from and sample, the frozen roles (reference, reward models) loaded beside the policy, the prompt and
pre-training text streams, and steps 1-3 of an iteration, generate -> score -> policy and reference log-probs
(`rollout`); the statistics both use (masked whitening over ranks, running moments of the scores), the KL estimators,
truncated importance sampling, the ptx loss, the micro-batch plumbing of an update, metrics and FLOPs.

What each stage makes of a rollout (rewards, advantages, the losses and the update) is written in the stage itself,
the clipped surrogate included: PPO-max clips its ratio symmetrically over token means, while the critic-free family
adds clip-higher, dual-clip and per-sequence loss aggregation, so a shared loss would carry knobs only one stage
uses. A formula read twice is the cost of a stage that reads alone from its Args to its loop (cleanrl's way).

Scripts import this module, never each other. bench/ and tests/ call `rollout` too.
"""

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist

import checkpoints
import common
import hf
import parallel
from common import UserError, exact_div, format_sample
from data import Order, encode_prompts, encode_sft, pad_right, prompt_ids, prompt_text, read_jsonl
from generate import Samples, sample
from lora import BaseView, merge_lora, merged_state_dict
from model import aggregate_rm_scores, entropy_from_logits, lm_loss, logprobs_from_logits, response_forward
from task import build_task, gold_reward
from tokenizer import Tokenizer


@dataclass
class RolloutArgs(common.CommonArgs):
    """Flags both RL stages share: what they start from, what they sample and how it is scored."""

    # --- models and data
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the policy's init (a policy checkpoint: SFT, DPO, PPO or GRPO), and the frozen reference unless --ref-ckpt"""
    ref_ckpt: Optional[str] = None
    """the frozen reference of the KL penalty (None: --sft-ckpt); a later round of iterated RLHF starts its policy
    from the last round's and keeps the SFT policy as the reference"""
    rm_ckpt: list[str] = field(default_factory=lambda: ["out/rm/ckpt.pt"])
    """frozen reward models: one, or the K members of an ensemble combined by --rm-agg; 'none': --reward-fn alone"""
    rm_agg: Literal["mean", "min", "uwo"] = "mean"
    """an ensemble's scores combined: mean, min (the worst case) or uwo = mean - --rm-uwo-coef x the members'
    variance (uncertainty-weighted optimisation, Coste et al. 2023); one RM is its own score under all three"""
    rm_uwo_coef: float = 1.0
    """--rm-agg uwo: the weight of the members' population variance"""
    reward_fn: Optional[str] = None
    """module:function or path/to/file.py:function, fn(prompt: str, response: str, ended: bool) -> float, added to
    the RM score (e.g. task:gold_reward)"""
    reward_fn_coef: float = 1.0
    """weight of --reward-fn in the score"""
    prompts: Optional[str] = None
    """prompts JSONL, one {"prompt": str or [messages]} a line (None: the built-in task's)"""
    ptx_data: Optional[str] = None
    """pre-training text JSONL {"text": str} for the ptx loss (None: the built-in task's text; none on user prompts)"""
    # --- rollout
    total_episodes: int = 12800
    """responses (episodes) sampled over the run (max_steps = total_episodes / rollout_batch_size unless --max-steps)"""
    rollout_batch_size: int = 64
    """responses per iteration, summed over ranks (the experience buffer: small, as PPO-max advises)"""
    num_minibatches: int = 2
    """optimizer steps per pass over a rollout (a minibatch is rollout_batch_size / num_minibatches)"""
    micro_batch_size: int = 32
    """rows per rank per forward, at most a rank's share of a minibatch (gradient accumulation makes up the rest)"""
    max_new_tokens: int = 64
    """longest response; sampling uses the tempered distribution only (top-k/top-p would make the ratio off-policy)"""
    temperature: float = 1.0
    """sampling temperature; log-probs for the ratio and the KL use logits / temperature too"""
    missing_eos_penalty: float = -1.0
    """score of a response that does not end with EOS, in place of the RM score"""
    tis_cap: Optional[float] = None
    """truncated importance sampling (Yao et al. 2025), for a sampler whose numerics differ from the trainer's (bf16):
    each token's policy loss weighted by min(pi_old / pi_sampler, C), pi_old the training forward's probability of
    the sampled token and pi_sampler the generation's own (None: off)"""
    ptx_coef: float = 0.1
    """weight of the LM loss on pre-training text (0: off)"""
    ptx_batch_size: int = 16
    """pre-training texts per optimizer step, summed over ranks (split like the minibatch)"""
    sample_every: int = 25
    """iterations between sample tables (TensorBoard text and samples.jsonl; 0: only the last)"""


def resolve_rollout_args(args):
    """What older checkpoints' args spell another way: one RM path (before ensembles), a reward function's older
    name. Applied to the saved args too (checkpoints.resume_args), so both compare like with like."""
    rm_ckpt = [args.rm_ckpt] if isinstance(args.rm_ckpt, str) else list(args.rm_ckpt)
    reward_fn = common.REWARD_FN_ALIASES.get(args.reward_fn, args.reward_fn)
    return replace(args, rm_ckpt=rm_ckpt, reward_fn=reward_fn)


def check_rollout_args(args: RolloutArgs) -> None:
    """The shared settings no run can mean: a one-line UserError naming the flag, before any work."""
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: RL samples from the tempered distribution; use > 0")
    if args.rm_ckpt == ["none"] and args.reward_fn is None:
        raise UserError("--rm-ckpt none needs --reward-fn module:function (e.g. task:gold_reward)")
    if "none" in args.rm_ckpt and len(args.rm_ckpt) > 1:
        raise UserError(f"--rm-ckpt {' '.join(args.rm_ckpt)}: 'none' stands alone (no reward model)")
    if args.tis_cap is not None and args.tis_cap <= 0:
        raise UserError(f"--tis-cap {args.tis_cap}: the cap of an importance weight, use > 0 (e.g. 2)")
    if args.ptx_coef < 0:
        raise UserError(f"--ptx-coef {args.ptx_coef}: a loss weight, use >= 0")


# -----------------------------------------------------------------------------
# statistics: tensors are (B, T) over response tokens, mask 1.0 = real token


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the valid entries."""
    return (x * mask).sum() / mask.sum()


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, mean=None, var=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the biased variance of the valid entries (or the given global mean/var);
    shift_mean=False adds the mean back. Padding entries are meaningless: mask them."""
    mean = masked_mean(x, mask) if mean is None else mean
    var = masked_mean((x - mean) ** 2, mask) if var is None else var
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def global_moments(x: torch.Tensor, mask: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of x over the valid entries of every rank (one all-reduce, float64 on device: no host
    sync), as float32 tensors for masked_whiten; no valid entry anywhere gives mean 0 and variance 0, not a NaN."""
    masked = x * mask
    count, total, total_squared = parallel.all_reduce_stack([mask.sum(), masked.sum(), (masked**2).sum()], device)
    count = count.clamp(min=1.0)
    mean = total / count
    variance = total_squared / count - mean**2
    return mean.float(), variance.float()


class RunningMoments:
    """Running mean and std of every score seen (parallel Welford / Chan et al.), merged across DDP ranks."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    @staticmethod
    def combine(triples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        """Fold (count, mean, M2) triples into one (Chan et al. 1979); exact, order-independent up to rounding."""
        n, mean, m2 = 0.0, 0.0, 0.0
        for nb, mb, m2b in triples:
            if nb == 0:
                continue
            delta, tot = mb - mean, n + nb
            mean, m2, n = mean + delta * nb / tot, m2 + m2b + delta**2 * n * nb / tot, tot
        return n, mean, m2

    def update(self, x: torch.Tensor) -> None:
        """Add a batch: every rank's (count, mean, M2) is all-gathered and folded in rank order, so all ranks agree."""
        x = x.detach().double().flatten()
        local = torch.stack([torch.tensor(float(x.numel()), device=x.device), x.mean(), ((x - x.mean()) ** 2).sum()])
        per_rank = [local]
        if dist.is_initialized():
            per_rank = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, local)
        per_rank = torch.stack(per_rank).tolist()  # one host sync
        self.count, self.mean, self.m2 = self.combine([(self.count, self.mean, self.m2)] + per_rank)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def normalize_scores(scores, mean: float, std: float, mode: str, clip: Optional[float]) -> torch.Tensor:
    """PPO-max §3.2: scores (B,) normalised with running moments, then clipped to +-clip (None: no clip). mode none |
    scale = s/std | norm = (s - mean)/std. A std under 1e-6 (every score seen so far equal: all responses missing EOS,
    an all-invalid batch under --reward-fn) gives no scale to divide by and counts as 1, never s/1e-8."""
    scale = std + 1e-8 if std > 1e-6 else 1.0
    if mode == "norm":
        scores = (scores - mean) / scale
    elif mode == "scale":
        scores = scores / scale
    elif mode != "none":
        raise ValueError(f"unknown reward normalisation {mode!r}")
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


def kl_estimate(logprobs, ref_logprobs, mask, estimator: str) -> torch.Tensor:
    """Per-token estimates (B, T) of KL(pi || ref), 0 on padding, masked before any exponential (a pad may hold any
    log-prob). With d = logp - ref_logp (http://joschu.net/blog/kl-approx.html): k1 = d; k2 = d^2 / 2; k3 = (r - 1)
    - log r, r = ref_p / p, unbiased and >= 0. Their gradients differ (DESIGN §5d): as a detached reward penalty only
    k1's expected gradient is that of KL(pi || ref) (k2's and k3's point elsewhere); in the loss, on the current
    log-probs, k1's expected gradient is zero, k2's is that of KL(pi || ref) and k3's that of KL(ref || pi)."""
    log_ratio = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown kl estimator {estimator!r}")
    return kl * mask


def tis_weights(old_logprobs, sampler_logprobs, mask, cap: float) -> tuple[torch.Tensor, dict]:
    """Truncated importance sampling (Yao et al. 2025): per token (B, T) min(pi_old / pi_sampler, cap), pi_old the
    training forward's probability of the sampled token and pi_sampler the sampler's own, masked before the
    exponential (0 on padding); stats: tis_weight_mean, tis_clipfrac (the share of tokens whose ratio exceeds the
    cap), means over the valid tokens."""
    ratio = torch.exp(torch.where(mask.bool(), old_logprobs - sampler_logprobs, 0.0))
    weights = ratio.clamp(max=cap) * mask
    stats = {"tis_weight_mean": masked_mean(weights, mask), "tis_clipfrac": masked_mean((ratio > cap).float(), mask)}
    return weights, stats


def tis_metrics(experience: dict, loss_mask, cap: float, device) -> tuple[torch.Tensor, dict]:
    """--tis-cap over a rollout: the weights (B, T) and policy/tis_weight_mean, policy/tis_clipfrac over every rank's
    policy-loss tokens (one all-reduce)."""
    weights, stats = tis_weights(experience["logprobs"], experience["sampler_logprobs"], loss_mask, cap)
    tokens = loss_mask.sum()
    sums = parallel.all_reduce_dict({key: value * tokens for key, value in stats.items()} | {"n": tokens}, device)
    return weights, {f"policy/{key}": sums[key] / max(sums["n"], 1.0) for key in stats}


# -----------------------------------------------------------------------------
# models and data


def load_inputs(args: RolloutArgs) -> tuple[dict, dict, list[dict]]:
    """The policy's init checkpoint, the reference's (--ref-ckpt, else the same) and the RM checkpoints (none with
    --rm-ckpt none), checked to share one tokenizer."""
    kinds = checkpoints.POLICY_KINDS
    sft = checkpoints.load_checkpoint(args.sft_ckpt, kind=kinds, flag="--sft-ckpt")
    ref = sft
    if args.ref_ckpt is not None:
        ref = checkpoints.load_checkpoint(args.ref_ckpt, kind=kinds, flag="--ref-ckpt")
    rms = [checkpoints.load_checkpoint(path, kind="rm", flag="--rm-ckpt") for path in args.rm_ckpt if path != "none"]
    others = [("--ref-ckpt", args.ref_ckpt, ref)] + [("--rm-ckpt", p, c) for p, c in zip(args.rm_ckpt, rms)]
    for flag, path, ckpt in others:
        if ckpt["tokenizer"] != sft["tokenizer"]:
            raise UserError(
                f"{flag} {path}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s (train it from this SFT "
                "checkpoint)"
            )
    return sft, ref, rms


def input_hashes(args: RolloutArgs) -> dict:
    """What the run started from, kept in its checkpoints: --resume refuses a changed input."""
    return {
        "sft_hash": checkpoints.file_sha256(args.sft_ckpt),
        "ref_hash": checkpoints.file_sha256(args.ref_ckpt) if args.ref_ckpt else None,
        "rm_hashes": [checkpoints.file_sha256(path) for path in args.rm_ckpt if path != "none"],
    }


HASH_FLAGS = {"sft_hash": "--sft-ckpt", "ref_hash": "--ref-ckpt", "rm_hashes": "--rm-ckpt"}


@dataclass
class Models:
    """The roles both RL stages have: the policy (actor, LM head), its frozen reference and the frozen reward models
    (scalar heads: one, the K members of an ensemble, or none with --rm-ckpt none). Under LoRA the reference is the
    actor with its adapters off (lora.BaseView); PPO's first reward model is its critic's base with the RM's head.
    sampler: what generates the rollouts when it is not the actor itself, a bf16 copy of it (with_sampler)."""

    actor: torch.nn.Module
    ref: torch.nn.Module
    reward_models: list[torch.nn.Module]
    sampler: Optional[torch.nn.Module] = None

    def frozen(self) -> list[torch.nn.Module]:
        return [self.ref, *self.reward_models]

    def compiled(self, setting: str, device: torch.device) -> "Models":
        """The training forward of each role: torch.compile'd under --compile (a LoRA view switches its base's
        adapters in eager code around the call: not compiled), else the modules themselves. The rollout's no-grad
        passes run it, so the sampler's log-probs are checked against the very forward the update differentiates."""
        if not parallel.use_compile(setting, device):
            return self
        reward_models = [compile_role(m) for m in self.reward_models]
        return Models(compile_role(self.actor), compile_role(self.ref), reward_models, self.sampler)

    def with_sampler(self, dtype: torch.dtype, fsdp: bool) -> "Models":
        """Under bf16 (not --fsdp, whose sharded actor gathers its parameters in bf16 for the rollout already): a
        frozen copy of the actor stored in bf16 (parallel.store_low_precision; LoRA adapters merged) that generates
        the rollouts, so the decode reads 2 bytes a parameter and casts nothing; refresh_sampler copies the actor in
        after every update, in place."""
        if dtype == torch.float32 or fsdp:
            return self
        sampler = merge_lora(copy.deepcopy(self.actor)).requires_grad_(False).eval()
        return replace(self, sampler=parallel.store_low_precision(sampler, dtype))


@torch.no_grad()
def refresh_sampler(models: Models) -> None:
    """The actor's weights (adapters merged) into its bf16 sampler, in place (copy_: static caches and CUDA graphs
    keep their addresses, no recompile); the actor's fp32 master weights and optimizer state are untouched."""
    if models.sampler is not None:
        models.sampler.load_state_dict(merged_state_dict(models.actor))


def compile_role(model):
    """parallel.compile_forward, except for a LoRA view and a missing role."""
    return model if model is None or isinstance(model, BaseView) else parallel.compile_forward(model)


def build_policy(args: RolloutArgs, sft: dict, ref: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy (LoRA and --grad-ckpt applied) and its frozen reference from the checkpoints in memory, on the CPU.
    Under LoRA the reference is the policy with its adapters off when it is the policy's init (lora.BaseView)."""
    actor = hf.model_from_checkpoint(sft)
    parallel.prepare_model(actor, args, "actor")
    lora = args.lora_rank > 0
    reference = BaseView(actor) if lora and ref is sft else hf.model_from_checkpoint(ref)
    return actor, reference.requires_grad_(False)


def build_reward_models(args: RolloutArgs, rms: list[dict], rm_base=None) -> list[torch.nn.Module]:
    """The frozen reward models from their checkpoints in memory, on the CPU. Under LoRA with rm_base (PPO's critic,
    built from the first RM) the first member is that base with the RM's own frozen score head (lora.BaseView); the
    other members of an ensemble are full frozen models."""
    reward_models = []
    for k, rm in enumerate(rms):
        if k == 0 and args.lora_rank > 0 and rm_base is not None:
            head = copy.deepcopy(rm_base.score_head).requires_grad_(False)
            reward_models.append(BaseView(rm_base, score_head=head))
        else:
            reward_models.append(hf.model_from_checkpoint(rm))
    return [model.requires_grad_(False) for model in reward_models]


def load_prompts(args: RolloutArgs, tok: Tokenizer, block_size: int) -> tuple[list, int, list, Optional[Callable]]:
    """(prompts that leave room for --max-new-tokens in the context, how many were too long, the ptx texts encoded,
    the gold reward on the built-in task or None)."""
    builtin = args.prompts is None
    task = build_task(args.task_dir, args.task_seed) if builtin else None
    rows = read_jsonl(task["prompts"] if builtin else args.prompts, "prompts", "--prompts")
    prompts = [row["prompt"] for row in rows]
    fitting = [prompt for prompt in prompts if len(prompt_ids(tok, prompt)) + args.max_new_tokens <= block_size]
    if not fitting:
        raise UserError(
            f"every prompt is longer than the context minus --max-new-tokens ({block_size} - {args.max_new_tokens} "
            "tokens)"
        )
    ptx_path = args.ptx_data or (task["pretrain"] if builtin else None)
    ptx = []
    if ptx_path:
        ptx, _ = encode_sft(tok, read_jsonl(ptx_path, "text", "--ptx-data"), block_size, mask_prompt=False)
    return fitting, len(prompts) - len(fitting), ptx, gold_reward if builtin else None


@dataclass(frozen=True)
class Sizes:
    """The derived sizes of the run, per rank."""

    prompts_per_rank: int  # a rank's responses per iteration / group_size: a group never straddles two ranks
    micro_batch_size: int  # rows per forward, at most a rank's share of a minibatch
    grad_accum_steps: int  # micro-batches per optimizer step
    ptx_micro_batch_size: int  # pre-training texts per micro-batch (0: no ptx loss)


def batch_sizes(args: RolloutArgs, group_size: int, has_ptx: bool) -> Sizes:
    """--rollout-batch-size over the launched world size, the group, the minibatches and the micro-batch, each split
    checked with exact_div: a mistake ends here, before any process group."""
    launched = parallel.launched_world_size()
    rows_per_rank = exact_div(args.rollout_batch_size, launched, "--rollout-batch-size over the world size")
    prompts_per_rank = exact_div(rows_per_rank, group_size, "--rollout-batch-size/world_size over --group-size")
    minibatch_rows = exact_div(
        rows_per_rank, args.num_minibatches, "--rollout-batch-size/world_size over --num-minibatches"
    )
    micro_batch_size = min(args.micro_batch_size, minibatch_rows)  # never more than a rank's share of a minibatch
    grad_accum_steps = exact_div(minibatch_rows, micro_batch_size, "minibatch rows per rank over --micro-batch-size")
    ptx_micro_batch_size = 0
    if has_ptx:  # checked only when there is a ptx loss to compute
        ptx_micro_batch_size = exact_div(
            args.ptx_batch_size, launched * grad_accum_steps, "--ptx-batch-size over world_size * accum steps"
        )
    return Sizes(prompts_per_rank, micro_batch_size, grad_accum_steps, ptx_micro_batch_size)


class PromptStream:
    """This rank's share of the next prompts of the global order (the same on every rank), each repeated group_size
    times in a row (a group's G responses are sampled together)."""

    def __init__(self, prompts: list, order: Order, prompts_per_rank: int, group_size: int, d: parallel.Dist):
        self.prompts = prompts
        self.order = order
        self.per_rank = prompts_per_rank
        self.group_size = group_size
        self.d = d

    def next(self) -> list:
        global_rows = self.order.take(self.per_rank * self.d.world_size)
        rows = global_rows[self.d.rank * self.per_rank : (self.d.rank + 1) * self.per_rank]
        return [self.prompts[row] for row in rows for _ in range(self.group_size)]


class PtxSampler:
    """This rank's slice of the next global micro-batch of pre-training text: (inputs, targets, target mask) on the
    device, from the global order (saved in the checkpoint)."""

    def __init__(self, texts: list, order: Order, micro_batch_size: int, d: parallel.Dist, pad_id: int):
        self.texts, self.order, self.micro_batch_size, self.d, self.pad_id = texts, order, micro_batch_size, d, pad_id

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, rank = self.micro_batch_size, self.d.rank
        rows = self.order.take(size * self.d.world_size)[rank * size : (rank + 1) * size]
        ids, _ = pad_right([self.texts[row][0] for row in rows], self.pad_id)
        loss_mask, _ = pad_right([self.texts[row][1] for row in rows], 0)
        device = self.d.device
        return ids[:, :-1].to(device), ids[:, 1:].to(device), loss_mask[:, 1:].float().to(device)


# -----------------------------------------------------------------------------
# steps 1-3 of an iteration: generate, score, log-probs


def check_logprobs(generation_logprobs, logprobs, mask, dtype: torch.dtype) -> float:
    """The sampler's own log-probs must match the training forward's, or the first ratio is not 1: the max |diff|
    over ranks (every rank raises together; one rank alone would leave the others waiting in the next collective),
    an error above 1e-4 in fp32, reported in bf16."""
    error = ((generation_logprobs - logprobs).abs() * mask).max()
    if dist.is_initialized():
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    error = error.item()
    if dtype == torch.float32 and error > 1e-4:
        raise RuntimeError(f"generation log-probs differ from the training forward by {error:.2e} > 1e-4 in fp32")
    return error


@dataclass
class Responses:
    """A rollout's prompts and what the policy answered (generate_responses)."""

    query: torch.Tensor  # (B, P) left-padded prompt ids
    query_mask: torch.Tensor  # (B, P)
    prompt_texts: list[str]  # each prompt as the reward function and the logs see it (a conversation rendered)
    samples: Samples


@torch.no_grad()
def generate_responses(
    models: Models, tok: Tokenizer, prompts: list, args: RolloutArgs, generator, temperature: float, dtype
) -> Responses:
    """Step 1: the policy's responses to this rank's prompts from the KV-cache decode (the tempered distribution, no
    top-k/top-p: the ratio must be on-policy; temperature 0: greedy); under --compile static caches and the
    one-token step compiled (CUDA graphs on a GPU), not under --fsdp. Generation stops each row at its first EOS and
    pads after it (the mask includes the EOS)."""
    device = next(models.actor.parameters()).device
    query, query_mask = (t.to(device) for t in encode_prompts(tok, prompts))
    compiled = parallel.use_compile(args.compile, device) and not args.fsdp
    policy = models.actor if models.sampler is None else models.sampler
    with parallel.autocast(device, dtype), parallel.gathered(policy):  # --fsdp: gathered once, not per token
        samples = sample(
            policy,
            tok,
            query,
            query_mask,
            args.max_new_tokens,
            temperature,
            generator=generator,
            compiled=compiled,
        )
    prompt_texts = [prompt_text(tok, prompt) for prompt in prompts]
    return Responses(query, query_mask, prompt_texts, samples)


def micro_batches(responses: Responses, micro_batch_size: int):
    """(rows, query, query_mask, response, mask) of each micro-batch of a rollout, in order."""
    samples = responses.samples
    for start in range(0, samples.response.size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        yield rows, responses.query[rows], responses.query_mask[rows], samples.response[rows], samples.mask[rows]


@torch.no_grad()
def response_scores(models: Models, responses: Responses, args: RolloutArgs, micro_batch_size: int, reward_fn, amp):
    """Step 3's score of each response (B,): each RM's score read at the last real token (its calibration folded
    into its head), aggregated over an ensemble (--rm-agg), + coef * reward_fn(prompt, response, ended); a response
    without EOS gets --missing-eos-penalty instead. Returns (scores, the parts logged apart: rm_score and reward_fn
    when there are two, score_std for an ensemble's spread)."""
    samples = responses.samples
    eos_position = responses.query.size(1) + samples.last[:, None]  # (B, 1)
    members = []  # (K, micro-batch) each
    for rows, query, query_mask, response, mask in micro_batches(responses, micro_batch_size):
        sequence, sequence_mask = torch.cat([query, response], 1), torch.cat([query_mask, mask], 1)
        member_scores = []
        for reward_model in models.reward_models:
            with amp:
                _, token_scores = reward_model(sequence, sequence_mask, logits=False)
            member_scores.append(token_scores.float().gather(1, eos_position[rows]).squeeze(1))
        if member_scores:
            members.append(torch.stack(member_scores))
    scores = torch.zeros(samples.response.size(0), device=eos_position.device)
    score_parts = {}
    if members:
        member_scores = torch.cat(members, dim=-1)  # (K, B)
        scores = aggregate_rm_scores(member_scores, args.rm_agg, args.rm_uwo_coef)
        if member_scores.size(0) > 1:
            score_parts["score_std"] = member_scores.std(0, correction=0)
    if reward_fn is not None:
        texts = zip(responses.prompt_texts, samples.texts, samples.ended.tolist())  # a conversation: rendered
        fn_scores = torch.tensor([float(reward_fn(p, t, e)) for p, t, e in texts], device=scores.device)
        if members:
            score_parts["rm_score"] = scores
        score_parts["reward_fn"] = fn_scores
        scores = scores + args.reward_fn_coef * fn_scores
    scores = torch.where(samples.ended, scores, torch.full_like(scores, args.missing_eos_penalty))
    return scores, score_parts


@torch.no_grad()
def policy_and_reference_logprobs(models: Models, responses: Responses, micro_batch_size: int, temperature, amp):
    """Step 3's no-grad passes of the training forward, per micro-batch: the policy's and the reference's log-probs
    of the response tokens and the policy's entropy, (B, T) each, masked."""
    chunks = {"logprobs": [], "ref_logprobs": [], "entropy": []}
    for _, *micro_batch in micro_batches(responses, micro_batch_size):
        response = micro_batch[2]
        with amp:
            logits, _ = response_forward(models.actor, *micro_batch, temperature)
            ref_logits, _ = response_forward(models.ref, *micro_batch, temperature)
        chunks["logprobs"].append(logprobs_from_logits(logits, response))
        chunks["ref_logprobs"].append(logprobs_from_logits(ref_logits, response))
        chunks["entropy"].append(entropy_from_logits(logits))
    mask = responses.samples.mask
    return {key: torch.cat(values) * mask for key, values in chunks.items()}


@torch.no_grad()
def rollout(
    models: Models,
    tok: Tokenizer,
    prompts: list,
    args: RolloutArgs,
    *,
    micro_batch_size: int,
    generator: torch.Generator,
    reward_fn: Optional[Callable] = None,
    gold_fn: Optional[Callable] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict, list]:
    """Steps 1-3 on this rank's prompts (a group's G copies of a prompt consecutive), with models' training forwards:
    generate, the policy's and the reference's log-probs (checked against the sampler's own), the scores. Returns
    (experience: (B, ...) tensors query, query_mask, response, mask, logprobs, ref_logprobs, sampler_logprobs,
    scores (after the missing-EOS penalty) and ended; sums: this rank's named sums of the rollout's metrics for
    rollout_metrics; records: this rank's samples as dicts)."""
    responses = generate_responses(models, tok, prompts, args, generator, args.temperature, dtype)
    samples = responses.samples
    amp = parallel.autocast(samples.mask.device, dtype)
    logprobs = policy_and_reference_logprobs(models, responses, micro_batch_size, args.temperature, amp)
    logprob_error = check_logprobs(samples.logprobs, logprobs["logprobs"], samples.mask, dtype)
    scores, score_parts = response_scores(models, responses, args, micro_batch_size, reward_fn, amp)
    experience = dict(
        query=responses.query,
        query_mask=responses.query_mask,
        response=samples.response,
        mask=samples.mask,
        logprobs=logprobs["logprobs"],
        ref_logprobs=logprobs["ref_logprobs"],
        scores=scores,
        ended=samples.ended.float(),
        sampler_logprobs=samples.logprobs * samples.mask,
    )
    ended = samples.ended.tolist()  # one host sync for the records
    gold = None
    if gold_fn is not None:
        gold = [gold_fn(p, t, e) for p, t, e in zip(responses.prompt_texts, samples.texts, ended)]
    sums = rollout_sums(experience, logprobs["entropy"], score_parts, gold) | {"logprob_err": logprob_error}
    records = []
    for row, score in enumerate(scores.tolist()):
        record = dict(prompt=responses.prompt_texts[row], response=samples.texts[row], ended=ended[row], score=score)
        records.append(record | {"gold": gold[row] if gold else None})
    return experience, sums, records


def rollout_sums(experience: dict, entropy, score_parts: dict, gold: Optional[list]) -> dict:
    """This rank's named sums behind the rollout's metrics (rollout_metrics reduces them over ranks). score_parts:
    per-response values (B,) logged as objective/<name> (the RMs' and the reward function's own scores when a reward
    function is given, an ensemble's spread); gold: per response (built-in task) or None."""
    mask = experience["mask"]
    logprobs = experience["logprobs"]
    kl_per_sequence = ((logprobs - experience["ref_logprobs"]) * mask).sum(1)  # objective/kl is always the summed k1
    sums = {
        "sequences": float(mask.size(0)),
        "score": experience["scores"].sum(),
        "kl": kl_per_sequence.sum(),
        "entropy": entropy.sum(),
        "tokens": mask.sum(),
        "nll": -logprobs.sum(),
        "ended": experience["ended"].sum(),
    }
    if gold:
        sums["gold"] = float(sum(gold))
    for name, part in score_parts.items():
        sums[f"part/{name}"] = part.sum()
    return sums


def rollout_metrics(sums: dict, device) -> tuple[dict, dict]:
    """The rollout's DESIGN §6 metrics, global means over every rank's responses and tokens from one all-reduce of
    this rank's named sums (rollout_sums, plus the stage's own): returns (metrics, the global sums, for the stage's
    own metrics). logprob_err is already the maximum over ranks."""
    logprob_error = sums.pop("logprob_err")
    totals = parallel.all_reduce_dict(sums, device)
    sequences = totals["sequences"]
    tokens = totals["tokens"]
    metrics = {
        "objective/score": totals["score"] / sequences,
        "objective/kl": totals["kl"] / sequences,
        "objective/entropy": totals["entropy"] / tokens,
        "rollout/response_len": tokens / sequences,
        "rollout/perplexity": math.exp(totals["nll"] / tokens),
        "rollout/eos_frac": totals["ended"] / sequences,
        "rollout/logprob_err": logprob_error,
    }
    if "gold" in totals:
        metrics["objective/gold"] = totals["gold"] / sequences
    for key, value in totals.items():
        if key.startswith("part/"):
            metrics[f"objective/{key.removeprefix('part/')}"] = value / sequences
    return metrics, totals


# -----------------------------------------------------------------------------
# the update's plumbing


def concat_experience(parts: list[dict], pad_id: int) -> dict:
    """Experience dicts of different widths -> one: prompts left-padded (query with pad_id, query_mask with 0; position
    ids follow the attention mask, so more left padding changes nothing), responses right-padded with pad_id, every
    other (B, T) tensor right-padded with 0, (B,) tensors concatenated."""
    merged = {}
    for key in parts[0]:
        tensors = [part[key] for part in parts]
        if tensors[0].dim() == 1:
            merged[key] = torch.cat(tensors)
            continue
        width = max(tensor.size(1) for tensor in tensors)
        value = pad_id if key in ("query", "response") else 0
        padded = []
        for tensor in tensors:
            extra = width - tensor.size(1)
            left = extra if key in ("query", "query_mask") else 0
            padded.append(torch.nn.functional.pad(tensor, (left, extra - left), value=value))
        merged[key] = torch.cat(padded)
    return merged


def take_rows(batch: dict, index, width: Optional[int] = None) -> dict:
    """The rows `index` of every tensor of an experience dict; width: response-shaped tensors (B, T) trimmed to their
    first `width` columns (a micro-batch's longest response), the prompts kept whole."""
    taken = {}
    for key, value in batch.items():
        value = value[index]
        if width is not None and value.dim() == 2 and key not in ("query", "query_mask"):
            value = value[:, :width]
        taken[key] = value
    return taken


def micro_batch_widths(lengths: list[int], order: list[int], micro_batch_size: int) -> list[int]:
    """Each micro-batch's longest response over a shuffled rollout (lengths per row, read from the device once per
    update; order: the epoch's permutation as a list): the width its right padding is trimmed to."""
    return [
        max(lengths[row] for row in order[s : s + micro_batch_size]) for s in range(0, len(order), micro_batch_size)
    ]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def policy_logprobs(actor, batch: dict, temperature: float):
    """The training forward over one micro-batch: (logits (B, T, V), log-probs of the response tokens (B, T))."""
    logits, _ = response_forward(
        actor, batch["query"], batch["query_mask"], batch["response"], batch["mask"], temperature
    )
    return logits, logprobs_from_logits(logits, batch["response"])


def ptx_backward(actor, ptx_batch: tuple, ptx_coef: float, ptx_tokens, amp) -> dict:
    """InstructGPT's PPO-ptx: ptx_coef * the LM loss on one micro-batch of pre-training text (inputs, targets, mask),
    over the step's global ptx token count; never the syncing backward (the policy loss's comes after it)."""
    inputs, targets, target_mask = ptx_batch
    with parallel.grad_sync(actor, False), amp:
        logits, _ = actor(inputs)
        loss = lm_loss(logits, targets, target_mask, denom=ptx_tokens)
    (ptx_coef * loss * world_size()).backward()
    return {"ptx_loss": loss.detach()}


def add_all(sums: dict, values: dict) -> None:
    """sums[key] += value for every entry, starting from 0 (running sums that stay on the device: no host sync)."""
    for key, value in values.items():
        sums[key] = sums[key] + value if key in sums else value


def token_sum(mean: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A per-token mean times its token count, 0 for a micro-batch without tokens (whose mean is 0/0; no host sync)."""
    return torch.where(tokens > 0, mean * tokens, torch.zeros_like(mean))


def first_micro_batch(logprobs, old_logprobs, mask, sums: dict) -> dict:
    """The first micro-batch of the first update's diagnostics: ratio_err (max |ratio - 1| over mask), approx_kl and
    clipfrac (from the policy loss's sums), which must read 0, 0, 0 to float precision (the policy has not moved since
    it sampled)."""
    ratio_error = ((logprobs - old_logprobs).exp().sub(1).abs() * mask).max()
    tokens = sums["tokens"]
    return {
        "ratio_err": ratio_error.item(),
        "approx_kl": (sums["approx_kl"] / tokens).item(),
        "clipfrac": (sums["clipfrac"] / tokens).item(),
    }


# -----------------------------------------------------------------------------
# monitoring


@torch.no_grad()
def update_kl(actor, experience: dict, micro_batch_size: int, temperature: float, amp) -> float:
    """How far an update moved the policy: KL(pi_old || pi_new) on the rollout it was computed from, per response
    (the summed k3 of rollout.kl_estimate with the roles of old and new, an unbiased estimate on pi_old's own samples),
    the mean over every rank's responses, from one no-grad pass of the training forward after the update."""
    mask = experience["mask"]
    total = torch.zeros((), device=mask.device)
    for start in range(0, mask.size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        batch = {key: experience[key][rows] for key in ("query", "query_mask", "response", "mask", "logprobs")}
        with amp:
            _, logprobs = policy_logprobs(actor, batch, temperature)
        total += kl_estimate(batch["logprobs"], logprobs, batch["mask"], "k3").sum()
    sums = parallel.all_reduce_dict({"kl": total, "sequences": float(mask.size(0))}, mask.device)
    return sums["kl"] / sums["sequences"]


def perf_metrics(
    models: Models, experience: dict, epochs: int, times: tuple, peak: float, world_size: int, critic=None
):
    """perf/: one iteration's rollout and update seconds, tokens per second and MFU (iteration_flops against the
    peak of every rank); times: the iteration's start, the update's start and the end."""
    t_rollout, t_update, t_end = times
    sequence_len = experience["query"].size(1) + experience["mask"].size(1)
    sequences = experience["mask"].size(0) * world_size
    flops = iteration_flops(models, sequence_len, sequences, epochs, critic=critic)
    return {
        "perf/rollout_s": t_update - t_rollout,
        "perf/update_s": t_end - t_update,
        "perf/tokens_per_sec": sequences * sequence_len / (t_end - t_rollout),
        "perf/mfu": flops / (t_end - t_rollout) / (peak * world_size),
    }


def iteration_flops(models: Models, sequence_len: int, sequences: int, epochs: int, critic=None) -> float:
    """Training-equivalent FLOPs of one iteration for perf/mfu (flops_per_token counts a forward and a backward, a
    forward is a third of it): generation, policy and reference log-probs (three actor-sized forwards), each RM's
    score and the critic's values (a forward each), then `epochs` forward-backward passes of the actor and the critic
    over the rollout. sequence_len = prompt + response positions; sequences summed over ranks."""
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


def loop_state(prompt_stream: PromptStream, ptx_sampler: PtxSampler, guard, updates: int, episodes: int) -> dict:
    """The data_state both RL stages save: the prompt and ptx orders, the optimizer steps taken, the responses
    sampled and the steps skipped."""
    prompts, ptx = prompt_stream.order.state_dict(), ptx_sampler.order.state_dict()
    return dict(prompts=prompts, ptx=ptx, updates=updates, episodes=episodes, skipped=guard.skipped)


def resume_loop(run, hashes: dict, sampler, prompt_stream: PromptStream, ptx_sampler: PtxSampler, guard, args):
    """--resume of an RL stage: its checkpoint (checked against the inputs' hashes; the stage reads its own state
    from it), with the prompt and ptx orders and the skipped steps restored in place; returns the checkpoint and the
    step, optimizer steps and episodes to continue from."""
    ckpt = run.resume({key: (HASH_FLAGS[key], digest) for key, digest in hashes.items()}, sampler)
    data_state = ckpt["data_state"]
    prompt_stream.order = Order(**data_state["prompts"])
    ptx_sampler.order = Order(**data_state["ptx"])
    guard.skipped = data_state["skipped"]
    episodes = data_state.get("episodes", ckpt["step"] * args.rollout_batch_size)  # older checkpoints lack it
    return ckpt, ckpt["step"], data_state["updates"], episodes


def log_samples(logger: common.Logger, samples: list[dict], step: int) -> None:
    """The first samples as a TensorBoard text table and in samples.jsonl."""
    table = []
    for record in samples[:8]:
        line = f"{format_sample(record['prompt'], record['response'], record['ended'])} | score {record['score']:.2f}"
        if record["gold"] is not None:
            line += f" | gold {record['gold']:.2f}"
        table.append(line)
    logger.text("samples", "\n\n".join(table), step)
    logger.samples(step, samples[:16])
