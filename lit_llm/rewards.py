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
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lit_llm.data.tool_calls import (
    ToolCallParseError,
    calls_from_json,
    parse_tool_calls,
    tool_schemas,
    validate_arguments,
)

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


def _reference(ref: Any, *, gsm8k: bool = False) -> Decimal | None:
    """A reference answer as a number (the whole value; with ``gsm8k`` a string's number after ``####``, else its
    last number); ``None`` when missing or not a number."""
    if ref is None or isinstance(ref, bool):
        return None
    return extract_gsm8k_answer(ref) if gsm8k and isinstance(ref, str) else normalize_number(ref)


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


_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.S)


def _schemas_of(value: Any, where: str) -> list[dict[str, Any]]:
    """A ``tools`` column entry (a list of schemas / Tools / callables, or its JSON text) -> tool schemas."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RewardError(f"tool_call_format_reward: {where}: the 'tools' column is a string but not JSON "
                              f"({e.msg}); give a list of tool schemas.") from e
    if isinstance(value, Mapping) or not isinstance(value, Sequence):
        raise RewardError(f"tool_call_format_reward: {where}: the 'tools' column must be a list of tool schemas "
                          f"({{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}), Tools or "
                          f"functions, got {type(value).__name__}.")
    out = []
    for t in value:
        if isinstance(t, Mapping) and isinstance(t.get("function", t), Mapping) and t.get("function", t).get("name"):
            out.append(dict(t))
        elif callable(t) or isinstance(getattr(t, "schema", None), Mapping):  # a function or a Tool
            out += tool_schemas([t])
        else:
            raise RewardError(f"tool_call_format_reward: {where}: {t!r:.100} in the 'tools' column is not a tool "
                              f"schema (a dict with a function name), a Tool or a function.")
    return out


def _prompt_schemas(prompt: Any) -> list[dict[str, Any]] | None:
    """The tool schemas described in a prompt: each JSON object with a ``name`` (or ``function.name``) on its own
    line of a ``<tools>...</tools>`` block of the prompt (text or message contents); ``None`` when there is none."""
    texts = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt or []
                                                      if isinstance(m, Mapping) and isinstance(m.get("content"), str)]
    found = []
    for text in texts:
        for block in _TOOLS_BLOCK.findall(text):
            for line in block.splitlines():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                fn = obj.get("function", obj) if isinstance(obj, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    found.append(obj)
    return found or None


def _turn_calls(message: Any) -> list[tuple[str, Any]]:
    """``(name, arguments)`` of every call of one assistant turn: its text's ``<tool_call>`` blocks
    (``parse_tool_calls``; markup that does not parse gives none) and its structured ``tool_calls``."""
    text = message if isinstance(message, str) else message.get("content")
    calls = []
    if isinstance(text, str):
        try:
            calls += [(c.name, c.arguments) for c in parse_tool_calls(text)]
        except ToolCallParseError:
            pass
    for i, call in enumerate((message.get("tool_calls") if isinstance(message, Mapping) else None) or []):
        try:
            calls += [(c.name, c.arguments) for c in calls_from_json(
                call.get("function", call) if isinstance(call, Mapping) else call, f"tool_calls[{i}]", top=False)]
        except ToolCallParseError:
            pass
    return calls


def tool_call_format_reward(prompts: list, completions: list, completion_ids: list | None = None,
                            tools: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """Tool-call format reward: 1.0 if the completion's assistant turns hold at least one well-formed call of a
    known tool, else 0.0. It rewards calling a tool the right way, not the call's result: a dense first signal for a
    model that never calls tools (SmolLM2-135M: 0 parsable calls in 512 samples, ``benchmarks/README.md``); pair it
    with the task's answer reward.

    A call counts when all hold:

    * it is in an assistant turn: the completion itself when it is a string, else every message of the list whose
      ``role`` is ``"assistant"`` (a multi-turn episode's tool / user messages are never searched);
    * it parses: a ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of the turn's text read by
      :func:`lit_llm.data.tool_calls.parse_tool_calls` (a turn whose markup does not parse gives no call; other turns
      still count), or an entry of the message's structured ``tool_calls``;
    * its name is a known tool and its arguments fit that tool's schema
      (:func:`lit_llm.data.tool_calls.validate_arguments`: required arguments present, no unknown one, JSON
      types right).

    Known tools, per row: the dataset column ``tools`` when the batch has it and the row's entry is not ``None``
    (a list of tool schemas ``{"type": "function", "function": {"name", "parameters"}}``, ``Tool`` objects or
    functions, or that list as JSON text); else the schemas listed one per line in a ``<tools>...</tools>`` block of
    the row's prompt (the system message :func:`lit_llm.rollouts.envs.tools_system_prompt` writes for templates
    without ``tools=``, e.g. SmolLM2's). A row whose ``tools`` entry is an empty list knows no tool (0.0).

    Raises:
        RewardError: a row with no known tools (no ``tools`` column entry and no ``<tools>`` block in its prompt;
            add a ``tools`` column), or a malformed ``tools`` entry.
    """
    n = len(completions)
    column = _column({"tools": tools}, "tools", n, "tool_call_format_reward") if tools is not None else [None] * n
    out: list[float | None] = []
    for i, completion in enumerate(completions):
        where = f"row {i}"
        entry = column[i]
        schemas = _schemas_of(entry, where) if entry is not None else _prompt_schemas(prompts[i] if prompts else None)
        if schemas is None:
            raise RewardError(f"tool_call_format_reward: {where} has no known tools: no 'tools' column entry and no "
                              f"<tools>...</tools> block in its prompt. Fix: add a 'tools' column (a list of tool "
                              f"schemas per row), or describe the tools in the prompt (tools_system_prompt).")
        known = {s.get("function", s)["name"]: s for s in schemas}
        turns = [completion] if isinstance(completion, str) else [
            m for m in completion if isinstance(m, Mapping) and m.get("role", "assistant") == "assistant"]
        ok = any(name in known and validate_arguments(known[name], args) is None
                 for turn in turns for name, args in _turn_calls(turn))
        out.append(float(ok))
    return out


def builtin_rewards() -> dict[str, RewardFn]:
    """The reward functions shipped in this module, by name (what a bare name in ``reward_funcs`` may be)."""
    fns = (arithmetic_answer_reward, bare_number_closeness_curriculum_reward, bare_number_closeness_reward,
           bare_number_digit_reward, concise_number_reward, gsm8k_answer_reward,
           strict_arithmetic_reward, strict_number_format_reward, tool_call_format_reward)
    return {fn.__name__: fn for fn in fns}


def _is_missing(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` says ``module`` itself (or a package above it) is missing, not something it imports."""
    return error.name is not None and (module == error.name or module.startswith(error.name + "."))


def _import_module(module: str, spec: str) -> Any:
    """``module`` imported as is, else from the current directory (put on ``sys.path`` as ``python -m`` does)."""
    for attempt in range(2):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not _is_missing(e, module):
                raise RewardError(f"Importing module {module!r} of reward function {spec!r} failed: {e} (a module "
                                  f"it imports is missing; install it).") from e
            if attempt:
                cwd, where = os.getcwd(), module.replace(".", "/")
                here = sorted(p.stem for p in Path(cwd).glob("*.py"))
                close = difflib.get_close_matches(module, here, n=1, cutoff=0.6)
                fn = spec.rpartition(":")[2]
                hint = f" Did you mean '{close[0]}:{fn}' ({close[0]}.py is there)?" if close else ""
                raise RewardError(
                    f"Reward function {spec!r} (a reward_funcs / eval_reward_funcs entry): no module {module!r}; "
                    f"tried importing it (it is not installed) and the current directory {cwd} (no {where}.py nor "
                    f"package {where}/).{hint} Fix the module name, run from the folder that holds it, or give the "
                    f"file: 'path/to/{module.rpartition('.')[2]}.py:{spec.rpartition(':')[2]}'.") from e
        cwd = os.getcwd()
        if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
            sys.path.append(cwd)  # appended: a file of the folder never shadows an installed module
        importlib.invalidate_caches()  # files written since the interpreter started
    raise AssertionError("unreachable")


def _load_file(path: str, spec: str) -> Any:
    """The module of a Python file (relative to the current directory or absolute), loaded once under a stable name
    (``lit_llm_reward_file_<stem>_<hash of the path>``, kept in ``sys.modules``).

    The file's folder is put on ``sys.path`` before it runs, so it imports the modules beside it (``from helpers
    import CAP`` with ``helpers.py`` in the same folder) as a script does. It is **appended**, and left there: an
    installed module is never shadowed by a file of that folder (``python script.py`` prepends instead), and
    imports the file makes later (inside its functions) still find their modules. Sibling modules are imported
    under their plain names, so two such folders should not hold different modules of the same name."""
    file = Path(path).expanduser()
    file = (file if file.is_absolute() else Path.cwd() / file).resolve()
    if not file.is_file():
        raise RewardError(f"Reward function file {path!r} of {spec!r} not found (looked for {file}; a relative path "
                          f"is taken from the current directory {os.getcwd()}). Fix the path.")
    stem = re.sub(r"\W", "_", file.stem)
    name = f"lit_llm_reward_file_{stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"Reward function file {str(file)!r} of {spec!r} is not a Python module; give a .py file.")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(file.parent)
    if not any(os.path.abspath(p or os.curdir) == folder for p in sys.path):
        sys.path.append(folder)  # appended: a file of the folder never shadows an installed module
        importlib.invalidate_caches()
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        hint = "Fix the file."
        if isinstance(e, ModuleNotFoundError):
            hint = (f"Install the module, or put it beside the file (its folder {folder} is on sys.path, after the "
                    f"installed packages).")
        raise RewardError(f"Running reward function file {str(file)!r} of {spec!r} raised {type(e).__name__}: {e}. "
                          f"{hint}") from e
    return module


def resolve_reward(spec: RewardFn | str) -> RewardFn:
    """The reward function a spec names.

    Args:
        spec: a callable (returned as is); a built-in's name (``"strict_arithmetic_reward"``, see
            :func:`builtin_rewards`); ``"package.module:function"`` (``"package.module.function"`` also works): the
            module imported as is, else from the current directory, which is put on ``sys.path`` (appended) as
            ``python -m`` does, so ``rewards:my_fn`` finds ``./rewards.py`` without ``PYTHONPATH``; or
            ``"path/to/file.py:function"`` (relative to the current directory, or absolute), loaded with
            ``importlib.util.spec_from_file_location`` under a stable module name, its folder appended to
            ``sys.path`` so it imports the modules beside it.

    Raises:
        RewardError: (a ``ValueError``) an unknown name (listing the built-ins), a module or file that cannot be found
            or imported, a missing attribute; each names the spec, what was tried and the fix.
        TypeError: ``spec`` is neither a callable nor a string, or names a non-callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"A reward function must be a callable or a string (a built-in name, 'module:function' or "
                        f"'path/to/file.py:function'), got {spec!r}.")
    builtins = builtin_rewards()
    text = spec.strip()
    if not any(c in text for c in (":", ".", "/", os.sep)):
        if text in builtins:
            return builtins[text]
        close = difflib.get_close_matches(text, list(builtins), n=1, cutoff=0.8)  # "_reward" alone: no match
        raise RewardError(f"Unknown reward function {spec!r} (a reward_funcs / eval_reward_funcs entry): not a "
                          f"built-in" + (f" (did you mean {close[0]!r}?)" if close else "") + ". Built-in reward "
                          f"functions: {sorted(builtins)}. For your own function give 'module:function' (a module "
                          f"importable or in the current directory {os.getcwd()}) or 'path/to/file.py:function'.")
    target, sep, attr = text.rpartition(":")
    if not sep:
        if text.endswith(".py"):
            raise RewardError(f"Reward function {spec!r} names a file but no function; give "
                              f"'{text}:function_name'.")
        target, _, attr = text.rpartition(".")
    if not target or not attr:
        raise RewardError(f"Reward function {spec!r} must look like 'module:function' or 'path/to/file.py:function' "
                          f"(or a built-in name: {sorted(builtins)}).")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _load_file(target, spec) if is_file else _import_module(target, spec)
    if not hasattr(module, attr):
        where = f"file {target!r}" if is_file else f"module {target!r}"
        if module is sys.modules[__name__]:
            listed = f"Built-in reward functions: {sorted(builtins)}."
        else:
            listed = "Its functions: " + str(sorted(n for n, v in vars(module).items() if inspect.isfunction(v)
                                                    and not n.startswith("_") and v.__module__ == module.__name__))
        raise RewardError(f"Cannot import reward function {spec!r}: {where} has no attribute {attr!r}. {listed} "
                          f"Check the name.")
    obj = getattr(module, attr)
    if not callable(obj):
        raise TypeError(f"Reward function {spec!r} resolved to a non-callable {type(obj).__name__}.")
    return obj


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

    Attributes:
        funcs, names: the resolved functions and their names.
        required_columns: function name -> the dataset columns it needs (:func:`required_columns`), checked against
            a dataset by :meth:`check_columns`.

    Raises:
        RewardError: (a ``ValueError``) no function, duplicate names, ``len(weights) != len(funcs)``, non-finite
            weight, an unknown name or a spec that does not resolve (see :func:`resolve_reward`).
        TypeError: an entry is neither callable nor a string.
    """

    def __init__(self, funcs: Sequence[RewardFn | str], weights: Sequence[float] | None = None, *,
                 allow_all_none: bool = False) -> None:
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
                failing sample is found by re-running it one sample at a time), returned the wrong number of values,
                a non-number, NaN or inf; or a sample got ``None`` from every function (unless ``allow_all_none``).
        """
        n = len(completions)
        trainer_state = TrainerState() if trainer_state is None else trainer_state
        per_function: dict[str, Tensor] = {}
        for fn, name in zip(self.funcs, self.names):
            try:
                out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                         trainer_state=trainer_state, **columns)
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

    def _raised(self, fn: RewardFn, name: str, e: Exception, prompts: list, completions: list,
                completion_ids: list | None, trainer_state: TrainerState, columns: dict[str, list]) -> RewardError:
        """The error for reward function ``fn`` having raised ``e``, naming the first sample that raises alone."""
        n = len(completions)
        i = self._failing_sample(fn, n, prompts, completions, completion_ids, trainer_state, columns)
        where = f"on sample {i} (completion {completions[i]!r:.120})" if i is not None else f"on {n} samples"
        return RewardError(f"Reward function {name!r} raised {type(e).__name__}: {e} {where}. Fix the function or the "
                           f"dataset columns it needs.")

    @staticmethod
    def _failing_sample(fn: RewardFn, n: int, prompts: list, completions: list, completion_ids: list | None,
                        trainer_state: TrainerState, columns: dict[str, Any]) -> int | None:
        """Re-run ``fn`` one sample at a time to find the first sample it raises on (only after a failure)."""

        def pick(x: Any, i: int) -> Any:
            return [x[i]] if isinstance(x, Sequence) and not isinstance(x, str) and len(x) == n else x

        for i in range(n):
            try:
                fn(prompts=pick(prompts, i), completions=[completions[i]], completion_ids=pick(completion_ids, i),
                   trainer_state=trainer_state, **{k: pick(v, i) for k, v in columns.items()})
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
