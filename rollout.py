"""The rollout both RL stages share (train_ppo.py: PPO-max; train_grpo.py: the critic-free family), steps 1-3 of an
iteration, with the flags they read (`RolloutArgs`) and the models they run, by role (`Models`: the actor, its
frozen reference, the frozen reward models, PPO's critic and the bf16 sampler; `load_inputs`, `build_models`, `place`),
and the RL loop's state (`Loop`, `build_loop`):

1. generate: an episode a prompt (`generate_episodes`): with --env up to --max-turns turns against the environment,
   otherwise one turn whose environment is --reward-fn (`OneTurn`), from the KV-cache decode at the rollout's
   temperature; or continuations of partial responses (`prefix`; k continuations a row in one call);
2. score: each turn's reward on its last model token, plus each reward model's score on the episode's last token,
   aggregated over an ensemble (--rm-agg); an episode whose last turn has no EOS scores as --missing-eos-penalty says;
3. log-probs: the policy's and the reference's over the response tokens from the training forward; the policy's
   checked against the sampler's own (TIS weights where they differ by design: a bf16 sampler).

Then the rollout's metrics (docs/design.md §5, §6), and what an update measures of the policy it moved.
"""

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist

import checkpoints
import common
import hf
import parallel
from checkpoints import POLICY_KINDS, load_checkpoint
from common import UserError
from data import Order, PromptStream, PtxStream, RLData, encode_prompts, env_spec, load_prompts, prompt_text
from generate import Episodes, Samples, continuation_budget, join_samples, run_episodes, sample
from lora import BaseView
from model import (
    aggregate_rm_scores,
    entropy_from_logits,
    left_pack,
    logprobs_from_logits,
    masked_mean,
    packed_response_logits,
    response_forward,
    row_extent,
)
from tokenizer import Tokenizer, same_tokenizer


@dataclass
class RolloutArgs(common.CommonArgs):
    """Flags both RL stages share: what they start from, what they sample and how it is scored."""

    # --- models and data
    sft_ckpt: str = "out/sft/ckpt.pt"
    """the policy's init: a policy checkpoint (SFT, DPO, PPO or GRPO) or a pretrained model (hf:<name-or-path>,
    gpt2, ...); also the frozen reference unless --ref-ckpt"""
    ref_ckpt: Optional[str] = None
    """the frozen reference of the KL penalty, as --sft-ckpt (None: --sft-ckpt); a later round of iterated RLHF
    starts its policy from the last round's and keeps the SFT policy as the reference"""
    rm_ckpt: list[str] = field(default_factory=lambda: ["out/rm/ckpt.pt"])
    """frozen reward models: one, or the K members of an ensemble combined by --rm-agg; 'none': --reward-fn alone"""
    rm_agg: Literal["mean", "min", "uwo"] = "mean"
    """an ensemble's scores combined: mean, min (the worst case) or uwo = mean - --rm-uwo-coef x the members'
    variance (uncertainty-weighted optimisation, Coste et al. 2023); one RM is its own score under all three"""
    rm_uwo_coef: float = 1.0
    """--rm-agg uwo: the weight of the members' population variance"""
    reward_fn: Optional[str] = None
    """module:function or path/to/file.py:function, fn(prompt: str, response: str, ended: bool) -> float, added to
    the RM score (e.g. task:gold_reward)"""
    reward_fn_coef: float = 1.0
    """weight of --reward-fn in the score"""
    prompts: Optional[str] = None
    """prompts JSONL, one {"prompt": str or [messages]} a line and any fields --env reads (None: the built-in task's)"""
    env: Optional[str] = None
    """module:NAME or path/to/file.py:NAME, NAME(row) an episode's environment over several turns (docs/usage.md; None:
    one response a prompt, or the built-in task's own ENV)"""
    max_turns: int = 1
    """--env: the model turns an episode may take"""
    ptx_data: Optional[str] = None
    """pre-training text JSONL {"text": str} for the ptx loss (None: on by default on the reviews task only, with its
    own text; no ptx on arith, whose demonstrations are half wrong on purpose, nor on --prompts)"""
    # --- rollout
    total_episodes: int = 12800
    """responses (episodes) sampled over the run (max_steps = total_episodes / rollout_batch_size unless --max-steps;
    train_grpo.py stops when its episodes, dynamic sampling's extra rounds included, reach this)"""
    rollout_batch_size: int = 64
    """responses per iteration, summed over ranks (the experience buffer: small, as PPO-max advises)"""
    num_minibatches: int = 2
    """optimizer steps per pass over a rollout (a minibatch is rollout_batch_size / num_minibatches)"""
    micro_batch_size: int = 32
    """rows per rank per forward, at most a rank's share of a minibatch (gradient accumulation makes up the rest)"""
    max_new_tokens: int = 64
    """longest response; sampling uses the tempered distribution only (top-k/top-p would make the ratio off-policy)"""
    temperature: float = 1.0
    """sampling temperature; log-probs for the ratio and the KL use logits / temperature too"""
    missing_eos_penalty: Optional[float] = None
    """the score of a response without EOS. None: with an RM, its part is -1 (an RM reads its score at the EOS) and
    --reward-fn still adds its own value (it is given `ended`); with --reward-fn alone, the function decides. A
    number: every such response scores it, whatever the RM or the function says (with --env: replaces the return of
    an episode whose last turn did not end)"""
    mask_truncated: bool = False
    """DAPO overlong filtering: responses without EOS, and episodes truncated by the context, keep their score but
    contribute nothing to the loss"""
    tis_cap: Optional[float] = None
    """truncated importance sampling (Yao et al. 2025), for a sampler whose numerics differ from the trainer's (bf16):
    each token's policy loss weighted by min(pi_old / pi_sampler, C), pi_old the training forward's probability of
    the sampled token and pi_sampler the generation's own (None: off)"""
    ptx_coef: float = 0.1
    """weight of the LM loss on pre-training text, where there is one (--ptx-data; 0: off)"""
    ptx_batch_size: int = 16
    """pre-training texts per optimizer step, summed over ranks (split like the minibatch)"""
    sample_every: int = 25
    """iterations between sample tables (TensorBoard text and samples.jsonl; 0: only the last)"""

    def __post_init__(self):
        # one RM path from code may come as a string (the saved args of --resume are rebuilt through here too)
        self.rm_ckpt = [self.rm_ckpt] if isinstance(self.rm_ckpt, str) else list(self.rm_ckpt)


def check_rollout_args(args: RolloutArgs, scored: bool = True) -> None:
    """The shared settings no run can mean: a one-line UserError naming the flag, before any work. scored: the run
    needs a score (an RM or --reward-fn); distillation's reward is the teacher's log-probs alone."""
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: RL samples from the tempered distribution; use > 0")
    env = env_spec(args)
    if scored and args.rm_ckpt == ["none"] and args.reward_fn is None and env is None:
        raise UserError("--rm-ckpt none needs --reward-fn module:function (e.g. task:gold_reward) or --env")
    if env is not None and args.reward_fn is not None:
        where = f"--env {env}" if args.env else f"--task {args.task} (its environment {env})"
        raise UserError(f"{where} and --reward-fn {args.reward_fn}: an environment's step gives the rewards, pass one")
    if args.max_turns < 1:
        raise UserError(f"--max-turns {args.max_turns}: the model's turns an episode may take, use >= 1")
    if "none" in args.rm_ckpt and len(args.rm_ckpt) > 1:
        raise UserError(f"--rm-ckpt {' '.join(args.rm_ckpt)}: 'none' stands alone (no reward model)")
    if args.tis_cap is not None and args.tis_cap <= 0:
        raise UserError(f"--tis-cap {args.tis_cap}: the cap of an importance weight, use > 0 (e.g. 2)")
    if args.ptx_coef < 0:
        raise UserError(f"--ptx-coef {args.ptx_coef}: a loss weight, use >= 0")


# -----------------------------------------------------------------------------
# the models an RL stage runs, by role: the policy (actor, LM head), its frozen reference, the frozen reward
# models (scalar heads: one, the K members of an ensemble, or none with --rm-ckpt none) and PPO's critic, built
# from their checkpoints; their training forwards under --compile; and the sampler, a frozen bf16 copy of the actor
# that generates the rollouts under bf16, refreshed after every update


@dataclass
class Models:
    """The roles of an RL stage. Under LoRA the reference is the actor with its adapters off (lora.BaseView), and
    PPO's first reward model its critic's base with the RM's head. sampler: what generates the rollouts when it is not
    the actor itself, a bf16 copy of it (with_sampler); critic: PPO's value model (None in GRPO)."""

    actor: torch.nn.Module
    ref: torch.nn.Module
    reward_models: list[torch.nn.Module]
    sampler: Optional[torch.nn.Module] = None
    critic: Optional[torch.nn.Module] = None

    def trained(self) -> list[torch.nn.Module]:
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def frozen(self) -> list[torch.nn.Module]:
        return [self.ref, *self.reward_models]

    def compiled(self, setting: str, device: torch.device) -> "Models":
        """The training forward of each role: torch.compile'd under --compile (a LoRA view switches its base's
        adapters in eager code around the call: not compiled), else the modules themselves. The rollout's no-grad
        passes run it, so the sampler's log-probs are checked against the very forward the update differentiates."""
        if not parallel.use_compile(setting, device):
            return self
        reward_models = [compile_role(m) for m in self.reward_models]
        actor, ref, critic = compile_role(self.actor), compile_role(self.ref), compile_role(self.critic)
        return Models(actor, ref, reward_models, self.sampler, critic)

    def with_sampler(self, dtype: torch.dtype, fsdp: bool) -> "Models":
        """Under bf16, not --fsdp: a frozen bf16 copy of the actor that generates the rollouts; refresh_sampler copies
        the actor in after every update, in place. LoRA adapters stay unmerged, as in the actor's forward: merged into
        the bf16 base, most of a small update would round away (lora.LoRALinear.merged_weight)."""
        if dtype == torch.float32 or fsdp:
            return self
        sampler = copy.deepcopy(self.actor).requires_grad_(False).eval()
        return replace(self, sampler=parallel.store_low_precision(sampler, dtype))

    @torch.no_grad()
    def refresh_sampler(self) -> None:
        """The actor's trained parameters into its bf16 sampler, in place (copy_: static caches and CUDA graphs keep
        their addresses, no recompile); the actor's fp32 master weights and optimizer state are untouched."""
        if self.sampler is None:
            return
        trained = {name: p for name, p in self.actor.named_parameters() if p.requires_grad}
        unexpected = self.sampler.load_state_dict(trained, strict=False).unexpected_keys
        assert not unexpected, f"the sampler lacks {unexpected}"


def training_forwards(models: Models, trained: list[common.Trained], setting: str, d) -> Models:
    """Each trained role's `forward`, what its losses call, set in place: its module compiled under --compile
    (Models.compiled), DDP-wrapped under torchrun (parallel.wrap_ddp). Returns the roles compiled, not wrapped: the
    rollout's no-grad passes run them, so the sampler's log-probs are checked against the very forward the update
    differentiates."""
    compiled = models.compiled(setting, d.device)
    for entry, module in zip(trained, compiled.trained()):
        entry.forward = parallel.wrap_ddp(module, d)
    return compiled


def policy_checkpoint(spec: str, flag: str) -> dict:
    """A policy's init as a checkpoint dict: our .pt file, or a pretrained model (hf:<name-or-path>, gpt2, ...) as
    an sft checkpoint with no training state."""
    if spec.endswith(".pt"):
        return load_checkpoint(spec, kind=POLICY_KINDS, flag=flag)
    if spec == "scratch":
        raise UserError(f"{flag} scratch: an RL run starts from a trained policy (a .pt checkpoint or hf:<path>)")
    model, tok, _ = hf.load_init(spec, flag=flag)
    return {"kind": "sft", "model": model.state_dict(), "model_config": asdict(model.config), "tokenizer": tok.state()}


def load_inputs(args) -> tuple[dict, dict, list[dict], Tokenizer, RLData]:
    """An RL run's inputs (args: RolloutArgs): the policy's init, the reference's (--ref-ckpt, else the same) and the
    RMs' (none with --rm-ckpt none) as checkpoint dicts, checked to share one tokenizer; that tokenizer; the data."""
    sft = policy_checkpoint(args.sft_ckpt, "--sft-ckpt")
    ref = sft
    if args.ref_ckpt is not None:
        ref = policy_checkpoint(args.ref_ckpt, "--ref-ckpt")
    rms = [load_checkpoint(path, kind="rm", flag="--rm-ckpt") for path in args.rm_ckpt if path != "none"]
    tok = Tokenizer.from_state(sft["tokenizer"])
    data = load_prompts(args, tok, sft["model_config"]["block_size"])
    # a teacher or RM in another folder may hold the same tokenizer: compared by what it encodes of the run's prompts
    others = [("--ref-ckpt", args.ref_ckpt, ref)] + [("--rm-ckpt", p, c) for p, c in zip(args.rm_ckpt, rms)]
    for flag, path, ckpt in others:
        other_tok = tok if ckpt["tokenizer"] == sft["tokenizer"] else Tokenizer.from_state(ckpt["tokenizer"])
        difference = same_tokenizer(other_tok, tok, data.prompts)
        if difference:
            raise UserError(f"{flag} {path}: its tokenizer differs from --sft-ckpt {args.sft_ckpt}'s: {difference}")
    return sft, ref, rms, tok, data


def compile_role(model):
    """parallel.compile_forward, except for a LoRA view and a missing role."""
    return model if model is None or isinstance(model, BaseView) else parallel.compile_forward(model)


def build_models(args, sft: dict, ref: dict, rms: list[dict], critic_init: Optional[dict] = None) -> Models:
    """The roles from the checkpoints in memory, on the CPU, LoRA and --grad-ckpt on what trains: the policy, its
    frozen reference (under LoRA the policy's adapters off when ref is its init), the frozen RMs, and with
    critic_init a critic of its trunk and score head (a fresh head if it has none)."""
    actor = hf.model_from_checkpoint(sft)
    parallel.prepare_model(actor, args, "actor")
    lora = args.lora_rank > 0
    reference = BaseView(actor) if lora and ref is sft else hf.model_from_checkpoint(ref)
    critic = None
    if critic_init is not None:
        critic = hf.model_from_checkpoint(critic_init, lm_head=False, score_head=True)
        parallel.prepare_model(critic, args, "critic")
    reward_models = []
    for rm in rms:
        if lora and critic_init is rm:  # the critic's frozen base is this RM's trunk: only its head is added
            head = copy.deepcopy(critic.score_head).requires_grad_(False)
            reward_models.append(BaseView(critic, score_head=head))
        else:
            reward_models.append(hf.model_from_checkpoint(rm))
    reward_models = [model.requires_grad_(False) for model in reward_models]
    return Models(actor, reference.requires_grad_(False), reward_models, critic=critic)


def place(models: Models, args, d: parallel.Dist, dtype: torch.dtype) -> Models:
    """Every role on the device in eval mode: what trains (the actor, PPO's critic) in fp32, what is frozen in bf16
    under bf16, all of it sharded under --fsdp; then, under bf16, the sampler (with_sampler)."""
    trained = models.trained()
    for model in trained + models.frozen():
        model.eval()
        frozen = not any(model is other for other in trained)
        parallel.place_model(model, args, d, dtype, frozen=frozen)
    return models.with_sampler(dtype, args.fsdp)


@dataclass
class Engine:
    """What a run's rollouts are made with, fixed while it runs (one object a call, as nanochat's Engine): the models by
    role, the tokenizer, the shared flags, the rows per forward, the generator of every random draw (sampling here,
    shuffling in the update), the autocast dtype, the reward function (--reward-fn), on the built-in task the gold
    reward (logged, never optimised), and the environment (--env)."""

    models: Models
    tok: Tokenizer
    args: RolloutArgs
    micro_batch_size: int
    generator: torch.Generator
    dtype: torch.dtype = torch.float32
    reward_fn: Optional[Callable] = None
    gold_fn: Optional[Callable] = None
    make_env: Optional[Callable] = None  # make_env(row): an episode's environment (--env); None: one response a prompt


# -----------------------------------------------------------------------------
# 1. generate, from prompts or from token prefixes


@dataclass
class Responses:
    """A rollout's prompts and what the policy answered: its episodes (generate_episodes), or its continuations of
    partial responses (continue_responses)."""

    query: torch.Tensor  # (B, P) left-padded prompt ids
    query_mask: torch.Tensor  # (B, P)
    prompt_texts: list[str]  # each prompt as the reward function and the logs see it (a conversation rendered)
    samples: Samples  # the whole responses: a prefix given, then the tokens sampled; mask: the model's tokens
    sampled: torch.Tensor  # (B, T) 1.0 on the tokens this call sampled (samples.mask without a prefix)
    attention_mask: torch.Tensor  # (B, T) 1.0 on the response's model and observation tokens (samples.mask without)
    packed: tuple  # (ids, mask) (B, W): each row's prompt and response together (model.left_pack), what is scored
    turn_rewards: torch.Tensor  # (B, T) each turn's reward (--env's, or --reward-fn's) on its last model token
    truncated: torch.Tensor  # (B,) bool: the context cut the episode short (generate.Episodes.truncated)
    episodes: Optional[Episodes] = None  # what generate_episodes ran (None for continuations)


class OneTurn:
    """A single-turn task as an environment of one turn, so that it runs the rollout --env runs: its step ends the
    episode with --reward-fn's value on the response (raw: episode_scores weighs it by --reward-fn-coef), or 0 without
    one (the RMs score the response, episode_scores). A raise or a value that is not a finite number is one UserError
    (common.checked_reward)."""

    def __init__(self, reward_fn: Optional[Callable], name: str, prompt: str):
        self.reward_fn = reward_fn
        self.name = name
        self.prompt = prompt

    def step(self, response: str, ended: bool) -> tuple[None, float, bool]:
        if self.reward_fn is None:
            return None, 0.0, True
        return None, common.checked_reward(self.name, self.reward_fn, self.prompt, response, ended), True


def one_turn_env(engine: Engine, prompt) -> OneTurn:
    """The one-turn environment of a single-turn task's prompt (a string or a conversation)."""
    return OneTurn(engine.reward_fn, f"--reward-fn {engine.args.reward_fn}", prompt_text(engine.tok, prompt))


@torch.no_grad()
def generate_episodes(engine: Engine, rows: list) -> Responses:
    """Step 1: an episode a row, generate.run_episodes at --temperature: with --env (engine.make_env) a row is its
    JSONL record and the episode takes up to --max-turns turns; otherwise a row is a prompt (a string or a
    conversation) and its episode is one turn (OneTurn), each row stopping at its first EOS. The response is
    everything after the prompt, the model's and the observations' tokens; samples.mask (the loss mask) covers the
    model's, attention_mask both. A user's environment or reward function that fails raises UserError."""
    tok, args, models = engine.tok, engine.args, engine.models
    device = next(models.actor.parameters()).device
    if engine.make_env is None:
        prompts, envs, max_turns = rows, [one_turn_env(engine, row) for row in rows], 1
    else:
        prompts, envs, max_turns = (
            [row["prompt"] for row in rows],
            [engine.make_env(row) for row in rows],
            args.max_turns,
        )
    query, query_mask = (t.to(device) for t in encode_prompts(tok, prompts))
    compiled = parallel.use_compile(args.compile, device) and not args.fsdp
    policy = models.actor if models.sampler is None else models.sampler
    amp = torch.autocast(device.type, dtype=engine.dtype, enabled=engine.dtype != torch.float32)
    # --fsdp: gathered once for every turn, so a rank's decodes never wait on another's, whatever its turn count
    with amp, parallel.gathered(policy):
        episodes = run_episodes(
            policy,
            tok,
            query,
            query_mask,
            envs,
            max_turns,
            args.max_new_tokens,
            temperature=args.temperature,
            generator=engine.generator,
            compiled=compiled,
        )
    P = episodes.prompt_width
    response, attention_mask, mask, rewards = (
        tensor[:, P:] for tensor in (episodes.sequences, episodes.attention_mask, episodes.mask, episodes.rewards)
    )
    last = (row_extent(mask) - 1).clamp(min=0)  # (B,) the episode's last model token
    ended = episodes.last_turn_ended()
    texts = [
        episode_text(turns, observations) for turns, observations in zip(episodes.turn_texts, episodes.observations)
    ]
    samples = Samples(response, mask, episodes.logprobs[:, P:] * mask, last, ended, texts)
    prompt_texts = [prompt_text(tok, prompt) for prompt in prompts]
    packed = left_pack(episodes.sequences, episodes.attention_mask)
    turn_rewards = (rewards * mask).float()  # float32, as the RMs' scores (a float64 model's too)
    return Responses(
        query,
        query_mask,
        prompt_texts,
        samples,
        mask,
        attention_mask,
        packed,
        turn_rewards,
        episodes.truncated,
        episodes,
    )


@torch.no_grad()
def continue_responses(engine: Engine, prompts: list, prefix: tuple) -> Responses:
    """Step 1 from partial responses (VinePPO's continuations; single-turn tasks only): prefix (ids, mask) (B, Tp)
    right-padded, a partial response per row, continued with what is left of --max-new-tokens at --temperature, each
    row stopping at its first EOS; the response is the prefix and its continuation as one, scored by its one-turn
    environment (OneTurn)."""
    tok, args, models = engine.tok, engine.args, engine.models
    device = next(models.actor.parameters()).device
    query, query_mask = (t.to(device) for t in encode_prompts(tok, prompts))
    prefix_ids, prefix_mask = prefix
    # the prompt and the prefix as one left-padded prompt, each row with its own budget
    inputs, input_mask = left_pack(torch.cat([query, prefix_ids], 1), torch.cat([query_mask, prefix_mask], 1))
    budget = continuation_budget(prefix_ids, prefix_mask, args.max_new_tokens, tok.eos_id)
    compiled = parallel.use_compile(args.compile, device) and not args.fsdp
    policy = models.actor if models.sampler is None else models.sampler
    amp = torch.autocast(device.type, dtype=engine.dtype, enabled=engine.dtype != torch.float32)
    with amp, parallel.gathered(policy):  # --fsdp: gathered once, not per token
        continued = sample(
            policy, tok, inputs, input_mask, budget, args.temperature, generator=engine.generator, compiled=compiled
        )
    samples, sampled = join_samples(tok, prefix_ids, prefix_mask, continued)
    ended = samples.ended.tolist()
    rewards = [one_turn_env(engine, p).step(t, e)[1] for p, t, e in zip(prompts, samples.texts, ended)]
    rewards = torch.tensor(rewards, device=samples.mask.device)  # float32, as the RMs' scores
    turn_rewards = torch.zeros(samples.mask.shape, device=rewards.device).scatter(
        1, samples.last[:, None], rewards[:, None]
    )
    turn_rewards = turn_rewards * samples.mask.float()  # 0 where a row has no token
    prompt_texts = [prompt_text(tok, prompt) for prompt in prompts]
    packed = left_pack(torch.cat([query, samples.response], 1), torch.cat([query_mask, samples.mask], 1))
    truncated = torch.zeros_like(samples.ended)
    return Responses(query, query_mask, prompt_texts, samples, sampled, samples.mask, packed, turn_rewards, truncated)


def episode_text(turns: list[str], observations: list[str]) -> str:
    """An episode as the logs show it: each model turn as sampled, and each observation quoted after [env] (its repr:
    where the environment's text ends and the model's next turn begins)."""
    parts = [turns[0]] if turns else []
    for observation, turn in zip(observations, turns[1:]):
        parts += [f"[env] {observation!r}", turn]
    return " ".join(parts)


def micro_batches(responses: Responses, micro_batch_size: int):
    """(rows, ids, mask, response, response_mask) of each micro-batch of a rollout, in order: each row's prompt and
    response packed (Responses.packed), so a row needs only its own to fit the context; its response as generated,
    response_mask its attention mask (an episode's observations included)."""
    ids, mask = responses.packed
    response, attention_mask = responses.samples.response, responses.attention_mask
    for start in range(0, ids.size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        yield rows, ids[rows], mask[rows], response[rows], attention_mask[rows]


# -----------------------------------------------------------------------------
# 2. score


MISSING_EOS_RM_SCORE = -1.0  # an RM's part of the score of a response without EOS (--missing-eos-penalty None)


def rm_scores(engine: Engine, responses: Responses, amp) -> tuple[torch.Tensor, dict]:
    """The RMs' part of the scores (B,), each RM's at the last real token of the packed row (an episode's last model
    token), aggregated by --rm-agg; -1 for a response without EOS; 0 without an RM. Returns (scores, parts:
    score_std for an ensemble)."""
    args = engine.args
    samples = responses.samples
    members = []  # (B,) each RM's
    for reward_model in engine.models.reward_models:
        member_scores = []
        with parallel.gathered(reward_model):  # --fsdp: once for all micro-batches, however many this rank has
            for _, ids, mask, _, _ in micro_batches(responses, engine.micro_batch_size):
                with amp:
                    _, token_scores = reward_model(ids, mask, logits=False)
                member_scores.append(token_scores[:, -1].float())  # packed: every row's last token is its last column
        members.append(torch.cat(member_scores))
    scores = torch.zeros(samples.response.size(0), device=samples.response.device)
    score_parts = {}
    if members:
        member_scores = torch.stack(members)  # (K, B)
        scores = aggregate_rm_scores(member_scores, args.rm_agg, args.rm_uwo_coef)
        if member_scores.size(0) > 1:
            score_parts["score_std"] = member_scores.std(0, correction=0)
        # an RM reads its score at the EOS: a response without one has no RM score, -1 in its place
        scores = torch.where(samples.ended, scores, torch.full_like(scores, MISSING_EOS_RM_SCORE))
    return scores, score_parts


@torch.no_grad()
def episode_scores(engine: Engine, responses: Responses, amp) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Step 2: turn_rewards (B, T), each turn's reward on its last model token (--reward-fn's weighed by
    --reward-fn-coef), plus the RMs' score of the whole episode (or response) on its last, aggregated by --rm-agg; a
    given --missing-eos-penalty replaces the return of an episode whose last turn did not end. Returns (scores (B,):
    the returns, turn_rewards, parts logged apart: reward_fn, or env_return with an RM, rm_score beside either,
    score_std for an ensemble)."""
    args = engine.args
    samples = responses.samples
    turn_rewards = responses.turn_rewards
    last = samples.last[:, None]  # (B, 1) the episode's last model token
    score_parts = {}
    if engine.reward_fn is not None:
        score_parts["reward_fn"] = turn_rewards.sum(1)
        turn_rewards = args.reward_fn_coef * turn_rewards
    elif engine.models.reward_models and engine.make_env is not None:
        score_parts["env_return"] = turn_rewards.sum(1)
    if engine.models.reward_models:
        rm_part, rm_parts = rm_scores(engine, responses, amp)
        if score_parts:
            score_parts["rm_score"] = rm_part
        score_parts |= rm_parts
        turn_rewards = turn_rewards.scatter_add(1, last, rm_part[:, None])
    if args.missing_eos_penalty is not None:  # given: the whole return of an episode whose last turn did not end
        penalized = torch.zeros_like(turn_rewards).scatter(1, last, args.missing_eos_penalty)
        turn_rewards = torch.where(samples.ended[:, None], turn_rewards, penalized)
    return turn_rewards.sum(1), turn_rewards, score_parts


def raise_on_every_rank(error: Optional[UserError], device: torch.device) -> None:
    """A user error that some ranks met (their reward function raised), agreed in one all-reduce: every rank raises
    the lowest such rank's error, so all exit 2 together and none waits in a later collective. Every rank calls it at
    the same point; the error's text travels only when there is one."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    world_size = dist.get_world_size()
    first = torch.tensor(world_size if error is None else dist.get_rank(), device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first)
    if first == world_size:
        return
    message = [str(error) if error is not None else None]
    dist.broadcast_object_list(message, src=first, device=device)
    raise UserError(message[0])


def rules(args: RolloutArgs, data: RLData) -> str:
    """The start-up lines of how a response without EOS scores and whether the ptx loss is on, and on what text."""
    return f"a response without EOS scores {missing_eos_rule(args)}\nptx {ptx_rule(args, data)}"


def ptx_rule(args: RolloutArgs, data: RLData) -> str:
    """Whether the ptx loss is on, and on what text."""
    if data.ptx_path is None and args.prompts is None and args.task.startswith("rg:"):
        return f"off: no --ptx-data on --task {args.task} (a reasoning-gym dataset has no text of its own)"
    if data.ptx_path is None:
        where = "--prompts" if args.prompts else f"the {args.task} task, whose demonstrations are wrong on purpose"
        return f"off: no --ptx-data on {where}"
    if args.ptx_coef == 0:
        return f"off (--ptx-coef 0; {len(data.ptx)} texts of {data.ptx_path} unused)"
    return (
        f"on: --ptx-coef {args.ptx_coef:g} x the LM loss on {len(data.ptx)} texts of {data.ptx_path} "
        f"({data.ptx_too_long} too long, skipped; --ptx-coef 0: off)"
    )


def missing_eos_rule(args: RolloutArgs) -> str:
    """How a response without EOS scores under these flags."""
    if args.missing_eos_penalty is not None:
        return f"{args.missing_eos_penalty:g} (--missing-eos-penalty)"
    has_rm = args.rm_ckpt != ["none"]
    if has_rm and args.reward_fn:
        return "-1 for the RM's part, plus --reward-fn's own value (ended False)"
    if has_rm:
        return "-1 (the RM reads its score at the EOS)"
    return "--reward-fn's own value (ended False)" if args.reward_fn else "nothing (no score is read)"


# -----------------------------------------------------------------------------
# 3. log-probs, checked against the sampler's; TIS


@torch.no_grad()
def policy_and_reference_logprobs(engine: Engine, responses: Responses, amp) -> dict:
    """Step 3: no-grad training forwards over the packed rows, per micro-batch: the policy's and reference's
    log-probs of the response tokens and the policy's entropy, (B, T) each, masked. The micro-batch count differs
    between ranks (VinePPO), so nothing in here may reach a collective."""
    models, temperature = engine.models, engine.args.temperature
    chunks = {"logprobs": [], "ref_logprobs": [], "entropy": []}
    with parallel.gathered(models.actor):
        for _, ids, mask, response, response_mask in micro_batches(responses, engine.micro_batch_size):
            with amp:
                logits = packed_response_logits(models.actor, ids, mask, response_mask, temperature)
            chunks["logprobs"].append(logprobs_from_logits(logits, response))
            chunks["entropy"].append(entropy_from_logits(logits))
    with parallel.gathered(models.ref):  # one model gathered at a time
        for _, ids, mask, response, response_mask in micro_batches(responses, engine.micro_batch_size):
            with amp:
                ref_logits = packed_response_logits(models.ref, ids, mask, response_mask, temperature)
            chunks["ref_logprobs"].append(logprobs_from_logits(ref_logits, response))
    mask = responses.samples.mask
    return {key: torch.cat(values) * mask for key, values in chunks.items()}


# mean |log-prob diff| a token, sampler vs trainer, above which bf16 rounding can't explain it
BF16_LOGPROB_BOUND = 0.15
# largest |log-prob diff| a token in fp32 above which rounding can't explain it: SmolLM2-135M's GRPO (make real-rlvr,
# fp32, 32 answers an iteration) read 1.1e-5 to 6.1e-5 an iteration and once 1.28e-4; a stale sampler or a position
# or mask bug moves log-probs by orders of magnitude more
FP32_LOGPROB_BOUND = 1e-3


def kept_rows(experience: dict) -> torch.Tensor:
    """(B,) 1.0 on the rows --mask-truncated keeps in the loss: the response ended with EOS (an episode: its last
    turn) and, with --env, the context did not cut the episode short."""
    kept = experience["ended"]
    if "truncated" in experience:
        kept = kept * (1 - experience["truncated"])
    return kept


def check_logprobs(generation_logprobs, logprobs, mask, dtype: torch.dtype) -> tuple[float, float]:
    """The sampler's log-probs against the training forward's, (B, T) each: returns (max, mean) |diff| a token over
    every rank. Raises on every rank at once: fp32 max above FP32_LOGPROB_BOUND; bf16 or TF32 mean above
    BF16_LOGPROB_BOUND."""
    difference = (generation_logprobs - logprobs).abs() * mask
    largest = difference.max().double()
    totals = torch.stack([difference.sum(), mask.sum()]).double()
    if dist.is_initialized():
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    largest, summed, tokens = torch.cat([largest[None], totals]).tolist()  # one host sync
    mean = summed / max(tokens, 1.0)
    # the bound follows the matmuls in use: TF32's 10-bit mantissa, emulated on CPU, took SmolLM2-135M's max to 8e-3
    exact = parallel.full_precision(dtype)
    if exact and largest > FP32_LOGPROB_BOUND:
        raise RuntimeError(
            f"generation log-probs differ from the training forward by {largest:.2e} > {FP32_LOGPROB_BOUND:g} in fp32"
        )
    if not exact and mean > BF16_LOGPROB_BOUND:
        raise RuntimeError(
            f"generation log-probs differ from the training forward by {mean:.2e} nats a token on average (max "
            f"{largest:.2e}), more than bf16 or TF32 rounding ({BF16_LOGPROB_BOUND}): a sampler copy that is not the "
            "actor, or a model that decodes without its KV cache"
        )
    return largest, mean


def tis_weights(old_logprobs, sampler_logprobs, mask, cap: float) -> tuple[torch.Tensor, dict]:
    """Truncated importance sampling (Yao et al. 2025): per token (B, T) min(pi_old / pi_sampler, cap), pi_old the
    training forward's probability of the sampled token and pi_sampler the sampler's own, masked before the
    exponential (0 on padding); stats: tis_weight_mean, tis_clipfrac (the share of tokens whose ratio exceeds the
    cap), means over the valid tokens."""
    ratio = torch.exp(torch.where(mask.bool(), old_logprobs - sampler_logprobs, 0.0))
    weights = ratio.clamp(max=cap) * mask
    stats = {"tis_weight_mean": masked_mean(weights, mask), "tis_clipfrac": masked_mean((ratio > cap).float(), mask)}
    return weights, stats


def tis_metrics(experience: dict, loss_mask, cap: float, device) -> tuple[torch.Tensor, dict]:
    """--tis-cap over a rollout: the weights (B, T) and policy/tis_weight_mean, policy/tis_clipfrac over every rank's
    policy-loss tokens (one all-reduce)."""
    weights, stats = tis_weights(experience["logprobs"], experience["sampler_logprobs"], loss_mask, cap)
    tokens = loss_mask.sum()
    sums = parallel.all_reduce_dict({key: value * tokens for key, value in stats.items()} | {"n": tokens}, device)
    return weights, {f"policy/{key}": sums[key] / max(sums["n"], 1.0) for key in stats}


# -----------------------------------------------------------------------------
# steps 1-3 as one call


@torch.no_grad()
def rollout(engine: Engine, prompts: list, prefix: Optional[tuple] = None, k: int = 1) -> tuple[dict, dict, list]:
    """Steps 1-3 on this rank's prompts (a group's G copies consecutive), each an episode (generate_episodes): with
    --env (engine.make_env) the prompts are their JSONL rows. prefix (ids, mask) (B, Tp): partial responses to
    continue; k: continuations a row, consecutive. Returns (experience: (B * k, ...) tensors query, query_mask,
    response, attention_mask (the response's model and observation tokens), mask (the model's: the loss mask),
    logprobs, ref_logprobs, sampler_logprobs (0 on a prefix), scores (the returns), turn_rewards (each turn's reward
    on its last model token, the RMs' score on the episode's), ended, truncated; sums for rollout_metrics; records:
    the responses as dicts for the logs)."""
    if k > 1:
        prompts = [prompt for prompt in prompts for _ in range(k)]
        prefix = None if prefix is None else tuple(tensor.repeat_interleave(k, 0) for tensor in prefix)
    rows = prompts
    if engine.make_env is not None:
        prompts = [row["prompt"] for row in rows]
    error = None
    try:
        if prefix is None:
            responses = generate_episodes(engine, rows)
        else:
            responses = continue_responses(engine, prompts, prefix)
    except UserError as raised:  # the user's environment or reward function, on this rank: all ranks learn of it first
        error = raised
    raise_on_every_rank(error, next(engine.models.actor.parameters()).device)
    samples = responses.samples
    amp = torch.autocast(samples.mask.device.type, dtype=engine.dtype, enabled=engine.dtype != torch.float32)
    logprobs = policy_and_reference_logprobs(engine, responses, amp)
    logprob_error, mean_error = check_logprobs(samples.logprobs, logprobs["logprobs"], responses.sampled, engine.dtype)
    scores, turn_rewards, score_parts = episode_scores(engine, responses, amp)
    experience = dict(
        query=responses.query,
        query_mask=responses.query_mask,
        response=samples.response,
        attention_mask=responses.attention_mask,
        mask=samples.mask,
        logprobs=logprobs["logprobs"],
        ref_logprobs=logprobs["ref_logprobs"],
        scores=scores,
        ended=samples.ended.float(),
        sampler_logprobs=samples.logprobs * samples.mask,
        turn_rewards=turn_rewards,
        truncated=responses.truncated.float(),
    )
    ended = samples.ended.tolist()  # one host sync for the records
    gold = None
    if engine.gold_fn is not None:
        gold = [engine.gold_fn(p, t, e) for p, t, e in zip(responses.prompt_texts, samples.texts, ended)]
    sums = rollout_sums(experience, logprobs["entropy"], score_parts, gold)
    if engine.make_env is not None:
        sums |= episode_sums(responses)
    sums |= {"logprob_err": logprob_error, "logprob_err_mean": mean_error}
    records = []
    for row, score in enumerate(scores.tolist()):
        prompt = common.shown_prompt(prompts[row])  # a conversation's last user message, not the rendered template
        record = dict(prompt=prompt, response=samples.texts[row], ended=ended[row], score=score)
        records.append(record | {"gold": gold[row] if gold else None})
    return experience, sums, records


def rollout_sums(experience: dict, entropy, score_parts: dict, gold: Optional[list]) -> dict:
    """This rank's named sums behind the rollout's metrics (rollout_metrics reduces them over ranks). score_parts:
    per-response values (B,) logged as objective/<name> (the RMs' and the reward function's own scores when a reward
    function is given, an ensemble's spread); gold: per response (built-in task) or None."""
    mask = experience["mask"]
    logprobs = experience["logprobs"]
    kl_per_sequence = ((logprobs - experience["ref_logprobs"]) * mask).sum(1)  # objective/kl is always the summed k1
    sums = {
        "sequences": float(mask.size(0)),
        "score": experience["scores"].sum(),
        "kl": kl_per_sequence.sum(),
        "entropy": entropy.sum(),
        "tokens": mask.sum(),
        "nll": -logprobs.sum(),
        "ended": experience["ended"].sum(),
    }
    if gold:
        sums["gold"] = float(sum(gold))
    for name, part in score_parts.items():
        sums[f"part/{name}"] = part.sum()
    return sums


def episode_sums(responses: Responses) -> dict:
    """This rank's sums behind the episode metrics: turns, observation tokens, truncated episodes, and each info key's
    sum and count over the episodes that gave it (keys agreed over ranks: an all-reduce needs the same on each)."""
    episodes = responses.episodes
    observation_tokens = responses.attention_mask - responses.samples.mask
    sums = {
        "episode/turns": episodes.turns.sum().float(),
        "episode/observation_tokens": observation_tokens.sum(),
        "episode/truncated": episodes.truncated.sum().float(),
    }
    keys = sorted(episodes.info)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
    for key in keys:
        values = episodes.info.get(key, torch.full_like(episodes.returns, float("nan")))
        given = ~values.isnan()
        sums[f"info/{key}"] = torch.where(given, values, 0.0).sum()
        sums[f"info_count/{key}"] = given.sum().float()
    return sums


def rollout_metrics(sums: dict, device) -> tuple[dict, dict]:
    """Global means of the rollout's metrics from one all-reduce of this rank's named sums (rollout_sums, plus the
    stage's own). Returns (metrics, the global sums)."""
    logprob_error = sums.pop("logprob_err")
    mean_error = sums.pop("logprob_err_mean")
    totals = parallel.all_reduce_dict(sums, device)
    sequences = totals["sequences"]
    tokens = totals["tokens"]
    metrics = {
        "objective/score": totals["score"] / sequences,
        "objective/kl": totals["kl"] / sequences,
        "objective/entropy": totals["entropy"] / tokens,
        "rollout/response_len": tokens / sequences,
        "rollout/perplexity": math.exp(totals["nll"] / tokens),
        "rollout/eos_frac": totals["ended"] / sequences,
        "rollout/logprob_err": logprob_error,
        "rollout/logprob_err_mean": mean_error,
    }
    if "gold" in totals:
        metrics["objective/gold"] = totals["gold"] / sequences
    for key, value in totals.items():
        if key.startswith("part/"):
            metrics[f"objective/{key.removeprefix('part/')}"] = value / sequences
    if "episode/turns" in totals:  # --env: per episode
        metrics["episode/turns"] = totals["episode/turns"] / sequences
        metrics["episode/observation_tokens"] = totals["episode/observation_tokens"] / sequences
        metrics["episode/truncated_frac"] = totals["episode/truncated"] / sequences
    for key, value in totals.items():
        if key.startswith("info/"):  # an info key's mean over the episodes that gave it
            name = key.removeprefix("info/")
            metrics[f"episode/{name}"] = value / max(totals[f"info_count/{name}"], 1.0)
    return metrics, totals


# -----------------------------------------------------------------------------
# what an update measures: the policy's log-probs again


def policy_logprobs(actor, batch: dict, temperature: float):
    """The training forward over one micro-batch: (logits (B, T, V), log-probs of the response tokens (B, T))."""
    logits, _ = response_forward(
        actor, batch["query"], batch["query_mask"], batch["response"], batch["attention_mask"], temperature
    )
    return logits, logprobs_from_logits(logits, batch["response"])


def ratio_diagnostics(logprobs, old_logprobs, mask, sums: dict) -> dict:
    """A micro-batch's ratio_err (max |ratio - 1| over mask), approx_kl and clipfrac (from the policy loss's sums), on
    device (nan without tokens): on an update's first micro-batch they must read 0, 0, 0 to float precision (the
    policy has not moved since it sampled)."""
    ratio_error = ((logprobs.detach() - old_logprobs).exp().sub(1).abs() * mask).max()
    tokens = sums["tokens"]
    return {"ratio_err": ratio_error, "approx_kl": sums["approx_kl"] / tokens, "clipfrac": sums["clipfrac"] / tokens}


def read_diagnostics(diagnostics: dict) -> dict:
    """ratio_diagnostics read on the host (one read): {} when absent or without tokens (nan)."""
    values = dict(zip(diagnostics, torch.stack(list(diagnostics.values())).tolist())) if diagnostics else {}
    return values if all(math.isfinite(value) for value in values.values()) else {}


@torch.no_grad()
def update_kl(actor, experience: dict, micro_batch_size: int, temperature: float, amp) -> float:
    """KL(pi_old || pi_new) per response (summed k3, r = pi_new / pi_old) after an update, from one no-grad pass
    over the first micro-batch of every rank's rollout, averaged over ranks."""
    rows = slice(0, micro_batch_size)
    keys = ("query", "query_mask", "response", "attention_mask", "mask", "logprobs")
    batch = {key: experience[key][rows] for key in keys}
    with amp:
        _, logprobs = policy_logprobs(actor, batch, temperature)
    log_ratio = torch.where(batch["mask"].bool(), batch["logprobs"] - logprobs, 0.0)
    kl = ((torch.expm1(-log_ratio) + log_ratio) * batch["mask"]).sum()
    sums = parallel.all_reduce_dict({"kl": kl, "sequences": float(batch["mask"].size(0))}, kl.device)
    return sums["kl"] / sums["sequences"]


# -----------------------------------------------------------------------------
# the RL loop's state


@dataclass
class Loop:
    """An RL stage's loop state, saved with its checkpoint: the iteration, optimizer steps, episodes, the generator
    of every draw, the prompt and ptx streams (ptx None: no ptx loss), the NaN guard, the inputs' hashes (checked by
    --resume); first_micro_batch (this process's first update's ratio_diagnostics) is not saved."""

    generator: torch.Generator
    prompt_stream: Optional[PromptStream] = None
    ptx_stream: Optional[PtxStream] = None  # None: no ptx loss
    guard: common.StepGuard = field(default_factory=common.StepGuard)
    hashes: dict = field(default_factory=dict)  # checkpoints.input_hashes
    step: int = 0
    updates: int = 0
    episodes: int = 0
    first_micro_batch: dict = field(default_factory=dict)

    def data_state(self) -> dict:
        """The checkpoint's data_state: the prompt and ptx orders, the optimizer steps, episodes and skipped steps."""
        ptx = self.ptx_stream.order.state_dict() if self.ptx_stream is not None else None
        prompts = self.prompt_stream.order.state_dict()
        return dict(prompts=prompts, ptx=ptx, updates=self.updates, episodes=self.episodes, skipped=self.guard.skipped)

    def resume(self, run: checkpoints.Run) -> dict:
        """--resume: the run's checkpoint (its inputs checked against their hashes now) restored into the trained
        models (Run.resume) and into this loop; returns it for the stage's own keys."""
        inputs = {key: (checkpoints.HASH_FLAGS[key], digest) for key, digest in self.hashes.items()}
        ckpt = run.resume(inputs, self.generator)
        data_state = ckpt["data_state"]
        self.prompt_stream.order.load_state_dict(data_state["prompts"])
        if self.ptx_stream is not None:
            self.ptx_stream.order.load_state_dict(data_state["ptx"])
        self.guard.skipped = data_state["skipped"]
        self.step = ckpt["step"]
        self.updates = data_state["updates"]
        self.episodes = data_state["episodes"]
        return ckpt


def build_loop(args, data: RLData, sizes: parallel.RolloutSizes, group_size: int, d, pad_id: int) -> Loop:
    """An RL run's loop state at its start: the generator (seed * 1000 + rank), the prompt stream (each prompt
    group_size times in a row) and the ptx stream (None without a ptx loss) over their global orders, the hashes."""
    generator = torch.Generator(device=d.device).manual_seed(args.seed * 1000 + d.rank)
    order = Order(len(data.prompts), args.seed)
    # --env: the stream hands out whole rows, the environment's input
    prompt_stream = PromptStream(
        data.rows if data.make_env else data.prompts, order, sizes.prompts_per_rank, group_size, d
    )
    ptx_stream = None
    if sizes.ptx_micro_batch_size:
        ptx_order = Order(len(data.ptx), args.seed + 1)
        ptx_stream = PtxStream(data.ptx, ptx_order, sizes.ptx_micro_batch_size, d, pad_id)
    return Loop(generator, prompt_stream, ptx_stream, hashes=checkpoints.input_hashes(args))
