"""Multi-turn RL (--env, --max-turns) in both RL stages: REINFORCE++ with turn rewards against a per-token loop, the
experience's two masks, the observations reaching the next model token, the episode tags, the one-line errors, a
SIGKILL and resume, and 2 gloo ranks against 1."""

import io
import json
import math
import re
import sys

import pytest
import torch
import torch.multiprocessing as mp
from conftest import (
    assert_same_weights,
    exits_2_with_one_line,
    fake_experience,
    free_port,
    grpo_update_once,
    kill_and_resume,
    ppo_update_once,
    read_scalars,
    run_here,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import hf
import rollout
import train_grpo
import train_ppo
from model import GPT, GPTConfig

# three turns; a turn's reward is its length in characters / 10; the observation is always the same text
ENV_SOURCE = """
class Echo:
    def __init__(self, row):
        self.turn = 0

    def step(self, response, ended):
        self.turn += 1
        done = self.turn == 3
        return (None if done else " ok."), len(response) / 10, done, {"success": float(ended)}


class Breaks(Echo):
    def step(self, response, ended):
        if self.turn == 1:
            raise ValueError("no second turn")
        return super().step(response, ended)
"""

TINY = dict(
    max_steps=2, rollout_batch_size=8, num_minibatches=2, micro_batch_size=4, ptx_batch_size=4, max_new_tokens=8
)
EPISODE_TAGS = ("episode/turns", "episode/observation_tokens", "episode/truncated_frac", "episode/success")


@pytest.fixture
def env_file(tmp_path) -> str:
    path = tmp_path / "toy_env.py"
    path.write_text(ENV_SOURCE)
    return str(path)


# -----------------------------------------------------------------------------
# the math: REINFORCE++ over episodes


def episode_inputs(B: int = 6, T: int = 9, seed: int = 0):
    """Random (B, T) log-probs and earlier turns' rewards with +-1e4 off a loss mask that has an observation span
    inside most rows (rows right-padded), and the last turn's scores (B,)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        length = [T, 1, 5, 8, 7, 9][b]
        mask[b, :length] = 1.0
        if length >= 5:  # an observation of 1 or 2 tokens between two turns
            start = 1 + b % 2
            mask[b, start : start + 1 + b % 2] = 0.0
    noise = 1e4 * torch.randint(-1, 2, (B, T), generator=g).double()
    logprobs = torch.where(mask.bool(), torch.randn(B, T, generator=g, dtype=torch.float64), noise)
    ref_logprobs = torch.where(mask.bool(), torch.randn(B, T, generator=g, dtype=torch.float64), -noise)
    last = (mask * torch.arange(1, T + 1)).argmax(1)
    turn_rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    turn_rewards[torch.arange(B), last] = 0.0  # the last turn's reward is the score
    turn_rewards = torch.where(mask.bool(), turn_rewards, noise)
    return torch.randn(B, generator=g, dtype=torch.float64), logprobs, ref_logprobs, mask, turn_rewards


def reinforce_pp_loop(scores, logprobs, ref_logprobs, mask, group_size, kl_coef, gamma, turn_rewards):
    """REINFORCE++ per token: each model token's reward -beta*k1 plus its turn's reward, the score less the group's
    mean return on the episode's last model token; the reward-to-go over the model tokens alone."""
    B, T = mask.shape
    model_tokens = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    returns = [scores[b].item() + sum(turn_rewards[b, t].item() for t in model_tokens[b]) for b in range(B)]
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        group = range(b - b % group_size, b - b % group_size + group_size)
        baseline = sum(returns[i] for i in group) / group_size if group_size > 1 else 0.0
        running = 0.0
        for t in reversed(model_tokens[b]):
            reward = -kl_coef * (logprobs[b, t].item() - ref_logprobs[b, t].item()) + turn_rewards[b, t].item()
            if t == model_tokens[b][-1]:
                reward += scores[b].item() - baseline
            running = reward + gamma * running
            out[b, t] = running
    return out


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_reinforce_pp_with_turn_rewards_matches_a_per_token_loop(group_size):
    scores, logprobs, ref_logprobs, mask, turn_rewards = episode_inputs()
    got = train_grpo.reinforce_pp_advantages(scores, logprobs, ref_logprobs, mask, group_size, 0.1, 0.9, turn_rewards)
    want = reinforce_pp_loop(scores, logprobs, ref_logprobs, mask, group_size, 0.1, 0.9, turn_rewards)
    assert (got - want).abs().max() < 1e-9


def test_reinforce_pp_without_turn_rewards_is_the_single_turn_formula_bit_for_bit():
    scores, logprobs, ref_logprobs, mask, _ = episode_inputs()
    mask = (torch.arange(9) < torch.tensor([9, 1, 5, 8, 7, 9])[:, None]).double()
    before = train_grpo.shape_rewards(
        train_grpo.group_advantages(scores, 3, "reinforce_pp"), logprobs, ref_logprobs, mask, 0.1
    )
    want = train_grpo.reward_to_go(before, mask, 0.9)
    assert torch.equal(train_grpo.reinforce_pp_advantages(scores, logprobs, ref_logprobs, mask, 3, 0.1, 0.9), want)


def test_an_observation_reaches_the_next_model_tokens_log_prob():
    """The training forward attends to the observation (attention_mask) though the loss never reads it (mask): a
    changed observation token moves the next model token's log-prob and none before it."""
    torch.manual_seed(0)
    actor = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16)).eval()
    response = torch.tensor([[3, 4, 1, 7, 8, 5, 6]])  # model, model, EOS | observation 7 8 | model, model
    loss_mask = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1]])
    batch = dict(query=torch.tensor([[2, 9]]), query_mask=torch.ones(1, 2), response=response)
    batch |= dict(attention_mask=torch.ones(1, 7), mask=loss_mask)
    _, before = rollout.policy_logprobs(actor, batch, 1.0)
    _, after = rollout.policy_logprobs(actor, batch | {"response": response.index_fill(1, torch.tensor([4]), 11)}, 1.0)
    assert torch.equal(before[:, :3], after[:, :3]) and (before[0, 5] - after[0, 5]).abs() > 1e-4


# -----------------------------------------------------------------------------
# both stages over episodes


def test_grpo_and_ppo_train_over_episodes(tmp_path, task_dir, tiny_ckpts, env_file, monkeypatch, capsys):
    """--env --max-turns 3 with a toy environment: the experience holds attention_mask (model and observation tokens,
    a prefix of ones) and the loss mask (the model's tokens), the observations as encoded, each turn's reward on its
    last model token summing to the score; both stages log the episode tags, finite; the sample tables (samples.jsonl,
    the console) show whole episodes, each observation quoted after [env]."""
    captured = []
    real_update = train_grpo.grpo_update

    def capturing_update(actor, experience, *state):
        captured.append(experience)
        return real_update(actor, experience, *state)

    monkeypatch.setattr(train_grpo, "grpo_update", capturing_update)
    flags = dict(task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt="none", env=f"{env_file}:Echo", max_turns=3)
    grpo_out, ppo_out = str(tmp_path / "grpo"), str(tmp_path / "ppo")
    train_grpo.main(train_grpo.Args(out_dir=grpo_out, group_size=2, log_every=1, **flags, **TINY))
    train_ppo.main(train_ppo.Args(out_dir=ppo_out, critic_warmup_steps=1, warmup_steps=1, log_every=1, **flags, **TINY))
    experience = captured[0]
    attention, mask = experience["attention_mask"], experience["mask"]
    lengths = attention.sum(1, keepdim=True)
    assert torch.equal(attention, (torch.arange(attention.size(1)) < lengths).float())  # right-padded, no holes
    assert torch.all(mask <= attention) and (attention - mask).sum() > 0
    from tokenizer import Tokenizer

    tok = Tokenizer.from_state(torch.load(tiny_ckpts[0], weights_only=False)["tokenizer"])
    observation = tok.encode(" ok.")
    for row, (row_attention, row_mask) in enumerate(zip(attention.tolist(), mask.tolist())):
        spans, span = [], []
        for column, (attended, model_token) in enumerate(zip(row_attention, row_mask)):
            if attended and not model_token:
                span.append(experience["response"][row, column].item())
            elif span:
                spans, span = spans + [span], []
        assert spans == [observation] * 2, row  # three turns: two observations between them
    turn_rewards = experience["turn_rewards"]
    assert torch.equal(turn_rewards * mask, turn_rewards)
    assert torch.allclose(turn_rewards.sum(1), experience["scores"])
    for out in (grpo_out, ppo_out):
        scalars = read_scalars(out)
        for tag in EPISODE_TAGS:
            assert len(scalars[tag]) == 2 and all(math.isfinite(value) for value in scalars[tag]), (out, tag)
        assert scalars["episode/turns"] == [3.0, 3.0]
        records = [json.loads(line) for line in open(f"{out}/samples.jsonl")]
        assert records and all(record["response"].count("[env] ' ok.'") == 2 for record in records), out
    shown = [line for line in capsys.readouterr().out.splitlines() if "[env]" in line]
    assert len(shown) >= 2 and all(line.count("[env] ' ok.'") == 2 for line in shown)


def test_an_episode_reads_as_its_turns_and_quoted_observations():
    """Turns as sampled, each observation's repr after [env]: its spaces and line breaks shown, its end marked."""
    episode = rollout.episode_text(["guess 10", "guess 15", " 13"], ["Higher.", "Lower.\n"])
    assert episode == "guess 10 [env] 'Higher.' guess 15 [env] 'Lower.\\n'  13"
    assert rollout.episode_text(["only"], []) == "only" and rollout.episode_text([], []) == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [dict(lora_rank=4, dtype="bfloat16", tis_cap=2.0), dict(compile="on")],
    ids=["lora_bf16", "compile"],
)
def test_grpo_and_ppo_over_episodes_under_lora_bf16_and_compile(tmp_path, task_dir, tiny_ckpts, env_file, extra):
    """--lora-rank with the bf16 sampler, and --compile on, with --env --max-turns 3: both stages train over three-turn
    episodes, the sampler's log-probs checked against the trainer's on the model's tokens (fp32: within 1e-4; bf16:
    TIS weights near 1), weights finite; compiled, each call signature compiles once and the decode step is one graph
    over every rollout's turns (the single-turn compile test's count: a graph per frame, plus the decode's)."""
    from torch._dynamo.utils import counters

    flags = dict(task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt="none", env=f"{env_file}:Echo", max_turns=3)
    flags |= dict(warmup_steps=1, log_every=1) | TINY | dict(max_steps=3) | extra
    torch._dynamo.reset()
    counters.clear()
    grpo_out, ppo_out = str(tmp_path / "grpo"), str(tmp_path / "ppo")
    train_grpo.main(train_grpo.Args(out_dir=grpo_out, group_size=2, **flags))
    train_ppo.main(train_ppo.Args(out_dir=ppo_out, critic_warmup_steps=0, **flags))
    for out in (grpo_out, ppo_out):
        scalars = read_scalars(out)
        assert scalars["episode/turns"] == [3.0] * 3, out
        assert all(math.isfinite(value) for value in scalars["policy/loss"]), out
        if "dtype" in extra:
            assert all(0.5 < value <= 2.0 for value in scalars["policy/tis_weight_mean"]), out
        else:
            assert max(scalars["rollout/logprob_err"]) < 1e-4, out
        model = hf.model_from_checkpoint(f"{out}/ckpt.pt")  # a LoRA checkpoint's adapters merged into its base
        assert all(torch.isfinite(weight).all() for weight in model.state_dict().values())
    if "compile" in extra:
        print(dict(counters["frames"]), dict(counters["stats"]))
        assert counters["stats"]["unique_graphs"] == counters["frames"]["total"] + 1


@pytest.mark.parametrize(
    "script, env, flags, message",
    [
        ("train_ppo.py", "Echo", "--max-turns 0", r"--max-turns 0: the model's turns an episode may take"),
        ("train_grpo.py", "Echo", "--reward-fn task:gold_reward", r"--env .*:Echo and --reward-fn task:gold_reward: "),
        ("train_grpo.py", "Echo", "--estimator vineppo", r"--estimator vineppo with --env .*:Echo: no environment"),
        ("train_ppo.py", "Breaks", "", r"--env .*:Breaks: step at turn 2 raised ValueError \(no second turn\)"),
    ],
)
def test_mistakes_exit_2_with_one_line(
    tmp_path, task_dir, tiny_ckpts, env_file, capsys, monkeypatch, script, env, flags, message
):
    """Refused at start-up, or an environment that raises mid-run: exit 2, one line, no checkpoint."""
    argv = f"--task-dir {task_dir} --sft-ckpt {tiny_ckpts[0]} --rm-ckpt none --env {env_file}:{env} --max-turns 3 "
    argv += f"--out-dir {tmp_path}/run --max-steps 1 --rollout-batch-size 4 --micro-batch-size 2 --max-new-tokens 4 "
    argv += "--num-minibatches 1 --critic-warmup-steps 0 " if script == "train_ppo.py" else "--num-minibatches 1 "
    line = exits_2_with_one_line(script, (argv + flags).split(), capsys, monkeypatch)
    assert re.search(message, line), line
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.slow
def test_multiturn_grpo_kill_and_resume_is_exact(tmp_path, task_dir, tiny_ckpts, env_file):
    sft = tiny_ckpts[0]
    base = (
        f"{sys.executable} train_grpo.py --task-dir {task_dir} --sft-ckpt {sft} --rm-ckpt none --env {env_file}:Echo "
        "--max-turns 3 --estimator reinforce_pp --group-size 2 --max-steps 6 --rollout-batch-size 8 "
        "--num-minibatches 2 --micro-batch-size 4 --ptx-batch-size 4 --max-new-tokens 6 --warmup-steps 2 "
        "--sample-every 1 --log-every 2 --save-every 1"
    )
    run_here(f"{base} --out-dir {tmp_path}/full")
    kill_and_resume(f"{base} --out-dir {tmp_path}/killed", str(tmp_path / "killed"), min_step=3)
    assert_same_weights(tmp_path / "full" / "ckpt.pt", tmp_path / "killed" / "ckpt.pt")
    full, killed = (torch.load(tmp_path / p / "ckpt.pt", weights_only=False) for p in ("full", "killed"))
    assert full["data_state"] == killed["data_state"]
    lines = open(tmp_path / "killed" / "samples.jsonl").read().splitlines()
    assert len(lines) == len(set(lines)) == 6 * 8 and "[env] ' ok.'" in lines[0]
    assert lines == open(tmp_path / "full" / "samples.jsonl").read().splitlines()


# -----------------------------------------------------------------------------
# 2 gloo ranks equal 1 on episodes: the forwards read attention_mask, the losses the loss mask with its holes


def episode_experience() -> tuple:
    """fake_experience with an observation span inside the longer responses: attended, out of the loss mask."""
    actor, critic, experience = fake_experience()
    attention = experience["mask"]
    mask = attention.clone()
    mask[attention.sum(1) >= 4, 1:3] = 0.0
    masked = {key: experience[key] * mask for key in ("values", "logprobs", "advantages", "returns")}
    return actor, critic, experience | masked | {"mask": mask, "attention_mask": attention}


def critic_free(experience: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    ref_logprobs = (experience["logprobs"] + 0.3 * torch.randn(experience["mask"].shape, generator=g)) * experience[
        "mask"
    ]
    ended = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    truncated = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    return experience | {"ref_logprobs": ref_logprobs, "ended": ended, "truncated": truncated}


def updates(rank: int, world_size: int) -> tuple:
    """PPO-max's and REINFORCE++'s (--mask-truncated) update on this rank's rows: (metrics, actor weights) each."""
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    wrap = (lambda model: DDP(model, gradient_as_bucket_view=True)) if world_size > 1 else (lambda model: model)
    actor, critic, experience = episode_experience()
    share = {key: value[rows] for key, value in experience.items()}
    ppo = ppo_update_once(wrap(actor), wrap(critic), share, 2)
    free_actor, _, free_experience = episode_experience()
    share = {key: value[rows] for key, value in critic_free(free_experience).items()}
    grpo = grpo_update_once(wrap(free_actor), share, 2, estimator="reinforce_pp", mask_truncated=True, max_turns=3)
    state = {key: value.detach().clone() for key, value in getattr(actor, "module", actor).state_dict().items()}
    free_state = {
        key: value.detach().clone() for key, value in getattr(free_actor, "module", free_actor).state_dict().items()
    }
    return ppo, state, grpo, free_state


def _rank_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = io.BytesIO()
    torch.save(updates(rank, 2), buffer)
    queue.put(buffer.getvalue())
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_on_episodes():
    port = free_port()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=_rank_worker, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    results = [torch.load(io.BytesIO(queue.get()), weights_only=False) for _ in range(2)]
    for process in processes:
        process.join(60)
    ppo_want, state_want, grpo_want, free_state_want = updates(0, 1)
    for ppo, state, grpo, free_state in results:
        for key in ("policy/loss", "value/loss", "policy/approx_kl", "train/grad_norm", "value/grad_norm"):
            assert ppo[key] == pytest.approx(ppo_want[key], rel=1e-4, abs=1e-6), key
        for key in ("policy/loss", "policy/approx_kl", "train/grad_norm"):
            assert grpo[key] == pytest.approx(grpo_want[key], rel=1e-4, abs=1e-6), key
        for mine, want in ((state, state_want), (free_state, free_state_want)):
            for key in want:
                assert torch.allclose(mine[key], want[key], atol=1e-5), key
