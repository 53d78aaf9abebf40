"""eval.py: metrics and their standard errors on hand-made samples with known answers, KL of a policy against itself,
seeds pooled, the JSON layout, a temperature that cannot be measured, a prompt too long for the
context skipped without changing the others, best-of-N (the pick, the KL bound, its rows),
--reward-fn, --pairs on user data; the reward signal (docs/design.md §5d): the KL-optimal tilt's estimates on a toy with
an exact optimum, the --kl-optimal rows and their sample cache (gold alone too), --pairs over an RM ensemble."""

import copy
import json
import math
import os
import random
import statistics
from dataclasses import replace
from unittest import mock

import pytest
import torch
from conftest import boost_eos, checkpoint_dict, exits_2_with_one_line, tiny_gpt, write_jsonl

import checkpoints
import common
import eval as ev
import parallel
import task
from data import read_jsonl
from model import GPT, GPTConfig, last_token_scores
from task import build_task
from tokenizer import load_tokenizer

POLICY_KEYS = [
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
    "reward_fn",
]


def distinct_n(responses: list, n: int) -> float:
    """The reference: unique n-grams / all n-grams over all responses, 0 when there are none."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def test_distinct_2_by_hand():
    # [[1, 2, 3], [1, 2, 4]]: (1, 2) twice, (2, 3), (2, 4)
    for responses, expected in (([[1, 2, 3], [1, 2, 4]], 3 / 4), ([[5, 5, 5, 5]], 1 / 3), ([[1], []], 0.0)):
        assert distinct_n(responses, 2) == pytest.approx(expected)
        assert ev.distinct_n_se(responses, list(range(len(responses))), 2)["value"] == pytest.approx(expected)


def test_win_rate_ties_count_half():
    outcomes = ev.win_outcomes([1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 1.0, 0.5])
    assert outcomes == [1.0, 0.5, 0.0, 0.5] and sum(outcomes) / 4 == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)


def test_mean_se_by_hand():
    """One sample per prompt: std(ddof=1)/sqrt(n); two seeds per prompt: the same over the per-prompt means."""
    gold = [1.0, 0.0, 1.0, 1.0]
    stat = ev.mean_se(gold, [0, 1, 2, 3])
    assert stat["value"] == 0.75
    assert stat["se"] == pytest.approx(statistics.stdev(gold) / math.sqrt(4))
    # prompts 0, 1, 2 sampled with two seeds each, seed-major as sample_policy lays them out
    values = [1.0, 0.0, 3.0, 2.0, 0.5, 4.0]
    prompt_index = [0, 1, 2, 0, 1, 2]
    prompt_means = [1.5, 0.25, 3.5]
    stat = ev.mean_se(values, prompt_index)
    assert stat["value"] == pytest.approx(statistics.mean(values))
    assert stat["se"] == pytest.approx(statistics.stdev(prompt_means) / math.sqrt(3))
    assert ev.mean_se([2.0, 4.0], [0, 0])["se"] is None  # one cluster: no spread to measure


def jackknife_se(statistic, samples: list, cluster: list) -> float:
    """Delete-one-cluster jackknife, the naive way: recompute the statistic without each cluster."""
    keys = sorted(set(cluster))
    leave_out = [statistic([x for x, c in zip(samples, cluster) if c != key]) for key in keys]
    mean = sum(leave_out) / len(leave_out)
    return math.sqrt((len(keys) - 1) / len(keys) * sum((x - mean) ** 2 for x in leave_out))


def test_perplexity_se_matches_the_jackknife():
    """The delta method on the clustered ratio agrees with a brute-force jackknife of exp(Σ nll / Σ tokens)."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 30) for _ in range(600)]
    logprob_sums = [-n * rng.uniform(0.5, 1.5) for n in lengths]
    cluster = [i % 300 for i in range(600)]  # 300 prompts x 2 seeds
    stat = ev.perplexity_se(logprob_sums, lengths, cluster)
    assert stat["value"] == pytest.approx(math.exp(-sum(logprob_sums) / sum(lengths)))

    def perplexity(pairs):
        return math.exp(-sum(lp for lp, _ in pairs) / sum(n for _, n in pairs))

    reference = jackknife_se(perplexity, list(zip(logprob_sums, lengths)), cluster)
    assert stat["se"] == pytest.approx(reference, rel=0.02)


def test_distinct_2_se_is_the_jackknife():
    rng = random.Random(1)
    responses = [[rng.randint(0, 6) for _ in range(rng.randint(0, 8))] for _ in range(40)]
    cluster = [i % 20 for i in range(40)]
    stat = ev.distinct_n_se(responses, cluster, 2)
    assert stat["value"] == pytest.approx(distinct_n(responses, 2))
    reference = jackknife_se(lambda rs: distinct_n(rs, 2), responses, cluster)
    assert stat["se"] == pytest.approx(reference)


def test_last_token_scores_with_ragged_padding():
    scores = torch.arange(12.0).view(2, 6)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert last_token_scores(scores, mask).tolist() == [3.0, 11.0]


def test_policy_metrics_hand_made():
    p = "Review of The Silent River (music):"
    s = {
        "prompt": [p, p],
        "response": [" the music was very wonderful.", " the music was"],
        "ended": [True, False],
        "tokens": [[1, 2, 3], [1, 2]],
        "logprob_sum": [-3.0, -1.0],
        "n": [3, 2],
        "kl": [0.5, 1.5],
        "score": [1.0, float("nan")],
        "prompt_index": [0, 1],
        "seed": [7, 7],
    }
    m, gold = ev.policy_metrics(s, task, [0.0, -1.0])
    assert gold[1] == -1.0 and m["valid_frac"] == 0.5 and m["eos_frac"] == 0.5 and m["kl"] == 1.0
    assert m["perplexity"] == pytest.approx(math.exp(4 / 5)) and m["response_len"] == 2.5
    assert m["win_rate_vs_ref"] == pytest.approx((1 + 0.5) / 2) and m["score"] == 1.0
    assert m["kl_se"] == pytest.approx(statistics.stdev([0.5, 1.5]) / math.sqrt(2))
    assert m["eos_frac_se"] == pytest.approx(0.5) and m["win_rate_vs_ref_se"] == pytest.approx(0.25)
    assert m["score_se"] is None  # one scored sample
    assert m["num_samples"] == 2 and m["seeds"] == [7]
    m, _ = ev.policy_metrics(s, None, None)
    assert m["gold"] is None and m["valid_frac"] is None and m["win_rate_vs_ref"] is None
    assert m["gold_se"] is None and m["win_rate_vs_ref_se"] is None


def test_kl_of_policy_against_itself_is_zero_and_seeds_extend(task_dir):
    """KL of a policy to itself is 0; --seeds 2 keeps seed s's samples and adds seed s + 1's after them (a sample is
    its prompt's and seed's: the same in a batch of every seed of one prompt, where the prompt's prefill is shared,
    as in a batch of one seed's prompts), and the seeds of a prompt draw differently."""
    torch.manual_seed(0)
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)).eval()
    prompts = ["Review of The Silent River (music):", "Review of The Iron Tower (plot, ending):"] * 6
    one_seed = ev.sample_policy(model, tok, prompts, ev.Args(max_new_tokens=20, batch_size=8), torch.device("cpu"))
    args = ev.Args(max_new_tokens=20, batch_size=8, seeds=2)
    s = ev.sample_policy(model, tok, prompts, args, torch.device("cpu"), ref=model)
    assert max(abs(k) for k in s["kl"]) < 1e-4 and min(s["n"]) >= 1
    assert s["tokens"][: len(prompts)] == one_seed["tokens"]
    assert s["seed"] == [1234] * 12 + [1235] * 12 and s["prompt_index"] == list(range(12)) * 2
    one_prompt_a_batch = ev.sample_policy(model, tok, prompts, replace(args, batch_size=3), torch.device("cpu"))
    assert one_prompt_a_batch["tokens"] == s["tokens"]
    assert s["tokens"][:12] != s["tokens"][12:]


def test_kl_to_another_model_equals_a_plain_forwards_on_ragged_answers(task_dir):
    """The KL of a policy to a different reference, read along the decode that drew each response (the reference's
    decode forced to the drawn tokens), equals Σ log π - log ref from one plain forward of each sample alone, fp64."""
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    policy, ref = (tiny_gpt(tok, seed=seed).double().eval() for seed in (0, 1))
    boost_eos(policy, tok.eos_id)  # responses that end at different lengths
    prompts = ["Review of The Silent River (music):", "Review of The Iron Tower (plot, ending, acting, music):"] * 3
    args = ev.Args(max_new_tokens=12, batch_size=4, seeds=2)
    s = ev.sample_policy(policy, tok, prompts, args, torch.device("cpu"), ref=ref)
    assert len(set(s["n"])) > 1  # ragged responses
    for prompt, tokens, kl in zip(s["prompt"], s["tokens"], s["kl"]):
        context = ev.prompt_ids(tok, prompt)
        ids = torch.tensor([context + tokens])
        expected = 0.0
        for model, sign in ((policy, 1.0), (ref, -1.0)):
            logits = model(ids)[0][0, len(context) - 1 : -1] / args.temperature  # the logits predicting each token
            expected += sign * logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).sum().item()
        assert kl == pytest.approx(expected, abs=1e-9)


def test_kl_of_a_bf16_policy_against_itself_is_zero(task_dir):
    """Under --dtype bfloat16 the sampler's log-probs (one token at a time on a KV cache) and a full forward's differ
    by up to 0.3 a token on SmolLM2; the KL reads both sides from a full forward, so a policy against itself is 0 (a
    policy whose matrices are stored in bf16, as eval.py loads it; the reference itself as the policy: one forward)."""
    torch.manual_seed(0)
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=64)).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # weights large enough that bf16's rounding shows in the log-probs
            parameter.mul_(4)
    parallel.store_low_precision(model, torch.bfloat16)
    prompts = ["Review of The Silent River (music):", "Review of The Iron Tower (plot, ending):"] * 4
    args = ev.Args(max_new_tokens=24, batch_size=8, dtype="bfloat16")
    s = ev.sample_policy(model, tok, prompts, args, torch.device("cpu"), ref=copy.deepcopy(model))
    assert max(abs(k) for k in s["kl"]) < 1e-6 and min(s["n"]) >= 1
    # the reference itself as the policy (eval.py --policy REF): one forward for both sides, KL 0 exactly
    itself = ev.sample_policy(model, tok, prompts, args, torch.device("cpu"), ref=model)
    assert itself["tokens"] == s["tokens"] and set(itself["kl"]) == {0.0}


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory, task_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32))
    path = str(tmp_path_factory.mktemp("policy") / "ckpt.pt")
    ckpt = {
        "kind": "sft",
        "model": model.state_dict(),
        "model_config": model.config.__dict__,
        "tokenizer": tok.state(),
        "seconds": 12.0,
    }
    checkpoints.save_checkpoint(ckpt, path)
    return path


def reject_nan(name):
    raise ValueError(f"{name} in results.json")


def test_results_json_layout(tmp_path, task_dir, tiny_policy):
    """eval.main writes one entry per policy with exactly the docs/design.md §4 keys (each metric with its _se,
    num_samples, seeds), strict JSON, merged into an existing file; --seeds 2 pools both seeds' samples."""
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"rm": {"accuracy": 0.8}}))
    args = ev.Args(
        policy=[tiny_policy],
        names=["sft"],
        ref=tiny_policy,
        rm="none",
        num_samples=8,
        seeds=2,
        seed=5,
        task_dir=task_dir,
        json=str(out),
        max_new_tokens=16,
    )
    ev.main(args)
    res = json.loads(out.read_text(), parse_constant=reject_nan)
    assert set(res) == {"rm", "sft"}
    se_keys = [f"{key}_se" for key in POLICY_KEYS]
    assert set(res["sft"]) == {*POLICY_KEYS, *se_keys, "num_samples", "seeds", "train_seconds"}
    assert res["sft"]["num_samples"] == 16 and res["sft"]["seeds"] == [5, 6]
    assert res["sft"]["train_seconds"] == 12.0 and res["sft"]["win_rate_vs_ref"] == 0.5 and abs(res["sft"]["kl"]) < 1e-4
    assert res["sft"]["win_rate_vs_ref_se"] == 0.0  # the reference against itself: every sample a tie
    assert res["sft"]["score"] is None and res["sft"]["score_se"] is None
    for key in ("gold", "kl", "response_len", "perplexity", "eos_frac", "valid_frac", "distinct_2"):
        assert res["sft"][f"{key}_se"] >= 0.0, key


def test_temperature_zero_and_empty_batches_are_rejected(tmp_path, tiny_policy, capsys, monkeypatch):
    with pytest.raises(common.UserError, match="--temperature 0: kl and perplexity"):
        ev.main(ev.Args(policy=[tiny_policy], ref=tiny_policy, rm="none", temperature=0))
    monkeypatch.chdir(tmp_path)
    err = exits_2_with_one_line("eval.py", ["--temperature", "0", "--task-dir", str(tmp_path)], capsys, monkeypatch)
    assert err.strip().splitlines() == [
        "error: --temperature 0: kl and perplexity are measured at the sampling temperature; use > 0 (e.g. 1.0)"
    ]
    for flag in ("batch_size", "micro_batch_size"):
        with pytest.raises(common.UserError, match=f"--{flag.replace('_', '-')} 0: samples at a time, use >= 1"):
            ev.main(ev.Args(policy=[tiny_policy], ref=tiny_policy, rm="none", **{flag: 0}))


def test_best_of_n_picks_the_rm_argmax_over_the_first_n():
    """Hand-made: 2 prompts x 4 seeds. N = 2 looks at seeds 5, 6 only; a response without EOS scores the penalty
    whatever the RM said; a tie keeps the earlier seed; kl becomes the bound plus the picked sample's own kl."""
    s = {
        "prompt": ["a", "b"] * 4,
        "response": [f"r{i}" for i in range(8)],
        "tokens": [[i] for i in range(8)],
        "ended": [True, True, False, True, True, True, True, True],
        "logprob_sum": [-1.0] * 8,
        "n": [1] * 8,
        "kl": [0.1 * i for i in range(8)],
        "score": [0.5, 1.0, 3.0, 1.0, 2.0, 0.0, 0.7, 9.0],
        "prompt_index": [0, 1] * 4,
        "seed": [5, 5, 6, 6, 7, 7, 8, 8],
    }
    # prompt 0: seed 6's 3.0 has no EOS (-1), so seed 5 wins; prompt 1: seeds 5 and 6 tie at 1.0, the earlier stays
    picked = ev.best_of_n(s, 2, first_seed=5, missing_eos_penalty=-1.0)
    assert picked["response"] == ["r0", "r1"] and picked["prompt_index"] == [0, 1]
    assert picked["kl"] == pytest.approx([ev.best_of_n_kl_bound(2) + 0.0, ev.best_of_n_kl_bound(2) + 0.1])
    # with a penalty above 0.5 the EOS-less sample wins; N = 4 reaches seed 8's 9.0 and seed 7's 2.0
    assert ev.best_of_n(s, 2, 5, missing_eos_penalty=0.6)["response"] == ["r2", "r1"]
    assert ev.best_of_n(s, 4, 5, -1.0)["response"] == ["r4", "r7"]
    assert ev.best_of_n(s, 1, 5, -1.0)["kl"] == pytest.approx([0.0, 0.1])  # N = 1: the policy itself


def test_best_of_n_kl_bound_formula():
    """log N - (N-1)/N, and the exact KL of best-of-N over M equally likely outcomes with distinct RM scores, which
    rises to it as M grows: P(the k-th best of M) = (k/M)^N - ((k-1)/M)^N."""
    assert ev.best_of_n_kl_bound(1) == 0.0
    assert ev.best_of_n_kl_bound(2) == pytest.approx(math.log(2) - 0.5)
    assert ev.best_of_n_kl_bound(64) == pytest.approx(math.log(64) - 63 / 64)
    M = 20000
    for n in (2, 4, 16, 64):
        probs = [(k / M) ** n - ((k - 1) / M) ** n for k in range(1, M + 1)]
        exact = sum(p * math.log(p * M) for p in probs if p > 0)
        assert exact <= ev.best_of_n_kl_bound(n) + 1e-9
        assert exact == pytest.approx(ev.best_of_n_kl_bound(n), abs=2e-3)


@pytest.mark.slow
def test_best_of_n_rows_in_the_json(tmp_path, task_dir, tiny_ckpts):
    """eval.main --best-of-n: rows <name>_bon<N> with the policy keys and kl_bound; N = 1 is the plain row; the
    policy is the reference here, so each kl is the bound alone."""
    sft, rm = tiny_ckpts
    out = tmp_path / "results.json"
    args = ev.Args(
        policy=[sft],
        names=["sft"],
        ref=sft,
        rm=rm,
        num_samples=12,
        best_of_n=[1, 2, 4],
        task_dir=task_dir,
        json=str(out),
        max_new_tokens=12,
    )
    ev.main(args)
    res = json.loads(out.read_text(), parse_constant=reject_nan)
    assert set(res) == {"sft", "sft_bon1", "sft_bon2", "sft_bon4"}
    for n in (1, 2, 4):
        row = res[f"sft_bon{n}"]
        assert row["kl_bound"] is True and row["num_samples"] == 12 and {*POLICY_KEYS, "train_seconds"} <= set(row)
        assert row["kl"] == pytest.approx(ev.best_of_n_kl_bound(n), abs=1e-4)
    for key in ("gold", "score", "response_len", "win_rate_vs_ref"):
        assert res["sft_bon1"][key] == pytest.approx(res["sft"][key]), key
    with pytest.raises(common.UserError, match="--best-of-n reranks by a reward model or a reward function"):
        ev.main(ev.Args(policy=[sft], ref=sft, rm="none", best_of_n=[2], task_dir=task_dir))


def test_best_of_n_by_the_reward_function_lets_it_decide_about_eos():
    """Ranked by the reward function (no RM), a response without EOS keeps the function's own value: it decides."""
    s = {
        "prompt_index": [0, 0, 0, 1, 1, 1],
        "seed": [5, 6, 7, 5, 6, 7],
        "reward_fn": [0.1, 0.9, 0.5, 0.3, 0.2, 0.8],
        "score": [float("nan")] * 6,
        "ended": [True, False, True, True, True, True],
        "kl": [0.0] * 6,
        "response": ["a", "b", "c", "d", "e", "f"],
    }
    assert ev.best_of_n(s, 3, 5, missing_eos_penalty=-1.0, by="reward_fn")["response"] == ["b", "f"]
    assert ev.best_of_n(s, 2, 5, missing_eos_penalty=-1.0, by="reward_fn")["response"] == ["b", "d"]


def test_write_best_writes_sft_records_of_training_prompts_only(tmp_path, task_dir, task_tok):
    """eval.py --best-of-n 4 --write-best F --reward-fn: one SFT record {"prompt", "response"} per prompt whose best
    of 4 ended, read back by the SFT reader; the best of 4 scores at least the first sample; the held-out prompts,
    no --prompts, two N or two policies are refused in one line."""
    policy = str(tmp_path / "policy.pt")
    model = boost_eos(tiny_gpt(task_tok, 0), task_tok.eos_id, amount=4.0)
    checkpoints.save_checkpoint(checkpoint_dict("sft", model, task_tok), policy)
    task = build_task(task_dir, 1337)
    out = tmp_path / "best.jsonl"
    args = ev.Args(
        policy=[policy],
        names=["sft"],
        ref=policy,
        rm="none",
        prompts=task["prompts"],
        num_samples=12,
        best_of_n=[4],
        write_best=str(out),
        reward_fn="task:gold_reward",
        task_dir=task_dir,
        max_new_tokens=12,
    )
    res = ev.main(args)
    rows = read_jsonl(str(out), "sft")
    assert len(rows) == round(res["sft_bon4"]["eos_frac"] * 12) > 0
    train_prompts = [row["prompt"] for row in read_jsonl(task["prompts"], "prompts")][:12]
    assert all(set(row) == {"prompt", "response"} and row["prompt"] in train_prompts for row in rows)
    assert res["sft_bon4"]["reward_fn"] >= res["sft"]["reward_fn"]
    refused = [
        (dict(prompts=task["eval_prompts"]), r"--write-best: --prompts .* holds 12 held-out prompts"),
        (dict(prompts=None), r"--write-best writes training data: pass --prompts"),
        (dict(best_of_n=[2, 4]), r"--write-best writes one policy's best of N"),
        (dict(policy=[policy, policy], names=["a", "b"]), r"--write-best writes one policy's best of N"),
    ]
    for flags, message in refused:
        with pytest.raises(common.UserError, match=message) as error:
            ev.main(replace(args, **flags))
        assert "\n" not in str(error.value)


@pytest.mark.slow
def test_reward_fn_column_is_the_users_objective_on_held_out_prompts(tmp_path, task_dir, tiny_policy):
    """eval.py --reward-fn: the mean of fn(prompt, response, ended) over the samples, with its standard error; the
    gold reward as the function gives the gold column back."""
    args = ev.Args(
        policy=[tiny_policy],
        names=["sft"],
        ref=tiny_policy,
        rm="none",
        num_samples=8,
        task_dir=task_dir,
        max_new_tokens=16,
        reward_fn="task:gold_reward",
    )
    res = ev.main(args)["sft"]
    assert res["reward_fn"] == pytest.approx(res["gold"]) and res["reward_fn_se"] == pytest.approx(res["gold_se"])
    assert ev.main(replace(args, reward_fn=None))["sft"]["reward_fn"] is None


def test_a_reward_fn_that_raises_on_some_answers_is_one_line_naming_it(tmp_path, task_dir, tiny_policy):
    """eval.py --reward-fn that raises past the start-up check, or returns nan: the error names the function, the
    line of the raise and the answer, as the RL stages do (it was a traceback, and a nan a nan column)."""
    path = tmp_path / "picky.py"
    path.write_text(
        "calls = []\ndef score(prompt, response, ended):\n    calls.append(1)\n    return 1 / (len(calls) < 3)\n"
    )
    nan_path = tmp_path / "nan.py"
    nan_path.write_text("def score(prompt, response, ended):\n    return float('nan') if response else 0.0\n")
    args = ev.Args(policy=[tiny_policy], names=["sft"], ref=tiny_policy, rm="none", num_samples=4, task_dir=task_dir)
    with pytest.raises(
        common.UserError, match=r"--reward-fn .*picky.py:score raised ZeroDivisionError .*picky.py:4 .*answer"
    ):
        ev.main(replace(args, reward_fn=f"{path}:score", max_new_tokens=4))
    with pytest.raises(common.UserError, match=r"nan.py:score returned nan on prompt .* expected a finite number"):
        ev.main(replace(args, reward_fn=f"{nan_path}:score", max_new_tokens=4))


@pytest.mark.slow
def test_pairs_on_user_data_builds_no_task(tmp_path, tiny_ckpts):
    """eval.py --pairs --pairs-data X reads X only (it used to build the built-in task into --task-dir first)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": "Review of", "chosen": " a", "rejected": " b"}) + "\n" for _ in "xy")
    )
    res = ev.main(ev.Args(pairs=True, pairs_data=str(pairs), rm=tiny_ckpts[1], task_dir=str(tmp_path / "data")))
    assert res["rm"]["pairs"] == 2 and not os.path.exists(tmp_path / "data")


# -----------------------------------------------------------------------------
# the reward signal (docs/design.md §5d): the KL-optimal limit, reward-model ensembles


def test_tilted_estimates_on_a_toy_where_the_optimum_is_exact():
    """A reference over 4 outcomes with probabilities 0.1 0.2 0.3 0.4, sampled exactly in proportion (M = 10 samples:
    1, 2, 3, 4 of each): the importance-weighted estimates are the tilted distribution's exact mean, KL and ess."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    r = torch.tensor([1.0, -0.5, 0.3, 0.0], dtype=torch.float64)
    f = torch.tensor([2.0, 5.0, -1.0, 0.5], dtype=torch.float64)
    outcomes = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    for beta in (0.2, 1.0, 5.0):
        est = ev.tilted_estimates(r[outcomes][None], {"f": f[outcomes][None]}, beta)
        tilted = p * torch.exp(r / beta)
        tilted = tilted / tilted.sum()
        assert est["f"].item() == pytest.approx((tilted * f).sum().item(), abs=1e-12)
        assert est["kl"].item() == pytest.approx((tilted * (tilted / p).log()).sum().item(), abs=1e-12)
        weights = tilted[outcomes] / torch.bincount(outcomes)[outcomes]  # each sample's share of its outcome
        assert est["ess"].item() == pytest.approx(1 / (weights**2).sum().item(), abs=1e-9)
    flat = ev.tilted_estimates(r[outcomes][None], {}, 1e6)  # beta -> infinity: the reference itself
    assert abs(flat["kl"].item()) < 1e-9 and flat["ess"].item() == pytest.approx(10, abs=1e-6)


@pytest.mark.slow
def test_eval_kl_optimal_rows_and_the_sample_cache(tmp_path, task_dir, tiny_ckpts, tiny_rms, capsys):
    """eval.py --kl-optimal: the first --policy must be --ref; rows <name>_opt_gold_b<beta> and _opt_rm_b<beta> with
    their schema; a large beta is the reference itself (KL ~ 0), the gold tilt raises gold and stays under log M;
    the cached samples serve another reward model without sampling again."""
    sft = tiny_ckpts[0]
    base = dict(policy=[sft], names=["sft"], ref=sft, num_samples=6, seeds=16, max_new_tokens=8, task_dir=task_dir)
    with pytest.raises(common.UserError, match="--kl-optimal tilts the reference's own samples"):
        ev.main(ev.Args(**base | {"policy": [tiny_rms[0]]}, rm=[tiny_rms[0]], kl_optimal=[0.5]))
    cache = str(tmp_path / "samples.pt")
    rows = ev.main(ev.Args(**base, rm=[tiny_rms[0]], kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert set(rows) == {"sft_opt_gold_b0.05", "sft_opt_gold_b10000", "sft_opt_rm_b0.05", "sft_opt_rm_b10000"}
    keys = {"gold", "score", "kl", "valid_frac", "off_aspect", "ess", "samples", "beta", "warning"}
    assert all(keys | {"gold_se", "score_se", "kl_se"} <= set(row) for row in rows.values())
    flat, sharp = rows["sft_opt_gold_b10000"], rows["sft_opt_gold_b0.05"]
    assert abs(flat["kl"]) < 1e-3 and flat["ess"] == pytest.approx(16, abs=0.01) and flat["samples"] == 16
    assert sharp["gold"] >= flat["gold"] and 0 <= sharp["kl"] <= math.log(16) + 1e-9
    capsys.readouterr()
    again = ev.main(ev.Args(**base, rm=tiny_rms, rm_agg="min", kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert "reference samples from" in capsys.readouterr().out
    assert again["sft_opt_gold_b0.05"]["gold"] == sharp["gold"]  # the same samples
    assert again["sft_opt_rm_b10000"]["score"] <= rows["sft_opt_rm_b10000"]["score"] + 1e-9  # min <= a member
    kept = torch.load(cache, weights_only=False)["rm_scores"]  # each RM's scores, by its file's hash
    assert set(kept) == {checkpoints.file_sha256(path) for path in tiny_rms}
    with mock.patch.object(ev, "score_sequences", side_effect=AssertionError("scored again")):
        third = ev.main(ev.Args(**base, rm=tiny_rms, rm_agg="min", kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert third == again


@pytest.mark.slow
def test_eval_pairs_reports_each_member_and_the_aggregate(task_dir, tiny_rms):
    res = ev.main(ev.Args(pairs=True, rm=tiny_rms, rm_agg="mean", task_dir=task_dir, batch_size=64))
    assert set(res) == {"rm", "rm_member1", "rm_member2"}
    # the second member's head is the first's negated: its accuracy is the first's complement, the mean is a tie
    assert res["rm_member1"]["accuracy"] + res["rm_member2"]["accuracy"] == pytest.approx(1.0, abs=1e-9)
    assert res["rm"]["accuracy"] == pytest.approx(0.5, abs=0.01)


def test_kl_optimal_on_gold_alone_creates_its_sample_cache_and_reuses_it(
    tmp_path, task_dir, tiny_policy, monkeypatch, capsys
):
    """--kl-optimal with --rm none: only the gold-tilted rows, from the reference's --seeds samples per prompt, which
    --sample-cache keeps (samples, no RM scores); a second call with the same settings reads them back and samples
    nothing (sample_policy raises if called) and gives the very same rows; another --seeds is another key: sampled
    afresh."""
    cache = tmp_path / "samples.pt"
    args = ev.Args(
        policy=[tiny_policy],
        names=["sft"],
        ref=tiny_policy,
        rm=["none"],
        kl_optimal=[0.1, 1e4],
        sample_cache=str(cache),
        num_samples=4,
        seeds=4,
        max_new_tokens=8,
        task_dir=task_dir,
    )
    rows = ev.main(args)
    assert set(rows) == {"sft_opt_gold_b0.1", "sft_opt_gold_b10000"}
    kept = torch.load(cache, weights_only=False)
    assert kept["rm_scores"] == {} and len(kept["samples"]["response"]) == 4 * 4
    assert kept["key"]["seeds"] == 4 and kept["key"]["ref"] == checkpoints.file_sha256(tiny_policy)
    written = cache.read_bytes()
    real_sample_policy = ev.sample_policy

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled again")

    monkeypatch.setattr(ev, "sample_policy", no_sampling)
    capsys.readouterr()
    again = ev.main(args)
    assert "eval: 16 reference samples from " in capsys.readouterr().out
    assert json.dumps(again, sort_keys=True) == json.dumps(rows, sort_keys=True)  # NaN-safe: the same rows
    assert cache.read_bytes() == written  # nothing new to keep
    calls = []
    monkeypatch.setattr(ev, "sample_policy", lambda *a, **k: calls.append(1) or real_sample_policy(*a, **k))
    ev.main(replace(args, seeds=2))
    assert calls == [1] and torch.load(cache, weights_only=False)["key"]["seeds"] == 2


def test_kl_optimal_rows_without_a_reward_model_have_no_score():
    """Without an RM (--rm none) there is no score to tilt or report: as in the policy rows ("score is null without
    an RM", docs/design.md §4), the gold-tilted rows' score and score_se are None (null in the JSON), whatever the
    samples' EOS; gold and kl are still numbers."""
    prompt = "Review of The Silent River (music, ending):"
    samples = {
        "prompt": [prompt] * 4,
        "response": [" the music was very wonderful.", " music", " i loved the ending.", " the"],
        "ended": [True, False, True, False],
        "score": [float("nan")] * 4,  # reference_samples' scores without an RM
        "prompt_index": [0, 0, 0, 0],
        "seed": [0, 1, 2, 3],
    }
    rows = ev.kl_optimal_rows("sft", samples, [1.0], task=task, missing_eos_penalty=-1.0)
    (row,) = rows.values()
    assert list(rows) == ["sft_opt_gold_b1"] and math.isfinite(row["gold"]) and math.isfinite(row["kl"])
    assert row["score"] is None and row["score_se"] is None, (row["score"], row["score_se"])


def test_a_prompt_with_no_room_for_a_response_is_skipped_and_changes_no_other_response(
    tmp_path, task_dir, tiny_policy, monkeypatch, capsys
):
    """eval.py answers only the prompts with room for a response in the smallest context (docs/design.md §4): a prompt
    file holding one prompt longer than the policy's 128-token context drops that prompt (and says so) before sampling,
    so every other prompt gets exactly the responses it gets from the same file without it, in the same batches,
    and the results are the same numbers."""
    short = [f"Tell me about river {i} and its music." for i in range(6)]
    long_prompt = " ".join(short * 20)
    with_long = tmp_path / "with_long.jsonl"
    with_long.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in short[:2] + [long_prompt] + short[2:]))
    without = tmp_path / "without.jsonl"
    without.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in short))
    real_sample_policy, sampled = ev.sample_policy, []

    def recording(model, tok, prompts, *args, **kwargs):
        samples = real_sample_policy(model, tok, prompts, *args, **kwargs)
        sampled.append((list(prompts), samples["response"], samples["logprob_sum"]))
        return samples

    monkeypatch.setattr(ev, "sample_policy", recording)
    settings = dict(policy=[tiny_policy], names=["p"], ref=tiny_policy, rm=["none"], max_new_tokens=8, batch_size=4)
    capsys.readouterr()
    results = ev.main(ev.Args(**settings, prompts=str(with_long), num_samples=7, task_dir=task_dir))
    assert "eval: 1 of 7 prompts leave no room for a response in the context of 128: skipped" in capsys.readouterr().out
    first, sampled[:] = list(sampled), []
    baseline = ev.main(ev.Args(**settings, prompts=str(without), num_samples=6, task_dir=task_dir))
    assert len(first) == len(sampled) == 2  # the reference, then the policy
    assert all(prompts == short for prompts, _, _ in first)
    assert first == sampled  # the same responses and log-probs, prompt by prompt
    assert results["p"]["num_samples"] == 6
    assert json.dumps(results, sort_keys=True) == json.dumps(baseline, sort_keys=True)


def test_a_batch_of_ragged_prompts_is_scored_row_by_row(tmp_path, task_dir, tiny_ckpts, capsys):
    """One prompt of about 112 tokens among short ones, a 128-token context, 64 new tokens: every row fits on its own
    (the long one's budget is its 16 tokens left), so the reference's and the RM's passes read each row's prompt and
    response packed and nothing crashes (before: a pass over the whole batch's widest prompt plus its widest response,
    `sequence of length > block_size`). Off the built-in task, the table says why gold and its columns are empty."""
    short = [f"Tell me about river {i} and its music." for i in range(15)]
    sft, rm = tiny_ckpts
    from tokenizer import Tokenizer

    tok = Tokenizer.from_state(torch.load(sft, weights_only=False)["tokenizer"])
    long_prompt = tok.decode(tok.encode(" ".join(short * 3))[:112])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [long_prompt] + short))
    args = ev.Args(policy=[sft], names=["p"], ref=sft, rm=[rm], prompts=str(prompts), num_samples=16, task_dir=task_dir)
    assert 100 <= len(tok.encode(long_prompt)) < 128 - 8
    capsys.readouterr()
    results = ev.main(args)
    assert results["p"]["num_samples"] == 16 and results["p"]["score"] is not None
    out = capsys.readouterr().out
    assert "gold, valid_frac, off_aspect, win_rate_vs_ref: - (the built-in task's gold reward" in out


def test_kl_optimal_warnings_name_the_check_that_failed():
    """Each row's warning says which check failed: kl within 1 nat of log M, the mean ess under 4, or a tenth of the
    prompts at ess under 2 (a mean over prompts hides prompts where one sample dominates); none when all pass."""
    num_prompts, num_samples = 10, 16
    scores = [0.0] * (num_prompts * num_samples)
    scores[0] = scores[num_samples] = 50.0  # prompts 0 and 1: one sample dominates at beta 1; the others stay flat
    samples = {
        "prompt": ["p"] * len(scores),
        "response": ["r"] * len(scores),
        "ended": [True] * len(scores),
        "score": scores,
        "prompt_index": [i // num_samples for i in range(len(scores))],
        "seed": [i % num_samples for i in range(len(scores))],
    }
    rows = ev.kl_optimal_rows("sft", samples, [1e4, 1.0], task=None, missing_eos_penalty=-1.0)
    assert rows["sft_opt_rm_b10000"]["warning"] is None
    warning = rows["sft_opt_rm_b1"]["warning"]  # two prompts of ten at ess 1: the mean ess is still 13
    assert "a tenth of the prompts at ess under 2" in warning and "kl" not in warning.split("ess")[0], warning
    samples["score"] = [50.0 * (i % num_samples == 0) for i in range(len(scores))]  # every prompt dominated
    warning = ev.kl_optimal_rows("sft", samples, [1.0], task=None, missing_eos_penalty=-1.0)["sft_opt_rm_b1"]
    assert "within 1 nat of its ceiling" in warning["warning"] and "ess 1.0 under 4" in warning["warning"]


def test_kl_optimal_takes_the_reference_alone(tmp_path, tiny_ckpts):
    """--kl-optimal with a second --policy is refused in one line rather than ignoring it."""
    sft = tiny_ckpts[0]
    with pytest.raises(common.UserError, match="pass one --policy"):
        ev.main(ev.Args(policy=[sft, sft], ref=sft, rm="none", kl_optimal=[0.1], task_dir=str(tmp_path)))


def test_an_rm_member_with_a_smaller_context_reads_the_pairs_through_its_own(tmp_path, task_dir, tiny_ckpts):
    """eval.py --pairs with an ensemble encodes the pairs for each member with its own tokenizer and context (b681921
    used the first member's context for all): a member with a 40-token context drops the records too long for it,
    counted, and every member scores the same kept records: each member's accuracy is its own on those records."""
    rm = torch.load(tiny_ckpts[1], weights_only=False)
    torch.manual_seed(3)
    short = GPT(GPTConfig(**(rm["model_config"] | {"block_size": 40})))
    path = str(tmp_path / "short_rm.pt")
    checkpoints.save_checkpoint(rm | {"model": short.state_dict(), "model_config": short.config.__dict__}, path)
    both = ev.main(ev.Args(pairs=True, rm=[tiny_ckpts[1], path], task_dir=task_dir, batch_size=64))
    alone = ev.main(ev.Args(pairs=True, rm=[path], task_dir=task_dir, batch_size=64))
    total = len(open(build_task(task_dir, 1337)["pairs_eval"]).readlines())
    assert 0 < both["rm"]["pairs"] == alone["rm"]["pairs"] < total  # the records that fit the 40-token member
    assert both["rm_member2"]["accuracy"] == pytest.approx(alone["rm"]["accuracy"], abs=1e-9)


def test_num_samples_says_how_many_prompts_the_file_held(tmp_path, capsys):
    """--num-samples counts prompts: cutting a file says how many it held (it printed only "for 32 prompts")."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    assert [row["prompt"] for row in ev.first_rows(path, 4)] == ["p0", "p1", "p2", "p3"]
    assert f"the first 4 of the 10 prompts in {path} (--num-samples counts prompts)" in capsys.readouterr().out
    ev.first_rows(path, 10)
    assert capsys.readouterr().out == ""


def test_a_tiny_negative_prints_as_zero():
    """The SFT's kl to itself, a tiny negative estimate, printed as -0.000."""
    assert ev.format_value({"kl": -0.0001}, "kl") == "0.000"
    assert ev.format_value({"kl": -0.0001, "kl_se": 0.0002}, "kl") == "0.000 ± 0.000"
    assert ev.format_value({"kl": -0.0123}, "kl") == "-0.012"
