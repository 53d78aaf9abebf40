"""Evaluate policies (and a reward model) on held-out prompts, measured against the built-in task's gold reward.

Policy mode: each --policy samples one response per held-out prompt and seed (seeds --seed ... --seed + --seeds - 1,
temperature 1 by default); we report the gold reward, the RM score, the KL to the reference, length, perplexity, EOS
and grammatical fractions, off_aspect (the share of responses praising an aspect the prompt did not name:
task.off_aspect_praise; gold scores it 0), distinct-2 and the gold-judged win rate against the reference, which
answers the same prompts with the same seeds. Every number comes with its standard error (`<metric>_se` in the JSON,
`mean ± se` in the table), clustered by prompt: the samples of one prompt (one per seed) count as one draw, so the
error covers the choice of prompts and the sampling noise together.
- means (gold, score, kl, response_len, eos_frac, valid_frac, off_aspect, win_rate_vs_ref): the cluster-robust
  standard error of a mean (`ratio_mean`); with --seeds 1 it is std(ddof=1)/sqrt(n), with N seeds the same over the
  per-prompt means.
- perplexity = exp(Σ nll / Σ tokens): the same formula for the ratio (linearisation), then the delta method,
  se(exp R) = exp(R)·se(R).
- distinct_2 (unique / all bigrams, not a mean of per-sample values): the delete-one-prompt jackknife, conservative in
  expectation (Efron-Stein).
- --best-of-n N1 N2 ...: per prompt, max(N) samples (seeds --seed, --seed + 1, ...); for each N the first N are reranked
  by --rm (a response without EOS scores --missing-eos-penalty) and the best one is scored like a policy sample (rows
  `<name>_bon<N>`). Its kl is the bound log N - (N-1)/N + the chosen sample's own KL to the reference (the chain rule;
  Beirami et al. 2024, https://arxiv.org/abs/2401.01879), marked `≤` in the table and `kl_bound: true` in the JSON.
- --env FILE.py:NAME --max-turns N: each prompt row is an episode against the environment NAME(row), the model's
  turns and the environment's observations in one sequence; the mean return, success (the info key `success`),
  turns, truncated_frac, tokens_per_turn and every info key (`episode/<key>`), with kl, response_len and perplexity
  over the model's tokens only, each clustered by prompt as above. --task guess (or a policy trained on it) plays the
  task's own environment with its turn sizes, and puts the optimum's values beside each policy (guess.optimum_columns).
- --pairs: accuracy, margin and the Bayes ceiling are weighted means over pairs, clustered by record (the pairs of a
  K-wise record share their responses).

python eval.py                                                          # SFT vs PPO, defaults of the earlier stages
python eval.py --policy out/sft/ckpt.pt out/ppo/ckpt.pt --names sft ppo --ref out/sft/ckpt.pt --rm out/rm/ckpt.pt \
    --json out/results.json --seeds 4
python eval.py --policy out/sft/ckpt.pt --names sft --best-of-n 1 4 16 64   # best-of-N from SFT, reranked by the RM
python eval.py --pairs                                                  # reward-model mode: accuracy, calibration
python eval.py --policy out/sft/ckpt.pt --names sft --prompts games.jsonl --env game.py:Guess --max-turns 6
"""

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Literal, Optional

import torch

import checkpoints
import cli
import common
import hf
import parallel
from common import UserError, format_sample, write_atomic, write_jsonl
from data import (
    builtin_files,
    builtin_task,
    drop_tied,
    encode_prefs,
    encode_prompts,
    prompt_ids,
    prompt_text,
    read_jsonl,
    responses_of,
)
from generate import run_episodes, sample
from model import (
    aggregate_rm_scores,
    calibration_error,
    left_pack,
    logprobs_from_logits,
    packed_response_logits,
    score_sequences,
)
from tokenizer import same_tokenizer


@dataclass
class Args:
    # --- what to evaluate
    policy: list[str] = field(default_factory=lambda: ["out/sft/ckpt.pt", "out/ppo/ckpt.pt"])
    """policies: checkpoints (.pt of any stage with an LM head) or pretrained models (hf:<name-or-path>, gpt2, ...)"""
    names: Optional[list[str]] = None
    """a name per policy for the table and JSON (None: each checkpoint's folder, out/ppo/ckpt.pt: ppo; a pretrained
    model's own name)"""
    ref: str = "out/sft/ckpt.pt"
    """reference policy for kl and win_rate_vs_ref (a checkpoint or a pretrained model, as --policy)"""
    rm: list[str] = field(default_factory=lambda: ["out/rm/ckpt.pt"])
    """reward models for `score`, best-of-N and --kl-optimal ("none": no RM): one, or the K members of an ensemble,
    their scores combined by --rm-agg"""
    rm_agg: Literal["mean", "min", "uwo"] = "mean"
    """how an ensemble's scores combine: mean, min (the worst case) or uwo = mean - --rm-uwo-coef x the members'
    variance (Coste et al. 2023); one RM is its own score under all three"""
    rm_uwo_coef: float = 1.0
    """--rm-agg uwo: the weight of the members' variance"""
    pairs: bool = False
    """reward-model mode: accuracy, margin, calibration and Bayes ceiling of --rm on held-out preference pairs"""
    pairs_data: Optional[str] = None
    """preference JSONL for --pairs (None: the built-in task's held-out pairs)"""
    prompts: Optional[str] = None
    """prompt JSONL ({"prompt": str or [messages]}) to sample on (None: the built-in task's held-out prompts; gold
    needs those)"""
    best_of_n: Optional[list[int]] = None
    """best-of-N sizes: per prompt max(N) samples, the first N reranked by --rm (or by --reward-fn without an RM), the
    best scored (rows <name>_bon<N>)"""
    write_best: Optional[str] = None
    """with one --best-of-n N: write each prompt's best of its N responses to this JSONL in the SFT layout
    {"prompt", "response"} (a response without EOS is left out), the data of a rejection-sampling warm-up
    (train_sft.py --init out/sft/ckpt.pt --data FILE); --prompts must be training prompts, never the held-out set"""
    pass_at: Optional[list[int]] = None
    """pass@k for each k on a verifiable task (--task arith, or --prompts with a --reward-fn that gives 1.0 to a right
    answer): --pass-samples responses per held-out problem, c of them right (gold 1), and the unbiased estimate
    1 - C(n-c, k)/C(n, k) (Chen et al. 2021, https://arxiv.org/abs/2107.03374) averaged over problems (keys pass@<k>
    and pass@<k>_se)"""
    pass_samples: int = 64
    """--pass-at: n, the responses sampled per problem (seeds --seed ...), at least the largest k"""
    kl_optimal: Optional[list[float]] = None
    """betas of the KL-regularised optimum pi* ∝ ref exp(r / beta), estimated from the --seeds samples per prompt of the
    first --policy (which must be --ref) by self-normalised importance weights, for r = the gold reward (built-in
    task; rows <name>_opt_gold_b<beta>) and r = --rm (rows <name>_opt_rm_b<beta>): what that reward signal can buy
    at each KL, before any RL (docs/design.md §5d)"""
    sample_cache: Optional[str] = None
    """--kl-optimal: keep the reference's samples in this file and reuse them while it matches (the same policy,
    prompts, seeds and sampling settings), with each RM's scores of them, so screening another reward model or
    ensemble scores only what is new"""
    reward_fn: Optional[str] = None
    """module:function or path/to/file.py:function, fn(prompt, response, ended) -> float (as train_ppo.py's): its mean
    over the samples is the reward_fn column, your own objective on held-out prompts"""
    env: Optional[str] = None
    """module:NAME or path/to/file.py:NAME: an environment NAME(row) built from each --prompts row, whose step(response,
    ended) -> (observation, reward, done[, info]) answers every model turn (docs/usage.md, How to extend): episodes
    instead of responses, reported as return, success, turns, truncated_frac and each info key (episode/<key>)"""
    max_turns: int = 1
    """--env: the model turns an episode may take"""
    missing_eos_penalty: Optional[float] = None
    """best-of-N and --kl-optimal: the RM score of a response without EOS (None: -1, as the RL stages score an RM's
    part: an RM reads its score at the EOS)"""
    # --- sampling
    num_samples: int = 512
    """prompts sampled (one response each per seed; the JSON's num_samples is this times --seeds)"""
    seeds: int = 1
    """samples per prompt, drawn with seeds --seed, --seed + 1, ... (the same for every policy and the reference)"""
    temperature: float = 1.0
    """sampling temperature, > 0 (kl and perplexity are measured at it)"""
    max_new_tokens: int = 64
    """longest response"""
    batch_size: int = 128
    """samples per generation batch (each holds every seed of its prompts: at least one prompt)"""
    micro_batch_size: int = 16
    """episodes per full forward (--env: the KL's log-probs): a batch's logits at once would be B x T x vocabulary
    floats"""
    seed: int = 1234
    """first sampling seed (the same for every policy)"""
    task: str = "reviews"
    """the built-in task whose held-out prompts and gold are used: reviews (task.py), arith (arith.py: gold is the
    verifier's accuracy, valid_frac the share of answers that parse), guess (guess.py: episodes against its own
    environment, beside the optimum's values) or rg:NAME (rg.py: gold is reasoning-gym's mean score, valid_frac the
    share of answers its extractor parses, pass@k counts scores of 1)"""
    task_config: Optional[str] = None
    """--task rg:NAME: the generator's configuration, a JSON object (None: the policy's checkpoint's, else
    reasoning-gym's defaults)"""
    task_seed: int = 1337
    """seed of the built-in task"""
    task_dir: str = "out/data"
    """where the built-in task is cached"""
    device: str = "auto"
    """auto | cpu | cuda"""
    dtype: str = "auto"
    """auto | float32 | bfloat16 (auto: bf16 on GPU, fp32 on CPU): under bf16 every model is stored in bf16 (all are
    frozen here; norms and biases in fp32) and runs under autocast"""
    compile: Literal["auto", "on", "off"] = "auto"
    """decode with static KV caches and the one-token step compiled (CUDA graphs on a GPU): auto = on CUDA only; the
    same tokens as the eager decode up to float rounding"""
    json: Optional[str] = None
    """write the numbers to this JSON file (merged into an existing one)"""
    show: int = 3
    """sample texts printed per policy"""


# -----------------------------------------------------------------------------
# statistics: a number and its standard error, as a {"value", "se"} dict, clustered by prompt (or by record);
# pass@k and the pair outcomes. Pure functions, imported by tests.


def ratio_mean(numerator: list, denominator: list, cluster: list) -> dict:
    """R = Σ numerator / Σ denominator and its cluster-robust standard error (linearisation), se² = C/(C-1) ·
    Σ_c (A_c - R·B_c)² / (Σ B)² over the C clusters' totals A_c, B_c. Returns {"value", "se"}: value None when
    Σ denominator is 0, se None under two clusters."""
    numerator_totals = Counter()
    denominator_totals = Counter()
    for top, bottom, key in zip(numerator, denominator, cluster):
        numerator_totals[key] += top
        denominator_totals[key] += bottom
    denominator_sum = sum(denominator_totals.values())
    if denominator_sum == 0:
        return {"value": None, "se": None}
    ratio = sum(numerator_totals.values()) / denominator_sum
    num_clusters = len(numerator_totals)
    if num_clusters < 2:
        return {"value": ratio, "se": None}
    residuals = [numerator_totals[key] - ratio * denominator_totals[key] for key in numerator_totals]
    variance = num_clusters / (num_clusters - 1) * sum(r * r for r in residuals) / denominator_sum**2
    return {"value": ratio, "se": math.sqrt(variance)}


def mean_se(values: list, cluster: list) -> dict:
    """The mean of per-sample values and its standard error, clustered (ratio_mean with denominator 1)."""
    return ratio_mean(values, [1] * len(values), cluster)


def perplexity_se(logprob_sums: list, lengths: list, cluster: list) -> dict:
    """exp(Σ nll / Σ tokens) over all responses; se by the delta method on the clustered ratio's se."""
    nll = ratio_mean([-x for x in logprob_sums], lengths, cluster)
    if nll["value"] is None:
        return nll
    perplexity = math.exp(nll["value"])
    return {"value": perplexity, "se": None if nll["se"] is None else perplexity * nll["se"]}


def distinct_n_se(responses: list, cluster: list, n: int = 2) -> dict:
    """Unique n-grams / all n-grams over all responses (token id lists; 0 when there are none) and its
    delete-one-cluster jackknife standard error: leaving cluster c out removes its n-grams from the total and, from
    the unique ones, those no other cluster has; se² = (C-1)/C · Σ_c (θ_-c - mean θ_-c)²."""
    grams_of = {}
    for response, key in zip(responses, cluster):
        grams_of.setdefault(key, []).extend(tuple(response[i : i + n]) for i in range(len(response) - n + 1))
    clusters_with = Counter(gram for grams in grams_of.values() for gram in set(grams))
    num_unique = len(clusters_with)
    num_grams = sum(len(grams) for grams in grams_of.values())
    value = num_unique / num_grams if num_grams else 0.0
    num_clusters = len(grams_of)
    if num_clusters < 2:
        return {"value": value, "se": None}
    leave_out = []
    for grams in grams_of.values():
        only_here = sum(1 for gram in set(grams) if clusters_with[gram] == 1)
        grams_left = num_grams - len(grams)
        leave_out.append((num_unique - only_here) / grams_left if grams_left else 0.0)
    leave_out_mean = sum(leave_out) / num_clusters
    variance = (num_clusters - 1) / num_clusters * sum((x - leave_out_mean) ** 2 for x in leave_out)
    return {"value": value, "se": math.sqrt(variance)}


def win_outcomes(gold: list, ref_gold: list) -> list:
    """Per sample: 1 if the policy's gold beats the reference's on the same prompt and seed, 0.5 on a tie, else 0."""
    return [1.0 if g > r else 0.5 if g == r else 0.0 for g, r in zip(gold, ref_gold)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with c right among n samples, 1 - C(n-c, k)/C(n, k) (Chen et al. 2021), as
    1 - prod_{i=n-c+1}^{n} (1 - k/i): no binomial coefficient overflows. Needs 1 <= k <= n and 0 <= c <= n."""
    # k > n has no k-subset to count: an error, not the 1.0 of the branch below
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@{k} of {c} right among {n} samples: needs 1 <= k <= n and 0 <= c <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pair_outcomes(gaps: list) -> list:
    """Per pair: 1 if the chosen response scores higher, 0.5 on a tie, else 0."""
    return [1.0 if gap > 0 else 0.5 if gap == 0 else 0.0 for gap in gaps]


def weighted_mean_se(values: list, weights: list, cluster: list) -> dict:
    """Σ w·x / Σ w with its standard error clustered by record (ratio_mean)."""
    return ratio_mean([w * x for w, x in zip(weights, values)], weights, cluster)


# -----------------------------------------------------------------------------
# sampling and the policy metrics


@torch.no_grad()
def sample_batch(model, tok, prompts: list, args: Args, device, generators: list, ref=None, rms=()) -> dict:
    """One response per prompt of one generation batch; per-sample lists (see sample_policy)."""
    query, query_mask = (t.to(device) for t in encode_prompts(tok, prompts))
    compiled = parallel.use_compile(args.compile, device)
    dtype = parallel.resolve_dtype(args.dtype, device)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with amp:
        samples = sample(
            model,
            tok,
            query,
            query_mask,
            args.max_new_tokens,
            args.temperature,
            generator=generators,
            compiled=compiled,
        )
    response, response_mask = samples.response, samples.mask
    lengths = response_mask.sum(1).long()
    kl = torch.zeros(len(prompts), device=device)
    if ref is not None and model is not ref:  # k1 summed over the sequence, at the sampling temperature
        # the reference reads the sampled tokens along the decode that drew them (the same batch, shared prefills and
        # steps): under bf16 the decode and a full forward differ by up to 0.3 a token on SmolLM2, and a policy read
        # along one path against a reference along the other had a KL to itself of 0.065 nats a response
        with amp:
            scored = sample(
                ref, tok, query, query_mask, response.size(1), args.temperature, forced=response, compiled=compiled
            )
        if not torch.equal(scored.mask, response_mask):
            raise UserError(f"--ref {args.ref}: its context ends before a response of the policy does")
        kl = ((samples.logprobs - scored.logprobs) * response_mask).sum(1)
    score = torch.full((len(prompts),), float("nan"), device=device)
    if rms:
        # each row's prompt and response packed: a row needs only its own to fit the context (as the RL rollout scores)
        ids, mask = left_pack(torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1))
        members = []
        for rm in rms:
            with amp:
                token_scores = rm(ids, mask, logits=False)[1]
            members.append(token_scores[:, -1].float())  # packed: every row's last token is its last column
        member_scores = torch.stack(members)  # (K, B)
        score = aggregate_rm_scores(member_scores, args.rm_agg, args.rm_uwo_coef)
    return {
        "prompt": [prompt_text(tok, prompt) for prompt in prompts],
        "response": samples.texts,
        "tokens": [response[row, : lengths[row]].tolist() for row in range(len(prompts))],
        "ended": samples.ended.tolist(),
        "logprob_sum": samples.logprobs.sum(1).tolist(),
        "n": lengths.tolist(),
        "kl": kl.tolist(),
        "score": score.tolist(),
    }


def forward_logprobs(
    model, ids: torch.Tensor, mask: torch.Tensor, response: torch.Tensor, response_mask: torch.Tensor, args: Args
) -> torch.Tensor:
    """(B, T) log-probs of the response tokens (B, T) at --temperature, from a full forward of each packed row (ids,
    mask (B, W): model.left_pack), --micro-batch-size rows a forward, each cut to its longest row."""
    logprobs = []
    for start in range(0, ids.size(0), args.micro_batch_size):
        rows = slice(start, start + args.micro_batch_size)
        width = int(mask[rows].sum(1).max())  # left-packed: the columns before it are padding in every row
        chunk_ids, chunk_mask = ids[rows, -width:], mask[rows, -width:]
        logits = packed_response_logits(model, chunk_ids, chunk_mask, response_mask[rows], args.temperature)
        logprobs.append(logprobs_from_logits(logits, response[rows]))
    return torch.cat(logprobs)


def over_seeds(items: list, args: Args, batch_fn) -> dict:
    """batch_fn(batch of items, generators) -> per-item lists, for every item and seed (--seed ... --seed + --seeds -
    1). Each (item, seed) row draws from a generator of its own, seeded by both: its sample depends on nothing else in
    its batch (not --batch-size, --seeds or --best-of-n; up to float rounding), and every policy meets the same draws.
    A batch of --batch-size rows holds every seed of its items, so a prompt's seeds share its prefill
    (generate.shared_prompts). The lists joined seed-major (every item under the first seed, then the next), with
    prompt_index (the cluster) and seed."""
    seeds = range(args.seed, args.seed + args.seeds)
    items_a_batch = max(1, args.batch_size // args.seeds)
    keys, joined = [], {}
    for start in range(0, len(items), items_a_batch):
        batch_keys = [(seed, index) for index in range(start, min(start + items_a_batch, len(items))) for seed in seeds]
        # a CPU generator keeps a seed's low 32 bits: distinct for 2**20 items and 4096 consecutive seeds
        generators = [torch.Generator().manual_seed((seed << 20) + index) for seed, index in batch_keys]
        batch = batch_fn([items[index] for _, index in batch_keys], generators)
        keys += batch_keys
        for key, values in batch.items():
            joined.setdefault(key, []).extend(values)
    order = sorted(range(len(keys)), key=keys.__getitem__)  # seed-major
    joined = {key: [values[row] for row in order] for key, values in joined.items()}
    joined["prompt_index"] = [keys[row][1] for row in order]
    joined["seed"] = [keys[row][0] for row in order]
    return joined


@torch.no_grad()
def sample_policy(model, tok, prompts: list, args: Args, device, ref=None, rms=()) -> dict:
    """One response per prompt and seed (over_seeds). Returns per-sample lists: prompt, response (text without EOS),
    tokens (with EOS), ended, logprob_sum, n, kl (to ref, 0 without), score (the RMs' aggregate, NaN without),
    prompt_index (the cluster), seed."""

    def batch_fn(batch_prompts: list, generators: list) -> dict:
        return sample_batch(model, tok, batch_prompts, args, device, generators, ref, rms)

    return over_seeds(prompts, args, batch_fn)


@torch.no_grad()
def episode_batch(model, tok, rows: list, make_env, args: Args, device, generators: list, ref) -> dict:
    """One generation batch of episodes, one a row; per-episode lists (see sample_episodes)."""
    query, query_mask = (t.to(device) for t in encode_prompts(tok, [row["prompt"] for row in rows]))
    compiled = parallel.use_compile(args.compile, device)
    dtype = parallel.resolve_dtype(args.dtype, device)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    envs = [make_env(row) for row in rows]
    with amp:
        episodes = run_episodes(
            model,
            tok,
            query,
            query_mask,
            envs,
            args.max_turns,
            args.max_new_tokens,
            temperature=args.temperature,
            generator=generators,
            compiled=compiled,
        )
    # the tokens after the prompt: the model's (mask) and the observations' (attention_mask)
    P = episodes.prompt_width
    response, attention, mask = episodes.sequences[:, P:], episodes.attention_mask[:, P:], episodes.mask[:, P:]
    sampler_logprobs = episodes.logprobs[:, P:]
    policy_logprobs = sampler_logprobs
    # k1 summed over the model's tokens, each read in the whole episode's context (observations included)
    ids, packed_mask = left_pack(episodes.sequences, episodes.attention_mask)
    with amp:
        ref_logprobs = forward_logprobs(ref, ids, packed_mask, response, attention, args)
        if not parallel.full_precision(dtype):  # bf16: both from a full forward (no single decode drew an episode)
            policy_logprobs = forward_logprobs(model, ids, packed_mask, response, attention, args)
    kl = ((policy_logprobs - ref_logprobs) * mask).sum(1)
    info = [
        {key: float(values[b]) for key, values in episodes.info.items() if not math.isnan(values[b])}
        for b in range(len(rows))
    ]
    return {
        "prompt": [prompt_text(tok, row["prompt"]) for row in rows],
        "turn_texts": episodes.turn_texts,
        "observations": episodes.observations,
        "return": episodes.returns.tolist(),
        "turns": episodes.turns.tolist(),
        "truncated": episodes.truncated.float().tolist(),
        "ended": episodes.last_turn_ended().tolist(),
        "n": mask.sum(1).tolist(),
        "observation_tokens": (attention - mask).sum(1).tolist(),
        "logprob_sum": (sampler_logprobs * mask).sum(1).tolist(),
        "kl": kl.tolist(),
        "info": info,
    }


@torch.no_grad()
def sample_episodes(model, tok, rows: list, make_env, args: Args, device, ref) -> dict:
    """One episode per prompt row and seed (over_seeds). Returns per-episode lists: prompt, turn_texts, observations,
    return, turns, truncated, ended (its last turn), n (model tokens), observation_tokens, logprob_sum, kl (to ref,
    over the model's tokens), info (the environment's last values), prompt_index (the cluster), seed."""

    def batch_fn(batch_rows: list, generators: list) -> dict:
        return episode_batch(model, tok, batch_rows, make_env, args, device, generators, ref)

    return over_seeds(rows, args, batch_fn)


def episode_metrics(episodes: dict) -> dict:
    """The episode table's numbers from sample_episodes' lists, each `<metric>` with its `<metric>_se` (clustered by
    prompt): return, success (the info key `success`, None without it), turns, truncated_frac, kl, response_len and
    perplexity over the model's tokens, tokens_per_turn (the model's tokens over its turns), eos_frac (the last turn
    ended), observation_tokens, every info key as
    episode/<key> (over the episodes that gave it); then num_samples and seeds."""
    cluster = episodes["prompt_index"]
    stats = {
        "return": mean_se(episodes["return"], cluster),
        "turns": mean_se(episodes["turns"], cluster),
        "truncated_frac": mean_se(episodes["truncated"], cluster),
        "kl": mean_se(episodes["kl"], cluster),
        "response_len": mean_se(episodes["n"], cluster),
        "tokens_per_turn": ratio_mean(episodes["n"], episodes["turns"], cluster),
        "perplexity": perplexity_se(episodes["logprob_sum"], episodes["n"], cluster),
        "eos_frac": mean_se([float(e) for e in episodes["ended"]], cluster),
        "observation_tokens": mean_se(episodes["observation_tokens"], cluster),
    }
    for key in sorted({key for info in episodes["info"] for key in info}):
        given = [(info[key], c) for info, c in zip(episodes["info"], cluster) if key in info]
        stats[f"episode/{key}"] = mean_se([value for value, _ in given], [c for _, c in given])
    stats["success"] = stats.get("episode/success")
    metrics = {}
    for name, stat in stats.items():
        metrics[name] = None if stat is None else stat["value"]
        metrics[f"{name}_se"] = None if stat is None else stat["se"]
    metrics["num_samples"] = len(cluster)
    metrics["seeds"] = sorted(set(episodes["seed"]))
    return metrics


def episode_results(args: Args, names: list, rows: list, ref, ref_tok, device) -> dict:
    """--env: each policy's episodes over the prompt rows, {name: episode_metrics + train seconds}; the first --show
    episodes printed turn by turn."""
    dtype = parallel.resolve_dtype(args.dtype, device)
    make_env = common.load_env(args.env, rows[0], args.max_turns)
    task_module = builtin_task(args)
    results = {}
    for name, path in zip(names, args.policy):
        model, tok, ckpt = load_model(path, "--policy", device, dtype=dtype)
        if tok.state() != ref_tok.state():
            raise UserError(f"--policy {path}: its tokenizer differs from the reference's ({args.ref})")
        episodes = sample_episodes(model, tok, rows, make_env, args, device, ref)
        results[name] = episode_metrics(episodes) | {"train_seconds": round((ckpt or {}).get("seconds", 0.0), 1)}
        if args.env == getattr(task_module, "ENV", None):  # the built-in game: the optimum's values beside
            results[name] |= task_module.optimum_columns(results[name]["kl"])
        for index in range(min(args.show, len(episodes["prompt"]))):
            turns = zip(episodes["turn_texts"][index], episodes["observations"][index] + [None])
            shown = " ".join(f"[turn] {text!r}" + (f" [env] {obs!r}" if obs is not None else "") for text, obs in turns)
            print(f"[{name}] {episodes['prompt'][index]!r} {shown} return {episodes['return'][index]:.3f}")
    return results


def print_episode_table(results: dict) -> None:
    """--env: the policies' episode metrics as a markdown table, every metric as mean ± standard error."""
    cols = ["return", "success", "turns", "truncated_frac", "kl", "response_len", "tokens_per_turn", "perplexity"]
    cols += ["eos_frac"]
    keys = {key for entry in results.values() for key in entry if key.startswith("episode/") and key[-3:] != "_se"}
    cols += ["observation_tokens", *sorted(keys - {"episode/success"}), "num_samples", "train_seconds"]
    print("| policy | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, entry in results.items():
        print(f"| {name} | " + " | ".join(format_value(entry, c) for c in cols) + " |")
    optimum = next(iter(results.values()))
    if "success_optimum" in optimum:  # the built-in game (guess.optimum_columns)
        print(
            f"the optimum (binary search): success {optimum['success_optimum']:.3f} | turns "
            f"{optimum['turns_optimum']:.3f} | episode/invalid 0 | tokens_per_turn "
            f"{optimum['tokens_per_turn_optimum']:.3f}; the weak player: success {optimum['success_weak']:.3f} | "
            f"turns {optimum['turns_weak']:.3f}"
        )
        tilted = [
            f"{name} {entry['success_tilted']:.3f} (beta {entry['beta_tilted']:.3g})" for name, entry in results.items()
        ]
        print("the tilted optimum's success at each policy's kl: " + ", ".join(tilted))


def with_task_env(args: Args) -> Args:
    """args with the built-in task's environment (a module attribute ENV: guess's guess:Game) where neither --env nor
    --prompts is given, and its --max-turns and --max-new-tokens (TURNS, MAX_NEW_TOKENS) where not given."""
    task_module = builtin_task(args)
    if args.env is not None or args.prompts is not None or not hasattr(task_module, "ENV"):
        return args
    given = getattr(args, "given", None)
    defaults = Args()
    sizes = {"max_turns": task_module.TURNS, "max_new_tokens": task_module.MAX_NEW_TOKENS}
    # from Python (no args.given): a flag at its default counts as not given
    taken = {
        flag: size
        for flag, size in sizes.items()
        if (flag not in given if given is not None else getattr(args, flag) == getattr(defaults, flag))
    }
    print(
        f"eval: --task {args.task}: --env {task_module.ENV} "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items())
    )
    resolved = replace(args, env=task_module.ENV, **taken)
    if given is not None:
        resolved.given = given
    return resolved


def pick_samples(samples: dict, indices: list) -> dict:
    """sample_policy's lists at the given sample indices."""
    return {key: [values[index] for index in indices] for key, values in samples.items()}


def policy_metrics(samples: dict, task: Optional[ModuleType], ref_gold: Optional[list]) -> tuple[dict, Optional[list]]:
    """(metrics, gold): the table's numbers from sample_policy's lists, each `<metric>` with its `<metric>_se`, then
    num_samples and seeds; gold (per sample) and the gold-based metrics are None off the built-in task (task: its
    module, data.TASKS; off_aspect the reviews task's only). ref_gold is the reference's per-sample gold on the
    same prompts and seeds, in the same order."""
    cluster = samples["prompt_index"]
    responses = samples["response"]
    ended = samples["ended"]
    builtin = task is not None
    gold = [task.gold_reward(p, r, e) for p, r, e in zip(samples["prompt"], responses, ended)] if builtin else None
    valid = [float(task.is_valid(r, e)) for r, e in zip(responses, ended)] if builtin else None
    off_aspect_praise = getattr(task, "off_aspect_praise", None)
    off_aspect = (
        [float(off_aspect_praise(p, r)) for p, r in zip(samples["prompt"], responses)] if off_aspect_praise else None
    )
    scored = [(x, c) for x, c in zip(samples["score"], cluster) if not math.isnan(x)]
    stats = {
        "gold": mean_se(gold, cluster) if builtin else None,
        "score": mean_se([x for x, _ in scored], [c for _, c in scored]) if scored else None,
        "kl": mean_se(samples["kl"], cluster),
        "response_len": mean_se(samples["n"], cluster),
        "perplexity": perplexity_se(samples["logprob_sum"], samples["n"], cluster),
        "eos_frac": mean_se([float(e) for e in ended], cluster),
        "valid_frac": mean_se(valid, cluster) if builtin else None,
        "off_aspect": mean_se(off_aspect, cluster) if off_aspect else None,
        "distinct_2": distinct_n_se(samples["tokens"], cluster, 2),
        "win_rate_vs_ref": mean_se(win_outcomes(gold, ref_gold), cluster) if builtin and ref_gold else None,
        "reward_fn": mean_se(samples["reward_fn"], cluster) if "reward_fn" in samples else None,
    }
    metrics = {}
    for name, stat in stats.items():
        metrics[name] = None if stat is None else stat["value"]
        metrics[f"{name}_se"] = None if stat is None else stat["se"]
    metrics["num_samples"] = len(cluster)
    metrics["seeds"] = sorted(set(samples["seed"]))
    return metrics, gold


def pass_at_metrics(samples: dict, task: ModuleType | None, ks: list, n: int, first_seed: int) -> dict:
    """pass@k for each k from sample_policy's lists: per problem the samples of seeds first_seed .. first_seed + n - 1,
    right where the task's gold is 1 (arith: the verifier says yes and the answer ends), or with no task where
    samples["reward_fn"] is 1; the mean over problems with its standard error (one value per problem)."""
    drawn, right = Counter(), Counter()
    for index, (prompt_index, seed) in enumerate(zip(samples["prompt_index"], samples["seed"])):
        if first_seed <= seed < first_seed + n:
            drawn[prompt_index] += 1
            if task is None:
                gold = samples["reward_fn"][index]
            else:
                gold = task.gold_reward(samples["prompt"][index], samples["response"][index], samples["ended"][index])
            right[prompt_index] += gold == 1.0
    problems = sorted(drawn)
    metrics = {}
    for k in ks:
        stat = mean_se([pass_at_k(drawn[i], right[i], k) for i in problems], problems)
        metrics[f"pass@{k}"] = stat["value"]
        metrics[f"pass@{k}_se"] = stat["se"]
    return metrics


def best_of_n_kl_bound(n: int) -> float:
    """log N - (N-1)/N: best-of-N sampling's KL to the policy it draws from is at most this (Beirami et al. 2024)."""
    return math.log(n) - (n - 1) / n


def best_of_n(samples: dict, n: int, first_seed: int, missing_eos_penalty: float, by: str = "score") -> dict:
    """sample_policy's lists -> one sample per prompt, in prompt order: the best of seeds first_seed .. first_seed +
    n - 1 by "score" (no EOS: missing_eos_penalty) or "reward_fn", a tie the earlier seed; its kl is
    best_of_n_kl_bound(n) + its own."""
    best = {}  # prompt_index -> (effective score, sample index)
    for index, (prompt_index, seed) in enumerate(zip(samples["prompt_index"], samples["seed"])):
        if not first_seed <= seed < first_seed + n:
            continue
        score = samples[by][index]
        if by == "score" and not samples["ended"][index]:
            score = missing_eos_penalty
        if prompt_index not in best or score > best[prompt_index][0]:
            best[prompt_index] = (score, index)
    picked = pick_samples(samples, [best[prompt_index][1] for prompt_index in sorted(best)])
    picked["kl"] = [best_of_n_kl_bound(n) + kl for kl in picked["kl"]]
    return picked


def first_rows(path: str, num_samples: int) -> list:
    """The first --num-samples rows of a prompts file, saying so when the file holds more."""
    rows = read_jsonl(path, "prompts", "--prompts")
    if len(rows) > num_samples:
        print(f"eval: the first {num_samples} of the {len(rows)} prompts in {path} (--num-samples counts prompts)")
    return rows[:num_samples]


def write_best(path: str, picked: dict, prompts: list, n: int, rank_by: str) -> None:
    """best_of_n's picks as SFT records in prompt order: {"prompt", "response"} for a text prompt, {"messages": the
    prompt's and the reply as an assistant turn} for a conversation; the ones without EOS are left out (SFT would
    teach them an EOS they never had). Says how many of each."""
    rows = []
    for prompt_index, response, ended in zip(picked["prompt_index"], picked["response"], picked["ended"]):
        prompt = prompts[prompt_index]
        if not ended:
            continue
        if isinstance(prompt, str):
            rows.append({"prompt": prompt, "response": response})
        else:
            rows.append({"messages": prompt + [{"role": "assistant", "content": response}]})
    write_jsonl(path, rows)
    left_out = len(picked["response"]) - len(rows)
    print(
        f"eval: wrote {path}: the best of {n} by {rank_by} for {len(rows)} prompts ({left_out} without EOS, left out)"
    )


def tilted_estimates(rewards: torch.Tensor, values: dict, beta: float) -> dict:
    """The KL-regularised optimum pi* ∝ ref exp(r / beta) per prompt from M reference samples: rewards (P, M),
    values {name: (P, M)} -> {name: (P,)} the means under w = softmax(r / beta), plus kl = sum_i w_i log(M w_i)
    (KL(pi* || ref), at most log M) and ess = 1 / sum_i w_i^2."""
    num_samples = rewards.size(1)
    log_weights = torch.log_softmax(rewards.double() / beta, dim=1)
    weights = log_weights.exp()
    estimates = {name: (weights * value.double()).sum(1) for name, value in values.items()}
    estimates["kl"] = (weights * (log_weights + math.log(num_samples))).sum(1)
    estimates["ess"] = 1.0 / (weights**2).sum(1)
    return estimates


def kl_optimal_rows(
    name: str, samples: dict, betas: list, task: Optional[ModuleType], missing_eos_penalty: float
) -> dict:
    """Rows <name>_opt_gold_b<beta> (tilted by gold) and <name>_opt_rm_b<beta> (by the RMs' score, no EOS scoring
    missing_eos_penalty) from sample_policy's lists of the reference, M samples a prompt. Each row: gold, score, kl,
    valid_frac with their se, ess, ess_p10, samples (M) and a warning when the estimate is not to be trusted."""
    order = sorted(range(len(samples["prompt"])), key=lambda i: (samples["prompt_index"][i], samples["seed"][i]))
    num_prompts = len(set(samples["prompt_index"]))

    def grid(values) -> torch.Tensor:  # (P, M), prompt-major
        return torch.tensor([float(values[i]) for i in order], dtype=torch.float64).view(num_prompts, -1)

    ended = [bool(e) for e in samples["ended"]]
    num_samples = len(order) // num_prompts
    values, signals = {}, {}
    if task is not None:
        gold = [task.gold_reward(p, r, e) for p, r, e in zip(samples["prompt"], samples["response"], ended)]
        values["gold"] = grid(gold)
        values["valid_frac"] = grid([task.is_valid(r, e) for r, e in zip(samples["response"], ended)])
        if hasattr(task, "off_aspect_praise"):
            responses = zip(samples["prompt"], samples["response"])
            values["off_aspect"] = grid([task.off_aspect_praise(p, r) for p, r in responses])
        signals["gold"] = values["gold"]
    if not math.isnan(samples["score"][0]):  # NaN: no RM (--rm none), no score to tilt by or report
        values["score"] = grid([s if e else missing_eos_penalty for s, e in zip(samples["score"], ended)])
        signals["rm"] = values["score"]
    rows = {}
    for signal, rewards in signals.items():
        for beta in betas:
            estimates = tilted_estimates(rewards, values, beta)
            row = {}
            for key in ("gold", "score", "kl", "valid_frac", "off_aspect"):
                stat = mean_se(estimates[key].tolist(), list(range(num_prompts))) if key in estimates else None
                row[key] = None if stat is None else stat["value"]
                row[f"{key}_se"] = None if stat is None else stat["se"]
            ess = estimates["ess"]
            row |= {"ess": ess.mean().item(), "ess_p10": ess.quantile(0.1).item(), "samples": num_samples}
            ceiling = math.log(num_samples)
            problems = []
            if row["kl"] > ceiling - 1:
                problems.append(f"kl {row['kl']:.2f} within 1 nat of its ceiling log M {ceiling:.2f}")
            if row["ess"] < 4:
                problems.append(f"ess {row['ess']:.1f} under 4")
            if row["ess_p10"] < 2:
                problems.append(f"a tenth of the prompts at ess under 2 ({row['ess_p10']:.2f})")
            row |= {"beta": beta, "warning": "; ".join(problems) + ": more --seeds" if problems else None}
            rows[f"{name}_opt_{signal}_b{beta:g}"] = row
    return rows


def load_model(path: str, flag: str, device, want: str = "lm", dtype: torch.dtype = torch.float32):
    """A model from one of our checkpoints (its LM or its scalar head) or, for its LM, a pretrained one (hf:<path>,
    gpt2, ...), eval mode, stored in dtype under bf16 (parallel.store_low_precision; a LoRA checkpoint's adapters
    unmerged, as its run's forward had them: hf.model_from_checkpoint), and the checkpoint (None)."""
    if not path.endswith(".pt") and (want != "lm" or path == "scratch"):
        raise UserError(f"{flag} {path}: expected a .pt checkpoint of this repo")
    kinds = checkpoints.POLICY_KINDS if want == "lm" else "rm"  # every policy kind has an LM head
    heads = dict(lm_head=want == "lm", score_head=want == "score")
    model, tok, ckpt = hf.load_init(path, **heads, flag=flag, kind=kinds, merge=dtype == torch.float32)
    if dtype != torch.float32:
        parallel.store_low_precision(model, dtype)
    return model.to(device).eval(), tok, ckpt


def context_size(path: str) -> int:
    """The context (block_size) of one of our checkpoints or a pretrained model, read without loading its weights."""
    if not path.endswith(".pt"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path.removeprefix("hf:"))
        return getattr(config, "max_position_embeddings", None) or config.n_positions
    return checkpoints.load_checkpoint(path, flag="--policy", mmap=True)["model_config"]["block_size"]


def format_value(entry: dict, key: str) -> str:
    """One cell: `mean ± se` where entry has `<key>_se`, `-` for None, 3 decimals for floats."""
    value = entry.get(key)
    se = entry.get(f"{key}_se")
    if value is None:
        return "-"
    if not isinstance(value, float):
        return str(value)
    bound = "≤ " if key == "kl" and entry.get("kl_bound") else ""  # best-of-N: an upper bound
    # + 0.0 turns the -0.0 of a tiny negative (the sft's kl to itself) into 0.0
    shown = f"{round(value, 3) + 0.0:.3f}"
    return f"{bound}{shown}" if se is None else f"{bound}{shown} ± {se:.3f}"


def print_table(results: dict) -> None:
    """The policies as a markdown table, every metric as mean ± standard error."""
    cols = [
        "gold",
        "score",
        "kl",
        "response_len",
        "perplexity",
        "eos_frac",
        "valid_frac",
        "off_aspect",
        "distinct_2",
        "win_rate_vs_ref",
        "num_samples",
        "train_seconds",
    ]
    if any(entry.get("reward_fn") is not None for entry in results.values()):
        cols.insert(cols.index("score") + 1, "reward_fn")
    pass_cols = {key for entry in results.values() for key in entry if key.startswith("pass@")}
    cols[1:1] = sorted((key for key in pass_cols if not key.endswith("_se")), key=lambda key: int(key[5:]))
    print("| policy | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, entry in results.items():
        print(f"| {name} | " + " | ".join(format_value(entry, c) for c in cols) + " |")
    reasons = (  # why a column is empty for every policy
        (
            "gold",
            "gold, valid_frac, off_aspect, win_rate_vs_ref",
            "the built-in task's gold reward scores its own prompts only",
        ),
        ("score", "score", "no reward model: --rm none"),
    )
    for key, columns, why in reasons:
        if results and all(entry.get(key) is None for entry in results.values()):
            print(f"{columns}: - ({why})")


# -----------------------------------------------------------------------------
# main


def check_args(args: Args) -> None:
    """Settings no run can measure: one line each."""
    if not args.temperature > 0:
        raise UserError(
            f"--temperature {args.temperature:g}: kl and perplexity are measured at the sampling temperature; "
            "use > 0 (e.g. 1.0)"
        )
    if args.seeds < 1:
        raise UserError(f"--seeds {args.seeds}: samples per prompt, use >= 1")
    for flag, value in (("--batch-size", args.batch_size), ("--micro-batch-size", args.micro_batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value}: samples at a time, use >= 1")
    if args.best_of_n and min(args.best_of_n) < 1:
        raise UserError(f"--best-of-n {min(args.best_of_n)}: N counts samples per prompt, use >= 1")
    if args.best_of_n and not rm_paths(args) and not args.reward_fn:
        raise UserError("--best-of-n reranks by a reward model or a reward function: pass --rm or --reward-fn")
    if args.pass_at and min(args.pass_at) < 1:
        raise UserError(f"--pass-at {min(args.pass_at)}: k counts attempts per problem, use >= 1")
    if args.pass_at and args.pass_samples < max(args.pass_at):
        raise UserError(
            f"--pass-samples {args.pass_samples}: pass@{max(args.pass_at)} needs at least that many samples"
        )
    if args.pass_at and not hasattr(builtin_task(args), "verify") and args.reward_fn is None:
        raise UserError(f"--pass-at counts right answers: the {args.task} task has no verifier (--task arith has one)")
    if args.write_best and (not args.best_of_n or len(args.best_of_n) != 1 or len(args.policy) != 1):
        raise UserError("--write-best writes one policy's best of N: pass one --policy and one --best-of-n N")
    if args.write_best and args.prompts is None:
        raise UserError(
            "--write-best writes training data: pass --prompts with training prompts (the default is the held-out set)"
        )
    if args.kl_optimal and args.policy[0] != args.ref:
        raise UserError(
            f"--kl-optimal tilts the reference's own samples: the first --policy ({args.policy[0]}) must be --ref "
            f"({args.ref})"
        )
    if args.kl_optimal and len(args.policy) > 1:
        raise UserError(
            f"--kl-optimal tilts the reference alone: pass one --policy (the --ref), not {len(args.policy)}; evaluate "
            "the others in a run of their own"
        )
    if args.env and args.reward_fn:
        raise UserError("--env and --reward-fn: an environment's step gives the rewards, pass one of them")
    env_modes = {"--pairs": args.pairs, "--best-of-n": args.best_of_n, "--pass-at": args.pass_at}
    env_modes |= {"--kl-optimal": args.kl_optimal, "--write-best": args.write_best}
    refused = [flag for flag, given in env_modes.items() if given]
    if args.env and refused:
        raise UserError(f"--env evaluates episodes, not responses: {refused[0]} does not apply to them")
    if args.kl_optimal and min(args.kl_optimal) <= 0:
        raise UserError(f"--kl-optimal {min(args.kl_optimal):g}: beta is the strength of the KL term, use > 0")


def rm_paths(args: Args) -> list[str]:
    """--rm as a list of checkpoints ("none": no RM; a single string from code, as older callers pass it)."""
    paths = [args.rm] if isinstance(args.rm, str) else list(args.rm or [])
    return [path for path in paths if path and path != "none"]


def load_rms(paths: list[str], device, tok, dtype: torch.dtype, prompts: list) -> list:
    """The reward models (scalar heads), in eval mode on device, each refused unless its tokenizer is the given one
    (tokenizer.same_tokenizer on the prompts)."""
    rms = []
    for path in paths:
        rm, rm_tok, _ = load_model(path, "--rm", device, want="score", dtype=dtype)
        difference = same_tokenizer(rm_tok, tok, prompts)
        if difference:
            raise UserError(f"--rm {path}: its tokenizer differs from --ref's: {difference}")
        rms.append(rm)
    return rms


@torch.no_grad()
def reference_samples(model, tok, prompts: list, args: Args, device, rms: list) -> dict:
    """--kl-optimal: --seeds samples per prompt of the reference (from --sample-cache when it matches), scored by
    every RM and their aggregate (score), a response's score read at its last token. The cache also
    keeps each RM's scores by its file's hash, so screening an ensemble scores only the members new to it."""
    key = dict(
        ref=checkpoints.init_fingerprint(args.ref),
        prompts=prompts,
        seed=args.seed,
        seeds=args.seeds,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        draws="a generator per prompt and seed",  # a cache of the earlier seed-major draws is not these samples
    )
    cached = (
        torch.load(args.sample_cache, weights_only=False)
        if args.sample_cache and os.path.exists(args.sample_cache)
        else None
    )
    fresh = cached is None or cached["key"] != key
    if fresh:
        samples = sample_policy(model, tok, prompts, args, device)
        cached = {"key": key, "samples": samples}
    else:
        samples = cached["samples"]
        print(f"eval: {len(samples['prompt'])} reference samples from {args.sample_cache}")
    scored = cached.setdefault("rm_scores", {})  # RM file hash -> its score of every sample
    known = len(scored)
    samples["score"] = [float("nan")] * len(samples["prompt"])  # without an RM (a cached set keeps no scores)
    if rms:
        heads = {prompt_text(tok, prompt): prompt_ids(tok, prompt) for prompt in prompts}  # text -> its ids
        sequences = [heads[p] + ids for p, ids in zip(samples["prompt"], samples["tokens"])]
        members = []
        for path, rm in zip(rm_paths(args), rms):
            sha = checkpoints.file_sha256(path)
            if sha not in scored:
                dtype = parallel.resolve_dtype(args.dtype, device)
                scored[sha] = score_sequences(rm, sequences, tok.pad_id, args.batch_size, device, dtype).tolist()
            members.append(torch.tensor(scored[sha]))
        samples["score"] = aggregate_rm_scores(torch.stack(members), args.rm_agg, args.rm_uwo_coef).tolist()
    if args.sample_cache and (fresh or len(scored) > known):
        samples_only = {k: v for k, v in samples.items() if k != "score"}
        partial = f"{args.sample_cache}.tmp.{os.getpid()}"  # a killed run leaves the old cache whole
        torch.save({"key": key, "samples": samples_only, "rm_scores": scored}, partial)
        os.replace(partial, args.sample_cache)
    return samples


def print_limit_table(rows: dict) -> None:
    """The --kl-optimal rows as a markdown table."""
    cols = ["beta", "gold", "score", "kl", "valid_frac", "off_aspect", "ess", "ess_p10", "samples"]
    print("| tilted | " + " | ".join(cols) + " | warning |\n|---|" + "---|" * (len(cols) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(format_value(row, c) for c in cols) + f" | {row['warning'] or ''} |")


def write_json(path: Optional[str], results: dict) -> dict:
    """Merge results into the JSON file at path (atomically); returns results."""
    if path:
        merged = {}
        if os.path.exists(path):
            with open(path) as f:
                merged = json.load(f)
        write_atomic(path, json.dumps({**merged, **results}, indent=2))
    return results


@torch.no_grad()
def rm_metrics(args: Args, task_files: Optional[dict], device) -> dict:
    """Reward-model mode: {"rm": metrics} of the --rm aggregate and, for an ensemble, {"rm_member<k>": ...} of each
    member (pair_metrics). Each member reads the pairs through its own tokenizer and context; the records every
    member could encode are the ones scored (the others, too long for some context, are counted)."""
    paths = rm_paths(args)
    if not paths:
        raise UserError("--pairs needs --rm")
    rows, tied = drop_tied(read_jsonl(args.pairs_data or task_files["pairs_eval"], "pairs", "--pairs-data"))
    if tied:
        print(f"eval: {tied} records with chosen equal to rejected, skipped")
    dtype = parallel.resolve_dtype(args.dtype, device)
    members, encoded = [], []
    for path in paths:
        rm, tok, ckpt = load_model(path, "--rm", device, want="score", dtype=dtype)
        examples, _ = encode_prefs(tok, rows, rm.config.block_size)
        members.append((rm, tok, ckpt))
        encoded.append({id(example[-1]): example for example in examples})  # by the record each came from
    kept = [row for row in rows if all(id(row) in by_record for by_record in encoded)]
    if len(kept) < len(rows):
        print(f"eval: {len(rows) - len(kept)} of {len(rows)} records too long for some reward model's context")
    scores = []
    for (rm, tok, _), by_record in zip(members, encoded):
        sequences = [seq for row in kept for seq in by_record[id(row)][0]]
        scores.append(score_sequences(rm, sequences, tok.pad_id, args.batch_size, device, dtype))
    scores = torch.stack(scores)
    examples = [encoded[0][id(row)] for row in kept]
    aggregate = aggregate_rm_scores(scores, args.rm_agg, args.rm_uwo_coef)
    train_seconds = round(sum(ckpt.get("seconds", 0.0) for _, _, ckpt in members), 1)
    task = builtin_task(args) if args.pairs_data is None else None
    results = {"rm": pair_metrics(aggregate.tolist(), examples, task) | {"train_seconds": train_seconds}}
    if len(members) > 1:
        for k, (member_scores, (_, _, ckpt)) in enumerate(zip(scores, members), start=1):
            metrics = pair_metrics(member_scores.tolist(), examples, task)
            results[f"rm_member{k}"] = metrics | {"train_seconds": round(ckpt.get("seconds", 0.0), 1)}
    return results


def pair_metrics(scores: list, examples: list, task: Optional[ModuleType]) -> dict:
    """Accuracy (pair weights of K-wise records, ties 1/2), mean margin, ECE and, on the built-in task, the empirical
    Bayes ceiling (the gold reward's own accuracy on the drawn labels) on the same pairs, from the scores of every
    encoded record's sequences in order; the means with their standard errors clustered by record."""
    gaps, gold_gaps, weights, record = [], [], [], []
    start = 0
    for record_index, (seqs, _, pairs, _, row) in enumerate(examples):
        gold = [task.gold_reward(row["prompt"], r, True) for r in responses_of(row)] if task else None
        for chosen, rejected, weight in pairs:
            gaps.append(scores[start + chosen] - scores[start + rejected])
            gold_gaps.append(gold[chosen] - gold[rejected] if gold else 0.0)
            weights.append(weight)
            record.append(record_index)
        start += len(seqs)
    accuracy = weighted_mean_se(pair_outcomes(gaps), weights, record)
    margin = weighted_mean_se(gaps, weights, record)
    ceiling = weighted_mean_se(pair_outcomes(gold_gaps), weights, record) if task else None
    return {
        "accuracy": accuracy["value"],
        "accuracy_se": accuracy["se"],
        "margin": margin["value"],
        "margin_se": margin["se"],
        "ece": calibration_error(torch.tensor(gaps)),
        "bayes_ceiling": None if ceiling is None else ceiling["value"],
        "bayes_ceiling_se": None if ceiling is None else ceiling["se"],
        "pairs": len(gaps),
    }


def main(args: Args) -> dict:
    t0 = time.time()
    flag = "--rm" if args.pairs else "--policy"
    args = checkpoints.task_from_checkpoint(args, (args.rm if args.pairs else args.policy)[0], flag)  # unless given
    args = with_task_env(args) if not args.pairs else args
    check_args(args)
    common.seed_everything(args.seed)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    needs_task = args.pairs_data is None if args.pairs else args.prompts is None  # the built-in task's, on demand
    missing_eos_score = -1.0 if args.missing_eos_penalty is None else args.missing_eos_penalty
    needed = "pairs_eval" if args.pairs else "eval_prompts"
    task_files = builtin_files(args, needed, "--pairs-data") if needs_task else None
    results = {}
    if args.pairs:
        results = rm_metrics(args, task_files, device)
        for name, entry in results.items():
            cells = [f"{key} {format_value(entry, key)}" for key in ("accuracy", "margin", "bayes_ceiling")]
            cells += [f"ece {entry['ece']:.3f}", f"pairs {entry['pairs']}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
        return write_json(args.json, results)
    # 1. prompts, reference and reward models
    rows = first_rows(args.prompts or task_files["eval_prompts"], args.num_samples)
    # a checkpoint is named by its folder (out/ppo/ckpt.pt: ppo), a pretrained model by itself (hf:out/smollm2)
    folders = [os.path.dirname(p) if p.endswith(".pt") else p.removeprefix("hf:").rstrip("/") for p in args.policy]
    names = args.names or [os.path.basename(folder) or f"policy{i}" for i, folder in enumerate(folders)]
    if len(names) != len(args.policy):
        raise UserError(f"--names: {len(names)} names for {len(args.policy)} policies")
    dtype = parallel.resolve_dtype(args.dtype, device)
    ref, ref_tok, ref_ckpt = load_model(args.ref, "--ref", device, dtype=dtype)
    # every policy and the reference answer the same prompts (KL and win rate stay paired): those with room for a
    # response in the smallest context among them
    context = min(context_size(path) for path in [args.ref, *args.policy])
    fitting = [row for row in rows if len(prompt_ids(ref_tok, row["prompt"])) < context]
    if len(fitting) < len(rows):
        print(
            f"eval: {len(rows) - len(fitting)} of {len(rows)} prompts leave no room for a response in the "
            f"context of {context}: skipped"
        )
    if not fitting:
        raise UserError(f"--prompts: no prompt leaves room for a response in the context of {context}")
    rows = fitting
    prompts = [row["prompt"] for row in rows]
    if args.env:  # multi-turn: each policy's episodes against the environment
        results = episode_results(args, names, rows, ref, ref_tok, device)
        print_episode_table(results)
        print(
            f"eval: {len(rows)} episodes x {args.seeds} seeds x {len(args.policy)} policies in "
            f"{time.time() - t0:.0f}s; ± is one standard error over prompts"
        )
        return write_json(args.json, results)
    reward_fn = None
    if args.reward_fn:  # called once at start-up, on the first prompt as the function will see it
        reward_fn = common.load_reward_fn(args.reward_fn, prompt_text(ref_tok, prompts[0]))
    rms = load_rms(rm_paths(args), device, ref_tok, dtype, prompts)
    # the gold reward knows the built-in task's prompts: task is its module when every prompt is one
    task_module = builtin_task(args)
    task = task_module if all(task_module.is_task_prompt(prompt) for prompt in prompts) else None
    if args.pass_at and task is None and reward_fn is None:
        raise UserError(
            f"--pass-at needs a verifier: the built-in task's (--task arith), or a --reward-fn giving 1.0 to a right "
            f"answer of --prompts {args.prompts}"
        )
    if args.write_best:  # training data: never from the held-out prompts
        held_out = [p for p in prompts if task_module.is_task_prompt(p) and task_module.is_held_out(p, args.task_seed)]
        if held_out:
            raise UserError(
                f"--write-best: --prompts {args.prompts} holds {len(held_out)} held-out prompts of the built-in task "
                f"(e.g. {held_out[0]!r}): write the best of N on training prompts"
            )
    if args.kl_optimal:  # the limit: the reference's samples, tilted by each reward signal
        samples = reference_samples(ref, ref_tok, prompts, args, device, rms)
        results = kl_optimal_rows(names[0], samples, args.kl_optimal, task, missing_eos_score)
        print_limit_table(results)
        return write_json(args.json, results)
    # 2. the reference answers the same prompts with the same seeds (win rate), then each policy
    ref_samples = sample_policy(ref, ref_tok, prompts, args, device)
    _, ref_gold = policy_metrics(ref_samples, task, None)
    for name, path in zip(names, args.policy):
        if path == args.ref:  # the reference itself (make real-rlvr's SFT row): one model, its KL 0 without scoring
            model, tok, ckpt = ref, ref_tok, ref_ckpt
        else:
            model, tok, ckpt = load_model(path, "--policy", device, dtype=dtype)
        difference = same_tokenizer(tok, ref_tok, prompts)
        if difference:
            raise UserError(f"--policy {path}: its tokenizer differs from --ref {args.ref}'s: {difference}")
        # best-of-N draws max(N) seeds per prompt once; the plain row takes the first --seeds of them
        num_seeds = max([args.seeds, *(args.best_of_n or []), *([args.pass_samples] if args.pass_at else [])])
        samples = sample_policy(model, tok, prompts, replace(args, seeds=num_seeds), device, ref=ref, rms=rms)
        if reward_fn is not None:
            responses = zip(samples["prompt"], samples["response"], samples["ended"])
            reward_fn_flag = f"--reward-fn {args.reward_fn}"
            samples["reward_fn"] = [common.checked_reward(reward_fn_flag, reward_fn, p, r, e) for p, r, e in responses]
        train_seconds = round((ckpt or {}).get("seconds", 0.0), 1)  # the stage's wall time (a pretrained model: 0)
        plain = [index for index, seed in enumerate(samples["seed"]) if seed < args.seed + args.seeds]
        metrics, _ = policy_metrics(pick_samples(samples, plain), task, ref_gold)
        results[name] = {**metrics, "train_seconds": train_seconds}
        if args.pass_at:
            results[name] |= pass_at_metrics(samples, task, args.pass_at, args.pass_samples, args.seed)
        rank_by = "score" if rms else "reward_fn"  # --rm, or --reward-fn without one
        for n in args.best_of_n or []:  # one pick per prompt, against the reference's first seed
            picked = best_of_n(samples, n, args.seed, missing_eos_score, rank_by)
            metrics, _ = policy_metrics(picked, task, ref_gold[: len(prompts)] if ref_gold else None)
            results[f"{name}_bon{n}"] = {**metrics, "kl_bound": True, "train_seconds": train_seconds}
            if args.write_best:
                write_best(args.write_best, picked, prompts, n, rank_by)
        for p, r, e in list(zip(samples["prompt"], samples["response"], samples["ended"]))[: args.show]:
            print(f"[{name}] {format_sample(p, r, e)}")
    print_table(results)
    print(
        f"eval: {len(prompts)} prompts x {args.seeds} seeds x {len(args.policy)} policies in {time.time() - t0:.0f}s; "
        "± is one standard error over prompts (samples of a prompt clustered)"
    )
    return write_json(args.json, results)


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
