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
* :class:`~lit_llm.rollouts.envs.tool_env.ToolEnv` (its own module) runs the calls of each assistant turn and ends
  the episode at the first turn without a call (the final answer, scored by the subclass's ``score``).

The message format follows transformers' chat templates (and TorchRL's ``ChatEnv`` tool transforms): a tool result is
``{"role": "tool", "name": <tool name>, "content": <text>}``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from lit_llm.rollouts.envs.timeout import call_with_timeout

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "Tool", "ToolCall", "ToolCallParseError", "ToolResult",
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
    """One :class:`Tool` per plain function (environments are built once per episode; a Tool is stateless). Only
    functions without a closure come here (:func:`_as_tool`): a bound method or a closure may hold an environment
    instance, which the cache would keep alive."""
    return Tool(fn)


def _shared(fn: Any) -> bool:
    """Whether ``fn`` is a plain function that holds no instance: a module- or class-level ``def`` (no closure)."""
    return inspect.isfunction(fn) and fn.__closure__ is None


def _as_tool(tool: Tool | Callable[..., Any]) -> Tool:
    """``tool`` as a :class:`Tool`: a Tool as is; a plain function through the cache (:func:`_tool_of`); a bound
    method of a plain function as a new Tool over the method with the cached schema of its function (the same
    schema: ``transformers.utils.get_json_schema`` drops an un-annotated ``self``); any other callable (a closure, a
    callable object) as a new Tool. A ``staticmethod`` object (listed in a class body) is its function."""
    if isinstance(tool, Tool):
        return tool
    if isinstance(tool, staticmethod):
        tool = tool.__func__
    if _shared(tool):
        return _tool_of(tool)
    if inspect.ismethod(tool) and _shared(tool.__func__) and _takes_receiver(tool.__func__):
        bound = copy.copy(_tool_of(tool.__func__))
        bound.fn = tool
        return bound
    return Tool(tool)


def _takes_receiver(fn: Any) -> bool:
    """Whether the plain function ``fn``'s first parameter is an implicit receiver: named ``self`` or ``cls``,
    without a type hint (what ``transformers.utils.get_json_schema`` leaves out of the schema), i.e. a method
    written in a class body that must be bound before it is called."""
    if not inspect.isfunction(fn):
        return False
    params = list(inspect.signature(fn).parameters.values())
    return bool(params) and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty \
        and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


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
    from lit_llm.data.chat_template import Renderer, resolve_template

    def dummy(x: str) -> str:
        """A probe tool.

        Args:
            x: any text.
        """
        return x

    messages = [{"role": "user", "content": "Hi"}]
    renders = []
    for tools in (None, [Tool(dummy).schema]):
        text, name = resolve_template(tokenizer, chat_template, tools)
        renders.append(Renderer(tokenizer, text, name, {**template_kwargs, "tools": tools}).render(messages, True))
    return renders[0] != renders[1]
