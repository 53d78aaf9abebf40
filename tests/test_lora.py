"""LoRA adapters, the base views PPO and DPO build on them, and activation checkpointing; LoRA through
the stages: SFT's merged checkpoint and resume, PPO's shared bases, the whole SFT -> RM -> PPO chain on a Hugging
Face Llama, and a resume refused after the base folder changed."""

import copy
import os
import re
import shutil
import sys
import time
from dataclasses import replace

import pytest
import torch
from conftest import CHAIN_SFT, ROOT, run_chain

import checkpoints
import common
import hf
import parallel
import train_ppo
import train_rm
import train_sft
from lora import (
    BaseView,
    LoRAEmbedding,
    LoRALinear,
    add_lora,
    lora_disabled,
    lora_layers,
    merge_lora,
    merged_state_dict,
)
from model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=16)


def randomize_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """B starts at zero (the adapted model equals its base): give it values so the tests can see it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_b" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def test_lora_starts_at_its_base_freezes_it_and_merges_exactly():
    torch.manual_seed(0)
    base = GPT(replace(CFG, score_head=True)).double()
    model = copy.deepcopy(base)
    adapted = add_lora(model, rank=4, alpha=8, targets=None)
    # every linear layer in the blocks, never the tied LM head or the scalar head
    assert adapted == [
        f"transformer.h.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert all("lora_" in name or name.startswith("score_head.") for name in trainable)
    assert "score_head.weight" in trainable and not model.lm_head.weight.requires_grad
    idx = torch.randint(0, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    logits, scores = model(idx, mask)
    base_logits, base_scores = base(idx, mask)
    assert torch.equal(logits, base_logits) and torch.equal(scores, base_scores)  # B = 0: the base exactly
    randomize_adapters(model)
    logits, scores = model(idx, mask)
    assert (logits - base_logits).abs().max() > 1e-3
    with lora_disabled(model):
        off_logits, _ = model(idx, mask)
    assert torch.equal(off_logits, base_logits)
    # the merged state dict is a plain GPT's, with the same outputs
    plain = GPT(replace(CFG, score_head=True)).double()
    plain.load_state_dict(merged_state_dict(model))
    plain_logits, plain_scores = plain(idx, mask)
    assert torch.allclose(plain_logits, logits, atol=1e-10) and torch.allclose(plain_scores, scores, atol=1e-10)
    # merge_lora in place: plain Linear layers back, the same outputs, the base tensors were shared, not copied
    merged_logits, _ = merge_lora(model)(idx, mask)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert torch.allclose(merged_logits, logits, atol=1e-10)


def test_a_small_update_survives_a_bf16_base():
    """Under bf16 a LoRA run's frozen base sits on bf16's grid. An update far under the grid's spacing at the base's
    outputs is still expressed: the adapter's output is added in fp32 (lora.at_least_fp32), which a bf16 sum would
    lose almost whole; merged, the weight comes back in fp32 with the update in it."""
    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(64, 48), rank=4, alpha=8.0)
    embedding = LoRAEmbedding(torch.nn.Embedding(50, 64), rank=4, alpha=8.0)
    for adapted in (layer, embedding):
        adapted.weight.requires_grad_(False)  # the frozen base in bf16, the adapters in fp32: as place_model stores it
        parallel.store_low_precision(adapted, torch.bfloat16, frozen_only=True)
        with torch.no_grad():
            adapted.lora_b.normal_(std=1e-5)  # an update ~1e-4 against outputs ~0.5: a bf16 spacing is ~4e-3
    x, idx = torch.randn(32, 64), torch.randint(0, 50, (32,))
    for adapted, inputs in ((layer, x), (embedding, idx)):
        delta = (adapted.lora_b @ adapted.lora_a) * adapted.scaling  # the update of the weight, in fp32
        want = torch.nn.functional.linear(x, delta) if adapted is layer else delta[idx]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with lora_disabled(adapted):
                without = adapted(inputs)  # bf16
            update = adapted(inputs) - without.float()
        summed_in_bf16 = (without + update.to(torch.bfloat16)).float() - without.float()
        assert (update - want).norm() / want.norm() < 0.02  # the adapter's own matmuls in bf16: ~2^-8
        assert (summed_in_bf16 - want).norm() / want.norm() > 0.8  # what a bf16 sum would have kept
        merged = adapted.merged_weight()
        assert merged.dtype == torch.float32
        assert (merged - adapted.weight.float() - delta).norm() / delta.norm() < 0.01  # fp32's rounding at the weight


def test_lora_shares_the_base_tensors_and_targets_by_name():
    model = GPT(CFG)
    weight = model.transformer.h[0].attn.c_attn.weight
    add_lora(model, rank=2, alpha=2, targets=["c_attn"])
    assert model.transformer.h[0].attn.c_attn.weight is weight  # no copy of the base
    assert isinstance(model.transformer.h[0].attn.c_attn, LoRALinear)
    assert not isinstance(model.transformer.h[0].mlp.c_fc, LoRALinear)
    with pytest.raises(ValueError, match="no linear layer"):
        add_lora(GPT(CFG), rank=2, alpha=2, targets=["q_proj"])


def test_embedding_adapter_is_shared_with_the_tied_lm_head():
    """--lora-targets wte: one low-rank update of the tied table, E + s B A, for the input embedding and the LM head
    alike; checked against a plain GPT given that table by hand, and merged it stays one tied matrix."""
    torch.manual_seed(2)
    model = GPT(CFG).double()
    table = model.transformer.wte.weight
    adapted = add_lora(model, rank=3, alpha=6, targets=["wte"])
    assert adapted == ["lm_head", "transformer.wte"]
    wte, head = model.transformer.wte, model.lm_head
    assert isinstance(wte, LoRAEmbedding) and isinstance(head, LoRALinear)
    assert wte.weight is table and head.weight is table and not table.requires_grad  # the base: shared and frozen
    assert wte.lora_a is head.lora_a and wte.lora_b is head.lora_b  # one adapter
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["transformer.wte.lora_a", "transformer.wte.lora_b"]
    randomize_adapters(model)
    idx = torch.randint(0, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[2, :5] = 0
    logits, _ = model(idx, mask)
    reference = GPT(CFG).double()
    reference.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        reference.transformer.wte.weight.copy_(table + 2.0 * wte.lora_b @ wte.lora_a)  # tied: the head moves too
    assert torch.allclose(logits, reference(idx, mask)[0], atol=1e-10)
    with lora_disabled(model):
        reference.transformer.wte.weight.data.copy_(table)
        assert torch.equal(model(idx, mask)[0], reference(idx, mask)[0])
    state = merged_state_dict(model)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # one tensor in the checkpoint
    plain = GPT(CFG).double()
    plain.load_state_dict(state)
    assert torch.allclose(plain(idx, mask)[0], logits, atol=1e-10)
    merge_lora(model)
    assert type(model.transformer.wte) is torch.nn.Embedding and model.lm_head.weight is model.transformer.wte.weight
    assert torch.allclose(model(idx, mask)[0], logits, atol=1e-10)


def test_untied_embedding_adapter(llama_dir):
    """Llama's embed_tokens is not tied to its head: its adapter is its own, and the head stays frozen and plain."""
    torch.manual_seed(3)
    model = hf.HFCausalLM.from_pretrained(llama_dir).double()
    base = copy.deepcopy(model)
    assert add_lora(model, rank=2, alpha=4, targets=["embed_tokens"]) == ["hf.model.embed_tokens"]
    assert type(model.hf.lm_head) is torch.nn.Linear and not model.hf.lm_head.weight.requires_grad
    randomize_adapters(model)
    idx = torch.randint(3, 50, (2, 9))
    logits, _ = model(idx)
    assert (logits - base(idx)[0]).abs().max() > 1e-3
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    assert torch.allclose(plain(idx)[0], logits, atol=1e-10)


def test_base_view_is_the_base_with_its_own_head():
    """PPO's reference = BaseView(actor); its RM = BaseView(critic, the RM's head): equal to separate frozen copies."""
    torch.manual_seed(1)
    rm = GPT(replace(CFG, score_head=True, lm_head=False))
    critic = copy.deepcopy(rm)
    add_lora(critic, rank=4, alpha=8)
    view = BaseView(critic, score_head=copy.deepcopy(critic.score_head))
    randomize_adapters(critic)
    with torch.no_grad():
        critic.score_head.weight.add_(1.0)  # the critic's head trains away from the RM's
    idx = torch.randint(0, 50, (2, 10))
    _, view_scores = view(idx, logits=False)
    _, rm_scores = rm(idx, logits=False)
    assert torch.allclose(view_scores, rm_scores, atol=1e-6)
    _, critic_scores = critic(idx, logits=False)
    assert (critic_scores - rm_scores).abs().max() > 1e-2  # the view restored the critic's adapters and head
    assert len(list(view.parameters())) == 2  # the view owns its head, not the base


@pytest.mark.parametrize("make", ["gpt", "llama"])
def test_grad_ckpt_gives_the_same_loss_and_gradients(make, llama_dir):
    torch.manual_seed(0)
    if make == "gpt":
        model = GPT(replace(CFG, score_head=True)).double()
    else:
        model = hf.HFCausalLM.from_pretrained(llama_dir, score_head=True).double()
    idx = torch.randint(0, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :3] = 0
    # a module inside the first block: the recompute runs it again (transformers checkpoints forward, not __call__)
    attention = model.transformer.h[0].attn if make == "gpt" else model.hf.model.layers[0].self_attn
    calls = []
    attention.register_forward_pre_hook(lambda *_: calls.append(1))
    results = []
    for enabled in (False, True):
        model.zero_grad()
        model.set_grad_ckpt(enabled)
        model.eval()  # PPO's models run in eval mode: the recompute must happen there too
        calls.clear()
        logits, scores = model(idx, mask)
        loss = logits.logsumexp(-1).mean() + scores.pow(2).mean()
        loss.backward()
        assert len(calls) == (2 if enabled else 1)  # checkpointing runs the block again in the backward
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-10), name


# -----------------------------------------------------------------------------
# LoRA checkpoints: adapters and the record of their base, merged by the loader


def save_as_a_run(kind: str, args, models: dict, tok, seed: int = 0) -> tuple[str, dict]:
    """Run.save's checkpoint of LoRA models by key (model, critic) whose adapters and heads moved: (its path, each
    model's merged state dict, what checkpoints held as `<key>` before they kept adapters only)."""
    trained = []
    for name, model in models.items():
        randomize_adapters(model, seed)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.startswith("score_head."):
                    parameter.add_(0.5)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        trained.append(common.Trained(name, model, optimizer, common.LRSchedule(1e-3, 0, 10)))
    dist = parallel.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), ddp=False)
    checkpoints.Run(kind, args, dist, tok, trained, started=time.time()).save(step=1, data_state={})
    return os.path.join(args.out_dir, "ckpt.pt"), {name: merged_state_dict(model) for name, model in models.items()}


def lora_model(spec: str, args, dtype: torch.dtype = torch.float32, **heads):
    """A stage's model: built from spec (through the loader when it is a LoRA checkpoint), adapters on, the frozen
    base stored in dtype as parallel.place_model stores it."""
    model, tok, _ = hf.load_init(spec, **heads)
    add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets)
    parallel.store_low_precision(model, dtype, frozen_only=True)
    return model, tok


def assert_same_tensors(state: dict, want: dict) -> None:
    assert state.keys() == want.keys()
    for name, value in want.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lora_checkpoint_holds_adapters_and_the_loader_merges_them_to_the_bit(tmp_path, tiny_ckpts, dtype):
    """A LoRA SFT from a .pt checkpoint, then a LoRA RM from that SFT: each checkpoint holds its adapters (and the RM
    its trained head) and `base`, no full weights; the loader rebuilds the base (recursively for the RM), merges, and
    returns exactly the merged state dict the run held, bf16 matrices included."""
    targets = ["c_attn", "c_proj", "c_fc", "wte"]
    lora = dict(lora_rank=2, lora_alpha=4.0, lora_targets=targets)
    sft_args = train_sft.Args(out_dir=str(tmp_path / "sft"), init=tiny_ckpts[0], **lora)
    sft_model, tok = lora_model(tiny_ckpts[0], sft_args, dtype)
    sft_path, sft_merged = save_as_a_run("sft", sft_args, {"model": sft_model}, tok)
    sft = checkpoints.load_checkpoint(sft_path)
    assert "model" not in sft and all("lora_" in name for name in sft["model_lora"])
    base = sft["base"]["model"]
    assert base["spec"] == tiny_ckpts[0] and base["sha256"] == checkpoints.file_sha256(tiny_ckpts[0])
    assert base["dtype"] == str(dtype).removeprefix("torch.") and base["lora_targets"] == targets
    assert_same_tensors(hf.merged_weights(sft), sft_merged["model"])
    assert any(not torch.equal(value, sft_merged["model"][name]) for name, value in sft_model.state_dict().items())
    # the RM's base is the LoRA SFT: two levels, and the RM's fresh head trains
    rm_args = train_rm.Args(out_dir=str(tmp_path / "rm"), init=sft_path, **lora)
    rm_model, _ = lora_model(sft_path, rm_args, dtype, score_head=True)
    rm_path, rm_merged = save_as_a_run("rm", rm_args, {"model": rm_model}, tok, seed=1)
    rm = checkpoints.load_checkpoint(rm_path)
    assert "score_head.weight" in rm["model_lora"] and rm["base"]["model"]["spec"] == sft_path
    assert_same_tensors(hf.merged_weights(rm), rm_merged["model"])
    loaded = hf.model_from_checkpoint(rm_path)
    assert_same_tensors(loaded.state_dict(), {name: value.float() for name, value in rm_merged["model"].items()})
    critic = hf.model_from_checkpoint(rm, lm_head=False, score_head=True)  # PPO's critic from a LoRA RM
    assert torch.equal(critic.score_head.weight, rm_merged["model"]["score_head.weight"].float())
    # unmerged (eval.py under bf16): the run's own model, adapters over its base, the RM's head dropped on request
    unmerged = hf.model_from_checkpoint(rm, lm_head=True, score_head=False, merge=False)
    held = {name: value.float() for name, value in rm_model.state_dict().items() if not name.startswith("score_")}
    assert lora_layers(unmerged) and unmerged.score_head is None
    assert_same_tensors({name: value.float() for name, value in unmerged.state_dict().items()}, held)


def test_a_lora_checkpoint_names_its_missing_or_changed_base(tmp_path, tiny_ckpts, capsys):
    """The loader checks the base against its fingerprint: gone or changed is one line naming the base and the
    checkpoint that needs it (exit 2 from a script: `python hf.py export`); --resume still loads the adapters onto
    the rebuilt base."""
    init = str(tmp_path / "init.pt")
    shutil.copy(tiny_ckpts[0], init)
    args = train_sft.Args(out_dir=str(tmp_path / "sft"), init=init, lora_rank=2)
    model, tok = lora_model(init, args)
    path, merged = save_as_a_run("sft", args, {"model": model}, tok)
    resumed, _ = lora_model(init, args)
    checkpoints.load_model_state(resumed, checkpoints.load_checkpoint(path))
    assert_same_tensors(merged_state_dict(resumed), merged["model"])
    os.rename(init, init + ".moved")
    with pytest.raises(common.UserError, match=rf"^{path} holds LoRA adapters only, and its base {init} is missing"):
        hf.model_from_checkpoint(checkpoints.load_checkpoint(path))
    with pytest.raises(SystemExit) as exit:
        common.run_main(lambda argv: hf.export_checkpoint(*argv), [path, str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and f"its base {init} is missing" in error and len(error.strip().splitlines()) == 1
    ckpt = torch.load(init + ".moved", weights_only=False)
    ckpt["model"]["transformer.ln_f.bias"] += 1.0
    checkpoints.save_checkpoint(ckpt, init)
    with pytest.raises(common.UserError, match=rf"its base {init} changed since it was trained \(sha256 differs\)"):
        hf.model_from_checkpoint(path)


def test_hf_lora_policy_and_critic_merge_to_the_bit_and_export(tmp_path, llama_dir):
    """The tiny Llama: a LoRA SFT from its folder, then a PPO run from that SFT with a policy and a critic (no RM: the
    critic's base is the policy's init, without its lm head); each merges back exactly, and the export of the SFT
    checkpoint is a plain transformers model with the merged model's logits."""
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    lora = dict(lora_rank=2, lora_alpha=4.0, lora_targets=targets)
    sft_args = train_sft.Args(out_dir=str(tmp_path / "sft"), init=f"hf:{llama_dir}", **lora)
    sft_model, tok = lora_model(f"hf:{llama_dir}", sft_args)
    sft_path, sft_merged = save_as_a_run("sft", sft_args, {"model": sft_model}, tok)
    sft = checkpoints.load_checkpoint(sft_path)
    assert sft["base"]["model"]["sha256"] == checkpoints.init_fingerprint(f"hf:{llama_dir}")
    assert_same_tensors(hf.merged_weights(sft), sft_merged["model"])
    ppo_args = train_ppo.Args(out_dir=str(tmp_path / "ppo"), sft_ckpt=sft_path, rm_ckpt=["none"], **lora)
    actor, _ = lora_model(sft_path, ppo_args)
    critic, _ = lora_model(sft_path, ppo_args, lm_head=False, score_head=True)
    ppo_path, ppo_merged = save_as_a_run("ppo", ppo_args, {"model": actor, "critic": critic}, tok)
    ppo = checkpoints.load_checkpoint(ppo_path)
    assert not {"model", "critic"} & set(ppo) and ppo["base"]["critic"]["lm_head"] is False
    assert_same_tensors(hf.merged_weights(ppo), ppo_merged["model"])
    assert_same_tensors(hf.merged_weights(ppo, "critic"), ppo_merged["critic"])
    hf.export_checkpoint(sft_path, str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    merged = hf.model_from_checkpoint(sft).eval()
    idx = torch.randint(3, 83, (2, 9))
    with torch.no_grad():
        assert torch.equal(merged(idx)[0], exported(idx).logits)


@pytest.mark.slow
def test_sft_lora_checkpoint_holds_adapters_and_resumes(tmp_path, task_dir, tiny_ckpts, capsys):
    """SFT with --lora-rank, the tied embedding among the targets: `model_lora` the adapters and `base` the --init they
    go on, no full `model` (the loader merges: a later stage loads it as any); the --export-hf folder gives the
    unmerged model's logits; --resume continues on the base rebuilt from --init. experiments/lora_merge_error.py
    reads the run: an fp32 merge keeps its update, a bf16 merge loses part of it."""
    args = train_sft.Args(
        out_dir=str(tmp_path / "lora"),
        task_dir=task_dir,
        init=tiny_ckpts[0],
        batch_size=8,
        micro_batch_size=4,
        max_steps=4,
        eval_every=4,
        num_samples=4,
        eval_samples=4,
        log_every=1,
        max_new_tokens=8,
        lr=1e-2,
        lora_rank=4,
        lora_alpha=8,
        lora_targets=["c_attn", "c_proj", "c_fc", "wte"],
        save_every=1,
    )
    train_sft.main(replace(args, export_hf=str(tmp_path / "hf")))
    ckpt = torch.load(tmp_path / "lora" / "ckpt.pt", weights_only=False)
    assert "model" not in ckpt and ckpt["base"]["model"]["spec"] == tiny_ckpts[0]
    assert ckpt["model_lora"] and all("lora_" in key for key in ckpt["model_lora"])
    merged = hf.merged_weights(ckpt)
    assert not any("lora_" in key for key in merged)
    init = torch.load(tiny_ckpts[0], weights_only=False)["model"]
    moved = [key for key in init if not torch.equal(init[key], merged[key])]
    targets = ("c_attn.weight", "c_proj.weight", "c_fc.weight", "wte.weight", "lm_head.weight")
    assert "transformer.wte.weight" in moved and all(key.endswith(targets) for key in moved)
    model = hf.model_from_checkpoint(ckpt)  # the plain loader: merged weights
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    # the export (merged) against the unmerged model: the base from --init with the checkpoint's adapters
    from transformers import AutoModelForCausalLM

    unmerged = hf.model_from_checkpoint(tiny_ckpts[0])
    add_lora(unmerged, rank=4, alpha=8, targets=args.lora_targets)
    unmerged.load_state_dict(ckpt["model_lora"], strict=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, unmerged.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert (unmerged(idx)[0] - exported(idx).logits).abs().max() <= 1e-4
    # 2 steps, then --resume to 4: the same adapters as the straight run
    train_sft.main(replace(args, out_dir=str(tmp_path / "split"), max_steps=2))
    os.remove(tmp_path / "split" / "samples.jsonl")
    train_sft.main(replace(args, out_dir=str(tmp_path / "split"), resume=True))
    split = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    for key in ckpt["model_lora"]:
        assert torch.allclose(ckpt["model_lora"][key], split["model_lora"][key], atol=1e-6), key
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import lora_merge_error

    errors = {}
    for dtype in ("float32", "bfloat16"):
        capsys.readouterr()
        lora_merge_error.main(lora_merge_error.Args(ckpt=str(tmp_path / "lora" / "ckpt.pt"), dtype=dtype))
        errors[dtype] = float(re.search(r"relative error is ([0-9.]+)", capsys.readouterr().out).group(1))
    assert errors["float32"] == 0 and errors["bfloat16"] > 0, errors


@pytest.mark.slow
def test_ppo_lora_shares_bases_and_trains(tmp_path, task_dir, tiny_ckpts, capsys):
    sft, rm = tiny_ckpts
    train_ppo.main(
        train_ppo.Args(
            out_dir=str(tmp_path / "ppo"),
            task_dir=task_dir,
            sft_ckpt=sft,
            rm_ckpt=rm,
            max_steps=3,
            rollout_batch_size=8,
            num_minibatches=2,
            micro_batch_size=4,
            ptx_batch_size=4,
            max_new_tokens=8,
            critic_warmup_steps=1,
            warmup_steps=1,
            log_every=1,
            sample_every=1,
            lora_rank=4,
            grad_ckpt=True,
        )
    )
    out = capsys.readouterr().out
    assert "actor: LoRA rank 4" in out and "critic: LoRA rank 4" in out
    ckpt = torch.load(tmp_path / "ppo" / "ckpt.pt", weights_only=False)
    assert {"model_lora", "critic_lora", "base"} <= set(ckpt) and not {"model", "critic"} & set(ckpt)
    assert ckpt["base"]["critic"]["spec"] == rm and ckpt["base"]["critic"]["lm_head"] is False  # the critic's init
    actor = hf.model_from_checkpoint(ckpt)
    reference = hf.model_from_checkpoint(checkpoints.load_checkpoint(sft))
    differs = [n for n, p in actor.state_dict().items() if not torch.equal(p, reference.state_dict()[n])]
    assert differs  # the actor's adapters moved (the ptx loss trains them even when no response ends)


@pytest.mark.slow
def test_llama_chain_with_lora_and_grad_ckpt(tmp_path, llama_dir, user_data):
    """--lora-rank and --grad-ckpt on the Hugging Face adapter through SFT, RM and PPO: adapters on q/k/v/o, the MLP
    projections and the (untied) token embedding, checkpoints with the adapters and their base (each stage's the one
    before: PPO's critic on the LoRA RM, itself on the LoRA SFT), merged by the loader, and an export with the
    unmerged actor's logits."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
    ckpts = run_chain(
        tmp_path, f"hf:{llama_dir}", user_data, lora_rank=2, lora_alpha=4, lora_targets=targets, grad_ckpt=True
    )
    for stage in ("sft", "rm", "ppo"):
        adapters = ckpts[stage]["model_lora"]
        assert any(name.endswith("q_proj.lora_a") for name in adapters), stage
        assert any(name.endswith("embed_tokens.lora_b") for name in adapters), stage
        assert "model" not in ckpts[stage] and not any("lora_" in name for name in hf.merged_weights(ckpts[stage]))
    assert any(name.endswith("lora_b") for name in ckpts["ppo"]["critic_lora"])
    assert ckpts["ppo"]["base"]["critic"]["spec"] == ckpts["rm"]["args"]["out_dir"] + "/ckpt.pt"
    critic = hf.model_from_checkpoint(ckpts["ppo"], key="critic")  # two levels of bases under it
    assert critic.score_head is not None and not critic.config.lm_head
    sft, policy = (hf.model_from_checkpoint(ckpts[s]).eval() for s in ("sft", "ppo"))
    idx = torch.randint(3, 83, (2, 7))
    with torch.no_grad():
        assert (sft(idx)[0] - policy(idx)[0]).abs().max() > 0  # the adapters moved the actor
    # the merged export against the unmerged actor: the SFT model (PPO's base) with PPO's adapters on it
    from transformers import AutoModelForCausalLM

    add_lora(sft, rank=2, alpha=4, targets=targets)
    sft.load_state_dict(ckpts["ppo"]["model_lora"], strict=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_policy").eval()
    assert exported.config.model_type == "llama"
    with torch.no_grad():
        assert (sft(idx)[0] - exported(idx).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_lora_resume_refuses_a_changed_base_folder(tmp_path, llama_dir, user_data):
    """A LoRA SFT run from a Hugging Face folder records the folder's fingerprint (it used to record no hash for a
    non-.pt --init): resuming after the folder's weights changed would load the adapters onto other weights, and is
    refused; the unchanged folder resumes."""
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "base")
    shutil.copytree(llama_dir, base)
    args = train_sft.Args(
        out_dir=str(tmp_path / "sft"),
        init=f"hf:{base}",
        data=user_data["sft"],
        task_dir=str(tmp_path / "data"),
        lora_rank=2,
        **(CHAIN_SFT | {"max_steps": 2}),
    )
    train_sft.main(args)
    assert torch.load(tmp_path / "sft" / "ckpt.pt", weights_only=False)["init_hash"] is not None
    resume = replace(args, resume=True, max_steps=3)
    hf_model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        hf_model.get_input_embeddings().weight.add_(0.01)
    hf_model.save_pretrained(base)
    with pytest.raises(common.UserError, match=r"--init hf:.*base changed since the run started"):
        train_sft.main(resume)
    shutil.rmtree(base)
    shutil.copytree(llama_dir, base)
    train_sft.main(resume)
    assert torch.load(tmp_path / "sft" / "ckpt.pt", weights_only=False)["step"] == 3
