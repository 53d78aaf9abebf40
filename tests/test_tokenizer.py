"""tokenizer.same_tokenizer, the one comparison of two tokenizers (the RL stages' --ref-ckpt and --rm-ckpt, eval.py's
--policy and --rm, train_rm.py's and train_dpo.py's --init against the task): a copy of a Hugging Face folder is the
same tokenizer, another eos, vocabulary, chat template or encoding is refused by name. Tiny word-level tokenizers,
no network."""

import shutil

import pytest
from conftest import HF_WORDS, TINY_RL, offline, read_scalars

import common
import tokenizer
import train_grpo
from hf import CHATML

PROMPTS = ["w3 w4 w5", [{"role": "user", "content": "w6 w7"}], "w8"]


def write_word_tokenizer(
    path: str, words: list[str], eos: str = "<eos>", template: str | None = CHATML, lowercase: bool = False
) -> None:
    """A word-level tokenizer: <unk>, <eos>, <pad>, ChatML's two special tokens, then the given ordinary words; with
    this template (None: no template); lowercase: text lowercased before the lookup."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chatml = ["<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "<pad>"] + chatml + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if lowercase:
        tk.normalizer = normalizers.Lowercase()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token="<pad>", unk_token="<unk>")
    hf_tok.add_special_tokens({"additional_special_tokens": chatml})
    hf_tok.chat_template = template
    hf_tok.save_pretrained(path)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("chat_tokenizer"))
    write_word_tokenizer(path, HF_WORDS)
    return path


def test_a_copy_of_a_folder_is_the_same_tokenizer(chat_dir, tmp_path):
    """Before: the saved states name two paths, so the copy was refused."""
    shutil.copytree(chat_dir, tmp_path / "copy")
    a, b = tokenizer.load_tokenizer(f"hf:{chat_dir}"), tokenizer.load_tokenizer(f"hf:{tmp_path / 'copy'}")
    assert a.state() != b.state() and a.chat and b.chat
    assert tokenizer.same_tokenizer(a, b, PROMPTS) is None


@pytest.mark.parametrize(
    "variant, message",
    [
        (dict(template=CHATML.replace("\n", " ")), "another chat template"),
        (dict(template=None, eos="<|im_end|>"), "a chat template against none"),
        (dict(words=HF_WORDS + ["w83"]), "vocabulary size 85 against 86"),
        (dict(words=[HF_WORDS[1], HF_WORDS[0]] + HF_WORDS[2:]), "another vocabulary of the same size"),
    ],
)
def test_another_tokenizer_is_refused_by_its_difference(chat_dir, tmp_path, variant, message):
    words = variant.pop("words", HF_WORDS)
    write_word_tokenizer(str(tmp_path / "other"), words, **variant)
    a, b = tokenizer.load_tokenizer(f"hf:{chat_dir}"), tokenizer.load_tokenizer(f"hf:{tmp_path / 'other'}")
    assert tokenizer.same_tokenizer(a, b, PROMPTS) == message


def test_another_eos_is_refused(tmp_path):
    """Without a chat template the tokenizer's own eos ends a response."""
    write_word_tokenizer(str(tmp_path / "a"), HF_WORDS, template=None)
    write_word_tokenizer(str(tmp_path / "b"), HF_WORDS, eos="<unk>", template=None)
    a, b = (tokenizer.load_tokenizer(f"hf:{tmp_path / name}") for name in ("a", "b"))
    assert tokenizer.same_tokenizer(a, b, PROMPTS) == "eos 1 against 0"


def test_a_prompt_that_encodes_otherwise_is_refused(chat_dir, tmp_path):
    """The same vocabulary read another way (text lowercased first): only the prompts with capitals tell them apart,
    here a conversation's, rendered through the template."""
    write_word_tokenizer(str(tmp_path / "other"), HF_WORDS, lowercase=True)
    a, b = tokenizer.load_tokenizer(f"hf:{chat_dir}"), tokenizer.load_tokenizer(f"hf:{tmp_path / 'other'}")
    shouted = [{"role": "user", "content": "W6 W7"}]
    assert tokenizer.same_tokenizer(a, b, PROMPTS) is None
    assert tokenizer.same_tokenizer(a, b, PROMPTS + [shouted]) == "prompt 4 encodes to other ids"


def test_distill_from_a_teacher_in_another_folder(tmp_path, llama_dir, user_data, monkeypatch):
    """--estimator distill with --sft-ckpt hf:DIR and --ref-ckpt hf:COPY (the same tokenizer elsewhere) runs; a
    teacher whose tokenizer has another vocabulary is refused with one line naming both flags and the difference."""
    offline(monkeypatch, tmp_path)
    copy = str(tmp_path / "copy")
    shutil.copytree(llama_dir, copy)
    out = str(tmp_path / "distill")
    flags = TINY_RL | dict(max_new_tokens=6, ppo_epochs=1, max_steps=1, sample_every=1)
    args = train_grpo.Args(
        out_dir=out,
        task_dir=str(tmp_path / "data"),
        device="cpu",
        sft_ckpt=f"hf:{llama_dir}",
        ref_ckpt=f"hf:{copy}",
        rm_ckpt="none",
        estimator="distill",
        prompts=user_data["prompts"],
        **flags,
    )
    train_grpo.main(args)
    assert len(read_scalars(out)["objective/kl"]) == 1
    other = str(tmp_path / "other")
    shutil.copytree(llama_dir, other)
    write_word_tokenizer(other, HF_WORDS + ["w83"], template=None)  # a word and ChatML's two tokens more
    with pytest.raises(common.UserError) as error:
        train_grpo.main(train_grpo.Args(**{**args.__dict__, "out_dir": str(tmp_path / "x"), "ref_ckpt": f"hf:{other}"}))
    message = str(error.value)
    assert message.startswith(f"--ref-ckpt hf:{other}: its tokenizer differs from --sft-ckpt hf:{llama_dir}'s: ")
    assert message.endswith("vocabulary size 86 against 83") and "\n" not in message


def test_a_folder_is_read_once_until_its_files_change(chat_dir, tmp_path):
    """A stage loads the tokenizer of each checkpoint it reads (policy, reference, RM): the folder is read once and
    its transformers tokenizer shared, each Tokenizer keeping its own ids (from_state drops a BOS in its own copy);
    a folder written anew is read anew."""
    shutil.copytree(chat_dir, tmp_path / "tok")
    spec = f"hf:{tmp_path / 'tok'}"
    first, second = tokenizer.load_tokenizer(spec), tokenizer.load_tokenizer(spec)
    assert first is not second and first.backend is second.backend
    no_bos = tokenizer.Tokenizer.from_state({key: value for key, value in first.state().items() if key != "bos_id"})
    assert no_bos.bos_id is None and "bos_id" in first.state()
    write_word_tokenizer(str(tmp_path / "tok"), HF_WORDS + ["w83"])
    rewritten = tokenizer.load_tokenizer(spec)
    assert rewritten.backend is not first.backend and rewritten.vocab_size == first.vocab_size + 1
