"""The data layer's tool-call reading (:mod:`lit_llm.data.tool_calls`): the ``<tool_call>`` parser and
transformers' ``parse_response`` path, JSON call objects, function schemas; the same objects re-exported by
:mod:`lit_llm.rollouts.envs`; and the rewards layer reads calls without importing the rollouts layer."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.data import tool_calls
from lit_llm.data.tool_calls import (
    ToolCall,
    ToolCallParseError,
    calls_from_json,
    function_schema,
    parse_tool_calls,
    tool_schemas,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def test_envs_reexport_the_same_objects():
    """Public import paths of the tools API keep working and give the data layer's objects (one implementation)."""
    import lit_llm.rollouts.envs as envs
    import lit_llm.rollouts.envs.tools as envs_tools

    for name in ("TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall", "ToolCallParseError", "parse_tool_calls",
                 "tool_schemas", "validate_arguments"):
        assert getattr(envs_tools, name) is getattr(tool_calls, name), name
        assert name.startswith("TOOL_CALL") or getattr(envs, name) is getattr(tool_calls, name), name


def test_rewards_read_tool_calls_without_the_rollouts_layer():
    """DESIGN.md layers: rewards sit above rollouts, so tool_call_format_reward (a function in its tools column
    included) runs without importing any lit_llm.rollouts module."""
    code = ("import sys, lit_llm.rewards as r\n"
            "def calc(expression: str) -> str:\n"
            "    \"\"\"Evaluate.\n\n    Args:\n        expression: the expression.\n    \"\"\"\n"
            "    return expression\n"
            "call = '<tool_call>{\"name\": \"calc\", \"arguments\": {\"expression\": \"1\"}}</tool_call>'\n"
            "print(r.tool_call_format_reward(['q'], [call], tools=[[calc]]))\n"
            "print(sorted(m for m in sys.modules if m.startswith('lit_llm.rollouts')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[1.0]", "[]"]


def test_calls_from_json_reads_structured_calls():
    assert calls_from_json({"name": "a", "arguments": '{"x": 1}'}) == [ToolCall("a", {"x": 1})]
    assert calls_from_json({"name": "a", "arguments": None}) == [ToolCall("a", {})]
    assert calls_from_json([{"name": "a"}, {"name": "b", "parameters": {"y": 2}}]) == [ToolCall("a"),
                                                                                        ToolCall("b", {"y": 2})]
    with pytest.raises(ToolCallParseError, match=r"tool_calls\[0\] must be a JSON object"):
        calls_from_json([{"name": "a"}], "tool_calls[0]", top=False)


def test_function_schema_and_tool_schemas():
    from transformers.utils import get_json_schema

    assert function_schema(add) == get_json_schema(add)
    first = tool_schemas([add])[0]
    first["function"] = None  # a copy: the cached schema is untouched
    assert tool_schemas([add]) == [get_json_schema(add)]

    def bare(x: int) -> int:
        return x
    with pytest.raises(ValueError, match=r"Tool 'bare': cannot build its JSON schema .*'Args:' section"):
        function_schema(bare)


# ---------------------------------------------------------------------- parse_tool_calls
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", []),
        ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>',
         [ToolCall("calculator", {"expression": "3*4"})]),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "parameters": '
         '{"k": [1, 2]}}</tool_call>', [ToolCall("a", {}), ToolCall("b", {"k": [1, 2]})]),
        ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', [ToolCall("a", {"x": 1})]),
        ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]</tool_call>',
         [ToolCall("a", {"x": 1}), ToolCall("b", {})]),
        ('<tool_call>\n```json\n{"name": "a", "arguments": {"x": 1}}\n```\n</tool_call>', [ToolCall("a", {"x": 1})]),
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n', [ToolCall("a", {"x": 1})]),  # closing tag cut
        ('<tool_call>{"name": "a", "arguments": {"s": "</tool_call>"}}</tool_call>',
         [ToolCall("a", {"s": "</tool_call>"})]),
        ('{"name": "calculator", "parameters": {"expression": "1+1"}}',
         [ToolCall("calculator", {"expression": "1+1"})]),
        ('{"answer": 3}', []),  # a JSON final answer without "name" is not a call
    ],
)
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>calculator(3*4)</tool_call>",
         r"the tool call is not valid JSON \(Expecting value at character 0\)"),
        ('<tool_call>{"name": "a", "arguments": {bad}}</tool_call>', "is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name" string'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object, got \\[1\\]'),
        ('<tool_call>{"name": "a", "arguments": "{x"}</tool_call>', 'the "arguments" string is not JSON'),
        ('<tool_call>{"name": "a"} trailing</tool_call>', "expected </tool_call> after its JSON, got 'trailing</tool"),
        ('<tool_call>{"name": "a"', "is not valid JSON"),
        ("</tool_call>", "</tool_call> without an opening <tool_call>"),
        ("<tool_call>[]</tool_call>", "is an empty list"),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>5</tool_call>', "tool call 1 must be a JSON object"),
        ('<tool_call>[[{"name": "a"}]]</tool_call>', "the tool call, item 0 must be a JSON object"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "the tool call.s JSON is nested too deeply"),
    ],
)
def test_unparseable_markup_raises_tool_call_parse_error(text, reason):
    with pytest.raises(ToolCallParseError, match=reason) as e:
        parse_tool_calls(text)
    assert e.value.reason == str(e.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                             max_size=4),
                    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
       arguments=st.dictionaries(st.text(), JSON, max_size=5),
       before=st.text().filter(lambda s: "tool_call>" not in s), n=st.integers(1, 3))
def test_parse_tool_calls_round_trips_any_json_arguments(name, arguments, before, n):
    call = ToolCall(name, arguments)
    text = before + "".join(call.to_text() for _ in range(n))
    assert parse_tool_calls(text) == [call] * n


# ---------------------------------------------------------------------- parse_response (transformers >= 5)
#: A response template for the Hermes format (written here: no tokenizer available offline ships one).
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close": "<|im_end|>", "content": "text"},
    },
}


@pytest.fixture
def tokenizer_with_response_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.response_template = HERMES_RESPONSE_TEMPLATE
    return tok


def test_parse_response_path_matches_the_markup_parser(tokenizer, tokenizer_with_response_template):
    assert getattr(tokenizer, "response_template", None) is None  # SmolLM2 has none: the markup parser runs
    text = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": "7"}}\n</tool_call><tool_call>{"name": "b", '
            '"arguments": {}}</tool_call>')
    tok = tokenizer_with_response_template
    # with the tools' schemas, parse_response casts "7" to the integer the schema asks for
    assert parse_tool_calls(text, tokenizer=tok, tools=[add]) == [ToolCall("add", {"a": 7}), ToolCall("b", {})]
    assert parse_tool_calls(text, tokenizer=tok) == parse_tool_calls(text) == [ToolCall("add", {"a": "7"}),
                                                                               ToolCall("b", {})]
    assert parse_tool_calls("The answer is 5.", tokenizer=tok) == []
    with pytest.raises(ToolCallParseError, match="could not be parsed: json parser could not parse region as JSON"):
        parse_tool_calls('<tool_call>{"name": "a", "arguments": {bad}}</tool_call>', tokenizer=tok)
