"""The RL stages' math on multi-turn episodes: the loss mask (1 = a model token) has holes, the environment's tokens
between model turns. Each formula against a per-token loop on random ragged episodes with +-1e4 in every masked
position, and the single-turn inputs (a prefix of ones) bit for bit as the code before multi-turn computed them."""

import math

import pytest
import torch
from conftest import boost_eos, tiny_gpt

import parallel
import rollout
import train_grpo
import train_ppo
from model import last_token_scores, row_extent
from rollout import Models

BETA, GAMMA, LAM = 0.1, 0.9, 0.8


def episodes(B: int = 8, T: int = 24, seed: int = 0, max_turns: int = 3):
    """Random (B, T) float64 loss masks of multi-turn episodes: 1 to max_turns model turns of 1-4 tokens, 1-3
    environment tokens (mask 0) between turns, then right padding; row 0 one turn of one token, row 1 max_turns turns.
    Returns (mask, turn_ends: each row's list of its turns' last model token)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    all_turn_ends = []
    for b in range(B):
        turns = 1 if b == 0 else max_turns if b == 1 else int(torch.randint(1, max_turns + 1, (1,), generator=g))
        column, turn_ends = 0, []
        for turn in range(turns):
            if turn > 0:  # the environment's observation
                column += int(torch.randint(1, 4, (1,), generator=g))
            length = 1 if b == 0 else int(torch.randint(1, 5, (1,), generator=g))
            mask[b, column : column + length] = 1.0
            column += length
            turn_ends.append(column - 1)
        all_turn_ends.append(turn_ends)
    return mask, all_turn_ends


def noisy(mask, seed: int, scale: float = 1.0):
    """A random (B, T) float64 tensor with +-1e4 wherever mask is 0."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    signs = torch.randint(0, 2, mask.shape, generator=g).double() * 2 - 1
    return torch.where(mask.bool(), x, 1e4 * signs)


def model_tokens(mask, b: int) -> list[int]:
    return mask[b].nonzero().squeeze(1).tolist()


def turn_reward_tensor(mask, turn_ends, seed: int):
    """(per-turn rewards: each row's list, turn_rewards (B, T)): each turn's reward on its last model token, 0 on the
    other model tokens, +-1e4 off the mask."""
    g = torch.Generator().manual_seed(seed)
    turn_rewards = torch.where(mask.bool(), 0.0, noisy(mask, seed))
    per_turn = []
    for b, ends in enumerate(turn_ends):
        rewards = torch.randn(len(ends), generator=g, dtype=torch.float64).tolist()
        per_turn.append(rewards)
        for end, reward in zip(ends, rewards):
            turn_rewards[b, end] = reward
    return per_turn, turn_rewards


def report(name: str, difference: float, bound: float = 1e-9) -> None:
    print(f"{name}: max |difference| {difference:.1e}")
    assert difference < bound


# -----------------------------------------------------------------------------
# the last model token, the rewards, GAE and the reward-to-go


def test_the_last_model_token_ends_the_row():
    mask, turn_ends = episodes()
    scores = noisy(mask, 1)
    assert row_extent(mask).tolist() == [ends[-1] + 1 for ends in turn_ends]
    assert last_token_scores(scores, mask).tolist() == [scores[b, ends[-1]].item() for b, ends in enumerate(turn_ends)]
    assert row_extent(torch.zeros(2, 3)).tolist() == [0, 0]


@pytest.mark.parametrize("stage", [train_ppo, train_grpo], ids=["ppo", "grpo"])
def test_rewards_of_every_turn_on_its_last_model_token(stage):
    """-beta * k1 on every model token, each turn's reward on its last model token, 0 on the environment's tokens and
    padding; a row sums to the episode's return minus beta * its summed k1 (the critic-free family's R_i)."""
    mask, turn_ends = episodes()
    logprobs, ref_logprobs = noisy(mask, 1), noisy(mask, 2)
    per_turn, turn_rewards = turn_reward_tensor(mask, turn_ends, 3)
    final, earlier = stage.split_turn_rewards(turn_rewards, mask)
    assert final.tolist() == [rewards[-1] for rewards in per_turn]
    rewards = stage.shape_rewards(final, logprobs, ref_logprobs, mask, BETA, earlier)
    if stage is train_ppo:
        rewards, kl = rewards
    difference = 0.0
    for b, ends in enumerate(turn_ends):
        for t in range(mask.size(1)):
            want = 0.0
            if mask[b, t]:
                want = -BETA * (logprobs[b, t] - ref_logprobs[b, t]).item()
                want += per_turn[b][ends.index(t)] if t in ends else 0.0
                if stage is train_ppo:
                    difference = max(difference, abs(kl[b, t].item() - (logprobs[b, t] - ref_logprobs[b, t]).item()))
            difference = max(difference, abs(rewards[b, t].item() - want))
        tokens = model_tokens(mask, b)
        episode_return = sum(per_turn[b]) - BETA * sum((logprobs[b, t] - ref_logprobs[b, t]).item() for t in tokens)
        difference = max(difference, abs(rewards[b].sum().item() - episode_return))
    report(f"{stage.__name__}.shape_rewards", difference)


def test_the_return_normalised_as_one_score():
    """norm: the mean subtracted on the last turn only and every turn over the std, so the normalised turns sum to
    (R - mean) / (std + 1e-8); one turn is normalize_scores of its score, exactly."""
    mask, turn_ends = episodes()
    per_turn, turn_rewards = turn_reward_tensor(mask, turn_ends, 3)
    mean, std = 0.3, 1.7
    for stage in (train_ppo, train_grpo):
        final, earlier = stage.split_turn_rewards(turn_rewards, mask)
        final_norm = stage.normalize_scores(final, mean, std, "norm", None)
        earlier_norm = stage.normalize_scores(earlier, 0.0, std, "norm", None)
        returns = torch.tensor([sum(rewards) for rewards in per_turn], dtype=torch.float64)
        difference = (final_norm + earlier_norm.sum(1) - (returns - mean) / (std + 1e-8)).abs().max().item()
        report(f"{stage.__name__} normalised return", difference)
        assert torch.equal(final_norm[0], stage.normalize_scores(returns, mean, std, "norm", None)[0])


def verl_gae(rewards, values, mask, gamma: float, lam: float) -> list[list[float]]:
    """verl's compute_gae_advantage_return (verl/trainer/ppo/core_algos.py) in its multi-turn form as a plain loop:
    on a mask-0 token the next value and the running advantage stay those of the next model token."""
    out = []
    for b in range(mask.size(0)):
        next_value, running, row = 0.0, 0.0, []
        for t in reversed(range(mask.size(1))):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            advantage = delta + gamma * lam * running
            if mask[b, t]:
                next_value, running = values[b, t].item(), advantage
            row.append(running)
        out.append(row[::-1])
    return out


def test_gae_on_episodes_is_verls_multi_turn_gae():
    mask, turn_ends = episodes()
    values = noisy(mask, 4)
    per_turn, turn_rewards = turn_reward_tensor(mask, turn_ends, 3)
    final, earlier = train_ppo.split_turn_rewards(turn_rewards, mask)
    rewards, _ = train_ppo.shape_rewards(final, noisy(mask, 1), noisy(mask, 2), mask, BETA, earlier)
    rewards = torch.where(mask.bool(), rewards, noisy(mask, 5))  # +-1e4 off the mask
    advantages, returns = train_ppo.compute_gae(rewards, values, mask, GAMMA, LAM)
    want = verl_gae(rewards, values, mask, GAMMA, LAM)
    difference = 0.0
    for b in range(mask.size(0)):
        for t in range(mask.size(1)):
            if mask[b, t]:
                difference = max(difference, abs(advantages[b, t].item() - want[b][t]))
                difference = max(difference, abs(returns[b, t].item() - want[b][t] - values[b, t].item()))
            else:
                assert advantages[b, t] == 0 and returns[b, t] == 0
    report("train_ppo.compute_gae against verl's", difference)
    # the code before multi-turn read the next column's value: wrong on a row with the environment's tokens inside
    before, _ = compute_gae_before(rewards, values, mask, GAMMA, LAM)
    assert (before - torch.tensor(want, dtype=torch.float64)).mul(mask).abs().max() > 0.1


def test_reward_to_go_counts_model_tokens_only():
    mask, turn_ends = episodes()
    rewards = noisy(mask, 6)
    got = train_grpo.reward_to_go(rewards, mask, GAMMA)
    difference = 0.0
    for b in range(mask.size(0)):
        tokens = model_tokens(mask, b)
        for i, t in enumerate(tokens):
            want = sum(GAMMA**j * rewards[b, u].item() for j, u in enumerate(tokens[i:]))
            difference = max(difference, abs(got[b, t].item() - want))
        assert (got[b][~mask[b].bool()] == 0).all()
    report("train_grpo.reward_to_go", difference)


def test_reinforce_pp_advantages_on_episodes():
    """REINFORCE++(-baseline) on episodes scored once, at the end: A_t = gamma^(model tokens after t) * s'_i - beta *
    the discounted k1 of the model tokens from t, s'_i the score less its group's mean."""
    mask, _ = episodes(B=8)
    logprobs, ref_logprobs = noisy(mask, 1), noisy(mask, 2)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = train_grpo.reinforce_pp_advantages(scores, logprobs, ref_logprobs, mask, 2, BETA, GAMMA)
    difference = 0.0
    for b in range(mask.size(0)):
        centred = scores[b].item() - scores[b - b % 2 : b - b % 2 + 2].mean().item()
        tokens = model_tokens(mask, b)
        for i, t in enumerate(tokens):
            later = tokens[i:]
            kl = sum(GAMMA**j * (logprobs[b, u] - ref_logprobs[b, u]).item() for j, u in enumerate(later))
            difference = max(difference, abs(got[b, t].item() - (GAMMA ** (len(later) - 1) * centred - BETA * kl)))
        assert (got[b][~mask[b].bool()] == 0).all()
    report("train_grpo.reinforce_pp_advantages", difference)


# -----------------------------------------------------------------------------
# the losses, their aggregations and the whitening count model tokens only


def test_ppo_losses_and_whitening_over_model_tokens():
    mask, _ = episodes()
    old_logprobs, advantages, values, old_values, returns = (noisy(mask, seed) for seed in range(10, 15))
    logprobs = torch.where(mask.bool(), old_logprobs + 0.3 * noisy(mask, 15), noisy(mask, 16))
    tokens = [(b, t) for b in range(mask.size(0)) for t in model_tokens(mask, b)]
    eps = 0.2
    policy, stats = train_ppo.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, eps)
    value, _ = train_ppo.ppo_value_loss(values, old_values, returns, mask, eps)
    policy_terms, value_terms, clipped = [], [], 0
    for b, t in tokens:
        ratio = math.exp(logprobs[b, t].item() - old_logprobs[b, t].item())
        advantage = advantages[b, t].item()
        unclipped, clipped_term = -advantage * ratio, -advantage * min(max(ratio, 1 - eps), 1 + eps)
        policy_terms.append(max(unclipped, clipped_term))
        clipped += clipped_term > unclipped
        v, old_v, R = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
        value_terms.append(0.5 * max((v - R) ** 2, (old_v + min(max(v - old_v, -eps), eps) - R) ** 2))
    difference = abs(policy.item() - sum(policy_terms) / len(tokens))
    difference = max(difference, abs(value.item() - sum(value_terms) / len(tokens)))
    difference = max(difference, abs(stats["clipfrac"].item() - clipped / len(tokens)))
    # whitening: the moments of the model tokens alone
    mean, variance = parallel.global_moments(advantages, mask, torch.device("cpu"))
    valid = torch.tensor([advantages[b, t].item() for b, t in tokens], dtype=torch.float64)
    difference = max(difference, abs(mean.item() - valid.mean().item()) / valid.abs().max().item())
    difference = max(difference, abs(variance.item() - valid.var(correction=0).item()) / valid.var().item())
    report("train_ppo losses and whitening", difference, bound=1e-6)  # the moments come back as float32


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_critic_free_losses_over_model_tokens(agg):
    """policy_loss, cispo_loss, gspo_loss (the sequence ratio over model tokens) and kl_loss under each --loss-agg,
    seq_sum_norm's constant max_turns * max_new_tokens; rebel_loss's sums over model tokens."""
    mask, _ = episodes(seed=1)
    old_logprobs, ref_logprobs, advantages = (noisy(mask, seed) for seed in range(20, 23))
    logprobs = torch.where(mask.bool(), old_logprobs + 0.3 * noisy(mask, 23), noisy(mask, 24))
    B = mask.size(0)
    rows = [model_tokens(mask, b) for b in range(B)]
    max_turns, max_new_tokens = 3, 5
    n_tok = sum(len(row) for row in rows)
    weights, denom = train_grpo.loss_weights(mask, agg, B, mask.sum(), max_new_tokens, max_turns)
    lower, upper = 0.8, 1.3

    def aggregate(terms: list[list[float]]) -> float:
        if agg == "token_mean":
            return sum(map(sum, terms)) / n_tok
        if agg == "seq_mean":
            return sum(sum(row) / len(row) for row in terms) / B
        return sum(map(sum, terms)) / (max_turns * max_new_tokens * B)

    ppo_terms, cispo_terms, gspo_terms, kl_terms = [], [], [], []
    for b, tokens in enumerate(rows):
        log_ratios = [logprobs[b, t].item() - old_logprobs[b, t].item() for t in tokens]
        sequence_ratio = math.exp(sum(log_ratios) / len(tokens))
        ppo_row, cispo_row, gspo_row, kl_row = [], [], [], []
        for t, log_ratio in zip(tokens, log_ratios):
            ratio, advantage = math.exp(log_ratio), advantages[b, t].item()
            ppo_row.append(max(-advantage * ratio, -advantage * min(max(ratio, lower), upper)))
            cispo_row.append(-min(max(ratio, lower), upper) * advantage * logprobs[b, t].item())
            gspo_row.append(max(-advantage * sequence_ratio, -advantage * min(max(sequence_ratio, lower), upper)))
            d = logprobs[b, t].item() - ref_logprobs[b, t].item()
            kl_row.append(BETA * (math.expm1(-d) + d))
        ppo_terms.append(ppo_row)
        cispo_terms.append(cispo_row)
        gspo_terms.append(gspo_row)
        kl_terms.append(kl_row)
    got = {
        "policy_loss": train_grpo.policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, weights, denom, 0.3)[0],
        "cispo_loss": train_grpo.cispo_loss(logprobs, old_logprobs, advantages, mask, 0.2, weights, denom, 0.3)[0],
        "gspo_loss": train_grpo.gspo_loss(logprobs, old_logprobs, advantages, mask, 0.2, weights, denom, 0.3)[0],
        "kl_loss": train_grpo.kl_loss(logprobs, ref_logprobs, mask, weights, denom, BETA, "k3"),
    }
    want = {
        "policy_loss": aggregate(ppo_terms),
        "cispo_loss": aggregate(cispo_terms),
        "gspo_loss": aggregate(gspo_terms),
        "kl_loss": aggregate(kl_terms),
    }
    difference = max(abs(got[name].item() - want[name]) for name in got)
    # rebel: rows (2j, 2j + 1) a pair, each log-ratio summed over its model tokens
    gaps = torch.randn(B, dtype=torch.float64)
    rebel, _ = train_grpo.rebel_loss(logprobs, old_logprobs, gaps, mask, 0.5, B / 2)
    sums = [sum(logprobs[b, t].item() - old_logprobs[b, t].item() for t in rows[b]) for b in range(B)]
    rebel_want = sum(((sums[b] - sums[b + 1]) / 0.5 - gaps[b].item()) ** 2 for b in range(0, B, 2)) / (B / 2)
    difference = max(difference, abs(rebel.item() - rebel_want))
    report(f"train_grpo losses, {agg}", difference)


# -----------------------------------------------------------------------------
# single-turn inputs: bit for bit the code before multi-turn (its functions copied here, as they were)


def shape_rewards_ppo_before(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    kl = torch.where(mask.bool(), logprobs - ref_logprobs, 0.0) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask, kl


def shape_rewards_grpo_before(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    rewards = -kl_coef * train_grpo.kl_estimate(logprobs, ref_logprobs, mask, "k1")
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask


def compute_gae_before(rewards, values, mask, gamma: float, lam: float):
    rewards, values = rewards * mask, values * mask
    T = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else torch.zeros_like(lastgaelam)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = (delta + gamma * lam * lastgaelam) * mask[:, t]
        advantages[:, t] = lastgaelam
    return advantages, (advantages + values) * mask


def reward_to_go_before(rewards, mask, gamma: float):
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def last_token_scores_before(scores, mask):
    T = scores.size(1)
    last = (mask.bool() * torch.arange(1, T + 1, device=mask.device)).argmax(-1)
    return scores.gather(1, last[:, None]).squeeze(1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_turn_inputs_compute_what_they_did_bit_for_bit(seed):
    """float32 as the stages run, a prefix of ones a row (an empty row too), anything off the mask."""
    g = torch.Generator().manual_seed(seed)
    B, T = 9, 13
    lengths = [0, 1, T] + torch.randint(1, T + 1, (B - 3,), generator=g).tolist()
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).float()
    logprobs, ref_logprobs, values, rewards, scores_t = (torch.randn(B, T, generator=g) * 3 for _ in range(5))
    scores = scores_t[:, 0]
    assert row_extent(mask).tolist() == mask.sum(1).long().tolist()  # the update's micro-batch widths
    assert torch.equal(last_token_scores(scores_t, mask), last_token_scores_before(scores_t, mask))
    for got, want in [
        (train_ppo.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.3), shape_rewards_ppo_before),
        (train_grpo.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.3), shape_rewards_grpo_before),
    ]:
        before = want(scores, logprobs, ref_logprobs, mask, 0.3)
        assert all(map(torch.equal, got, before)) if isinstance(got, tuple) else torch.equal(got, before)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.8)]:
        got = train_ppo.compute_gae(rewards, values, mask, gamma, lam)
        assert all(map(torch.equal, got, compute_gae_before(rewards, values, mask, gamma, lam)))
        assert torch.equal(train_grpo.reward_to_go(rewards, mask, gamma), reward_to_go_before(rewards, mask, gamma))
    for agg in ("token_mean", "seq_mean", "seq_sum_norm"):
        weights, denom = train_grpo.loss_weights(mask, agg, 7.0, mask.sum(), 24)
        assert denom == {"token_mean": mask.sum(), "seq_mean": 7.0, "seq_sum_norm": 24 * 7.0}[agg]
    # one turn through the multi-turn path: its score split off and normalised as before, the same rewards
    turn_rewards = torch.zeros(B, T).scatter(1, (mask.sum(1).long() - 1).clamp(min=0)[:, None], scores[:, None])
    for stage in (train_ppo, train_grpo):
        final, earlier = stage.split_turn_rewards(turn_rewards, mask)
        final_norm = stage.normalize_scores(final, 0.4, 1.3, "norm", 5.0)
        earlier_norm = stage.normalize_scores(earlier, 0.0, 1.3, "norm", 5.0)
        score_norm = stage.normalize_scores(scores, 0.4, 1.3, "norm", 5.0)
        assert torch.equal(final_norm, score_norm)
        got = stage.shape_rewards(final_norm, logprobs, ref_logprobs, mask, 0.3, earlier_norm)
        before = stage.shape_rewards(score_norm, logprobs, ref_logprobs, mask, 0.3)
        assert all(map(torch.equal, got, before)) if isinstance(got, tuple) else torch.equal(got, before)


# -----------------------------------------------------------------------------
# the stages read a rollout's turn rewards


@pytest.mark.parametrize("stage", [train_ppo, train_grpo], ids=["ppo", "grpo"])
def test_the_stages_read_turn_rewards(stage, task_tok, monkeypatch):
    """An experience's turn_rewards (each turn's reward on its last model token, a row summing to the score): the score
    on the EOS as one turn gives what the rollout's own one-turn episodes give, bit for bit; a score split into two
    turns (0.25 on the first token) moves 0.25 / std from the EOS to that token, the normalised return stays, GAE
    runs over the moved rewards, RLOO's advantage stays."""
    tok = task_tok
    actor = boost_eos(tiny_gpt(tok, 0), tok.eos_id)
    ref, rm, critic = tiny_gpt(tok, 3), tiny_gpt(tok, 2, score_head=True), tiny_gpt(tok, 1, score_head=True)
    if stage is train_ppo:
        args = train_ppo.Args(max_new_tokens=8, reward_norm="norm", reward_clip=None)
    else:
        args = train_grpo.resolve_args(train_grpo.Args(max_new_tokens=8, estimator="rloo", reward_norm="norm"))
    real_rollout = rollout.rollout

    def run(turns: int):
        def with_turn_rewards(engine, prompts):
            experience, sums, records = real_rollout(engine, prompts)
            mask, scores = experience["mask"], experience["scores"]
            last = (mask.sum(1).long() - 1)[:, None]
            turn_rewards = torch.zeros_like(mask).scatter(1, last, scores[:, None])
            if turns == 2:  # the first token ends a first turn worth 0.25 where the row has two tokens
                first = torch.where(last[:, 0] > 0, 0.25, 0.0)
                turn_rewards[:, 0] += first
                turn_rewards = turn_rewards.scatter_add(1, last, -first[:, None])
            if turns:  # 0: the rollout's own
                experience["turn_rewards"] = turn_rewards
            return experience, sums, records

        monkeypatch.setattr(rollout, "rollout", with_turn_rewards)
        roles = Models(actor, ref, [rm], critic=critic if stage is train_ppo else None)
        engine = rollout.Engine(roles, tok, args, 4, torch.Generator().manual_seed(0))
        moments = stage.RunningMoments()
        if stage is train_ppo:
            experience, metrics, _ = train_ppo.ppo_rollout(engine, args, ["Review of"] * 8, 0.1, moments)
        else:
            experience, metrics, _ = train_grpo.grpo_rollout(engine, args, ["Review of"] * 8, moments)
        return experience, metrics, moments.std

    plain, plain_metrics, std = run(0)
    one, one_metrics, _ = run(1)
    two, two_metrics, _ = run(2)
    assert all(torch.equal(one[key], plain[key]) for key in ("rewards", "advantages")) and one_metrics == plain_metrics
    last = (plain["mask"].sum(1).long() - 1)[:, None]
    moved = torch.where(last[:, 0] > 0, 0.25 / (std + 1e-8), 0.0)
    want = plain["rewards"].clone()
    want[:, 0] += moved
    want = want.scatter_add(1, last, -moved[:, None])
    assert moved.sum() > 0 and torch.allclose(two["rewards"], want, atol=1e-6)
    if stage is train_ppo:  # GAE over the moved rewards
        advantages, _ = train_ppo.compute_gae(two["rewards"], two["values"], two["mask"], args.gamma, args.lam)
        assert torch.equal(two["advantages"], advantages)
    else:  # RLOO's advantage reads the return, which stays
        assert torch.allclose(two["advantages"], plain["advantages"], atol=1e-5)
    assert two_metrics["objective/score_norm"] == pytest.approx(plain_metrics["objective/score_norm"], abs=1e-6)
