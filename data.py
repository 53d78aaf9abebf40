"""Data: JSONL readers with validation, converters from public formats (HH, UltraFeedback, conversations), encoding,
padding, the global sample order, the RL stages' prompt and pre-training text streams, and `TASKS`, the built-in
task of each --task. The record layouts: docs/design.md §3.
"""

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import arith
import guess
import rg
import task as reviews
from common import UserError, load_env, load_reward_fn, write_jsonl
from generate import observation_ids
from tokenizer import HH_ASSISTANT, HH_NAMES, Tokenizer, load_tokenizer, same_tokenizer

# the built-in tasks by --task (reviews: task.py): each module has build_task, is_valid, is_task_prompt, STEP_END and
# PTX_FROM_PRETRAIN with the same signatures. The single-turn ones (reviews, arith) have gold_reward and is_held_out
# too; the multi-turn one (guess) has ENV instead, its environment (--env's spelling), with TURNS and MAX_NEW_TOKENS,
# and its build_task writes no pairs nor pretrain file (builtin_files says so)
TASKS = {"reviews": reviews, "arith": arith, "guess": guess}


def builtin_task(args):
    """The built-in task of --task: a module of TASKS, or for rg:NAME the reasoning-gym dataset NAME under
    --task-config (rg.ReasoningGymTask, the same interface; its files built on first use)."""
    if args.task.startswith("rg:"):
        return rg.load(args.task.removeprefix("rg:"), args.task_config, args.task_dir, args.task_seed)
    return TASKS[args.task]


def builtin_files(args, needed: str, instead: str) -> dict[str, str]:
    """The built-in task's files (args.task, task_dir, task_seed), or a one-line error naming the flag to give
    instead when it has no `needed` file (--task guess and rg:NAME have no preference pairs)."""
    paths = builtin_task(args).build_task(args.task_dir, args.task_seed)
    if needed not in paths:
        raise UserError(
            f"--task {args.task} has no {needed} file (SFT, the RL stages and eval.py run it): give {instead}"
        )
    return paths


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
    """What is wrong with a record in one of TRL's other layouts, or None: SFT prompt-completion
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
    if kind in ("pairs", "kto") and "prompt" not in obj:
        head = shared_head(obj["chosen"], obj["rejected"])
        return {"prompt": obj["chosen"][:head], "chosen": obj["chosen"][head:], "rejected": obj["rejected"][head:]}
    return obj


def _sft_layout_problem(obj: dict) -> str | None:
    """An SFT record that names one role twice, or TRL's unpaired KTO layout (a 'label' marks the completions not to
    learn, which SFT would learn too): what is wrong, or None."""
    if "label" in obj:
        return "field 'label': an unpaired KTO record (desirable or not); SFT would learn every completion it holds"
    if "response" in obj and "completion" in obj:
        return "fields 'response' and 'completion' in one record: one response to learn, not two"
    if "messages" in obj and any(key in obj for key in ("prompt", "response", "completion")):
        return "fields 'messages' and 'prompt'/'response' in one record: a conversation or a prompt-response, not both"
    return None


TURN_ROLES = ("assistant", "env")


def _turns_problem(obj: dict) -> str | None:
    """What is wrong with an episode record {"prompt", "turns": [{"role": "assistant" | "env", "text"}, ...]} (the
    model's turns and the environment's observations in order, the last the model's), or None."""
    if any(key in obj for key in ("response", "completion", "messages")):
        return "fields 'turns' and 'response'/'completion'/'messages' in one record: an episode or a response, not both"
    prompt = obj.get("prompt")
    if isinstance(prompt, list):
        return _messages_problem(prompt, "prompt")
    if not isinstance(prompt, str) or not prompt:
        return "field 'prompt' of an episode record must be a non-empty string or a list of messages"
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        return "field 'turns' must be a non-empty list of turns"
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or turn.get("role") not in TURN_ROLES or not isinstance(turn.get("text"), str):
            return f'field \'turns\' turn {number}: expected {{"role": "assistant" or "env", "text": str}}'
    if turns[-1]["role"] != "assistant":
        return "field 'turns': the last turn must be the assistant's (an episode ends on a model turn)"
    return None


def _unpaired_problem(obj: dict) -> str | None:
    """What is wrong with TRL's unpaired KTO record {"prompt", "completion", "label": bool} (strings, or messages with
    the completion's assistant turns), or None."""
    for key in ("prompt", "completion", "label"):
        if key not in obj:
            return f"missing field {key!r} (an unpaired record needs prompt, completion, label)"
    if not isinstance(obj["label"], bool):
        return f"field 'label' must be true (desirable) or false (undesirable), got {type(obj['label']).__name__}"
    if any(key in obj for key in ("chosen", "rejected", "responses")):
        return "fields 'label' and 'chosen'/'rejected'/'responses' in one record: an unpaired record or a preference"
    return _trl_problem(obj, "sft")


def _check_fields(obj: dict, kind: str) -> str | None:
    """What is wrong with one record of this kind, or None. Conversational records: SFT
    {"messages"}, prompts {"prompt": [messages]}, preferences {"prompt": [messages], "chosen": [messages], "rejected":
    [messages]} (the replies' assistant turns); and TRL's prompt-completion SFT and implicit-prompt preferences
    (_trl_problem). Kind "kto": TRL's unpaired record (_unpaired_problem) or any preference record."""
    if kind == "kto" and ("label" in obj or "completion" in obj):
        return _unpaired_problem(obj)
    if kind == "kto":
        kind = "pairs"
    if kind == "sft" and "turns" in obj:
        return _turns_problem(obj)
    if kind == "sft":
        problem = _sft_layout_problem(obj)
        if problem:
            return problem
    if kind == "pairs" and "responses" in obj and ("chosen" in obj or "rejected" in obj):
        return "fields 'responses' and 'chosen'/'rejected' in one record: a ranking or a pair, not both"
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
            accepted = "a string or a list of messages" if kind in ("prompts", "pairs") else "a string"
            return f"field {k!r} must be {accepted}, got {type(obj[k]).__name__}"
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


class DuplicateKey(ValueError):
    """A JSON object with one key twice (json.loads would keep the last value)."""


def _unique_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, or DuplicateKey naming a key it holds twice."""
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise DuplicateKey(repr(key))
    return dict(pairs)


def read_jsonl(path: str, kind: str, flag: str | None = None) -> list[dict]:
    """Read and validate a UTF-8 JSONL file of kind "sft", "text", "prompts", "pairs", "kto", "hh" or
    "ultrafeedback"; anything malformed (a missing or empty file too) is a one-line UserError `path:line: what is
    wrong` (a missing file names its flag). Blank lines are skipped."""
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
                obj = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: bad JSON: {e.msg} (column {e.colno})") from None
            except DuplicateKey as e:
                raise UserError(
                    f"{path}:{lineno}: the key {e} appears twice in one object (which one is meant?)"
                ) from None
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

    def load_state_dict(self, state: dict) -> None:
        self.n, self.seed, self.epoch, self.pos = state["n"], state["seed"], state["epoch"], state["pos"]
        self._perm = None


def episode_ids(tok: Tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """An episode record's ids as generate.run_episodes makes them, and its loss mask: 1 on the model's tokens (each
    assistant turn's text and its EOS), 0 on the prompt and on each observation (encoded on its own, after the EOS or
    as the chat template's next user turn: generate.observation_ids)."""
    ids = prompt_ids(tok, row["prompt"])
    loss_mask = [0] * len(ids)
    for turn in row["turns"]:
        model_turn = turn["role"] == "assistant"
        turn_ids = tok.encode(turn["text"]) + [tok.eos_id] if model_turn else observation_ids(tok, turn["text"])
        ids += turn_ids
        loss_mask += [int(model_turn)] * len(turn_ids)
    return ids, loss_mask


def encode_sft(tok: Tokenizer, rows: list[dict], block_size: int, mask_prompt: bool) -> tuple[list, int]:
    """-> ([(ids, loss_mask), ...], n_skipped): ids = [BOS] + prompt + response + EOS (a BOS if the tokenizer has
    one), loss_mask[t] = 1 on targets: never the first token, nor a prompt token under mask_prompt. A {"text"} row has
    an empty prompt, a {"messages"} row learns every assistant turn, a {"turns"} row (an episode) the model's turns
    only, whatever mask_prompt (episode_ids); rows over block_size are skipped."""
    examples, skipped = [], 0
    for row in rows:
        if "turns" in row:
            ids, loss_mask = episode_ids(tok, row)
        elif "messages" in row:
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
    if "turns" in row:
        return episode_ids(tok, row)[0]
    return prompt_ids(tok, row["prompt"]) + response_ids(tok, row["prompt"], row["response"])


def drop_tied(rows: list[dict]) -> tuple[list[dict], int]:
    """Preference records without a tie: a pair whose chosen equals its rejected (or a ranking that holds one
    response twice) says nothing and is dropped. Returns (the others, how many were dropped)."""
    kept = [
        row for row in rows if len({json.dumps(response) for response in responses_of(row)}) == len(responses_of(row))
    ]
    return kept, len(rows) - len(kept)


def responses_of(row: dict) -> list:
    """A preference record's responses: [chosen, rejected], or the K-wise "responses" (an unpaired record's:
    [completion])."""
    if "completion" in row:
        return [row["completion"]]
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


def longest_sequence(example) -> int:
    """An encoded record's longest sequence (encode_prefs's and encode_kto's examples hold their sequences first):
    a rank's records are sorted by it into micro-batches."""
    return max(len(seq) for seq in example[0])


def encode_kto(tok, rows: list[dict], block_size: int) -> tuple[list, int]:
    """KTO's examples from unpaired records and preferences: ([(seqs, n_prompt, labels, row), ...], n_skipped) with
    seqs as in encode_prefs and labels[k] True for a desirable sequence: an unpaired record's completion with its
    label, a pair's chosen (True) and rejected (False), a ranking's top (True) and bottom (False). Records with any
    sequence longer than block_size are skipped and counted."""
    examples, skipped = [], 0
    for row in rows:
        head = prompt_ids(tok, row["prompt"])
        if "label" in row:
            responses, labels = [row["completion"]], [row["label"]]
        else:
            ranking = row.get("ranking", [0, 1])
            responses = [responses_of(row)[ranking[0]], responses_of(row)[ranking[-1]]]
            labels = [True, False]
        seqs = [head + response_ids(tok, row["prompt"], r) for r in responses]
        if max(len(s) for s in seqs) > block_size:
            skipped += 1
            continue
        examples.append((seqs, len(head), labels, row))
    return examples, skipped


# -----------------------------------------------------------------------------
# the RL stages' prompts and pre-training text


@dataclass
class RLData:
    """An RL run's data (load_prompts)."""

    prompts: list  # the prompts that leave room for --max-new-tokens in the context
    too_long: list[int]  # the line numbers of those that do not, skipped
    prompts_path: str  # the prompts' file: --prompts, or the built-in task's
    ptx: list  # the pre-training texts encoded, (ids, loss mask) each
    ptx_too_long: int  # pre-training texts longer than the context, skipped
    gold_fn: Optional[Callable]  # the gold reward on the built-in task, else None
    ptx_path: Optional[str]  # the ptx texts' file: --ptx-data, or the reviews task's own (None: no ptx text)
    reward_fn: Optional[Callable]  # --reward-fn, tried on the first prompt (None: none given)
    rows: list = field(default_factory=list)  # the kept prompts' whole records, an environment's input
    make_env: Optional[Callable] = None  # make_env(row): an episode's environment (env_spec), tried on the first row

    def skipped(self) -> str:
        """The start-up count of the prompts too long, the first 5 by line: `3 too long, skipped: p.jsonl:7, 9`."""
        if not self.too_long:
            return "0 too long, skipped"
        lines = ", ".join(str(line) for line in self.too_long[:5]) + (", ..." if len(self.too_long) > 5 else "")
        return f"{len(self.too_long)} too long, skipped: {self.prompts_path}:{lines}"


def record_lines(path: str) -> list[int]:
    """The line number of each record read_jsonl reads from path (blank lines skipped)."""
    with open(path, "rb") as f:
        return [lineno for lineno, raw in enumerate(f, start=1) if raw.strip()]


def load_prompts(args, tok: Tokenizer, block_size: int) -> RLData:
    """An RL run's data (args: rollout.RolloutArgs): --prompts and --ptx-data, or without --prompts the built-in
    task's (--task) prompts and (without --ptx-data) its pre-training text; and --reward-fn. No prompt with room for a
    response, no ptx text that fits while --ptx-coef asks for a ptx loss, or another tokenizer than the built-in
    task's, is a one-line error."""
    builtin = args.prompts is None
    task_module = builtin_task(args) if builtin else None
    task = task_module.build_task(args.task_dir, args.task_seed) if builtin else None
    if hasattr(task_module, "check_trainable"):  # rg: a dataset whose own answers score below 1 is refused
        task_module.check_trainable("RL")
    prompts_path = task["prompts"] if builtin else args.prompts
    rows = read_jsonl(prompts_path, "prompts", "--prompts")
    prompts = [row["prompt"] for row in rows]
    # an rg: task has no tokenizer of its own: it takes the policy's
    if builtin and "tokenizer" in task and same_tokenizer(tok, load_tokenizer(task["tokenizer"]), prompts):
        raise UserError(
            f"the policy's tokenizer is not the built-in {args.task} task's ({task['tokenizer']}): was it trained on "
            "another --task?"
        )
    room = block_size - args.max_new_tokens
    lengths = [len(prompt_ids(tok, prompt)) for prompt in prompts]
    fitting = [prompt for prompt, length in zip(prompts, lengths) if length <= room]
    fitting_rows = [row for row, length in zip(rows, lengths) if length <= room]
    too_long = [lineno for lineno, length in zip(record_lines(prompts_path), lengths) if length > room]
    if not fitting:
        raise UserError(
            f"{prompts_path}: every prompt is longer than the context minus --max-new-tokens ({block_size} - "
            f"{args.max_new_tokens} = {room} tokens; the shortest takes {min(lengths)})"
        )
    # the task's own text only where it is right (task.PTX_FROM_PRETRAIN: reviews, not arith)
    ptx_path = args.ptx_data or (task["pretrain"] if builtin and task_module.PTX_FROM_PRETRAIN else None)
    ptx, ptx_too_long = [], 0
    if ptx_path:
        ptx, ptx_too_long = encode_sft(tok, read_jsonl(ptx_path, "text", "--ptx-data"), block_size, mask_prompt=False)
    if ptx_path and not ptx and args.ptx_coef > 0:
        raise UserError(
            f"--ptx-data {ptx_path}: all {ptx_too_long} texts are longer than the context ({block_size} tokens): no "
            "ptx loss (shorten them, or --ptx-coef 0)"
        )
    gold_fn = getattr(task_module, "gold_reward", None) if builtin else None  # a multi-turn task has none
    reward_fn = load_reward_fn(args.reward_fn, prompt_text(tok, fitting[0])) if args.reward_fn else None
    spec = env_spec(args)
    make_env = load_env(spec, fitting_rows[0], args.max_turns) if spec else None
    return RLData(
        fitting, too_long, prompts_path, ptx, ptx_too_long, gold_fn, ptx_path, reward_fn, fitting_rows, make_env
    )


def env_spec(args) -> Optional[str]:
    """The RL run's environment (args: rollout.RolloutArgs): --env, else without --prompts the built-in task's own (a
    module attribute ENV, e.g. "guess:Game"); None: one response a prompt."""
    if args.env is not None or args.prompts is not None:
        return args.env
    return getattr(builtin_task(args), "ENV", None)


class PromptStream:
    """This rank's share of the next prompts of the global order (the same on every rank), each repeated group_size
    times in a row (a group's G responses are sampled together). d: the rank and world size (parallel.Dist)."""

    def __init__(self, prompts: list, order: Order, prompts_per_rank: int, group_size: int, d):
        self.prompts = prompts
        self.order = order
        self.per_rank = prompts_per_rank
        self.group_size = group_size
        self.d = d

    def next(self) -> list:
        global_rows = self.order.take(self.per_rank * self.d.world_size)
        rows = global_rows[self.d.rank * self.per_rank : (self.d.rank + 1) * self.per_rank]
        return [self.prompts[row] for row in rows for _ in range(self.group_size)]


class PtxStream:
    """This rank's slice of the next global micro-batch of pre-training text: (inputs, targets, target mask) on the
    device, from the global order (saved in the checkpoint). d: the rank, world size and device (parallel.Dist)."""

    def __init__(self, texts: list, order: Order, micro_batch_size: int, d, pad_id: int):
        self.texts = texts
        self.order = order
        self.micro_batch_size = micro_batch_size
        self.d = d
        self.pad_id = pad_id

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, rank = self.micro_batch_size, self.d.rank
        rows = self.order.take(size * self.d.world_size)[rank * size : (rank + 1) * size]
        ids, _ = pad_right([self.texts[row][0] for row in rows], self.pad_id)
        loss_mask, _ = pad_right([self.texts[row][1] for row in rows], 0)
        device = self.d.device
        inputs = ids[:, :-1].contiguous()  # a sliced input is a compiled graph more (model.left_pack)
        return inputs.to(device), ids[:, 1:].to(device), loss_mask[:, 1:].float().to(device)


def as_conversation(row: dict) -> dict:
    """A string record as a conversation: the prompt as the user's turn, each answer as the
    assistant's; SFT {"prompt", "response"}, preferences (pairwise or K-wise) and prompts."""

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
