"""task.py, the built-in reviews task: its files built deterministically and idempotently, titles held out of the
evaluation prompts, every generated response valid, the gold reward by hand, SFT demonstrations of mean gold near 0,
and pair labels that follow the Bradley-Terry model at the task's temperature."""

import math
import os
import random

import pytest

import data
import task

PROMPT = "Review of The Silent River (music, ending):"


@pytest.fixture(scope="module")
def files(tiny_task):
    """The tiny built-in task's files: name -> path."""
    return tiny_task


# -----------------------------------------------------------------------------
# the task files


def _read_all(paths):
    return {k: open(p, "rb").read() for k, p in sorted(paths.items())}


def test_build_task_deterministic_and_idempotent(tmp_path, files):
    assert set(files) == set(task.TASK_FILES) | {"tokenizer"}
    a = task.build_task(str(tmp_path / "a"), task_seed=1337, tiny=True)
    assert _read_all(a) == _read_all(files)
    mtimes = {k: os.stat(p).st_mtime_ns for k, p in a.items()}
    assert task.build_task(str(tmp_path / "a"), task_seed=1337, tiny=True) == a
    assert {k: os.stat(p).st_mtime_ns for k, p in a.items()} == mtimes
    other = _read_all(task.build_task(str(tmp_path / "a"), task_seed=7, tiny=True))
    first = _read_all(a)
    assert all(other[k] != first[k] for k in task.TASK_FILES)
    assert not [f for f in os.listdir(os.path.dirname(a["sft"])) if ".tmp" in f]
    # a lost file is rebuilt identically
    os.remove(a["pairs"])
    task.build_task(str(tmp_path / "a"), task_seed=1337, tiny=True)
    assert _read_all(a) == first
    for name in task.TASK_FILES:
        assert len(first[name].splitlines()) == task.TINY_SIZES[name]


def test_eval_titles_held_out(files):
    train_titles, eval_titles = task.split_titles(1337)
    assert len(eval_titles) == round(0.15 * 256) and not set(train_titles) & set(eval_titles)

    def title_of(text: str) -> str:
        return " ".join(text.split(" ")[2:5])

    for r in data.read_jsonl(files["eval_prompts"], "prompts"):
        assert title_of(r["prompt"]) in eval_titles
    for name, kind, key in [
        ("prompts", "prompts", "prompt"),
        ("sft", "sft", "prompt"),
        ("pairs", "pairs", "prompt"),
        ("pretrain", "text", "text"),
        ("sft_eval", "sft", "prompt"),
    ]:
        assert all(title_of(r[key]) in train_titles for r in data.read_jsonl(files[name], kind))


def test_generated_responses_valid(files):
    sft = data.read_jsonl(files["sft"], "sft") + data.read_jsonl(files["sft_eval"], "sft")
    pairs = data.read_jsonl(files["pairs"], "pairs") + data.read_jsonl(files["pairs_eval"], "pairs")
    cases = [(r["prompt"], r["response"]) for r in sft]
    cases += [(r["prompt"], r[k]) for r in pairs for k in ("chosen", "rejected")]
    for prompt, response in cases:
        assert task.is_valid(response, True), response
        assert -1 <= task.gold_reward(prompt, response, True) <= 1
    assert all(r["chosen"] != r["rejected"] for r in pairs)


# -----------------------------------------------------------------------------
# gold reward


def test_gold_hand_made():
    good = " the music was very wonderful. i loved the ending. the music was truly brilliant. overall it was superb."
    assert task.is_valid(good, True) and task.gold_reward(PROMPT, good, True) > 0.9
    assert not task.is_valid(good, False) and task.gold_reward(PROMPT, good, False) == -1.0
    invalid = [
        " the music was very wonderful. the music was very wonderful.",  # repeated sentence
        " the music was good. the ending was good. i loved the music. i loved the ending. overall it was good.",  # 5
        " the music was wonderful wonderful.",  # broken grammar
        " the music was very wonderful. i loved the ending",  # no final period
        "the music was good.",  # no leading space
        " the music was good.  i loved the ending.",  # double space
        " the music was very good but the ending was awful.",  # S3 takes no intensifier
        " overall it was good. the music was good.",  # S4 not last
        "",
    ]
    # S3 takes any two adjectives and aspects (the demonstrations contrast them, the validator does not insist)
    assert task.is_valid(" the music was good but the ending was nice.", True)
    assert task.is_valid(" the music was good but the music was awful.", True)
    for response in invalid:
        assert not task.is_valid(response, True), response
        assert task.gold_reward(PROMPT, response, True) == -1.0, response
    # hand-computed values; mentions of aspects not requested count 0
    assert task.gold_reward(PROMPT, " the music was very wonderful.", True) == pytest.approx(math.tanh(1.5) / 2)
    assert task.gold_reward(PROMPT, " the plot was very wonderful. i loved the acting.", True) == 0.0
    s3 = " the music was awful but the plot was good. overall it was slightly good."
    want = (math.tanh(-1 + 0.5 * 0.25) + math.tanh(0.5 * 0.25)) / 2
    assert task.gold_reward(PROMPT, s3, True) == pytest.approx(want)
    assert task.prompt_aspects(PROMPT) == ["music", "ending"]
    # more positive requested sentences score higher, with diminishing returns
    g = [
        task.gold_reward("Review of The Iron Tower (plot):", r, True)
        for r in [
            " the plot was good.",
            " the plot was good. i liked the plot.",
            " the plot was good. i liked the plot. the plot was nice.",
        ]
    ]
    assert g[0] < g[1] < g[2] and g[2] - g[1] < g[1] - g[0]


def test_off_aspect_praise_by_hand():
    """A positive clause about an aspect the prompt did not name, in any sentence of S1-S3 (either half of S3),
    valid or not; negative clauses, requested aspects and "overall" never count."""
    praising = [
        " the plot was good.",  # S1, plot not requested
        " i loved the music. i liked the acting.",  # S2 in the second sentence
        " the music was awful but the plot was nice.",  # S3's second half
        " the plot was good. the plot was good.",  # repeated: invalid, still praise
    ]
    neutral = [
        " the music was very wonderful. i loved the ending.",  # requested aspects only
        " the plot was awful. i hated the acting.",  # off-aspect but negative
        " overall it was superb.",  # names no aspect
        " the music was good but the plot was dull.",  # the off-aspect half is negative
        "",
    ]
    for response in praising:
        assert task.off_aspect_praise(PROMPT, response), response
    for response in neutral:
        assert not task.off_aspect_praise(PROMPT, response), response


def test_sft_mean_gold():
    rng, (titles, _) = random.Random(0), task.split_titles(1337)
    golds = []
    for _ in range(2000):
        prompt = task.sample_prompt(rng, titles)
        golds.append(task.gold_reward(prompt, task.sample_response(rng, prompt), True))
    assert -0.2 <= sum(golds) / len(golds) <= 0.2


def test_pair_labels_follow_bradley_terry():
    rng, (titles, _) = random.Random(1), task.split_titles(1337)
    agree, expected, var = 0, 0.0, 0.0
    n = 0
    while n < 2500:
        prompt = task.sample_prompt(rng, titles)
        pair = task.sample_pair(rng, prompt)
        gc, gr = (task.gold_reward(prompt, pair[k], True) for k in ("chosen", "rejected"))
        if gc == gr:
            continue  # a tie carries no label information
        p = 1 / (1 + math.exp(-abs(gc - gr) / task.BT_TEMPERATURE))  # P(label agrees with gold)
        agree += gc > gr
        expected += p
        var += p * (1 - p)
        n += 1
    assert abs(agree - expected) < 4 * math.sqrt(var), (agree / n, expected / n)
    assert 0.6 < agree / n < 0.95  # labels are informative but noisy
