"""Screen reasoning-gym datasets for RL on a real model: its held-out pass@1 and pass@8 on each candidate task.

Each candidate is a dataset at a small configuration (CANDIDATES, --task rg:NAME --task-config JSON). eval.py samples
--pass-samples answers to each of --prompts held-out questions at --temperature; the row has pass@1 and pass@k with
their standard errors, the mean score (gold) and the share of answers the extractor parses (valid_frac). A task
worth RL leaves room both ways: pass@1 between about 0.05 and 0.6.

SmolLM2-135M-Instruct never writes the <answer> tags under reasoning-gym's system prompt (0 of 16 answers parsed on
chain_sum and spell_backward), so its own row is 0 whatever it knows. --sft-steps S > 0 screens a second policy a
task: the model after S steps of LoRA SFT on that task's demonstrations (<answer>ANSWER</answer>, batch 8), long
enough to learn the format and short of learning the task from 8 S answers; make real-rlvr starts its GRPO there.

Writes <out_dir>/results.json (a row a task and policy, kept as they finish: a rerun skips the rows it has) and prints
the table. CPU-heavy: 64 questions x 8 answers of 32 tokens take the 135M model minutes a task on 2 cores.

python experiments/rg_screen.py                                         # SmolLM2-135M-Instruct, every candidate
python experiments/rg_screen.py --tasks chain_sum spell_backward --prompts 16
python experiments/rg_screen.py --sft-steps 0                           # the instruct model alone
python experiments/rg_screen.py --no-model-rows                         # the format SFT's rows alone
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
import train_sft  # noqa: E402
from common import run_main, write_atomic  # noqa: E402

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
    # from 1: reasoning-gym 0.1.25 writes 0 as an empty number and scores its own answer to it 0
    "base_conversion": {"max_base": 10, "min_value": 1, "max_value": 64},
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
    sft_steps: int = 24
    """steps of the format SFT screened beside the model (0: the model alone)"""
    sft_lr: float = 2e-4
    """the format SFT's learning rate (LoRA rank 16)"""
    model_rows: bool = True
    """screen the model itself too (--no-model-rows: the format SFT's rows alone, where the model parses nothing)"""


def format_sft(args: Args, name: str) -> str:
    """The model after --sft-steps of LoRA SFT on the task's demonstrations (batch 8): its checkpoint, kept."""
    out_dir = os.path.join(args.out_dir, "sft", name)
    checkpoint = os.path.join(out_dir, "ckpt.pt")
    if os.path.exists(checkpoint):
        return checkpoint
    sft_args = train_sft.Args(
        out_dir=out_dir,
        init=args.model,
        task=f"rg:{name}",
        task_config=json.dumps(CANDIDATES[name]),
        task_dir=os.path.join(args.out_dir, "data"),
        lora_rank=16,
        lora_alpha=32.0,
        lr=args.sft_lr,
        batch_size=8,
        micro_batch_size=8,
        max_steps=args.sft_steps,
        warmup_steps=2,
        eval_every=args.sft_steps,
        num_samples=8,
        eval_samples=8,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        device=args.device,
    )
    train_sft.main(sft_args)
    return checkpoint


def screen(args: Args, name: str, policy: str) -> dict:
    """eval.py on one candidate: the policy's row, with the configuration and the seconds it took."""
    started = time.time()
    config = json.dumps(CANDIDATES[name])
    eval_args = ev.Args(
        policy=[policy],
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
    header = f"| task | policy | config | pass@1 | pass@{k} | score | valid_frac | seconds |"
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for key, row in rows.items():
        name, _, policy = key.partition("/")
        cells = [f"{row[stat]:.3f} ± {row[stat + '_se']:.3f}" for stat in ("pass@1", f"pass@{k}", "gold", "valid_frac")]
        cells = [name, policy or "model", f"`{json.dumps(row['config'])}`", *cells, str(row["seconds"])]
        lines.append("| " + " | ".join(cells) + " |")
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
    sft_settings = settings | {"sft_steps": args.sft_steps, "sft_lr": args.sft_lr}
    shown = {}
    for name in args.tasks:
        policies = {name: (args.model, settings)} if args.model_rows else {}  # a row a task, /sft<S> the SFT's
        if args.sft_steps > 0:
            policies[f"{name}/sft{args.sft_steps}"] = (None, sft_settings)
        for key, (policy, kept) in policies.items():
            if key in rows and all(rows[key].get(stat) == value for stat, value in kept.items()):
                shown[key] = rows[key]
                continue  # screened before with the same settings
            rows[key] = screen(args, name, policy or format_sft(args, name)) | kept
            write_atomic(path, json.dumps(rows, indent=2))
            shown[key] = rows[key]
    print(table(shown, args.pass_samples))
    return shown


if __name__ == "__main__":
    run_main(main, tyro.cli(Args))  # a task the stages refuse: one line, exit 2
