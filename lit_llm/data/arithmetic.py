"""The synthetic arithmetic prompt task of GRPO: ``"What is 47 + 38? Reply with just the number."`` -> ``"85"``.

Seeded, no download, operand range and operators configurable, and train/eval problems **disjoint** (no ``(a, op, b)``
of the evaluation set appears in the training set). Rows have TRL's prompt-dataset shape: ``prompt`` (a chat message
list), ``answer`` (the result as text, read by :func:`lit_llm.rewards.strict_arithmetic_reward` and
:func:`lit_llm.rewards.arithmetic_answer_reward`) and ``sample_id``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_TEMPLATE", "OPERATORS", "arithmetic_prompts", "arithmetic_split"]

#: The question; ``{a}``, ``{op}`` and ``{b}`` are filled in.
DEFAULT_TEMPLATE = "What is {a} {op} {b}? Reply with just the number."
#: Supported operators and their results.
OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check(low: int, high: int, ops: Sequence[str]) -> None:
    if not (isinstance(low, int) and isinstance(high, int)) or low > high:
        raise ValueError(f"arithmetic task: operand range must be integers with low <= high, got low={low!r}, "
                         f"high={high!r}; e.g. low=10, high=99 for 2-digit operands.")
    bad = [o for o in ops if o not in OPERATORS]
    if not ops or bad:
        raise ValueError(f"arithmetic task: unknown operator(s) {bad or ops!r}; choose from {sorted(OPERATORS)}.")


def _row(a: int, op: str, b: int, sample_id: str, template: str, system_prompt: str | None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": template.format(a=a, op=op, b=b)})
    return {"prompt": messages, "answer": str(OPERATORS[op](a, b)), "sample_id": sample_id}


def arithmetic_prompts(num: int, *, seed: int = 0, low: int = 10, high: int = 99, ops: Sequence[str] = ("+",),
                       exclude: set[tuple[int, str, int]] | None = None, template: str = DEFAULT_TEMPLATE,
                       system_prompt: str | None = None, split: str = "train") -> list[dict[str, Any]]:
    """``num`` distinct problems ``a op b`` with ``a, b`` uniform in ``[low, high]`` (deterministic in ``seed``).

    Args:
        num: number of problems (>= 1).
        seed: the problems are a function of ``seed`` (and the other arguments) only.
        low, high: operand range, inclusive.
        ops: operators drawn uniformly, from ``"+"``, ``"-"``, ``"*"``.
        exclude: ``(a, op, b)`` triples never drawn (the other split's problems).
        template: the question, with ``{a}``, ``{op}``, ``{b}`` placeholders.
        system_prompt: optional system message before the question.
        split: name used in the sample ids (``"arithmetic-<split>:<i>"``) and in the RNG seed.

    Returns:
        ``num`` rows ``{"prompt": [messages], "answer": str, "sample_id": str}``.

    Raises:
        ValueError: ``num < 1``, a bad range or operator, or fewer than ``num`` problems available.
    """
    return _draw(num, seed=seed, low=low, high=high, ops=ops, exclude=exclude or set(), template=template,
                 system_prompt=system_prompt, split=split)[0]


def _draw(num: int, *, seed: int, low: int, high: int, ops: Sequence[str], exclude: set[tuple[int, str, int]],
          template: str, system_prompt: str | None, split: str) -> tuple[list[dict[str, Any]], set]:
    _check(low, high, ops)
    space = (high - low + 1) ** 2 * len(ops)
    if num < 1 or num > space - len(exclude):
        raise ValueError(f"arithmetic task: cannot draw {num} distinct {split} problems from {space} (minus "
                         f"{len(exclude)} excluded); lower the count or widen low/high/ops.")
    rng = random.Random(f"lit_llm-arithmetic:{seed}:{split}")
    seen: set[tuple[int, str, int]] = set()
    rows = []
    while len(rows) < num:
        key = (rng.randint(low, high), rng.choice(list(ops)), rng.randint(low, high))
        if key in seen or key in exclude:
            continue
        seen.add(key)
        rows.append(_row(key[0], key[1], key[2], f"arithmetic-{split}:{len(rows)}", template, system_prompt))
    return rows, seen


def arithmetic_split(num_train: int, num_eval: int, *, seed: int = 0, low: int = 10, high: int = 99,
                     ops: Sequence[str] = ("+",), template: str = DEFAULT_TEMPLATE,
                     system_prompt: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint training and evaluation problems: the evaluation set is drawn first, then excluded from training.

    Returns:
        ``(train_rows, eval_rows)`` (see :func:`arithmetic_prompts`).

    Raises:
        ValueError: see :func:`arithmetic_prompts`.
    """
    kw = dict(seed=seed, low=low, high=high, ops=ops, template=template, system_prompt=system_prompt)
    eval_rows, held = _draw(num_eval, split="eval", exclude=set(), **kw)
    return _draw(num_train, split="train", exclude=held, **kw)[0], eval_rows
