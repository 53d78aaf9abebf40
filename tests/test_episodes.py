"""Multi-turn episodes (generate.run_episodes) against toy environments: batched episodes equal one-at-a-time ones
token for token (greedy, float64), the loss mask covers exactly the sampled tokens and the attention mask the
observations too, observations are encoded once, an observation's text reaches the next model token, rows that
finish early are left alone, truncation at the context, turn rewards on each turn's last model token; the
environment's user errors (common.load_env) and eval.py --env end to end."""

import json
import shutil

import pytest
import torch
from conftest import exits_2_with_one_line

from generate import observation_ids, run_episodes
from model import GPT, GPTConfig, left_pack, logprobs_from_logits, packed_response_logits
from tokenizer import GPT2_PAT, bpe_tokenizer


@pytest.fixture(scope="module")
def tok():
    """A byte-level tokenizer with no merges: 256 byte tokens, EOS 256, pad 257."""
    return bpe_tokenizer("bytes", [bytes([i]) for i in range(256)], GPT2_PAT)


def wide_model(tok, seed: int = 0, block_size: int = 64) -> GPT:
    """A float64 GPT with std-0.3 matrices (no near-ties under greedy) whose EOS wins now and then."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)
    model = GPT(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight[tok.eos_id] = 1.3 * model.lm_head.weight[ord("a")]
    return model


class Countdown:
    """Done after row["turns"] turns with reward 1; before that observes "again" (or row["word"]) at reward 0.1."""

    def __init__(self, row: dict):
        self.left = row["turns"]
        self.word = row.get("word", "again")
        self.steps = 0

    def step(self, response: str, ended: bool):
        self.steps += 1
        self.left -= 1
        if self.left <= 0:
            return None, 1.0, True, {"success": 1.0}
        return self.word, 0.1, False


def prompts(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tok.encode(text) for text in texts]
    width = max(len(row) for row in ids)
    query = torch.tensor([[tok.pad_id] * (width - len(row)) + row for row in ids])
    query_mask = torch.tensor([[0.0] * (width - len(row)) + [1.0] * len(row) for row in ids])
    return query, query_mask


ROWS = [{"turns": 3}, {"turns": 1}, {"turns": 2, "word": "no, try a longer one"}, {"turns": 3, "word": "?"}]
TEXTS = ["guess:", "a much longer prompt here:", "x", "go"]


def after_prompt(episodes, b: int) -> dict:
    """Row b's tensors after its prompt, cut at its last real token."""
    P = episodes.prompt_width
    n = int(episodes.attention_mask[b, P:].sum())
    names = ("sequences", "attention_mask", "mask", "logprobs", "rewards")
    return {name: getattr(episodes, name)[b, P : P + n] for name in names}


def spans(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in a 1-d mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((int(mask[start]), start, i))
            start = i
    return runs


def test_batched_episodes_equal_one_at_a_time(tok):
    """Greedy: each row of a batch whose episodes end at turns 1, 2 and 3 equals its episode run alone; a row that is
    done is not stepped again."""
    model = wide_model(tok)
    query, query_mask = prompts(tok, TEXTS)
    envs = [Countdown(row) for row in ROWS]
    batched = run_episodes(model, tok, query, query_mask, envs, 3, 6, temperature=0.0)
    assert batched.turns.tolist() == [3, 1, 2, 3]
    assert [env.steps for env in envs] == [3, 1, 2, 3]
    for b, row in enumerate(ROWS):
        alone = run_episodes(model, tok, *prompts(tok, [TEXTS[b]]), [Countdown(row)], 3, 6, temperature=0.0)
        got, want = after_prompt(batched, b), after_prompt(alone, 0)
        assert torch.equal(got["sequences"], want["sequences"]) and torch.equal(got["mask"], want["mask"])
        assert torch.equal(got["rewards"], want["rewards"])
        assert torch.allclose(got["logprobs"], want["logprobs"], atol=1e-10, rtol=0)
        assert batched.turn_texts[b] == alone.turn_texts[0] and batched.returns[b] == alone.returns[0]


def test_masks_observations_and_turn_rewards(tok):
    """After the prompt: the model's spans (mask 1) are the turns' tokens, whose text is the turn's text; the spans
    in between (attention 1, mask 0) are the observations encoded once; each turn's reward sits on its last model
    token; nothing past a row's end, nothing in its prompt's columns."""
    model = wide_model(tok)
    query, query_mask = prompts(tok, TEXTS)
    episodes = run_episodes(model, tok, query, query_mask, [Countdown(row) for row in ROWS], 3, 6, temperature=0.0)
    P = episodes.prompt_width
    assert torch.equal(episodes.attention_mask[:, :P], query_mask) and episodes.mask[:, :P].sum() == 0
    for b, row in enumerate(ROWS):
        part = after_prompt(episodes, b)
        runs = spans(part["mask"])
        model_runs = [(start, end) for value, start, end in runs if value == 1]
        observation_runs = [(start, end) for value, start, end in runs if value == 0]
        assert len(model_runs) == row["turns"] and len(observation_runs) == row["turns"] - 1
        for (start, end), text in zip(model_runs, episodes.turn_texts[b]):
            assert tok.decode(part["sequences"][start:end]) == text
            assert part["rewards"][start : end - 1].sum() == 0 and float(part["rewards"][end - 1]) in (0.1, 1.0)
            assert (part["logprobs"][start:end] < 0).all()
        for (start, end), text in zip(observation_runs, episodes.observations[b]):
            assert (
                part["sequences"][start:end].tolist()
                == observation_ids(tok, text)
                == tok.encode(row.get("word", "again"))
            )
            assert part["logprobs"][start:end].abs().sum() == 0 and part["rewards"][start:end].abs().sum() == 0
        assert episodes.returns[b] == pytest.approx(0.1 * (row["turns"] - 1) + 1.0)
        n = P + len(part["mask"])
        assert episodes.attention_mask[b, n:].sum() == 0 and (episodes.sequences[b, n:] == tok.pad_id).all()
    assert episodes.info["success"].tolist() == [1.0] * 4
    assert not episodes.truncated.any()


class ChatML:
    """A chat tokenizer's interface over bytes: ChatML turns, <|im_start|> 1001, <|im_end|> (the end-of-turn) 1000."""

    chat, name, eos_id, start_id = True, "chatml", 1000, 1001

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids = []
        for message in messages:
            ids += [self.start_id, *f"{message['role']}\n{message['content']}".encode(), self.eos_id, *b"\n"]
        return ids + ([self.start_id, *b"assistant\n"] if generation_prompt else [])


def test_a_chat_observation_is_the_next_user_turn_and_the_assistant_header(tok):
    """After the model's end-of-turn: the rest of its turn's rendering, the user turn, the assistant header; a plain
    tokenizer: the observation's text alone."""
    chat = ChatML()
    want = [*b"\n", chat.start_id, *b"user\n3 is too low", chat.eos_id, *b"\n", chat.start_id, *b"assistant\n"]
    assert observation_ids(chat, "3 is too low") == want
    assert observation_ids(tok, "3 is too low") == tok.encode("3 is too low")


def test_sampler_logprobs_match_a_forward_and_observations_reach_the_next_token(tok):
    """Sampled at temperature 1: the sampler's log-probs of the model's tokens are a forward's over the whole
    sequence; another observation text changes the log-prob of the model token after it."""
    model = wide_model(tok)
    query, query_mask = prompts(tok, TEXTS)
    generator = torch.Generator().manual_seed(0)
    envs = [Countdown(row) for row in ROWS]
    episodes = run_episodes(model, tok, query, query_mask, envs, 3, 6, temperature=1.0, generator=generator)
    P = episodes.prompt_width

    def forward_logprobs(sequences: torch.Tensor) -> torch.Tensor:
        ids, packed_mask = left_pack(sequences, episodes.attention_mask)
        logits = packed_response_logits(model, ids, packed_mask, episodes.attention_mask[:, P:], 1.0)
        return logprobs_from_logits(logits, sequences[:, P:])

    mask = episodes.mask[:, P:].double()
    logprobs = forward_logprobs(episodes.sequences)
    # packed_response_logits hands its logits on in fp32: agreement to its rounding
    assert torch.allclose(logprobs * mask, episodes.logprobs[:, P:], atol=1e-5, rtol=0)
    # row 0: its first observation "again" -> "AGAIN", the same length; the first token of turn 2 moves
    _, start, end = [run for run in spans(episodes.mask[0, P:]) if run[0] == 0][0]
    changed = episodes.sequences.clone()
    changed[0, P + start : P + end] = torch.tensor(tok.encode("AGAIN"))
    moved = forward_logprobs(changed)
    assert (moved[0, end] - logprobs[0, end]).abs() > 1e-3
    assert torch.equal(moved[0, :start], logprobs[0, :start])


def test_truncated_when_the_next_observation_and_a_turn_do_not_fit(tok):
    """A long observation every turn: the episode stops before the context overflows, truncated and counted, its
    rewards kept; a row whose prompt fills the context takes no turn."""
    model = wide_model(tok, block_size=48)
    query, query_mask = prompts(tok, ["go", "y" * 48])
    envs = [Countdown({"turns": 99, "word": "w" * 10}), Countdown({"turns": 99})]
    episodes = run_episodes(model, tok, query, query_mask, envs, 10, 8, temperature=0.0)
    part = after_prompt(episodes, 0)
    assert episodes.truncated.tolist() == [True, True] and episodes.turns.tolist()[1] == 0
    # 2 + (turn + 10) * k tokens: a third observation and turn would pass 48
    assert 1 < episodes.turns[0] < 10 and len(part["mask"]) + 2 + 10 + 8 > 48
    assert episodes.returns[0] == pytest.approx(0.1 * int(episodes.turns[0]))
    assert episodes.attention_mask[1].sum() == 48 and episodes.mask[1].sum() == 0


# -----------------------------------------------------------------------------
# the compiled decode over turns (generate's compiled=True, inductor's CPU backend; docs/design.md §7)

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler"
)
LONG_TEXTS = ["a prompt of more than sixteen bytes:", "?", "twenty bytes or so:", "ok"]  # another width bucket


@pytest.fixture(scope="module")
def compiled_rollouts(tok):
    """Two 3-turn rollouts (greedy over TEXTS, then sampled at temperature 1 over LONG_TEXTS), eager and through the
    compiled decode from the same generator state; returns ({compiled: [greedy, sampled]}, dynamo's unique graphs
    after the compiled rollouts)."""
    from torch._dynamo.utils import counters

    model = wide_model(tok)
    rollouts = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        greedy = run_episodes(
            model, tok, *prompts(tok, TEXTS), [Countdown(row) for row in ROWS], 3, 6, temperature=0.0, compiled=compiled
        )
        generator = torch.Generator().manual_seed(3)
        envs = [Countdown(row) for row in ROWS]
        kw = dict(temperature=1.0, generator=generator, compiled=compiled)
        sampled = run_episodes(model, tok, *prompts(tok, LONG_TEXTS), envs, 3, 6, **kw)
        rollouts[compiled] = [greedy, sampled]
    return rollouts, counters["stats"]["unique_graphs"]


@pytest.mark.slow
@needs_compiler
def test_compiled_episodes_compile_the_decode_step_once(compiled_rollouts):
    """Six turns over two rollouts whose live rows shrink (episodes end at turns 1, 2 and 3), whose histories grow and
    whose prompts pad to different widths: the decode step is one graph (one per turn before the caches kept the
    batch's shape and the context's length: 3 in the first rollout)."""
    rollouts, graphs = compiled_rollouts
    for episodes in rollouts[True]:
        assert episodes.turns.tolist() == [3, 1, 2, 3]
    assert rollouts[True][0].prompt_width <= 32 < rollouts[True][1].prompt_width  # prompts in two buckets of 16
    assert graphs == 1


@pytest.mark.slow
@needs_compiler
def test_compiled_episodes_equal_eager_ones(compiled_rollouts):
    """Greedy and sampled from the same generator state: the compiled decode's episodes are the eager decode's token
    for token (masks, rewards, texts), their log-probs to float64 rounding."""
    rollouts, _ = compiled_rollouts
    for eager, compiled in zip(rollouts[False], rollouts[True]):
        for name in ("sequences", "attention_mask", "mask", "rewards", "turns", "ended"):
            assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
        assert torch.allclose(eager.logprobs, compiled.logprobs, atol=1e-10, rtol=0)
        assert eager.turn_texts == compiled.turn_texts and eager.observations == compiled.observations


ENV_FILE = """
class Game:
    def __init__(self, row):
        self.secret, self.turn = row["secret"], 0

    def step(self, response, ended):
        self.turn += 1
        if self.turn == 3 or response == self.secret:
            return None, 1.0, True, {"success": float(response == self.secret), "guesses": self.turn}
        return "again", 0.0, False, {"guesses": self.turn}


class Raises(Game):
    def step(self, response, ended):
        if self.turn == 1:
            raise ValueError("no such move")
        return super().step(response, ended)


class NanReward(Game):
    def step(self, response, ended):
        observation, reward, done, info = super().step(response, ended)
        return observation, float("nan") if self.turn == 2 else reward, done, info


class BadShape(Game):
    def step(self, response, ended):
        return "again", 0.0
"""


@pytest.fixture
def env_files(tmp_path):
    env = tmp_path / "games.py"
    env.write_text(ENV_FILE)
    rows = tmp_path / "games.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"guess {i}:", "secret": str(i)}) + "\n" for i in range(6)))
    return str(env), str(rows)


def eval_argv(sft: str, env: str, rows: str, name: str, *extra) -> list:
    flags = ["--policy", sft, "--ref", sft, "--rm", "none", "--prompts", rows, "--env", f"{env}:{name}"]
    return flags + ["--max-turns", "3", "--max-new-tokens", "6", "--num-samples", "6", "--show", "1", *extra]


@pytest.mark.parametrize(
    "name, extra, says",
    [
        ("Raises", [], "Raises: step at turn 2 raised ValueError (no such move) at /"),
        (
            "NanReward",
            [],
            "NanReward: step at turn 2 returned the reward nan: expected a finite number (a float), on the prompt",
        ),
        ("BadShape", [], "BadShape: step at turn 1 returned ('again', 0.0): expected (observation, reward, done)"),
        ("Game", ["--max-turns", "0"], "--max-turns 0: the model's turns an episode may take, use >= 1"),
        ("Game", ["--reward-fn", "arith:reward"], "--env and --reward-fn"),
        ("Missing", [], "AttributeError"),
    ],
)
def test_env_user_errors_are_one_line(tiny_ckpts, env_files, capsys, monkeypatch, name, extra, says):
    """An environment that raises mid-run (its start-up check passes), a non-finite reward, a step of the wrong shape,
    --max-turns 0, --env with --reward-fn, a name the file lacks: exit 2, one line naming the environment, the turn
    and the prompt."""
    err = exits_2_with_one_line("eval.py", eval_argv(tiny_ckpts[0], *env_files, name, *extra), capsys, monkeypatch)
    assert says in err, err
    if name == "Raises":  # the line of the raise, the prompt and the response
        assert "games.py:16 on the prompt 'guess " in err and "and the response '" in err, err


def test_eval_env_end_to_end(tiny_ckpts, env_files, tmp_path):
    """eval.py --env on a tiny model: the episode columns in the JSON, finite, with standard errors; kl 0 for the
    reference against itself; turns within --max-turns."""
    import tyro

    import eval as eval_script

    out = str(tmp_path / "results.json")
    argv = eval_argv(tiny_ckpts[0], *env_files, "Game", "--json", out, "--seeds", "2", "--names", "sft")
    results = eval_script.main(tyro.cli(eval_script.Args, args=argv))
    with open(out) as f:
        written = json.load(f)["sft"]
    assert written == json.loads(json.dumps(results["sft"]))
    for key in ("return", "success", "turns", "truncated_frac", "kl", "response_len", "perplexity", "episode/guesses"):
        assert written[key] is not None and written[f"{key}_se"] is not None, key
    assert 1 <= written["turns"] <= 3 and written["num_samples"] == 12
    assert abs(written["kl"]) < 1e-4 and written["episode/guesses"] == pytest.approx(written["turns"])
