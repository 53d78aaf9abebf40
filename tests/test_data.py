"""Tests for data.py and task.py: tokenizers, the reviews task and its gold reward, JSONL validation, batching."""

import base64
import hashlib
import json
import math
import os
import random
import shutil

import pytest
import regex
import torch

import data
import task
from common import UserError

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets")  # vendored GPT-2 ranks
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
PROMPT = "Review of The Silent River (music, ending):"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny built-in task's files: name -> path."""
    return task.build_task(str(tmp_path_factory.mktemp("data")), task_seed=1337, tiny=True)


@pytest.fixture(scope="module")
def tok(files):
    return data.load_tokenizer(files["tokenizer"])


def _roundtrip(tok, texts):
    for text in texts:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == text  # eos and pad dropped
        assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text


# -----------------------------------------------------------------------------
# tokenizers


def test_task_tokenizer(files, tok):
    assert tok.name == "reviews"
    assert tok.pad_id != tok.eos_id and tok.eos_id == tok.vocab_size - 1 and tok.pad_id == tok.vocab_size
    rows = data.read_jsonl(files["sft"], "sft")[:50]
    _roundtrip(tok, [r["prompt"] + r["response"] for r in rows] + ["Hello, wörld! <|endoftext|> 123"])
    assert tok.eos_id not in tok.encode(data.EOT)  # never parsed as a special token
    # state survives JSON and rebuilds the same tokenizer
    tok2 = data.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
    assert tok2.state() == tok.state()
    assert (tok2.eos_id, tok2.pad_id, tok2.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size)
    # no BOS: bos=True changes nothing and the state is what it always was
    assert tok.bos_id is None and tok.encode(PROMPT, bos=True) == tok.encode(PROMPT) and "bos_id" not in tok.state()
    assert tok2.encode(rows[0]["prompt"] + rows[0]["response"]) == tok.encode(rows[0]["prompt"] + rows[0]["response"])
    bad = dict(tok.state(), vocab_size=tok.vocab_size + 1)
    with pytest.raises(UserError, match="changed"):
        data.Tokenizer.from_state(bad)


def test_task_tokenizer_matches_trainer(files, tok):
    # every grammar word is one token, and tiktoken's encoding agrees with the trainer's final segmentation
    ranks = [base64.b64decode(r) for r in tok.state()["ranks"]]
    rank_of = {b: i for i, b in enumerate(ranks)}
    assert len(rank_of) == len(ranks) and ranks[:256] == [bytes([i]) for i in range(256)]
    for w in task.GRAMMAR_WORDS:
        assert tok.encode(w) == [rank_of[w.encode()]], w
    # the task text holds no other pre-tokenized word, and sentences encode word by word
    pat = regex.compile(data.GPT2_PAT)
    words = {w for r in data.read_jsonl(files["pretrain"], "text") for w in pat.findall(r["text"])}
    assert words <= set(task.GRAMMAR_WORDS)
    text = PROMPT + " the music was very wonderful. i loved the ending."
    assert tok.encode(text) == [rank_of[w.encode()] for w in pat.findall(text)]


def test_train_bpe_deterministic():
    counts = {" banana": 5, " band": 3, " bandana": 2, " can": 7}
    a = data.train_bpe(counts, list(counts))
    b = data.train_bpe(dict(reversed(list(counts.items()))), list(reversed(list(counts))))
    assert a == b and len(set(a)) == len(a)
    assert all(w.encode() in a for w in counts)


def test_gpt2_tokenizer(monkeypatch, tmp_path):
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    shutil.copy(os.path.join(ASSETS, "gpt2.tiktoken"), cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tok = data.load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (50256, 50257, 50257)
    assert tok.encode("<|endoftext|>") != [50256]
    assert tok.bos_id is None and tok.encode("Hello", bos=True) == [15496] and "bos_id" not in tok.state()
    _roundtrip(tok, ["Hello world", " the music was very wonderful.", "naïve café ✓"])
    tok2 = data.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
    assert tok2.encode("Hello world") == [15496, 995] and tok2.state() == tok.state()


def _save_hf_tokenizer(path, pad: bool):
    # a tiny byte-level BPE trained offline, saved as a transformers tokenizer folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    specials = ["<eos>", "<pad>"] if pad else ["<eos>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(["hello world", "the world says hello"] * 20, trainer=trainer)
    kw = {"pad_token": "<pad>"} if pad else {}
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", **kw).save_pretrained(str(path))


def test_hf_tokenizer(tmp_path):
    _save_hf_tokenizer(tmp_path / "nopad", pad=False)
    tok = data.load_tokenizer(f"hf:{tmp_path / 'nopad'}")
    assert tok.eos_id == 0 and tok.pad_id == tok.vocab_size and tok.vocab_size > 256
    assert len(tok.encode("hello world")) == 2  # both words were merged into single tokens
    assert tok.eos_id not in tok.encode("hello <eos>")  # special tokens are not parsed from text
    _roundtrip(tok, ["hello world", "the world says hello", "naïve ✓"])
    tok2 = data.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
    assert tok2.encode("hello world") == tok.encode("hello world") and tok2.state() == tok.state()
    # no BOS token: bos=True changes nothing; a Hugging Face tokenizer's state records the decision
    assert tok.bos_id is None and tok.encode("hello world", bos=True) == tok.encode("hello world")
    assert tok.state()["bos_id"] is None
    _save_hf_tokenizer(tmp_path / "pad", pad=True)
    tok = data.load_tokenizer(f"hf:{tmp_path / 'pad'}")
    assert (tok.eos_id, tok.pad_id) == (0, 1) and tok.vocab_size > 256
    with pytest.raises(UserError):
        data.load_tokenizer(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(UserError, match="no such tokenizer"):
        data.load_tokenizer(str(tmp_path / "missing.json"))


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


# -----------------------------------------------------------------------------
# JSONL readers


def _write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    "kind,content,lineno,what",
    [
        ("sft", b'{"prompt": "a", "response": "b"}\n{"prompt": "a", \n', 2, "bad JSON"),
        ("sft", b'{"prompt": "a", "response": "b"}\n\n{"prompt": "a"}\n', 3, "missing field 'response'"),
        ("sft", b'{"prompt": "a", "response": 3}\n', 1, "must be a string"),
        ("text", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', 2, "UTF-8"),
        ("prompts", b'["not", "an", "object"]\n', 1, "JSON object"),
        ("pairs", b'{"prompt": "p", "chosen": "a"}\n', 1, "missing field 'rejected'"),
        ("pairs", b'{"prompt": "p", "responses": ["a", "b", "c"], "ranking": [0, 2, 2]}\n', 1, "permutation"),
        ("pairs", b'{"prompt": "p", "responses": ["a", "b"], "ranking": [0, 1, 2]}\n', 1, "permutation"),
        ("pairs", b'{"prompt": "p", "responses": ["a"], "ranking": [0]}\n', 1, "at least 2"),
        # a prompt holds at least one token: an all-empty batch has nothing to generate from
        ("prompts", b'{"prompt": "a"}\n{"prompt": ""}\n', 2, "field 'prompt' is empty"),
        ("sft", b'{"prompt": "", "response": "b"}\n', 1, "field 'prompt' is empty"),
        ("pairs", b'{"prompt": "", "chosen": "a", "rejected": "b"}\n', 1, "field 'prompt' is empty"),
        ("pairs", b'{"prompt": "", "responses": ["a", "b"], "ranking": [1, 0]}\n', 1, "field 'prompt' is empty"),
    ],
)
def test_read_jsonl_errors(tmp_path, kind, content, lineno, what):
    path = _write(tmp_path / "x.jsonl", content)
    with pytest.raises(UserError) as e:
        data.read_jsonl(path, kind)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{lineno}: ") and what in msg and "\n" not in msg


def test_read_jsonl_empty_missing_and_ok(tmp_path):
    for path, what in [
        (_write(tmp_path / "empty.jsonl", b"\n  \n"), "no records"),
        (str(tmp_path / "missing.jsonl"), "no such file"),
    ]:
        with pytest.raises(UserError) as e:
            data.read_jsonl(path, "sft")
        assert str(e.value) == f"{path}: {what}"
    path = _write(
        tmp_path / "ok.jsonl",
        b'{"prompt": "p", "responses": ["a", "b"], "ranking": [1, 0], "x": 1}\n'
        b'{"prompt": "p", "chosen": "\xc3\xa9", "rejected": "b"}\n',
    )
    rows = data.read_jsonl(path, "pairs")
    assert rows[0]["ranking"] == [1, 0] and rows[1]["chosen"] == "é"


# -----------------------------------------------------------------------------
# batching


def test_pad_left_right():
    seqs = [[1, 2, 3], [4], []]
    ids, mask = data.pad_left(seqs, pad_id=9)
    assert ids.dtype == torch.long and mask.dtype == torch.float32
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids, mask = data.pad_right(seqs, pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9], [9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]


def test_encode_sft(tok):
    rows = [
        {"prompt": PROMPT, "response": " the music was good."},
        {"prompt": PROMPT, "response": " the music was good." * 30},
        {"text": PROMPT + " i loved the ending."},
    ]
    n_prompt = len(tok.encode(PROMPT))
    examples, skipped = data.encode_sft(tok, rows, block_size=32, mask_prompt=True)
    assert skipped == 1 and len(examples) == 2
    ids, mask = examples[0]
    assert ids == tok.encode(PROMPT) + tok.encode(" the music was good.") + [tok.eos_id]
    assert len(mask) == len(ids) and mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    ids, mask = examples[1]  # a text row: everything but the first token is a target
    assert ids[-1] == tok.eos_id and mask == [0] + [1] * (len(ids) - 1)
    examples, _ = data.encode_sft(tok, rows[:1], block_size=32, mask_prompt=False)
    assert examples[0][1] == [0] + [1] * (len(examples[0][0]) - 1)
