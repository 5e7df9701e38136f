"""The built-in graded rewards for bare-integer answers: partial credit by digits (:func:`bare_number_digit_reward`)
or by closeness to the answer (:func:`bare_number_closeness_reward`), and the closeness window narrowing over the
steps (:func:`bare_number_closeness_curriculum_reward`, :data:`CLOSENESS_CURRICULUM`) (issue 17,
docs/results/grpo_arithmetic.md)."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from lit_llm.rewards.answers import _score_bare_integers
from lit_llm.rewards.base import TrainerState, requires_columns

__all__ = ["CLOSENESS_CURRICULUM", "bare_number_closeness_curriculum_reward", "bare_number_closeness_reward",
           "bare_number_digit_reward", "closeness_tolerance"]


def _digit_match(x: Decimal, answer: Decimal) -> float:
    """Share of digit positions (from the units up, over the longer of the two numbers) where ``x`` and ``answer``
    agree; 0.0 when their signs differ or either is not an integer."""
    if x != x.to_integral_value() or answer != answer.to_integral_value() or (x < 0) != (answer < 0):
        return 0.0
    a, b = str(abs(int(x))), str(abs(int(answer)))
    width = max(len(a), len(b))
    a, b = a.rjust(width, " "), b.rjust(width, " ")
    return sum(p == q for p, q in zip(a, b)) / width


@requires_columns("answer")
def bare_number_digit_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                             ) -> list[float | None]:
    """Format reward graded by digits: for a completion that is exactly an integer ``x`` (stripped, ``-?\\d+``), the
    share of digit positions, counted from the units up over the longer of ``x`` and the answer ``a`` (column
    ``answer``), where the two agree (a position only one of them has counts as a mismatch); 0.0 if the signs differ
    or the completion is anything else; ``None`` where the answer is missing or not a number.

    ``"82"`` for 82 -> 1.0, ``"12"`` -> 0.5 (units right), ``"80"`` -> 0.5 (tens right), ``"182"`` -> 2/3,
    ``"100"`` for 103 -> 2/3, ``"100"`` for 82 -> 0.0, ``"43 + 39 = 82"`` -> 0.0.

    Why (issue 17, docs/results/grpo_arithmetic.md): :func:`bare_number_closeness_reward` credits a number for being
    *near* the answer, so one constant near the middle of the answers' range (e.g. "100" for every 2-digit sum) earns
    0.7-1.0 on most problems without reading the operands, an optimum GRPO runs settled in. Digits are credited only
    where they agree: a constant earns about a quarter on 2-digit sums (mostly the hundreds digit), while a policy that
    gets the units digit right, ``(a0 + b0) mod 10``, earns a third more on every problem; any bare number still
    beats text (0.0), so the format is learned as with the closeness reward.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    return _score_bare_integers(completions, kwargs, "bare_number_digit_reward", _digit_match)


@requires_columns("answer")
def bare_number_closeness_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                                 ) -> list[float | None]:
    """Format reward graded by closeness: for a completion that is exactly an integer ``x`` (stripped, ``-?\\d+``),
    ``max(0, 1 - |x - a| / max(|a|, 1))`` with ``a`` the integer in column ``answer``; 0.0 for any other completion;
    ``None`` where the answer is missing or not a number.

    ``"82"`` for 82 -> 1.0, ``"80"`` -> 1 - 2/82 = 0.9756, ``"41"`` -> 0.5, ``"192"`` -> 0.0, ``"43 + 39 = 82"`` ->
    0.0. Unlike :func:`strict_number_format_reward` (1.0 for *any* bare integer, which the policy can satisfy with
    wrong numbers: format-only reward hacking), a bare number far from the answer earns nothing, and among bare numbers
    the nearer one ranks higher, so the reward that teaches the format also points toward the right number.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    return _score_bare_integers(completions, kwargs, "bare_number_closeness_reward", _closeness(1.0))


def _closeness(tolerance: float) -> Callable[[Decimal, Decimal], float]:
    """``max(0, 1 - |x - a| / (tolerance * max(|a|, 1)))``."""
    return lambda got, target: max(0.0, 1.0 - float(abs(got - target)) / (tolerance * max(float(abs(target)), 1.0)))


#: ``(start, end, steps)`` of :func:`bare_number_closeness_curriculum_reward`'s tolerance (a fraction of ``|answer|``).
CLOSENESS_CURRICULUM = (1.0, 0.1, 20)


def closeness_tolerance(step: int) -> float:
    """The tolerance of :func:`bare_number_closeness_curriculum_reward` at optimizer step ``step``: linear from
    ``CLOSENESS_CURRICULUM[0]`` at step 0 to ``CLOSENESS_CURRICULUM[1]`` at step ``CLOSENESS_CURRICULUM[2]``, then
    constant (1.0 -> 0.1 over 20 steps: 0.55 at step 10)."""
    start, end, steps = CLOSENESS_CURRICULUM
    return max(end, start - (start - end) * max(int(step), 0) / steps)


@requires_columns("answer")
def bare_number_closeness_curriculum_reward(prompts: list, completions: list, completion_ids: list | None = None,
                                            trainer_state: TrainerState | None = None, **kwargs: Any,
                                            ) -> list[float | None]:
    """:func:`bare_number_closeness_reward` whose window narrows as training goes on: for a bare integer ``x``,
    ``max(0, 1 - |x - a| / (s * max(|a|, 1)))`` with ``s = closeness_tolerance(trainer_state.global_step)`` (1.0 at
    step 0, 0.1 from step 20; ``trainer_state=None`` counts as step 0); 0.0 for any other completion; ``None`` where
    the answer is missing.

    Why: with the wide window (``s = 1``) a constant near the middle of the answers' range (e.g. "105" for every
    2-digit sum) earns 0.7-1.0 on most problems without computing anything, a local optimum a GRPO run can settle in
    (every group zero-std); with only the narrow one (``s = 0.1``) almost no early bare number earns anything, so the
    format is not discovered. Wide first (discovery), narrow before the constant guess sets in
    (docs/results/grpo_arithmetic.md, issue 17).

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    step = getattr(trainer_state, "global_step", 0) if trainer_state is not None else 0
    return _score_bare_integers(completions, kwargs, "bare_number_closeness_curriculum_reward",
                                _closeness(closeness_tolerance(step)))

