"""Reward functions with TRL's signature, their import paths, and their checked, weighted combination.

A reward function is ``fn(prompts, completions, completion_ids, trainer_state, **dataset_columns) ->
list[float | None]`` as in TRL's ``GRPOTrainer``: one entry per completion; ``completions`` are strings for text
prompts and message lists (``[{"role": "assistant", "content": ...}]``) for chat prompts; ``trainer_state`` is a
:class:`TrainerState` (``global_step``, ``epoch``, ``max_steps``, as TRL's ``trainer_state=self.state``); ``None``
means "does not apply to this sample" and is left out of the weighted sum. Completions are expected decoded without
special tokens (TRL uses ``skip_special_tokens=True``), so a stop token does not break the strict rewards.

The built-ins (:func:`builtin_rewards`) never score a missing or unparsable reference answer, or a completion without
an answer, as correct: a reference that is ``None`` or not a number gives ``None`` (TRL's ``accuracy_reward`` skips
an unparsable gold answer the same way), a completion without a number gives 0.0.

Reward functions are given as callables or as strings (:func:`resolve_reward`): a built-in's name
(``"strict_arithmetic_reward"``), ``"package.module:function"`` (importable as is, or from the current directory as
``python -m`` would import it) or ``"path/to/rewards.py:function"``.

One job per module: :mod:`~lit_llm.rewards.base` (the signature, :class:`TrainerState`, :class:`RewardError`, the
columns a function reads), :mod:`~lit_llm.rewards.parsing` (completion text and numbers),
:mod:`~lit_llm.rewards.answers`, :mod:`~lit_llm.rewards.graded` and :mod:`~lit_llm.rewards.tool_format` (the
built-ins), :mod:`~lit_llm.rewards.specs` (names and import paths -> functions) and :mod:`~lit_llm.rewards.combine`
(:class:`RewardFunctions`). This package re-exports their public names: ``lit_llm.rewards:strict_arithmetic_reward``
is what configs name.
"""

from __future__ import annotations

import sys
import types

from lit_llm.rewards import graded
from lit_llm.rewards.answers import (
    arithmetic_answer_reward,
    concise_number_reward,
    gsm8k_answer_reward,
    strict_arithmetic_reward,
    strict_number_format_reward,
)
from lit_llm.rewards.base import (
    REWARD_ARGUMENTS,
    RewardError,
    TrainerState,
    required_columns,
    requires_columns,
)
from lit_llm.rewards.base import RewardFn as RewardFn
from lit_llm.rewards.combine import RewardFunctions
from lit_llm.rewards.graded import bare_number_closeness_curriculum_reward as bare_number_closeness_curriculum_reward
from lit_llm.rewards.graded import bare_number_closeness_reward as bare_number_closeness_reward
from lit_llm.rewards.graded import bare_number_digit_reward
from lit_llm.rewards.graded import closeness_tolerance as closeness_tolerance
from lit_llm.rewards.parsing import completion_text, extract_gsm8k_answer, last_number, normalize_number
from lit_llm.rewards.specs import builtin_rewards, resolve_reward
from lit_llm.rewards.tool_format import tool_call_format_reward

# `name as name`: public names that were outside __all__ when lit_llm.rewards was one module (still outside it)
__all__ = [
    "REWARD_ARGUMENTS",
    "RewardError",
    "RewardFunctions",
    "TrainerState",
    "arithmetic_answer_reward",
    "bare_number_digit_reward",
    "builtin_rewards",
    "completion_text",
    "concise_number_reward",
    "extract_gsm8k_answer",
    "gsm8k_answer_reward",
    "last_number",
    "normalize_number",
    "required_columns",
    "requires_columns",
    "resolve_reward",
    "strict_arithmetic_reward",
    "strict_number_format_reward",
    "tool_call_format_reward",
]

class _RewardsPackage(types.ModuleType):
    """``lit_llm.rewards.CLOSENESS_CURRICULUM`` reads and sets the constant where
    :func:`~lit_llm.rewards.graded.closeness_tolerance` reads it (:mod:`lit_llm.rewards.graded`), so setting it on
    the package (as when it was one module) still changes the schedule."""

    @property
    def CLOSENESS_CURRICULUM(self) -> tuple[float, float, int]:  # noqa: N802 - the constant's name
        return graded.CLOSENESS_CURRICULUM

    @CLOSENESS_CURRICULUM.setter
    def CLOSENESS_CURRICULUM(self, value: tuple[float, float, int]) -> None:  # noqa: N802
        graded.CLOSENESS_CURRICULUM = value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), "CLOSENESS_CURRICULUM"})


sys.modules[__name__].__class__ = _RewardsPackage
