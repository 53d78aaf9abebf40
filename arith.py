"""The second built-in task ("arith", --task arith; docs/design.md §3): addition with an answer a verifier checks.

Prompts like `482+379=`, responses the sum's digits and an EOS (`861`). Each operand has 1..MAX_DIGITS digits. A
share WRONG_FRAC of the demonstrations is wrong (a dropped carry, or one digit off), so imitation alone leaves the
policy right about half the time: what it learns is a distribution over answers with the right one on top, the room
a verifiable reward (GRPO, DAPO, RLOO, PPO) and pass@k are measured in. The tokenizer has no merges: every digit is
a token of its own. Held-out problems (eval_prompts) are a fixed ~10 % of all operand pairs, never trained on.

The task's functions have the reviews task's names (task.py), so a stage picks either by --task (data.TASKS):
- verify(prompt, response): the answer is the sum;
- gold_reward(prompt, response, ended): 1.0 right with an EOS, else 0.0, so eval.py's gold is the accuracy;
- reward(prompt, response, ended): the RL stages' reward (--reward-fn arith:reward): 1 right, 0 wrong, -1 when the
  answer does not parse or has no EOS;
- is_valid(response, ended): the answer parses (digits, no leading zero) and has its EOS: eval.py's valid_frac.
"""

import json
import os
import random
import re

from common import write_atomic, write_jsonl
from task import TASK_FILES, task_paths, task_record
from tokenizer import GPT2_PAT, bpe_tokenizer

MAX_DIGITS = 2
WRONG_FRAC = 0.5  # share of wrong demonstrations
EVAL_FRAC = 0.1  # share of operand pairs held out for eval_prompts
TASK_VERSION = 1  # bump when generation changes: the cache folder is keyed by it
STEP_END = None  # an answer has no sentence: VinePPO's steps are --vine-chunk tokens
# no ptx loss unless --ptx-data: half of pretrain.jsonl's answers are wrong on purpose, and an LM loss on them pulls
# the policy back towards the wrong answers the verifier's reward pushes it from
PTX_FROM_PRETRAIN = False

PROMPT_RE = re.compile(r"(\d+)\+(\d+)=")
ANSWER_RE = re.compile(r"0|[1-9]\d*")


def operands(prompt: str) -> tuple[int, int]:
    m = PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not an arith-task prompt: {prompt!r}")
    return int(m.group(1)), int(m.group(2))


def is_task_prompt(prompt) -> bool:
    """A prompt of this task ("<a>+<b>=")."""
    return isinstance(prompt, str) and PROMPT_RE.fullmatch(prompt) is not None


def is_valid(response: str, ended: bool) -> bool:
    """The answer parses: digits without a leading zero, then the EOS."""
    return ended and ANSWER_RE.fullmatch(response) is not None


def verify(prompt: str, response: str) -> bool:
    """The response is the sum of the prompt's operands, written as the demonstrations write it."""
    a, b = operands(prompt)
    return ANSWER_RE.fullmatch(response) is not None and int(response) == a + b


def gold_reward(prompt: str, response: str, ended: bool) -> float:
    """1.0 when the answer is right and ends, else 0.0: eval.py's gold is the verifier's accuracy."""
    return float(ended and verify(prompt, response))


def reward(prompt: str, response: str, ended: bool) -> float:
    """The RL reward (--reward-fn arith:reward): 1 right, 0 wrong, -1 when the answer does not parse or has no EOS."""
    if not is_valid(response, ended):
        return -1.0
    return float(verify(prompt, response))


def is_held_out(prompt: str, task_seed: int) -> bool:
    """A held-out problem: a fixed EVAL_FRAC of the operand pairs, by the task seed."""
    a, b = operands(prompt)
    return random.Random(f"{task_seed}:{a}+{b}").random() < EVAL_FRAC


def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def sample_prompt(rng: random.Random, task_seed: int, held_out: bool) -> str:
    """A problem from the training (held_out False) or the held-out side of the split."""
    while True:
        prompt = f"{_operand(rng)}+{_operand(rng)}="
        if is_held_out(prompt, task_seed) == held_out:
            return prompt


def without_carries(a: int, b: int) -> int:
    """The digit-wise sum with every carry dropped (the classic mistake)."""
    total, place = 0, 1
    while a or b:
        total += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


def wrong_answer(rng: random.Random, a: int, b: int) -> int:
    """A plausible mistake: the sum without its carries (when it had any) or with one digit changed."""
    right = a + b
    if rng.random() < 0.5 and without_carries(a, b) != right:
        return without_carries(a, b)
    digits = list(str(right))
    position = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[position] and (d != "0" or position > 0 or len(digits) == 1)]
    digits[position] = rng.choice(choices)
    return int("".join(digits))


def sample_response(rng: random.Random, prompt: str) -> str:
    """A demonstration: the sum, or with probability WRONG_FRAC a wrong_answer."""
    a, b = operands(prompt)
    return str(wrong_answer(rng, a, b) if rng.random() < WRONG_FRAC else a + b)


def sample_pair(rng: random.Random, prompt: str) -> dict:
    """The right answer over a mistake: what an annotator with the verifier labels."""
    a, b = operands(prompt)
    return {"prompt": prompt, "chosen": str(a + b), "rejected": str(wrong_answer(rng, a, b))}


# the files every stage reads (task.TASK_FILES), in the reviews task's layouts
TASK_SIZES = {
    "pretrain": 20000,
    "sft": 20000,
    "sft_eval": 1000,
    "pairs": 20000,
    "pairs_eval": 4000,
    "prompts": 8192,
    "eval_prompts": 512,  # of the ~1,000 held-out operand pairs
    "pairs_extra": 20000,
}
TINY_SIZES = {name: max(64, size // 20) for name, size in TASK_SIZES.items()}  # make demo TINY=1, tests


def _task_records(name: str, rng: random.Random, n: int, task_seed: int) -> list:
    records, seen = [], set()
    while len(records) < n:
        prompt = sample_prompt(rng, task_seed, held_out=name == "eval_prompts")
        if name == "eval_prompts" and prompt in seen:
            continue  # held-out problems are distinct: each is one cluster of pass@k's standard error
        seen.add(prompt)
        records.append(task_record(name, rng, prompt, sample_response, sample_pair))
    return records


def build_task(data_dir: str, task_seed: int = 1337, tiny: bool = False) -> dict[str, str]:
    """Write the task files under {data_dir}/arith-v{TASK_VERSION}-seed{task_seed}[-tiny]/ (only those missing) and
    return name -> path, as task.build_task does."""
    out = os.path.join(data_dir, f"arith-v{TASK_VERSION}-seed{task_seed}" + ("-tiny" if tiny else ""))
    paths = task_paths(out)
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(out, exist_ok=True)
    master = random.Random(task_seed)  # one independent stream per file, so each file is fixed by the seed alone
    streams = [random.Random(master.getrandbits(64)) for _ in TASK_FILES]
    sizes = TINY_SIZES if tiny else TASK_SIZES
    for name, rng in zip(TASK_FILES, streams):
        if not os.path.exists(paths[name]):
            write_jsonl(paths[name], _task_records(name, rng, sizes[name], task_seed))
    if not os.path.exists(paths["tokenizer"]):
        tok = bpe_tokenizer("arith", [bytes([i]) for i in range(256)], GPT2_PAT)  # no merges: a token per digit
        write_atomic(paths["tokenizer"], json.dumps(tok.state()))
    return paths
