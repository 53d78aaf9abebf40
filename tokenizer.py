"""Tokenizers behind one small interface (`Tokenizer`): the built-in task's byte-level BPE and GPT-2's through
tiktoken, any Hugging Face tokenizer through transformers, chat templates (or HH's "\n\nHuman: ... \n\nAssistant:"
without one), loading by name (`load_tokenizer`), BPE training for the built-in task (`train_bpe`) and the export as
files that transformers' AutoTokenizer reads (`export_tokenizer`). Conversations: docs/design.md §3.
"""

import base64
import json
import os
import re
import tempfile

import tiktoken
import torch

from common import UserError, write_atomic

# GPT-2's split pattern (the same string tiktoken's r50k_base uses, minus the possessive quantifiers)
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


class Tokenizer:
    """One interface over a tiktoken.Encoding (task BPE, GPT-2) or a Hugging Face tokenizer.

    bos_id: None, or the BOS a Hugging Face tokenizer adds (Llama); encode(text, bos=True) only where a sequence
    starts. chat: conversations go through the chat template and its end-of-turn token is eos_id; without one they
    take HH's layout as text."""

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
            start = reply[0]["content"][:20] if reply else ""
            raise UserError(
                f"tokenizer {self.name!r}: its chat template does not render the prompt as a prefix of the reply "
                f"{start!r}... (a reply that starts with whitespace can merge with the template's last token: strip it)"
            )
        return _through_last(whole[len(head) :], self.eos_id)

    def conversation(self, messages: list[dict], learn_from: int = 0) -> tuple[list[int], list[int]]:
        """SFT on a conversation -> (ids through the last assistant turn, target mask: 1 on every assistant turn through
        its end-of-turn), read in the rendering of the whole conversation. learn_from: the first message whose
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


SAME_TOKENIZER_PROMPTS = 256  # the prompts same_tokenizer encodes with both


def same_tokenizer(a: Tokenizer, b: Tokenizer, prompts: list) -> str | None:
    """None when a and b encode alike, else their first difference as a short phrase: the same saved state, or the
    same eos, pad and bos ids, vocabulary (its size; its tokens where both are of one kind), chat template and ids of
    the first 256 prompts (strings or conversations, as data.prompt_ids encodes them). A copy of a Hugging Face folder,
    or the task's tokenizer exported and loaded back (hf:DIR), is the same tokenizer in another place."""
    if a.state() == b.state():
        return None
    for name, label in (("eos_id", "eos"), ("pad_id", "pad"), ("bos_id", "bos"), ("vocab_size", "vocabulary size")):
        if getattr(a, name) != getattr(b, name):
            return f"{label} {getattr(a, name)} against {getattr(b, name)}"
    # tokens the prompts may not hold (a response's); a tiktoken BPE and a Hugging Face tokenizer spell them apart
    one_kind = isinstance(a.backend, tiktoken.Encoding) == isinstance(b.backend, tiktoken.Encoding)
    if one_kind and _vocabulary(a) != _vocabulary(b):
        return "another vocabulary of the same size"
    a_template, b_template = _chat_template(a), _chat_template(b)
    if a_template != b_template and a_template and b_template:
        return "another chat template"
    if a_template != b_template:
        return "a chat template against none" if a_template else "no chat template against one"
    for i, prompt in enumerate(prompts[:SAME_TOKENIZER_PROMPTS]):
        # a string as it is (BOS first where there is one), a conversation rendered with the generation prompt
        a_ids = a.encode(prompt, bos=True) if isinstance(prompt, str) else a.render(prompt, True)
        b_ids = b.encode(prompt, bos=True) if isinstance(prompt, str) else b.render(prompt, True)
        if a_ids != b_ids:
            return f"prompt {i + 1} encodes to other ids"
    return None


def _vocabulary(tok: Tokenizer) -> dict:
    """Token -> id: a tiktoken BPE's ranks, a Hugging Face tokenizer's vocabulary."""
    if isinstance(tok.backend, tiktoken.Encoding):
        return tok.backend._mergeable_ranks
    return tok.backend.get_vocab()


def _chat_template(tok: Tokenizer) -> str | dict | None:
    """The chat template tok renders conversations with (a Hugging Face tokenizer's, when chat), else None."""
    return tok.backend.chat_template if tok.chat else None


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
    # a path that can only be local (/, ./, ../, ~, or more than one /) is never looked up on the hub
    if name_or_path.startswith((".", "/", "~")) or not HUB_NAME.fullmatch(name_or_path):
        return f"no folder {name_or_path} here"
    return None


def hub_error(name_or_path: str, what: str, error: Exception, folder: bool = True) -> str:
    """A failed load of a Hugging Face name or folder as one line: a folder's reason; for a name with no folder of
    that name here, that first (folder: the name may be a folder, an hf: spec), then what to do offline."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if os.path.isdir(name_or_path):
        return f"could not load {what} from the folder {name_or_path}: {first_line}"
    hub = (
        f"could not load {what} {name_or_path!r} from the hub (offline? pass a local folder saved with "
        "save_pretrained, or set HF_HOME to a cache that has it, and HF_HUB_OFFLINE=1 to skip the network's retries): "
        f"{first_line}"
    )
    return f"no folder {name_or_path} here, and {hub}" if folder else hub


def _through_last(ids: list[int], token: int) -> list[int]:
    """ids up to and including the last `token` (what a template renders after the end-of-turn left out); all of
    them when token is not there."""
    positions = [i for i, t in enumerate(ids) if t == token]
    return ids[: positions[-1] + 1] if positions else ids


HH_NAMES = {"system": "System", "user": "Human", "assistant": "Assistant"}
HH_ASSISTANT = "\n\nAssistant:"  # where an HH dialogue's reply starts


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
    # a probe word may be unknown; the pad id stays, since many tokenizers pad with their end-of-turn token
    special = set(hf.all_special_ids) - {hf.unk_token_id}
    return next((token for token in list(whole)[len(head) :] if token in special), None)


HF_BACKENDS = {}  # (name or folder, its files' sizes and times) -> the transformers tokenizer read from it


def hf_backend(name_or_path: str):
    """AutoTokenizer.from_pretrained(name_or_path), read once a process while a folder's files stay as they were: a
    stage reads the tokenizer of each checkpoint it loads (policy, reference, reward model), half a second each for
    SmolLM2's. The object is shared, never changed: each Tokenizer around it keeps its own ids."""
    from transformers import AutoTokenizer

    stamps = []  # a folder's files as (name, size, mtime): a file written anew reads anew
    if os.path.isdir(name_or_path):
        for entry in sorted(os.scandir(name_or_path), key=lambda entry: entry.name):
            if entry.is_file():
                stat = entry.stat()
                stamps.append((entry.name, stat.st_size, stat.st_mtime_ns))
    key = (name_or_path, tuple(stamps))
    if key not in HF_BACKENDS:
        try:
            HF_BACKENDS[key] = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as e:
            raise UserError(hub_error(name_or_path, "the tokenizer", e)) from None
    return HF_BACKENDS[key]


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
        problem = hf_source_problem(spec[3:], tokenizer=True)
        if problem:
            raise UserError(problem)
        hf = hf_backend(spec[3:])
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
