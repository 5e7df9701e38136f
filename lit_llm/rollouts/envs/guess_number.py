"""Guess the number: a multi-turn game with feedback every turn. The secret is a whole number in ``[1, max_value]``
(from the dataset row); the model replies with a guess each turn (the last number of its reply) and the user answers
``"Higher."`` or ``"Lower."``; the episode ends at the right guess (reward ``turn_decay ** (guesses - 1)``, 1.0 by
default) or after the last guess of its budget (reward 0.0): ``max_guesses``, or the episode's ``max_turns`` when that
is smaller, so the "N guesses left" it tells the model is true.

Rows (:meth:`GuessNumberEnv.make_rows`) are seeded and need no download. Train and eval are disjoint by secret: a
secret ``s`` of range ``max_value`` belongs to the ``"eval"`` split when the SHA-1 of ``"<max_value>:<s>"`` is 0
modulo 10 (:func:`~lit_llm.rollouts.envs.calculator.split_of`), else to ``"train"``; rows of one split may repeat a
secret (the space is small).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from lit_llm.rewards import last_number
from lit_llm.rollouts.envs.base import Environment, EnvStep, _last_assistant, prompt_messages
from lit_llm.rollouts.envs.calculator import split_of

__all__ = ["DEFAULT_TEMPLATE", "GuessNumberEnv"]

DEFAULT_TEMPLATE = ("I am thinking of a whole number between 1 and {max_value}. Guess it! After each guess I will "
                    "tell you whether the number is higher or lower. Reply with just your guess.")
"""The opening user message of a row; ``{max_value}`` is filled in."""


class GuessNumberEnv(Environment):
    """Guess a secret whole number with "Higher." / "Lower." feedback after each guess.

    Args:
        max_guesses: guesses allowed (>= 1); the episode ends with reward 0.0 after the last wrong one.
        turn_decay: reward of a right guess at guess ``k`` (1-based) is ``turn_decay ** (k - 1)``; in ``(0, 1]``.

    Each step reads the guess as the last number of the reply (:func:`lit_llm.rewards.last_number`); a reply with no
    whole number counts as a guess and gets ``"Reply with one whole number between 1 and N."``. The feedback message
    is ``{"role": "user", "content": "Higher. 3 guesses left."}`` (or ``"Lower. ..."``; ``"1 guess left"``).
    ``EnvStep.info``: ``guesses`` (so far) and, at the end, ``reason``: ``"answer"`` (guessed) or ``"max_guesses"``.

    The guesses a game really has are :attr:`budget`: ``max_guesses``, or the episode's ``max_turns`` when that is
    smaller (the episode engine sets :attr:`~lit_llm.rollouts.envs.Environment.max_turns`, one guess per model
    turn), so "N guesses left" never promises a guess the episode will not get; the game ends (``"max_guesses"``)
    after the last one.

    Row columns: ``prompt``, ``secret`` (int), optional ``max_value`` (default 100), ``sample_id``.

    Raises:
        ValueError: a bad option; at :meth:`reset`, a row whose ``secret`` is not a whole number in
            ``[1, max_value]``.
    """

    required_columns = ("secret",)

    def __init__(self, max_guesses: int = 7, turn_decay: float = 1.0) -> None:
        if isinstance(max_guesses, bool) or not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"GuessNumberEnv: max_guesses must be an integer >= 1, got {max_guesses!r}.")
        if isinstance(turn_decay, bool) or not (isinstance(turn_decay, int | float) and 0 < turn_decay <= 1):
            raise ValueError(f"GuessNumberEnv: turn_decay must be in (0, 1], got {turn_decay!r}.")
        self.max_guesses = max_guesses
        self.turn_decay = float(turn_decay)
        self.guesses = 0
        self.secret: int | None = None
        self.max_value = 100

    @property
    def budget(self) -> int:
        """Guesses of this game: ``min(max_guesses, max_turns)`` (``max_guesses`` when ``max_turns`` is ``None``)."""
        return self.max_guesses if self.max_turns is None else min(self.max_guesses, int(self.max_turns))

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Read ``secret`` (and ``max_value``) from the row; return its prompt messages."""
        secret, max_value = row.get("secret"), row.get("max_value", 100)
        if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1:
            raise ValueError(f"GuessNumberEnv: the row's 'max_value' must be an integer >= 1, got {max_value!r}.")
        if isinstance(secret, bool) or not isinstance(secret, int) or not 1 <= secret <= max_value:
            raise ValueError(f"GuessNumberEnv: the row's 'secret' must be a whole number in [1, {max_value}], got "
                             f"{secret!r} (row {row.get('sample_id', '?')}).")
        self.secret, self.max_value, self.guesses = secret, max_value, 0
        return prompt_messages(row)

    def step(self, messages: list[dict[str, Any]]) -> EnvStep:
        """Score the last reply's guess and answer "Higher." / "Lower." (or end the episode).

        Raises:
            ValueError: :meth:`reset` was not called, or the conversation does not end with an assistant message.
        """
        if self.secret is None:
            raise ValueError("GuessNumberEnv: step() before reset(row).")
        number = last_number(_last_assistant(messages))
        guess = int(number) if number is not None and number == number.to_integral_value() else None
        self.guesses += 1
        info: dict[str, Any] = {"guesses": self.guesses}
        if guess == self.secret:
            reward = self.turn_decay ** (self.guesses - 1)
            return EnvStep([], reward=reward, done=True, info={**info, "reason": "answer"})
        left = self.budget - self.guesses
        if left <= 0:
            return EnvStep([], reward=0.0, done=True, info={**info, "reason": "max_guesses"})
        if guess is None:
            text = f"Reply with one whole number between 1 and {self.max_value}."
        else:
            text = "Higher." if guess < self.secret else "Lower."
        text += f" {left} guess{'es' if left > 1 else ''} left."
        return EnvStep([{"role": "user", "content": text}], info=info)

    @staticmethod
    def make_rows(n: int, seed: int = 0, *, split: str = "train", max_value: int = 100,
                  template: str = DEFAULT_TEMPLATE) -> list[dict[str, Any]]:
        """``n`` synthetic games of ``split``, secrets uniform over that split's secrets of ``[1, max_value]``
        (deterministic in ``(seed, split, max_value)``).

        Returns:
            ``n`` rows ``{"prompt": [{"role": "user", "content": ...}], "secret": int, "max_value": int,
            "sample_id": "guess_number-<split>:<i>"}``.

        Raises:
            ValueError: ``n < 1``, an unknown split, a ``max_value`` below 1, or a range with no secret of ``split``.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"GuessNumberEnv.make_rows: n must be an integer >= 1, got {n!r}.")
        if split not in ("train", "eval"):
            raise ValueError(f"GuessNumberEnv.make_rows: split must be 'train' or 'eval', got {split!r}.")
        if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1:
            raise ValueError(f"GuessNumberEnv.make_rows: max_value must be an integer >= 1, got {max_value!r}.")
        pool = [s for s in range(1, max_value + 1) if split_of(f"{max_value}:{s}") == split]
        if not pool:
            raise ValueError(f"GuessNumberEnv.make_rows: no secret of [1, {max_value}] falls in the {split!r} split; "
                             f"use a larger max_value (about 10% of secrets are eval secrets).")
        rng = random.Random(f"lit_llm-guess_number:{seed}:{split}:{max_value}")
        prompt = template.format(max_value=max_value)
        return [{"prompt": [{"role": "user", "content": prompt}], "secret": rng.choice(pool), "max_value": max_value,
                 "sample_id": f"guess_number-{split}:{i}"} for i in range(n)]
