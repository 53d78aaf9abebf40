"""The arith task (arith.py): the verifier, the reward, the mistakes in the demonstrations, the held-out split, the
files and the tokenizer; pass@k (eval.py) against counting subsets; --task on resume and on a policy."""

import itertools
import json
import math
import random

import pytest

import arith
import checkpoints
import eval as ev
from common import UserError
from data import TASKS
from tokenizer import load_tokenizer


def test_verifier_gold_reward_and_validity_by_hand():
    assert arith.verify("48+37=", "85") and not arith.verify("48+37=", "75")
    assert not arith.verify("48+37=", "085") and not arith.verify("48+37=", "85 ")  # written as demonstrated
    assert arith.verify("0+0=", "0")
    assert arith.gold_reward("48+37=", "85", True) == 1.0
    assert arith.gold_reward("48+37=", "85", False) == 0.0  # no EOS: not an answer
    assert arith.gold_reward("48+37=", "75", True) == 0.0
    assert arith.reward("48+37=", "85", True) == 1.0
    assert arith.reward("48+37=", "75", True) == 0.0
    assert arith.reward("48+37=", "8x", True) == -1.0  # does not parse
    assert arith.reward("48+37=", "85", False) == -1.0  # no end
    assert arith.is_valid("85", True) and not arith.is_valid("85", False) and not arith.is_valid("07", True)
    assert arith.is_task_prompt("48+37=") and not arith.is_task_prompt("Review of The Silent River (music):")


def test_without_carries_against_digit_by_digit():
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(1000), rng.randrange(1000)
        width = max(len(str(a)), len(str(b)))
        digits = [(int(x) + int(y)) % 10 for x, y in zip(str(a).zfill(width), str(b).zfill(width))]
        assert arith.without_carries(a, b) == int("".join(map(str, digits)))
    assert arith.without_carries(58, 27) == 75 and arith.without_carries(12, 34) == 46


def test_a_wrong_answer_is_never_right_and_parses():
    rng = random.Random(1)
    for _ in range(2000):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = arith.wrong_answer(rng, a, b)
        assert wrong != a + b and wrong >= 0
        assert arith.is_valid(str(wrong), True)


def test_task_files_split_and_the_share_of_wrong_demonstrations(tmp_path):
    paths = TASKS["arith"].build_task(str(tmp_path), 1337, tiny=True)
    read = {name: [json.loads(line) for line in open(paths[name])] for name in arith.TASK_FILES}
    held = [row["prompt"] for row in read["eval_prompts"]]
    assert len(held) == len(set(held)) == arith.TINY_SIZES["eval_prompts"]
    assert all(arith.is_held_out(prompt, 1337) for prompt in held)
    for name in ("pretrain", "sft", "sft_eval", "pairs", "prompts"):
        prompts = [row["text"].split("=")[0] + "=" if name == "pretrain" else row["prompt"] for row in read[name]]
        assert not any(arith.is_held_out(prompt, 1337) for prompt in prompts), name
    wrong = sum(not arith.verify(row["prompt"], row["response"]) for row in read["sft"])
    n = len(read["sft"])
    assert abs(wrong / n - arith.WRONG_FRAC) < 4 * math.sqrt(arith.WRONG_FRAC * (1 - arith.WRONG_FRAC) / n)
    assert all(
        arith.verify(r["prompt"], r["chosen"]) and not arith.verify(r["prompt"], r["rejected"]) for r in read["pairs"]
    )
    tok = load_tokenizer(paths["tokenizer"])
    assert [tok.decode([i]) for i in tok.encode("907+38=")] == list("907+38=")  # one token a character
    assert TASKS["arith"].build_task(str(tmp_path), 1337, tiny=True) == paths  # cached


@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_pass_at_k_counts_the_subsets_with_a_right_answer(n):
    """The unbiased estimator is the share of the k-subsets of the n samples that hold a right one."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(subset) for subset in subsets) / len(subsets)
            assert ev.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
            assert ev.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert ev.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-9)


@pytest.mark.parametrize("n, c, k", [(4, 0, 5), (4, 4, 5), (4, 1, 0), (4, 5, 2)])
def test_pass_at_k_refuses_what_it_cannot_count(n, c, k):
    """k > n has no k-subset of the samples (it was 1.0 whatever c), k < 1 none either, and c lies in 0..n."""
    with pytest.raises(ValueError, match=f"pass@{k} of {c} right among {n} samples"):
        ev.pass_at_k(n, c, k)


def test_pass_at_metrics_over_problems_with_its_standard_error():
    """Two problems, 4 seeds each (a fifth seed past n is left out): right 1 of 4 and 4 of 4."""
    prompts, responses, seeds, index = [], [], [], []
    for problem, (prompt, answers) in enumerate([("2+2=", ["4", "5", "3", "7", "4"]), ("1+1=", ["2"] * 5)]):
        for seed, answer in enumerate(answers):
            prompts.append(prompt)
            responses.append(answer)
            seeds.append(10 + seed)
            index.append(problem)
    samples = {"prompt": prompts, "response": responses, "ended": [True] * 10, "seed": seeds, "prompt_index": index}
    metrics = ev.pass_at_metrics(samples, arith, [1, 2], n=4, first_seed=10)
    pass1 = [1 / 4, 1.0]
    pass2 = [1 - math.comb(3, 2) / math.comb(4, 2), 1.0]
    assert metrics["pass@1"] == pytest.approx(sum(pass1) / 2)
    assert metrics["pass@2"] == pytest.approx(sum(pass2) / 2)
    assert metrics["pass@1_se"] == pytest.approx(abs(pass1[1] - pass1[0]) / 2)  # std(ddof=1)/sqrt(2) of two values


def test_pass_at_flags_are_checked():
    with pytest.raises(UserError, match="--pass-samples 8: pass@16 needs at least that many samples"):
        ev.check_args(ev.Args(pass_at=[1, 16], pass_samples=8))
    with pytest.raises(UserError, match="--pass-at 0"):
        ev.check_args(ev.Args(pass_at=[0]))
    with pytest.raises(UserError, match="--pass-at counts right answers: the reviews task has no verifier"):
        ev.check_args(ev.Args(pass_at=[1, 4], pass_samples=8))  # it printed pass@1 = pass@4 = 0.000
    ev.check_args(ev.Args(pass_at=[1, 4], pass_samples=8, task="arith"))
    ev.check_args(ev.Args(pass_at=[1, 4], pass_samples=8, reward_fn="verifier.py:reward"))  # a verifier of one's own


def test_pass_at_k_counts_a_reward_fn_of_one_as_right_off_the_built_in_task():
    """With no built-in task (prompts of one's own), a right answer is a --reward-fn value of 1.0: problem 0 has 1 of
    4 right, problem 1 has 3 of 4 (0.5 and -1 are not right)."""
    rewards = [1.0, 0.0, 0.5, -1.0, 1.0, 1.0, 0.0, 1.0]
    samples = {"reward_fn": rewards, "seed": [0, 1, 2, 3] * 2, "prompt_index": [0] * 4 + [1] * 4}
    metrics = ev.pass_at_metrics(samples, None, [1, 2], n=4, first_seed=0)
    assert metrics["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert metrics["pass@2"] == pytest.approx((1 - math.comb(3, 2) / math.comb(4, 2) + 1.0) / 2)


def test_resume_refuses_another_task(tmp_path):
    """The checkpoint records --task: a resume takes it where no flag says otherwise, and refuses another in one
    line."""
    import train_sft

    out = tmp_path / "sft"
    saved = train_sft.Args(out_dir=str(out), task="reviews", lr=1e-3)
    checkpoints.save_checkpoint({"kind": "sft", "model": {}, "args": vars(saved), "step": 2}, str(out / "ckpt.pt"))
    assert checkpoints.resume_args(train_sft.Args(out_dir=str(out), resume=True), "sft").task == "reviews"
    with pytest.raises(UserError, match="--task reviews -> arith: these change what the run computes"):
        checkpoints.resume_args(train_sft.Args(out_dir=str(out), resume=True, task="arith"), "sft")


def test_a_later_stage_takes_the_task_from_its_input_checkpoint(tmp_path):
    """An SFT checkpoint of --task arith: PPO, GRPO, RM, DPO and eval take arith from it without --task (every later
    stage had to repeat it), a given --task arith agrees, and a given --task reviews is refused in one line."""
    import train_ppo

    path = str(tmp_path / "ckpt.pt")
    checkpoints.save_checkpoint({"kind": "sft", "model": {}, "args": {"task": "arith"}, "step": 2}, path)
    assert checkpoints.task_from_checkpoint(train_ppo.Args(sft_ckpt=path), path, "--sft-ckpt").task == "arith"
    given = train_ppo.Args(sft_ckpt=path, task="arith")
    given.given = frozenset({"task"})
    assert checkpoints.task_from_checkpoint(given, path, "--sft-ckpt").given == {"task"}
    other = train_ppo.Args(sft_ckpt=path, task="reviews")
    other.given = frozenset({"task"})
    with pytest.raises(UserError, match=f"--task reviews: --sft-ckpt {path} was trained on --task arith"):
        checkpoints.task_from_checkpoint(other, path, "--sft-ckpt")
    assert checkpoints.task_from_checkpoint(train_ppo.Args(), "hf:some/model", "--sft-ckpt").task == "reviews"


def test_ptx_is_off_on_arith_unless_given(tmp_path, task_dir, task_tok):
    """arith's demonstrations are half wrong: its own text is no ptx text (a run took an LM loss on its 20000 texts
    by default); --ptx-data still gives one. The reviews task keeps its own text. The start-up line says which."""
    import data
    import rollout
    import train_grpo

    tok = load_tokenizer(TASKS["arith"].build_task(str(tmp_path), 1337)["tokenizer"])
    args = train_grpo.Args(task="arith", task_dir=str(tmp_path), max_new_tokens=8)
    loaded = data.load_prompts(args, tok, block_size=64)
    assert loaded.ptx == [] and loaded.ptx_path is None
    assert (
        rollout.ptx_rule(args, loaded)
        == "off: no --ptx-data on the arith task, whose demonstrations are wrong on purpose"
    )
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "1+1=2"}) + "\n")
    args = train_grpo.Args(task="arith", task_dir=str(tmp_path), max_new_tokens=8, ptx_data=str(text))
    loaded = data.load_prompts(args, tok, block_size=64)
    assert len(loaded.ptx) == 1 and rollout.ptx_rule(args, loaded).startswith(
        f"on: --ptx-coef 0.1 x the LM loss on 1 texts of {text}"
    )
    args = train_grpo.Args(task_dir=task_dir, max_new_tokens=8)
    loaded = data.load_prompts(args, task_tok, block_size=64)
    assert loaded.ptx_path == TASKS["reviews"].build_task(task_dir, 1337)["pretrain"] and len(loaded.ptx) > 0
    assert rollout.ptx_rule(args, loaded).startswith(f"on: --ptx-coef 0.1 x the LM loss on {len(loaded.ptx)} texts")


@pytest.mark.slow
def test_rlvr_chain_with_tiny_sizes(tmp_path):
    """make rlvr's chain (experiments/rlvr.py --tiny): SFT on arith, GRPO, DAPO, GSPO, CISPO, DPPO (TV and KL), RLOO and
    PPO-max on the verifier's reward, pass@k of all nine; results.json has a row each with pass@k, its se, kl and
    response_len, and DAPO's zero_std_frac; each RL run stops on its episode budget (DAPO's extra rounds counted)."""
    import sys

    from conftest import run

    out = tmp_path / "out"
    r = run(
        f"{sys.executable} experiments/rlvr.py --tiny --out-dir {out} --task-dir {tmp_path / 'data'} --problems 8 "
        "--pass-samples 4",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.load(open(out / "results.json"))
    assert set(results) == {"sft", "grpo", "dapo", "gspo", "cispo", "dppo_tv", "dppo_kl", "rloo", "ppo"}
    for row in results.values():
        assert {"pass@1", "pass@1_se", "pass@4", "pass@4_se", "kl", "response_len"} <= set(row)
        assert 0 <= row["pass@1"] <= row["pass@4"] <= 1
    assert results["dapo"]["zero_std_frac"] is not None and results["grpo"]["zero_std_frac"] is None
    assert all(results[name]["episodes"] >= 32 for name in set(results) - {"sft"})
    assert "best RL policy by pass@1" in r.stdout
