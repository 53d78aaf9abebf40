"""The multi-turn task (guess.py): the optimum against every deterministic strategy, the weak player against Monte
Carlo, the environment against the contract, the tokenizer, the episodes' encoding, the tilted optimum against a
direct maximisation over history-dependent policies, and the files."""

import functools
import json
import math
import random
from fractions import Fraction

import pytest
import torch

import guess
from data import episode_ids
from tokenizer import load_tokenizer


def strategies(numbers: int, turns: int):
    """Every deterministic strategy as a tree (guess, tree after "higher", tree after "lower"), any guess in
    1..numbers at every node."""
    if turns == 0:
        yield None
        return
    subtrees = list(strategies(numbers, turns - 1))
    for first in range(1, numbers + 1):
        for if_higher in subtrees:
            for if_lower in subtrees:
                yield first, if_higher, if_lower


def play(tree, secret: int, numbers: int, turns: int) -> tuple[float, int]:
    game = guess.Game({"secret": secret}, numbers, turns)
    while True:
        first, if_higher, if_lower = tree
        observation, reward, done, info = game.step(str(first), True)
        if done:
            return reward, info["guesses"]
        tree = if_higher if observation == guess.HIGHER else if_lower


@pytest.mark.parametrize("numbers,turns", [(4, 3), (7, 2)])
def test_optimum_is_the_best_of_every_deterministic_strategy(numbers, turns):
    best = (Fraction(-1), Fraction(0))
    for tree in strategies(numbers, turns):
        results = [play(tree, secret, numbers, turns) for secret in range(1, numbers + 1)]
        success = Fraction(sum(int(reward) for reward, _ in results), numbers)
        expected_turns = Fraction(sum(taken for _, taken in results), numbers)
        # most success, then fewest turns
        if (success, -expected_turns) > (best[0], -best[1]):
            best = (success, expected_turns)
    assert guess.optimum(numbers, turns) == best


def test_the_games_sizes_pin_one_optimum_and_binary_search_reaches_it():
    assert guess.optimum() == (Fraction(3, 4), Fraction(69, 20))
    midpoint = guess.policy_values(lambda low, high, left: {(low + high) // 2: 1})
    linear = guess.policy_values(lambda low, high, left: {low: 1})
    assert midpoint == guess.optimum()
    assert linear == (Fraction(1, 5), Fraction(37, 10))
    weak_success, weak_turns = guess.policy_values(guess.weak_policy)
    assert float(weak_success) == pytest.approx(0.498640, abs=1e-6)
    assert float(weak_turns) == pytest.approx(3.505477, abs=1e-6)


def test_the_weak_players_values_against_monte_carlo():
    rng = random.Random(0)
    episodes = [guess.weak_episode(rng, rng.randint(1, guess.NUMBERS)) for _ in range(10000)]
    successes = [int(episode["turns"][-1]["text"] == str(episode["secret"])) for episode in episodes]
    taken = [sum(turn["role"] == "assistant" for turn in episode["turns"]) for episode in episodes]
    success, expected_turns = guess.policy_values(guess.weak_policy)
    n = len(episodes)
    mean_success = sum(successes) / n
    mean_turns = sum(taken) / n
    turns_std = math.sqrt(sum((t - mean_turns) ** 2 for t in taken) / (n - 1))
    assert abs(mean_success - float(success)) < 4 * math.sqrt(mean_success * (1 - mean_success) / n)
    assert abs(mean_turns - float(expected_turns)) < 4 * turns_std / math.sqrt(n)


def test_the_game_follows_the_contract():
    game = guess.Game({"prompt": guess.PROMPT, "secret": 13})
    assert game.step("10", True) == ("higher", 0.0, False, {})
    assert game.step("18", True) == ("lower", 0.0, False, {})
    assert game.step("2", True) == ("higher", 0.0, False, {})  # inconsistent: a wasted turn, answered truthfully
    assert game.step("13", True) == (None, 1.0, True, {"success": 1, "guesses": 4, "invalid": 0})
    game = guess.Game({"secret": 1})
    outcomes = [game.step("20", True) for _ in range(guess.TURNS)]
    assert [done for _, _, done, _ in outcomes] == [False] * (guess.TURNS - 1) + [True]
    assert outcomes[-1] == (None, 0.0, True, {"success": 0, "guesses": guess.TURNS, "invalid": 0})
    # a turn that is not a guess in 1..20 with its EOS ends the episode with nothing
    for response, ended in [("13", False), ("013", True), ("0", True), ("21", True), ("1 3", True), ("", False)]:
        game = guess.Game({"secret": 13})
        game.step("5", True)
        assert game.step(response, ended) == (None, 0.0, True, {"success": 0, "guesses": 2, "invalid": 1})
        assert not guess.is_valid(response, ended)
    assert guess.is_valid("20", True) and guess.is_valid("1", True)
    for row in [{}, {"secret": 0}, {"secret": 21}, {"secret": "13"}, {"secret": True}, {"secret": 13.0}]:
        with pytest.raises(ValueError, match="secret must be an integer in 1..20"):
            guess.Game(row)


def test_the_tokenizer_keeps_digits_and_feedback_words_whole():
    tok = guess.task_tokenizer()
    for number in range(1, guess.NUMBERS + 1):
        assert [tok.decode([i]) for i in tok.encode(str(number))] == list(str(number))
    assert len(tok.encode(guess.HIGHER)) == len(tok.encode(guess.LOWER)) == 1
    assert [tok.decode([i]) for i in tok.encode(guess.PROMPT)] == ["guess", " ", "1", "-", "2", "0", ":"]
    assert tok.eos_id not in tok.encode(guess.PROMPT + guess.HIGHER + "19")
    # the longest episode: the prompt, TURNS two-digit guesses with their EOS, an observation between two turns
    longest_turn = max(len(tok.encode(str(number))) + 1 for number in range(1, guess.NUMBERS + 1))
    longest_observation = max(len(tok.encode(word)) for word in (guess.HIGHER, guess.LOWER))
    longest = len(tok.encode(guess.PROMPT)) + guess.TURNS * longest_turn + (guess.TURNS - 1) * longest_observation
    assert longest_turn == guess.MAX_NEW_TOKENS
    assert longest == 22 <= guess.BLOCK_SIZE


def test_an_episode_encodes_as_the_rollout_appends_it():
    tok = guess.task_tokenizer()
    record = {"prompt": guess.PROMPT, "secret": 7, "turns": []}
    record["turns"] = [{"role": "assistant", "text": "13"}, {"role": "env", "text": "lower"}]
    record["turns"].append({"role": "assistant", "text": "7"})
    ids, loss_mask = episode_ids(tok, record)
    one, three, seven = (tok.encode(digit)[0] for digit in "137")
    assert ids[7:] == [one, three, tok.eos_id, tok.encode("lower")[0], seven, tok.eos_id]
    assert loss_mask == [0] * 7 + [1, 1, 1, 0, 1, 1]
    # the weak player's records against a rollout that keeps the model's tokens and appends the env's observations
    rng = random.Random(1)
    for _ in range(50):
        record = guess.weak_episode(rng, rng.randint(1, guess.NUMBERS))
        game = guess.Game(record)
        ids, loss_mask = tok.encode(record["prompt"], bos=True), [0] * len(tok.encode(record["prompt"]))
        for turn in record["turns"][::2]:
            response = tok.encode(turn["text"]) + [tok.eos_id]
            ids, loss_mask = ids + response, loss_mask + [1] * len(response)
            observation, _, done, _ = game.step(tok.decode(response), True)
            if done:
                break
            ids, loss_mask = ids + tok.encode(observation), loss_mask + [0]
        assert episode_ids(tok, record) == (ids, loss_mask)


@functools.cache
def consistent(history: tuple, numbers: int, turns: int) -> tuple[int, ...]:
    """The secrets the history's answers allow, by replaying it through the game: the weak player's guesses."""
    return tuple(secret for secret in range(1, numbers + 1) if history == replay(history, secret, numbers, turns))


def replay(history: tuple, secret: int, numbers: int, turns: int) -> tuple:
    game = guess.Game({"secret": secret}, numbers, turns)
    return tuple((first, game.step(str(first), True)[0]) for first, _ in history)


@functools.cache
def answer(history: tuple, secret: int, first: int, numbers: int, turns: int) -> tuple:
    """(observation, reward, done) of the guess first after history, the game replayed."""
    game = guess.Game({"secret": secret}, numbers, turns)
    for earlier, _ in history:
        game.step(str(earlier), True)
    return game.step(str(first), True)[:3]


def histories(numbers: int, turns: int, history: tuple = ()) -> list[tuple]:
    """Every history a policy on the weak player's support can reach, where it still has to guess."""
    found = [history]
    for first in consistent(history, numbers, turns):
        for secret in consistent(history, numbers, turns):
            observation, _, done = answer(history, secret, first, numbers, turns)
            child = history + ((first, observation),)
            if not done and child not in found:
                found += [h for h in histories(numbers, turns, child) if h not in found]
    return found


def episode_moments(logits: dict, numbers: int, turns: int, history: tuple = (), secret: int = 0):
    """(success, KL to the weak player) of the history-dependent softmax policy logits, over a uniform secret (or
    from history on, the secret given)."""
    if secret == 0:
        pairs = [episode_moments(logits, numbers, turns, (), s) for s in range(1, numbers + 1)]
        return sum(s for s, _ in pairs) / numbers, sum(k for _, k in pairs) / numbers
    support = consistent(history, numbers, turns)
    probs = torch.softmax(logits[history], 0)
    success, kl = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for i, first in enumerate(support):
        kl = kl + probs[i] * torch.log(probs[i] * len(support))
        observation, reward, done = answer(history, secret, first, numbers, turns)
        if done:
            success = success + probs[i] * reward
            continue
        later = episode_moments(logits, numbers, turns, history + ((first, observation),), secret)
        success = success + probs[i] * later[0]
        kl = kl + probs[i] * later[1]
    return success, kl


def tilted_logits(beta: float, numbers: int, turns: int) -> dict:
    """Every history's logits of guess.tilted_policy, at the interval of the secrets the history allows."""
    policy = guess.tilted_policy(beta, numbers=numbers, turns=turns)
    logits = {}
    for history in histories(numbers, turns):
        support = consistent(history, numbers, turns)
        probs = policy(support[0], support[-1], turns - len(history))
        logits[history] = torch.tensor([math.log(probs[first]) for first in support], dtype=torch.float64)
        logits[history].requires_grad_(True)
    return logits


def test_tilted_optimum_against_a_direct_maximisation():
    numbers, turns, beta = 3, 2, 0.3
    logits = {
        history: torch.zeros(len(consistent(history, numbers, turns)), dtype=torch.float64, requires_grad=True)
        for history in histories(numbers, turns)
    }
    # gradient ascent on every history's logits (torch.optim would import torch._dynamo: seconds)
    for _ in range(5000):
        success, kl = episode_moments(logits, numbers, turns)
        grads = torch.autograd.grad(success - beta * kl, list(logits.values()))
        if max(float(grad.abs().max()) for grad in grads) < 1e-10:
            break
        with torch.no_grad():
            for param, grad in zip(logits.values(), grads):
                param += grad / beta
    success, kl = (float(x.detach()) for x in episode_moments(logits, numbers, turns))
    want_success, want_kl = guess.tilted_optimum(beta, numbers=numbers, turns=turns)
    assert success - beta * kl == pytest.approx(want_success - beta * want_kl, abs=1e-9)
    assert (success, kl) == pytest.approx((want_success, want_kl), abs=1e-5)
    # the whole-episode tilt with the secret's own Z would pick feedback the policy cannot: it overstates success
    weak = {history: torch.zeros(len(consistent(history, numbers, turns)), dtype=torch.float64) for history in logits}
    weak_by_secret = [float(episode_moments(weak, numbers, turns, (), secret)[0]) for secret in range(1, numbers + 1)]
    tilt = math.exp(1 / beta)
    naive = sum(p * tilt / (p * tilt + 1 - p) for p in weak_by_secret) / numbers
    assert naive > want_success + 0.01


@pytest.mark.parametrize("numbers,turns,beta", [(5, 3, 0.2), (6, 3, 1.0)])
def test_tilted_policy_is_stationary_among_history_dependent_policies(numbers, turns, beta):
    """The objective is concave in the episodes' distribution: a full-support stationary point is its maximum."""
    logits = tilted_logits(beta, numbers, turns)
    success, kl = episode_moments(logits, numbers, turns)
    grads = torch.autograd.grad(success - beta * kl, list(logits.values()))
    assert max(float(grad.abs().max()) for grad in grads) < 1e-12
    assert (float(success.detach()), float(kl.detach())) == pytest.approx(
        guess.tilted_optimum(beta, numbers=numbers, turns=turns)
    )
    # another beta's tilt is not stationary here, and does worse
    other = tilted_logits(2 * beta, numbers, turns)
    other_success, other_kl = episode_moments(other, numbers, turns)
    grads = torch.autograd.grad(other_success - beta * other_kl, list(other.values()))
    assert max(float(grad.abs().max()) for grad in grads) > 1e-3
    assert float((other_success - beta * other_kl).detach()) < float((success - beta * kl).detach()) - 1e-4


def test_tilted_optimum_spans_the_weak_player_to_the_optimum():
    assert guess.tilted_optimum(1e4) == pytest.approx((0.498640, 0.0), abs=1e-5)  # the weak player's
    success, kl = guess.tilted_optimum(1e-3)
    assert success == pytest.approx(0.75, abs=1e-4) and kl > 2
    curve = [guess.tilted_optimum(beta) for beta in (1.0, 0.3, 0.1, 0.03)]
    assert [s for s, _ in curve] == sorted(s for s, _ in curve) and [k for _, k in curve] == sorted(k for _, k in curve)


def test_task_files_are_fixed_by_the_seed(tmp_path):
    paths = guess.build_task(str(tmp_path / "a"), 1337, tiny=True)
    again = guess.build_task(str(tmp_path / "b"), 1337, tiny=True)
    other = guess.build_task(str(tmp_path / "c"), 7, tiny=True)
    for name in (*guess.TASK_FILES, "tokenizer"):
        assert open(paths[name], "rb").read() == open(again[name], "rb").read(), name
    assert open(paths["sft"], "rb").read() != open(other["sft"], "rb").read()
    assert guess.build_task(str(tmp_path / "a"), 1337, tiny=True) == paths  # cached
    read = {name: [json.loads(line) for line in open(paths[name])] for name in guess.TASK_FILES}
    held = [row["secret"] for row in read["eval_prompts"]]
    assert sorted(held) == sorted(list(range(1, guess.NUMBERS + 1)) * (guess.TINY_SIZES["eval_prompts"] // 20))
    assert [row["secret"] for row in read["prompts"][:50]] != held[:50]  # another stream
    assert all(row["prompt"] == guess.PROMPT for name in guess.TASK_FILES for row in read[name])
    for record in read["sft"]:  # each demonstration replays against the game to its end
        game = guess.Game(record)
        steps = [game.step(turn["text"], True) for turn in record["turns"][::2]]
        assert [step[0] for step in steps[:-1]] == [turn["text"] for turn in record["turns"][1::2]]
        assert steps[-1][2] and not any(step[2] for step in steps[:-1])
    tok = load_tokenizer(paths["tokenizer"])
    assert tok.encode(guess.PROMPT + guess.HIGHER) == guess.task_tokenizer().encode(guess.PROMPT + guess.HIGHER)


@pytest.mark.parametrize("numbers,turns", [(12, 2)])
def test_best_strategy_tokens_against_every_deterministic_strategy(numbers, turns):
    """Guesses of 10 and more take a token more: among the strategies of the most success and fewest turns, the
    fewest expected tokens."""
    best = None
    for tree in strategies(numbers, turns):
        success = expected_turns = tokens = Fraction(0)
        for secret in range(1, numbers + 1):
            node, game = tree, guess.Game({"secret": secret}, numbers, turns)
            while True:
                first, if_higher, if_lower = node
                tokens += Fraction(guess.guess_tokens(first), numbers)
                observation, reward, done, info = game.step(str(first), True)
                if done:
                    success += Fraction(int(reward), numbers)
                    expected_turns += Fraction(info["guesses"], numbers)
                    break
                node = if_higher if observation == guess.HIGHER else if_lower
        candidate = (success, -expected_turns, -tokens)
        best = candidate if best is None else max(best, candidate)
    assert guess.best_strategy(numbers, turns) == (best[0], -best[1], -best[2])
    assert guess.optimum_tokens_per_turn() == Fraction(164, 69)


def test_tilted_at_kl_inverts_the_limits_curve():
    sizes = dict(reference=guess.weak_policy, numbers=7, turns=3)
    for beta in (0.5, 0.05):
        success, kl = guess.tilted_optimum(beta, **sizes)
        found = guess.tilted_at_kl(kl, **sizes)
        assert found["beta"] == pytest.approx(beta, rel=1e-5) and found["success"] == pytest.approx(success, abs=1e-8)
    weak_success, _ = guess.policy_values(guess.weak_policy, 7, 3)
    best_success, _ = guess.optimum(7, 3)
    assert guess.tilted_at_kl(0.0, **sizes)["success"] == pytest.approx(float(weak_success), abs=1e-4)
    assert guess.tilted_at_kl(50.0, **sizes)["success"] == pytest.approx(float(best_success), abs=1e-4)


def test_episode_records_as_sft_data(tmp_path):
    """{"prompt", "turns"} records: read as SFT data (a malformed one is path:line), encoded by episode_ids with the
    loss on the model's tokens only, even where the prompt is not masked (from scratch on the built-in task)."""
    from common import UserError
    from data import encode_sft, read_jsonl

    tok = guess.task_tokenizer()
    record = guess.weak_episode(random.Random(3), 11)
    path = tmp_path / "episodes.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (row,) = read_jsonl(str(path), "sft")
    (example,), skipped = encode_sft(tok, [row], guess.BLOCK_SIZE, mask_prompt=False)
    assert example == episode_ids(tok, record) and skipped == 0
    ids, loss_mask = example
    model_tokens = [token for token, learned in zip(ids, loss_mask) if learned]
    assert model_tokens.count(tok.eos_id) == sum(turn["role"] == "assistant" for turn in record["turns"])
    assert tok.encode(guess.HIGHER)[0] not in model_tokens and tok.encode(guess.LOWER)[0] not in model_tokens
    bad = [
        ({"prompt": "p", "turns": [{"role": "user", "text": "1"}]}, "turn 1: expected"),
        ({"prompt": "p", "turns": [{"role": "assistant", "text": "1"}, {"role": "env", "text": "lower"}]}, "last"),
        ({"prompt": "p", "turns": [], "response": "1"}, "an episode or a response"),
        ({"prompt": "", "turns": [{"role": "assistant", "text": "1"}]}, "non-empty"),
    ]
    for obj, message in bad:
        path.write_text(json.dumps(record) + "\n" + json.dumps(obj) + "\n")
        with pytest.raises(UserError, match=f"episodes.jsonl:2: .*{message}"):
            read_jsonl(str(path), "sft")


def test_the_task_gives_eval_its_environment_and_sizes(tmp_path):
    """eval.py --task guess: the task's environment and turn sizes where not given; a given flag, or --prompts, wins;
    the RM and DPO stages and eval.py --pairs refuse the task (no pairs) in one line."""
    import eval as evaluate
    from common import UserError
    from data import builtin_files

    resolved = evaluate.with_task_env(evaluate.Args(task="guess"))
    assert (resolved.env, resolved.max_turns, resolved.max_new_tokens) == ("guess:Game", 4, 3)
    given = evaluate.Args(task="guess", max_turns=2)
    given.given = frozenset({"max_turns"})
    resolved = evaluate.with_task_env(given)
    assert (resolved.env, resolved.max_turns, resolved.max_new_tokens) == ("guess:Game", 2, 3)
    assert resolved.given == given.given
    assert evaluate.with_task_env(evaluate.Args(task="guess", prompts="mine.jsonl")).env is None
    assert evaluate.with_task_env(evaluate.Args(task="arith")).env is None
    args = evaluate.Args(task="guess", task_dir=str(tmp_path))
    with pytest.raises(UserError, match="--task guess has no pairs file .*: give --data"):
        builtin_files(args, "pairs", "--data")
    assert builtin_files(args, "eval_prompts", "--prompts")["eval_prompts"].endswith("eval_prompts.jsonl")


def test_optimum_columns_beside_a_policys_kl():
    columns = guess.optimum_columns(0.087)
    assert columns["success_optimum"] == 0.75 and columns["turns_optimum"] == 3.45 and columns["invalid_optimum"] == 0
    assert columns["success_weak"] == pytest.approx(0.498640, abs=1e-6)
    assert columns["success_tilted"] == pytest.approx(guess.tilted_optimum(columns["beta_tilted"])[0])
    assert columns["beta_tilted"] == pytest.approx(0.3, rel=0.01)  # design.md §3: beta 0.3 is 0.550 at 0.087 nats
    assert guess.optimum_columns(None)["success_tilted"] is None


@pytest.mark.parametrize("script", ["train_rm.py", "train_dpo.py"])
def test_the_preference_stages_refuse_the_task_in_one_line(script, tmp_path, capsys, monkeypatch):
    from conftest import exits_2_with_one_line

    # the task is refused before the --init is read
    argv = f"--task guess --task-dir {tmp_path} --init {tmp_path / 'sft.pt'} --out-dir {tmp_path / 'o'}".split()
    err = exits_2_with_one_line(script, argv, capsys, monkeypatch)
    assert "--task guess has no pairs file" in err and "give --data" in err
