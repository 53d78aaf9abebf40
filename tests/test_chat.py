"""Conversational data (DESIGN §3): chat-template rendering, every assistant turn learned, the end-of-turn token as
the stop and score token, HH's layout without a template, validation, converters, and every stage on messages data
with a tiny Hugging Face Llama whose tokenizer has a chat template."""

import json
import os
import subprocess
import sys

import pytest
import torch

import data
import eval as ev
import train_dpo
import train_ppo
import train_rm
import train_sft
from common import UserError
from task import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL = ["<unk>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
WORDS = [f"w{i}" for i in range(40)]
# ChatML, with spaces where the real one has newlines (the test's word-level tokenizer splits on whitespace)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
IM_START, IM_END = 3, 4


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    """A tiny Llama folder whose tokenizer has a ChatML-style template; <|im_end|> closes a turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("chat_llama"))
    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(vocab),
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=IM_END,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_template_renders_prompts_replies_and_every_assistant_turn(chat_llama):
    tok = data.load_tokenizer(f"hf:{chat_llama}")
    assert tok.chat and tok.eos_id == IM_END and tok.state()["chat"] is True
    assert data.Tokenizer.from_state(tok.state()).eos_id == IM_END
    prompt = [user("w1 w2")]
    head = data.prompt_ids(tok, prompt)  # apply_chat_template(..., add_generation_prompt=True)
    hf_tok = tok.backend
    rendered = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert head == list(rendered["input_ids"]) and head[-2:] == [IM_START, 6]  # ends with the assistant header
    assert "<|im_start|>assistant" in data.prompt_text(tok, prompt)
    reply = data.response_ids(tok, prompt, [assistant("w3 w4")])
    assert reply == tok.encode("w3 w4") + [IM_END]  # the end-of-turn token, no EOS appended, nothing after it
    assert data.response_ids(tok, prompt, " w3") == tok.encode(" w3") + [IM_END]  # a string reply: eos_id too
    conversation = [user("w1"), assistant("w2 w3"), user("w4"), assistant("w5")]
    ids, mask = tok.conversation(conversation)
    targets = [token for token, learned in zip(ids, mask) if learned]
    assert targets == tok.encode("w2 w3") + [IM_END] + tok.encode("w5") + [IM_END]
    assert ids[-1] == IM_END and tok.encode("w4")[0] in ids and not mask[ids.index(tok.encode("w4")[0])]
    examples, _ = data.encode_sft(tok, [{"messages": conversation}], 128, mask_prompt=True)
    encoded, loss_mask = examples[0]
    assert encoded == ids and loss_mask[0] == 0 and sum(loss_mask) == len(targets)


def test_without_a_template_conversations_take_hh_layout(task_dir):
    tok = data.load_tokenizer(build_task(task_dir, 1337)["tokenizer"])
    assert not tok.chat
    prompt = [{"role": "system", "content": "be kind"}, user("how was it?")]
    assert data.prompt_text(tok, prompt) == "\n\nSystem: be kind\n\nHuman: how was it?\n\nAssistant:"
    assert data.response_ids(tok, prompt, [assistant("fine")]) == tok.encode(" fine") + [tok.eos_id]
    ids, mask = tok.conversation([user("hi"), assistant("yes"), user("and?"), assistant("no")])
    assert tok.decode(ids) == "\n\nHuman: hi\n\nAssistant: yes\n\nHuman: and?\n\nAssistant: no"
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == " yes no" and ids[-1] == tok.eos_id and mask[-1] == 1


@pytest.mark.parametrize(
    "kind, record, message",
    [
        ("sft", {"messages": [{"content": "w1"}]}, r"field 'messages' turn 1: missing 'role'"),
        ("sft", {"messages": [{"role": "user"}]}, r"field 'messages' turn 1: missing 'content'"),
        ("sft", {"messages": [user("w1")]}, r"field 'messages': the last turn must be the assistant's"),
        ("sft", {"messages": [{"role": "bot", "content": "x"}]}, r"role 'bot' is not one of system, user, assistant"),
        (
            "pairs",
            {"prompt": [user("a")], "chosen": [user("b")], "rejected": [assistant("c")]},
            r"assistant turns only",
        ),
        ("pairs", {"prompt": [user("a")], "chosen": "b", "rejected": [assistant("c")]}, r"field 'chosen' must be a"),
        ("prompts", {"prompt": []}, r"field 'prompt' must be a non-empty list of messages"),
    ],
)
def test_malformed_messages_are_file_line_errors(tmp_path, kind, record, message):
    good = {
        "sft": {"messages": [user("a"), assistant("b")]},
        "pairs": {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]},
        "prompts": {"prompt": [user("a")]},
    }[kind]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError, match=rf"data\.jsonl:2: .*{message}"):
        data.read_jsonl(str(path), kind)


def test_converters_write_conversational_pairs(tmp_path):
    """python data.py ultrafeedback: UltraFeedback-binarized's chosen/rejected repeat the user turn, which becomes the
    prompt; python data.py hh --messages: HH dialogues as messages."""
    rows = [
        {"prompt": "q", "chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]},
        {"prompt": "q", "chosen": [user("q"), assistant("same")], "rejected": [user("q"), assistant("same")]},
    ]
    src, dst = tmp_path / "uf.jsonl", tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = [sys.executable, os.path.join(ROOT, "data.py"), "ultrafeedback", str(src), str(dst)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote 1 pairs" in r.stdout and "1 skipped" in r.stdout, r.stderr
    assert [json.loads(line) for line in open(dst)] == [
        {"prompt": [user("q")], "chosen": [assistant("good")], "rejected": [assistant("bad")]}
    ]
    hh = tmp_path / "hh.jsonl"
    dialogue = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how?\n\nAssistant:"
    hh.write_text(json.dumps({"chosen": dialogue + " well", "rejected": dialogue + " badly"}) + "\n")
    data.convert(str(hh), str(dst), "hh", messages=True)
    (pair,) = data.read_jsonl(str(dst), "pairs")
    assert pair["prompt"] == [user("hi"), assistant("hello"), user("how?")] and pair["chosen"] == [assistant("well")]


def test_every_stage_on_messages_with_a_chat_template(tmp_path, chat_llama):
    """SFT -> RM -> DPO -> PPO -> eval with conversational data and a tiny Llama whose tokenizer has a chat template:
    responses stop at <|im_end|> (the stop and score token, never followed by an EOS), --reward-fn and the samples
    see the rendered prompt."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    def write(name: str, rows: list) -> str:
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(tmp_path / name)

    sft_rows = [{"messages": [user(words(3)), assistant(words(2)), user(words(2)), assistant(words(2))]}] * 20
    sft_rows += [{"messages": [user(words(3)), assistant(words(3))]} for _ in range(20)]
    pairs = [{"prompt": [user(words(3))], "chosen": [assistant("w1 w2")], "rejected": [assistant(words(3))]}] * 24
    prompts = [{"prompt": [user(words(3))]} for _ in range(16)]
    sft_data, pairs_data, prompts_data = (
        write("sft.jsonl", sft_rows),
        write("pairs.jsonl", pairs),
        write("p.jsonl", prompts),
    )
    out = {stage: str(tmp_path / stage) for stage in ("sft", "rm", "dpo", "ppo")}
    ckpt = {stage: os.path.join(folder, "ckpt.pt") for stage, folder in out.items()}
    small = dict(batch_size=8, micro_batch_size=4, max_steps=2, warmup_steps=1, device="cpu", task_dir=str(tmp_path))
    train_sft.main(
        train_sft.Args(out_dir=out["sft"], init=f"hf:{chat_llama}", data=sft_data, eval_every=2, num_samples=4, **small)
    )
    rm_flags = dict(eval_every=2, eval_pairs=8, calib_size=8)
    train_rm.main(train_rm.Args(out_dir=out["rm"], init=ckpt["sft"], data=pairs_data, **rm_flags, **small))
    dpo_flags = dict(eval_every=2, eval_pairs=8, num_samples=4, eval_samples=4)
    train_dpo.main(train_dpo.Args(out_dir=out["dpo"], init=ckpt["sft"], data=pairs_data, **dpo_flags, **small))
    (tmp_path / "myreward.py").write_text(
        "SEEN = []\ndef length(prompt, response, ended):\n    SEEN.append(prompt)\n    return len(response) / 10\n"
    )
    ppo = train_ppo.Args(
        out_dir=out["ppo"],
        sft_ckpt=ckpt["dpo"],
        ref_ckpt=ckpt["sft"],
        rm_ckpt=[ckpt["rm"]],
        prompts=prompts_data,
        reward_fn=f"{tmp_path}/myreward.py:length",
        max_steps=2,
        rollout_batch_size=8,
        num_minibatches=2,
        micro_batch_size=4,
        max_new_tokens=8,
        critic_warmup_steps=1,
        warmup_steps=1,
        device="cpu",
        task_dir=str(tmp_path),
    )
    train_ppo.main(ppo)
    sample = json.loads(open(os.path.join(out["ppo"], "samples.jsonl")).readline())
    assert sample["prompt"].startswith("<|im_start|>user ") and sample["prompt"].endswith("<|im_start|>assistant ")
    tok = data.Tokenizer.from_state(torch.load(ckpt["ppo"], weights_only=False)["tokenizer"])
    assert tok.chat and tok.eos_id == IM_END
    examples, _ = data.encode_prefs(tok, pairs[:1], 128)
    assert all(seq[-1] == IM_END and seq[-2] != IM_END for seq in examples[0][0])  # scored at the end-of-turn
    res = ev.main(
        ev.Args(
            policy=[ckpt["ppo"]],
            names=["ppo"],
            ref=ckpt["sft"],
            rm=[ckpt["rm"]],
            prompts=prompts_data,
            num_samples=8,
            max_new_tokens=8,
            reward_fn=f"{tmp_path}/myreward.py:length",
            task_dir=str(tmp_path),
        )
    )
    assert res["ppo"]["gold"] is None and res["ppo"]["score"] is not None and res["ppo"]["reward_fn"] is not None
