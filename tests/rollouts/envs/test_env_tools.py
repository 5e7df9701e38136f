"""Tools: schemas, argument validation, calls in a worker thread with a timeout, the <tool_call> parser (and
transformers' parse_response path), the tools system prompt, and which shared chat templates render tools=."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rollouts.envs import (
    Tool,
    ToolCall,
    ToolCallParseError,
    ToolResult,
    parse_tool_calls,
    template_supports_tools,
    tool_schemas,
    tools_system_prompt,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def describe(name: str, scores: list[float], tag: str | None = None, verbose: bool = False) -> dict:
    """Describe a list of scores.

    Args:
        name: a label.
        scores: the numbers.
        tag: an optional tag.
        verbose: more output.
    """
    return {"name": name, "n": len(scores), "tag": tag, "verbose": verbose}


def test_tool_schema_is_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    tool = Tool(add)
    assert tool.name == "add"
    assert tool.schema == get_json_schema(add)
    assert tool.parameters == {"type": "object", "required": ["a"],
                               "properties": {"a": {"type": "integer", "description": "the first integer."},
                                              "b": {"type": "integer", "description": "the second integer."}}}
    assert Tool(tool).schema == tool.schema  # a Tool wraps its function again


def test_tool_schemas_of_every_kind_of_tool():
    """One conversion for templates, the tools column and the prompt: dicts copied, Tools' and duck-typed tools'
    schemas, plain functions through Tool; None / [] give []; anything else names its index."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(add)

    class OwnTool:  # an environment's own tool class with a schema attribute
        schema = {"type": "function", "function": {"name": "own", "parameters": {}}}

    given_dict = {"type": "function", "function": {"name": "d"}}
    out = tool_schemas([given_dict, Tool(add), OwnTool(), describe])
    assert out == [given_dict, schema, OwnTool.schema, get_json_schema(describe)]
    out[0]["extra"] = 1
    out[1]["extra"] = 1
    assert "extra" not in given_dict and "extra" not in Tool(add).schema  # copies
    assert tool_schemas(None) == tool_schemas([]) == []
    with pytest.raises(ValueError) as e:
        tool_schemas([add, 42])
    assert str(e.value) == ("tool 1 is int 42: give a Tool, a JSON-schema dict {'type': 'function', 'function': "
                            "{'name': ..., 'parameters': {...}}} or a function with type hints and a Google-style "
                            "docstring.")

    def bare(x: int) -> int:
        return x
    with pytest.raises(ValueError, match=r"Tool 'bare': cannot build its JSON schema"):
        tool_schemas([bare])


def test_tool_without_docstring_or_hint_is_a_clear_error():
    def bare(x: int) -> int:
        return x

    def no_args_doc(x: int) -> int:
        """Does a thing."""
        return x

    with pytest.raises(ValueError, match=r"Tool 'bare': cannot build its JSON schema .*no docstring.*Args:"):
        Tool(bare)
    with pytest.raises(ValueError, match=r"Tool 'no_args_doc'.*no description for the argument 'x'"):
        Tool(no_args_doc)
    with pytest.raises(TypeError, match="expected a Python callable, got int"):
        Tool(3)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Tool(add, timeout=0)


def test_tool_call_success_and_result_text():
    assert Tool(add)({"a": 2, "b": 40}) == ToolResult("add", "42", elapsed=pytest.approx(0.0, abs=5.0))
    result = Tool(describe)({"name": "x", "scores": [1, 2.5]})
    assert result.ok and json.loads(result.content) == {"name": "x", "n": 2, "tag": None, "verbose": False}
    assert result.message == {"role": "tool", "name": "describe", "content": result.content}

    def weird() -> object:
        """Return something that is not JSON."""
        return {1, 2}

    assert Tool(weird)({}).content == "{1, 2}"  # not JSON-able: str()


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({}, "Error: bad arguments for add: missing required argument(s) a."),
        ({"a": 1, "c": 2}, "Error: bad arguments for add: unknown argument(s) c."),
        ({"a": "1"}, 'Error: bad arguments for add: argument a must be integer, got "1".'),
        ({"a": True}, "Error: bad arguments for add: argument a must be integer, got true."),
        ({"a": 1.5}, "Error: bad arguments for add: argument a must be integer, got 1.5."),
        ({"b": 1, "z": 0}, "Error: bad arguments for add: missing required argument(s) a; unknown argument(s) z."),
        ([1, 2], "Error: the arguments of add must be a JSON object, got [1, 2]."),
    ],
)
def test_bad_arguments_become_the_tool_message(arguments, error):
    result = Tool(add)(arguments)
    assert result.error == "bad_arguments"
    assert result.content == error + " add takes (a: integer, b: integer)."


def test_argument_types_of_lists_optionals_and_bools():
    tool = Tool(describe)
    assert tool.validate({"name": "n", "scores": [1, 2.0], "tag": None, "verbose": True}) is None
    assert tool.validate({"name": "n", "scores": [1, "x"]}) == (
        'Error: bad arguments for describe: argument scores must be array of number, got [1, "x"]. describe takes '
        "(name: string, scores: array of number, tag: string or null, verbose: boolean).")
    assert "argument verbose must be boolean, got 1" in tool.validate({"name": "n", "scores": [], "verbose": 1})
    assert "argument tag must be string or null, got 3" in tool.validate({"name": "n", "scores": [], "tag": 3})


def test_raising_tool_becomes_an_error_message():
    def boom(x: int) -> int:
        """Fail.

        Args:
            x: ignored.
        """
        raise RuntimeError(f"no luck with {x}")

    result = Tool(boom)({"x": 7})
    assert (result.error, result.content) == ("exception", "Error: boom raised RuntimeError: no luck with 7")


def test_hanging_tool_is_abandoned_after_its_timeout():
    release = threading.Event()

    def hang(x: int) -> int:
        """Wait until released.

        Args:
            x: returned.
        """
        release.wait(30)
        return x

    try:
        start = time.perf_counter()
        result = Tool(hang, timeout=0.05)({"x": 1})
        took = time.perf_counter() - start
        assert (result.error, result.content) == ("timeout", "Error: hang timed out after 0.05 s and was stopped.")
        assert 0.05 <= result.elapsed <= took < 2.0
        # the call-time timeout wins over the tool's default
        assert Tool(hang, timeout=10)({"x": 1}, timeout=0.02).error == "timeout"
    finally:
        release.set()


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


# ---------------------------------------------------------------------- prompts and templates
def test_tools_system_prompt_lists_each_schema_and_the_format():
    text = tools_system_prompt([add, Tool(describe)])
    schemas = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(s) for s in schemas] == [Tool(add).schema, Tool(describe).schema]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert tools_system_prompt([Tool(add).schema]) == tools_system_prompt([add])
    with pytest.raises(ValueError, match="no tools given"):
        tools_system_prompt([])


@pytest.mark.parametrize("name", ["stock-qwen2_5.jinja", "stock-qwen3.jinja", "stock-llama3_1.jinja"])
def test_schemas_render_into_templates_that_take_tools(tokenizer, templates_dir, name):
    path = templates_dir / name
    schema = Tool(add).schema
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    with_tools = tokenizer.apply_chat_template(messages, tools=[schema], chat_template=path.read_text(),
                                               tokenize=False, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(messages, chat_template=path.read_text(), tokenize=False,
                                          add_generation_prompt=True)
    assert with_tools != plain
    # the schema is rendered as JSON (one line for Qwen, indented for Llama-3.1)
    assert json.dumps(schema) in with_tools or json.dumps(schema, indent=4) in with_tools
    assert template_supports_tools(tokenizer, str(path)) is True
    assert template_supports_tools(tokenizer, path.read_text()) is True
    # a tool turn and its result render in these templates
    conversation = messages + [{"role": "assistant", "content": ToolCall("add", {"a": 2, "b": 3}).to_text()},
                               {"role": "tool", "name": "add", "content": "5"}]
    rendered = tokenizer.apply_chat_template(conversation, tools=[schema], chat_template=path.read_text(),
                                             tokenize=False)
    assert ToolCall("add", {"a": 2, "b": 3}).to_text() in rendered
    assert ("<tool_response>\n5\n</tool_response>" in rendered
            or '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>' in rendered)


def test_smollm2_template_ignores_tools(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert (tokenizer.apply_chat_template(messages, tools=[Tool(add).schema], tokenize=False)
            == tokenizer.apply_chat_template(messages, tokenize=False))
    assert template_supports_tools(tokenizer) is False  # so the tools go in a tools_system_prompt system message
