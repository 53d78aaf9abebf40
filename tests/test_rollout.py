"""rollout.py, what both RL stages share: the masked statistics, running moments merged across ranks, the score
normalisation, the KL estimators k1/k2/k3 and the TIS weights against their formulas on random ragged batches (padding
holding extreme log-probs), and steps 1-3 of an iteration on tiny models: padding never changes a log-prob or a value,
KL exactly 0 for policy == reference, the score on the EOS, the sampler-vs-trainer log-prob check (raised on every
rank), the metrics reduced from this rank's sums, older flag spellings, the FLOPs of an iteration by hand, and the bf16
sampler copy of the actor refreshed in place."""

import dataclasses
import math

import pytest
import torch
import torch.multiprocessing as mp
from conftest import boost_eos, free_port, ragged, tiny_gpt, valid

import generate
import rollout
import train_grpo
import train_ppo
from model import GPT, GPTConfig, logprobs_from_logits, response_forward
from rollout import Models, RunningMoments, kl_estimate, masked_mean, masked_whiten, normalize_scores

# -----------------------------------------------------------------------------
# statistics, KL estimators, TIS: pure functions against naive loops


def test_masked_mean_and_whiten():
    lengths, mask, (x, *_) = ragged()
    vals = valid(x, lengths)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-12)
    w = masked_whiten(x, mask)
    assert valid(w, lengths) == pytest.approx([(v - mean) / math.sqrt(var + 1e-8) for v in vals], abs=1e-10)
    w = masked_whiten(x, mask, shift_mean=False)
    want = [(v - mean) / math.sqrt(var + 1e-8) + mean for v in vals]
    assert valid(w, lengths) == pytest.approx(want, abs=1e-10)
    w = masked_whiten(x, mask, mean=torch.tensor(0.5).double(), var=torch.tensor(4.0).double())  # global statistics
    assert valid(w, lengths) == pytest.approx([(v - 0.5) / math.sqrt(4.0 + 1e-8) for v in vals], abs=1e-10)


def test_running_moments_merge_equals_big_batch():
    torch.manual_seed(0)
    chunks = [torch.randn(n, dtype=torch.float64) * 3 + 1 for n in (5, 1, 17, 64)]
    big = torch.cat(chunks)
    # ranks simulated by folding per-chunk triples (what update() does with the all-gathered triples)
    triples = [(len(c), c.mean().item(), ((c - c.mean()) ** 2).sum().item()) for c in chunks]
    n, mean, m2 = RunningMoments.combine(triples)
    assert n == len(big) and mean == pytest.approx(big.mean().item(), abs=1e-12)
    assert math.sqrt(m2 / n) == pytest.approx(big.std(correction=0).item(), abs=1e-12)
    # sequential updates over the history equal one big batch; state round-trips
    rm = RunningMoments()
    for c in chunks:
        rm.update(c)
    assert rm.mean == pytest.approx(big.mean().item(), abs=1e-12)
    assert rm.std == pytest.approx(big.std(correction=0).item(), abs=1e-12)
    rm2 = RunningMoments()
    rm2.load_state_dict(rm.state_dict())
    assert (rm2.count, rm2.mean, rm2.std) == (rm.count, rm.mean, rm.std)


def test_normalize_scores_with_a_zero_std():
    """Every score seen so far equal (all responses missing EOS): no scale to divide by, so scale/norm leave the
    scores finite (s and 0), never s / 1e-8 = -1e8 with --reward-clip None."""
    scores = torch.full((4,), -1.0)
    moments = RunningMoments()
    moments.update(scores)
    assert moments.std == 0.0
    scaled = normalize_scores(scores, moments.mean, moments.std, "scale", None)
    assert torch.equal(scaled, scores)
    centred = normalize_scores(scores, moments.mean, moments.std, "norm", None)
    assert torch.equal(centred, torch.zeros(4))
    # a real spread: the PPO-max formulas, then the clip
    scores = torch.tensor([0.0, 1.0, 2.0, 30.0])
    want = (scores - 1.5) / (2.0 + 1e-8)
    assert torch.allclose(normalize_scores(scores, 1.5, 2.0, "norm", None), want)
    assert torch.allclose(normalize_scores(scores, 1.5, 2.0, "scale", 5.0), (scores / 2.0).clamp(-5, 5))
    assert torch.equal(normalize_scores(scores, 1.5, 2.0, "none", None), scores)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_against_the_formulas_masked_before_the_exponential(estimator):
    """Per token, with d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = (exp(-d) - 1) + d (>= 0, like k2); 0 on
    padding. Padding may hold any log-prob (a pad target's log-prob under the current policy is not masked): at -1000
    on the policy side and 0 on the reference side, exp(ref - logp) alone would be inf and inf * 0 a NaN; the
    estimates stay finite and equal the unpadded ones."""
    lengths, mask, (lp, ref, *_) = ragged(seed=4)
    kl = kl_estimate(lp, ref, mask, estimator)
    for b, n in enumerate(lengths):
        for t in range(mask.size(1)):
            if t >= n:
                assert kl[b, t] == 0
                continue
            d = (lp[b, t] - ref[b, t]).item()
            want = {"k1": d, "k2": 0.5 * d**2, "k3": (math.exp(-d) - 1) + d}[estimator]
            assert kl[b, t].item() == pytest.approx(want, abs=1e-12)
    assert estimator == "k1" or (kl >= 0).all()
    extreme = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0))
    padded = kl_estimate(extreme, ref * mask, mask, estimator)
    assert torch.isfinite(padded).all() and (padded[mask == 0] == 0).all()
    assert torch.allclose(padded, kl_estimate(lp, ref * mask, mask, estimator), atol=1e-12)
    with pytest.raises(ValueError, match="unknown kl estimator"):
        kl_estimate(lp, ref, mask, "k4")


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


def test_older_spellings_of_the_flags_resolve():
    """The RM list: a checkpoint from before ensembles saved one path; and older reward-function names: both stages
    resolve them (the saved args too, on --resume)."""
    for resolved in (
        rollout.resolve_rollout_args(train_ppo.Args(rm_ckpt="out/rm/ckpt.pt", reward_fn="data:gold_reward")),
        train_grpo.resolve_args(train_grpo.Args(rm_ckpt="out/rm/ckpt.pt", reward_fn="data:gold_reward")),
    ):
        assert resolved.rm_ckpt == ["out/rm/ckpt.pt"] and resolved.reward_fn == "task:gold_reward"


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


def run_rollout(models: Models, tok, prompts: list, reward_fn=None, gold_fn=None, **settings):
    """rollout.rollout on prompts in micro-batches of 4 from a seeded generator -> (experience, sums, records)."""
    generator = torch.Generator().manual_seed(0)
    shared = dict(micro_batch_size=4, generator=generator, reward_fn=reward_fn, gold_fn=gold_fn)
    return rollout.rollout(models, tok, prompts, rollout_args(**settings), **shared)


PROMPTS = [f"Review of The Silent River ({a}):" for a in ("plot", "music", "acting, ending")] + ["Review of"] * 5


def test_rollout_kl_zero_for_the_policy_as_reference_and_the_score_on_eos(task_tok):
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)  # some rows end with EOS within 12 tokens, some do not
    ref = GPT(actor.config).eval()
    ref.load_state_dict(actor.state_dict())
    rm = tiny_gpt(tok, 2, score_head=True)
    exp, sums, samples = run_rollout(
        Models(actor, ref, [rm]), tok, PROMPTS, reward_fn=lambda p, r, e: len(r) / 10, reward_fn_coef=0.5
    )
    metrics, _ = rollout.rollout_metrics(sums, torch.device("cpu"))
    assert metrics["objective/kl"] == 0.0 and (exp["logprobs"] == exp["ref_logprobs"]).all()  # exactly, not approx
    mask, P = exp["mask"], exp["query"].size(1)
    ended = torch.tensor([s["ended"] for s in samples])
    assert 0 < ended.sum() < len(PROMPTS), "want rows with and without EOS"
    assert torch.equal(exp["ended"], ended.float())
    last = mask.sum(1).long() - 1
    for b in range(len(PROMPTS)):
        n = int(last[b]) + 1
        assert (exp["response"][b, n - 1] == tok.eos_id) == bool(ended[b])
        if ended[b]:  # the RM's score of the unpadded sequence at its EOS, + coef * reward_fn
            ids = torch.cat([exp["query"][b][exp["query_mask"][b].bool()], exp["response"][b, :n]])[None]
            want = rm(ids)[1][0, -1].item() + 0.5 * len(samples[b]["response"]) / 10
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
    monkeypatch.setattr(rollout, "sample", sampler_off_by(1e-3))
    with pytest.raises(RuntimeError, match="generation log-probs differ"):
        run_rollout(Models(actor, actor, []), task_tok, ["Review of"] * 4, reward_fn=lambda p, r, e: 0.0)


def _logprob_check_worker(rank: int, port: int, tokenizer_state: dict, queue) -> None:
    """Rank 0's sampler disagrees with its training forward, rank 1's agrees: both must raise, none may hang."""
    import torch.distributed as dist

    from tokenizer import Tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = Tokenizer.from_state(tokenizer_state)
    actor = tiny_gpt(tok, 0)
    if rank == 0:
        rollout.sample = sampler_off_by(1e-3)
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
# FLOPs


def test_iteration_flops_against_a_hand_count():
    """perf/mfu's FLOP count of one iteration on a tiny config, counted by hand: per token a training pass is 6N
    plus 12*L*H*Q*T of attention (PaLM), a forward a third of it; with a critic (PPO-max) the RM's score forward is
    critic-sized, without one (the critic-free family) the RM's own."""
    config = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16)
    actor = GPT(GPTConfig(**config))
    critic = GPT(GPTConfig(**config, lm_head=False, score_head=True))
    reward_model = GPT(GPTConfig(**config, score_head=True))
    block = 12 * 16 * 16 + 9 * 16  # attention (qkv, proj) and MLP (fc, proj) weights plus their biases, per layer
    block += 4 * 16  # two layer norms
    trunk = 2 * block + 2 * 16  # blocks and ln_f (position embeddings are not counted)
    actor_n = trunk + 50 * 16  # the LM head (tied to wte) runs a matmul per token
    critic_n = trunk + 16 + 1  # the scalar head
    seq_len, sequences, epochs = 20, 8, 3
    attention = 12 * 2 * 2 * 8 * seq_len
    actor_per_token = 6 * actor_n + attention
    critic_per_token = 6 * critic_n + attention
    rollout_flops = (3 * actor_per_token + 2 * critic_per_token) / 3  # generation, old, ref; values, RM score
    update = epochs * (actor_per_token + critic_per_token)
    want = sequences * seq_len * (rollout_flops + update)
    assert actor.flops_per_token(seq_len) == actor_per_token
    models = Models(actor, actor, [reward_model])
    got = rollout.iteration_flops(models, seq_len, sequences, epochs, critic=critic)
    assert got == pytest.approx(want, rel=1e-12)
    # --rm-ckpt none: no RM forward
    without_rm = rollout.iteration_flops(Models(actor, actor, []), seq_len, sequences, epochs, critic=critic)
    assert want - without_rm == pytest.approx(sequences * seq_len * critic_per_token / 3, rel=1e-12)
    ensemble = rollout.iteration_flops(Models(actor, actor, [reward_model] * 3), seq_len, sequences, epochs, critic)
    assert ensemble - got == pytest.approx(2 * sequences * seq_len * critic_per_token / 3, rel=1e-12)  # a forward each
    # no critic: generation, old, ref and the RM's own forward (both heads), then the actor's passes alone
    rm_per_token = 6 * (trunk + 50 * 16 + 16 + 1) + attention
    critic_free = rollout.iteration_flops(models, seq_len, sequences, epochs)
    want = sequences * seq_len * ((3 * actor_per_token + rm_per_token) / 3 + epochs * actor_per_token)
    assert reward_model.flops_per_token(seq_len) == rm_per_token and critic_free == pytest.approx(want, rel=1e-12)


# -----------------------------------------------------------------------------
# the bf16 sampler (Models.with_sampler, refresh_sampler)


def assert_sampler_is_the_actor_in_bf16(sampler, actor_state: dict) -> None:
    """Every matrix of the sampler is exactly the actor's (adapters merged) cast to bf16; norms and biases are the
    actor's fp32 tensors (parallel.store_low_precision keeps them in fp32)."""
    sampler_state = sampler.state_dict()
    assert set(sampler_state) == set(actor_state)
    for name, want in actor_state.items():
        got = sampler_state[name]
        if want.is_floating_point() and want.dim() >= 2:
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


def move(parameters, seed: int) -> None:
    """A stand-in for an optimizer step: every parameter moved in place by a small random amount."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in parameters:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=g))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_bf16_sampler_is_the_actor_in_bf16_and_refreshes_in_place(task_tok, lora):
    """Under bf16 the rollouts come from a frozen bf16 copy of the actor (DESIGN §7): its matrices are the actor's
    (with LoRA: the merged weights, no adapter left in the copy) cast to bf16. After the actor moves,
    refresh_sampler copies it in place: every sampler tensor keeps its storage (static KV caches and CUDA graphs
    keep their addresses) and holds the new weights cast to bf16 exactly, while the actor's fp32 master weights
    (and its adapters) are left as they were. fp32 and --fsdp build no sampler."""
    from lora import BaseView, add_lora, lora_layers, merged_state_dict

    actor = tiny_gpt(task_tok, 0)
    if lora:
        add_lora(actor, rank=2, alpha=4.0, targets=["c_attn", "c_proj", "c_fc", "wte"])
        move([p for name, p in actor.named_parameters() if "lora_" in name], seed=1)  # B A != 0: merging matters
    reference = BaseView(actor) if lora else tiny_gpt(task_tok, 1)
    plain = Models(actor, reference, [])
    assert plain.with_sampler(torch.float32, fsdp=False).sampler is None
    assert plain.with_sampler(torch.bfloat16, fsdp=True).sampler is None
    models = plain.with_sampler(torch.bfloat16, fsdp=False)
    sampler = models.sampler
    assert models.actor is actor and sampler is not actor and not lora_layers(sampler)
    assert sampler.lm_head.weight is sampler.transformer.wte.weight  # still one tied matrix
    assert not any(p.requires_grad for p in sampler.parameters()) and not sampler.training
    assert_sampler_is_the_actor_in_bf16(sampler, merged_state_dict(actor))
    addresses = {name: tensor.data_ptr() for name, tensor in sampler.state_dict().items()}
    trained = [p for p in actor.parameters() if p.requires_grad]
    move(trained, seed=2)
    actor_before = {name: tensor.clone() for name, tensor in actor.state_dict().items()}
    moved = merged_state_dict(actor)
    stale = sampler.state_dict()["transformer.h.0.attn.c_attn.weight"]
    assert not torch.equal(stale, moved["transformer.h.0.attn.c_attn.weight"].to(torch.bfloat16))
    rollout.refresh_sampler(models)
    assert_sampler_is_the_actor_in_bf16(sampler, moved)
    assert {name: tensor.data_ptr() for name, tensor in sampler.state_dict().items()} == addresses
    actor_after = actor.state_dict()
    assert all(torch.equal(actor_after[name], tensor) for name, tensor in actor_before.items())
    assert all(p.dtype == torch.float32 for p in trained) and bool(lora_layers(actor)) == lora
    rollout.refresh_sampler(plain)  # no sampler: nothing to do


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
