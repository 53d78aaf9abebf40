"""Data: tokenizers behind one interface, JSONL readers with validation, converters from public formats (HH),
encoding, padding and the global sample order. The built-in task itself (its grammar, gold reward and files) is
task.py.
"""

import base64
import json
import os
import re
import tempfile

import tiktoken
import torch

from common import UserError, write_atomic

# -----------------------------------------------------------------------------
# tokenizers

# GPT-2's split pattern (the same string tiktoken's r50k_base uses, minus the possessive quantifiers)
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


class Tokenizer:
    """One small interface over a tiktoken.Encoding (task BPE, GPT-2) or a Hugging Face tokenizer.

    bos_id: the id a sequence starts with, or None. A Hugging Face tokenizer whose own encode adds a BOS (Llama) gets
    one; the task BPE and GPT-2 have none. encode(text, bos=True) prepends it: pass bos=True for what starts a sequence
    (a prompt, a {"text"} row) and never for a response that follows a prompt, so the BOS appears once, first.
    chat: the tokenizer has a chat template (DESIGN §3, "Conversational data"): conversations are rendered by it, and
    its end-of-turn token (<|im_end|>, <|eot_id|>, ...) is eos_id, every response's stop and score token. Without
    one, conversations take HH's layout ("\n\nHuman: ...\n\nAssistant: ...") as text."""

    def __init__(
        self,
        backend,
        name: str,
        eos_id: int,
        pad_id: int,
        vocab_size: int,
        source: dict,
        bos_id: int | None = None,
        chat: bool = False,
    ):
        assert pad_id != eos_id, f"pad_id {pad_id} must differ from eos_id {eos_id}"
        self.backend, self.name, self.eos_id, self.pad_id, self.vocab_size = backend, name, eos_id, pad_id, vocab_size
        self.bos_id = bos_id
        self.chat = chat
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

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        """A conversation's ids: the chat template's rendering (generation_prompt: ending with the assistant turn's
        header), a BOS first only where the tokenizer has one and the template added none; without a template, HH's
        layout as text (generation_prompt: ending with "\n\nAssistant:")."""
        if not self.chat:
            return self.encode(hh_text(messages, generation_prompt), bos=True)
        rendered = self.backend.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
        )
        ids = list(rendered["input_ids"])
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id] + ids

    def render_text(self, messages: list[dict], generation_prompt: bool) -> str:
        """The rendered conversation as a string (what --reward-fn and the logs see of a conversational prompt)."""
        if not self.chat:
            return hh_text(messages, generation_prompt)
        return self.backend.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def reply(self, prompt: list[dict], reply: list[dict]) -> list[int]:
        """The ids an assistant reply (its messages) adds after the prompt rendered with the generation prompt,
        through its last end-of-turn token (in place of an appended EOS, never both); without a template, the
        reply's text in HH's layout and EOS."""
        if not self.chat:
            return self.encode(hh_text(reply, False, after_prompt=True)) + [self.eos_id]
        head = self.render(prompt, True)
        whole = self.render(prompt + reply, False)
        if whole[: len(head)] != head:
            raise UserError(f"tokenizer {self.name!r}: its chat template does not render the prompt as a prefix")
        return _through_last(whole[len(head) :], self.eos_id)

    def conversation(self, messages: list[dict], learn_from: int = 0) -> tuple[list[int], list[int]]:
        """SFT on a conversation: its ids through the last assistant turn and a target mask (per token, 1 = learned)
        that covers every assistant turn, each from its first token through its end-of-turn, both read in the
        rendering of the whole conversation: a turn starts where the conversation before it, rendered with the
        generation prompt, ends (most templates mark no assistant spans themselves; that rendering must be a
        prefix, or one line says so) and ends at its first end-of-turn token. learn_from: the first message whose
        assistant turns are learned (a prompt-completion record learns its completion only)."""
        if not self.chat:  # HH's layout: each assistant turn's text learned, its "\n\nAssistant:" header not
            ids, mask = [], []
            for i, message in enumerate(messages):
                learned = message["role"] == "assistant" and i >= learn_from
                head = self.encode(hh_text([message], False) if not learned else HH_ASSISTANT, bos=i == 0)
                text = self.encode(f" {message['content']}") if learned else []
                ids += head + text
                mask += [0] * len(head) + [1] * len(text)
            return ids + [self.eos_id], mask + [1]
        whole = self.render(messages, False)
        mask = [0] * len(whole)
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < learn_from:
                continue
            head = self.render(messages[:i], True)
            if whole[: len(head)] != head:
                raise UserError(f"tokenizer {self.name!r}: its chat template does not render each turn as a prefix")
            # the turn as the whole conversation renders it (a template may re-render earlier turns, as Qwen3
            # strips their <think>), through its own end-of-turn and never into the next turn
            rest = whole[len(head) :]
            if self.eos_id not in rest:
                raise UserError(f"tokenizer {self.name!r}: an assistant turn renders without its end-of-turn token")
            end = len(head) + rest.index(self.eos_id) + 1
            mask[len(head) : end] = [1] * (end - len(head))
        end = max(i for i, m in enumerate(mask) if m) + 1
        return whole[:end], mask[:end]

    def state(self) -> dict:
        """The ids and what rebuilds the backend; a Hugging Face tokenizer's also says bos_id (its BOS decision) and
        chat (whether its chat template renders conversations, its end-of-turn token the EOS)."""
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
            tok = bpe_tokenizer(d["name"], [base64.b64decode(r) for r in d["ranks"]], d["pat_str"])
        else:  # a state without chat was saved before chat templates were used: the tokenizer's own EOS then
            tok = load_tokenizer(d["spec"], chat=d.get("chat", False))
        if "bos_id" not in d:
            tok.bos_id = None
            tok._source.pop("bos_id", None)
        got = (tok.eos_id, tok.pad_id, tok.vocab_size, tok.bos_id)
        want = (d["eos_id"], d["pad_id"], d["vocab_size"], d.get("bos_id"))
        if got != want:
            raise UserError(f"tokenizer {d['name']!r} changed: (eos, pad, vocab, bos) is {got} now, {want} when saved")
        return tok


def bpe_tokenizer(name: str, ranks: list[bytes], pat_str: str) -> Tokenizer:
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # org/name on the Hugging Face hub


def hf_source_problem(name_or_path: str, tokenizer: bool = False) -> str | None:
    """What is wrong with a Hugging Face name or folder before transformers tries it (its own messages run to many
    lines), or None: a folder that does not exist, a file, a folder without tokenizer files (tokenizer: the
    tokenizer is wanted). A hub name (org/name) is left to try."""
    if os.path.isdir(name_or_path):
        if tokenizer and not any(os.path.exists(os.path.join(name_or_path, f)) for f in TOKENIZER_FILES):
            return (
                f"{name_or_path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the tokenizer there "
                "with save_pretrained"
            )
        return None
    if os.path.exists(name_or_path):
        return f"{name_or_path} is a file, not a Hugging Face folder (config.json, weights, tokenizer files)"
    if name_or_path.startswith((".", "/", "~")) or not HUB_NAME.fullmatch(name_or_path):
        return f"{name_or_path}: no such folder"
    return None


def hub_error(name_or_path: str, what: str, error: Exception) -> str:
    """A failed load of a hub name or folder as one line: the reason, and what to do offline."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"could not load {what} {name_or_path!r} (offline? pass a local folder saved with save_pretrained, or set "
        f"HF_HOME to a cache that has it, and HF_HUB_OFFLINE=1 to skip the network's retries): {first_line}"
    )


def _through_last(ids: list[int], token: int) -> list[int]:
    """ids up to and including the last `token` (what a template renders after the end-of-turn left out); all of
    them when token is not there."""
    positions = [i for i, t in enumerate(ids) if t == token]
    return ids[: positions[-1] + 1] if positions else ids


HH_NAMES = {"system": "System", "user": "Human", "assistant": "Assistant"}


def hh_text(messages: list[dict], generation_prompt: bool, after_prompt: bool = False) -> str:
    """A conversation in Anthropic HH's layout, "\n\nHuman: ...\n\nAssistant: ...", the text of a tokenizer with no
    chat template; generation_prompt: it ends with "\n\nAssistant:"; after_prompt: the messages are a reply whose
    first assistant turn follows a prompt that ended so (its text only, " ..." )."""
    parts = []
    for i, message in enumerate(messages):
        if after_prompt and i == 0 and message["role"] == "assistant":
            parts.append(f" {message['content']}")
        else:
            parts.append(f"\n\n{HH_NAMES[message['role']]}: {message['content']}")
    return "".join(parts) + ("\n\nAssistant:" if generation_prompt else "")


def _end_of_turn(hf) -> int | None:
    """The id a Hugging Face chat template closes an assistant turn with: the first special token after the
    generation prompt in a rendered probe conversation (None when there is none: a template without one)."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    head = hf.apply_chat_template(probe[:1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    whole = hf.apply_chat_template(probe, tokenize=True, return_dict=True)["input_ids"]
    special = set(hf.all_special_ids) - {hf.unk_token_id, hf.pad_token_id}  # a probe word may be unknown
    return next((token for token in list(whole)[len(head) :] if token in special), None)


def load_tokenizer(spec: str, chat: bool | None = None) -> Tokenizer:
    """ "gpt2" (tiktoken r50k_base), "hf:<name-or-path>" (transformers.AutoTokenizer) or a task tokenizer.json path.
    chat: use a Hugging Face tokenizer's chat template (None: when it has one; False: its own EOS, as a checkpoint
    saved before chat templates were used)."""
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

        problem = hf_source_problem(spec[3:], tokenizer=True)
        if problem:
            raise UserError(problem)
        try:
            hf = AutoTokenizer.from_pretrained(spec[3:])
        except Exception as e:
            raise UserError(hub_error(spec[3:], "the tokenizer", e)) from None
        if hf.eos_token_id is None:
            raise UserError(f"tokenizer {spec!r} has no eos token")
        vocab_size = len(hf)
        chat = bool(getattr(hf, "chat_template", None)) if chat is None else chat
        eos_id = hf.eos_token_id
        if chat:  # the template's end-of-turn token stops and scores every response
            eos_id = _end_of_turn(hf)
            if eos_id is None:
                raise UserError(f"tokenizer {spec!r}: its chat template closes an assistant turn with no special token")
        pad_id = hf.pad_token_id if hf.pad_token_id is not None and hf.pad_token_id != eos_id else vocab_size
        bos_id = _hf_bos_id(hf)
        source = {"spec": spec, "bos_id": bos_id} | ({"chat": True} if chat else {})
        return Tokenizer(hf, spec, eos_id, pad_id, vocab_size, source=source, bos_id=bos_id, chat=chat)
    if not os.path.isfile(spec):
        raise UserError(f"{spec}: no such tokenizer file (expected 'gpt2', 'hf:<name-or-path>' or a tokenizer.json)")
    try:
        with open(spec) as f:
            return Tokenizer.from_state(json.load(f))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{spec}: not a tokenizer file ({type(e).__name__}: {e})") from None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (Radford et al. 2019's encoder.py), the
    vocabulary file's spelling of a byte-level BPE token."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a byte-level BPE given as tiktoken's ranks, in rank order: the two parts each multi-byte
    token is built from, found by running BPE over its bytes with the merges of lower rank only."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([byte]) for byte in token]
        while len(parts) > 2:
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], b"".join(parts[1:])))
    return merges


def export_tokenizer(tok: Tokenizer, out_dir: str) -> str:
    """Write tok to out_dir as a Hugging Face tokenizer that AutoTokenizer.from_pretrained(out_dir) loads with the
    same ids (--export-hf): a Hugging Face tokenizer as it saves itself; a tiktoken byte-level BPE with GPT-2's split
    pattern (GPT-2's r50k_base, the built-in task's) as GPT-2's vocab.json and merges.txt, built from its ranks.
    Returns the line to print."""
    if not isinstance(tok.backend, tiktoken.Encoding):
        tok.backend.save_pretrained(out_dir)
        return f"tokenizer {tok.name} saved with it"
    if tok.backend._pat_str != GPT2_PAT:
        return f"tokenizer {tok.name}: its split pattern is not GPT-2's, so no Hugging Face tokenizer expresses it"
    from transformers import GPT2TokenizerFast

    ranks = tok.backend._mergeable_ranks
    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {spell(token): rank for token, rank in ranks.items()} | {EOT: tok.eos_id}
    with tempfile.TemporaryDirectory() as folder:
        vocab_file, merges_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        write_atomic(vocab_file, json.dumps(vocab, ensure_ascii=False))
        lines = [f"{spell(a)} {spell(b)}" for a, b in bpe_merges(ranks)]
        write_atomic(merges_file, "#version: 0.2\n" + "\n".join(lines) + "\n")
        hf = GPT2TokenizerFast(vocab_file, merges_file, unk_token=EOT, bos_token=EOT, eos_token=EOT)
        hf.save_pretrained(out_dir)
    return f"tokenizer {tok.name} written as GPT-2's byte-level BPE files"


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
# JSONL readers


def read_train_eval(train_path: str, eval_path: str | None, kind: str) -> tuple[list[dict], list[dict]]:
    """The training records (--data) and the held-out ones: eval_path's (--eval-data), or without one the last 5 % of
    train_path's (at least one record)."""
    train_rows = read_jsonl(train_path, kind, "--data")
    if eval_path is not None:
        return train_rows, read_jsonl(eval_path, kind, "--eval-data")
    n_eval = max(1, len(train_rows) // 20)
    return train_rows[:-n_eval], train_rows[-n_eval:]


ROLES = ("system", "user", "assistant")


def _messages_problem(value, field: str, assistant_only: bool = False, last_assistant: bool = False) -> str | None:
    """What is wrong with a conversation field (a list of {"role", "content"} messages), or None."""
    if not isinstance(value, list) or not value:
        return f"field {field!r} must be a non-empty list of messages"
    for turn, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            return f"field {field!r} turn {turn}: expected a message object, got {type(message).__name__}"
        for key in ("role", "content"):
            if key not in message:
                return f"field {field!r} turn {turn}: missing {key!r}"
            if not isinstance(message[key], str):
                return f"field {field!r} turn {turn}: {key!r} must be a string, got {type(message[key]).__name__}"
        if message["role"] not in ROLES:
            return f"field {field!r} turn {turn}: role {message['role']!r} is not one of {', '.join(ROLES)}"
        if assistant_only and message["role"] != "assistant":
            return f"field {field!r} turn {turn}: a reply holds assistant turns only, not {message['role']!r}"
    if last_assistant and value[-1]["role"] != "assistant":
        return (
            f"field {field!r}: the last turn must be the assistant's (it is what SFT learns), not {value[-1]['role']!r}"
        )
    return None


def shared_head(a: list, b: list) -> int:
    """How many leading messages two conversations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _trl_problem(obj: dict, kind: str) -> str | None:
    """What is wrong with a record in one of TRL's other layouts (DESIGN §3), or None: SFT prompt-completion
    {"prompt", "completion"} (strings, or messages with the completion's assistant turns), implicit-prompt
    preferences {"chosen": [messages], "rejected": [messages]} (their shared head is the prompt)."""
    if kind == "sft":
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return None if prompt else "field 'prompt' is empty (a prompt needs at least one token)"
        if not isinstance(prompt, list) or not isinstance(completion, list):
            return "fields 'prompt' and 'completion' must be both strings or both lists of messages"
        return _messages_problem(prompt, "prompt") or _messages_problem(completion, "completion", assistant_only=True)
    for key in ("chosen", "rejected"):
        if not isinstance(obj[key], list):
            return (
                f"missing field 'prompt': an implicit prompt needs 'chosen' and 'rejected' as lists of messages, "
                f"not {type(obj[key]).__name__} (HH's dialogue strings: python data.py hh)"
            )
        problem = _messages_problem(obj[key], key)
        if problem:
            return problem
    head = shared_head(obj["chosen"], obj["rejected"])
    if head == 0:
        return "fields 'chosen' and 'rejected' share no leading turn: an implicit prompt is their shared head"
    for key in ("chosen", "rejected"):
        problem = _messages_problem(obj[key][head:], f"{key} after the shared prompt", assistant_only=True)
        if problem:
            return problem
    return None


def canonical(obj: dict, kind: str) -> dict:
    """A valid record in this repo's layout: TRL's prompt-completion SFT as {"prompt", "response"} (strings) or
    {"messages", "learn_from"} (the completion's first turn: only it and later turns are learned), implicit-prompt
    preferences as {"prompt", "chosen", "rejected"} with the shared head as the prompt."""
    if kind == "sft" and "completion" in obj:
        if isinstance(obj["prompt"], str):
            return {"prompt": obj["prompt"], "response": obj["completion"]}
        return {"messages": obj["prompt"] + obj["completion"], "learn_from": len(obj["prompt"])}
    if kind == "pairs" and "prompt" not in obj:
        head = shared_head(obj["chosen"], obj["rejected"])
        return {"prompt": obj["chosen"][:head], "chosen": obj["chosen"][head:], "rejected": obj["rejected"][head:]}
    return obj


def _check_fields(obj: dict, kind: str) -> str | None:
    """What is wrong with one record of this kind, or None. Conversational records (DESIGN §3): SFT {"messages"},
    prompts {"prompt": [messages]}, preferences {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    (the replies' assistant turns); and TRL's prompt-completion SFT and implicit-prompt preferences (_trl_problem)."""
    if kind == "sft" and "messages" in obj:
        return _messages_problem(obj["messages"], "messages", last_assistant=True)
    if kind == "sft" and "completion" in obj and "prompt" in obj:
        return _trl_problem(obj, kind)
    if kind == "pairs" and "prompt" not in obj and "chosen" in obj and "rejected" in obj:
        return _trl_problem(obj, kind)
    if kind == "ultrafeedback":
        for key in ("chosen", "rejected"):
            problem = _messages_problem(obj.get(key), key) if key in obj else f"missing field {key!r}"
            if problem:
                return problem
        return None
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
    conversational = kind in ("prompts", "pairs") and isinstance(obj.get("prompt"), list)
    for k in fields:
        if k not in obj:
            return f"missing field {k!r} (a {kind} record needs {', '.join(fields)})"
        if k in ("responses", "ranking"):
            continue
        if conversational:
            problem = _messages_problem(obj[k], k, assistant_only=k != "prompt")
            if problem:
                return problem
        elif not isinstance(obj[k], str):
            return f"field {k!r} must be a string, got {type(obj[k]).__name__}"
    if "prompt" in fields and not obj["prompt"]:  # an all-empty batch has nothing to generate from
        return "field 'prompt' is empty (a prompt needs at least one token)"
    if "responses" in fields:
        resp, ranking = obj["responses"], obj["ranking"]
        kind_of = list if conversational else str
        if not isinstance(resp, list) or len(resp) < 2 or not all(isinstance(r, kind_of) for r in resp):
            what = "conversations (lists of assistant messages)" if conversational else "strings"
            return f"field 'responses' must be a list of at least 2 {what}"
        for r in resp if conversational else []:
            problem = _messages_problem(r, "responses", assistant_only=True)
            if problem:
                return problem
        ints = isinstance(ranking, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ranking)
        if not ints or sorted(ranking) != list(range(len(resp))):
            return f"field 'ranking' must be a permutation of 0..{len(resp) - 1}"
    return None


def write_jsonl(path: str, rows: list[dict]) -> None:
    """One JSON object a line, written atomically (common.write_atomic)."""
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: str, kind: str, flag: str | None = None) -> list[dict]:
    """Read and validate a UTF-8 JSONL file of kind "sft", "text", "prompts", "pairs", "hh" (Anthropic-HH) or
    "ultrafeedback" (UltraFeedback-binarized); a missing
    or empty file, bad UTF-8, bad JSON, a line that is not an object or a bad field is a one-line UserError
    `path:line: what is wrong` (a missing file names the flag that gave it). Blank lines are skipped."""
    if not os.path.isfile(path):
        raise UserError(f"{flag + ' ' if flag else ''}{path}: no such file")
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
            records.append(canonical(obj, kind))
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


def hh_messages(dialogue: str) -> list[dict]:
    """An HH dialogue ("\n\nHuman: ...\n\nAssistant: ...") as messages (hh_text's inverse)."""
    names = {f"\n\n{name}:": role for role, name in HH_NAMES.items()}
    pattern = "(" + "|".join(re.escape(marker) for marker in names) + ")"
    pieces = re.split(pattern, dialogue)
    messages = []
    for marker, content in zip(pieces[1::2], pieces[2::2]):
        messages.append({"role": names[marker], "content": content.strip()})
    return messages


def hh_pair_messages(pair: dict) -> dict:
    """An HH pair as a conversational one: the prompt's dialogue as messages, each answer one assistant turn."""
    prompt = hh_messages(pair["prompt"].removesuffix(HH_ASSISTANT))
    replies = {key: [{"role": "assistant", "content": pair[key].strip()}] for key in ("chosen", "rejected")}
    return {"prompt": prompt} | replies


def ultrafeedback_to_pair(chosen: list[dict], rejected: list[dict]) -> dict | None:
    """One UltraFeedback-binarized record (its chosen and rejected conversations, each repeating the user turns) ->
    {"prompt": the turns up to the last user one, "chosen"/"rejected": the assistant turns after it}; None when the
    two differ before that point, or a reply is empty, or both replies are the same."""
    last_user = [i for i, message in enumerate(chosen) if message["role"] == "user"]
    if not last_user:
        return None
    cut = last_user[-1] + 1
    prompt, chosen_reply, rejected_reply = chosen[:cut], chosen[cut:], rejected[cut:]
    if rejected[:cut] != prompt or not chosen_reply or not rejected_reply or chosen_reply == rejected_reply:
        return None
    if any(message["role"] != "assistant" for message in chosen_reply + rejected_reply):
        return None
    return {"prompt": prompt, "chosen": chosen_reply, "rejected": rejected_reply}


def convert(src: str, dst: str, kind: str, messages: bool = False) -> tuple[int, int]:
    """A public preference set as our preference JSONL at dst, written atomically; returns (written, skipped).
    kind hh: Anthropic-HH ({"chosen": str, "rejected": str} dialogues; messages: write conversational records);
    ultrafeedback: UltraFeedback-binarized ({"chosen": [messages], "rejected": [messages]}, each repeating the user
    turns, always conversational). A bad line stops before anything is written, with `path:line: what is wrong`."""
    if kind == "hh":
        pairs = [hh_to_pair(r["chosen"], r["rejected"]) for r in read_jsonl(src, "hh")]
        if messages:
            pairs = [hh_pair_messages(pair) if pair else None for pair in pairs]
    else:
        pairs = [ultrafeedback_to_pair(r["chosen"], r["rejected"]) for r in read_jsonl(src, "ultrafeedback")]
    rows = [p for p in pairs if p]
    skipped = len(pairs) - len(rows)
    if not rows:
        raise UserError(f"{src}: no usable record (every one lacks a shared prompt or has an empty or tied answer)")
    try:
        write_jsonl(dst, rows)
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


def prompt_ids(tok: Tokenizer, prompt) -> list[int]:
    """A prompt's ids: a string as it is ([BOS] + its text, the BOS if the tokenizer has one), a conversation (a list
    of messages) rendered with the assistant's generation prompt (Tokenizer.render)."""
    return tok.encode(prompt, bos=True) if isinstance(prompt, str) else tok.render(prompt, True)


def prompt_text(tok: Tokenizer, prompt) -> str:
    """A prompt as a string: itself, or a conversation rendered (what --reward-fn, samples and logs see)."""
    return prompt if isinstance(prompt, str) else tok.render_text(prompt, True)


def response_ids(tok: Tokenizer, prompt, response) -> list[int]:
    """A response's ids after its prompt: a string's text and EOS; a reply (assistant messages after a
    conversation) as the template renders it, through its end-of-turn token (Tokenizer.reply)."""
    return tok.encode(response) + [tok.eos_id] if isinstance(response, str) else tok.reply(prompt, response)


def encode_prompts(tok: Tokenizer, prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (strings or conversations) as a generation batch, left-padded -> (query (B, P) long, query_mask (B, P)
    float)."""
    return pad_left([prompt_ids(tok, prompt) for prompt in prompts], tok.pad_id)


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
    followed by the text. A {"messages"} row learns every assistant turn (Tokenizer.conversation). Rows longer than
    block_size tokens are skipped and counted.
    """
    examples, skipped = [], 0
    for row in rows:
        if "messages" in row:
            ids, loss_mask = tok.conversation(row["messages"], row.get("learn_from", 0))
            loss_mask = [0] + loss_mask[1:]  # the first token is never a target
        else:
            head = tok.encode(row.get("prompt", ""), bos=True)
            ids = head + tok.encode(row["response"] if "response" in row else row["text"]) + [tok.eos_id]
            n_masked = max(len(head), 1) if mask_prompt else 1
            loss_mask = [0] * n_masked + [1] * (len(ids) - n_masked)
        if len(ids) > block_size:
            skipped += 1
            continue
        examples.append((ids, loss_mask))
    return examples, skipped


def sft_prompt(row: dict):
    """What an SFT record answers: its prompt, or a conversation before its last (assistant) turn (a prompt-completion
    record's: its prompt)."""
    if "messages" not in row:
        return row["prompt"]
    return row["messages"][: row["learn_from"]] if "learn_from" in row else row["messages"][:-1]


def sft_sequence(tok: Tokenizer, row: dict) -> list[int]:
    """An SFT record's whole sequence (prompt, response and its stop token): a reward model's calibration input."""
    if "messages" in row:
        return tok.conversation(row["messages"], row.get("learn_from", 0))[0]
    return prompt_ids(tok, row["prompt"]) + response_ids(tok, row["prompt"], row["response"])


def responses_of(row: dict) -> list:
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
        head = prompt_ids(tok, row["prompt"])
        ranking = row.get("ranking", [0, 1])
        seqs = [head + response_ids(tok, row["prompt"], r) for r in responses_of(row)]
        if max(len(s) for s in seqs) > block_size:
            skipped += 1
            continue
        examples.append((seqs, len(head), ranking_pairs(ranking), ranking[0], row))
    return examples, skipped


def as_conversation(row: dict) -> dict:
    """A string record as a conversation (DESIGN §3): the prompt as the user's turn, each answer as the assistant's;
    SFT {"prompt", "response"}, preferences (pairwise or K-wise) and prompts."""

    def reply(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text.strip()}]

    prompt = [{"role": "user", "content": row["prompt"]}]
    if "response" in row:
        return {"messages": prompt + reply(row["response"])}
    if "responses" in row:
        return {"prompt": prompt, "responses": [reply(r) for r in row["responses"]], "ranking": row["ranking"]}
    if "chosen" in row:
        return {"prompt": prompt, "chosen": reply(row["chosen"]), "rejected": reply(row["rejected"])}
    return {"prompt": prompt}


def to_conversations(src: str, dst: str) -> int:
    """The string records of src (SFT, preferences or prompts, told apart by their fields) as conversations at dst,
    written atomically; returns how many."""
    first = read_jsonl(src, "prompts")[0]
    kind = "sft" if "response" in first else "pairs" if "chosen" in first or "responses" in first else "prompts"
    rows = [as_conversation(row) for row in read_jsonl(src, kind)]
    write_jsonl(dst, rows)
    return len(rows)


def _cli(argv: list[str]) -> None:
    """python data.py hh anthropic_hh.jsonl pairs.jsonl [--messages] | ultrafeedback uf.jsonl pairs.jsonl |
    chat strings.jsonl conversations.jsonl"""
    usage = (
        "usage: python data.py hh anthropic_hh.jsonl pairs.jsonl [--messages] (gunzip the HH files first) | "
        "python data.py ultrafeedback ultrafeedback_binarized.jsonl pairs.jsonl | "
        "python data.py chat strings.jsonl conversations.jsonl"
    )
    messages = "--messages" in argv
    argv = [arg for arg in argv if arg != "--messages"]
    if len(argv) != 3 or argv[0] not in ("hh", "ultrafeedback", "chat") or (messages and argv[0] != "hh"):
        raise UserError(usage)
    if argv[0] == "chat":
        print(f"wrote {to_conversations(argv[1], argv[2])} conversations to {argv[2]}")
        return
    written, skipped = convert(argv[1], argv[2], argv[0], messages)
    print(f"wrote {written} pairs to {argv[2]} ({skipped} skipped: no shared prompt, an empty or a tied answer)")


if __name__ == "__main__":
    import sys

    from common import run_main

    run_main(_cli, sys.argv[1:])
