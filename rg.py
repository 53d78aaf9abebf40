"""reasoning-gym's generators and scorers as a built-in task (--task rg:NAME, --task-config JSON; docs/design.md §3).

reasoning-gym (requirements-real.txt) has about a hundred procedural datasets: each entry a question, an answer and
the metadata its scorer reads. As a task of ours:
- prompts are conversations: reasoning-gym's "direct" system prompt (SYSTEM_PROMPT), the question as the user turn;
- the answer format is reasoning-gym's own: the last <answer>...</answer> of a response (its extract_answer);
- gold_reward is the dataset's score_answer(extract_answer(response), entry) as it is, in [0, 1] (partial credit on
  some datasets: countdown gives a wrong expression 0.05); the RL stages take it as --reward-fn rg:score. verify
  (eval.py's pass@k) is a score of 1.0, is_valid (valid_frac) an answer the extractor finds;
- training questions come from seed task_seed, held-out ones from seed task_seed + HELD_OUT_SEED_OFFSET (reasoning-gym
  draws entry i from seed + i: nearby seeds share entries); a held-out question drawn for training too is dropped
  from the training set (the start-up line counts them);
- SFT's demonstrations are the entries' own answers in the answer format. A dataset whose own answers score below 1
  (0.1.25: boxnet, graph_color, propositional_logic, rubiks_cube, rush_hour) gives nothing to imitate or reward: SFT
  and RL refuse it (check_trainable), eval.py still runs it.
The task brings no tokenizer: it is asked of a pretrained chat model's (hf:out/smollm2), and training from scratch is
refused. reasoning_gym is imported on first use: its import loads every subpackage (about a second).
"""

import hashlib
import json
import os
from importlib.metadata import version
from typing import Optional

from common import UserError, print0, write_jsonl
from task import task_paths

SYSTEM_PROMPT_NAME = "direct"  # of reasoning_gym.utils.SYSTEM_PROMPTS: the answer alone, in <answer> tags
TRAIN_SIZE = 1024  # training questions drawn (held-out ones among them dropped)
EVAL_SIZE = 256  # held-out questions drawn (repeats dropped: each is one cluster of eval.py's standard errors)
SFT_EVAL_SIZE = 64  # the first held-out questions with their answers: SFT's validation loss
OWN_ANSWER_CHECKS = 16  # training entries whose own answer check_trainable scores
HELD_OUT_SEED_OFFSET = 1_000_000  # held-out questions: seed task_seed + this, far past the training entries' seeds
TASK_VERSION = 1  # bump when the files change: the cache folder is keyed by it
STEP_END = None  # an answer has no sentence: VinePPO's steps are --vine-chunk tokens
PTX_FROM_PRETRAIN = False  # no pre-training text: the policy is a pretrained model
LOADED: dict = {}  # (name, config, task_dir, task_seed) -> the task load built: what --reward-fn rg:score reads


def import_reasoning_gym(name: str):
    """The reasoning_gym package, or a one-line error when it is not installed."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            f"--task rg:{name}: reasoning-gym is not installed (pip install --no-deps -r requirements-real.txt, or "
            "make real-venv)"
        ) from None
    return reasoning_gym


def parse_config(text: Optional[str]) -> dict:
    """--task-config's JSON object (None: {}); size and seed are the task's own."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--task-config {text}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"--task-config {text}: expected a JSON object, e.g. '{{\"min_terms\": 2}}'")
    for key in ("size", "seed"):
        if key in config:
            raise UserError(f"--task-config {text}: {key} is the task's own (sizes are fixed, seeds are --task-seed's)")
    return config


def make_dataset(name: str, config: dict, size: int, seed: int):
    """reasoning_gym.create_dataset(name, size=, seed=, **config), its first entry drawn: a name reasoning-gym does
    not have, or a configuration it refuses, is a one-line error naming the flag."""
    reasoning_gym = import_reasoning_gym(name)
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        examples = ", ".join(
            n for n in ("chain_sum", "basic_arithmetic", "countdown", "spell_backward") if n in DATASETS
        )
        raise UserError(f"--task rg:{name}: reasoning-gym has no dataset {name!r} (e.g. {examples})")
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
        dataset[0]
    except Exception as e:  # the library's own checks of the configuration: assertions, TypeError, ValueError
        message = str(e).splitlines()[0] if str(e) else ""
        raise UserError(
            f"--task-config {json.dumps(config)}: reasoning-gym's {name} refuses it: {type(e).__name__}: {message}"
        ) from None
    return dataset


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def conversation(question: str, system_prompt: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


class ReasoningGymTask:
    """One reasoning-gym dataset with the interface of a task module (task.py, arith.py): build_task, gold_reward,
    verify, is_valid, is_task_prompt, is_held_out, STEP_END, PTX_FROM_PRETRAIN. Built by load."""

    STEP_END = STEP_END
    PTX_FROM_PRETRAIN = PTX_FROM_PRETRAIN

    def __init__(self, name: str, config: dict, task_seed: int):
        self.name = name
        self.config = config
        import_reasoning_gym(name)
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.system_prompt = SYSTEM_PROMPTS[SYSTEM_PROMPT_NAME]
        self.extract_answer = extract_answer
        self.train = make_dataset(name, config, TRAIN_SIZE, task_seed)
        self.held_out = make_dataset(name, config, EVAL_SIZE, task_seed + HELD_OUT_SEED_OFFSET)
        self.where = {}  # question -> (dataset, index): held-out questions first, so one in both is held out
        self.held_out_questions = set()
        self.entries = {}  # (held out, index) -> entry, drawn on first use
        self.by_head = {}  # a question's first self.head characters -> the questions that start so (question_in)
        self.head = 0
        self.paths = None  # build_task's

    def entry(self, dataset, index: int) -> dict:
        key = (dataset is self.held_out, index)
        if key not in self.entries:
            self.entries[key] = dataset[index]
        return self.entries[key]

    def build_task(self, data_dir: str, task_seed: int, tiny: bool = False) -> dict[str, str]:
        """Write the task files under {data_dir}/rg-v{TASK_VERSION}-NAME-<config hash>-seed{task_seed}/ (when
        missing), read the questions back, and return name -> path: prompts and sft (training questions),
        eval_prompts and sft_eval (held-out ones), each prompt row with its entry's index. No tokenizer, pretrain nor
        pairs file; tiny is ignored (the sizes are small)."""
        if self.paths is not None:
            return self.paths
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()[:10]
        every = task_paths(os.path.join(data_dir, f"rg-v{TASK_VERSION}-{self.name}-{digest}-seed{task_seed}"))
        paths = {name: every[name] for name in ("prompts", "eval_prompts", "sft", "sft_eval")}
        if not all(os.path.exists(path) for path in paths.values()):
            os.makedirs(os.path.dirname(paths["prompts"]), exist_ok=True)
            self.write_files(paths)
        held_out_rows, train_rows = read_jsonl(paths["eval_prompts"]), read_jsonl(paths["prompts"])
        for dataset, rows in ((self.held_out, held_out_rows), (self.train, train_rows)):
            for row in rows:
                self.where.setdefault(row["prompt"][-1]["content"], (dataset, row["index"]))
        self.held_out_questions = {row["prompt"][-1]["content"] for row in held_out_rows}
        self.head = min(32, *(len(question) for question in self.where))
        for question in self.where:
            self.by_head.setdefault(question[: self.head], []).append(question)
        print0(
            f"task rg:{self.name} {json.dumps(self.config)}: {len(train_rows)} training questions (seed {task_seed}; "
            f"{TRAIN_SIZE - len(train_rows)} held-out ones dropped), {len(held_out_rows)} held-out (seed "
            f"{task_seed + HELD_OUT_SEED_OFFSET}); gold is reasoning-gym's score of the last <answer>...</answer>, "
            "valid_frac the share of responses that have one"
        )
        self.paths = paths
        return paths

    def write_files(self, paths: dict[str, str]) -> None:
        held_out, held_out_rows = set(), []
        for index in range(EVAL_SIZE):
            entry = self.entry(self.held_out, index)
            if entry["question"] not in held_out:
                held_out.add(entry["question"])
                held_out_rows.append({"prompt": conversation(entry["question"], self.system_prompt), "index": index})
        train_rows = []
        for index in range(TRAIN_SIZE):
            entry = self.entry(self.train, index)
            if entry["question"] not in held_out:
                train_rows.append({"prompt": conversation(entry["question"], self.system_prompt), "index": index})
        write_jsonl(paths["sft"], [self.demonstration(row, self.train) for row in train_rows])
        write_jsonl(
            paths["sft_eval"], [self.demonstration(row, self.held_out) for row in held_out_rows[:SFT_EVAL_SIZE]]
        )
        write_jsonl(paths["eval_prompts"], held_out_rows)
        write_jsonl(paths["prompts"], train_rows)

    def demonstration(self, row: dict, dataset) -> dict:
        """An SFT record: the conversation and the entry's own answer in the answer format."""
        answer = self.entry(dataset, row["index"])["answer"]
        reply = {"role": "assistant", "content": f"<answer>{answer}</answer>"}
        return {"messages": row["prompt"] + [reply], "learn_from": len(row["prompt"])}

    def question_in(self, prompt) -> Optional[str]:
        """The task's question a prompt asks: a conversation's last user turn, or in a rendered one (a string: what
        the reward function sees) the known question its text holds; None if none."""
        if isinstance(prompt, list):
            question = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), None)
            return question if question in self.where else None
        for start in range(len(prompt) - self.head + 1):
            for question in self.by_head.get(prompt[start : start + self.head], ()):
                if prompt.startswith(question, start):
                    return question
        return None

    def gold_reward(self, prompt, response: str, ended: bool) -> float:
        """reasoning-gym's score of the response's answer, as it is: score_answer(extract_answer(response), entry).
        ended is not read: the closing tag ends an answer."""
        question = self.question_in(prompt)
        if question is None:
            raise ValueError(f"not a question of --task rg:{self.name}: {str(prompt)[-80:]!r}")
        dataset, index = self.where[question]
        return float(dataset.score_answer(self.extract_answer(response), self.entry(dataset, index)))

    def verify(self, prompt, response: str) -> bool:
        """A right answer: a score of 1.0 (pass@k counts these)."""
        return self.gold_reward(prompt, response, True) == 1.0

    def is_valid(self, response: str, ended: bool) -> bool:
        """The extractor finds an answer (<answer>...</answer>)."""
        return self.extract_answer(response) is not None

    def is_task_prompt(self, prompt) -> bool:
        return self.question_in(prompt) is not None

    def is_held_out(self, prompt, task_seed: int) -> bool:
        return self.question_in(prompt) in self.held_out_questions

    def check_trainable(self, stage: str) -> None:
        """A one-line error when one of the first OWN_ANSWER_CHECKS training entries' own answer, written as SFT's
        demonstration, scores below 1: nothing to imitate, no reward to trust."""
        for index in range(OWN_ANSWER_CHECKS):
            entry = self.entry(self.train, index)
            demonstration = self.demonstration({"prompt": [], "index": index}, self.train)["messages"][-1]["content"]
            own = self.train.score_answer(self.extract_answer(demonstration), entry)
            if own < 1.0:
                raise UserError(
                    f"--task rg:{self.name}: reasoning-gym {version('reasoning-gym')} scores its own answer "
                    f"{own:g} (training entry {index}): nothing to imitate or reward, so {stage} refuses it; eval.py "
                    "still measures it"
                )


def load(name: str, config_text: Optional[str], task_dir: str, task_seed: int) -> ReasoningGymTask:
    """The task rg:NAME under --task-config, its files built (once per process)."""
    key = (name, config_text, task_dir, task_seed)
    if key not in LOADED:
        task = ReasoningGymTask(name, parse_config(config_text), task_seed)
        task.build_task(task_dir, task_seed)
        LOADED[key] = task
    return LOADED[key]


def task_asking(prompt) -> ReasoningGymTask:
    """The rg: task this process loaded (--task rg:NAME) that asks the prompt's question (a conversation, or one
    rendered)."""
    for task in LOADED.values():
        if task.is_task_prompt(prompt):
            return task
    raise ValueError("not a question of the --task rg:NAME this run loaded (rg:score scores that task's prompts)")


def score(prompt: str, response: str, ended: bool) -> float:
    """--reward-fn rg:score: the gold_reward of the rg: task this process loaded (--task rg:NAME) that asks the
    prompt's question."""
    return task_asking(prompt).gold_reward(prompt, response, ended)


NO_ANSWER = "I found no answer. Give it between <answer> and </answer> tags."  # Retry's word on an untagged attempt
WRONG = "That is not right (it scores {score:g} of 1). Try again."  # and on a wrong one


class Retry:
    """--env rg:Retry: a question of --task rg:NAME answered in up to --max-turns attempts, each wrong one answered by
    the scorer's verdict as the next user turn (NO_ANSWER, or WRONG with its score). The return is the best score of
    the attempts: an attempt's reward is what it adds to the best before it (so a right first answer earns 1 at once,
    and a right second one 1 less the first's partial credit). Its info: first_try (the first attempt scored 1),
    solved (some attempt did), attempts."""

    def __init__(self, row: dict):
        self.prompt = row["prompt"]
        self.task = task_asking(self.prompt)
        self.best = 0.0
        self.attempts = 0
        self.first_try = 0.0

    def step(self, response: str, ended: bool) -> tuple[Optional[str], float, bool, dict]:
        score = self.task.gold_reward(self.prompt, response, ended)
        self.attempts += 1
        if self.attempts == 1:
            self.first_try = float(score == 1.0)
        reward = max(0.0, score - self.best)
        self.best = max(self.best, score)
        solved = self.best == 1.0
        info = {"first_try": self.first_try, "solved": float(solved), "attempts": float(self.attempts)}
        if solved:
            return None, reward, True, info
        verdict = NO_ANSWER if self.task.extract_answer(response) is None else WRONG.format(score=score)
        return verdict, reward, False, info
