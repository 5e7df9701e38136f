"""Tools: schemas, argument validation, calls in a worker thread with a timeout, the tools system prompt, and which
shared chat templates render tools=. The <tool_call> parser's tests are in tests/data/test_tool_calls.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lit_llm.rollouts.envs import (
    Tool,
    ToolCall,
    ToolResult,
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


def test_schema_error_example_uses_the_tools_own_parameters():
    def nodoc(x: str, count: int = 1):
        return x * count

    class Box:
        def peek(self, n) -> str:
            return "x" * n

    with pytest.raises(ValueError) as e:
        Tool(nodoc)
    assert str(e.value).endswith(
        "e.g.\n    def nodoc(x: str, count: int):\n        \"\"\"What nodoc does, in one line.\n\n        Args:\n"
        "            x: what x is.\n            count: what count is.\n        \"\"\"")
    with pytest.raises(ValueError) as e:
        Tool(Box.peek)
    assert str(e.value).endswith(
        "e.g.\n    def peek(self, n: str) -> str:\n        \"\"\"What peek does, in one line.\n\n        Args:\n"
        "            n: what n is.\n        \"\"\"")
