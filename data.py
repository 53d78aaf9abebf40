"""Data: tokenizers behind one interface, JSONL readers with validation, converters from public formats (HH),
encoding, padding and the global sample order. The built-in task itself (its grammar, gold reward and files) is
task.py.
"""

import base64
import json
import os
import re

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
            tok = bpe_tokenizer(d["name"], [base64.b64decode(r) for r in d["ranks"]], d["pat_str"])
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
# JSONL readers


def read_train_eval(train_path: str, eval_path: str | None, kind: str) -> tuple[list[dict], list[dict]]:
    """The training records (--data) and the held-out ones: eval_path's (--eval-data), or without one the last 5 % of
    train_path's (at least one record)."""
    train_rows = read_jsonl(train_path, kind, "--data")
    if eval_path is not None:
        return train_rows, read_jsonl(eval_path, kind, "--eval-data")
    n_eval = max(1, len(train_rows) // 20)
    return train_rows[:-n_eval], train_rows[-n_eval:]


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


def read_jsonl(path: str, kind: str, flag: str | None = None) -> list[dict]:
    """Read and validate a UTF-8 JSONL file of kind "sft", "text", "prompts", "pairs" or "hh" (Anthropic-HH); a missing
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


def encode_prompts(tok: Tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a generation batch: [BOS] + prompt ids (the BOS if the tokenizer has one), left-padded -> (query
    (B, P) long, query_mask (B, P) float)."""
    return pad_left([tok.encode(prompt, bos=True) for prompt in prompts], tok.pad_id)


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
