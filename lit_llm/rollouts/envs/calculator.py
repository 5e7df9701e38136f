"""The calculator tool task: multi-digit arithmetic (``347 * 5812``, ``4821 + 1377 - 2954``) that a small model gets
wrong by itself but right by calling ``calculator(expression)``; the final answer (the first turn without a tool
call) is scored exactly, 1.0 or 0.0, from its last number.

The calculator evaluates with Python's own arithmetic on a checked syntax tree (``ast``; never ``eval`` of the text):
numbers, ``+ - * / // % **``, unary ``+``/``-`` and parentheses only, with limits on the length of the expression and
on powers (no exponent above :data:`MAX_EXPONENT`, no result above :data:`MAX_DIGITS` digits).

Rows (:meth:`CalculatorEnv.make_rows`) are seeded and need no download. Train and eval problems are disjoint by
construction: a problem belongs to the ``"eval"`` split when the SHA-1 of its expression is 0 modulo 10 (about 10% of
all problems), else to ``"train"``, whatever the seeds and counts.
"""

from __future__ import annotations

import ast
import hashlib
import math
import operator
import random
import re
from collections.abc import Mapping
from typing import Any

from lit_llm.rewards import last_number, normalize_number
from lit_llm.rollouts.envs.base import prompt_messages
from lit_llm.rollouts.envs.tool_env import ToolEnv
from lit_llm.rollouts.envs.tools import ToolCall, prompt_with_tools

__all__ = ["ANSWER_TEMPLATE", "DEFAULT_TEMPLATE", "MAX_DIGITS", "MAX_EXPONENT", "MAX_EXPRESSION_CHARS", "CalculatorEnv",
           "calculator", "evaluate_expression", "format_number", "split_of"]

MAX_EXPRESSION_CHARS = 200
"""Longest expression the calculator accepts (characters, after normalisation)."""
MAX_EXPONENT = 100
"""Largest ``|exponent|`` of ``**``."""
MAX_DIGITS = 200
"""Largest number of digits of any intermediate integer result (and ``1e200`` for floats)."""

DEFAULT_TEMPLATE = "What is {expression}? Use the calculator tool, then give the final answer as a number."
"""The question of a row; ``{expression}`` is filled in."""
ANSWER_TEMPLATE = "The answer is {answer}."
"""The final answer of a synthetic tool trace (:meth:`CalculatorEnv.make_sft_rows`); ``{answer}`` is filled in."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def _normalise(expression: str) -> str:
    """Calculator spellings to Python's: ``×``/``x`` between numbers -> ``*``, ``÷`` -> ``/``, ``^`` -> ``**``,
    the minus sign ``−`` -> ``-``, thousands commas dropped (``1,234`` -> ``1234``), a trailing ``=`` dropped."""
    text = expression.strip().rstrip("=").strip()
    text = text.replace("×", "*").replace("·", "*").replace("÷", "/").replace("−", "-").replace("^", "**")
    text = re.sub(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])", " * ", text)
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value != 0 and len(str(abs(value))) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits.")
    if isinstance(value, float) and (not math.isfinite(value) or abs(value) > 10.0 ** MAX_DIGITS):
        raise ValueError("the result is too large.")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents above {MAX_EXPONENT} are not supported.")
            if abs(left) > 1 and abs(right) * math.log10(abs(left)) > MAX_DIGITS:
                raise ValueError(f"the result has more than {MAX_DIGITS} digits.")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero.") from None
        except OverflowError:
            raise ValueError("the result is too large.") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number.")
        return _check_size(value)
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    elif isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    raise ValueError(f"{what} is not supported; use numbers, + - * / // % ** and parentheses.")


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression, as Python computes it (``int`` for integer arithmetic, ``float`` once
    ``/`` or a float is involved).

    Args:
        expression: numbers, ``+ - * / // % **``, unary signs and parentheses (calculator spellings ``×``, ``x``,
            ``÷``, ``^``, ``1,234`` and a trailing ``=`` are accepted; see :data:`MAX_EXPRESSION_CHARS`).

    Raises:
        ValueError: anything else (names, calls, strings...), a syntax error, division by zero, a result or exponent
            over the limits; the message says what is wrong.
        TypeError: ``expression`` is not a str.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a str, got {type(expression).__name__}.")
    text = _normalise(expression)
    if not text:
        raise ValueError("the expression is empty.")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters.")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression; use numbers, + - * / // % ** and "
                         f"parentheses, e.g. '347 * 5812'.") from None
    return _eval(tree)


def format_number(value: int | float) -> str:
    """A result as text: integers (and integral floats below 1e16) without a decimal point, other floats with 12
    significant digits (``2/3`` -> ``"0.666666666667"``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its exact result.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "347 * 5812" or "(4821 + 1377) - 2954". Use numbers,
            + - * / // % ** and parentheses.
    """
    return format_number(evaluate_expression(expression))


def split_of(key: str) -> str:
    """``"eval"`` when the SHA-1 of ``key`` is 0 modulo 10 (about 10% of keys), else ``"train"``: a fixed partition
    of all problems, so the splits are disjoint whatever the seeds."""
    return "eval" if int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10 == 0 else "train"


def _problem(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{rng.randint(100, 999)} * {rng.randint(100, 9999)}"
    a, b, c = (rng.randint(1000, 9999) for _ in range(3))
    return f"{a} + {b} - {c}"


class CalculatorEnv(ToolEnv):
    """Multi-digit arithmetic with a ``calculator(expression)`` tool (:func:`calculator`).

    Each turn with ``<tool_call>`` blocks gets the calculator's results as tool messages; the first turn without a
    call is the final answer: reward 1.0 when its last number (:func:`lit_llm.rewards.last_number`, so
    ``"2,016,764"`` and ``"2016764.0"`` count) equals the row's ``answer``, else 0.0. Tool errors follow
    :class:`~lit_llm.rollouts.envs.tool_env.ToolEnv`'s options (keyword arguments of the constructor).

    Row columns: ``prompt`` (messages), ``answer`` (the exact result as text), ``expression`` and ``sample_id``
    (:meth:`make_rows`).
    """

    tools = [calculator]
    required_columns = ("answer",)

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The row's prompt messages."""
        return prompt_messages(row)

    def score(self, answer: str, row: Mapping[str, Any]) -> float:
        """1.0 if the last number of ``answer`` equals ``row["answer"]`` exactly, else 0.0.

        Raises:
            ValueError: ``row["answer"]`` is missing or not a number (a dataset error).
        """
        target = normalize_number(row["answer"]) if row.get("answer") is not None else None
        if target is None:
            raise ValueError(f"CalculatorEnv: the row's 'answer' must be a number, got {row.get('answer')!r} (row "
                             f"{row.get('sample_id', '?')}).")
        got = last_number(answer)
        return float(got is not None and got == target)

    @staticmethod
    def make_rows(n: int, seed: int = 0, *, split: str = "train",
                  template: str = DEFAULT_TEMPLATE) -> list[dict[str, Any]]:
        """``n`` distinct synthetic problems of ``split``: half ``a * b`` (``a`` 3 digits, ``b`` 3-4 digits), half
        ``a + b - c`` (4 digits each), deterministic in ``(seed, split)``; train and eval never share a problem
        (:func:`split_of`).

        Returns:
            ``n`` rows ``{"prompt": [{"role": "user", "content": ...}], "answer": str, "expression": str,
            "sample_id": "calculator-<split>:<i>"}``.

        Raises:
            ValueError: ``n < 1`` or an unknown ``split`` (``"train"`` or ``"eval"``).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"CalculatorEnv.make_rows: n must be an integer >= 1, got {n!r}.")
        if split not in ("train", "eval"):
            raise ValueError(f"CalculatorEnv.make_rows: split must be 'train' or 'eval', got {split!r}.")
        rng = random.Random(f"lit_llm-calculator:{seed}:{split}")
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        while len(rows) < n:
            expression = _problem(rng)
            if expression in seen or split_of(expression) != split:
                continue
            seen.add(expression)
            rows.append({"prompt": [{"role": "user", "content": template.format(expression=expression)}],
                         "answer": calculator(expression), "expression": expression,
                         "sample_id": f"calculator-{split}:{len(rows)}"})
        return rows

    @staticmethod
    def make_sft_rows(n: int, seed: int = 0, *, split: str = "train", tools_in_system: bool = True,
                      system_prompt: str | None = None, template: str = DEFAULT_TEMPLATE,
                      answer_template: str = ANSWER_TEMPLATE) -> list[dict[str, Any]]:
        """``n`` synthetic tool traces for an SFT warm-up: the problems of :meth:`make_rows` (same ``n``, ``seed``,
        ``split``: same questions, answers and ids, so train and eval stay disjoint), each with the episode the task
        rewards. Messages, in order:

        1. only with ``tools_in_system``: a system message describing the tool
           (:func:`~lit_llm.rollouts.envs.tools_system_prompt`) after a ``system_prompt`` in the same message, as
           :func:`~lit_llm.rollouts.envs.prompt_with_tools` merges them for an episode's first render too; without
           it, ``system_prompt`` alone if
           given (the caller passes the tool's schema to the template's ``tools=``);
        2. the user question (``template``);
        3. the assistant's call, ``ToolCall("calculator", {"expression": <the problem>}).to_text()``: exactly the
           markup :func:`~lit_llm.rollouts.envs.parse_tool_calls` reads (and Qwen-style templates render for a
           structured call);
        4. the tool result ``{"role": "tool", "name": "calculator", "content": calculator(expression)}``: the message
           :class:`~lit_llm.rollouts.envs.ToolEnv` appends for that call;
        5. the final answer ``answer_template.format(answer=...)`` (no call, so it ends the episode), scored 1.0.

        Train with an assistant-masked loss (``loss: rlhf``): turns 3 and 5 are trained, the prompt and the tool
        result are not (DESIGN.md property 3).

        Args:
            n, seed, split: as :meth:`make_rows`.
            tools_in_system: describe the tool in a system message: for chat templates that do not take ``tools=``
                (SmolLM2's; :func:`~lit_llm.rollouts.envs.template_supports_tools`). ``False`` for those that do.
            system_prompt: an extra system message text (``None``: none).
            template: the question template (``{expression}``).
            answer_template: the final answer (``{answer}``); its last number must be the answer.

        Returns:
            ``n`` rows ``{"messages": [...], "answer": str, "expression": str, "sample_id":
            "calculator-<split>:<i>"}`` (the chat format of :class:`~lit_llm.lightning.SFTDataModule`).

        Raises:
            ValueError: as :meth:`make_rows`; an ``answer_template`` whose last number is not the answer.
        """
        rows = []
        for row in CalculatorEnv.make_rows(n, seed, split=split, template=template):
            expression, answer = row["expression"], row["answer"]
            prompt = row["prompt"] if not system_prompt else [{"role": "system", "content": system_prompt},
                                                              *row["prompt"]]
            prompt, _ = prompt_with_tools(prompt, CalculatorEnv.tools, template_takes_tools=not tools_in_system)
            final = answer_template.format(answer=answer)
            if last_number(final) != normalize_number(answer):
                raise ValueError(f"CalculatorEnv.make_sft_rows: answer_template {answer_template!r} gives {final!r}, "
                                 f"whose last number is not the answer {answer}; end it with {{answer}}.")
            messages = [*prompt,
                        {"role": "assistant", "content": ToolCall("calculator", {"expression": expression}).to_text()},
                        {"role": "tool", "name": "calculator", "content": calculator(expression)},
                        {"role": "assistant", "content": final}]
            rows.append({"messages": messages, "answer": answer, "expression": expression,
                         "sample_id": row["sample_id"]})
        return rows
