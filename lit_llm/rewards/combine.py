"""The checked, weighted combination of reward functions (:class:`RewardFunctions`: TRL's ``reward_funcs`` +
``reward_weights``): every function called with TRL's keyword arguments and the dataset columns, each value checked,
``None`` left out of the weighted sum; a failure names the function and the sample; a call slower than ``timeout``
is abandoned and scores ``None``."""

from __future__ import annotations

import inspect
import math
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_llm.imports import call_bounded, check_timeout
from lit_llm.rewards.base import RewardError, RewardFn, TrainerState, required_columns
from lit_llm.rewards.specs import resolve_reward

__all__ = ["RewardFunctions"]


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _rejects_keywords(fn: RewardFn, keywords: list[str]) -> bool:
    """Whether ``fn``'s signature cannot take ``keywords`` as keyword arguments (``False`` when it has none to read)."""
    try:
        inspect.signature(fn).bind(**dict.fromkeys(keywords))
    except TypeError:
        return True
    except ValueError:
        return False
    return False


class RewardFunctions:
    """A checked, weighted sum of reward functions (TRL ``reward_funcs`` + ``reward_weights``).

    ``total[i] = nansum_k(weight_k * reward_k[i])`` where a ``None`` reward is NaN and left out, as TRL's
    ``GRPOTrainer._calculate_rewards``. TRL warns and gives 0 when *every* function returns ``None`` for a sample;
    here that raises unless ``allow_all_none=True`` (then: TRL's behaviour, 0 with a warning).

    Args:
        funcs: callables or specs (:func:`resolve_reward`: a built-in name, ``"module:function"``,
            ``"path/to/file.py:function"``).
        weights: one float per function; ``None`` means all 1.0.
        allow_all_none: accept samples for which every function returned ``None`` (total 0, with a warning).
        timeout: seconds one call of one function may take (``None``: no limit). A call still running then is
            abandoned on its daemon thread (Python cannot stop a thread: it **keeps running** and its result is
            dropped); the function's scores for that call's completions are ``None`` (TRL: "does not apply", left
            out of the weighted sum; a sample that is then ``None`` for every function totals 0, TRL's rule, whatever
            ``allow_all_none``), with a ``UserWarning`` naming the function and the first prompt, and the call is
            counted (:meth:`take_timeouts`). A function that *raises* is an error as before (:meth:`__call__`).

    Attributes:
        funcs, names: the resolved functions and their names.
        required_columns: function name -> the dataset columns it needs (:func:`required_columns`), checked against
            a dataset by :meth:`check_columns`.

    Raises:
        RewardError: (a ``ValueError``) no function, duplicate names, ``len(weights) != len(funcs)``, non-finite
            weight, an unknown name or a spec that does not resolve (see :func:`resolve_reward`), a ``timeout`` that
            is not a number > 0 or ``None``.
        TypeError: an entry is neither callable nor a string.
    """

    def __init__(self, funcs: Sequence[RewardFn | str], weights: Sequence[float] | None = None, *,
                 allow_all_none: bool = False, timeout: float | None = None) -> None:
        if isinstance(funcs, str) or callable(funcs):
            funcs = [funcs]
        if len(funcs) == 0:
            raise RewardError("reward_funcs is empty; give at least one reward function (callable or 'module:attr').")
        self.funcs: list[RewardFn] = [resolve_reward(f) for f in funcs]
        self.names: list[str] = [_name(f) for f in self.funcs]
        dupes = sorted({n for n in self.names if self.names.count(n) > 1})
        if dupes:
            raise RewardError(f"reward_funcs has duplicate names {dupes}; each function must appear once (use "
                             f"reward_weights to weight it).")
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise RewardError(f"reward_weights has {len(weights)} entries but there are {len(self.funcs)} reward "
                             f"functions {self.names}; give one weight per function.")
        if not all(isinstance(w, int | float) and math.isfinite(w) for w in weights):
            raise RewardError(f"reward_weights must be finite numbers, got {list(weights)}.")
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.allow_all_none = allow_all_none
        check_timeout("reward_timeout", timeout, RewardError)
        self.timeout = None if timeout is None else float(timeout)
        self._timeouts = dict.fromkeys(self.names, 0)
        self._timeouts_lock = threading.Lock()
        self.required_columns: dict[str, tuple[str, ...]] = {n: required_columns(f)
                                                             for n, f in zip(self.names, self.funcs)}

    def check_columns(self, columns: Iterable[str], *, source: str = "the dataset") -> None:
        """Check that ``columns`` (the dataset columns the functions will receive) hold every required column.

        Raises:
            RewardError: naming each function, the column it needs, and ``source``'s columns.
        """
        have = set(columns)
        missing = [(name, col) for name, cols in self.required_columns.items() for col in cols if col not in have]
        if missing:
            needs = "; ".join(f"reward function {name!r} needs the column {col!r}" for name, col in missing)
            raise RewardError(f"{needs}, but {source} has only the columns {sorted(have)}. Add the column to the "
                              f"dataset, or choose reward functions that read the columns it has.")

    def __call__(self, prompts: list, completions: list, completion_ids: list | None = None,
                 trainer_state: TrainerState | None = None, **columns: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Score ``N`` completions.

        Args:
            prompts: ``N`` prompts (str or message lists), repeated per generation.
            completions: ``N`` completions (str or message lists).
            completion_ids: ``N`` lists of sampled token ids (passed through).
            trainer_state: the training progress (:class:`TrainerState`), passed to every function as TRL does;
                ``None`` (outside training) passes a default ``TrainerState()``.
            **columns: dataset columns, each a list of ``N`` entries, passed to every function.

        Returns:
            ``(total, per_function)``: ``total`` ``[N]`` float32 weighted nansum; ``per_function`` maps each
            function name to its ``[N]`` float32 rewards (unweighted) with NaN where it returned ``None``.

        Raises:
            RewardError: (a ``ValueError``) naming the function and the sample index: a function raised (chained; the
                failing sample is found by re-running it one sample at a time, within ``timeout`` in all), returned
                the wrong number of values, a non-number, NaN or inf; or a sample got ``None`` from every function
                (unless ``allow_all_none`` or a function timed out on it).
        """
        n = len(completions)
        trainer_state = TrainerState() if trainer_state is None else trainer_state
        per_function: dict[str, Tensor] = {}
        timed_out: list[str] = []
        for fn, name in zip(self.funcs, self.names):
            try:
                finished, out = self._call(fn, name, prompts=prompts, completions=completions,
                                           completion_ids=completion_ids, trainer_state=trainer_state, **columns)
            except TypeError as e:
                if not _rejects_keywords(fn, ["prompts", "completions", "completion_ids", "trainer_state", *columns]):
                    raise self._raised(fn, name, e, prompts, completions, completion_ids, trainer_state,
                                       columns) from e
                passed = ["prompts", "completions", "completion_ids", "trainer_state", *columns]
                raise RewardError(f"Reward function {name!r} does not accept the keywords it is called with ({e}): "
                                  f"reward functions are called with {passed} as keyword arguments (TRL's signature "
                                  f"plus the dataset's columns); add **kwargs to its parameters, e.g. "
                                  f"def {getattr(fn, '__name__', 'reward')}(completions, **kwargs).") from e
            except Exception as e:
                raise self._raised(fn, name, e, prompts, completions, completion_ids, trainer_state, columns) from e
            if not finished:
                timed_out.append(name)
                self._count_timeout(name, n, prompts)
                per_function[name] = torch.full((n,), math.nan, dtype=torch.float32)
                continue
            try:
                values = list(out)
            except TypeError:
                values = None
            if values is None or len(values) != n:
                got = f"{len(values)} values" if values is not None else type(out).__name__
                raise RewardError(f"Reward function {name!r} returned {got} for {n} completions; it must return a "
                                 f"list with one float (or None) per completion.")
            per_function[name] = torch.tensor([self._check(v, name, i) for i, v in enumerate(values)],
                                              dtype=torch.float32)
        stacked = torch.stack(list(per_function.values()), dim=1) if n else torch.zeros(0, len(self.funcs))
        all_none = torch.isnan(stacked).all(dim=1).nonzero().flatten().tolist()
        if all_none and not timed_out:  # with a timeout: total 0 (TRL's rule), the timeout already warned
            msg = (f"Every reward function {self.names} returned None for sample indices {all_none}; such samples "
                   f"get total reward 0 (TRL's behaviour).")
            if not self.allow_all_none:
                raise RewardError(msg + " Make at least one function apply to every sample (return 0.0 instead "
                                       "of None), or, in Python, build RewardFunctions(..., allow_all_none=True).")
            warnings.warn(msg, stacklevel=2)
        total = (stacked * self.weights).nansum(dim=1)
        return total, per_function

    def _call(self, fn: RewardFn, name: str, deadline: float | None = None, **kwargs: Any) -> tuple[bool, Any]:
        """``(finished, fn(**kwargs))``: directly without a timeout, else on a daemon thread waited for until the
        timeout (or ``deadline``, a ``time.monotonic()`` value) and abandoned after it (``(False, None)``); what the
        function raised is re-raised here."""
        if self.timeout is None:
            return True, fn(**kwargs)
        wait = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.0)
        return call_bounded(lambda: fn(**kwargs), wait, f"lit_llm-reward-{name}")

    def _count_timeout(self, name: str, n: int, prompts: list) -> None:
        with self._timeouts_lock:
            self._timeouts[name] += 1
        first = f" (prompt 0: {prompts[0]!r:.80})" if len(prompts) else ""
        warnings.warn(f"Reward function {name!r} did not return within reward_timeout={self.timeout:g} s on {n} "
                      f"completions{first}: its scores for them are None (left out of the weighted sum), counted in "
                      f"train/rewards/{name}/timeouts; the call keeps running on an abandoned thread. Make the "
                      f"function faster or raise --model.init_args.reward_timeout (null: no limit).", UserWarning,
                      stacklevel=3)

    def take_timeouts(self) -> dict[str, int]:
        """Each function's calls that timed out since the previous :meth:`take_timeouts` (thread-safe: an
        asynchronous producer may be rewarding meanwhile); the counts restart at 0."""
        with self._timeouts_lock:
            out, self._timeouts = self._timeouts, dict.fromkeys(self.names, 0)
        return out

    def _raised(self, fn: RewardFn, name: str, e: Exception, prompts: list, completions: list,
                completion_ids: list | None, trainer_state: TrainerState, columns: dict[str, list]) -> RewardError:
        """The error for reward function ``fn`` having raised ``e``, naming the first sample that raises alone."""
        n = len(completions)
        i = self._failing_sample(fn, name, n, prompts, completions, completion_ids, trainer_state, columns)
        where = f"on sample {i} (completion {completions[i]!r:.120})" if i is not None else f"on {n} samples"
        return RewardError(f"Reward function {name!r} raised {type(e).__name__}: {e} {where}. Fix the function or the "
                           f"dataset columns it needs.")

    def _failing_sample(self, fn: RewardFn, name: str, n: int, prompts: list, completions: list,
                        completion_ids: list | None, trainer_state: TrainerState,
                        columns: dict[str, Any]) -> int | None:
        """Re-run ``fn`` one sample at a time to find the first sample it raises on (only after a failure; within
        ``timeout`` seconds in all: ``None`` when it runs out, or when no sample raises alone)."""

        def pick(x: Any, i: int) -> Any:
            return [x[i]] if isinstance(x, Sequence) and not isinstance(x, str) and len(x) == n else x

        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for i in range(n):
            try:
                finished, _ = self._call(fn, name, deadline, prompts=pick(prompts, i), completions=[completions[i]],
                                         completion_ids=pick(completion_ids, i), trainer_state=trainer_state,
                                         **{k: pick(v, i) for k, v in columns.items()})
            except Exception:
                return i
            if not finished:
                return None
        return None

    @staticmethod
    def _check(v: Any, name: str, i: int) -> float:
        if v is None:
            return math.nan
        if isinstance(v, Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, str) or not hasattr(v, "__float__"):
            raise RewardError(f"Reward function {name!r} returned {v!r} for sample {i}; rewards must be float or None.")
        f = float(v)
        if not math.isfinite(f):
            raise RewardError(f"Reward function {name!r} returned {f} for sample {i}; rewards must be finite (return "
                             f"None when the function does not apply).")
        return f
