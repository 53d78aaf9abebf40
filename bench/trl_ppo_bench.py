#!/usr/bin/env python3
"""Peer baseline: HuggingFace TRL's PPOTrainer on a tiny, randomly initialised GPT-2, CPU only.

Everything is built in code (no hub access): a GPT-2 policy, a frozen reference copy, a reward model
and a value model (GPT2ForSequenceClassification, num_labels=1), a WordLevel tokenizer, and a dataset
of random fixed-length prompts. TRL's own PPO loop runs unmodified; timing is taken from outside by
(a) a TrainerCallback marking the end of every PPO iteration and (b) thin timing wrappers around the
module-level helpers that TRL's train() calls (batch_generation / forward / get_reward) and around the
accelerator's backward and the optimizer's step.

Requires trl with `trl.experimental.ppo` (PPO was dropped from TRL in 1.13.0; 1.12.0 is the last
release that has it). Example:

    python trl_ppo_bench.py --prompt-len 16 --resp-len 48 --batch 64 --iters 6 \
        --ppo-epochs 4 --mini-batches 4 --threads 2

--model-dir DIR runs the same loop on a real Hugging Face folder instead (out/smollm2: SmolLM2-135M-Instruct),
built as TRL's examples build it (see load_pretrained):

    python trl_ppo_bench.py --model-dir out/smollm2 --prompt-len 32 --resp-len 32 --batch 16 --iters 4 \
        --ppo-epochs 1 --mini-batches 2 --threads 2

Final line: `trl_ppo_bench: sec_per_iter=<median> gen_tok_per_s=<x> peak_rss_mb=<y>`
where sec_per_iter is the median over iterations 2..K (iteration 1 is warm-up) and
gen_tok_per_s = batch * resp_len / sec_per_iter (end-to-end PPO throughput, not generation alone).
"""

import argparse
import copy
import gc
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict

# Offline and quiet before anything from HF is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--resp-len", type=int, default=48)
    p.add_argument("--batch", type=int, default=64, help="prompts (rollouts) per PPO iteration")
    p.add_argument("--iters", type=int, default=6, help="PPO iterations; the first is warm-up")
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (TRL default is 0.7)")
    p.add_argument("--lr", type=float, default=3e-6, help="TRL PPOConfig default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="TRL's default is bf16=True; we default to fp32")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="TRL gradient_accumulation_steps (per_device_train_batch_size = batch / this); >1 shows how "
        "accelerate then skips optimizer steps across mini-batch boundaries",
    )
    p.add_argument("--model-dir", default=None, help="a Hugging Face folder to load instead of the random GPT-2")
    p.add_argument("--quiet", action="store_true", help="do not print TRL's per-iteration metric dicts")
    return p.parse_args()


def build_tokenizer(vocab):
    """WordLevel tokenizer: ids 0..vocab-1 are 't0'..'t{vocab-1}', then <pad>, <eos>, <unk>.

    The special ids are >= the model's vocab_size, so the policy can never sample them: responses are
    always exactly resp_len tokens long and never contain the pad token (TRL treats any pad id inside a
    response as padding). TRL masks pad ids to 0 before every model call, so out-of-range ids are safe.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok_vocab = {f"t{i}": i for i in range(vocab)}
    tok_vocab.update({"<pad>": vocab, "<eos>": vocab + 1, "<unk>": vocab + 2})
    tok = Tokenizer(models.WordLevel(vocab=tok_vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_random(args):
    """(tokenizer, policy, reference, reward model, value model): a random GPT-2 of the flags' shape, fp32."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config

    V = args.vocab
    assert args.prompt_len + args.resp_len <= args.n_positions, "prompt_len + resp_len must fit in n_positions"
    tokenizer = build_tokenizer(V)
    config = GPT2Config(
        vocab_size=V,
        n_positions=args.n_positions,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    policy = AutoModelForCausalLM.from_config(config)
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)  # what TRL's create_reference_model does
    reward_model = AutoModelForSequenceClassification.from_config(config).eval().requires_grad_(False)
    value_model = copy.deepcopy(reward_model).train().requires_grad_(True)  # TRL examples init value from RM
    return tokenizer, policy, ref_policy, reward_model, value_model


def load_pretrained(model_dir):
    """(tokenizer, policy, reference, reward model, value model) from a Hugging Face folder, fp32: the policy
    AutoModelForCausalLM, the reference its frozen copy, the reward model AutoModelForSequenceClassification with
    num_labels=1 (a fresh, untrained score head: the scores mean nothing, the work is the same), the value model a
    trainable copy of the reward model (as TRL's examples).

    TRL treats every pad id inside a response as padding: the first one ends the response (its reward is read
    before it, the rest is masked out of the loss) and each one is masked out of attention. SmolLM2's pad is
    <|im_end|> (id 2), which the policy samples, so some responses would be cut short and the work would differ
    from ours. The pad token is set to a new <pad>, id = the model's vocabulary size, which the policy can never
    sample (as build_tokenizer does; TRL masks pad ids to 0 before every model call), so every response is exactly
    --resp-len tokens, as in the random-model case.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert tokenizer.pad_token_id == policy.config.vocab_size, "<pad> must lie outside the model's vocabulary"
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    reward_model = reward_model.eval().requires_grad_(False)
    value_model = copy.deepcopy(reward_model).train().requires_grad_(True)
    return tokenizer, policy, ref_policy, reward_model, value_model


class PhaseTimer:
    """Accumulates wall time per named phase; one dict per PPO iteration."""

    def __init__(self):
        self.cur = defaultdict(float)
        self.iters = []  # list of (iteration wall seconds, {phase: seconds})
        self.t_last = None

    def wrap(self, fn, name_fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[name_fn()] += time.perf_counter() - t

        return timed

    def start(self):
        self.t_last = time.perf_counter()

    def end_iteration(self):
        now = time.perf_counter()
        self.iters.append((now - self.t_last, dict(self.cur)))
        self.cur = defaultdict(float)
        self.t_last = now


def main():
    args = parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    try:
        import trl.experimental.ppo.ppo_trainer as ppo_mod
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError:
        sys.exit(f"trl {trl.__version__} has no trl.experimental.ppo (removed in 1.13.0); pip install 'trl==1.12.0'")

    transformers.logging.set_verbosity_error()
    B, R, P, V = args.batch, args.resp_len, args.prompt_len, args.vocab
    assert B % args.mini_batches == 0, "--batch must be a multiple of --mini-batches"
    assert B % args.grad_accum == 0, "--batch must be a multiple of --grad-accum"

    # ---- tokenizer, models, data -------------------------------------------------------------
    if args.model_dir is None:
        tokenizer, policy, ref_policy, reward_model, value_model = build_random(args)
    else:
        tokenizer, policy, ref_policy, reward_model, value_model = load_pretrained(args.model_dir)
        V = policy.config.vocab_size
    n_params = sum(p.numel() for p in policy.parameters())

    n_prompts = B * args.iters  # every iteration sees fresh prompts
    g = torch.Generator().manual_seed(args.seed)
    allowed = torch.tensor([i for i in range(V) if i not in tokenizer.added_tokens_decoder])  # never a special id
    prompts = allowed[torch.randint(0, len(allowed), (n_prompts, P), generator=g)].tolist()
    train_dataset = Dataset.from_dict({"input_ids": prompts})

    # ---- TRL config --------------------------------------------------------------------------
    # Batch semantics in TRL's PPO: rollout batch = per_device_train_batch_size * gradient_accumulation_steps;
    # mini-batch = rollout batch / num_mini_batches; micro-batch = per_device_train_batch_size. Accelerate only
    # steps the optimizer every gradient_accumulation_steps micro-batches, so GA=1 with per_device=B gives the
    # textbook schedule: one optimizer step per mini-batch, ppo_epochs * mini_batches steps per iteration
    # (the bench checks this by counting the inner torch optimizer's steps).
    out_dir = tempfile.mkdtemp(prefix="trl_ppo_bench_")
    ppo_args = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=B // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum,
        num_mini_batches=args.mini_batches,
        num_ppo_epochs=args.ppo_epochs,
        total_episodes=B * args.iters,
        local_rollout_forward_batch_size=B,  # generate / score the whole batch at once
        response_length=R,
        stop_token=None,
        stop_token_id=None,  # no early stop: every response is exactly R tokens
        temperature=args.temperature,
        learning_rate=args.lr,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=args.bf16,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True (it is not applied by PPOTrainer anyway)
        use_cpu=True,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = PPOTrainer(
        args=ppo_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
    )

    # ---- instrumentation (no change to TRL's code; module globals / instance attributes) ------
    eos_rows = []  # per iteration: responses holding the EOS id (SmolLM2's <|im_end|>, its own pad id)
    raw_generation = ppo_mod.batch_generation

    def checked_generation(*a, **kw):
        query_responses, logitss = raw_generation(*a, **kw)
        responses = query_responses[:, P:]
        assert responses.shape == (B, R) and not (responses == tokenizer.pad_token_id).any(), "a response was cut"
        eos_rows.append(int((responses == tokenizer.eos_token_id).any(1).sum()))
        return query_responses, logitss

    ppo_mod.batch_generation = checked_generation
    pt = PhaseTimer()
    grad_tag = lambda fwd, bwd: lambda: bwd if torch.is_grad_enabled() else fwd  # noqa: E731
    ppo_mod.batch_generation = pt.wrap(ppo_mod.batch_generation, lambda: "generate")
    ppo_mod.forward = pt.wrap(ppo_mod.forward, grad_tag("rollout_ref_fwd", "train_fwd"))
    ppo_mod.get_reward = pt.wrap(ppo_mod.get_reward, lambda: "rollout_value_reward_fwd")
    ppo_mod.selective_log_softmax = pt.wrap(ppo_mod.selective_log_softmax, grad_tag("rollout_logprob", "train_logprob"))
    ppo_mod.gc = types.SimpleNamespace(collect=pt.wrap(gc.collect, lambda: "gc_collect"))  # TRL calls it 2x/iter
    trainer.log = pt.wrap(trainer.log, lambda: "log_metrics")
    acc = trainer.accelerator
    acc.backward = pt.wrap(acc.backward, lambda: "backward")
    trainer.optimizer.step = pt.wrap(trainer.optimizer.step, lambda: "optimizer_step")
    n_opt_steps = [0]
    inner_opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    inner_opt.register_step_post_hook(lambda *_: n_opt_steps.__setitem__(0, n_opt_steps[0] + 1))

    class IterClock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            pt.start()

        def on_step_end(self, *a, **kw):
            pt.end_iteration()

    trainer.add_callback(IterClock())
    if args.quiet:
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)

    print(
        f"[setup] trl={trl.__version__} transformers={transformers.__version__} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} attn={policy.config._attn_implementation} "
        f"mixed_precision={acc.mixed_precision} optim={ppo_args.optim} device={acc.device}",
        flush=True,
    )
    print(
        f"[setup] {args.model_dir or 'random GPT-2'}: policy params={n_params / 1e6:.2f}M (x4 models) "
        f"layers={policy.config.num_hidden_layers} heads={policy.config.num_attention_heads} "
        f"dim={policy.config.hidden_size} vocab={V} | B={B} P={P} R={R} iters={args.iters} "
        f"ppo_epochs={args.ppo_epochs} mini_batches={args.mini_batches} (mini-batch={ppo_args.local_mini_batch_size}, "
        f"micro-batch={ppo_args.per_device_train_batch_size}, grad_accum={ppo_args.gradient_accumulation_steps})",
        flush=True,
    )

    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0

    # ---- report --------------------------------------------------------------------------------
    assert len(pt.iters) == args.iters, (len(pt.iters), args.iters)
    steady = pt.iters[1:] if len(pt.iters) > 1 else pt.iters
    it_times = [t for t, _ in pt.iters]
    med = statistics.median(t for t, _ in steady)
    phases = [
        "generate",
        "rollout_logprob",
        "rollout_ref_fwd",
        "rollout_value_reward_fwd",
        "train_fwd",
        "train_logprob",
        "backward",
        "optimizer_step",
        "gc_collect",
        "log_metrics",
    ]
    med_phase = {ph: statistics.median(d.get(ph, 0.0) for _, d in steady) for ph in phases}
    med_other = statistics.median(t - sum(d.values()) for t, d in steady)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    gen_only = B * R / med_phase["generate"] if med_phase["generate"] > 0 else float("nan")
    print(f"[result] iteration seconds: {' '.join(f'{t:.3f}' for t in it_times)} (first = warm-up)")
    print(
        f"[result] total wall (trainer.train) = {total:.2f}s; optimizer steps = {n_opt_steps[0]} "
        f"(expected {args.iters * args.ppo_epochs * args.mini_batches})"
    )
    print(f"[result] responses holding the EOS id {tokenizer.eos_token_id} per iteration: {eos_rows} of {B}")
    print(
        "[result] median phase seconds per iteration: "
        + " ".join(f"{ph}={med_phase[ph]:.3f}" for ph in phases)
        + f" other={med_other:.3f}"
    )
    train_s = sum(med_phase[k] for k in ("train_fwd", "train_logprob", "backward", "optimizer_step"))
    rollout_s = sum(
        med_phase[k] for k in ("generate", "rollout_logprob", "rollout_ref_fwd", "rollout_value_reward_fwd")
    )
    print(
        f"[result] rollout (gen+scoring) = {rollout_s:.3f}s ({100 * rollout_s / med:.0f}%), "
        f"train (fwd+logprob+bwd+step) = {train_s:.3f}s ({100 * train_s / med:.0f}%), "
        f"generation-only tok/s = {gen_only:.0f}"
    )
    print(f"trl_ppo_bench: sec_per_iter={med:.3f} gen_tok_per_s={B * R / med:.1f} peak_rss_mb={peak_rss_mb:.0f}")


if __name__ == "__main__":
    main()
