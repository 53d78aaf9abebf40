"""data.py: tokenizers (the task's BPE, GPT-2's, a Hugging Face one), the task's BPE exported for transformers, JSONL
validation (TRL's prompt-completion and implicit-prompt layouts too), batching and encoding; the Anthropic-HH and
UltraFeedback converters; conversational data (docs/design.md §3): chat-template rendering, every assistant turn learned
(as the whole conversation renders it, earlier <think> reasoning stripped), the end-of-turn token as the stop and score
token, HH's layout without a template, and every stage on messages data with a tiny Hugging Face Llama whose tokenizer
has a chat template. (task.py: test_task.py.)"""

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import regex
import torch
from conftest import ROOT, write_jsonl

import common
import data
import eval as ev
import task
import tokenizer
import train_dpo
import train_ppo
import train_rm
import train_sft
from common import UserError

ASSETS = os.path.join(ROOT, "assets")  # vendored GPT-2 ranks
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
PROMPT = "Review of The Silent River (music, ending):"


@pytest.fixture(scope="module")
def files(tiny_task):
    """The tiny built-in task's files: name -> path."""
    return tiny_task


@pytest.fixture(scope="module")
def tok(files):
    return tokenizer.load_tokenizer(files["tokenizer"])


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
    assert tok.eos_id not in tok.encode(tokenizer.EOT)  # never parsed as a special token
    # state survives JSON and rebuilds the same tokenizer
    tok2 = tokenizer.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
    assert tok2.state() == tok.state()
    assert (tok2.eos_id, tok2.pad_id, tok2.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size)
    # no BOS: bos=True changes nothing and the state is what it always was
    assert tok.bos_id is None and tok.encode(PROMPT, bos=True) == tok.encode(PROMPT) and "bos_id" not in tok.state()
    assert tok2.encode(rows[0]["prompt"] + rows[0]["response"]) == tok.encode(rows[0]["prompt"] + rows[0]["response"])
    bad = dict(tok.state(), vocab_size=tok.vocab_size + 1)
    with pytest.raises(UserError, match="changed"):
        tokenizer.Tokenizer.from_state(bad)


def test_task_tokenizer_matches_trainer(files, tok):
    # every grammar word is one token, and tiktoken's encoding agrees with the trainer's final segmentation
    ranks = [base64.b64decode(r) for r in tok.state()["ranks"]]
    rank_of = {b: i for i, b in enumerate(ranks)}
    assert len(rank_of) == len(ranks) and ranks[:256] == [bytes([i]) for i in range(256)]
    for w in task.GRAMMAR_WORDS:
        assert tok.encode(w) == [rank_of[w.encode()]], w
    # the task text holds no other pre-tokenized word, and sentences encode word by word
    pat = regex.compile(tokenizer.GPT2_PAT)
    words = {w for r in data.read_jsonl(files["pretrain"], "text") for w in pat.findall(r["text"])}
    assert words <= set(task.GRAMMAR_WORDS)
    text = PROMPT + " the music was very wonderful. i loved the ending."
    assert tok.encode(text) == [rank_of[w.encode()] for w in pat.findall(text)]


def test_the_task_tokenizer_exports_as_a_hugging_face_tokenizer(tmp_path, files, tok):
    """--export-hf writes the built-in task's BPE (tiktoken ranks, GPT-2's split pattern) as GPT-2's vocab.json and
    merges.txt: transformers' AutoTokenizer loads the folder, encodes the task's prompts and full reviews to the very
    ids of the task's own tokenizer, decodes them back to the text, and has the same EOS and vocabulary size, so an
    exported policy is usable with its tokenizer outside this repo."""
    from transformers import AutoTokenizer

    assert "written as GPT-2's byte-level BPE files" in tokenizer.export_tokenizer(tok, str(tmp_path))
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    prompts = [row["prompt"] for row in data.read_jsonl(files["eval_prompts"], "prompts")[:16]]
    reviews = [row["prompt"] + row["response"] for row in data.read_jsonl(files["sft"], "sft")[:16]]
    texts = prompts + reviews + ["Hello, wörld! 123  spaces\n\nand lines ✓"]
    for text in texts:
        ids = tok.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf_tok.decode(ids) == text == tok.decode(ids)
    assert hf_tok.eos_token_id == tok.eos_id and len(hf_tok) == tok.vocab_size
    assert hf_tok.decode(tok.encode(prompts[0]) + [tok.eos_id]) == prompts[0] + tokenizer.EOT


def test_an_exported_task_tokenizer_is_the_task_tokenizer_to_the_rl_stages(tmp_path, task_dir, task_tok):
    """A policy exported with --export-hf and loaded back with --init hf:DIR has the task's tokenizer saved another
    way: load_prompts takes it (it compared saved state and refused it); another task's tokenizer is still refused."""
    tokenizer.export_tokenizer(task_tok, str(tmp_path / "hf"))
    hf_tok = tokenizer.load_tokenizer(f"hf:{tmp_path / 'hf'}")
    args = train_ppo.Args(task_dir=task_dir, max_new_tokens=8, ptx_coef=0.0)
    assert len(data.load_prompts(args, hf_tok, block_size=64).prompts) > 0
    arith = data.TASKS["arith"].build_task(str(tmp_path / "arith"), 1337, tiny=True)  # its tokenizer is the full one's
    arith_tok = tokenizer.load_tokenizer(arith["tokenizer"])
    with pytest.raises(common.UserError, match="not the built-in reviews task's"):
        data.load_prompts(args, arith_tok, block_size=64)


def test_train_bpe_deterministic():
    counts = {" banana": 5, " band": 3, " bandana": 2, " can": 7}
    a = tokenizer.train_bpe(counts, list(counts))
    b = tokenizer.train_bpe(dict(reversed(list(counts.items()))), list(reversed(list(counts))))
    assert a == b and len(set(a)) == len(a)
    assert all(w.encode() in a for w in counts)


def test_gpt2_tokenizer(monkeypatch, tmp_path):
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    shutil.copy(os.path.join(ASSETS, "gpt2.tiktoken"), cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tok = tokenizer.load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (50256, 50257, 50257)
    assert tok.encode("<|endoftext|>") != [50256]
    assert tok.bos_id is None and tok.encode("Hello", bos=True) == [15496] and "bos_id" not in tok.state()
    _roundtrip(tok, ["Hello world", " the music was very wonderful.", "naïve café ✓"])
    tok2 = tokenizer.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
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
    tok = tokenizer.load_tokenizer(f"hf:{tmp_path / 'nopad'}")
    assert tok.eos_id == 0 and tok.pad_id == tok.vocab_size and tok.vocab_size > 256
    assert len(tok.encode("hello world")) == 2  # both words were merged into single tokens
    assert tok.eos_id not in tok.encode("hello <eos>")  # special tokens are not parsed from text
    _roundtrip(tok, ["hello world", "the world says hello", "naïve ✓"])
    tok2 = tokenizer.Tokenizer.from_state(json.loads(json.dumps(tok.state())))
    assert tok2.encode("hello world") == tok.encode("hello world") and tok2.state() == tok.state()
    # no BOS token: bos=True changes nothing; a Hugging Face tokenizer's state records the decision
    assert tok.bos_id is None and tok.encode("hello world", bos=True) == tok.encode("hello world")
    assert tok.state()["bos_id"] is None
    _save_hf_tokenizer(tmp_path / "pad", pad=True)
    tok = tokenizer.load_tokenizer(f"hf:{tmp_path / 'pad'}")
    assert (tok.eos_id, tok.pad_id) == (0, 1) and tok.vocab_size > 256
    with pytest.raises(UserError):
        tokenizer.load_tokenizer(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(UserError, match="no such tokenizer"):
        tokenizer.load_tokenizer(str(tmp_path / "missing.json"))


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
        # a record names one thing once: which of two values would be meant is the reader's guess
        ("sft", b'{"prompt": "a", "response": "b", "completion": "c"}\n', 1, "'response' and 'completion'"),
        ("sft", b'{"messages": [{"role": "user", "content": "a"}], "prompt": "a", "response": "b"}\n', 1, "'messages'"),
        ("sft", b'{"prompt": "a", "response": "b", "response": "c"}\n', 1, "the key 'response' appears twice"),
        (
            "pairs",
            b'{"prompt": "p", "chosen": "a", "rejected": "b", "responses": ["a", "b"], "ranking": [0, 1]}\n',
            1,
            "a ranking or a pair",
        ),
        # TRL's unpaired KTO layout: SFT would learn the undesirable completions too
        ("sft", b'{"prompt": "a", "completion": "b", "label": false}\n', 1, "field 'label'"),
        ("prompts", b'{"prompt": null}\n', 1, "must be a string or a list of messages, got NoneType"),
    ],
)
def test_read_jsonl_errors(tmp_path, kind, content, lineno, what):
    path = _write(tmp_path / "x.jsonl", content)
    with pytest.raises(UserError) as e:
        data.read_jsonl(path, kind)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{lineno}: ") and what in msg and "\n" not in msg


def test_a_tied_pair_is_dropped_and_counted():
    """A pair whose chosen equals its rejected (or a ranking holding one response twice) says nothing: drop_tied
    drops it and counts it, and the stages print the count beside the records too long."""
    rows = [
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "a", "rejected": "a"},
        {"prompt": "p", "responses": ["a", "b", "a"], "ranking": [0, 1, 2]},
        {
            "prompt": "p",
            "chosen": [{"role": "assistant", "content": "x"}],
            "rejected": [{"role": "assistant", "content": "x"}],
        },
    ]
    kept, tied = data.drop_tied(rows)
    assert kept == rows[:1] and tied == 3


def test_ptx_texts_too_long_are_counted_and_none_left_is_an_error(tmp_path, task_dir):
    """--ptx-data: the texts longer than the context are counted at start-up; none left while --ptx-coef asks for a
    ptx loss is a one-line error naming the flag (it was "0 ptx texts" and a run without its ptx loss)."""
    import train_ppo

    tok = tokenizer.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    prompts = _write(tmp_path / "prompts.jsonl", b'{"prompt": "Review of"}\n')
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text(json.dumps({"text": "the plot was good. " * 40}) + "\n" + json.dumps({"text": "short"}) + "\n")
    args = train_ppo.Args(prompts=prompts, ptx_data=str(ptx), task_dir=task_dir, max_new_tokens=8)
    loaded = data.load_prompts(args, tok, block_size=64)
    assert len(loaded.ptx) == 1 and loaded.ptx_too_long == 1
    ptx.write_text(json.dumps({"text": "the plot was good. " * 40}) + "\n")
    with pytest.raises(UserError, match=r"--ptx-data .*ptx.jsonl: all 1 texts are longer than the context"):
        data.load_prompts(args, tok, block_size=64)
    assert data.load_prompts(dataclasses.replace(args, ptx_coef=0.0), tok, block_size=64).ptx == []


def test_prompts_too_long_are_named_by_file_and_line_and_none_left_names_the_file(tmp_path, task_dir):
    """--prompts: the start-up line counts the prompts too long for the context and names the file and their first 5
    lines (blank lines counted as the file counts them); every prompt too long is one line naming the file (both were
    a count alone)."""
    import train_ppo

    tok = tokenizer.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    long_prompt, short_prompt = {"prompt": "the plot was good. " * 40}, {"prompt": "Review of"}
    rows = [short_prompt, long_prompt, short_prompt, long_prompt] + [long_prompt] * 5
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" + ("\n" if line == 0 else "") for line, row in enumerate(rows)))
    args = train_ppo.Args(prompts=str(path), task_dir=task_dir, max_new_tokens=8)
    loaded = data.load_prompts(args, tok, block_size=64)
    assert loaded.prompts == ["Review of"] * 2 and loaded.too_long == [3, 5, 6, 7, 8, 9, 10]
    assert loaded.skipped() == f"7 too long, skipped: {path}:3, 5, 6, 7, 8, ..."
    path.write_text(json.dumps(short_prompt) + "\n" + json.dumps(long_prompt) + "\n")
    assert data.load_prompts(args, tok, block_size=64).skipped() == f"1 too long, skipped: {path}:2"
    path.write_text(json.dumps(short_prompt) + "\n")
    assert data.load_prompts(args, tok, block_size=64).skipped() == "0 too long, skipped"
    with pytest.raises(UserError) as error:
        data.load_prompts(args, tok, block_size=8)
    assert str(error.value) == (
        f"{path}: every prompt is longer than the context minus --max-new-tokens (8 - 8 = 0 tokens; the shortest "
        f"takes {len(tok.encode('Review of'))})"
    )


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


# -----------------------------------------------------------------------------
# Anthropic-HH -> preference JSONL

H, A = "\n\nHuman:", "\n\nAssistant:"


def test_hh_to_pair():
    # multi-turn: the prompt is the whole shared dialogue up to and including the last "Assistant:"
    dialogue = f"{H} hi{A} hello!{H} how do I bake bread?{A}"
    pair = data.hh_to_pair(dialogue + " Knead, rest, bake.", dialogue + " No idea.")
    assert pair == {"prompt": dialogue, "chosen": " Knead, rest, bake.", "rejected": " No idea."}
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} a{A} no")["prompt"] == f"{H} a{A}"  # one turn
    # an earlier assistant turn inside the answers' shared prefix stays in the prompt, the answers only differ last
    assert data.hh_to_pair(f"{H} a{A} b{H} c{A} d", f"{H} a{A} b{H} c{A} e")["prompt"] == f"{H} a{A} b{H} c{A}"
    # skipped: the dialogues differ before the last turn, no assistant turn, an empty answer, the same answer
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} b{A} no") is None
    assert data.hh_to_pair(f"{H} a{A} b{H} c{A} d", f"{H} a{A} x{H} c{A} e") is None
    assert data.hh_to_pair(f"{H} a yes", f"{H} a no") is None
    assert data.hh_to_pair(f"{H} a{A} yes", f"{H} a{A}") is None
    assert data.hh_to_pair(f"{H} a{A}  \n", f"{H} a{A} no") is None
    assert data.hh_to_pair(f"{H} a{A} same", f"{H} a{A} same") is None


def hh_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "data.py", *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_convert_hh_cli(tmp_path):
    d1 = f"{H} what is 2+2?{A}"
    d2 = f"{H} hi{A} hello{H} tell me a joke{A}"
    records = [
        {"chosen": d1 + " 4", "rejected": d1 + " 5"},
        {"chosen": f"{H} a{A} b", "rejected": f"{H} c{A} d"},  # no shared prompt: skipped
        {"chosen": d2 + " Why did the chicken...", "rejected": d2 + ""},  # empty answer: skipped
        {"chosen": d2 + " A pun.", "rejected": d2 + " No.", "extra": 1},
    ]
    src, dst = write_jsonl(tmp_path / "hh.jsonl", records), tmp_path / "pairs.jsonl"
    r = hh_cli("hh", src, dst)
    assert (
        r.returncode == 0
        and r.stdout.strip() == f"wrote 2 pairs to {dst} (2 skipped: no shared prompt, an empty or a tied answer)"
    ), r.stdout + r.stderr
    pairs = data.read_jsonl(str(dst), "pairs")  # what train_rm.py --data reads
    assert pairs == [
        {"prompt": d1, "chosen": " 4", "rejected": " 5"},
        {"prompt": d2, "chosen": " A pun.", "rejected": " No."},
    ]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # written through a temp file and os.replace
    assert data.convert(src, str(dst), "hh") == (2, 2)
    # a bad line: one line on stderr, exit code 2 (like every stage), nothing written
    with open(src, "a") as f:
        f.write('{"chosen": "x", "rejected": 3}\n')
    os.remove(dst)
    r = hh_cli("hh", src, dst)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {src}:5: field 'rejected' must be a string") and not os.path.exists(dst)


GOOD = json.dumps({"chosen": f"{H} a{A} yes", "rejected": f"{H} a{A} no"}) + "\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (
            GOOD + '{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": 3}\n',
            r"hh\.jsonl:2: field 'rejected' must be a string, got int",
        ),
        (GOOD + '{"chosen": "x"}\n', r"hh\.jsonl:2: missing field 'rejected'"),
        (GOOD + "\n{not json\n", r"hh\.jsonl:3: bad JSON"),
        (GOOD + '["chosen", "rejected"]\n', r"hh\.jsonl:2: expected a JSON object"),
        (GOOD.encode() + b'{"chosen": "\xff"}\n', r"hh\.jsonl:2: not valid UTF-8"),
        ("\n", r"hh\.jsonl: no records"),
        (json.dumps({"chosen": f"{H} a{A} b", "rejected": f"{H} c{A} d"}) + "\n", r"hh\.jsonl: no usable record"),
    ],
)
def test_convert_hh_user_mistakes(tmp_path, content, message):
    src, dst = tmp_path / "hh.jsonl", tmp_path / "pairs.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(common.UserError, match=message):
        data._cli(["hh", str(src), str(dst)])
    assert not os.path.exists(dst)  # nothing written from a bad file


def test_convert_hh_usage_errors(tmp_path):
    for argv, message in [
        (["hh", str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")], "no such file"),
        (["hh", "in.jsonl"], "usage: python data.py hh"),
        (["sft", "in.jsonl", "out.jsonl"], "usage: python data.py hh"),
    ]:
        with pytest.raises(common.UserError, match=message):
            data._cli(argv)
    src = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": f"{H} a{A} yes", "rejected": f"{H} a{A} no"}])
    with pytest.raises(common.UserError, match="nowhere/pairs.jsonl: cannot write"):
        data._cli(["hh", src, str(tmp_path / "nowhere" / "pairs.jsonl")])


# -----------------------------------------------------------------------------
# conversational data (docs/design.md §3): chat templates, HH's layout without one, every stage on messages

SPECIAL = ["<unk>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
WORDS = [f"w{i}" for i in range(40)]
# ChatML, with spaces where the real one has newlines (the test's word-level tokenizer splits on whitespace)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
IM_START, IM_END = 3, 4


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    """A tiny Llama folder whose tokenizer has a ChatML-style template; <|im_end|> closes a turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("chat_llama"))
    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(vocab),
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=IM_END,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_template_renders_prompts_replies_and_every_assistant_turn(chat_llama):
    tok = tokenizer.load_tokenizer(f"hf:{chat_llama}")
    assert tok.chat and tok.eos_id == IM_END and tok.state()["chat"] is True
    assert tokenizer.Tokenizer.from_state(tok.state()).eos_id == IM_END
    prompt = [user("w1 w2")]
    head = data.prompt_ids(tok, prompt)  # apply_chat_template(..., add_generation_prompt=True)
    hf_tok = tok.backend
    rendered = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert head == list(rendered["input_ids"]) and head[-2:] == [IM_START, 6]  # ends with the assistant header
    assert "<|im_start|>assistant" in data.prompt_text(tok, prompt)
    reply = data.response_ids(tok, prompt, [assistant("w3 w4")])
    assert reply == tok.encode("w3 w4") + [IM_END]  # the end-of-turn token, no EOS appended, nothing after it
    assert data.response_ids(tok, prompt, " w3") == tok.encode(" w3") + [IM_END]  # a string reply: eos_id too
    conversation = [user("w1"), assistant("w2 w3"), user("w4"), assistant("w5")]
    ids, mask = tok.conversation(conversation)
    targets = [token for token, learned in zip(ids, mask) if learned]
    assert targets == tok.encode("w2 w3") + [IM_END] + tok.encode("w5") + [IM_END]
    assert ids[-1] == IM_END and tok.encode("w4")[0] in ids and not mask[ids.index(tok.encode("w4")[0])]
    examples, _ = data.encode_sft(tok, [{"messages": conversation}], 128, mask_prompt=True)
    encoded, loss_mask = examples[0]
    assert encoded == ids and loss_mask[0] == 0 and sum(loss_mask) == len(targets)


# Qwen3-like: an assistant turn's <think>...</think> reasoning is rendered in the final turn only, dropped from the
# earlier ones
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1].strip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory) -> str:
    """A word-level tokenizer folder (split on whitespace only, so <think> and </think> are words) with
    THINK_TEMPLATE as its chat template; <|im_end|> closes a turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("think_tokenizer"))
    vocab = {word: i for i, word in enumerate(SPECIAL + ["<think>", "</think>"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf_tok.chat_template = THINK_TEMPLATE
    hf_tok.save_pretrained(path)
    return path


def test_a_template_that_strips_earlier_reasoning_learns_each_turn_as_the_whole_conversation_renders_it(
    think_tokenizer,
):
    """Qwen3's template drops <think>...</think> from every assistant turn but the last, so a conversation renders
    its earlier turns otherwise than they were written. The target spans are read from the rendering of the whole
    conversation: the earlier turn is learned as it appears there (its answer alone, without the dropped reasoning),
    the final turn with its reasoning, each through its own <|im_end|>, and no token outside those spans (headers,
    user turns) is a target."""
    tok = tokenizer.load_tokenizer(f"hf:{think_tokenizer}")
    assert tok.chat and tok.eos_id == IM_END
    conversation = [
        user("w1"),
        assistant("<think> w2 w3 </think> w4"),
        user("w5"),
        assistant("<think> w6 </think> w7 w8"),
    ]
    ids, mask = tok.conversation(conversation)
    assert ids == tok.render(conversation, False)
    assert tok.encode("w2")[0] not in ids and ids.count(tok.encode("<think>")[0]) == 1  # the earlier reasoning dropped
    targets = [token for token, learned in zip(ids, mask) if learned]
    assert targets == tok.encode("w4") + [IM_END] + tok.encode("<think> w6 </think> w7 w8") + [IM_END]
    first = ids.index(tok.encode("w4")[0])
    assert mask[first - 1] == 0 and mask[first : first + 2] == [1, 1] and mask[first + 2] == 0  # w4, <|im_end|>
    assert ids[-1] == IM_END and mask[-1] == 1
    examples, _ = data.encode_sft(tok, [{"messages": conversation}], 128, mask_prompt=True)
    assert examples[0] == (ids, mask)


def test_without_a_template_conversations_take_hh_layout(task_dir):
    tok = tokenizer.load_tokenizer(task.build_task(task_dir, 1337)["tokenizer"])
    assert not tok.chat
    prompt = [{"role": "system", "content": "be kind"}, user("how was it?")]
    assert data.prompt_text(tok, prompt) == "\n\nSystem: be kind\n\nHuman: how was it?\n\nAssistant:"
    assert data.response_ids(tok, prompt, [assistant("fine")]) == tok.encode(" fine") + [tok.eos_id]
    ids, mask = tok.conversation([user("hi"), assistant("yes"), user("and?"), assistant("no")])
    assert tok.decode(ids) == "\n\nHuman: hi\n\nAssistant: yes\n\nHuman: and?\n\nAssistant: no"
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == " yes no" and ids[-1] == tok.eos_id and mask[-1] == 1


@pytest.mark.parametrize(
    "kind, record, message",
    [
        ("sft", {"messages": [{"content": "w1"}]}, r"field 'messages' turn 1: missing 'role'"),
        ("sft", {"messages": [{"role": "user"}]}, r"field 'messages' turn 1: missing 'content'"),
        ("sft", {"messages": [user("w1")]}, r"field 'messages': the last turn must be the assistant's"),
        ("sft", {"messages": [{"role": "bot", "content": "x"}]}, r"role 'bot' is not one of system, user, assistant"),
        (
            "pairs",
            {"prompt": [user("a")], "chosen": [user("b")], "rejected": [assistant("c")]},
            r"assistant turns only",
        ),
        ("pairs", {"prompt": [user("a")], "chosen": "b", "rejected": [assistant("c")]}, r"field 'chosen' must be a"),
        ("prompts", {"prompt": []}, r"field 'prompt' must be a non-empty list of messages"),
    ],
)
def test_malformed_messages_are_file_line_errors(tmp_path, kind, record, message):
    good = {
        "sft": {"messages": [user("a"), assistant("b")]},
        "pairs": {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]},
        "prompts": {"prompt": [user("a")]},
    }[kind]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError, match=rf"data\.jsonl:2: .*{message}"):
        data.read_jsonl(str(path), kind)


def test_trl_prompt_completion_and_implicit_prompt_records_load(tmp_path, tok):
    """TRL's other layouts (docs/design.md §3) load to this repo's records: prompt-completion SFT with strings becomes
    {"prompt", "response"}, with messages a conversation that learns the completion only (learn_from: an earlier
    assistant turn inside the prompt is context, not a target); implicit-prompt preferences take the chosen and
    rejected conversations' shared head as the prompt, the rest as the replies."""
    sft = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "Review of", "completion": " the music was good."},
            {"prompt": [user("a"), assistant("b"), user("c")], "completion": [assistant("d")]},
        ],
    )
    rows = data.read_jsonl(sft, "sft")
    assert rows[0] == {"prompt": "Review of", "response": " the music was good."}
    assert rows[1] == {"messages": [user("a"), assistant("b"), user("c"), assistant("d")], "learn_from": 3}
    assert data.sft_prompt(rows[1]) == [user("a"), assistant("b"), user("c")]
    examples, _ = data.encode_sft(tok, rows[1:], block_size=128, mask_prompt=True)
    ids, mask = examples[0]
    assert tok.decode([token for token, learned in zip(ids, mask) if learned]) == " d"  # b is not learned
    assert ids[-1] == tok.eos_id and mask[-1] == 1
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"chosen": [user("q"), assistant("yes")], "rejected": [user("q"), assistant("no")]},
            {
                "chosen": [user("q"), assistant("hi"), user("r"), assistant("good"), assistant("more")],
                "rejected": [user("q"), assistant("hi"), user("r"), assistant("bad")],
            },
        ],
    )
    rows = data.read_jsonl(pairs, "pairs")
    assert rows[0] == {"prompt": [user("q")], "chosen": [assistant("yes")], "rejected": [assistant("no")]}
    assert rows[1] == {
        "prompt": [user("q"), assistant("hi"), user("r")],
        "chosen": [assistant("good"), assistant("more")],
        "rejected": [assistant("bad")],
    }


@pytest.mark.parametrize(
    "kind, record, message",
    [
        (
            "sft",
            {"prompt": "a", "completion": 3},
            "fields 'prompt' and 'completion' must be both strings or both lists",
        ),
        ("sft", {"prompt": [user("a")], "completion": "b"}, "must be both strings or both lists of messages"),
        ("sft", {"prompt": "", "completion": "b"}, "field 'prompt' is empty"),
        ("sft", {"prompt": [user("a")], "completion": [user("b")]}, "field 'completion' turn 1: a reply holds"),
        ("sft", {"prompt": [{"role": "user"}], "completion": [assistant("b")]}, "field 'prompt' turn 1: missing"),
        (
            "pairs",
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": [user("a")]},
            "missing field 'prompt': an implicit prompt needs 'chosen' and 'rejected' as lists of messages, not str",
        ),
        ("pairs", {"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]}, "share no leading"),
        (
            "pairs",
            {"chosen": [user("a"), assistant("b"), user("x")], "rejected": [user("a"), assistant("c")]},
            "field 'chosen after the shared prompt' turn 2: a reply holds assistant turns only, not 'user'",
        ),
        (
            "pairs",
            {"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b")]},
            "field 'chosen after the shared prompt' must be a non-empty list",
        ),
        ("pairs", {"chosen": [user("a"), {"role": "assistant", "content": 1}], "rejected": [user("a")]}, "'content'"),
    ],
    ids=[
        "types",
        "mixed",
        "empty_prompt",
        "user_completion",
        "no_role",
        "strings",
        "no_shared_turn",
        "user_after_prompt",
        "identical",
        "content_type",
    ],
)
def test_malformed_trl_records_are_file_line_field_errors(tmp_path, kind, record, message):
    """A bad record in a TRL layout, on line 3 after a good one and a blank line, is one line `path:3: ...` naming
    the field that is wrong."""
    good = {
        "sft": {"prompt": [user("a")], "completion": [assistant("b")]},
        "pairs": {"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("c")]},
    }[kind]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as error:
        data.read_jsonl(str(path), kind)
    text = str(error.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text, text


@pytest.mark.slow
def test_converters_write_conversational_pairs(tmp_path):
    """python data.py ultrafeedback: UltraFeedback-binarized's chosen/rejected repeat the user turn, which becomes the
    prompt; python data.py hh --messages: HH dialogues as messages."""
    rows = [
        {"prompt": "q", "chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]},
        {"prompt": "q", "chosen": [user("q"), assistant("same")], "rejected": [user("q"), assistant("same")]},
    ]
    src, dst = tmp_path / "uf.jsonl", tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = [sys.executable, os.path.join(ROOT, "data.py"), "ultrafeedback", str(src), str(dst)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote 1 pairs" in r.stdout and "1 skipped" in r.stdout, r.stderr
    assert [json.loads(line) for line in open(dst)] == [
        {"prompt": [user("q")], "chosen": [assistant("good")], "rejected": [assistant("bad")]}
    ]
    hh = tmp_path / "hh.jsonl"
    dialogue = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how?\n\nAssistant:"
    hh.write_text(json.dumps({"chosen": dialogue + " well", "rejected": dialogue + " badly"}) + "\n")
    data.convert(str(hh), str(dst), "hh", messages=True)
    (pair,) = data.read_jsonl(str(dst), "pairs")
    assert pair["prompt"] == [user("hi"), assistant("hello"), user("how?")] and pair["chosen"] == [assistant("well")]


@pytest.mark.slow
def test_every_stage_on_messages_with_a_chat_template(tmp_path, chat_llama):
    """SFT -> RM -> DPO -> PPO -> eval with conversational data and a tiny Llama whose tokenizer has a chat template:
    responses stop at <|im_end|> (the stop and score token, never followed by an EOS), --reward-fn sees the rendered
    prompt and the samples the last user message."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    def write(name: str, rows: list) -> str:
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(tmp_path / name)

    sft_rows = [{"messages": [user(words(3)), assistant(words(2)), user(words(2)), assistant(words(2))]}] * 20
    sft_rows += [{"messages": [user(words(3)), assistant(words(3))]} for _ in range(20)]
    pairs = [{"prompt": [user(words(3))], "chosen": [assistant("w1 w2")], "rejected": [assistant(words(3))]}] * 24
    prompts = [{"prompt": [user(words(3))]} for _ in range(16)]
    sft_data, pairs_data, prompts_data = (
        write("sft.jsonl", sft_rows),
        write("pairs.jsonl", pairs),
        write("p.jsonl", prompts),
    )
    out = {stage: str(tmp_path / stage) for stage in ("sft", "rm", "dpo", "ppo")}
    ckpt = {stage: os.path.join(folder, "ckpt.pt") for stage, folder in out.items()}
    small = dict(batch_size=8, micro_batch_size=4, max_steps=2, warmup_steps=1, device="cpu", task_dir=str(tmp_path))
    train_sft.main(
        train_sft.Args(out_dir=out["sft"], init=f"hf:{chat_llama}", data=sft_data, eval_every=2, num_samples=4, **small)
    )
    rm_flags = dict(eval_every=2, eval_pairs=8, calib_size=8)
    train_rm.main(train_rm.Args(out_dir=out["rm"], init=ckpt["sft"], data=pairs_data, **rm_flags, **small))
    dpo_flags = dict(eval_every=2, eval_pairs=8, num_samples=4, eval_samples=4)
    train_dpo.main(train_dpo.Args(out_dir=out["dpo"], init=ckpt["sft"], data=pairs_data, **dpo_flags, **small))
    (tmp_path / "myreward.py").write_text(
        "SEEN = []\ndef length(prompt, response, ended):\n    SEEN.append(prompt)\n    return len(response) / 10\n"
    )
    ppo = train_ppo.Args(
        out_dir=out["ppo"],
        sft_ckpt=ckpt["dpo"],
        ref_ckpt=ckpt["sft"],
        rm_ckpt=[ckpt["rm"]],
        prompts=prompts_data,
        reward_fn=f"{tmp_path}/myreward.py:length",
        max_steps=2,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
        device="cpu",
        task_dir=str(tmp_path),
    )
    train_ppo.main(ppo)
    sample = json.loads(open(os.path.join(out["ppo"], "samples.jsonl")).readline())
    shown = {f"user: {row['prompt'][-1]['content']}\nassistant: " for row in prompts}
    assert sample["prompt"] in shown
    tok = tokenizer.Tokenizer.from_state(torch.load(ckpt["ppo"], weights_only=False)["tokenizer"])
    assert tok.chat and tok.eos_id == IM_END
    examples, _ = data.encode_prefs(tok, pairs[:1], 128)
    assert all(seq[-1] == IM_END and seq[-2] != IM_END for seq in examples[0][0])  # scored at the end-of-turn
    res = ev.main(
        ev.Args(
            policy=[ckpt["ppo"]],
            names=["ppo"],
            ref=ckpt["sft"],
            rm=[ckpt["rm"]],
            prompts=prompts_data,
            num_samples=8,
            max_new_tokens=8,
            reward_fn=f"{tmp_path}/myreward.py:length",
            task_dir=str(tmp_path),
        )
    )
    assert res["ppo"]["gold"] is None and res["ppo"]["score"] is not None and res["ppo"]["reward_fn"] is not None
