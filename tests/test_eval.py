"""eval.py: metrics on hand-made samples with known answers, KL of a policy against itself, the JSON layout."""

import json
import math

import pytest
import torch

import eval as ev
from data import build_task, load_tokenizer
from model import GPT, GPTConfig, sequence_scores


def test_distinct_2_by_hand():
    assert ev.distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)  # (1,2) twice, (2,3), (2,4)
    assert ev.distinct_n([[5, 5, 5, 5]], 2) == pytest.approx(1 / 3)
    assert ev.distinct_n([[1], []], 2) == 0.0


def test_win_rate_ties_count_half():
    assert ev.win_rate([1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 1.0, 0.5]) == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)


def test_last_token_scores_with_ragged_padding():
    scores = torch.arange(12.0).view(2, 6)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert sequence_scores(scores, mask).tolist() == [3.0, 11.0]


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
    }
    m, gold = ev.policy_metrics(s, True, [0.0, -1.0])
    assert gold[1] == -1.0 and m["valid_frac"] == 0.5 and m["eos_frac"] == 0.5 and m["kl"] == 1.0
    assert m["perplexity"] == pytest.approx(math.exp(4 / 5)) and m["response_len"] == 2.5
    assert m["win_rate_vs_ref"] == pytest.approx((1 + 0.5) / 2) and m["score"] == 1.0
    m, _ = ev.policy_metrics(s, False, None)
    assert m["gold"] is None and m["valid_frac"] is None and m["win_rate_vs_ref"] is None


def test_kl_of_policy_against_itself_is_zero(task_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)).eval()
    args = ev.Args(max_new_tokens=20, batch_size=8)
    prompts = ["Review of The Silent River (music):", "Review of The Iron Tower (plot, ending):"] * 6
    s = ev.sample_policy(model, tok, prompts, args, torch.device("cpu"), ref=model)
    assert max(abs(k) for k in s["kl"]) < 1e-4 and min(s["n"]) >= 1


def test_results_json_layout(tmp_path, task_dir):
    """eval.main writes one entry per policy with exactly the DESIGN §4 keys, merged into an existing file."""
    import common

    torch.manual_seed(0)
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32))
    path = str(tmp_path / "ckpt.pt")
    common.save_checkpoint(
        {
            "kind": "sft",
            "model": model.state_dict(),
            "model_config": model.config.__dict__,
            "tokenizer": tok.state(),
            "seconds": 12.0,
        },
        path,
    )
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"rm": {"accuracy": 0.8}}))
    ev.main(
        ev.Args(
            policy=[path],
            names=["sft"],
            ref=path,
            rm="none",
            num_samples=16,
            task_dir=task_dir,
            json=str(out),
            max_new_tokens=16,
        )
    )
    res = json.loads(out.read_text())
    assert set(res) == {"rm", "sft"}
    assert set(res["sft"]) == {
        "gold",
        "score",
        "kl",
        "response_len",
        "perplexity",
        "eos_frac",
        "valid_frac",
        "distinct_2",
        "win_rate_vs_ref",
        "seconds",
    }
    assert res["sft"]["seconds"] == 12.0 and res["sft"]["win_rate_vs_ref"] == 0.5 and abs(res["sft"]["kl"]) < 1e-4
