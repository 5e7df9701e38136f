"""GuessNumberEnv: higher/lower feedback each turn, the reward at the right guess (with turn decay), the guess
limit, replies without a number, and seeded rows with train/eval disjoint by secret."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rollouts.envs import EnvStep, GuessNumberEnv
from lit_llm.rollouts.envs.calculator import split_of

ROW = {"prompt": [{"role": "user", "content": "Guess!"}], "secret": 37, "max_value": 100}


def play(env, replies, row=ROW):
    history = env.reset(row)
    steps = []
    for reply in replies:
        history.append({"role": "assistant", "content": reply})
        steps.append(env.step(history))
        history += steps[-1].messages
    return steps


def user(text):
    return [{"role": "user", "content": text}]


def test_feedback_then_reward_at_the_right_guess():
    steps = play(GuessNumberEnv(), ["50", "My guess is 25.", "I have no idea", "37"])
    assert steps == [EnvStep(user("Lower. 6 guesses left."), 0.0, False, {"guesses": 1}),
                     EnvStep(user("Higher. 5 guesses left."), 0.0, False, {"guesses": 2}),
                     EnvStep(user("Reply with one whole number between 1 and 100. 4 guesses left."), 0.0, False,
                             {"guesses": 3}),
                     EnvStep([], 1.0, True, {"guesses": 4, "reason": "answer"})]


def test_turn_decay_and_guess_limit():
    assert play(GuessNumberEnv(turn_decay=0.5), ["10", "37"])[-1] == EnvStep([], 0.5, True,
                                                                             {"guesses": 2, "reason": "answer"})
    steps = play(GuessNumberEnv(max_guesses=2), ["36", "38"])
    assert steps == [EnvStep(user("Higher. 1 guess left."), 0.0, False, {"guesses": 1}),
                     EnvStep([], 0.0, True, {"guesses": 2, "reason": "max_guesses"})]
    assert play(GuessNumberEnv(), ["37.5"])[0].messages == user("Reply with one whole number between 1 and 100. "
                                                                "6 guesses left.")
    assert play(GuessNumberEnv(), ["37.0"])[0].reward == 1.0


def test_feedback_counts_the_turns_the_episode_really_has():
    """With max_turns (set by the episode engine) below max_guesses, the game has max_turns guesses and says so."""
    env = GuessNumberEnv(max_guesses=7)
    env.max_turns = 3
    assert env.budget == 3
    assert play(env, ["10", "20", "30"]) == [EnvStep(user("Higher. 2 guesses left."), 0.0, False, {"guesses": 1}),
                                             EnvStep(user("Higher. 1 guess left."), 0.0, False, {"guesses": 2}),
                                             EnvStep([], 0.0, True, {"guesses": 3, "reason": "max_guesses"})]
    env = GuessNumberEnv(max_guesses=2)
    env.max_turns = 5  # more turns than guesses: max_guesses rules
    assert env.budget == 2 and play(env, ["10"])[0].messages == user("Higher. 1 guess left.")


@settings(max_examples=60, deadline=None)
@given(secret=st.integers(1, 100))
def test_binary_search_always_wins_within_seven_guesses(secret):
    env = GuessNumberEnv()
    history = env.reset({**ROW, "secret": secret})
    low, high = 1, 100
    for k in range(1, 8):
        guess = (low + high) // 2
        history.append({"role": "assistant", "content": str(guess)})
        step = env.step(history)
        if step.done:
            assert (guess, step.reward, step.info) == (secret, 1.0, {"guesses": k, "reason": "answer"})
            return
        history += step.messages
        low, high = (guess + 1, high) if step.messages[0]["content"].startswith("Higher") else (low, guess - 1)
    raise AssertionError("binary search did not find the secret in 7 guesses")


def test_rows_seeded_and_disjoint_by_secret():
    rows = GuessNumberEnv.make_rows(40, seed=1)
    assert rows == GuessNumberEnv.make_rows(40, seed=1) and rows != GuessNumberEnv.make_rows(40, seed=2)
    eval_rows = GuessNumberEnv.make_rows(40, seed=1, split="eval")
    train_secrets, eval_secrets = {r["secret"] for r in rows}, {r["secret"] for r in eval_rows}
    assert not train_secrets & eval_secrets
    assert eval_secrets <= {s for s in range(1, 101) if split_of(f"100:{s}") == "eval"}
    assert rows[0]["prompt"] == [{"role": "user", "content": "I am thinking of a whole number between 1 and 100. "
                                  "Guess it! After each guess I will tell you whether the number is higher or lower. "
                                  "Reply with just your guess."}]
    assert [r["sample_id"] for r in rows[:2]] == ["guess_number-train:0", "guess_number-train:1"]
    assert all(r["max_value"] == 100 for r in rows)


@pytest.mark.parametrize(
    ("call", "match"),
    [(lambda: GuessNumberEnv(max_guesses=0), "max_guesses must be an integer >= 1"),
     (lambda: GuessNumberEnv(turn_decay=0), r"turn_decay must be in \(0, 1\]"),
     (lambda: GuessNumberEnv().reset({**ROW, "secret": 101}), r"'secret' must be a whole number in \[1, 100\]"),
     (lambda: GuessNumberEnv().reset({"prompt": "p", "secret": "7"}), "'secret' must be a whole number"),
     (lambda: GuessNumberEnv().step([{"role": "assistant", "content": "1"}]), r"step\(\) before reset"),
     (lambda: GuessNumberEnv.make_rows(1, max_value=1, split="eval"), "no secret of \\[1, 1\\] falls in the 'eval'"),
     (lambda: GuessNumberEnv.make_rows(0), "n must be an integer >= 1")],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
