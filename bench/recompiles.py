"""Recompilations of PPO's compiled training forward over a run (--compile on, inductor's CPU backend): each new
micro-batch length, logits_to_keep or output kind can be a new graph, and once dynamo's recompile limit is reached
later shapes run eager. A 1-layer model whose EOS is likely (so response lengths vary from iteration to iteration),
train_ppo.main in-process, dynamo's counters read at the end.

python bench/recompiles.py                 # 8 iterations
python bench/recompiles.py --iters 16

Last line: `recompiles: frames=<dynamo frame compilations> graphs=<unique graphs> limit_hits=<times the recompile
limit was hit> compile_s=<seconds compiling, every frame> lengths=<response widths seen>`.
"""

import logging
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoints  # noqa: E402
import train_ppo  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from task import build_task  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Args:
    iters: int = 8
    """PPO iterations"""
    max_new_tokens: int = 24
    """longest response"""
    eos_boost: float = 4.0
    """how far the random policy's EOS logit is raised (response lengths then vary)"""
    task_dir: str = "out/data"
    """the built-in task's cache"""


class LimitHits(logging.Handler):
    """Counts dynamo's log records that say the recompile limit was hit."""

    def __init__(self):
        super().__init__()
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
            self.hits += 1


def tiny_checkpoints(folder: str, task_dir: str, eos_boost: float) -> tuple[str, str]:
    """A 1-layer policy (its EOS raised) and RM on the built-in task's tokenizer, as SFT and RM checkpoints."""
    tok = load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    paths = []
    for seed, kind in enumerate(("sft", "rm")):
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, score_head=kind == "rm")
        model = GPT(config)
        with torch.no_grad():
            direction = model.transformer.wte.weight[tok.eos_id]
            model.transformer.ln_f.bias += eos_boost * direction / direction.norm() ** 2
        path = os.path.join(folder, f"{kind}.pt")
        state = dict(kind=kind, model=model.state_dict(), model_config=asdict(config), tokenizer=tok.state())
        checkpoints.save_checkpoint(state | dict(args={}, step=0, seconds=0.0, score_offset=0.0), path)
        paths.append(path)
    return paths[0], paths[1]


def main(args: Args) -> None:
    from torch._dynamo.utils import compilation_time_metrics, counters

    hits = LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    with tempfile.TemporaryDirectory() as folder:
        sft, rm = tiny_checkpoints(folder, args.task_dir, args.eos_boost)
        widths = []
        real_rollout = train_ppo.ppo_rollout

        def rollout(*a, **kw):  # records each rollout's response width
            experience, metrics, records = real_rollout(*a, **kw)
            widths.append(experience["mask"].size(1))
            return experience, metrics, records

        train_ppo.ppo_rollout = rollout
        torch._dynamo.reset()
        counters.clear()
        train_ppo.main(
            train_ppo.Args(
                out_dir=os.path.join(folder, "ppo"),
                task_dir=args.task_dir,
                sft_ckpt=sft,
                rm_ckpt=[rm],
                compile="on",
                max_steps=args.iters,
                rollout_batch_size=8,
                num_minibatches=2,
                micro_batch_size=2,
                ptx_batch_size=4,
                max_new_tokens=args.max_new_tokens,
                critic_warmup_steps=1,
                warmup_steps=1,
                log_every=args.iters,
            )
        )
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))  # dynamo + inductor, every frame
    print(
        f"recompiles: frames={frames} graphs={graphs} limit_hits={hits.hits} compile_s={seconds:.1f} lengths={widths}"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
