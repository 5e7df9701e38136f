"""The reward-function signature (TRL's): the keyword arguments every function receives (:data:`REWARD_ARGUMENTS`,
``trainer_state`` a :class:`TrainerState`), the dataset columns it reads (:func:`requires_columns`,
:func:`required_columns`) and :class:`RewardError`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["REWARD_ARGUMENTS", "RewardError", "RewardFn", "TrainerState", "required_columns", "requires_columns"]

RewardFn = Callable[..., Sequence[float | None]]

#: The keyword arguments every reward function receives besides the dataset columns (TRL's ``GRPOTrainer``).
REWARD_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "trainer_state"})


class RewardError(ValueError):
    """A reward function failed, returned a bad value, or a reward configuration is invalid."""


@dataclass(frozen=True)
class TrainerState:
    """The training progress every reward function receives as ``trainer_state`` (the fields of TRL's
    ``trainer_state=self.state``, a ``transformers.TrainerState``, that a reward schedule reads).

    Attributes:
        global_step: the optimizer step the rollouts are for (the trainer's ``global_step`` when they were
            generated; an asynchronous producer generating ahead reports the step it generated at).
        epoch: epochs done, fractional (``current_epoch + batches done in it / batches per epoch``), as
            transformers counts it.
        max_steps: the optimizer steps of the whole run (``trainer.max_steps``, else Lightning's
            ``estimated_stepping_batches``); -1 when unbounded, 0 when unknown (no trainer).
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def requires_columns(*columns: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: declare the dataset columns a reward function reads from its ``**kwargs`` (its
    ``required_columns`` attribute, read by :func:`required_columns`), so a dataset without them fails at setup."""

    def mark(fn: RewardFn) -> RewardFn:
        fn.required_columns = tuple(columns)  # type: ignore[attr-defined]
        return fn

    return mark


def required_columns(fn: RewardFn) -> tuple[str, ...]:
    """The dataset columns ``fn`` needs: its ``required_columns`` attribute (see :func:`requires_columns`), then every
    parameter without a default other than :data:`REWARD_ARGUMENTS` (``*args``/``**kwargs`` excluded), in order."""
    names = list(getattr(fn, "required_columns", ()) or ())
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to read
        params = []
    names += [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in REWARD_ARGUMENTS
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(dict.fromkeys(names))
