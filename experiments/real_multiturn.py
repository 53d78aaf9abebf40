"""Multi-turn RL on a real pretrained model (make real-multiturn): SmolLM2-135M-Instruct plays the guessing game
in chat.

The game of guess.py at chat sizes (a secret in 1..--numbers, --turns guesses), asked as chat messages, with the
feedback "Higher." or "Lower." as the next user turn (experiments/chat_guess.py: the prompt, the lenient parse, the
exact optimum). eval.py --env plays the instruct model on --eval-prompts held-out games (success ± standard error,
turns, invalid share, KL to the instruct model), then GRPO over the games (LoRA rank 16, the instruct model as the
reference), then eval again on the same games. Train and held-out secrets come from different seeds. The model is
make real's (a 4-bit round trip of the released weights, out/smollm2). Writes <out_dir>/results.json, one row per
policy, and _meta (the sizes, the optimum and two baselines, the dtype, the seconds). Finished steps are kept.

python experiments/real_multiturn.py                          # make real-multiturn
python experiments/real_multiturn.py --tiny --out-dir /tmp/r  # the chain with tiny sizes (the test)
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chat_guess  # noqa: E402
from real import build_model, run, run_dtype, stage, write_rows  # noqa: E402

ENV = f"{os.path.abspath(chat_guess.__file__)}:ChatGame"


@dataclass
class Args:
    out_dir: str = "out/real_multiturn"
    """where the games, the run and results.json go"""
    model_dir: str = "out/smollm2"
    """the Hugging Face folder of the model (built from the package's GGUF when missing: make smollm2)"""
    numbers: int = 10
    """the secret is a whole number in 1..numbers"""
    turns: int = 4
    """guesses a game allows (eval's and GRPO's --max-turns)"""
    eval_prompts: int = 128
    """held-out games of the evaluation"""
    episodes: int = 80
    """games GRPO plays (16 an iteration: 5 iterations, docs/results.md)"""
    group_size: int = 4
    """GRPO's games per secret"""
    rollout_batch_size: int = 16
    """games an iteration plays"""
    max_new_tokens: int = 5
    """longest turn, in tokens (a guess is its digits and <|im_end|>)"""
    temperature: float = 0.7
    """sampling temperature of training and evaluation"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """GRPO's and eval's --dtype, as make real's (auto: bf16 on a GPU, fp32 on CPU). Kept in <out_dir>/dtype: a
    resume in another refuses"""
    tiny: bool = False
    """tiny sizes: the chain runs in a minute and its numbers mean nothing"""


def main(args: Args) -> None:
    started = time.time()
    model = args.model_dir
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        build_model(model)
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    dtype = run_dtype(out, args.dtype)
    print(f"real_multiturn: GRPO and eval in {dtype}, into {out}", flush=True)
    sizes = dict(eval=4, episodes=8, batch=4, group=2, turns=2) if args.tiny else None
    turns = sizes["turns"] if sizes else args.turns
    eval_count = sizes["eval"] if sizes else args.eval_prompts
    episodes = sizes["episodes"] if sizes else args.episodes
    train_path, eval_path = os.path.join(out, "prompts.jsonl"), os.path.join(out, "eval_prompts.jsonl")
    # every training game is asked group_size times by GRPO: as many secrets as groups, from another seed
    group_size = sizes["group"] if sizes else args.group_size
    write_rows(train_path, chat_guess.rows(episodes // group_size, args.numbers, turns, seed=1))
    write_rows(eval_path, chat_guess.rows(eval_count, args.numbers, turns, seed=2))
    game = ["--env", ENV, "--max-turns", str(turns), "--max-new-tokens", str(args.max_new_tokens)]
    game += ["--temperature", str(args.temperature), "--dtype", dtype]
    # the instruct model's games, before training
    instruct_path = os.path.join(out, "instruct.json")
    flags = ["--policy", f"hf:{model}", "--names", "instruct", "--ref", f"hf:{model}", "--rm", "none"]
    flags += ["--prompts", eval_path, "--num-samples", str(eval_count), *game, "--json", instruct_path, "--show", "5"]
    if not os.path.exists(instruct_path):
        run(stage("eval.py", *flags), os.path.join(out, "eval_instruct.txt"))
    # GRPO over the games, LoRA on the instruct model (the reference is its base)
    ckpt = os.path.join(out, "grpo", "ckpt.pt")
    if not os.path.exists(ckpt):
        flags = ["--sft-ckpt", f"hf:{model}", "--rm-ckpt", "none", "--prompts", train_path, *game]
        flags += ["--estimator", "grpo", "--group-size", str(group_size), "--total-episodes", str(episodes)]
        flags += ["--rollout-batch-size", str(sizes["batch"] if sizes else args.rollout_batch_size)]
        flags += ["--lora-rank", "16", "--lr", "5e-4", "--kl-coef", "0.04", "--micro-batch-size", "16"]
        flags += ["--num-minibatches", "1", "--warmup-steps", "1", "--ptx-coef", "0", "--log-every", "1"]
        flags += ["--sample-every", "4", "--out-dir", os.path.dirname(ckpt), "--overwrite"]
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        run(stage("train_grpo.py", *flags), os.path.join(os.path.dirname(ckpt), "stdout.txt"))
    # the trained policy's games: the same held-out secrets and seed
    grpo_path = os.path.join(out, "grpo.json")
    flags = ["--policy", ckpt, "--names", "grpo", "--ref", f"hf:{model}", "--rm", "none"]
    flags += ["--prompts", eval_path, "--num-samples", str(eval_count), *game, "--json", grpo_path, "--show", "5"]
    if not os.path.exists(grpo_path):
        run(stage("eval.py", *flags), os.path.join(out, "eval_grpo.txt"))
    results = json.load(open(instruct_path)) | json.load(open(grpo_path))
    meta = {"numbers": args.numbers, "turns": turns, "baselines": chat_guess.baselines(args.numbers, turns)}
    results["_meta"] = meta | {"dtype": dtype, "seconds": round(time.time() - started)}
    results_path = os.path.join(out, "results.json")
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    for name in ("instruct", "grpo"):
        row = results[name]
        print(
            f"{name}: success {row['success']:.3f} ± {row['success_se']:.3f}, turns {row['turns']:.2f}, "
            f"invalid {row['episode/invalid']:.3f}, kl {row['kl']:.3f}"
        )
    print(f"the optimum: success {meta['baselines']['optimum']['success']:.3f}")
    print(f"real_multiturn: {results_path} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
