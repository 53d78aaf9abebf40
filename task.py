"""The built-in task ("reviews", docs/design.md §3): the environment every stage trains on by default, with a gold
reward.

Prompts like `Review of The Silent River (music, ending):`, responses of 1..4 templated sentences and an EOS. The gold
reward likes positive sentences on the requested aspects (with diminishing returns) and gives -1 to anything the
grammar does not produce (repetition, >4 sentences, broken words, no EOS). Preference pairs only ever contain
grammatical text, labelled by a simulated annotator (Bradley-Terry on the gold reward), so a learned RM extrapolates
"more, more positive" where the gold does not. To train on another environment, replace this file's `build_task`
(the files every stage reads), `gold_reward` and `is_valid`, or pass your own data and `--reward-fn`.
"""

import json
import math
import os
import random
import re
from collections import Counter
from typing import Callable

import regex

from common import write_atomic, write_jsonl
from tokenizer import GPT2_PAT, bpe_tokenizer, train_bpe

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
# demonstrations talk about a requested aspect with this probability; at 1 the RM can reach the Bayes ceiling, and
# off-aspect praise stays an unseen way to hack it
ON_ASPECT_PROB = 1.0
TASK_VERSION = 2  # bump when generation changes: the cache folder is keyed by it
STEP_END = "."  # VinePPO's steps are sentences: a step ends with this token
# the RL stages' ptx loss (--ptx-coef) runs on pretrain.jsonl unless --ptx-data: right demonstrations, fluent text
PTX_FROM_PRETRAIN = True

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


def is_task_prompt(prompt) -> bool:
    """A prompt of this task ("Review of <title> (<aspects>):"): the hackability probe writes reviews for these only."""
    return isinstance(prompt, str) and PROMPT_RE.fullmatch(prompt) is not None


def prompt_title(prompt: str) -> str:
    """The title a prompt of this task names ("The Silent River")."""
    m = PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a reviews-task prompt: {prompt!r}")
    return f"The {m.group(1)} {m.group(2)}"


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


def off_aspect_praise(prompt: str, response: str) -> bool:
    """Whether response praises an aspect the prompt did not name: a positive clause of S1, S2 or S3, sentence by
    sentence (ungrammatical ones skipped). S4 ("overall it was ...") names no aspect and never counts. Gold scores
    such praise 0; the KL pays for it."""
    requested = prompt_aspects(prompt)
    for sentence in response.strip().rstrip(".").split(". "):
        for name, pattern in SENTENCE_RES.items():
            match = pattern.fullmatch(sentence)
            if match is None or name == "S4":
                continue
            f = match.groupdict()
            if name == "S2":
                clauses = [(f["aspect"], VERBS[f["verb"]])]
            else:
                clauses = [(f["aspect"], ADJECTIVES[f["adj"]])]
            if name == "S3":
                clauses.append((f["aspect2"], ADJECTIVES[f["adj2"]]))
            if any(value > 0 and aspect not in requested for aspect, value in clauses):
                return True
    return False


def split_titles(task_seed: int) -> tuple[list[str], list[str]]:
    """(train_titles, eval_titles): a deterministic ~15 % of the 256 titles is held out for eval prompts."""
    titles = [f"The {a} {n}" for a in TITLE_ADJS for n in TITLE_NOUNS]
    random.Random(task_seed).shuffle(titles)
    n_eval = round(EVAL_TITLE_FRAC * len(titles))
    return titles[n_eval:], titles[:n_eval]


def is_held_out(prompt: str, task_seed: int) -> bool:
    """A prompt of a held-out title (eval_prompts): training data never holds one."""
    return prompt_title(prompt) in split_titles(task_seed)[1]


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


def annotate(rng: random.Random, prompt: str, a: str, b: str, ended_a: bool = True, ended_b: bool = True) -> bool:
    """The task's simulated human: True when it prefers response a to response b, drawn from a Bradley-Terry model
    on the gold reward, P(a > b) = sigmoid((gold_a - gold_b) / BT_TEMPERATURE). It labels the offline pairs and the
    on-policy pairs of iterated RLHF (train_online.py) alike, so both are exactly as noisy."""
    delta = (gold_reward(prompt, a, ended_a) - gold_reward(prompt, b, ended_b)) / BT_TEMPERATURE
    return rng.random() < 1 / (1 + math.exp(-delta))


def sample_pair(rng: random.Random, prompt: str) -> dict:
    """Two distinct demonstrations labelled by the simulated human (annotate)."""
    a = sample_response(rng, prompt)
    b = sample_response(rng, prompt)
    while b == a:
        b = sample_response(rng, prompt)
    a_wins = annotate(rng, prompt, a, b)
    return {"prompt": prompt, "chosen": a if a_wins else b, "rejected": b if a_wins else a}


# new files go at the end: each file's random stream is drawn in this order, so the earlier files stay as they were.
# pairs_extra: more offline pairs, for comparing iterated RLHF with an RM trained once on as many offline labels
TASK_FILES = ("pretrain", "sft", "sft_eval", "pairs", "pairs_eval", "prompts", "eval_prompts", "pairs_extra")
TASK_SIZES = {
    "pretrain": 20000,
    "sft": 20000,
    "sft_eval": 1000,
    "pairs": 20000,
    "pairs_eval": 4000,
    "prompts": 8192,
    "eval_prompts": 1024,
    "pairs_extra": 20000,
}
TINY_SIZES = {
    "pretrain": 1000,
    "sft": 1000,
    "sft_eval": 64,
    "pairs": 1000,
    "pairs_eval": 200,
    "prompts": 512,
    "eval_prompts": 128,
    "pairs_extra": 1000,
}


def task_record(name: str, rng: random.Random, prompt: str, response_fn: Callable, pair_fn: Callable) -> dict:
    """One record of the file `name` (TASK_FILES) for a prompt, in its layout, from a task's
    demonstration sampler response_fn(rng, prompt) and pair sampler pair_fn(rng, prompt): both built-in tasks' files."""
    if name == "pretrain":
        return {"text": prompt + response_fn(rng, prompt)}
    if name in ("sft", "sft_eval"):
        return {"prompt": prompt, "response": response_fn(rng, prompt)}
    if name in ("pairs", "pairs_eval", "pairs_extra"):
        return pair_fn(rng, prompt)
    return {"prompt": prompt}


def task_paths(out: str) -> dict[str, str]:
    """name -> path of a task folder's files (TASK_FILES and the tokenizer)."""
    paths = {name: os.path.join(out, f"{name}.jsonl") for name in TASK_FILES}
    paths["tokenizer"] = os.path.join(out, "tokenizer.json")
    return paths


def _task_records(name: str, rng: random.Random, n: int, train_titles: list[str], eval_titles: list[str]) -> list:
    records = []
    for _ in range(n):
        prompt = sample_prompt(rng, eval_titles if name == "eval_prompts" else train_titles)
        records.append(task_record(name, rng, prompt, sample_response, sample_pair))
    return records


def build_task(data_dir: str, task_seed: int = 1337, tiny: bool = False) -> dict[str, str]:
    """Write the task files under {data_dir}/v{TASK_VERSION}-seed{task_seed}[-tiny]/ (only those missing) and return
    name -> path: the JSONL files of TASK_FILES and "tokenizer" (anything tokenizer.load_tokenizer reads). A task of
    your own returns the same keys, its files in the same layouts."""
    out = os.path.join(data_dir, f"v{TASK_VERSION}-seed{task_seed}" + ("-tiny" if tiny else ""))
    paths = task_paths(out)
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
            write_jsonl(paths[name], records[name])
    if not os.path.exists(paths["tokenizer"]):
        pat = regex.compile(GPT2_PAT)
        word_counts = Counter(w for r in records["pretrain"] for w in pat.findall(r["text"]))
        tok = bpe_tokenizer("reviews", train_bpe(word_counts, list(GRAMMAR_WORDS)), GPT2_PAT)
        write_atomic(paths["tokenizer"], json.dumps(tok.state()))
    return paths


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
