"""Screen reasoning-gym datasets for RL on a real model: its held-out pass@1 and pass@8 on each candidate task.

Each candidate is a dataset at a small configuration (CANDIDATES, --task rg:NAME --task-config JSON). eval.py samples
--pass-samples answers to each of --prompts held-out questions at --temperature; the row has pass@1 and pass@k with
their standard errors, the mean score (gold) and the share of answers the extractor parses (valid_frac). A task
worth RL leaves room both ways: pass@1 between about 0.05 and 0.6. Writes <out_dir>/results.json (one row a task,
kept as they finish: a rerun skips the tasks it has) and prints the table. CPU-heavy: 64 questions x 8 answers of 32
tokens take the 135M model minutes a task on 2 cores.

python experiments/rg_screen.py                                         # SmolLM2-135M-Instruct, every candidate
python experiments/rg_screen.py --tasks chain_sum spell_backward --prompts 16
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval as ev  # noqa: E402
from common import write_atomic  # noqa: E402

# small configurations: short questions and answers a 135M model can read and write in 32 tokens
CANDIDATES = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_negation": False},
    "countdown": {"min_numbers": 3, "max_numbers": 3, "max_value": 20, "min_target": 10, "max_target": 50},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "number_sorting": {"min_numbers": 3, "max_numbers": 4, "max_decimals": 0},
    "word_sorting": {"min_words": 3, "max_words": 4},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "base_conversion": {"max_base": 10, "max_value": 64},
    "gsm_symbolic": {},
}


@dataclass
class Args:
    out_dir: str = "out/rg_screen"
    """where results.json and the tasks' files go"""
    model: str = "hf:out/smollm2"
    """the policy screened (a pretrained chat model)"""
    tasks: list[str] = field(default_factory=lambda: list(CANDIDATES))
    """the candidates screened, by dataset name (their configurations: CANDIDATES)"""
    prompts: int = 64
    """held-out questions a task"""
    pass_samples: int = 8
    """answers a question: pass@1 and pass@<this>"""
    max_new_tokens: int = 32
    """longest answer, in tokens"""
    temperature: float = 0.7
    """sampling temperature"""
    dtype: str = "auto"
    """eval.py's --dtype"""
    device: str = "auto"
    """eval.py's --device"""
    batch_size: int = 64
    """eval.py's prompts per generation batch"""


def screen(args: Args, name: str) -> dict:
    """eval.py on one candidate: its row, with the configuration and the seconds it took."""
    started = time.time()
    config = json.dumps(CANDIDATES[name])
    eval_args = ev.Args(
        policy=[args.model],
        ref=args.model,
        rm=["none"],
        names=[name],
        task=f"rg:{name}",
        task_config=config,
        task_dir=os.path.join(args.out_dir, "data"),
        num_samples=args.prompts,
        pass_at=[1, args.pass_samples],
        pass_samples=args.pass_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        dtype=args.dtype,
        device=args.device,
        show=0,
    )
    row = ev.main(eval_args)[name]
    return {"config": CANDIDATES[name], **row, "seconds": round(time.time() - started, 1)}


def table(rows: dict, k: int) -> str:
    """The rows as markdown: pass@1, pass@k, gold and valid_frac with their standard errors."""
    lines = [f"| task | config | pass@1 | pass@{k} | score | valid_frac | seconds |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        cells = [f"{row[key]:.3f} ± {row[key + '_se']:.3f}" for key in ("pass@1", f"pass@{k}", "gold", "valid_frac")]
        lines.append(f"| {name} | `{json.dumps(row['config'])}` | " + " | ".join(cells) + f" | {row['seconds']} |")
    return "\n".join(lines)


def main(args: Args) -> dict:
    unknown = [name for name in args.tasks if name not in CANDIDATES]
    if unknown:
        sys.exit(f"error: --tasks {unknown[0]}: not a candidate (one of {', '.join(CANDIDATES)})")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "results.json")
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    settings = {"model": args.model, "prompts": args.prompts, "pass_samples": args.pass_samples}
    for name in args.tasks:
        if name in rows and all(rows[name][key] == value for key, value in settings.items()):
            continue  # screened before with the same settings
        rows[name] = screen(args, name) | settings
        write_atomic(path, json.dumps(rows, indent=2))
    shown = {name: rows[name] for name in args.tasks}
    print(table(shown, args.pass_samples))
    return shown


if __name__ == "__main__":
    main(tyro.cli(Args))
