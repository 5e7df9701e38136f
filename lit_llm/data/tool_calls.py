"""Tool calls in model text, below the environments (DESIGN.md layers: data sits above rewards and rollouts, so
both :func:`lit_llm.rewards.tool_call_format_reward` and :mod:`lit_llm.rollouts.envs` read calls with the same code):

* :func:`parse_tool_calls` reads the Hermes / Qwen format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (``"parameters"`` accepted as Llama-3.1 writes it, and a bare JSON call without tags as Llama-3.1 emits it), or,
  given a tokenizer with a ``response_template`` (transformers >= 5), ``tokenizer.parse_response``; bad markup raises
  :class:`ToolCallParseError`, whose ``reason`` is written for the model;
* :func:`calls_from_json` reads one JSON call object (a structured ``tool_calls`` entry of a message);
* :func:`validate_arguments` checks a call's arguments against a tool's JSON schema;
* :func:`tool_schemas` / :func:`function_schema` give the JSON schemas chat templates take as ``tools=``.

Pure functions of text and JSON: no environment, no tool execution (that is :class:`lit_llm.rollouts.envs.Tool`).
:mod:`lit_llm.rollouts.envs` re-exports every public name, so ``from lit_llm.rollouts.envs import parse_tool_calls``
keeps working.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall", "ToolCallParseError", "calls_from_json", "function_schema",
           "parse_tool_calls", "tool_schemas", "validate_arguments"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list, tuple), "object": (dict,),
                                            "null": (type(None),)}


class ToolCallParseError(ValueError):
    """The tool-call markup of a model turn could not be read (bad JSON, no ``name``, unclosed tags...).

    Attributes:
        reason: what was wrong, in words a model can act on (it becomes the tool message's text).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class ToolCall:
    """One call parsed from a model turn.

    Attributes:
        name: the tool's name (the ``name`` of its schema).
        arguments: the arguments, a JSON object (``{}`` when the call gave none).
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_text(self) -> str:
        """The call in the Hermes / Qwen markup :func:`parse_tool_calls` reads (and Qwen-style templates render):
        ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (for scripted policies and SFT traces)."""
        body = json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)
        return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` has one of the JSON types of ``schema`` (bools are not numbers; arrays' items checked)."""
    types = schema.get("type")
    if types is None:
        return True  # no type (an untyped or Any parameter): anything goes
    types = [types] if isinstance(types, str) else list(types)
    if schema.get("nullable"):
        types.append("null")
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # a type this check does not know: do not refuse
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if t == "number" and isinstance(value, float) and not math.isfinite(value):
            continue
        if isinstance(value, py):
            items = schema.get("items")
            if t == "array" and isinstance(items, Mapping) and not all(_type_ok(v, items) for v in value):
                continue
            return True
    return False


def _type_name(schema: Mapping[str, Any]) -> str:
    t = schema.get("type", "any")
    name = t if isinstance(t, str) else " or ".join(t)
    items = schema.get("items")
    if name == "array" and isinstance(items, Mapping) and "type" in items:
        name = f"array of {_type_name(items)}"
    return name + (" or null" if schema.get("nullable") else "")


def validate_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """Check a call's ``arguments`` against a tool's JSON schema (what :meth:`lit_llm.rollouts.envs.Tool.validate`
    does, for a schema without its function, e.g. one read from a dataset): a JSON object, every required argument
    present, no unknown argument, each value of its JSON type (``integer``: an int, not a bool; ``number``: a finite
    int or float; arrays' item types; ``nullable`` allows ``null``; an ``enum`` is enforced).

    Args:
        schema: ``{"type": "function", "function": {"name", "parameters"}}`` (transformers' format) or the bare
            ``{"name", "parameters"}`` function object; no ``parameters``: a tool without arguments.
        arguments: the call's arguments.

    Returns:
        ``None`` when they fit, else the error text (naming the argument, the expected type and the tool's
        signature).

    Raises:
        ValueError: ``schema`` has no ``name`` (not a tool schema).
    """
    function = schema.get("function", schema) if isinstance(schema, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"validate_arguments: not a tool schema (no function name): {schema!r:.200}. Expected "
                         f"{{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}.")
    params = function.get("parameters") or {"type": "object", "properties": {}}
    props: Mapping[str, Any] = params.get("properties", {}) or {}
    signature = ", ".join(f"{k}: {_type_name(v)}" for k, v in props.items())
    usage = f" {name} takes ({signature})."
    if not isinstance(arguments, Mapping):
        got = json.dumps(arguments, default=str)
        return f"Error: the arguments of {name} must be a JSON object, got {got}." + usage
    problems = []
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        problems.append(f"missing required argument(s) {', '.join(missing)}")
    unknown = [k for k in arguments if k not in props]
    if unknown:
        problems.append(f"unknown argument(s) {', '.join(map(str, unknown))}")
    for k, v in arguments.items():
        if k in props and not _type_ok(v, props[k]):
            problems.append(f"argument {k} must be {_type_name(props[k])}, got {json.dumps(v, default=str)}")
        elif k in props and "enum" in props[k] and v not in props[k]["enum"]:
            problems.append(f"argument {k} must be one of {json.dumps(props[k]['enum'])}, got {json.dumps(v)}")
    return f"Error: bad arguments for {name}: {'; '.join(problems)}." + usage if problems else None


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a Python function: ``transformers.utils.get_json_schema(fn)``,
    ``{"type": "function", "function": {"name", "description", "parameters": {...}}}``, from its signature and
    Google-style docstring.

    Raises:
        ValueError: no schema can be built (no docstring, a parameter without a description or a type hint); the
            message names the function and shows what to add.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException / TypeHintParsingException (plain Exceptions)
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"Tool {name!r}: cannot build its JSON schema ({type(e).__name__}: {e}). A tool needs a type hint on "
            f"every parameter and a Google-style docstring with a description and an 'Args:' section naming "
            f"each parameter, e.g.\n{_schema_example(fn, name)}") from e


def _schema_example(fn: Callable[..., Any], name: str) -> str:
    """The signature line and a docstring with an ``Args:`` entry per parameter of ``fn`` (its real names and type
    hints, ``str`` where a hint is missing; an implicit ``self`` / ``cls`` kept, without an entry), the example of
    :func:`function_schema`'s error."""
    import inspect

    def hint(annotation: Any) -> str:
        if annotation is inspect.Parameter.empty:
            return "str"
        return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = inspect.Signature()
    params = list(signature.parameters.values())
    receiver = []
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        receiver, params = [params[0].name], params[1:]
    params = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    returns = "" if signature.return_annotation is inspect.Signature.empty else \
        f" -> {hint(signature.return_annotation)}"
    args = "".join(f"\n            {p.name}: what {p.name} is." for p in params)
    written = ", ".join([*receiver, *(f"{p.name}: {hint(p.annotation)}" for p in params)])
    return (f"    def {name}({written}){returns}:\n"
            f"        \"\"\"What {name} does, in one line." + (f"\n\n        Args:{args}" if params else "")
            + "\n        \"\"\"")


@functools.lru_cache(maxsize=256)
def _cached_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    return function_schema(fn)


def _schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """:func:`function_schema`, cached per function (a rollout asks once per episode); a shallow copy. A bound
    method is not cached (the cache would keep its instance, e.g. an episode's environment, alive)."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return dict(function_schema(fn))
    try:
        return dict(_cached_schema(fn))
    except TypeError as e:  # an unhashable callable object: no cache
        if "unhashable" not in str(e):
            raise
        return dict(function_schema(fn))


def tool_schemas(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The JSON schemas of ``tools``, in order: what chat templates take as ``tools=`` and reward functions get as
    the ``tools`` column.

    Args:
        tools: each a schema dict (``{"type": "function", "function": {"name", "description", "parameters"}}``,
            copied), a :class:`lit_llm.rollouts.envs.Tool` (or any object with a ``schema`` dict, e.g. an
            environment's own tool class: its schema), or a plain callable (:func:`function_schema`:
            ``transformers.utils.get_json_schema`` of its signature and Google-style docstring); ``None`` or empty:
            ``[]``.

    Returns:
        A new list of schema dicts (shallow copies: changing one leaves the tool alone).

    Raises:
        ValueError: an entry that is none of these (names its index), or a callable whose schema cannot be built
            (:func:`function_schema`: a type hint and an ``Args:`` entry per parameter).
    """
    out = []
    for i, t in enumerate(tools or ()):
        if isinstance(t, Mapping):
            out.append(dict(t))
        elif isinstance(getattr(t, "schema", None), Mapping):
            out.append(dict(t.schema))
        elif callable(t):
            out.append(_schema_of(t))
        else:
            raise ValueError(f"tool {i} is {type(t).__name__} {t!r:.80}: give a Tool, a JSON-schema dict "
                             f"{{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}} or a "
                             f"function with type hints and a Google-style docstring.")
    return out


# ---------------------------------------------------------------------- parsing
def calls_from_json(obj: Any, where: str = "the tool call", *, top: bool = True) -> list[ToolCall]:
    """The calls of a JSON value: ``{"name": str, "arguments" | "parameters": object | JSON string | null}`` is one
    call; with ``top`` a list of such objects is one call each (a list inside a list is not).

    Args:
        obj: the decoded JSON (e.g. the ``function`` of a message's structured ``tool_calls`` entry).
        where: names the call in errors (``"tool call 2"``).
        top: whether a list is allowed.

    Raises:
        ToolCallParseError: not an object (or list), no ``"name"`` string, ``"arguments"`` neither an object nor
            a JSON-object string, an empty list.
    """
    if isinstance(obj, list) and top:
        if not obj:
            raise ToolCallParseError(f"{where} is an empty list; give one object per call.")
        return [c for i, o in enumerate(obj) for c in calls_from_json(o, f"{where}, item {i}", top=False)]
    expected = 'a JSON object {"name": <tool name>, "arguments": {<argument>: <value>, ...}}'
    if not isinstance(obj, dict):
        raise ToolCallParseError(f"{where} must be {expected}, got {json.dumps(obj)[:100]}.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallParseError(f"{where} has no \"name\" string; it must be {expected}.")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallParseError(f"{where}: the \"arguments\" string is not JSON ({e.msg}).") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ToolCallParseError(f"{where}: \"arguments\" must be a JSON object, got {json.dumps(args)[:100]}.")
    return [ToolCall(name, args)]


_FENCE = re.compile(r"```(?:json)?\s*")


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _parse_markup(text: str) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos, k = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        where = f"tool call {k}" if k else "the tool call"
        i = _skip_space(text, start + len(TOOL_CALL_OPEN))
        fence = _FENCE.match(text, i)
        i = fence.end() if fence else i
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            body = text[i:text.find(TOOL_CALL_CLOSE, i)] if TOOL_CALL_CLOSE in text[i:] else text[i:]
            raise ToolCallParseError(f"{where} is not valid JSON ({e.msg} at character {e.pos - i}): "
                                     f"{body.strip()[:120]!r}. Write {TOOL_CALL_OPEN}{{\"name\": ..., "
                                     f"\"arguments\": {{...}}}}{TOOL_CALL_CLOSE}.") from e
        end = _skip_space(text, end)
        if fence and text.startswith("```", end):
            end = _skip_space(text, end + 3)
        if text.startswith(TOOL_CALL_CLOSE, end):
            end += len(TOOL_CALL_CLOSE)
        elif end < len(text):  # an unclosed call at the very end (a stop string cut the tag) is accepted
            raise ToolCallParseError(f"{where}: expected {TOOL_CALL_CLOSE} after its JSON, got "
                                     f"{text[end:end + 40]!r}.")
        calls.extend(calls_from_json(obj, where))
        pos, k = end, k + 1
    if not calls and TOOL_CALL_CLOSE in text:
        raise ToolCallParseError(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}.")
    if not calls:  # Llama-3.1: a bare JSON call {"name": ..., "parameters": {...}} as the whole turn
        stripped = text.strip()
        if stripped.startswith("{") and stripped.endswith("}"):
            try:
                obj = json.loads(stripped)
            except json.JSONDecodeError:
                return []
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("parameters" in obj
                                                                                or "arguments" in obj):
                return calls_from_json(obj, "the tool call")
    return calls


def parse_tool_calls(text: str, *, tokenizer: Any = None,
                     tools: Sequence[Any] | None = None) -> list[ToolCall]:
    """The tool calls of a model turn.

    Without a response template: every ``<tool_call> JSON </tool_call>`` block in order (the Hermes / Qwen format;
    the JSON is ``{"name": ..., "arguments": {...}}``, ``"parameters"`` also read (Llama-3.1), ``"arguments"`` may
    be a JSON string (OpenAI), a block may hold a list of calls, a Markdown code fence inside a block is skipped, and
    the last block may be unclosed when the text ends right after its JSON (a stop string cut the closing tag)).
    Without any tag, a turn that is exactly a JSON call with ``"name"`` and ``"parameters"`` / ``"arguments"`` (what
    Llama-3.1 emits) is a call. Text outside the blocks is ignored.

    With ``tokenizer`` whose ``response_template`` is set (transformers >= 5): ``tokenizer.parse_response(text,
    prefix="", tools=...)``'s ``tool_calls`` (arguments cast by the tools' schemas when ``tools`` are given).

    Args:
        text: the assistant turn's text (decoded with ``skip_special_tokens=True``).
        tokenizer: optional; used only when it defines a ``response_template``.
        tools: optional tools / schemas, passed to ``parse_response`` for argument casting.

    Returns:
        The calls, in order; ``[]`` when the turn has no call (the final answer).

    Raises:
        ToolCallParseError: call markup that cannot be read (invalid JSON, no ``"name"``, non-object arguments,
            text between the JSON and the closing tag, a closing tag without an opening one, or a
            ``parse_response`` failure); its ``reason`` is meant for the model.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls: text must be a str, got {type(text).__name__}.")
    try:
        return _parse(text, tokenizer, tools)
    except RecursionError:  # JSON nested deeper than the interpreter's recursion limit
        raise ToolCallParseError("the tool call's JSON is nested too deeply.") from None


def _parse(text: str, tokenizer: Any, tools: Sequence[Any] | None) -> list[ToolCall]:
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix="", tools=tool_schemas(tools) if tools else None)
        except Exception as e:  # the parser's ValueError for bad JSON, or anything else it raises on model text
            raise ToolCallParseError(f"the tool call could not be parsed: {e}") from e
        calls = (message.get("tool_calls") or []) if isinstance(message, Mapping) else []
        out = []
        for i, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, Mapping) else call
            out.extend(calls_from_json(fn, f"tool call {i}"))
        return out
    return _parse_markup(text)
