"""rollout.py, the rollout both RL stages share: the TIS weights against their formula on random ragged batches
(padding holding extreme log-probs), and steps 1-3 of an iteration on tiny models: padding never changes a log-prob or
a value, KL exactly 0 for policy == reference, the score on the EOS, the sampler-vs-trainer log-prob check (raised on
every rank), the metrics reduced from this rank's sums, one RM path as the RM list, generation from token prefixes (k
continuations a row against a loop, greedy batched against one at a time, a prefix of length 0 as the plain rollout),
the FLOPs of an iteration by hand, and the bf16 sampler copy of the actor refreshed in place."""

import contextlib
import dataclasses
import json
import math
import os
import re

import pytest
import torch
import torch.multiprocessing as mp
from conftest import boost_eos, exits_2_with_one_line, fake_experience, free_port, ragged, read_scalars, tiny_gpt

import common
import generate
import parallel
import rollout
import train_grpo
import train_ppo
from model import GPT, logprobs_from_logits, response_forward
from rollout import Models

# -----------------------------------------------------------------------------
# TIS: a pure function against a naive loop


def test_tis_weights_against_the_formula():
    """--tis-cap C: min(exp(old - sampler), C) per valid token, 0 on padding whatever its log-probs (masked before the
    exponential); the stats are the valid tokens' mean weight and the share above the cap."""
    lengths, mask, (old, sampler, _, _, _) = ragged(B=6, seed=11)
    sampler = old + 0.8 * sampler  # ratios on both sides of the cap
    sampler = torch.where(mask.bool(), sampler, torch.full_like(sampler, -1000.0))
    weights, stats = rollout.tis_weights(old, sampler, mask, 1.5)
    want, above, n = [], 0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            ratio = math.exp(old[b, t].item() - sampler[b, t].item())
            assert weights[b, t].item() == pytest.approx(min(ratio, 1.5), abs=1e-12)
            want.append(min(ratio, 1.5))
            above += ratio > 1.5
            n += 1
        assert (weights[b, length:] == 0).all()
    assert stats["tis_weight_mean"].item() == pytest.approx(sum(want) / n, abs=1e-12)
    assert stats["tis_clipfrac"].item() == pytest.approx(above / n, abs=1e-12) and 0 < above < n


def test_one_rm_path_resolves_to_the_rm_list():
    """The RM list: one path from code as a string; both stages' Args take it (the saved args too, on --resume)."""
    for resolved in (
        train_ppo.Args(rm_ckpt="out/rm/ckpt.pt"),
        train_grpo.resolve_args(train_grpo.Args(rm_ckpt="out/rm/ckpt.pt")),
    ):
        assert resolved.rm_ckpt == ["out/rm/ckpt.pt"]


@pytest.mark.parametrize("rows", [3, 8], ids=["a micro-batch", "all"])
def test_update_kl_against_a_loop(rows):
    """policy/update_kl after a policy moved: the mean over the first `rows` responses of sum_t (r - 1) - log r,
    r = pi_new / pi_old of the sampled token, each response's new log-probs from a forward of its own (no padding),
    padding holding extreme old log-probs."""
    actor, _, exp = fake_experience()
    with torch.no_grad():
        for parameter in actor.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    exp = exp | {"logprobs": torch.where(exp["mask"].bool(), exp["logprobs"], -1000.0)}
    got = rollout.update_kl(actor, exp, rows, 0.8, contextlib.nullcontext())
    want = []
    for row in range(rows):
        query = exp["query"][row][exp["query_mask"][row].bool()][None]
        n = int(exp["mask"][row].sum())
        response = exp["response"][row, :n][None]
        with torch.no_grad():
            logits, _ = response_forward(actor, query, torch.ones_like(query), response, torch.ones_like(response), 0.8)
        new = logprobs_from_logits(logits, response)[0]
        log_r = new - exp["logprobs"][row, :n]
        want.append((log_r.exp() - 1 - log_r).sum().item())
    assert got == pytest.approx(sum(want) / rows, rel=1e-5) and got > 0


# -----------------------------------------------------------------------------
# steps 1-3 on tiny models: padding, KL = 0, the scores, the log-prob check, the metrics


def test_padding_never_changes_logprobs_or_values(task_tok):
    from data import pad_left, pad_right

    tok = task_tok
    actor, critic = tiny_gpt(tok, 0), tiny_gpt(tok, 1, lm_head=False, score_head=True)
    queries = [tok.encode("Review of The Silent River (music):"), tok.encode("Review of")]
    responses = [tok.encode(" the plot was good.") + [tok.eos_id], tok.encode(" i")]
    q, qm = pad_left(queries, tok.pad_id)
    r, rm = pad_right(responses, tok.pad_id)
    r = torch.cat([r, torch.full((2, 3), tok.pad_id)], 1)  # extra right padding
    rm = torch.cat([rm, torch.zeros(2, 3)], 1)
    logits, _ = response_forward(actor, q, qm, r, rm, 0.7)
    _, values = response_forward(critic, q, qm, r, rm, 0.7)
    lp = logprobs_from_logits(logits, r)
    with torch.no_grad():  # the lm head on the response positions only: the full forward's logits there
        full = actor(torch.cat([q, r], 1), torch.cat([qm, rm], 1))[0][:, q.size(1) - 1 : -1] / 0.7
    assert logits.shape == full.shape and torch.allclose(logits, full, atol=1e-5)
    for b in range(2):
        n = len(responses[b])
        q1, r1 = torch.tensor([queries[b]]), torch.tensor([responses[b]])
        l1, _ = response_forward(actor, q1, torch.ones_like(q1), r1, torch.ones_like(r1), 0.7)
        _, v1 = response_forward(critic, q1, torch.ones_like(q1), r1, torch.ones_like(r1), 0.7)
        assert torch.allclose(lp[b, :n], logprobs_from_logits(l1, r1)[0], atol=1e-5)
        assert torch.allclose(values[b, :n], v1[0], atol=1e-5)


def rollout_args(**settings) -> rollout.RolloutArgs:
    """The rollout's flags: 12 new tokens at temperature 0.9, a missing EOS scores -3 (settings override)."""
    defaults = dict(max_new_tokens=12, temperature=0.9, missing_eos_penalty=-3.0)
    return rollout.RolloutArgs(**(defaults | settings))


def engine_of(models: Models, tok, reward_fn=None, gold_fn=None, seed: int = 0, **settings) -> rollout.Engine:
    """A rollout engine over the models: micro-batches of 4, a generator seeded with seed, rollout_args(**settings)."""
    generator = torch.Generator().manual_seed(seed)
    return rollout.Engine(models, tok, rollout_args(**settings), 4, generator, reward_fn=reward_fn, gold_fn=gold_fn)


def run_rollout(models: Models, tok, prompts: list, reward_fn=None, gold_fn=None, **settings):
    """rollout.rollout on prompts in micro-batches of 4 from a seeded generator -> (experience, sums, records)."""
    return rollout.rollout(engine_of(models, tok, reward_fn, gold_fn, **settings), prompts)


PROMPTS = [f"Review of The Silent River ({a}):" for a in ("plot", "music", "acting, ending")] + ["Review of"] * 5


def test_rollout_kl_zero_for_the_policy_as_reference_and_the_score_on_eos(task_tok):
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)  # some rows end with EOS within 12 tokens, some do not
    ref = GPT(actor.config).eval()
    ref.load_state_dict(actor.state_dict())
    rm = tiny_gpt(tok, 2, score_head=True)
    exp, sums, records = run_rollout(
        Models(actor, ref, [rm]), tok, PROMPTS, reward_fn=lambda p, r, e: len(r) / 10, reward_fn_coef=0.5
    )
    metrics, _ = rollout.rollout_metrics(sums, torch.device("cpu"))
    assert metrics["objective/kl"] == 0.0 and (exp["logprobs"] == exp["ref_logprobs"]).all()  # exactly, not approx
    mask, P = exp["mask"], exp["query"].size(1)
    ended = torch.tensor([record["ended"] for record in records])
    assert 0 < ended.sum() < len(PROMPTS), "want rows with and without EOS"
    assert torch.equal(exp["ended"], ended.float())
    last = mask.sum(1).long() - 1
    for b in range(len(PROMPTS)):
        n = int(last[b]) + 1
        assert (exp["response"][b, n - 1] == tok.eos_id) == bool(ended[b])
        if ended[b]:  # the RM's score of the unpadded sequence at its EOS, + coef * reward_fn
            ids = torch.cat([exp["query"][b][exp["query_mask"][b].bool()], exp["response"][b, :n]])[None]
            want = rm(ids)[1][0, -1].item() + 0.5 * len(records[b]["response"]) / 10
            assert exp["scores"][b].item() == pytest.approx(want, abs=1e-5)
        else:
            assert exp["scores"][b].item() == -3.0
    assert P == max(len(tok.encode(p)) for p in PROMPTS)
    # the sampler's own log-probs, kept for --tis-cap: the training forward's to fp32 rounding, 0 on padding
    assert torch.allclose(exp["sampler_logprobs"], exp["logprobs"], atol=1e-4)
    assert (exp["sampler_logprobs"][mask == 0] == 0).all()


def test_rollout_sums_reduce_to_the_metrics_of_the_experience(task_tok):
    """rollout_metrics over this rank's sums (one process) equals each metric computed directly from the experience
    and the records: the mean score, the mean summed k1 (a reference other than the policy: KL != 0), the mean
    response length, the EOS fraction, the perplexity of the sampled tokens, the mean gold reward."""
    tok = task_tok
    actor, ref = boost_eos(tiny_gpt(tok, 0), tok.eos_id), tiny_gpt(tok, 3)
    exp, sums, records = run_rollout(
        Models(actor, ref, [tiny_gpt(tok, 2, score_head=True)]), tok, PROMPTS, gold_fn=lambda p, r, e: len(r) / 100
    )
    metrics, totals = rollout.rollout_metrics(dict(sums), torch.device("cpu"))
    mask = exp["mask"]
    kl = ((exp["logprobs"] - exp["ref_logprobs"]) * mask).sum(1)
    assert 0 < exp["ended"].sum() < len(PROMPTS) and kl.abs().min() > 0
    assert metrics["objective/score"] == pytest.approx(exp["scores"].mean().item(), abs=1e-6)
    assert metrics["objective/kl"] == pytest.approx(kl.mean().item(), abs=1e-5)
    assert metrics["rollout/response_len"] == pytest.approx(mask.sum(1).mean().item(), abs=1e-6)
    assert metrics["rollout/eos_frac"] == pytest.approx(exp["ended"].mean().item(), abs=1e-6)
    perplexity = math.exp(-(exp["logprobs"] * mask).sum().item() / mask.sum().item())
    assert metrics["rollout/perplexity"] == pytest.approx(perplexity, rel=1e-5)
    gold = [record["gold"] for record in records]
    assert metrics["objective/gold"] == pytest.approx(sum(gold) / len(gold), abs=1e-9)
    assert totals["sequences"] == len(PROMPTS) and totals["tokens"] == mask.sum().item()
    assert [record["score"] for record in records] == pytest.approx(exp["scores"].tolist(), abs=1e-6)


def test_rollout_logs_the_rm_score_and_the_reward_function_apart(task_tok):
    tok = task_tok
    actor, rm = tiny_gpt(tok, 0), tiny_gpt(tok, 2, score_head=True)
    exp, sums, _ = run_rollout(
        Models(actor, actor, [rm]), tok, ["Review of"] * 4, reward_fn=lambda p, r, e: 0.25, reward_fn_coef=2.0
    )
    stats, _ = rollout.rollout_metrics(sums, torch.device("cpu"))
    assert stats["objective/reward_fn"] == pytest.approx(0.25)
    ended = exp["ended"].bool()
    if ended.any():  # the score of an ended response is the RM's plus coef x the function's
        assert stats["objective/rm_score"] != 0.0


def sampler_off_by(amount: float):
    """generate.sample whose reported log-probs are `amount` above the sampled tokens' (a sampler whose numerics
    differ from the training forward's)."""
    real = generate.sample

    def sample(*args, **kwargs):
        samples = real(*args, **kwargs)
        return dataclasses.replace(samples, logprobs=samples.logprobs + amount * samples.mask)

    return sample


def test_rollout_raises_on_logprob_mismatch(task_tok, monkeypatch):
    actor = tiny_gpt(task_tok, 0)
    monkeypatch.setattr(generate, "sample", sampler_off_by(1e-3))  # run_episodes samples each turn
    with pytest.raises(RuntimeError, match="generation log-probs differ"):
        run_rollout(Models(actor, actor, []), task_tok, ["Review of"] * 4, reward_fn=lambda p, r, e: 0.0)


def test_the_bf16_check_bounds_the_mean_error_a_token():
    """Under bf16 the sampler-versus-trainer check stops a run whose mean |error| a token cannot come from rounding
    (rollout.BF16_LOGPROB_BOUND), with one line naming the likely causes; a single token far off (bf16 moves some)
    only shows in the max, which is reported; fp32 keeps its bound on the max."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 16)
    logprobs = -torch.rand(4, 16, generator=g) * 3
    rounding = logprobs + 2e-3 * torch.randn(4, 16, generator=g)
    rounding[0, 0] += 0.3  # one token far off
    largest, mean = rollout.check_logprobs(rounding, logprobs, mask, torch.bfloat16)
    assert largest == pytest.approx(0.3, abs=0.01) and mean < 0.01
    stale = logprobs + 0.5 * torch.randn(4, 16, generator=g)  # another model sampled (a stale copy)
    with pytest.raises(RuntimeError, match="a sampler copy that is not the actor, or a model that decodes without"):
        rollout.check_logprobs(stale, logprobs, mask, torch.bfloat16)
    with pytest.raises(RuntimeError, match="> 0.001 in fp32"):
        rollout.check_logprobs(rounding, logprobs, mask, torch.float32)
    largest, mean = rollout.check_logprobs(logprobs + 1e-6, logprobs, mask, torch.float32)
    assert largest == pytest.approx(1e-6, rel=0.1) and mean == pytest.approx(1e-6, rel=0.1)


@pytest.fixture
def matmul_precision():
    """torch's fp32 matmul settings (process-wide), restored after the test."""
    precision, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_fp32_means_fp32_on_cuda_and_the_check_follows_the_matmuls_in_use(monkeypatch, matmul_precision):
    """setup_dist on CUDA leaves fp32 matmuls at full precision (it turned TF32 on, and --dtype float32 then failed its
    own fp32 check); where TF32 is on anyway (a fork's choice), an fp32 run is checked like bf16, on the mean."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.delenv("RANK", raising=False)
    assert parallel.setup_dist("cuda").device == torch.device("cuda:0")
    assert torch.get_float32_matmul_precision() == "highest" and parallel.full_precision(torch.float32)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 16)
    logprobs = -torch.rand(4, 16, generator=g) * 3
    tf32_rounding = logprobs + 2e-3 * torch.randn(4, 16, generator=g)
    with pytest.raises(RuntimeError, match="> 0.001 in fp32"):
        rollout.check_logprobs(tf32_rounding, logprobs, mask, torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert not parallel.full_precision(torch.float32)
    largest, mean = rollout.check_logprobs(tf32_rounding, logprobs, mask, torch.float32)
    assert largest > rollout.FP32_LOGPROB_BOUND and mean < 0.01
    with pytest.raises(RuntimeError, match="more than bf16 or TF32 rounding"):
        rollout.check_logprobs(logprobs + 0.5, logprobs, mask, torch.float32)


@pytest.mark.parametrize(
    "rm, reward_fn, penalty, want",
    [
        (True, False, None, "rm: -1"),
        (True, True, None, "rm: -1, plus the function"),
        (False, True, None, "the function"),
        (True, True, -3.0, "-3"),
        (False, True, -3.0, "-3"),
    ],
)
def test_how_a_response_without_eos_scores(task_tok, rm, reward_fn, penalty, want):
    """--missing-eos-penalty None: an RM's part of the score of a response without EOS is -1 (it reads its score at
    the EOS) and the reward function adds its own value, given ended=False; with the function alone, it decides. A
    number: every such response scores it. An ended response's score is untouched."""
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)
    models = Models(actor, actor, [tiny_gpt(tok, 2, score_head=True)] if rm else [])

    def fn(prompt, response, ended):
        return 0.5 if ended else -0.25

    settings = dict(missing_eos_penalty=penalty, rm_ckpt=["rm.pt"] if rm else ["none"])
    engine = engine_of(models, tok, reward_fn=fn if reward_fn else None, **settings)
    if reward_fn:  # the flag the start-up line reads
        engine.args = dataclasses.replace(engine.args, reward_fn="test:fn")
    exp, _, _ = rollout.rollout(engine, PROMPTS)
    ended = exp["ended"].bool()
    assert ended.any() and not ended.all(), "want responses with and without EOS"
    expected = {"rm: -1": -1.0, "rm: -1, plus the function": -1.0 - 0.25, "the function": -0.25, "-3": -3.0}[want]
    assert torch.allclose(exp["scores"][~ended], torch.full(((~ended).sum(),), expected))
    if not rm:  # the ended ones: the function's own value
        assert torch.allclose(exp["scores"][ended], torch.full((ended.sum(),), 0.5))
    rule = rollout.missing_eos_rule(engine.args)  # what the start-up line says
    said = {
        "rm: -1": "-1 (the RM",
        "rm: -1, plus the function": "-1 for the RM's part",
        "the function": "--reward-fn's",
    }
    assert rule.startswith(said.get(want, "-3"))


def test_the_start_up_line_says_when_nothing_is_scored():
    args = rollout.RolloutArgs(rm_ckpt=["none"])  # distillation: the teacher's log-probs alone
    assert rollout.missing_eos_rule(args) == "nothing (no score is read)"


def test_a_ragged_batch_is_scored_row_by_row(task_tok):
    """The rollout's RM score and log-probs read each row's own prompt and response packed (model.left_pack): a
    batch whose longest prompt plus longest response is wider than the context scores (no row needs another's
    width), and every row's score and log-probs equal those of the row alone."""
    tok = task_tok
    actor = tiny_gpt(tok, 0).double()  # context 64
    rm = tiny_gpt(tok, 2, score_head=True).double()
    long_prompt = "Review of " + " ".join(["The Silent River"] * 14) + ":"
    prompts = [long_prompt, "Review of"]
    assert len(tok.encode(long_prompt)) + 24 > 64 >= len(tok.encode(long_prompt)) + 4
    exp, _, records = rollout.rollout(engine_of(Models(actor, actor, [rm]), tok, max_new_tokens=24), prompts)
    assert exp["query"].size(1) + exp["mask"].size(1) > 64  # unpacked, the batch would not fit
    for row, prompt in enumerate(prompts):
        n = int(exp["mask"][row].sum())
        ids = torch.tensor([tok.encode(prompt) + exp["response"][row, :n].tolist()])
        with torch.no_grad():
            logits, scores = actor(ids)[0], rm(ids, logits=False)[1]
        want = logprobs_from_logits(logits[0, -n - 1 : -1] / 0.9, ids[0, -n:])
        assert torch.allclose(exp["logprobs"][row, :n], want, atol=1e-10)
        if records[row]["ended"]:
            assert exp["scores"][row].item() == pytest.approx(scores[0, -1].item(), abs=1e-6)


def _logprob_check_worker(rank: int, port: int, tokenizer_state: dict, queue) -> None:
    """Rank 0's sampler disagrees with its training forward, rank 1's agrees: both must raise, none may hang."""
    import torch.distributed as dist

    from tokenizer import Tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = Tokenizer.from_state(tokenizer_state)
    actor = tiny_gpt(tok, 0)
    if rank == 0:
        generate.sample = sampler_off_by(1e-3)  # what run_episodes samples each turn with
    try:
        run_rollout(Models(actor, actor, []), tok, ["Review of"] * 4, reward_fn=lambda prompt, response, ended: 0.0)
        queue.put((rank, "no error"))
    except RuntimeError as error:
        queue.put((rank, str(error)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_logprob_check_raises_on_every_rank(task_tok):
    """The generation-vs-training log-prob check reduces its error (max) across ranks before deciding."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_logprob_check_worker, args=(r, port, task_tok.state(), queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), "a rank hung or crashed"
    results = dict(queue.get() for _ in range(2))
    assert all("generation log-probs differ" in results[rank] for rank in (0, 1)), results


# -----------------------------------------------------------------------------
# generation from token prefixes: k continuations of a partial response in one call


def double_models(tok, eos_boost: float = 1.5) -> Models:
    """A float64 policy (its own reference) that ends some responses early, and a float64 RM: batched and
    one-at-a-time forwards agree to rounding."""
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id, eos_boost).double()
    return Models(actor, actor, [tiny_gpt(tok, 2, score_head=True).double()])


def half_prefixes(experience: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's first half (its length // 2 tokens) as a prefix: (ids, mask), right-padded."""
    mask = experience["mask"]
    half = mask.sum(1, keepdim=True) // 2
    return experience["response"], (torch.arange(mask.size(1)) < half).to(mask.dtype)


def test_a_prefix_of_length_0_is_the_plain_rollout(task_tok):
    """rollout(prompts, prefix of width 0) draws the same tokens from the same generator and returns the very same
    experience and records as rollout(prompts)."""
    models = double_models(task_tok)
    plain, plain_sums, plain_records = rollout.rollout(engine_of(models, task_tok), PROMPTS)
    empty = (torch.zeros(len(PROMPTS), 0, dtype=torch.long), torch.zeros(len(PROMPTS), 0, dtype=torch.float64))
    joined, sums, records = rollout.rollout(engine_of(models, task_tok), PROMPTS, prefix=empty)
    assert plain.keys() == joined.keys() and all(torch.equal(plain[key], joined[key]) for key in plain)
    assert records == plain_records and sums.keys() == plain_sums.keys()


def fixed_sample(continuations: torch.Tensor, continuation_mask: torch.Tensor, eos_id: int):
    """generate.sample that answers every row with the given continuation (B, Tc) and reports the policy's own
    log-probs of it, as the decode would."""

    def sample(model, tok, query, query_mask, max_new_tokens, temperature, **kwargs):
        assert query.size(0) == continuations.size(0) and (continuation_mask.sum(1) <= max_new_tokens).all()
        logits, _ = response_forward(model, query, query_mask, continuations, continuation_mask, temperature)
        logprobs = logprobs_from_logits(logits, continuations) * continuation_mask
        lengths = continuation_mask.sum(1).long()
        last = (lengths - 1).clamp(min=0)
        ended = (continuations.gather(1, last[:, None]).squeeze(1) == eos_id) & (lengths > 0)
        texts = [tok.decode(row) for row in continuations.tolist()]
        return generate.Samples(continuations, continuation_mask, logprobs, last, ended, texts)

    return sample


def test_monte_carlo_value_of_fixed_continuations_equals_a_loop(task_tok, monkeypatch):
    """With the continuation token ids fixed, rollout(prompts, prefix, k) assembles each prefix and continuation into
    one response and scores it: the tokens, texts and ends of every response equal a loop that builds each sequence as
    a list, and the mean score of a row's k continuations (its Monte-Carlo value) equals the loop's, which scores each
    sequence alone (the RM at its last token, + coef x the reward function on the whole response's text, the
    missing-EOS penalty) and averages, to the float32 the scores are kept in; the log-probs over the whole response
    equal the policy's on the unpadded sequence (float64)."""
    tok, k = task_tok, 3
    models = double_models(task_tok)
    experience, _, _ = rollout.rollout(engine_of(models, tok), PROMPTS)
    prefix_ids, prefix_mask = half_prefixes(experience)
    g = torch.Generator().manual_seed(5)
    budget = (12 - prefix_mask.sum(1)).long().repeat_interleave(k)  # what is left of max_new_tokens 12
    lengths = (torch.rand(len(budget), generator=g) * budget).long() + 1  # 1..budget tokens
    width = int(lengths.max())
    continuations = torch.randint(0, tok.eos_id, (len(budget), width), generator=g)
    continuation_mask = (torch.arange(width) < lengths[:, None]).double()
    ends = torch.rand(len(budget), generator=g) < 0.5  # about half of them end with EOS
    continuations[torch.arange(len(budget)), lengths - 1] = torch.where(ends, tok.eos_id, continuations[:, 0])
    continuations = continuations.masked_fill(continuation_mask == 0, tok.pad_id)
    monkeypatch.setattr(rollout, "sample", fixed_sample(continuations, continuation_mask, tok.eos_id))

    def reward_fn(prompt, response, ended):
        return len(response) / 20

    engine = engine_of(models, tok, reward_fn=reward_fn, reward_fn_coef=0.5)
    continued, _, records = rollout.rollout(engine, PROMPTS, prefix=(prefix_ids, prefix_mask), k=k)
    values = continued["scores"].view(-1, k).mean(1)
    actor, rm = models.actor, models.reward_models[0]
    for row, prompt in enumerate(PROMPTS):
        prompt_ids = tok.encode(prompt)
        prefix = prefix_ids[row, : int(prefix_mask[row].sum())].tolist()
        scores = []
        for j in range(k):
            index = row * k + j
            continuation = continuations[index, : int(lengths[index])].tolist()
            ids = torch.tensor([prompt_ids + prefix + continuation])
            ended = continuation[-1] == tok.eos_id
            text = tok.decode(prefix + continuation)
            assert records[index]["response"] == text and records[index]["ended"] == ended
            assert continued["response"][index, : len(prefix + continuation)].tolist() == prefix + continuation
            score = rm(ids, logits=False)[1][0, -1].item() + 0.5 * reward_fn(prompt, text, ended)
            scores.append(score if ended else -3.0)
            logits = actor(ids)[0][0, len(prompt_ids) - 1 : -1] / 0.9  # at the rollout's temperature
            logprobs = logprobs_from_logits(logits, ids[0, len(prompt_ids) :])
            n = len(prefix + continuation)
            assert torch.allclose(continued["logprobs"][index, :n], logprobs, atol=1e-12)
        assert values[row].item() == pytest.approx(sum(scores) / k, abs=1e-6)  # scores are float32 (an RM's .float())


def test_greedy_continuations_batched_equal_one_at_a_time(task_tok):
    """At temperature 0 (greedy) a batch of prefixes of different lengths, continued in one call, gives each row the
    tokens and log-probs it gets alone (float64); a prefix that ends with EOS takes no token."""
    tok = task_tok
    models = double_models(tok, eos_boost=2.0)
    experience, _, _ = rollout.rollout(engine_of(models, tok), PROMPTS)
    prefix_ids, prefix_mask = half_prefixes(experience)
    ended_row = int(experience["ended"].argmax())  # a whole response that ended, as its own prefix
    assert experience["ended"][ended_row] == 1
    prefix_mask[ended_row] = experience["mask"][ended_row]
    greedy = engine_of(models, tok, temperature=0.0)
    batched = rollout.continue_responses(greedy, PROMPTS, (prefix_ids, prefix_mask))
    for row, prompt in enumerate(PROMPTS):
        alone = rollout.continue_responses(greedy, [prompt], (prefix_ids[row : row + 1], prefix_mask[row : row + 1]))
        n = int(alone.samples.mask.sum())
        assert n == int(batched.samples.mask[row].sum()) and alone.samples.texts[0] == batched.samples.texts[row]
        assert torch.equal(alone.samples.response[0, :n], batched.samples.response[row, :n])
        assert torch.allclose(alone.samples.logprobs[0, :n], batched.samples.logprobs[row, :n], atol=1e-10)
        assert torch.equal(alone.sampled[0, :n], batched.sampled[row, :n])
    assert batched.sampled[ended_row].sum() == 0 and batched.samples.ended[ended_row]


def test_sampled_monte_carlo_value_within_3_standard_errors_of_a_loop(task_tok):
    """The mean score of 512 continuations of one prefix sampled in one call lies within 3 standard errors of the
    mean of 512 continuations sampled one call each (other draws of the same distribution)."""
    tok, n = task_tok, 512
    models = double_models(tok, eos_boost=2.0)
    experience, _, _ = rollout.rollout(engine_of(models, tok, max_new_tokens=8), PROMPTS[:1])
    prefix = half_prefixes(experience)
    engine = engine_of(models, tok, reward_fn=lambda p, r, e: len(r) / 10, seed=1, max_new_tokens=8)
    batched = rollout.rollout(engine, PROMPTS[:1], prefix=prefix, k=n)[0]["scores"]
    engine = engine_of(models, tok, reward_fn=lambda p, r, e: len(r) / 10, seed=2, max_new_tokens=8)
    looped = torch.cat([rollout.rollout(engine, PROMPTS[:1], prefix=prefix)[0]["scores"] for _ in range(n)])
    assert batched.std() > 0 and looped.std() > 0
    standard_error = math.sqrt(batched.var() / n + looped.var() / n)
    assert abs(batched.mean() - looped.mean()) <= 3 * standard_error


# -----------------------------------------------------------------------------
# host syncs: on a GPU each one stalls the stream, so none may be per row or per micro-batch

HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


def count_host_syncs(monkeypatch, run) -> int:
    """The calls of Tensor methods that read a value on the host (a host sync on a GPU) while run() runs."""
    calls = [0]

    def counting(original):
        def counted(self, *args, **kwargs):
            calls[0] += 1
            return original(self, *args, **kwargs)

        return counted

    with monkeypatch.context() as patch:
        for name in HOST_SYNCS:
            patch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
        run()
    return calls[0]


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_host_syncs_do_not_grow_with_the_batch(tmp_path, task_dir, tiny_ckpts, monkeypatch, stage):
    """Two iterations read values on the host the same number of times at 8 and 16 responses an iteration and at 1
    and 2 micro-batches a step: the sample records, the scores and the metrics come back in one read each, the
    token counts stay on device, one read a step for the grad norms (b681921 made 146 an iteration at 64 responses,
    128 of them one per row). max_new_tokens 8: the decode's every-8-steps EOS check never runs, so the count is
    exact."""
    sft_ckpt, rm_ckpt = tiny_ckpts
    counts = {}
    for responses, micro_batch_size in ((8, 8), (16, 16), (16, 8)):
        flags = dict(
            out_dir=str(tmp_path / f"{stage}_{responses}_{micro_batch_size}"),
            task_dir=task_dir,
            sft_ckpt=sft_ckpt,
            rm_ckpt=rm_ckpt,
            rollout_batch_size=responses,
            num_minibatches=1,
            micro_batch_size=micro_batch_size,
            max_new_tokens=8,
            warmup_steps=1,
            log_every=1,
            sample_every=100,
            max_steps=2,
        )
        if stage == "ppo":
            args = train_ppo.Args(**flags, critic_warmup_steps=0)
            counts[responses, micro_batch_size] = count_host_syncs(monkeypatch, lambda: train_ppo.main(args))
        else:
            args = train_grpo.Args(**flags, group_size=4)
            counts[responses, micro_batch_size] = count_host_syncs(monkeypatch, lambda: train_grpo.main(args))
    assert len(set(counts.values())) == 1, counts
    assert counts[8, 8] <= 50, counts  # 2 iterations: about 20 each (measured 33 and 34)


# -----------------------------------------------------------------------------
# a reward function that raises, or returns no finite number, mid-run: one line, exit 2, the folder untouched

# passes the start-up check's 2 calls and `passed` more, then answers `value`
MID_RUN_REWARD = """calls = []


def score(prompt, response, ended):
    calls.append(response)
    if len(calls) <= 2 + {passed}:
        return 0.5
    return {value}
"""


def test_a_reward_function_that_raises_is_named_with_the_prompt_the_answer_and_its_line(tmp_path, task_tok):
    """rollout's --reward-fn: a raise is one UserError naming the function, its file and line, and the prompt and the
    answer quoted (newlines escaped) and cut at 60 characters; a value that is not a finite number the same."""
    (tmp_path / "myreward.py").write_text(MID_RUN_REWARD.format(passed=0, value="{}['missing']"))
    spec = f"{tmp_path}/myreward.py:score"
    reward_fn = common.load_reward_fn(spec, "a prompt")
    actor = tiny_gpt(task_tok, 0)
    engine = engine_of(Models(actor, actor, []), task_tok, reward_fn=reward_fn)
    engine.args = dataclasses.replace(engine.args, reward_fn=spec)
    prompt = "Review of The Silent River (plot, music, acting, ending, and the rest of it):\nin short"
    with pytest.raises(common.UserError) as error:
        rollout.rollout(engine, [prompt] * 4)
    head = f"--reward-fn {spec} raised KeyError ('missing') at {tmp_path}/myreward.py:8 on prompt "
    assert str(error.value).startswith(head + repr(prompt[:60]) + "... answer '"), str(error.value)
    assert "\n" not in str(error.value)
    engine.reward_fn = lambda prompt, response, ended: float("inf") if response else 0.0
    with pytest.raises(common.UserError, match=r" returned inf on prompt '.*' answer '.+': expected a finite number"):
        rollout.rollout(engine, ["Review of"] * 4)


@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py"])
@pytest.mark.parametrize(
    "passed, value, said",
    [
        (8, "1 / len(prompt) / 0", r"raised ZeroDivisionError \(float division by zero\) at {file}:8 on prompt '.*' "),
        (0, "float('nan')", r"returned nan on prompt '.*' answer '.*': expected a finite number \(a float\)$"),
    ],
    ids=["raises in the second iteration", "nan in the first"],
)
def test_a_reward_function_that_fails_mid_run_exits_2_and_leaves_the_last_checkpoints_folder(
    tmp_path, task_dir, tiny_ckpts, capsys, monkeypatch, script, passed, value, said
):
    """A --reward-fn that passes the start-up check, then raises or returns nan: one line naming the function, the
    file and line of the raise, the prompt and the answer, exit 2 and no traceback (it was a 25-line traceback and exit
    1). The run folder is as its last checkpoint left it: after a save at step 1, no scalar, sample or checkpoint of
    step 2; failing in the first iteration, no event file and no samples.jsonl at all."""
    path = tmp_path / "myreward.py"
    path.write_text(MID_RUN_REWARD.format(passed=passed, value=value))
    out = tmp_path / "run"
    flags = f"--sft-ckpt {tiny_ckpts[0]} --rm-ckpt none --reward-fn {path}:score --task-dir {task_dir} --out-dir {out}"
    flags += " --max-steps 3 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --max-new-tokens 8"
    flags += " --warmup-steps 1 --log-every 1 --sample-every 1 --save-every 1 --device cpu"
    err = exits_2_with_one_line(script, flags.split(), capsys, monkeypatch)
    assert re.match(f"error: --reward-fn {path}:score " + said.format(file=path), err), err
    if passed == 0:  # the first iteration
        assert not out.exists() or os.listdir(out) == [], os.listdir(out)
        return
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 1
    assert {json.loads(line)["step"] for line in open(out / "samples.jsonl")} == {1}
    assert len(read_scalars(str(out))["objective/score"]) == 1
    assert len([name for name in os.listdir(out) if name.startswith("events.out.tfevents.")]) == 1
