"""rollout.py's models an RL stage runs by role: the bf16 sampler copy of the actor (Models.with_sampler) and its
refresh in place after every update (Models.refresh_sampler), with and without LoRA."""

import pytest
import torch
from conftest import tiny_gpt

import rollout
from rollout import Models

# -----------------------------------------------------------------------------
# the bf16 sampler (Models.with_sampler, Models.refresh_sampler)


def assert_sampler_is_the_actor_in_bf16(sampler, actor_state: dict) -> None:
    """Every matrix of the sampler is exactly the actor's (adapters too) cast to bf16; norms and biases are the
    actor's fp32 tensors (parallel.store_low_precision keeps them in fp32)."""
    sampler_state = sampler.state_dict()
    assert set(sampler_state) == set(actor_state)
    for name, want in actor_state.items():
        got = sampler_state[name]
        if want.is_floating_point() and want.dim() >= 2:
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


def move(parameters, seed: int) -> None:
    """A stand-in for an optimizer step: every parameter moved in place by a small random amount."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in parameters:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=g))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_bf16_sampler_is_the_actor_in_bf16_and_refreshes_in_place(task_tok, lora):
    """Under bf16 the rollouts come from a frozen bf16 copy of the actor (docs/design.md §7): its matrices are the
    actor's cast to bf16, LoRA adapters kept unmerged (merged into the bf16 base, a small update rounds away), so its
    forward under autocast is the actor's to bf16's rounding. After the actor moves, refresh_sampler copies it in place:
    every sampler tensor keeps its storage (static KV caches and CUDA graphs keep their addresses) and holds the new
    weights cast to bf16 exactly, while the actor's fp32 master weights (and its adapters) are left as they were.
    fp32 and --fsdp build no sampler."""
    from lora import BaseView, add_lora, lora_layers

    actor = tiny_gpt(task_tok, 0)
    if lora:
        add_lora(actor, rank=2, alpha=4.0, targets=["c_attn", "c_proj", "c_fc", "wte"])
        move([p for name, p in actor.named_parameters() if "lora_" in name], seed=1)  # B A != 0: the update matters
    reference = BaseView(actor) if lora else tiny_gpt(task_tok, 1)
    plain = Models(actor, reference, [])
    assert plain.with_sampler(torch.float32, fsdp=False).sampler is None
    assert plain.with_sampler(torch.bfloat16, fsdp=True).sampler is None
    models = plain.with_sampler(torch.bfloat16, fsdp=False)
    sampler = models.sampler
    assert models.actor is actor and sampler is not actor and len(lora_layers(sampler)) == len(lora_layers(actor))
    assert sampler.lm_head.weight is sampler.transformer.wte.weight  # still one tied matrix
    assert not any(p.requires_grad for p in sampler.parameters()) and not sampler.training
    assert_sampler_is_the_actor_in_bf16(sampler, actor.state_dict())
    idx = torch.randint(0, task_tok.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        gap = (sampler(idx)[0].float() - actor(idx)[0].float()).abs().max()
    assert gap <= 0.02  # bf16's rounding of logits under 1: the embedding table, which autocast leaves fp32
    addresses = {name: tensor.data_ptr() for name, tensor in sampler.state_dict().items()}
    trained = [p for p in actor.parameters() if p.requires_grad]
    move(trained, seed=2)
    actor_before = {name: tensor.clone() for name, tensor in actor.state_dict().items()}
    moved = "transformer.h.0.attn.c_attn." + ("lora_b" if lora else "weight")
    assert not torch.equal(sampler.state_dict()[moved], actor_before[moved].to(torch.bfloat16))
    models.refresh_sampler()
    assert_sampler_is_the_actor_in_bf16(sampler, actor_before)
    assert {name: tensor.data_ptr() for name, tensor in sampler.state_dict().items()} == addresses
    actor_after = actor.state_dict()
    assert all(torch.equal(actor_after[name], tensor) for name, tensor in actor_before.items())
    assert all(p.dtype == torch.float32 for p in trained) and bool(lora_layers(actor)) == lora
    plain.refresh_sampler()  # no sampler: nothing to do


@pytest.mark.parametrize("stage, lora", [("ppo", False), ("grpo", True)], ids=["ppo", "grpo_lora"])
def test_a_resumed_bf16_run_samples_from_the_resumed_actor(tmp_path, task_dir, tiny_ckpts, monkeypatch, stage, lora):
    """--resume under bf16: before the first rollout of the resumed sitting, the sampler copy is the resumed actor
    (LoRA adapters too) cast to bf16, not the --sft-ckpt weights it was built from; the first rollout's mean log-prob
    error a token stays at bf16 rounding."""
    import train_grpo
    import train_ppo

    module = train_ppo if stage == "ppo" else train_grpo
    flags = dict(
        out_dir=str(tmp_path / stage),
        task_dir=task_dir,
        sft_ckpt=tiny_ckpts[0],
        rm_ckpt=[tiny_ckpts[1]],
        dtype="bfloat16",
        rollout_batch_size=8,
        num_minibatches=1,
        micro_batch_size=8,
        max_new_tokens=8,
        warmup_steps=1,
        lr=5e-2,  # large steps: the actor moves far from its init
        log_every=1,
        max_steps=2,
    )
    flags |= dict(critic_warmup_steps=0) if stage == "ppo" else dict(group_size=2)
    flags |= dict(lora_rank=4, lora_alpha=8.0) if lora else {}
    module.main(module.Args(**flags))
    seen = []
    real = rollout.rollout

    def first_rollout(engine, prompts, *args, **kwargs):
        if not seen:  # copies: both are updated in place later
            sampler = {name: value.clone() for name, value in engine.models.sampler.state_dict().items()}
            actor = {name: value.clone() for name, value in engine.models.actor.state_dict().items()}
            seen.append((sampler, actor))
        return real(engine, prompts, *args, **kwargs)

    monkeypatch.setattr(rollout, "rollout", first_rollout)
    module.main(module.Args(**(flags | dict(resume=True, max_steps=3))))
    sampler, actor = seen[0]
    for name, want in actor.items():
        assert torch.equal(sampler[name], want.to(sampler[name].dtype)), name
    init = torch.load(tiny_ckpts[0], weights_only=False)["model"]
    if lora:  # the actor had moved: its adapters off B = 0
        assert any(actor[name].abs().max() > 0 for name in actor if name.endswith("lora_b"))
    else:
        assert any(not torch.equal(actor[name], init[name]) for name in init)
