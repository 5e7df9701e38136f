"""The built-in answer and format rewards: exact answers (:func:`gsm8k_answer_reward`,
:func:`arithmetic_answer_reward`, :func:`strict_arithmetic_reward`) and the answer's format
(:func:`strict_number_format_reward`, :func:`concise_number_reward`). A missing or unparsable reference gives
``None``, a completion without an answer 0.0."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from lit_llm.rewards.base import requires_columns
from lit_llm.rewards.parsing import (
    _INTEGER,
    _NUMBER,
    _column,
    _reference,
    completion_text,
    extract_gsm8k_answer,
    last_number,
    normalize_number,
)

__all__ = ["arithmetic_answer_reward", "concise_number_reward", "gsm8k_answer_reward", "strict_arithmetic_reward",
           "strict_number_format_reward"]


@requires_columns("answer")
def gsm8k_answer_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                        ) -> list[float | None]:
    """1.0 if the completion's final answer equals the reference, else 0.0; ``None`` where the reference is missing
    or not a number (the sample is left out, as TRL's ``accuracy_reward`` leaves out an unparsable gold answer).

    Reference: column ``answer``; the number after ``####`` (GSM8K format), else the whole value as a number.
    Completion: the number after its last ``####`` if present, else its last number (none: 0.0). Both are normalised
    (commas, ``$``, trailing ``.0``) and compared as decimals.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    answers = _column(kwargs, "answer", len(completions), "gsm8k_answer_reward")
    out: list[float | None] = []
    for completion, ref in zip(completions, answers):
        target = _reference(ref, gsm8k=True)
        got = extract_gsm8k_answer(completion_text(completion))
        out.append(None if target is None else float(got is not None and got == target))
    return out


@requires_columns("answer")
def arithmetic_answer_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                             ) -> list[float | None]:
    """Lenient arithmetic match: 1.0 if the last number of the completion equals column ``answer``, else 0.0 (also
    when the completion has no number); ``None`` where the answer is missing or not a number.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    answers = _column(kwargs, "answer", len(completions), "arithmetic_answer_reward")
    out: list[float | None] = []
    for c, ref in zip(completions, answers):
        target, got = _reference(ref), last_number(completion_text(c))
        out.append(None if target is None else float(got is not None and got == target))
    return out


def strict_number_format_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                                ) -> list[float | None]:
    """Format reward: 1.0 if the stripped completion is exactly an integer (``-?\\d+``), else 0.0."""
    return [float(_INTEGER.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def concise_number_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                          ) -> list[float | None]:
    """Graded format reward: the share of the stripped completion's characters taken by its last number.

    ``"85"`` -> 1.0, ``"The answer is 85."`` -> 2/17, ``"60 + 25 = 85"`` -> 2/12, no number -> 0.0. Unlike
    :func:`strict_number_format_reward`, which is 0 for every completion of a model that never answers with the bare
    number (all-zero groups carry no GRPO signal), it ranks shorter answers higher, so the policy is pushed toward
    the bare number from the first step. Pair it with an answer reward: alone it rewards any bare number.
    """
    out: list[float | None] = []
    for c in completions:
        text = completion_text(c).strip()
        matches = list(_NUMBER.finditer(text))
        out.append(len(matches[-1].group(0)) / len(text) if matches else 0.0)
    return out


def _score_bare_integers(completions: list, kwargs: dict[str, Any], name: str,
                         score: Callable[[Decimal, Decimal], float]) -> list[float | None]:
    """``score(x, answer)`` for each completion that is exactly an integer ``x`` (stripped), 0.0 for any other
    completion, ``None`` where column ``answer`` is missing or not a number (``name`` is the reward in errors)."""
    answers = _column(kwargs, "answer", len(completions), name)
    out: list[float | None] = []
    for c, ref in zip(completions, answers):
        text, target = completion_text(c).strip(), _reference(ref)
        if target is None:
            out.append(None)
        else:
            out.append(score(normalize_number(text), target) if _INTEGER.fullmatch(text) else 0.0)
    return out



@requires_columns("answer")
def strict_arithmetic_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                             ) -> list[float | None]:
    """Strict accuracy: 1.0 if the stripped completion is exactly the integer in column ``answer``, else 0.0;
    ``None`` where the answer is missing or not a number.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    return _score_bare_integers(completions, kwargs, "strict_arithmetic_reward",
                                lambda got, target: float(got == target))

