"""The guessing game (guess.py, docs/design.md §3) asked in chat, for an instruct model (make real-multiturn).

A row is `{"prompt": [the user's message], "secret": s, "numbers": N, "turns": K}`: the user's message states the
game (a number in 1..N, K guesses, answer with the number only, the reply "Higher." or "Lower."). Each model turn is
one guess; `ChatGame` (`--env experiments/chat_guess.py:ChatGame`) answers "Higher." or "Lower." as the next user
turn, and the episode ends on the secret (reward 1) or after K wrong guesses (reward 0).

The parse is lenient, for a chat model: a turn's guess is the first integer in its text ("My guess is 5." guesses 5).
A turn that has no integer, one outside 1..N, or no end-of-turn token within --max-new-tokens is invalid and ends the
episode with reward 0 (a cut turn has no <|im_end|> for the next user turn to follow).

The optimum and the baselines are guess.py's, exact, at these sizes (`baselines`).
"""

import os
import random
import re
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import guess  # noqa: E402

INTEGER_RE = re.compile(r"\d+")
HIGHER = "Higher."
LOWER = "Lower."
DEMO_SECRET = 3  # the secret of the game played in the prompt


def question(numbers: int, turns: int) -> list[dict]:
    """The game's rules as a system message, then one game played by binary search (its secret DEMO_SECRET) and the
    user opening a new one: without the played game the 135M instruct model chats instead of guessing."""
    rules = f"Guess my whole number from 1 to {numbers} in {turns} tries. I reply Higher. or Lower. Answer with the "
    rules += "number only."
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": "Your guess?"}]
    low, high = 1, numbers
    secret = min(DEMO_SECRET, numbers)
    while True:
        value = (low + high) // 2
        messages.append({"role": "assistant", "content": str(value)})
        if value == secret:
            break
        messages.append({"role": "user", "content": HIGHER if secret > value else LOWER})
        low, high = (value + 1, high) if secret > value else (low, value - 1)
    return messages + [{"role": "user", "content": "Correct! New game. Your guess?"}]


def parse_guess(response: str, ended: bool, numbers: int) -> int | None:
    """The first integer of an ended turn, if it lies in 1..numbers; else None."""
    found = INTEGER_RE.search(response)
    if not ended or found is None:
        return None
    value = int(found.group())
    return value if 1 <= value <= numbers else None


class ChatGame:
    """One episode of the chat game, built from a row holding its "secret", "numbers" and "turns"."""

    def __init__(self, row: dict):
        self.numbers = row["numbers"]
        self.turns = row["turns"]
        self.secret = row["secret"]
        if not 1 <= self.secret <= self.numbers:
            raise ValueError(f"chat_guess: the row's secret {self.secret} is not in 1..{self.numbers}")
        self.guesses = 0

    def step(self, response: str, ended: bool) -> tuple[str | None, float, bool, dict]:
        """(observation, reward, done, info) after one turn, as guess.Game's; the info (last turn only): success,
        guesses, invalid."""
        self.guesses += 1
        value = parse_guess(response, ended, self.numbers)
        if value is None:
            return None, 0.0, True, {"success": 0, "guesses": self.guesses, "invalid": 1}
        if value == self.secret:
            return None, 1.0, True, {"success": 1, "guesses": self.guesses, "invalid": 0}
        if self.guesses == self.turns:
            return None, 0.0, True, {"success": 0, "guesses": self.guesses, "invalid": 0}
        return (HIGHER if self.secret > value else LOWER), 0.0, False, {}


def rows(count: int, numbers: int, turns: int, seed: int) -> list[dict]:
    """count rows with secrets drawn uniformly from random.Random(seed)."""
    rng = random.Random(seed)
    prompt = question(numbers, turns)
    return [
        {"prompt": prompt, "secret": rng.randint(1, numbers), "numbers": numbers, "turns": turns} for _ in range(count)
    ]


def baselines(numbers: int, turns: int) -> dict:
    """Exact success (and expected turns) at these sizes: the optimum (binary search), the player who guesses
    uniformly among the values still consistent (guess.weak_policy), and the one who ignores the feedback (a uniform
    guess in 1..numbers each turn)."""
    best_success, best_turns = guess.optimum(numbers, turns)
    weak_success, weak_turns = guess.policy_values(guess.weak_policy, numbers, turns)

    def blind(low: int, high: int, left: int) -> dict:
        return {value: Fraction(1, numbers) for value in range(1, numbers + 1)}

    blind_success, blind_turns = guess.policy_values(blind, numbers, turns)
    return {
        "optimum": {"success": float(best_success), "turns": float(best_turns)},
        "consistent_uniform": {"success": float(weak_success), "turns": float(weak_turns)},
        "blind_uniform": {"success": float(blind_success), "turns": float(blind_turns)},
    }
