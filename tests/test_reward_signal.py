"""The reward signal (DESIGN §5d): the KL-optimal limit, reward-model ensembles, the reference of a later round, and
the KL estimator in the loss."""

import math
import os
from unittest import mock

import pytest
import torch

import checkpoints
import common
import eval as ev
import train_ppo
from model import aggregate_rm_scores
from train_ppo import kl_loss, loss_weights


def ragged(B: int = 6, T: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 1, T
    mask = (torch.arange(T) < lengths[:, None]).double()
    return lengths.tolist(), mask, [torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(3)]


def test_aggregate_rm_scores_against_loops():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 9, generator=g, dtype=torch.float64)
    got = {agg: aggregate_rm_scores(scores, agg, 0.7) for agg in ("mean", "min", "uwo")}
    for b in range(9):
        members = scores[:, b].tolist()
        mean = sum(members) / 4
        variance = sum((x - mean) ** 2 for x in members) / 4  # the population variance
        assert got["mean"][b].item() == pytest.approx(mean, abs=1e-12)
        assert got["min"][b].item() == min(members)
        assert got["uwo"][b].item() == pytest.approx(mean - 0.7 * variance, abs=1e-12)
    one = scores[:1]
    for agg in ("mean", "min", "uwo"):  # one member is its own score
        assert torch.equal(aggregate_rm_scores(one, agg, 0.7), one[0])
    with pytest.raises(ValueError, match="unknown RM aggregation"):
        aggregate_rm_scores(scores, "max")


def test_k2_in_the_loss_value_and_gradient():
    """k2 = d^2 / 2 with d = logp - ref_logp: its gradient in logp is d, the on-policy gradient of k1 in the reward;
    padding holds an extreme log-prob and changes nothing."""
    lengths, mask, (lp, ref, _) = ragged()
    weights, denom = loss_weights(mask, "seq_mean", len(lengths), mask.sum(), 7)
    logprobs = torch.where(mask.bool(), lp, torch.full_like(lp, -1000.0)).requires_grad_(True)
    loss = kl_loss(logprobs, ref * mask, mask, weights, denom, 0.05, "k2")
    want = sum(
        0.05 * 0.5 * (lp[b, t].item() - ref[b, t].item()) ** 2 * weights[b, t].item() / denom
        for b, n in enumerate(lengths)
        for t in range(n)
    )
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    assert torch.allclose(logprobs.grad, 0.05 * weights / denom * (lp - ref) * mask, atol=1e-12)
    with pytest.raises(ValueError, match="k1's expected gradient is zero"):
        kl_loss(logprobs, ref, mask, weights, denom, 0.05, "k1")


def test_kl_estimator_resolves_per_placement():
    resolve = train_ppo.resolve_args
    assert resolve(train_ppo.Args()).kl_estimator == "k1"  # gae: in the reward
    assert resolve(train_ppo.Args(adv_estimator="grpo")).kl_estimator == "k3"  # grpo: in the loss
    assert resolve(train_ppo.Args(adv_estimator="grpo", kl_estimator="k2")).kl_estimator == "k2"
    args = resolve(train_ppo.Args(adv_estimator="grpo", kl_estimator="k1"))
    with pytest.raises(common.UserError, match="--kl-estimator k1 in the loss: its expected gradient is zero"):
        train_ppo.check_args(args)
    # the RM list: a checkpoint from before ensembles saved one path, and older reward-function names
    old = resolve(train_ppo.Args(rm_ckpt="out/rm/ckpt.pt", reward_fn="data:gold_reward"))
    assert old.rm_ckpt == ["out/rm/ckpt.pt"] and old.reward_fn == "task:gold_reward"


def test_tilted_estimates_on_a_toy_where_the_optimum_is_exact():
    """A reference over 4 outcomes with probabilities 0.1 0.2 0.3 0.4, sampled exactly in proportion (M = 10 samples:
    1, 2, 3, 4 of each): the importance-weighted estimates are the tilted distribution's exact mean, KL and ess."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    r = torch.tensor([1.0, -0.5, 0.3, 0.0], dtype=torch.float64)
    f = torch.tensor([2.0, 5.0, -1.0, 0.5], dtype=torch.float64)
    outcomes = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    for beta in (0.2, 1.0, 5.0):
        est = ev.tilted_estimates(r[outcomes][None], {"f": f[outcomes][None]}, beta)
        tilted = p * torch.exp(r / beta)
        tilted = tilted / tilted.sum()
        assert est["f"].item() == pytest.approx((tilted * f).sum().item(), abs=1e-12)
        assert est["kl"].item() == pytest.approx((tilted * (tilted / p).log()).sum().item(), abs=1e-12)
        weights = tilted[outcomes] / torch.bincount(outcomes)[outcomes]  # each sample's share of its outcome
        assert est["ess"].item() == pytest.approx(1 / (weights**2).sum().item(), abs=1e-9)
    flat = ev.tilted_estimates(r[outcomes][None], {}, 1e6)  # beta -> infinity: the reference itself
    assert abs(flat["kl"].item()) < 1e-9 and flat["ess"].item() == pytest.approx(10, abs=1e-6)


@pytest.fixture(scope="module")
def tiny_rms(tmp_path_factory, task_dir, tiny_ckpts):
    """Two RM checkpoints: the tiny RM and a copy with another head (an ensemble whose members disagree)."""
    rm = torch.load(tiny_ckpts[1], weights_only=False)
    other = {k: v.clone() for k, v in rm["model"].items()}
    other["score_head.weight"] = -other["score_head.weight"]
    path = str(tmp_path_factory.mktemp("rms") / "rm2.pt")
    import checkpoints

    checkpoints.save_checkpoint(rm | {"model": other}, path)
    return [tiny_ckpts[1], path]


def test_eval_kl_optimal_rows_and_the_sample_cache(tmp_path, task_dir, tiny_ckpts, tiny_rms, capsys):
    """eval.py --kl-optimal: the first --policy must be --ref; rows <name>_opt_gold_b<beta> and _opt_rm_b<beta> with
    their schema; a large beta is the reference itself (KL ~ 0), the gold tilt raises gold and stays under log M;
    the cached samples serve another reward model without sampling again."""
    sft = tiny_ckpts[0]
    base = dict(policy=[sft], names=["sft"], ref=sft, num_samples=6, seeds=16, max_new_tokens=8, task_dir=task_dir)
    with pytest.raises(common.UserError, match="--kl-optimal tilts the reference's own samples"):
        ev.main(ev.Args(**base | {"policy": [tiny_rms[0]]}, rm=[tiny_rms[0]], kl_optimal=[0.5]))
    cache = str(tmp_path / "samples.pt")
    rows = ev.main(ev.Args(**base, rm=[tiny_rms[0]], kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert set(rows) == {"sft_opt_gold_b0.05", "sft_opt_gold_b10000", "sft_opt_rm_b0.05", "sft_opt_rm_b10000"}
    keys = {"gold", "score", "kl", "valid_frac", "ess", "samples", "beta", "warning"}
    assert all(keys | {"gold_se", "score_se", "kl_se"} <= set(row) for row in rows.values())
    flat, sharp = rows["sft_opt_gold_b10000"], rows["sft_opt_gold_b0.05"]
    assert abs(flat["kl"]) < 1e-3 and flat["ess"] == pytest.approx(16, abs=0.01) and flat["samples"] == 16
    assert sharp["gold"] >= flat["gold"] and 0 <= sharp["kl"] <= math.log(16) + 1e-9
    capsys.readouterr()
    again = ev.main(ev.Args(**base, rm=tiny_rms, rm_agg="min", kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert "reference samples from" in capsys.readouterr().out
    assert again["sft_opt_gold_b0.05"]["gold"] == sharp["gold"]  # the same samples
    assert again["sft_opt_rm_b10000"]["score"] <= rows["sft_opt_rm_b10000"]["score"] + 1e-9  # min <= a member
    kept = torch.load(cache, weights_only=False)["rm_scores"]  # each RM's scores, by its file's hash
    assert set(kept) == {checkpoints.file_sha256(path) for path in tiny_rms}
    with mock.patch.object(ev, "score_sequences", side_effect=AssertionError("scored again")):
        third = ev.main(ev.Args(**base, rm=tiny_rms, rm_agg="min", kl_optimal=[0.05, 1e4], sample_cache=cache))
    assert third == again


def test_eval_pairs_reports_each_member_and_the_aggregate(task_dir, tiny_rms):
    res = ev.main(ev.Args(pairs=True, rm=tiny_rms, rm_agg="mean", task_dir=task_dir, batch_size=64))
    assert set(res) == {"rm", "rm_member1", "rm_member2"}
    # the second member's head is the first's negated: its accuracy is the first's complement, the mean is a tie
    assert res["rm_member1"]["accuracy"] + res["rm_member2"]["accuracy"] == pytest.approx(1.0, abs=1e-9)
    assert res["rm"]["accuracy"] == pytest.approx(0.5, abs=0.01)


TINY = dict(
    max_steps=2,
    rollout_batch_size=8,
    num_minibatches=2,
    micro_batch_size=4,
    ptx_batch_size=4,
    max_new_tokens=8,
    critic_warmup_steps=1,
    warmup_steps=1,
    log_every=1,
)


def test_ppo_with_an_ensemble_and_a_reference_of_its_own(tmp_path, task_dir, tiny_ckpts, tiny_rms):
    """--rm-ckpt a b (uwo) logs the members' spread and keeps both hashes; under LoRA the first member shares the
    critic's base and the second is a full model; --ref-ckpt sets the KL's reference apart from the policy's init
    (its first rollout's KL is then not 0) and a resume refuses a changed reference."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "ppo")
    args = train_ppo.Args(
        out_dir=out, task_dir=task_dir, sft_ckpt=tiny_ckpts[0], rm_ckpt=tiny_rms, rm_agg="uwo", lora_rank=2, **TINY
    )
    train_ppo.main(args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert len(ckpt["rm_hashes"]) == 2 and ckpt["args"]["rm_ckpt"] == tiny_rms
    events = EventAccumulator(out)
    events.Reload()
    assert events.Scalars("objective/score_std")[0].value > 0
    # another reference: the tiny RM's trunk with an LM head is a policy of another seed
    other = str(tmp_path / "other_sft.pt")
    sft = torch.load(tiny_ckpts[0], weights_only=False)
    moved = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sft["model"].items()}
    import checkpoints

    checkpoints.save_checkpoint(sft | {"model": moved}, other)
    ref_out = str(tmp_path / "ref")
    ref_args = dict(sft_ckpt=tiny_ckpts[0], ref_ckpt=other, rm_ckpt=tiny_rms[:1])
    train_ppo.main(train_ppo.Args(out_dir=ref_out, task_dir=task_dir, **ref_args, **TINY))
    events = EventAccumulator(ref_out)
    events.Reload()
    assert events.Scalars("objective/kl")[0].value != 0.0
    checkpoints.save_checkpoint(sft | {"model": moved, "seconds": 1.0}, other)
    with pytest.raises(common.UserError, match="--ref-ckpt changed since the run started"):
        train_ppo.main(train_ppo.Args(out_dir=ref_out, task_dir=task_dir, resume=True, max_steps=3))
