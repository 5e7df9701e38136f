"""The base of tool-using tasks: :class:`ToolEnv` runs the calls of each assistant turn (parsed by
:func:`~lit_llm.data.tool_calls.parse_tool_calls`, run by :class:`~lit_llm.rollouts.envs.tools.Tool` with a timeout)
and ends the episode at the first turn without a call (the final answer, scored by the subclass's
:meth:`ToolEnv.score`). Tool errors never raise: they become tool messages (and optional penalties)."""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, Literal

from lit_llm.data.tool_calls import ToolCallParseError, parse_tool_calls
from lit_llm.rollouts.envs.base import Environment, EnvStep, _last_assistant, prompt_messages
from lit_llm.rollouts.envs.tools import Tool, ToolResult, _as_tools, _takes_receiver

__all__ = ["OnToolError", "ToolEnv"]

OnToolError = Literal["continue", "end"]
_REASONS = {"timeout": "tool_timeout", "parse_error": "parse_error"}


class ToolEnv(Environment):
    """Base of tool-using tasks: each assistant turn either calls tools (their results are the next messages) or is
    the final answer (scored by :meth:`score`, which ends the episode).

    Subclasses set :attr:`tools` (:class:`Tool` objects or plain callables, wrapped on first use; a method written
    in the class body and listed there, ``def peek(self, n: int) -> str: ...; tools = [peek]``, is bound to each
    instance, as are ``staticmethod`` / ``classmethod`` objects) and implement :meth:`score`, and :meth:`reset`
    when the initial messages are not just the row's ``prompt`` (the default). The row given to :meth:`reset` is
    kept for :meth:`score` (a subclass's ``reset`` is wrapped to keep it too).

    Args:
        tool_timeout: seconds each call may run before it is abandoned (a timeout is a tool error). The episode
            engine may overwrite the attribute on each fresh instance with its own ``tool_timeout``.
        on_tool_error: ``"continue"``: the error text is the tool message and the episode goes on; ``"end"``: the
            episode ends at the first failing call of a turn (later calls of that turn are not run).
        tool_error_penalty: subtracted from the step's reward once per failing call (``"continue"``) or once
            (``"end"``); ``>= 0``.
        max_calls_per_turn: calls run per turn; the rest are refused with one error message, each refused call
            counted as a call and an error (and penalized as a failing call).

    Attributes:
        tokenizer: ``None``, or a tokenizer whose ``response_template`` :func:`parse_tool_calls` uses (the engine
            may set it).

    ``EnvStep.info`` of a turn with calls: ``tool_calls`` (calls made, refused ones included; an unparseable turn
    counts 1; with ``on_tool_error="end"`` the calls after the first failing one are not run nor counted),
    ``tool_errors``, ``tool_time`` (seconds), ``tool_results`` (the :class:`ToolResult` list) and, when the episode
    ends, ``reason``: ``"answer"`` (a turn without calls), ``"tool_error"``, ``"tool_timeout"`` or ``"parse_error"``.

    Raises:
        ValueError: a bad option (named).
        TypeError: a tool that takes ``self`` first but is not a method of the class (naming the tool and the fix).
    """

    tool_timeout: float = 10.0
    on_tool_error: OnToolError = "continue"
    tool_error_penalty: float = 0.0
    max_calls_per_turn: int = 8
    tokenizer: Any = None

    def __init__(self, *, tool_timeout: float = 10.0, on_tool_error: OnToolError = "continue",
                 tool_error_penalty: float = 0.0, max_calls_per_turn: int = 8) -> None:
        name = type(self).__name__
        if isinstance(tool_timeout, bool) or not (isinstance(tool_timeout, int | float) and tool_timeout > 0):
            raise ValueError(f"{name}: tool_timeout must be > 0 seconds, got {tool_timeout!r}.")
        if on_tool_error not in ("continue", "end"):
            raise ValueError(f"{name}: on_tool_error must be 'continue' or 'end', got {on_tool_error!r}.")
        if isinstance(tool_error_penalty, bool) or not (isinstance(tool_error_penalty, int | float)
                                                        and math.isfinite(tool_error_penalty)
                                                        and tool_error_penalty >= 0):
            raise ValueError(f"{name}: tool_error_penalty must be a finite number >= 0 (it is subtracted), got "
                             f"{tool_error_penalty!r}.")
        if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ValueError(f"{name}: max_calls_per_turn must be an integer >= 1, got {max_calls_per_turn!r}.")
        self.tool_timeout = float(tool_timeout)
        self.on_tool_error = on_tool_error
        self.tool_error_penalty = float(tool_error_penalty)
        self.max_calls_per_turn = max_calls_per_turn
        self._tools()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("reset")
        if own is not None and not getattr(own, "_keeps_row", False):
            @functools.wraps(own)
            def reset(self: ToolEnv, row: Mapping[str, Any]) -> list[dict[str, Any]]:
                self._row = row
                return own(self, row)

            reset._keeps_row = True  # type: ignore[attr-defined]
            cls.reset = reset  # type: ignore[method-assign]

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Keep ``row`` and return its prompt as messages (:func:`~lit_llm.rollouts.envs.base.prompt_messages`)."""
        self._row = row
        return prompt_messages(row)

    reset._keeps_row = True  # type: ignore[attr-defined]

    def score(self, answer: str, row: Mapping[str, Any]) -> float:
        """The reward of the final answer ``answer`` (the text of the first assistant turn without a tool call,
        decoded with ``skip_special_tokens=True``) for dataset row ``row`` (the one :meth:`reset` got). Subclasses
        implement it; it ends the episode (reason ``"answer"``).

        Returns:
            The reward: a finite real number (``int`` / ``float`` / a NumPy scalar), e.g. 1.0 for a correct answer
            and 0.0 otherwise, on every path; :meth:`step` raises ``TypeError`` for anything else (``None``, a
            ``bool``, a string) and ``ValueError`` for NaN / infinity, both naming ``<Class>.score``.

        Raises:
            NotImplementedError: not overridden (the episode engine's setup reports it first:
                :meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score(answer, row) -> float.")

    def _unwritten_method(self) -> str | None:
        """:meth:`score` when neither it nor :meth:`step` is overridden, else the base's check."""
        cls = type(self)
        if cls.step is ToolEnv.step and cls.score is ToolEnv.score:
            return "score(answer, row) -> float"
        return super()._unwritten_method()

    @property
    def row(self) -> Mapping[str, Any]:
        """The dataset row of the episode (the one :meth:`reset` got).

        Raises:
            ValueError: :meth:`reset` was not called.
        """
        try:
            return self._row
        except AttributeError:
            raise ValueError(f"{type(self).__name__}: step() before reset(row); the episode engine calls reset "
                             f"first.") from None

    def step(self, messages: list[dict[str, Any]]) -> EnvStep:
        """Run the tool calls of the last assistant turn, or score it as the final answer when it has none.

        Raises:
            ValueError: ``messages`` does not end with an assistant message with ``str`` content, or :meth:`reset`
                was not called (programming errors, never model output), or :meth:`score` returned a non-finite
                number.
            TypeError: :meth:`score` returned something else than a real number (``None``, a ``bool``, a string;
                named with the value).
        """
        text = _last_assistant(messages)
        row = self.row
        tools = self._tools()
        try:
            calls = parse_tool_calls(text, tokenizer=self.tokenizer, tools=tools)
        except ToolCallParseError as e:
            return self._reply([ToolResult("invalid_tool_call", f"Error: {e.reason}", error="parse_error")], 1)
        if not calls:
            return EnvStep([], reward=self._checked_score(text, row), done=True, info={"reason": "answer"})
        by_name = {t.name: t for t in tools}
        results: list[ToolResult] = []
        for call in calls[:self.max_calls_per_turn]:
            tool = by_name.get(call.name)
            if tool is None:
                result = ToolResult(call.name, f"Error: unknown tool {call.name!r}; the tools are "
                                               f"{sorted(by_name) or 'none'}.", error="unknown_tool")
            else:
                result = tool(call.arguments, timeout=self.tool_timeout)
            results.append(result)
            if not result.ok and self.on_tool_error == "end":
                return self._reply(results, len(results))
        refused = max(len(calls) - self.max_calls_per_turn, 0)
        if refused:
            results.append(ToolResult("too_many_tool_calls", f"Error: {len(calls)} tool calls in one turn; only the "
                                      f"first {self.max_calls_per_turn} were run.", error="too_many_calls"))
        return self._reply(results, len(calls), refused=refused)

    def _checked_score(self, answer: str, row: Mapping[str, Any]) -> float:
        """:meth:`score` as a float, checked: a real number (``int`` / ``float`` / NumPy scalar; not ``bool``, not a
        string), finite."""
        value = self.score(answer, row)
        name = type(self).__name__
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}.score must return a real number (the reward of the final answer), got "
                            f"{type(value).__name__} {value!r:.80} for the answer {answer!r:.80}; return a float "
                            f"(e.g. 1.0 for a correct answer, 0.0 otherwise) on every path.")
        if not math.isfinite(value):
            raise ValueError(f"{name}.score returned {value!r} for the answer {answer!r:.80}; rewards must be finite "
                             f"numbers.")
        return float(value)

    def _tools(self) -> list[Tool]:
        """:attr:`tools` as :class:`Tool` objects bound to this instance (:func:`_instance_tools`), converted once
        (again when :attr:`tools` is reassigned)."""
        if self.__dict__.get("_ready_tools") is not self.tools or self.tools is None:
            self.tools = _instance_tools(self, self.tools)
            self._ready_tools = self.tools
        return list(self.tools)

    def _reply(self, results: list[ToolResult], attempted: int, *, refused: int = 0) -> EnvStep:
        """``refused`` calls (past ``max_calls_per_turn``, one message in ``results``) count as that many calls in
        ``attempted`` and as that many errors, so ``0 <= tool_errors <= tool_calls``."""
        failed = [r for r in results if not r.ok]
        errors = len(failed) - (1 if refused else 0) + refused
        info: dict[str, Any] = {"tool_calls": attempted, "tool_errors": errors,
                                "tool_time": sum(r.elapsed for r in results), "tool_results": results}
        if failed and self.on_tool_error == "end":
            info["reason"] = _REASONS.get(failed[0].error or "", "tool_error")
            return EnvStep([], reward=0.0 - self.tool_error_penalty, done=True, info=info)
        return EnvStep([r.message for r in results], reward=0.0 - self.tool_error_penalty * errors, info=info)


def _instance_tools(env: ToolEnv, tools: Any) -> list[Tool]:
    """``tools`` as :class:`Tool` objects for ``env``: a function written as a method in the class body (first
    parameter ``self``, listed as ``tools = [peek]``) is bound to ``env``, keeping a Tool's schema and timeout; a
    ``classmethod`` object is bound to ``type(env)``.

    Raises:
        TypeError: ``tools`` is not a list, or a function takes ``self`` first but is not a method of ``env``'s class
            (naming the tool and the fix).
    """
    name = type(env).__name__
    if tools is None or isinstance(tools, str | bytes | Mapping) or not hasattr(tools, "__iter__"):
        raise TypeError(f"{name}.tools must be a list of tools (functions or Tool objects), got {tools!r:.80}.")
    out = []
    for tool in tools:
        fn = tool.fn if isinstance(tool, Tool) else tool
        if isinstance(fn, classmethod):
            bound = fn.__get__(None, type(env))
        elif _takes_receiver(fn):
            if not any(vars(k).get(fn.__name__) is fn for k in type(env).__mro__):
                raise TypeError(
                    f"{name}: tool {fn.__name__!r} ({fn.__qualname__}) takes `self` first but is not a method of "
                    f"{name}, so it cannot be bound to the environment. List the bound method in __init__ "
                    f"(`self.tools = [self.{fn.__name__}]` after super().__init__()), or make it a @staticmethod "
                    f"without `self`.")
            bound = fn.__get__(env, type(env))
        else:
            out.append(tool)
            continue
        if isinstance(tool, Tool):
            tool = copy.copy(tool)
            tool.fn = bound
        else:
            tool = bound
        out.append(tool)
    return _as_tools(out)
