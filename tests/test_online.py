"""train_online.py: iterated RLHF rounds with tiny flags (every stage a subprocess), resumable, every round kept, a
rerun's changed argument refused; --overwrite; the labelers: people's labels.jsonl (a bad line is one error naming it),
the task's simulated human, a judge of yours."""

import dataclasses
import json
import os
import random
import sys

import pytest
import torch

import checkpoints
import cli
import train_online

TINY_PPO = (
    "--max-steps 2 --rollout-batch-size 8 --num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 "
    "--max-new-tokens 8 --critic-warmup-steps 1 --warmup-steps 1"
)
TINY_RM = "--max-steps 2 --batch-size 8 --micro-batch-size 4 --eval-every 2 --eval-pairs 8 --probe-size 4 "
TINY_RM += "--calib-size 16"
TINY_EVAL = "--num-samples 8 --max-new-tokens 8"


@pytest.fixture(scope="module")
def ending_sft(tmp_path_factory, tiny_ckpts) -> str:
    """The tiny random SFT with its EOS logit raised: about half of its 8-token responses end, so some pairs keep."""
    ckpt = torch.load(tiny_ckpts[0], weights_only=False)
    state = dict(ckpt["model"])
    eos = ckpt["tokenizer"]["eos_id"]
    direction = state["transformer.wte.weight"][eos]
    state["transformer.ln_f.bias"] = state["transformer.ln_f.bias"] + 4.0 * direction / direction.norm() ** 2
    path = str(tmp_path_factory.mktemp("ending") / "sft.pt")
    checkpoints.save_checkpoint(ckpt | {"model": state}, path)
    return path


def label(folder: str, a_wins) -> list:
    """People's labels for a round: labels.jsonl, the exported pairs with "a_wins" (a_wins(i) for the i-th) added."""
    exported = [json.loads(line) for line in open(os.path.join(folder, "to_label.jsonl"))]
    with open(os.path.join(folder, "labels.jsonl"), "w") as f:
        f.writelines(json.dumps(row | {"a_wins": a_wins(i)}) + "\n" for i, row in enumerate(exported))
    return exported


def test_rounds_keep_everything_resume_and_take_human_labels(tmp_path, task_dir, tiny_ckpts, ending_sft):
    """Round 0 (the SFT policy), then rounds labelled by people: each stops at to_label.jsonl and continues once
    labels.jsonl (each line with "a_wins") is there; a rerun may raise --rounds but not change another argument. Each
    round keeps its PPO policy, pairs (kept + dropped = sampled), reward model and evaluation; results.json has a row
    per round whose labels count the offline pairs plus every earlier round's, whose new_labels are the round's own
    and whose episodes add up; a run with every step done changes nothing."""
    out = str(tmp_path / "online")
    args = train_online.Args(
        out_dir=out,
        sft_ckpt=ending_sft,
        rm_ckpt=[tiny_ckpts[1]],
        task_dir=task_dir,
        rounds=1,
        pairs_per_round=24,
        max_new_tokens=8,
        labeler="human",
        rl_flags=TINY_PPO,
        rm_flags=TINY_RM,
        eval_flags=TINY_EVAL,
    )
    train_online.main(args)  # round 0, round 1's PPO and pairs: it waits for the labels
    round1, round2 = (os.path.join(out, f"round{r}") for r in (1, 2))
    assert not os.path.exists(os.path.join(round1, "pairs.jsonl"))
    exported1 = label(round1, lambda i: i % 2 == 0)
    train_online.main(args)
    with pytest.raises(train_online.UserError, match=r"--pairs-per-round 24 -> 12: this run was started otherwise"):
        train_online.main(train_online.Args(**{**args.__dict__, "rounds": 2, "pairs_per_round": 12}))
    more = train_online.Args(**{**args.__dict__, "rounds": 2})
    train_online.main(more)
    assert not os.path.exists(os.path.join(round2, "pairs.jsonl"))
    assert "round2" not in json.load(open(os.path.join(out, "results.json")))
    exported2 = label(round2, lambda i: False)
    train_online.main(more)
    pairs = [json.loads(line) for line in open(os.path.join(round1, "pairs.jsonl"))]
    want = [row["response_a"] if i % 2 == 0 else row["response_b"] for i, row in enumerate(exported1)]
    assert [pair["chosen"] for pair in pairs] == want
    pairs = [json.loads(line) for line in open(os.path.join(round2, "pairs.jsonl"))]
    assert [pair["chosen"] for pair in pairs] == [row["response_b"] for row in exported2]
    results = json.load(open(os.path.join(out, "results.json")))
    assert list(results) == ["round0", "round1", "round2"]
    kept = {}
    for r in (1, 2):
        folder = os.path.join(out, f"round{r}")
        for name in ("ppo/ckpt.pt", "rm1/ckpt.pt", "eval.json", "to_label.jsonl", "pairs_all.jsonl"):
            assert os.path.exists(os.path.join(folder, name)), (r, name)
        stats = json.load(open(os.path.join(folder, "pairs_stats.json")))
        assert stats["kept"] + sum(stats["dropped"].values()) == stats["sampled"] == 24
        kept[r] = stats["kept"]
        assert results[f"round{r}"]["episodes"] == 2 * 8 * r and results[f"round{r}"]["new_labels"] == kept[r]
        assert set(results[f"round{r}"]) >= {"gold", "gold_se", "kl", "kl_se", "valid_frac", "valid_frac_se"}
    assert kept[1] + kept[2] > 0 and results["round1"]["labels"] == results["round0"]["labels"]
    assert results["round2"]["labels"] == results["round0"]["labels"] + kept[1]
    assert results["round2"]["labels"] + results["round2"]["new_labels"] == results["round0"]["labels"] + sum(
        kept.values()
    )
    before = {name: os.path.getmtime(os.path.join(round2, name)) for name in ("eval.json", "pairs.jsonl")}
    train_online.main(more)  # resumes: nothing left to do
    assert before == {name: os.path.getmtime(os.path.join(round2, name)) for name in before}
    with pytest.raises(train_online.UserError, match="--rounds"):
        train_online.main(train_online.Args(**{**args.__dict__, "rounds": 0}))


def test_the_task_labeler_is_the_simulated_human(tmp_path):
    """--labeler task draws each label from the task's Bradley-Terry annotator on the gold reward, seeded: a
    wonderful review against an ungrammatical one is chosen all but always, the same labels from the same seed."""
    good = " the music was very wonderful. i loved the ending."
    rows = [{"prompt": "Review of The Silent River (music, ending):", "response_a": good, "response_b": " music"}] * 50
    rows = [
        row if i % 2 else {**row, "response_a": row["response_b"], "response_b": good} for i, row in enumerate(rows)
    ]
    args = train_online.Args(labeler="task")
    labelled = train_online.label_pairs(rows, args, str(tmp_path / "labels.jsonl"), seed=0)
    assert sum(pair["chosen"] == good for pair in labelled) >= 45
    assert all({pair["chosen"], pair["rejected"]} == {good, " music"} for pair in labelled)
    assert train_online.label_pairs(rows, args, str(tmp_path / "labels.jsonl"), seed=0) == labelled


def test_a_judge_of_yours_draws_the_labels(tmp_path):
    """--labeler path.py:fn: each label is drawn from the judge's P(a is better): 1 always a, 0 always b, 0.5 both."""
    (tmp_path / "judge.py").write_text("def prefer(prompt, a, b):\n    return {'a': 1.0, 'b': 0.0}.get(prompt, 0.5)\n")
    label_fn = train_online.load_labeler(f"{tmp_path}/judge.py:prefer")
    rng = random.Random(0)
    assert all(label_fn(rng, "a", "x", "y") for _ in range(50))
    assert not any(label_fn(rng, "b", "x", "y") for _ in range(50))
    assert 10 < sum(label_fn(rng, "?", "x", "y") for _ in range(100)) < 90
    rows = [
        {"prompt": "a", "response_a": "x", "response_b": "y"},
        {"prompt": "b", "response_a": "x", "response_b": "y"},
    ]
    args = train_online.Args(labeler=f"{tmp_path}/judge.py:prefer")
    labelled = train_online.label_pairs(rows, args, str(tmp_path / "labels.jsonl"), seed=0)
    assert [pair["chosen"] for pair in labelled] == ["x", "y"]


# -----------------------------------------------------------------------------
# people's labels and the run's arguments: user mistakes in one line

TO_LABEL = [{"prompt": f"p{i}", "response_a": f" a{i}", "response_b": f" b{i}"} for i in range(3)]


def labelled_lines(*a_wins) -> list:
    return [json.dumps(row | {"a_wins": wins}) for row, wins in zip(TO_LABEL, a_wins)]


def good_but(lineno: int, text: str) -> list:
    """labels.jsonl done right (a, b, a) but for the line at lineno (1-based), which reads text."""
    lines = labelled_lines(True, False, True)
    return lines[: lineno - 1] + [text] + lines[lineno:]


@pytest.mark.parametrize(
    "lines, where, message",
    [
        (good_but(2, "{not json"), 2, "bad JSON"),
        (good_but(2, json.dumps(TO_LABEL[1])), 2, 'needs "a_wins": true or false'),
        (good_but(3, json.dumps(TO_LABEL[2] | {"a_wins": "yes"})), 3, 'needs "a_wins": true or false'),
        (good_but(2, json.dumps(TO_LABEL[1] | {"a_wins": 1})), 2, 'needs "a_wins"'),  # an int is not a label
        (good_but(1, "[true]"), 1, 'needs "a_wins"'),
        (good_but(2, json.dumps(TO_LABEL[2] | {"a_wins": True})), 2, "not the pair on line 2 of to_label.jsonl"),
        (labelled_lines(True, False), None, "2 labelled pairs for 3 in to_label.jsonl: label them all"),
    ],
    ids=["json", "missing", "string", "int", "not_an_object", "moved", "unlabelled"],
)
def test_bad_human_labels_are_one_line_naming_the_file_and_line(tmp_path, lines, where, message):
    """--labeler human reads round<r>/labels.jsonl line by line against to_label.jsonl: bad JSON, a missing or
    non-boolean "a_wins", a pair moved to another line, or pairs left unlabelled are each one UserError naming the
    file and the line (or the counts), never a traceback or a silently misread label."""
    path = tmp_path / "labels.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(train_online.UserError) as error:
        train_online.label_pairs(TO_LABEL, train_online.Args(labeler="human"), str(path), seed=0)
    text = str(error.value)
    prefix = f"{path}:{where}: " if where else f"{path}: "
    assert text.startswith(prefix) and message in text and "\n" not in text, text


def test_good_human_labels_pick_the_chosen_response(tmp_path):
    """The same file done right (a blank line is fine): each pair's chosen response is the one "a_wins" says; before
    labels.jsonl exists the round waits (None)."""
    path = tmp_path / "labels.jsonl"
    args = train_online.Args(labeler="human")
    assert train_online.label_pairs(TO_LABEL, args, str(path), seed=0) is None
    lines = labelled_lines(True, False, True)
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    labelled = train_online.label_pairs(TO_LABEL, args, str(path), seed=0)
    assert [(pair["chosen"], pair["rejected"]) for pair in labelled] == [(" a0", " b0"), (" b1", " a1"), (" a2", " b2")]


def test_a_changed_argument_of_a_kept_run_is_refused_unless_overwrite(tmp_path, monkeypatch):
    """args.json keeps a run's arguments: a rerun that changes one (given on the command line, even at its default
    value) is refused in one line naming it with its saved and new value, more --rounds is allowed, and --overwrite
    starts over (the old rounds removed, the new value saved)."""
    out = str(tmp_path / "online")
    first = train_online.saved_args(train_online.Args(out_dir=out, pairs_per_round=24, rounds=1))
    assert json.load(open(os.path.join(out, "args.json")))["pairs_per_round"] == 24 and first.pairs_per_round == 24
    os.makedirs(os.path.join(out, "round1"))
    again = train_online.saved_args(train_online.Args(out_dir=out, rounds=2))  # the default 6000: not given
    assert (again.pairs_per_round, again.rounds) == (24, 2)
    with pytest.raises(train_online.UserError) as error:
        train_online.saved_args(train_online.Args(out_dir=out, pairs_per_round=12))
    assert "args.json: --pairs-per-round 24 -> 12: this run was started otherwise (--overwrite starts over)" in str(
        error.value
    )
    argv = ["train_online.py", "--out-dir", out, "--pairs-per-round", "6000"]  # given at its default: still a change
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(train_online.UserError, match=r"--pairs-per-round 24 -> 6000: this run was started otherwise"):
        train_online.saved_args(cli.parse(train_online.Args))
    fresh = train_online.saved_args(train_online.Args(out_dir=out, pairs_per_round=12, overwrite=True))
    assert fresh.pairs_per_round == 12 and sorted(os.listdir(out)) == ["args.json"]
    assert json.load(open(os.path.join(out, "args.json")))["pairs_per_round"] == 12


def test_a_folder_resumes_only_what_its_args_json_says(tmp_path):
    """An args.json written by an older train_online.py (no --tilted-frac, --tilt-betas, ...: today's defaults need
    not be what it ran with) is refused in one line naming the flags it lacks; the --rl-flags check runs on the flags
    merged with the saved ones, so a saved --rl-flags holding --kl-coef is refused too, not run beside --rl-betas."""
    out = tmp_path / "old"
    out.mkdir()
    saved = {name: value for name, value in dataclasses.asdict(train_online.Args(out_dir=str(out))).items()}
    for name in ("overwrite", "tilted_frac", "tilt_betas", "tilt_samples", "rl_betas"):
        saved.pop(name)
    (out / "args.json").write_text(json.dumps(saved))
    with pytest.raises(train_online.UserError) as error:
        train_online.main(train_online.Args(out_dir=str(out)))
    message = str(error.value)
    assert (
        "written by an older train_online.py, without --tilted-frac, --tilt-betas, --tilt-samples, --rl-betas"
        in (message)
        and "\n" not in message
    )
    kept = tmp_path / "kept"
    kept.mkdir()
    saved = dataclasses.asdict(train_online.Args(out_dir=str(kept), rl_flags="--kl-coef 0.15"))
    saved.pop("overwrite")
    (kept / "args.json").write_text(json.dumps(saved))
    with pytest.raises(train_online.UserError, match="each round's --kl-coef is --rl-betas"):
        train_online.main(train_online.Args(out_dir=str(kept)))  # --rl-flags not given: the saved one applies


def test_tilted_pairs_follow_the_tilt_and_skip_what_never_ended(tmp_path, tiny_ckpts):
    """The pairs drawn where the limit lives: from eval.py's sample cache, for each prompt and beta two distinct
    responses drawn with weights softmax(score / beta) over the ended ones. At a tiny beta the two best-scored ended
    responses are the pair (a response without EOS never is, however high its score); a prompt with one ended
    response gives no pair and counts as not ended; two equal texts count as identical. A prompt twice in a round
    (training prompts repeat) is two prompts."""
    rm = tiny_ckpts[1]
    prompts = ["p0", "p1", "p0"]
    responses = ["a", "b", "c", "top", "x", "y", "z", "w", "same", "same", "q", "r"]
    ended = [True, True, True, False, True, False, False, False, True, True, False, False]
    scores = [0.1, 0.9, 0.5, 9.0, 0.0, 1.0, 2.0, 3.0, 0.2, 0.3, 0.0, 0.0]
    samples = {
        "prompt": [p for p in prompts for _ in range(4)],
        "response": responses,
        "ended": ended,
        "prompt_index": [i for i in range(3) for _ in range(4)],
        "seed": [0, 1, 2, 3] * 3,
    }
    cache = str(tmp_path / "tilt.pt")
    torch.save({"samples": samples, "rm_scores": {checkpoints.file_sha256(rm): scores}}, cache)
    args = train_online.Args(tilt_betas=[1e-3, 1e-3])
    pairs, dropped = train_online.tilted_pairs(cache, prompts, [rm], args, seed=0)
    assert [(pair["prompt"], {pair["response_a"], pair["response_b"]}) for pair in pairs] == [("p0", {"b", "c"})] * 2
    assert dropped == {"not_ended": 2, "identical": 2}
    weights = torch.softmax(torch.tensor([0.1, 0.9, 0.5]) / 0.5, 0)  # at beta 0.5: b first in about 48% of draws
    args = train_online.Args(tilt_betas=[0.5] * 400)
    pairs, _ = train_online.tilted_pairs(cache, prompts, [rm], args, seed=1)
    first = [pair["response_a"] for pair in pairs if pair["prompt"] == "p0"]
    assert first.count("b") / len(first) == pytest.approx(weights[1].item(), abs=0.08)


def test_with_data_of_your_own_the_held_out_pairs_are_left_out_of_every_round(tmp_path):
    """--data alone: its last 5% are the held-out pairs every round's RMs are evaluated on (written to
    --out-dir/eval_pairs.jsonl and passed as --eval-data), and the rest are the offline pairs they train on (b681921
    let train_rm hold out the last 5% of pairs_all.jsonl instead: the newest on-policy pairs, counted as trained on);
    --eval-data given is used as it is."""
    offline = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(100)]
    args = train_online.Args(out_dir=str(tmp_path), data="mine.jsonl")
    path, train = train_online.held_out_pairs(args, None, offline)
    held_out = [json.loads(line) for line in open(path)]
    assert held_out == offline[95:] and train == offline[:95]
    args = train_online.Args(out_dir=str(tmp_path), data="mine.jsonl", eval_data="theirs.jsonl")
    assert train_online.held_out_pairs(args, None, offline) == ("theirs.jsonl", offline)
