"""The built-in tool-call format reward (:func:`tool_call_format_reward`): whether a completion's assistant turns
call a known tool the right way, the tools read from the ``tools`` column or the prompt's ``<tools>`` block."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lit_llm.data.tool_calls import (
    ToolCallParseError,
    calls_from_json,
    parse_tool_calls,
    tool_schemas,
    validate_arguments,
)
from lit_llm.rewards.base import RewardError
from lit_llm.rewards.parsing import _column

__all__ = ["tool_call_format_reward"]

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

