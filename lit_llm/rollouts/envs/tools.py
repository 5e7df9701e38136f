"""Tools for tool-using episodes: wrapped Python callables with JSON schemas, the ``<tool_call>`` parser, the
system prompt that describes tools to templates without ``tools=``, and :class:`ToolEnv`, the base of tool tasks.

* :class:`Tool` wraps a callable; its schema is ``transformers.utils.get_json_schema(fn)`` (the format chat
  templates take as ``tools=``). Calling it (:meth:`Tool.__call__`) validates the arguments against the schema and
  runs the function in a daemon worker thread with a timeout; it never raises for bad arguments, an exception of the
  function or a timeout: the :class:`ToolResult` carries the error text that becomes the tool message.
* the pure parts live in the data layer (:mod:`lit_llm.data.tool_calls`, where the reward functions read them too)
  and are re-exported here: :func:`parse_tool_calls` (the Hermes / Qwen ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` format, Llama-3.1's, or ``tokenizer.parse_response``), :class:`ToolCall`,
  :class:`ToolCallParseError`, :func:`validate_arguments`, :func:`tool_schemas`.
* :class:`ToolEnv` runs the calls of each assistant turn and ends the episode at the first turn without a call (the
  final answer, scored by the subclass's :meth:`ToolEnv.score`).

The message format follows transformers' chat templates (and TorchRL's ``ChatEnv`` tool transforms): a tool result is
``{"role": "tool", "name": <tool name>, "content": <text>}``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lit_llm.data.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    ToolCallParseError,
    function_schema,
    parse_tool_calls,
    tool_schemas,
    validate_arguments,
)
from lit_llm.rollouts.envs.base import Environment, EnvStep, _last_assistant, call_with_timeout, prompt_messages

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "Tool", "ToolCall", "ToolCallParseError", "ToolEnv", "ToolResult",
           "parse_tool_calls", "prompt_with_tools", "template_supports_tools", "tool_schemas", "tools_system_prompt",
           "validate_arguments"]

@dataclass
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        name: the tool's name (or the name the model asked for, for an unknown tool).
        content: the result as text (``str`` results as is, others JSON-encoded or ``str()``), or the error text.
        error: ``None`` on success, else the kind of failure: ``"timeout"``, ``"exception"``, ``"bad_arguments"``,
            ``"unknown_tool"``, ``"parse_error"`` or ``"too_many_calls"``.
        elapsed: wall-clock seconds spent on the call (up to the timeout for a call that timed out).
    """

    name: str
    content: str
    error: str | None = None
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the call succeeded."""
        return self.error is None

    @property
    def message(self) -> dict[str, str]:
        """The tool message appended to the conversation: ``{"role": "tool", "name": ..., "content": ...}``."""
        return {"role": "tool", "name": self.name, "content": self.content}


def _result_text(value: Any) -> str:
    """A tool's return value as message text: a ``str`` as is, else its JSON encoding, else ``str(value)``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)


class Tool:
    """A Python callable offered to the model as a tool.

    Args:
        fn: the function. Its JSON schema comes from its signature and Google-style docstring
            (``transformers.utils.get_json_schema``): every parameter needs a type hint and an ``Args:`` entry.
        timeout: default seconds a call may run (:meth:`__call__`); ``None``: no limit unless the caller gives one.

    Attributes:
        fn: the wrapped callable.
        schema: ``{"type": "function", "function": {"name", "description", "parameters": {...}}}``, what chat
            templates take as ``tools=[...]``.
        name: ``schema["function"]["name"]`` (the function's ``__name__``).
        timeout: the default timeout in seconds.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: no schema can be built (no docstring, a parameter without a description or a type hint); the
            message says what to add.
    """

    def __init__(self, fn: Callable[..., Any], *, timeout: float | None = None) -> None:
        if isinstance(fn, Tool):
            fn = fn.fn
        if not callable(fn):
            raise TypeError(f"Tool: expected a Python callable, got {type(fn).__name__} {fn!r:.80}.")
        self.schema: dict[str, Any] = function_schema(fn)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"Tool {self.schema['function']['name']!r}: timeout must be > 0 seconds or None, got "
                             f"{timeout!r}.")
        self.fn = fn
        self.name: str = self.schema["function"]["name"]
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (``{"type": "object", "properties": {...}, "required": [...]}``)."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}

    def validate(self, arguments: Any) -> str | None:
        """Check ``arguments`` against the schema (:func:`validate_arguments`).

        Returns:
            ``None`` when they fit, else the error text (naming the argument, the expected type and the tool's
            signature) that becomes the tool message.
        """
        return validate_arguments(self.schema, arguments)

    def __call__(self, arguments: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> ToolResult:
        """Validate ``arguments`` and run the tool in a daemon worker thread.

        A call still running after ``timeout`` seconds is abandoned (its thread is a daemon: it keeps running in the
        background but never blocks the caller nor the interpreter's exit); its result, if any, is dropped.

        Args:
            arguments: keyword arguments (a JSON object; ``None`` = ``{}``).
            timeout: seconds; ``None``: :attr:`timeout` (``None`` there too: wait for the call to finish).

        Returns:
            A :class:`ToolResult`: the result text, or the error (``"bad_arguments"``, ``"exception"`` with the
            exception's type and message, ``"timeout"``). Never raises for the call itself.
        """
        arguments = {} if arguments is None else arguments
        problem = self.validate(arguments)
        if problem is not None:
            return ToolResult(self.name, problem, error="bad_arguments")
        timeout = self.timeout if timeout is None else timeout
        start = time.perf_counter()  # everything a tool raises becomes its error message
        finished, value, e = call_with_timeout(lambda: self.fn(**arguments), timeout, f"lit_llm-tool-{self.name}")
        elapsed = time.perf_counter() - start
        if not finished:
            return ToolResult(self.name, f"Error: {self.name} timed out after {timeout:g} s and was stopped.",
                              error="timeout", elapsed=elapsed)
        if e is not None:
            return ToolResult(self.name, f"Error: {self.name} raised {type(e).__name__}: {e}", error="exception",
                              elapsed=elapsed)
        return ToolResult(self.name, _result_text(value), elapsed=elapsed)


@functools.lru_cache(maxsize=256)
def _tool_of(fn: Callable[..., Any]) -> Tool:
    """One :class:`Tool` per function (environments are built once per episode; a Tool is stateless)."""
    return Tool(fn)


def _as_tool(tool: Tool | Callable[..., Any]) -> Tool:
    return tool if isinstance(tool, Tool) else _tool_of(tool)


def _as_tools(tools: Sequence[Tool | Callable[..., Any]]) -> list[Tool]:
    return [_as_tool(t) for t in tools]


# ---------------------------------------------------------------------- prompts and templates
def tools_system_prompt(tools: Sequence[Tool | Callable[..., Any] | Mapping[str, Any]]) -> str:
    """The system-prompt text describing ``tools`` and the ``<tool_call>`` format (Qwen2.5's wording), for chat
    templates that do not take ``tools=`` (SmolLM2's; see :func:`template_supports_tools`).

    Args:
        tools: :class:`Tool` objects, callables (wrapped with :class:`Tool`) or schema dicts.

    Returns:
        The text: the schemas (one JSON line each) in ``<tools></tools>``, then how to call one.

    Raises:
        ValueError: ``tools`` is empty, or a callable has no schema (see :class:`Tool`).
    """
    schemas = tool_schemas(tools)
    if not schemas:
        raise ValueError("tools_system_prompt: no tools given; an environment without tools needs no tool prompt.")
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>"
            "\n\nFor each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{TOOL_CALL_CLOSE}\n\nEach result comes back in a message from the tool. When you have the final answer, "
            "reply with it and no tool call.")


def prompt_with_tools(messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Tool | Callable[..., Any] | Mapping[str, Any]], *,
                      template_takes_tools: bool, describe: Callable[[list], str] | None = None,
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """How a tool task's conversation meets the chat template: the messages to render and the ``tools=`` argument.

    * ``template_takes_tools`` (Qwen2.5 / Qwen3 / Llama-3.1; see :func:`template_supports_tools`): the messages
      unchanged and the tools' schemas, for the template's ``tools=``;
    * else (SmolLM2): the tools described by a system message (``describe(tools)``, default
      :func:`tools_system_prompt`) and ``None``. A leading system message of ``messages`` comes first, the
      description after it in the same message: ``its content + "\n\n" + description`` (the description alone when
      the content is empty), as Qwen's templates place their ``# Tools`` section.

    The one function behind the first render of an episode (:meth:`~lit_llm.rollouts.episodes.EpisodeRenderer.
    prompt_messages`) and the SFT traces (:meth:`~lit_llm.rollouts.envs.CalculatorEnv.make_sft_rows`), so a
    warmed-up model sees the same prompt in RL.

    Args:
        messages: the conversation (copied; not modified).
        tools: :class:`Tool` objects, callables or schema dicts; empty: ``(messages, None)``.
        template_takes_tools: whether the chat template renders ``tools=``.
        describe: ``fn(list of tools) -> str``, the system text describing them (default :func:`tools_system_prompt`).

    Returns:
        ``(messages, tools_argument)``.

    Raises:
        ValueError: a callable without a schema (see :class:`Tool`).
    """
    out = [dict(m) for m in messages]
    if not tools:
        return out, None
    if template_takes_tools:
        return out, tool_schemas(tools)
    text = (describe or tools_system_prompt)(list(tools))
    if out and out[0].get("role") == "system":
        own = out[0]["content"]
        return [{**out[0], "content": f"{own}\n\n{text}" if own else text}, *out[1:]], None
    return [{"role": "system", "content": text}, *out], None


def template_supports_tools(tokenizer: Any, chat_template: str | None = None, **template_kwargs: Any) -> bool:
    """Whether a chat template renders ``tools=``: a one-user-message conversation rendered (with the generation
    prompt) with and without a dummy tool differs.

    Args:
        tokenizer: a Hugging Face tokenizer (its special tokens reach the template).
        chat_template: Jinja text, a ``.jinja`` path, a named template, or ``None`` for the tokenizer's own (as
            :meth:`lit_llm.data.History.apply_chat_template` resolves it).
        **template_kwargs: other template variables (e.g. ``enable_thinking=False``).

    Raises:
        lit_llm.data.errors.ChatTemplateError: the template cannot be resolved or raises on the probe.
    """
    from lit_llm.data.chat_template import _Renderer, _resolve_template

    def dummy(x: str) -> str:
        """A probe tool.

        Args:
            x: any text.
        """
        return x

    messages = [{"role": "user", "content": "Hi"}]
    renders = []
    for tools in (None, [Tool(dummy).schema]):
        text, name = _resolve_template(tokenizer, chat_template, tools)
        renders.append(_Renderer(tokenizer, text, name, {**template_kwargs, "tools": tools}).render(messages, True))
    return renders[0] != renders[1]


# ---------------------------------------------------------------------- the tool-task base
OnToolError = Literal["continue", "end"]
_REASONS = {"timeout": "tool_timeout", "parse_error": "parse_error"}


class ToolEnv(Environment):
    """Base of tool-using tasks: each assistant turn either calls tools (their results are the next messages) or is
    the final answer (scored by :meth:`score`, which ends the episode).

    Subclasses set :attr:`tools` (:class:`Tool` objects or plain callables, wrapped on first use) and implement
    :meth:`score`, and :meth:`reset` when the initial messages are not just the row's ``prompt`` (the default). The
    row given to :meth:`reset` is kept for :meth:`score` (a subclass's ``reset`` is wrapped to keep it too).

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
        self.tools = _as_tools(self.tools)

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
        """The reward of the final answer ``answer`` (the last assistant turn's text) for dataset row ``row``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(answer, row) -> float.")

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
                was not called (programming errors, never model output).
        """
        text = _last_assistant(messages)
        row = self.row
        tools = self._tools()
        try:
            calls = parse_tool_calls(text, tokenizer=self.tokenizer, tools=tools)
        except ToolCallParseError as e:
            return self._reply([ToolResult("invalid_tool_call", f"Error: {e.reason}", error="parse_error")], 1)
        if not calls:
            return EnvStep([], reward=float(self.score(text, row)), done=True, info={"reason": "answer"})
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

    def _tools(self) -> list[Tool]:
        if not all(isinstance(t, Tool) for t in self.tools):
            self.tools = _as_tools(self.tools)
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
