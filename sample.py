"""The policy of a checkpoint answers your prompts (as nanoGPT's sample.py): any checkpoint that holds a policy (SFT,
DPO, PPO, GRPO), a prompt given on the command line or a prompts JSONL, on CPU or GPU, compiled or not. A
conversational checkpoint (its tokenizer has a chat template) renders a prompt string as the user's turn.

python sample.py --ckpt out/ppo/ckpt.pt --prompt "Review of The Silent River (music, ending):"
python sample.py --ckpt out/ppo/ckpt.pt --prompt "Review of The Red Fox (plot):" --prompt "..." --answers 4
python sample.py --ckpt out/chat/sft/ckpt.pt --prompts my_prompts.jsonl --temperature 0   # greedy
"""

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import tyro

import checkpoints
import cli
import common
import hf
import parallel
from common import UserError, write_jsonl
from data import encode_prompts, prompt_text, read_jsonl
from generate import sample


@dataclass
class Args:
    ckpt: str = "out/ppo/ckpt.pt"
    """a checkpoint that holds a policy: sft, dpo, ppo or grpo"""
    prompt: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """a prompt to answer (repeat the flag for more)"""
    prompts: Optional[str] = None
    """a prompts JSONL, {"prompt": str or [messages]} a line, answered after the --prompt ones"""
    answers: int = 1
    """answers to each prompt (sampled apart; at --temperature 0 all the same)"""
    temperature: float = 1.0
    """sampling temperature (0: greedy)"""
    max_new_tokens: int = 64
    """longest answer, in tokens (fewer where the context ends first)"""
    seed: int = 1337
    """seed of the sampling"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    dtype: str = "auto"
    """auto | float32 | bfloat16 (auto: bf16 autocast on GPU, fp32 on CPU)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """the one-token decode step compiled with static KV caches (auto: on CUDA only)"""
    out: Optional[str] = None
    """also write the answers as JSONL, {"prompt" (as given), "response", "ended"} a line"""


def read_prompts(args: Args, chat: bool) -> list:
    """The --prompt strings, then the --prompts file's; a string as the user's turn of a conversation when the
    tokenizer renders conversations (chat)."""
    prompts = list(args.prompt)
    if args.prompts is not None:
        prompts += [row["prompt"] for row in read_jsonl(args.prompts, "prompts", "--prompts")]
    if not prompts:
        raise UserError("nothing to answer: give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    if any(isinstance(prompt, str) and not prompt for prompt in prompts):
        raise UserError("--prompt '': a prompt needs at least one token")
    return [[{"role": "user", "content": p}] if chat and isinstance(p, str) else p for p in prompts]


@torch.no_grad()
def main(args: Args) -> list[dict]:
    if args.temperature < 0 or args.answers < 1 or args.max_new_tokens < 1:
        raise UserError("--temperature >= 0, --answers >= 1 and --max-new-tokens >= 1")
    d = parallel.setup_dist(args.device)
    dtype = parallel.resolve_dtype(args.dtype, d.device)
    model, tok, _ = hf.load_init(args.ckpt, flag="--ckpt", kind=checkpoints.POLICY_KINDS)
    prompts = read_prompts(args, tok.chat)
    model = model.to(d.device).eval()
    generator = torch.Generator(device=d.device).manual_seed(args.seed)
    repeated = [prompt for prompt in prompts for _ in range(args.answers)]
    query, query_mask = (tensor.to(d.device) for tensor in encode_prompts(tok, repeated))
    compiled = parallel.use_compile(args.compile, d.device)
    with torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32):
        samples = sample(
            model, tok, query, query_mask, args.max_new_tokens, args.temperature, generator=generator, compiled=compiled
        )
    answers, records = [], []
    for row, prompt in enumerate(repeated):
        ended = bool(samples.ended[row])
        answers.append({"prompt": prompt_text(tok, prompt), "response": samples.texts[row], "ended": ended})
        records.append({"prompt": prompt, "response": samples.texts[row], "ended": ended})
        if row % args.answers == 0:
            print(f"\n{answers[-1]['prompt']}")
        print(f"  -> {samples.texts[row]}{'' if ended else '  [no EOS: --max-new-tokens reached]'}")
    if samples.skipped:
        print(f"({samples.skipped} prompts leave no room in the context for an answer: not answered)")
    if args.out is not None:
        write_jsonl(args.out, records)
        print(f"wrote {len(records)} answers to {args.out}")
    return answers


if __name__ == "__main__":
    common.run_main(main, cli.parse(Args))
