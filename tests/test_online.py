"""train_online.py: iterated RLHF rounds with tiny flags (every stage a subprocess), resumable, every round kept."""

import json
import os
import random

import pytest
import torch

import checkpoints
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


def test_rounds_keep_everything_resume_and_take_human_labels(tmp_path, task_dir, tiny_ckpts, ending_sft):
    """Round 0 (the SFT policy), round 1 labelled by the simulated human, then round 2 by people: it stops at
    to_label.jsonl and continues once labels.jsonl (each line with "a_wins") is there. Each round keeps its PPO
    policy, pairs (kept + dropped = sampled), reward model and evaluation; results.json has a row per round whose
    labels count the offline pairs plus every round's and whose episodes add up; a run with every step done changes
    nothing."""
    out = str(tmp_path / "online")
    args = train_online.Args(
        out_dir=out,
        sft_ckpt=ending_sft,
        rm_ckpt=[tiny_ckpts[1]],
        task_dir=task_dir,
        rounds=1,
        pairs_per_round=24,
        max_new_tokens=8,
        ppo_flags=TINY_PPO,
        rm_flags=TINY_RM,
        eval_flags=TINY_EVAL,
    )
    train_online.main(args)
    human = train_online.Args(**{**args.__dict__, "rounds": 2, "labeler": "human"})
    train_online.main(human)
    round2 = os.path.join(out, "round2")
    assert not os.path.exists(os.path.join(round2, "pairs.jsonl"))
    assert "round2" not in json.load(open(os.path.join(out, "results.json")))
    exported = [json.loads(line) for line in open(os.path.join(round2, "to_label.jsonl"))]
    with open(os.path.join(round2, "labels.jsonl"), "w") as f:
        f.writelines(json.dumps(row | {"a_wins": False}) + "\n" for row in exported)
    train_online.main(human)
    pairs = [json.loads(line) for line in open(os.path.join(round2, "pairs.jsonl"))]
    assert [pair["chosen"] for pair in pairs] == [row["response_b"] for row in exported]
    results = json.load(open(os.path.join(out, "results.json")))
    assert list(results) == ["round0", "round1", "round2"]
    kept = 0
    for r in (1, 2):
        folder = os.path.join(out, f"round{r}")
        for name in ("ppo/ckpt.pt", "rm1/ckpt.pt", "eval.json", "to_label.jsonl", "pairs_all.jsonl"):
            assert os.path.exists(os.path.join(folder, name)), (r, name)
        stats = json.load(open(os.path.join(folder, "pairs_stats.json")))
        assert stats["kept"] + sum(stats["dropped"].values()) == stats["sampled"] == 24
        kept += stats["kept"]
        assert results[f"round{r}"]["episodes"] == 2 * 8 * r
        assert set(results[f"round{r}"]) >= {"gold", "gold_se", "kl", "kl_se", "valid_frac", "valid_frac_se"}
    assert kept > 0 and results["round2"]["labels"] == results["round0"]["labels"] + kept
    before = {name: os.path.getmtime(os.path.join(round2, name)) for name in ("eval.json", "pairs.jsonl")}
    train_online.main(human)  # resumes: nothing left to do
    assert before == {name: os.path.getmtime(os.path.join(round2, name)) for name in before}
    with pytest.raises(train_online.UserError, match="--rounds"):
        train_online.main(train_online.Args(**{**args.__dict__, "rounds": 0}))


def test_a_judge_of_yours_draws_the_labels(tmp_path):
    """--labeler path.py:fn: each label is drawn from the judge's P(a is better): 1 always a, 0 always b, 0.5 both."""
    (tmp_path / "judge.py").write_text("def prefer(prompt, a, b):\n    return {'a': 1.0, 'b': 0.0}.get(prompt, 0.5)\n")
    label = train_online.load_labeler(f"{tmp_path}/judge.py:prefer")
    rng = random.Random(0)
    assert all(label(rng, "a", "x", "y") for _ in range(50)) and not any(label(rng, "b", "x", "y") for _ in range(50))
    assert 10 < sum(label(rng, "?", "x", "y") for _ in range(100)) < 90
    rows = [
        {"prompt": "a", "response_a": "x", "response_b": "y"},
        {"prompt": "b", "response_a": "x", "response_b": "y"},
    ]
    args = train_online.Args(labeler=f"{tmp_path}/judge.py:prefer")
    labelled = train_online.label_pairs(rows, args, str(tmp_path / "labels.jsonl"), seed=0)
    assert [pair["chosen"] for pair in labelled] == ["x", "y"]
