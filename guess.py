"""The multi-turn task ("guess", docs/design.md §3): a guessing game with higher/lower feedback whose optimum is known.

A row holds a secret in 1..NUMBERS (`{"prompt": "guess 1-20:", "secret": 13}`). Each model turn is one guess, its
digits then the EOS; the environment (`Game`, `--env guess:Game`) answers `higher` or `lower`, and the episode ends
on the secret (reward 1) or after TURNS wrong guesses (reward 0). A turn that is not a guess in 1..NUMBERS with its EOS
ends the episode with reward 0. The return is the success: with 4 guesses binary search tells 2^4 - 1 = 15 of the 20
secrets apart, so the optimum succeeds with probability 3/4 in 69/20 turns (`optimum`, by dynamic programming).
The demonstrations are a weak player's, a uniform guess among the values still consistent: 0.499 (`policy_values`).
`tilted_optimum(beta)` is the multi-turn KL-optimal limit over that reference. The tokenizer merges bytes only into
"guess" and the feedback words: every digit is a token of its own, each feedback word one token.

As a built-in task (--task guess, data.TASKS) it has no single-turn gold reward and no preference pairs: its
environment is ENV, which the RL stages and eval.py take when no --env is given, with the turn sizes below.
"""

import functools
import json
import math
import os
import random
import re
from fractions import Fraction
from typing import Callable

from common import write_atomic, write_jsonl
from tokenizer import GPT2_PAT, Tokenizer, bpe_tokenizer, train_bpe

NUMBERS = 20  # the secret is one of 1..NUMBERS
TURNS = 4  # guesses an episode allows
PROMPT = f"guess 1-{NUMBERS}:"
HIGHER = "higher"  # the secret is above the guess
LOWER = "lower"  # the secret is below the guess
MAX_NEW_TOKENS = 3  # a guess: two digits and the EOS
BLOCK_SIZE = 24  # holds the longest episode: a 7-token prompt, 4 turns of 3 tokens and 3 one-token observations
TASK_VERSION = 1  # bump when generation changes: the cache folder is keyed by it
STEP_END = None  # a guess has no sentence: VinePPO's steps are --vine-chunk tokens
PTX_FROM_PRETRAIN = False  # no pre-training text: the demonstrations are a weak player's
GUESS_RE = re.compile(r"[1-9]\d*")
ENV = "guess:Game"  # the task's environment, as --env spells it

# a policy or a reference: (low, high, turns left) -> {guess: probability}, the secret uniform on low..high
Policy = Callable[[int, int, int], dict]


def parse_guess(response: str, ended: bool, numbers: int = NUMBERS) -> int | None:
    """The guess a turn makes: digits without a leading zero, in 1..numbers, then the EOS; else None."""
    if not ended or GUESS_RE.fullmatch(response) is None:
        return None
    guess = int(response)
    return guess if guess <= numbers else None


def is_valid(response: str, ended: bool) -> bool:
    """A turn is a guess: it parses, lies in 1..NUMBERS and has its EOS."""
    return parse_guess(response, ended) is not None


def is_task_prompt(prompt) -> bool:
    """A prompt of this task (PROMPT)."""
    return prompt == PROMPT


class Game:
    """One episode of the game (--env guess:Game), built from a row holding its "secret"."""

    def __init__(self, row: dict, numbers: int = NUMBERS, turns: int = TURNS):
        secret = row.get("secret")
        if type(secret) is not int or not 1 <= secret <= numbers:
            raise ValueError(f"guess: the row's secret must be an integer in 1..{numbers}, not {secret!r}")
        self.secret = secret
        self.numbers = numbers
        self.turns = turns
        self.guesses = 0

    def step(self, response: str, ended: bool) -> tuple[str | None, float, bool, dict]:
        """(observation, reward, done, info) after one turn: higher or lower while the episode goes on; done with
        reward 1 on the secret, 0 on the last wrong guess or a turn that is not a guess. The info, on the last turn
        only ({} before): success, guesses (the turns taken), invalid."""
        self.guesses += 1
        guess = parse_guess(response, ended, self.numbers)
        if guess is None:
            return None, 0.0, True, {"success": 0, "guesses": self.guesses, "invalid": 1}
        if guess == self.secret:
            return None, 1.0, True, {"success": 1, "guesses": self.guesses, "invalid": 0}
        if self.guesses == self.turns:
            return None, 0.0, True, {"success": 0, "guesses": self.guesses, "invalid": 0}
        return (HIGHER if self.secret > guess else LOWER), 0.0, False, {}


# -----------------------------------------------------------------------------
# exact values: dynamic programming over the interval of secrets still consistent with the feedback


@functools.cache
def outcomes(low: int, high: int, guess: int) -> tuple[Fraction, list[tuple[Fraction, int, int]]]:
    """A guess's chance of hitting a secret uniform on low..high, and [(probability, low, high)] of the intervals the
    feedback leaves otherwise (a guess outside the interval leaves it as it is)."""
    size = high - low + 1
    if not low <= guess <= high:
        return Fraction(0), [(Fraction(1), low, high)]
    below = [(Fraction(guess - low, size), low, guess - 1)] if guess > low else []
    above = [(Fraction(high - guess, size), guess + 1, high)] if guess < high else []
    return Fraction(1, size), below + above


def guess_tokens(guess: int) -> int:
    """The model tokens a guess takes: its digits (a token each) and the EOS."""
    return len(str(guess)) + 1


@functools.cache
def best_strategy(numbers: int, turns: int) -> tuple[Fraction, Fraction, Fraction]:
    """(success, expected turns, expected model tokens) of the best strategy: the most success, then the fewest turns,
    then the fewest tokens (a failed episode takes all `turns`)."""

    @functools.cache
    def best(low: int, high: int, left: int) -> tuple[Fraction, Fraction, Fraction]:
        if left == 0:
            return Fraction(0), Fraction(0), Fraction(0)
        candidates = []
        for guess in range(low, high + 1):
            hit, rest = outcomes(low, high, guess)
            success = hit + sum(p * best(lo, hi, left - 1)[0] for p, lo, hi in rest)
            expected_turns = 1 + sum(p * best(lo, hi, left - 1)[1] for p, lo, hi in rest)
            tokens = guess_tokens(guess) + sum(p * best(lo, hi, left - 1)[2] for p, lo, hi in rest)
            candidates.append((success, -expected_turns, -tokens))
        # most success first, then fewest turns, then fewest tokens: each a sum over the feedback with positive
        # weights, so the order holds node by node
        success, negative_turns, negative_tokens = max(candidates)
        return success, -negative_turns, -negative_tokens

    return best(1, numbers, turns)


@functools.cache
def float_outcomes(low: int, high: int, guess: int) -> tuple[float, list[tuple[float, int, int]]]:
    """outcomes in floats, for the tilted limit's float recursion."""
    hit, rest = outcomes(low, high, guess)
    return float(hit), [(float(p), lo, hi) for p, lo, hi in rest]


def optimum(numbers: int = NUMBERS, turns: int = TURNS) -> tuple[Fraction, Fraction]:
    """The highest success probability over all strategies, and the fewest expected turns among the strategies that
    reach it (a failed episode takes all `turns`): (3/4, 69/20) for the game's sizes."""
    success, expected_turns, _ = best_strategy(numbers, turns)
    return success, expected_turns


def optimum_tokens_per_turn(numbers: int = NUMBERS, turns: int = TURNS) -> Fraction:
    """The model tokens a turn of the best strategy takes (expected tokens over expected turns; fewest tokens among
    the optimal strategies, whose guesses of 10 and more take a token more): 164/69 for the game's sizes."""
    _, expected_turns, tokens = best_strategy(numbers, turns)
    return tokens / expected_turns


@functools.cache
def weak_policy(low: int, high: int, left: int) -> dict[int, Fraction]:
    """The demonstrations' player: a uniform guess among the values still consistent."""
    return {guess: Fraction(1, high - low + 1) for guess in range(low, high + 1)}


def policy_values(policy: Policy, numbers: int = NUMBERS, turns: int = TURNS) -> tuple[Fraction, Fraction]:
    """A policy's success probability and expected turns (a failed episode takes all `turns`), exact."""

    @functools.cache
    def values(low: int, high: int, left: int) -> tuple[Fraction, Fraction]:
        if left == 0:
            return Fraction(0), Fraction(0)
        success, expected_turns = Fraction(0), Fraction(1)
        for guess, prob in policy(low, high, left).items():
            hit, rest = outcomes(low, high, guess)
            success += prob * (hit + sum(p * values(lo, hi, left - 1)[0] for p, lo, hi in rest))
            expected_turns += prob * sum(p * values(lo, hi, left - 1)[1] for p, lo, hi in rest)
        return success, expected_turns

    return values(1, numbers, turns)


def tilted_policy(beta: float, reference: Policy = weak_policy, numbers: int = NUMBERS, turns: int = TURNS) -> Policy:
    """The policy maximising E[R] - beta KL(policy || reference) over whole episodes, the KL summed over turns.

    The secret is hidden, so the policy cannot tilt the feedback: its optimum is the soft Bellman recursion
    pi(g | s) = reference(g | s) exp((Q(g) - V(s)) / beta), V(s) = beta log sum_g reference(g | s) exp(Q(g) / beta),
    Q(g) the hit chance plus the feedback's expected next V (Levine 2018, "Reinforcement learning and control as
    probabilistic inference", §3), not reference(episode) exp(R / beta) / Z, which would also pick the secret."""
    assert beta > 0, f"beta {beta} must be positive"

    @functools.cache
    def value(low: int, high: int, left: int) -> float:
        if left == 0:
            return 0.0
        exponents = [math.log(prob) + q / beta for _, prob, q in q_values(low, high, left)]
        top = max(exponents)
        return beta * (top + math.log(sum(math.exp(e - top) for e in exponents)))

    @functools.cache
    def q_values(low: int, high: int, left: int) -> list[tuple[int, float, float]]:
        rows = []
        for guess, prob in reference(low, high, left).items():
            if prob == 0:
                continue
            hit, rest = float_outcomes(low, high, guess)
            q = hit + sum(p * value(lo, hi, left - 1) for p, lo, hi in rest)
            rows.append((guess, float(prob), q))
        return rows

    @functools.cache
    def policy(low: int, high: int, left: int) -> dict[int, float]:
        v = value(low, high, left)
        return {guess: prob * math.exp((q - v) / beta) for guess, prob, q in q_values(low, high, left)}

    return policy


def tilted_optimum(
    beta: float, reference: Policy = weak_policy, numbers: int = NUMBERS, turns: int = TURNS
) -> tuple[float, float]:
    """(success, KL to the reference) of tilted_policy(beta): the multi-turn KL-optimal limit."""
    policy = tilted_policy(beta, reference, numbers, turns)

    @functools.cache
    def moments(low: int, high: int, left: int) -> tuple[float, float]:
        if left == 0:
            return 0.0, 0.0
        success, kl = 0.0, 0.0
        ref = reference(low, high, left)
        for guess, prob in policy(low, high, left).items():
            if prob == 0:  # 0 log 0: a guess the tilt has underflowed to nothing
                continue
            hit, rest = float_outcomes(low, high, guess)
            later_success = sum(p * moments(lo, hi, left - 1)[0] for p, lo, hi in rest)
            later_kl = sum(p * moments(lo, hi, left - 1)[1] for p, lo, hi in rest)
            success += prob * (hit + later_success)
            kl += prob * (math.log(prob / float(ref[guess])) + later_kl)
        return success, kl

    return moments(1, numbers, turns)


def tilted_at_kl(kl: float, reference: Policy = weak_policy, numbers: int = NUMBERS, turns: int = TURNS) -> dict:
    """The tilted optimum whose KL to the reference is kl, found by bisection on log beta (its KL falls as beta
    grows): {"beta", "success", "kl"}, the most success a policy at that KL can reach. A kl past the limit's range
    gives its end: beta 1e3 (about the reference itself) or 1e-4 (about the optimum)."""
    low, high = math.log(1e-4), math.log(1e3)
    for _ in range(30):
        middle = (low + high) / 2
        _, middle_kl = tilted_optimum(math.exp(middle), reference, numbers, turns)
        low, high = (middle, high) if middle_kl > kl else (low, middle)
    beta = math.exp((low + high) / 2)
    success, beta_kl = tilted_optimum(beta, reference, numbers, turns)
    return {"beta": beta, "success": success, "kl": beta_kl}


def optimum_columns(kl: float | None) -> dict:
    """eval.py's values beside a policy's episode metrics: the optimum's success, turns, invalid share and tokens a
    turn; the weak player's success and turns; the tilted optimum at the policy's KL (to the SFT, taken as the KL to
    the weak player it imitates): its success and beta."""
    success, expected_turns = optimum()
    weak_success, weak_turns = policy_values(weak_policy)
    columns = {"success_optimum": float(success), "turns_optimum": float(expected_turns), "invalid_optimum": 0.0}
    columns["tokens_per_turn_optimum"] = float(optimum_tokens_per_turn())
    columns |= {"success_weak": float(weak_success), "turns_weak": float(weak_turns)}
    tilted = tilted_at_kl(max(kl, 0.0)) if kl is not None else {"success": None, "beta": None}
    columns |= {"success_tilted": tilted["success"], "beta_tilted": tilted["beta"]}
    return columns


# -----------------------------------------------------------------------------
# the demonstrations and the files


def weak_episode(rng: random.Random, secret: int) -> dict:
    """One episode of the weak player against Game, as an SFT record: {"prompt", "secret", "turns": [{"role":
    "assistant" or "env", "text"}, ...]}, the model's turns and the observations in order."""
    game = Game({"secret": secret})
    low, high = 1, NUMBERS
    turns = []
    while True:
        guess = rng.randint(low, high)
        turns.append({"role": "assistant", "text": str(guess)})
        observation, _, done, _ = game.step(str(guess), True)
        if done:
            return {"prompt": PROMPT, "secret": secret, "turns": turns}
        turns.append({"role": "env", "text": observation})
        low, high = (guess + 1, high) if observation == HIGHER else (low, guess - 1)


def task_tokenizer() -> Tokenizer:
    """The 256 bytes, merged only into the feedback words and "guess": every digit is a token of its own."""
    return bpe_tokenizer("guess", train_bpe({}, ["guess", HIGHER, LOWER]), GPT2_PAT)


TASK_FILES = ("sft", "sft_eval", "prompts", "eval_prompts")
TASK_SIZES = {"sft": 20000, "sft_eval": 1000, "prompts": 8192, "eval_prompts": 640}
TINY_SIZES = {"sft": 1000, "sft_eval": 64, "prompts": 512, "eval_prompts": 160}


def _task_records(name: str, rng: random.Random, n: int) -> list[dict]:
    if name == "eval_prompts":
        # every secret equally often, so the held-out success estimates the uniform secret's without its variance
        assert n % NUMBERS == 0, f"eval_prompts {n} must divide by NUMBERS {NUMBERS}"
        secrets = list(range(1, NUMBERS + 1)) * (n // NUMBERS)
        rng.shuffle(secrets)
        return [{"prompt": PROMPT, "secret": secret} for secret in secrets]
    secrets = [rng.randint(1, NUMBERS) for _ in range(n)]
    if name == "prompts":
        return [{"prompt": PROMPT, "secret": secret} for secret in secrets]
    return [weak_episode(rng, secret) for secret in secrets]


def build_task(data_dir: str, task_seed: int = 1337, tiny: bool = False) -> dict[str, str]:
    """Write the task files under {data_dir}/guess-v{TASK_VERSION}-seed{task_seed}[-tiny]/ (only those missing) and
    return name -> path: sft and sft_eval hold weak_episode records, prompts and eval_prompts {"prompt", "secret"},
    each file from its own random stream; and the tokenizer."""
    out = os.path.join(data_dir, f"guess-v{TASK_VERSION}-seed{task_seed}" + ("-tiny" if tiny else ""))
    paths = {name: os.path.join(out, f"{name}.jsonl") for name in TASK_FILES}
    paths["tokenizer"] = os.path.join(out, "tokenizer.json")
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(out, exist_ok=True)
    master = random.Random(task_seed)  # one independent stream per file, so each file is fixed by the seed alone
    streams = [random.Random(master.getrandbits(64)) for _ in TASK_FILES]
    sizes = TINY_SIZES if tiny else TASK_SIZES
    for name, rng in zip(TASK_FILES, streams):
        if not os.path.exists(paths[name]):
            write_jsonl(paths[name], _task_records(name, rng, sizes[name]))
    if not os.path.exists(paths["tokenizer"]):
        write_atomic(paths["tokenizer"], json.dumps(task_tokenizer().state()))
    return paths
