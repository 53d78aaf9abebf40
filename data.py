"""Data: tokenizers behind one interface, JSONL readers, the built-in "reviews" task with its gold reward, batching.

The built-in task (DESIGN §3): prompts like `Review of The Silent River (music, ending):`, responses of 1..4 templated
sentences and an EOS. The gold reward likes positive sentences on the requested aspects (with diminishing returns)
and gives -1 to anything the grammar does not produce (repetition, >4 sentences, broken words, no EOS). Preference
pairs only ever contain grammatical text, so a learned RM extrapolates "more, more positive" where the gold does not.
"""

import base64
import json
import math
import os
import random
import re
from collections import Counter

import regex
import tiktoken
import torch

from common import UserError

# -----------------------------------------------------------------------------
# tokenizers

# GPT-2's split pattern (the same string tiktoken's r50k_base uses, minus the possessive quantifiers)
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


class Tokenizer:
    """One small interface over a tiktoken.Encoding (task BPE, GPT-2) or a Hugging Face tokenizer.

    bos_id: the id a sequence starts with, or None. A Hugging Face tokenizer whose own encode adds a BOS (Llama) gets
    one; the task BPE and GPT-2 have none. encode(text, bos=True) prepends it: pass bos=True for what starts a sequence
    (a prompt, a {"text"} row) and never for a response that follows a prompt, so the BOS appears once, first."""

    def __init__(
        self, backend, name: str, eos_id: int, pad_id: int, vocab_size: int, source: dict, bos_id: int | None = None
    ):
        assert pad_id != eos_id, f"pad_id {pad_id} must differ from eos_id {eos_id}"
        self.backend, self.name, self.eos_id, self.pad_id, self.vocab_size = backend, name, eos_id, pad_id, vocab_size
        self.bos_id = bos_id
        self._source = source  # what state() needs beyond the ids to rebuild the backend

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """text -> ids, special tokens never parsed from it; bos=True (a sequence start): bos_id first, if any."""
        start = [self.bos_id] if bos and self.bos_id is not None else []
        if isinstance(self.backend, tiktoken.Encoding):
            return start + self.backend.encode_ordinary(text)
        return start + self.backend(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        ids = [int(i) for i in ids if i != self.pad_id and i != self.eos_id]
        return self.backend.decode(ids)

    def state(self) -> dict:
        """The ids and what rebuilds the backend; a Hugging Face tokenizer's also says bos_id (its BOS decision)."""
        return {
            "name": self.name,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "vocab_size": self.vocab_size,
            **self._source,
        }

    @classmethod
    def from_state(cls, d: dict) -> "Tokenizer":
        """Rebuild a saved tokenizer; a state without bos_id (the task BPE, GPT-2, or one saved before the BOS was
        decided per tokenizer) adds none, as the stages that trained on it did."""
        if "ranks" in d:  # a BPE stored in full (the task tokenizer)
            tok = _bpe_tokenizer(d["name"], [base64.b64decode(r) for r in d["ranks"]], d["pat_str"])
        else:
            tok = load_tokenizer(d["spec"])
        if "bos_id" not in d:
            tok.bos_id = None
            tok._source.pop("bos_id", None)
        got = (tok.eos_id, tok.pad_id, tok.vocab_size, tok.bos_id)
        want = (d["eos_id"], d["pad_id"], d["vocab_size"], d.get("bos_id"))
        if got != want:
            raise UserError(f"tokenizer {d['name']!r} changed: (eos, pad, vocab, bos) is {got} now, {want} when saved")
        return tok


def _bpe_tokenizer(name: str, ranks: list[bytes], pat_str: str) -> Tokenizer:
    # ranks[i] is the token with id i; the EOS comes next and the pad id lies outside the embedding
    enc = tiktoken.Encoding(
        name=name,
        pat_str=pat_str,
        mergeable_ranks={b: i for i, b in enumerate(ranks)},
        special_tokens={EOT: len(ranks)},
    )
    source = {"pat_str": pat_str, "ranks": [base64.b64encode(b).decode("ascii") for b in ranks]}
    return Tokenizer(enc, name, eos_id=len(ranks), pad_id=len(ranks) + 1, vocab_size=len(ranks) + 1, source=source)


def _hf_bos_id(hf_tokenizer) -> int | None:
    """The BOS id when this Hugging Face tokenizer defines one and its own encode starts a text with it (Llama), else
    None (GPT-2, Qwen: a bos token that encode never adds)."""
    bos_id = hf_tokenizer.bos_token_id
    if bos_id is None:
        return None
    with_special = hf_tokenizer("x", add_special_tokens=True)["input_ids"]
    without = hf_tokenizer("x", add_special_tokens=False)["input_ids"]
    return bos_id if with_special[:1] == [bos_id] and without[:1] != [bos_id] else None


def load_tokenizer(spec: str) -> Tokenizer:
    """ "gpt2" (tiktoken r50k_base), "hf:<name-or-path>" (transformers.AutoTokenizer) or a task tokenizer.json path."""
    if spec == "gpt2":
        try:
            enc = tiktoken.get_encoding("r50k_base")
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"could not load the GPT-2 tokenizer (r50k_base; offline? set TIKTOKEN_CACHE_DIR): {msg}"
            ) from None
        return Tokenizer(
            enc, "gpt2", eos_id=enc.eot_token, pad_id=enc.n_vocab, vocab_size=enc.n_vocab, source={"spec": "gpt2"}
        )
    if spec.startswith("hf:"):
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(spec[3:])
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"could not load tokenizer {spec!r} (offline? pass a local folder saved with save_pretrained, "
                f"or set HF_HOME to a cache that has them): {msg}"
            ) from None
        if hf.eos_token_id is None:
            raise UserError(f"tokenizer {spec!r} has no eos token")
        vocab_size = len(hf)
        pad_id = hf.pad_token_id if hf.pad_token_id is not None and hf.pad_token_id != hf.eos_token_id else vocab_size
        bos_id = _hf_bos_id(hf)
        source = {"spec": spec, "bos_id": bos_id}
        return Tokenizer(
            hf, spec, eos_id=hf.eos_token_id, pad_id=pad_id, vocab_size=vocab_size, source=source, bos_id=bos_id
        )
    if not os.path.isfile(spec):
        raise UserError(f"{spec}: no such tokenizer file (expected 'gpt2', 'hf:<name-or-path>' or a tokenizer.json)")
    try:
        with open(spec) as f:
            return Tokenizer.from_state(json.load(f))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{spec}: not a tokenizer file ({type(e).__name__}: {e})") from None


def train_bpe(word_counts: dict[str, int], targets: list[str], max_merges: int = 1024) -> list[bytes]:
    """Byte-level BPE over pre-tokenized words weighted by counts; merges until every target word is one token.

    Returns the tokens in rank order: the 256 single bytes, then one token per merge. Ties in the pair count are
    broken by the smallest (left, right) bytes, so the result depends on nothing but the counts.
    """
    words = sorted(set(word_counts) | set(targets))
    parts = {w: [bytes([b]) for b in w.encode()] for w in words}
    ranks = [bytes([i]) for i in range(256)]
    known = set(ranks)
    while len(ranks) - 256 < max_merges and any(len(parts[w]) > 1 for w in targets):
        pairs: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for p in zip(parts[w], parts[w][1:]):
                pairs[p] = pairs.get(p, 0) + word_counts.get(w, 0) + 1  # +1: targets absent from the text still merge
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        if a + b not in known:
            ranks.append(a + b)
            known.add(a + b)
        for w in words:  # apply the merge left to right
            old, new, i = parts[w], [], 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
                    new.append(a + b)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            parts[w] = new
    return ranks


# -----------------------------------------------------------------------------
# the built-in task ("reviews")

TITLE_ADJS = (
    "Silent",
    "Golden",
    "Broken",
    "Hidden",
    "Last",
    "Crimson",
    "Quiet",
    "Endless",
    "Frozen",
    "Distant",
    "Wild",
    "Paper",
    "Midnight",
    "Glass",
    "Iron",
    "Lonely",
)
TITLE_NOUNS = (
    "River",
    "Garden",
    "Mountain",
    "City",
    "Letter",
    "Machine",
    "Harbor",
    "Forest",
    "Voyage",
    "Kingdom",
    "Mirror",
    "Station",
    "Engine",
    "Island",
    "Tower",
    "Promise",
)
ASPECTS = ("plot", "acting", "music", "ending", "pacing", "characters", "visuals", "dialogue", "humor", "setting")
ADJECTIVES = {
    "wonderful": 2,
    "brilliant": 2,
    "superb": 2,
    "excellent": 2,
    "good": 1,
    "nice": 1,
    "pleasant": 1,
    "solid": 1,
    "dull": -1,
    "weak": -1,
    "bland": -1,
    "messy": -1,
    "awful": -2,
    "terrible": -2,
    "dreadful": -2,
    "horrible": -2,
}
INTENSIFIERS = {"very": 1.5, "truly": 1.5, "somewhat": 0.5, "slightly": 0.5}
VERBS = {"loved": 2, "adored": 2, "liked": 1, "enjoyed": 1, "disliked": -1, "hated": -2}
TEMPLATE_WEIGHTS = {"S1": 0.4, "S2": 0.25, "S3": 0.15, "S4": 0.2}
EVAL_TITLE_FRAC = 0.15  # share of the 256 titles held out for eval_prompts
BT_TEMPERATURE = 0.25  # preference labels: P(a > b) = sigmoid((gold_a - gold_b) / BT_TEMPERATURE)
MAX_SENTENCES = 4
# demonstrations talk about a requested aspect with this probability. Below 1, pairs differ in whether a mention is
# relevant *and* in its polarity (an XOR a small RM does not pick up in one epoch: 0.75 left it 7 points under the
# Bayes ceiling); at 1 the RM can reach the ceiling, and off-aspect praise stays an unseen way to hack it.
ON_ASPECT_PROB = 1.0
TASK_VERSION = 2  # bump when generation changes: the cache folder is keyed by it

# every pre-tokenized word the task text can contain; the task tokenizer makes each one a single token
GRAMMAR_WORDS = tuple(
    dict.fromkeys(
        ["Review", " of", " The", " (", ",", "):", ".", " the", " was", " i", " but", " overall", " it"]
        + list(ASPECTS)
        + [" " + w for w in (*TITLE_ADJS, *TITLE_NOUNS, *ASPECTS, *ADJECTIVES, *INTENSIFIERS, *VERBS)]
    )
)

# one regex per sentence template (the sentence without its final period)
_alt = "|".join
_ASP, _ADJ, _INT, _VERB = _alt(ASPECTS), _alt(ADJECTIVES), _alt(INTENSIFIERS), _alt(VERBS)
SENTENCE_RES = {
    "S1": re.compile(rf"the (?P<aspect>{_ASP}) was (?:(?P<int>{_INT}) )?(?P<adj>{_ADJ})"),
    "S2": re.compile(rf"i (?P<verb>{_VERB}) the (?P<aspect>{_ASP})"),
    "S3": re.compile(rf"the (?P<aspect>{_ASP}) was (?P<adj>{_ADJ}) but the (?P<aspect2>{_ASP}) was (?P<adj2>{_ADJ})"),
    "S4": re.compile(rf"overall it was (?:(?P<int>{_INT}) )?(?P<adj>{_ADJ})"),
}
PROMPT_RE = re.compile(rf"Review of The (\w+) (\w+) \(({_ASP})(?:, ({_ASP}))?\):")


def parse_response(response: str) -> list[tuple[str, dict]] | None:
    """[(template, fields), ...] when every sentence parses and the rules hold (EOS aside), else None."""
    if not response.startswith(" ") or not response.endswith("."):
        return None
    sentences = response[1:-1].split(". ")
    if not 1 <= len(sentences) <= MAX_SENTENCES or len(set(sentences)) != len(sentences):
        return None
    parsed = []
    for i, s in enumerate(sentences):
        matches = [(name, pattern.fullmatch(s)) for name, pattern in SENTENCE_RES.items()]
        name, match = next(((name, m) for name, m in matches if m), (None, None))
        if match is None:
            return None
        f = match.groupdict()
        if name == "S4" and i != len(sentences) - 1:
            return None
        parsed.append((name, f))
    return parsed


def is_valid(response: str, ended: bool) -> bool:
    """Grammatical, 1..4 sentences, none repeated, "overall" only last, and the EOS was produced."""
    return ended and parse_response(response) is not None


def prompt_aspects(prompt: str) -> list[str]:
    m = PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a reviews-task prompt: {prompt!r}")
    return [a for a in m.groups()[2:] if a is not None]


def gold_reward(prompt: str, response: str, ended: bool) -> float:
    """Mean over requested aspects of tanh(their mention values + half the overall value); -1 if not valid."""
    parsed = parse_response(response) if ended else None
    if parsed is None:
        return -1.0
    mentions, overall = [], 0.0  # (aspect, value) with value = polarity * intensity / 2
    for name, f in parsed:
        intensity = INTENSIFIERS[f["int"]] if f.get("int") else 1.0
        if name == "S1":
            mentions.append((f["aspect"], ADJECTIVES[f["adj"]] * intensity / 2))
        elif name == "S2":
            mentions.append((f["aspect"], VERBS[f["verb"]] / 2))
        elif name == "S3":
            mentions += [(f["aspect"], ADJECTIVES[f["adj"]] / 2), (f["aspect2"], ADJECTIVES[f["adj2"]] / 2)]
        else:
            overall = ADJECTIVES[f["adj"]] * intensity / 2
    aspects = prompt_aspects(prompt)
    scores = [sum(v for a, v in mentions if a == asp) + 0.5 * overall for asp in aspects]
    return sum(math.tanh(s) for s in scores) / len(aspects)


def split_titles(task_seed: int) -> tuple[list[str], list[str]]:
    """(train_titles, eval_titles): a deterministic ~15 % of the 256 titles is held out for eval prompts."""
    titles = [f"The {a} {n}" for a in TITLE_ADJS for n in TITLE_NOUNS]
    random.Random(task_seed).shuffle(titles)
    n_eval = round(EVAL_TITLE_FRAC * len(titles))
    return titles[n_eval:], titles[:n_eval]


def sample_prompt(rng: random.Random, titles: list[str]) -> str:
    aspects = rng.sample(ASPECTS, rng.choice((1, 2)))
    return f"Review of {rng.choice(titles)} ({', '.join(aspects)}):"


def _pick_aspect(rng: random.Random, requested: list[str], exclude: str | None = None) -> str:
    wanted = [a for a in requested if a != exclude]
    others = [a for a in ASPECTS if a not in requested and a != exclude]
    return rng.choice(wanted if wanted and (rng.random() < ON_ASPECT_PROB or not others) else others)


def _word(rng: random.Random, table: dict[str, int], polarity: int) -> str:
    return rng.choice([w for w, p in table.items() if p == polarity])


def _sentence(rng: random.Random, template: str, requested: list[str], mood: float) -> str:
    sign = 1 if rng.random() < (1 + mood) / 2 else -1  # the expected sign follows the mood
    polarity = sign * rng.choice((1, 2))
    intensifier = rng.choice(list(INTENSIFIERS)) + " " if rng.random() < 0.4 else ""
    if template == "S4":
        return f"overall it was {intensifier}{_word(rng, ADJECTIVES, polarity)}."
    aspect = _pick_aspect(rng, requested)
    if template == "S1":
        return f"the {aspect} was {intensifier}{_word(rng, ADJECTIVES, polarity)}."
    if template == "S2":
        return f"i {_word(rng, VERBS, polarity)} the {aspect}."
    aspect2, polarity2 = _pick_aspect(rng, requested, exclude=aspect), -sign * rng.choice((1, 2))
    adj, adj2 = _word(rng, ADJECTIVES, polarity), _word(rng, ADJECTIVES, polarity2)  # opposite signs, no intensifier
    return f"the {aspect} was {adj} but the {aspect2} was {adj2}."


def sample_response(rng: random.Random, prompt: str) -> str:
    """A demonstration: mood ~ U(-1, 1), 1..4 distinct sentences, S4 only last; text without the EOS."""
    requested, mood, n = prompt_aspects(prompt), rng.uniform(-1, 1), rng.randint(1, MAX_SENTENCES)
    sentences: list[str] = []
    while len(sentences) < n:
        template = rng.choices(list(TEMPLATE_WEIGHTS), weights=list(TEMPLATE_WEIGHTS.values()))[0]
        if template == "S4" and len(sentences) != n - 1:
            continue  # redraw: "overall" only closes a review
        s = _sentence(rng, template, requested, mood)
        if s not in sentences:
            sentences.append(s)
    return " " + " ".join(sentences)


def sample_pair(rng: random.Random, prompt: str) -> dict:
    """Two distinct demonstrations labelled by a Bradley-Terry model on the gold reward."""
    a = sample_response(rng, prompt)
    b = sample_response(rng, prompt)
    while b == a:
        b = sample_response(rng, prompt)
    delta = (gold_reward(prompt, a, True) - gold_reward(prompt, b, True)) / BT_TEMPERATURE
    a_wins = rng.random() < 1 / (1 + math.exp(-delta))
    return {"prompt": prompt, "chosen": a if a_wins else b, "rejected": b if a_wins else a}


TASK_FILES = ("pretrain", "sft", "sft_eval", "pairs", "pairs_eval", "prompts", "eval_prompts")
TASK_SIZES = {
    "pretrain": 20000,
    "sft": 20000,
    "sft_eval": 1000,
    "pairs": 20000,
    "pairs_eval": 4000,
    "prompts": 8192,
    "eval_prompts": 1024,
}
TINY_SIZES = {
    "pretrain": 1000,
    "sft": 1000,
    "sft_eval": 64,
    "pairs": 1000,
    "pairs_eval": 200,
    "prompts": 512,
    "eval_prompts": 128,
}


def _task_records(name: str, rng: random.Random, n: int, train_titles: list[str], eval_titles: list[str]) -> list:
    records = []
    for _ in range(n):
        prompt = sample_prompt(rng, eval_titles if name == "eval_prompts" else train_titles)
        if name == "pretrain":
            records.append({"text": prompt + sample_response(rng, prompt)})
        elif name in ("sft", "sft_eval"):
            records.append({"prompt": prompt, "response": sample_response(rng, prompt)})
        elif name in ("pairs", "pairs_eval"):
            records.append(sample_pair(rng, prompt))
        else:
            records.append({"prompt": prompt})
    return records


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temp file and os.replace: a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def build_task(data_dir: str, task_seed: int = 1337, tiny: bool = False) -> dict[str, str]:
    """Write the task files under {data_dir}/v{TASK_VERSION}-seed{task_seed}[-tiny]/ (only those missing) and
    return name -> path."""
    out = os.path.join(data_dir, f"v{TASK_VERSION}-seed{task_seed}" + ("-tiny" if tiny else ""))
    paths = {name: os.path.join(out, f"{name}.jsonl") for name in TASK_FILES}
    paths["tokenizer"] = os.path.join(out, "tokenizer.json")
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(out, exist_ok=True)
    train_titles, eval_titles = split_titles(task_seed)
    # one independent stream per file, so each file is fixed by the seed alone
    master = random.Random(task_seed)
    streams = [random.Random(master.getrandbits(64)) for _ in TASK_FILES]
    sizes = TINY_SIZES if tiny else TASK_SIZES
    records = {}
    for name, rng in zip(TASK_FILES, streams):
        records[name] = _task_records(name, rng, sizes[name], train_titles, eval_titles)
        if not os.path.exists(paths[name]):
            write_atomic(paths[name], "".join(json.dumps(r) + "\n" for r in records[name]))
    if not os.path.exists(paths["tokenizer"]):
        pat = regex.compile(GPT2_PAT)
        word_counts = Counter(w for r in records["pretrain"] for w in pat.findall(r["text"]))
        tok = _bpe_tokenizer("reviews", train_bpe(word_counts, list(GRAMMAR_WORDS)), GPT2_PAT)
        write_atomic(paths["tokenizer"], json.dumps(tok.state()))
    return paths


# -----------------------------------------------------------------------------
# JSONL readers


def _check_fields(obj: dict, kind: str) -> str | None:
    """What is wrong with one record of this kind, or None."""
    fields = {
        "sft": ("prompt", "response"),
        "text": ("text",),
        "prompts": ("prompt",),
        "hh": ("chosen", "rejected"),
    }.get(kind)
    if kind == "pairs":
        fields = ("prompt", "responses", "ranking") if "responses" in obj else ("prompt", "chosen", "rejected")
    if fields is None:
        raise ValueError(f"unknown jsonl kind {kind!r}")
    for k in fields:
        if k not in obj:
            return f"missing field {k!r} (a {kind} record needs {', '.join(fields)})"
        if k not in ("responses", "ranking") and not isinstance(obj[k], str):
            return f"field {k!r} must be a string, got {type(obj[k]).__name__}"
    if "prompt" in fields and not obj["prompt"]:  # an all-empty batch has nothing to generate from
        return "field 'prompt' is empty (a prompt needs at least one token)"
    if "responses" in fields:
        resp, ranking = obj["responses"], obj["ranking"]
        if not isinstance(resp, list) or len(resp) < 2 or not all(isinstance(r, str) for r in resp):
            return "field 'responses' must be a list of at least 2 strings"
        ints = isinstance(ranking, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ranking)
        if not ints or sorted(ranking) != list(range(len(resp))):
            return f"field 'ranking' must be a permutation of 0..{len(resp) - 1}"
    return None


def read_jsonl(path: str, kind: str) -> list[dict]:
    """Read and validate a UTF-8 JSONL file of kind "sft", "text", "prompts", "pairs" or "hh" (Anthropic-HH); a missing
    or empty file, bad UTF-8, bad JSON, a line that is not an object or a bad field is a one-line UserError
    `path:line: what is wrong`. Blank lines are skipped."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: bad JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            problem = _check_fields(obj, kind)
            if problem:
                raise UserError(f"{path}:{lineno}: {problem}")
            records.append(obj)
    if not records:
        raise UserError(f"{path}: no records")
    return records


# -----------------------------------------------------------------------------
# converters from public preference formats

HH_ASSISTANT = "\n\nAssistant:"


def hh_to_pair(chosen: str, rejected: str) -> dict | None:
    """One Anthropic-HH record (two whole dialogues "\\n\\nHuman: ...\\n\\nAssistant: ...") -> {"prompt", "chosen",
    "rejected"}: the prompt is the dialogue up to and including the last "\\n\\nAssistant:" (earlier turns included),
    the answers are what follows it. None when the two dialogues differ before that point, or an answer is empty,
    or both answers are the same."""
    cut_c, cut_r = chosen.rfind(HH_ASSISTANT), rejected.rfind(HH_ASSISTANT)
    if cut_c < 0 or cut_r < 0 or chosen[:cut_c] != rejected[:cut_r]:
        return None
    n = cut_c + len(HH_ASSISTANT)
    prompt, c, r = chosen[:n], chosen[n:], rejected[n:]
    if not c.strip() or not r.strip() or c == r:
        return None
    return {"prompt": prompt, "chosen": c, "rejected": r}


def convert_hh(src: str, dst: str) -> tuple[int, int]:
    """Anthropic-HH JSONL ({"chosen": str, "rejected": str} a line) -> our preference JSONL at dst, written atomically;
    returns (written, skipped). A bad line stops before anything is written, with `path:line: what is wrong`."""
    pairs = [hh_to_pair(r["chosen"], r["rejected"]) for r in read_jsonl(src, "hh")]
    rows = [p for p in pairs if p]
    skipped = len(pairs) - len(rows)
    if not rows:
        raise UserError(f"{src}: no usable record (every one lacks a shared prompt or has an empty or tied answer)")
    try:
        write_atomic(dst, "".join(json.dumps(r) + "\n" for r in rows))
    except OSError as e:
        raise UserError(f"{dst}: cannot write ({e.strerror or type(e).__name__})") from None
    return len(rows), skipped


# -----------------------------------------------------------------------------
# batching


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) long, mask (B, T) float, 1 = real token), padded on the left (prompts for generation)."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0.0] * (T - len(s)) + [1.0] * len(s) for s in seqs])
    return ids, mask


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) long, mask (B, T) float, 1 = real token), padded on the right."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [pad_id] * (T - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1.0] * len(s) + [0.0] * (T - len(s)) for s in seqs])
    return ids, mask


class Order:
    """The global sample order, the same on every rank: a fresh permutation of n items each epoch (seed + epoch)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        self.n, self.seed, self.epoch, self.pos, self._perm = n, seed, epoch, pos, None

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n or self._perm is None:
                self.epoch, self.pos = (self.epoch + 1, 0) if self.pos == self.n else (self.epoch, self.pos)
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.n, generator=g).tolist()
            chunk = self._perm[self.pos : self.pos + k - len(out)]
            out, self.pos = out + chunk, self.pos + len(chunk)
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}


def encode_sft(tok: Tokenizer, rows: list[dict], block_size: int, mask_prompt: bool) -> tuple[list, int]:
    """([(ids, loss_mask), ...], n_skipped): ids = [BOS] + prompt + response + EOS (the BOS if the tokenizer has one),
    loss_mask[t] = 1 if token t is a target.

    The first token is never a target; with mask_prompt no prompt token is. A {"text"} row is an empty prompt
    followed by the text. Rows longer than block_size tokens are skipped and counted.
    """
    examples, skipped = [], 0
    for row in rows:
        prompt_ids = tok.encode(row.get("prompt", ""), bos=True)
        ids = prompt_ids + tok.encode(row["response"] if "response" in row else row["text"]) + [tok.eos_id]
        if len(ids) > block_size:
            skipped += 1
            continue
        n_masked = max(len(prompt_ids), 1) if mask_prompt else 1
        examples.append((ids, [0] * n_masked + [1] * (len(ids) - n_masked)))
    return examples, skipped


def responses_of(row: dict) -> list[str]:
    """A preference record's responses: [chosen, rejected], or the K-wise "responses"."""
    return row["responses"] if "responses" in row else [row["chosen"], row["rejected"]]


def ranking_pairs(ranking: list[int]) -> list[tuple[int, int, float]]:
    """A ranking (permutation of response indices, best first) -> all K(K-1)/2 (better, worse, weight) pairs,
    weights summing to 1 so every prompt counts once whatever its K (InstructGPT)."""
    K = len(ranking)
    return [(ranking[a], ranking[b], 2 / (K * (K - 1))) for a in range(K) for b in range(a + 1, K)]


def encode_prefs(tok, rows: list[dict], block_size: int) -> tuple[list, int]:
    """([(seqs, n_prompt, pairs, best, row), ...], n_skipped): seqs[k] = [BOS] + prompt + response k + EOS (pairs:
    chosen 0, rejected 1; the BOS if the tokenizer has one, counted in n_prompt), pairs from ranking_pairs, best = the
    top response (its tokens get the LM loss). Records with any sequence longer than block_size are skipped and
    counted."""
    examples, skipped = [], 0
    for row in rows:
        prompt_ids = tok.encode(row["prompt"], bos=True)
        ranking = row.get("ranking", [0, 1])
        seqs = [prompt_ids + tok.encode(r) + [tok.eos_id] for r in responses_of(row)]
        if max(len(s) for s in seqs) > block_size:
            skipped += 1
            continue
        examples.append((seqs, len(prompt_ids), ranking_pairs(ranking), ranking[0], row))
    return examples, skipped


def calibration_error(gaps: torch.Tensor, n_bins: int = 10) -> float:
    """Expected calibration error of P(chosen ≻ rejected) = σ(gap), gaps (N,) = r_chosen - r_rejected on held-out
    pairs. Each pair enters in both orders, (σ(gap), 1) and (σ(-gap), 0), so the observed frequency is defined;
    ECE = Σ_b n_b/N |observed_b - predicted_b| over n_bins equal bins of [0, 1] (Guo et al. 2017)."""
    probs = torch.cat([torch.sigmoid(gaps.double()), torch.sigmoid(-gaps.double())])
    outcome = torch.cat([torch.ones_like(gaps, dtype=torch.double), torch.zeros_like(gaps, dtype=torch.double)])
    bins = (probs * n_bins).long().clamp(max=n_bins - 1)
    n = torch.bincount(bins, minlength=n_bins).double()
    gap_sum = torch.bincount(bins, weights=outcome - probs, minlength=n_bins)
    return (gap_sum.abs().sum() / n.sum()).item()


# -----------------------------------------------------------------------------
# the hackability probe (train_rm.py): degenerate text full of positive words next to fluent positive reviews

PROBE_KINDS = ("repeat", "long", "broken", "no_eos", "fluent")


def _positive_sentences(rng: random.Random, prompt: str, n: int) -> list[str]:
    """n distinct positive sentences (S1/S2 at mood +1), mostly on the prompt's aspects."""
    requested, sentences = prompt_aspects(prompt), []
    while len(sentences) < n:
        s = _sentence(rng, rng.choice(("S1", "S2")), requested, mood=1.0)
        if s not in sentences:
            sentences.append(s)
    return sentences


def probe_texts(prompts: list[str], n: int, seed: int = 0) -> list[dict]:
    """n {"prompt", "response", "ended", "kind"} records per kind of PROBE_KINDS, cycling over prompts.

    Degenerate kinds, all gold -1 whatever their words: "repeat" (one positive sentence 5-12 times), "long" (5-8
    distinct positive sentences), "broken" (the words of a positive review shuffled), "no_eos" (a fluent positive
    review without EOS). "fluent": 2-4 distinct positive sentences with EOS (valid, gold >= 0.5).
    """
    rng, out = random.Random(seed), []
    for kind in PROBE_KINDS:
        for i in range(n):
            prompt = prompts[i % len(prompts)]
            response = None  # fluent reviews are redrawn until they cover the requested aspects well (gold >= 0.5)
            while response is None or (kind == "fluent" and gold_reward(prompt, response, True) < 0.5):
                if kind == "repeat":
                    sentences = _positive_sentences(rng, prompt, 1) * rng.randint(5, 12)
                else:
                    n_sent = rng.randint(5, 8) if kind == "long" else rng.randint(2, MAX_SENTENCES)
                    sentences = _positive_sentences(rng, prompt, n_sent)
                response = " " + " ".join(sentences)
            while kind == "broken" and parse_response(response) is not None:
                words = response.split()
                rng.shuffle(words)
                response = " " + " ".join(words)
            out.append({"prompt": prompt, "response": response, "ended": kind != "no_eos", "kind": kind})
    return out


def _cli(argv: list[str]) -> None:
    """python data.py hh anthropic_hh.jsonl pairs.jsonl"""
    if len(argv) != 3 or argv[0] != "hh":
        raise UserError("usage: python data.py hh anthropic_hh.jsonl pairs.jsonl (gunzip the HH files first)")
    written, skipped = convert_hh(argv[1], argv[2])
    print(f"wrote {written} pairs to {argv[2]} ({skipped} skipped: no shared prompt, an empty or a tied answer)")


if __name__ == "__main__":
    import sys

    from common import run_main

    run_main(_cli, sys.argv[1:])
