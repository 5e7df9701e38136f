"""Reward functions with TRL's signature, and their checked, weighted combination.

A reward function is ``fn(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`` as in TRL's
``GRPOTrainer``: one entry per completion; ``completions`` are strings for text prompts and message lists
(``[{"role": "assistant", "content": ...}]``) for chat prompts; ``None`` means "does not apply to this sample" and is
left out of the weighted sum. Completions are expected decoded without special tokens (TRL uses
``skip_special_tokens=True``), so a stop token does not break the strict rewards.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "RewardError",
    "RewardFunctions",
    "arithmetic_answer_reward",
    "completion_text",
    "concise_number_reward",
    "extract_gsm8k_answer",
    "gsm8k_answer_reward",
    "last_number",
    "normalize_number",
    "strict_arithmetic_reward",
    "strict_number_format_reward",
]

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(ValueError):
    """A reward function failed, returned a bad value, or a reward configuration is invalid."""

_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 1,234.5 | 1234 | $5 | -7
_INTEGER = re.compile(r"-?\d+")


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """Text of a completion: the string itself, or the ``content`` of the last message of a chat completion.

    Raises:
        TypeError: neither a string nor a list of message dicts with string ``content``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(f"A completion must be a str or a list of message dicts with str 'content', got {completion!r}.")


def normalize_number(text: str | int | float) -> Decimal | None:
    """Parse a number written as in GSM8K: drops ``,``, ``$`` and spaces; ``"1,000.00"`` == ``"1000"``.

    Returns:
        the value as a ``Decimal`` (so ``"3.50"`` == ``"3.5"`` and ``"72.0"`` == ``"72"``), or ``None`` if unparsable.
    """
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def last_number(text: str) -> Decimal | None:
    """The last number in ``text`` (``-?$?`` then ``1,234`` groups or digits, optional ``.digits``), normalised.

    Commas count only as thousands separators: ``"1,2,3"`` holds the numbers 1, 2 and 3. ``None`` if there is none.
    """
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last ``####`` if the text has one, else its last number (GSM8K answer convention)."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_number(found[0]) if found else None
    return last_number(text)


def _column(kwargs: dict[str, Any], name: str, n: int, fn: str) -> Sequence[Any]:
    if name not in kwargs:
        raise ValueError(f"{fn} needs the dataset column {name!r} (the reference answer), but the batch only has "
                         f"columns {sorted(kwargs)}; add it to the dataset or remove {fn} from the reward functions.")
    col = kwargs[name]
    if isinstance(col, (str, bytes)) or len(col) != n:
        raise ValueError(f"{fn}: column {name!r} must hold one entry per completion ({n}), got {col!r:.200}.")
    return col


def gsm8k_answer_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                        ) -> list[float | None]:
    """1.0 if the completion's final answer equals the reference, else 0.0 (``None`` where the reference is ``None``).

    Reference: column ``answer``; the number after ``####`` (GSM8K format), else the whole value as a number.
    Completion: the number after its last ``####`` if present, else its last number. Both are normalised
    (commas, ``$``, trailing ``.0``) and compared as decimals.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    answers = _column(kwargs, "answer", len(completions), "gsm8k_answer_reward")
    out: list[float | None] = []
    for completion, ref in zip(completions, answers):
        if ref is None:
            out.append(None)
            continue
        target = extract_gsm8k_answer(ref) if isinstance(ref, str) else normalize_number(ref)
        got = extract_gsm8k_answer(completion_text(completion))
        out.append(float(target is not None and got == target))
    return out


def arithmetic_answer_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                             ) -> list[float | None]:
    """Lenient arithmetic match: 1.0 if the last number of the completion equals column ``answer``, else 0.0.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    answers = _column(kwargs, "answer", len(completions), "arithmetic_answer_reward")
    return [
        None if ref is None else float(last_number(completion_text(c)) == normalize_number(ref))
        for c, ref in zip(completions, answers)
    ]


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


def strict_arithmetic_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any,
                             ) -> list[float | None]:
    """Strict accuracy: 1.0 if the stripped completion is exactly the integer in column ``answer``, else 0.0.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    answers = _column(kwargs, "answer", len(completions), "strict_arithmetic_reward")
    out: list[float | None] = []
    for c, ref in zip(completions, answers):
        text = completion_text(c).strip()
        out.append(None if ref is None else float(_INTEGER.fullmatch(text) is not None
                                                  and normalize_number(text) == normalize_number(ref)))
    return out


def _resolve(fn: RewardFn | str) -> RewardFn:
    if callable(fn):
        return fn
    if not isinstance(fn, str):
        raise TypeError(f"A reward function must be a callable or an import path 'module:attr', got {fn!r}.")
    module, sep, attr = fn.partition(":")
    if not sep:
        module, _, attr = fn.rpartition(".")
    if not module or not attr:
        raise RewardError(f"Reward function path {fn!r} must look like 'package.module:function'.")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"Cannot import reward function {fn!r}: {e}. Check the module path and the name.") from e
    if not callable(obj):
        raise TypeError(f"Reward function {fn!r} resolved to a non-callable {type(obj).__name__}.")
    return obj


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardFunctions:
    """A checked, weighted sum of reward functions (TRL ``reward_funcs`` + ``reward_weights``).

    ``total[i] = nansum_k(weight_k * reward_k[i])`` where a ``None`` reward is NaN and left out, as TRL's
    ``GRPOTrainer._calculate_rewards``. TRL warns and gives 0 when *every* function returns ``None`` for a sample;
    here that raises unless ``allow_all_none=True`` (then: TRL's behaviour, 0 with a warning).

    Args:
        funcs: callables, or import paths ``"package.module:function"`` (``"package.module.function"`` also works).
        weights: one float per function; ``None`` means all 1.0.
        allow_all_none: accept samples for which every function returned ``None`` (total 0, with a warning).

    Raises:
        RewardError: (a ``ValueError``) no function, duplicate names, ``len(weights) != len(funcs)``, non-finite
            weight, bad import path.
        TypeError: an entry is neither callable nor a string.
    """

    def __init__(self, funcs: Sequence[RewardFn | str], weights: Sequence[float] | None = None, *,
                 allow_all_none: bool = False) -> None:
        if isinstance(funcs, str) or callable(funcs):
            funcs = [funcs]
        if len(funcs) == 0:
            raise RewardError("reward_funcs is empty; give at least one reward function (callable or 'module:attr').")
        self.funcs: list[RewardFn] = [_resolve(f) for f in funcs]
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

    def __call__(self, prompts: list, completions: list, completion_ids: list | None = None, **columns: Any,
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        """Score ``N`` completions.

        Args:
            prompts: ``N`` prompts (str or message lists), repeated per generation.
            completions: ``N`` completions (str or message lists).
            completion_ids: ``N`` lists of sampled token ids (passed through).
            **columns: dataset columns, each a list of ``N`` entries, passed to every function.

        Returns:
            ``(total, per_function)``: ``total`` ``[N]`` float32 weighted nansum; ``per_function`` maps each
            function name to its ``[N]`` float32 rewards (unweighted) with NaN where it returned ``None``.

        Raises:
            RewardError: (a ``ValueError``) naming the function and the sample index: a function raised (chained; the
                failing sample is found by re-running it one sample at a time), returned the wrong number of values,
                a non-number, NaN or inf; or a sample got ``None`` from every function (unless ``allow_all_none``).
        """
        n = len(completions)
        per_function: dict[str, Tensor] = {}
        for fn, name in zip(self.funcs, self.names):
            try:
                out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as e:
                i = self._failing_sample(fn, n, prompts, completions, completion_ids, columns)
                where = f"on sample {i} (completion {completions[i]!r:.120})" if i is not None else f"on {n} samples"
                raise RewardError(f"Reward function {name!r} raised {type(e).__name__}: {e} {where}. Fix the "
                                  f"function or the dataset columns it needs.") from e
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
        if all_none:
            msg = (f"Every reward function {self.names} returned None for sample indices {all_none}; such samples "
                   f"get total reward 0 (TRL's behaviour).")
            if not self.allow_all_none:
                raise RewardError(msg + " Make at least one function apply to every sample (return 0.0 instead "
                                       "of None), or, in Python, build RewardFunctions(..., allow_all_none=True).")
            warnings.warn(msg, stacklevel=2)
        total = (stacked * self.weights).nansum(dim=1)
        return total, per_function

    @staticmethod
    def _failing_sample(fn: RewardFn, n: int, prompts: list, completions: list, completion_ids: list | None,
                        columns: dict[str, Any]) -> int | None:
        """Re-run ``fn`` one sample at a time to find the first sample it raises on (only after a failure)."""

        def pick(x: Any, i: int) -> Any:
            return [x[i]] if isinstance(x, Sequence) and not isinstance(x, str) and len(x) == n else x

        for i in range(n):
            try:
                fn(prompts=pick(prompts, i), completions=[completions[i]], completion_ids=pick(completion_ids, i),
                   **{k: pick(v, i) for k, v in columns.items()})
            except Exception:
                return i
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
