"""Synthetic tool traces of the calculator task (``CalculatorEnv.make_sft_rows``), the tool prompt
(``prompt_with_tools``) and the schema check without a function (``validate_arguments``)."""

from __future__ import annotations

import json

import pytest

from lit_llm.rollouts.envs import (
    CalculatorEnv,
    Tool,
    ToolCall,
    calculator,
    parse_tool_calls,
    prompt_with_tools,
    tools_system_prompt,
    validate_arguments,
)


def python_value(expression: str) -> int:
    """The problems are ``a * b`` or ``a + b - c`` of whole numbers: Python's integer arithmetic, independently."""
    terms = expression.split()
    if terms[1] == "*":
        return int(terms[0]) * int(terms[2])
    return int(terms[0]) + int(terms[2]) - int(terms[4])


def test_sft_rows_are_the_rewarded_episode_of_each_problem():
    rows = CalculatorEnv.make_sft_rows(6, seed=3)
    problems = CalculatorEnv.make_rows(6, seed=3)
    assert [r["sample_id"] for r in rows] == [p["sample_id"] for p in problems]
    assert [r["expression"] for r in rows] == [p["expression"] for p in problems]
    for row in rows:
        e, value = row["expression"], python_value(row["expression"])
        assert row["answer"] == str(value)
        assert row["messages"] == [
            {"role": "system", "content": tools_system_prompt([calculator])},
            {"role": "user", "content": f"What is {e}? Use the calculator tool, then give the final answer as a "
                                        f"number."},
            {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                                             + e + '"}}\n</tool_call>'},
            {"role": "tool", "name": "calculator", "content": str(value)},
            {"role": "assistant", "content": f"The answer is {value}."},
        ]
    assert CalculatorEnv.make_sft_rows(6, seed=3) == rows  # deterministic
    train = {r["expression"] for r in CalculatorEnv.make_sft_rows(200, seed=0)}
    held = {r["expression"] for r in CalculatorEnv.make_sft_rows(50, seed=0, split="eval")}
    assert not train & held


def test_sft_rows_replay_through_the_environment():
    """The environment, fed the trace's assistant turns, answers with the trace's tool message and rewards 1.0."""
    for row in CalculatorEnv.make_sft_rows(8, seed=1):
        messages = row["messages"]
        env = CalculatorEnv()
        env.reset({"prompt": messages[1:2], "answer": row["answer"]})
        assert parse_tool_calls(messages[2]["content"]) == [ToolCall("calculator", {"expression": row["expression"]})]
        step = env.step(messages[:3])
        assert step.messages == [messages[3]] and not step.done and step.info["tool_errors"] == 0
        final = env.step(messages)
        assert (final.done, final.reward, final.info["reason"]) == (True, 1.0, "answer")


def test_sft_rows_options():
    (row,) = CalculatorEnv.make_sft_rows(1, tools_in_system=False)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    (row,) = CalculatorEnv.make_sft_rows(1, tools_in_system=False, system_prompt="Be brief.")
    assert row["messages"][0] == {"role": "system", "content": "Be brief."}
    (row,) = CalculatorEnv.make_sft_rows(1, system_prompt="Be brief.")
    assert row["messages"][0] == {"role": "system", "content": "Be brief.\n\n" + tools_system_prompt([calculator])}
    (row,) = CalculatorEnv.make_sft_rows(1, template="Compute {expression}.", answer_template="= {answer}")
    assert row["messages"][1]["content"] == f"Compute {row['expression']}."
    assert row["messages"][-1]["content"] == f"= {row['answer']}"
    with pytest.raises(ValueError, match=r"answer_template 'Done\.' gives 'Done\.', whose last number is not the "
                                         r"answer"):
        CalculatorEnv.make_sft_rows(1, answer_template="Done.")
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        CalculatorEnv.make_sft_rows(0)


def test_prompt_with_tools():
    user = [{"role": "user", "content": "q"}]
    schema = Tool(calculator).schema
    assert prompt_with_tools(user, [calculator], template_takes_tools=True) == (user, [schema])
    assert prompt_with_tools(user, [calculator], template_takes_tools=False) == (
        [{"role": "system", "content": tools_system_prompt([calculator])}, *user], None)
    with_system = [{"role": "system", "content": "S"}, *user]
    assert prompt_with_tools(with_system, [schema], template_takes_tools=False) == (
        [{"role": "system", "content": "S\n\n" + tools_system_prompt([schema])}, *user], None)
    assert prompt_with_tools(user, [], template_takes_tools=False) == (user, None)
    out, _ = prompt_with_tools(user, [calculator], template_takes_tools=False)
    assert user == [{"role": "user", "content": "q"}] and out[1] is not user[0]  # the input is not modified


def test_validate_arguments_matches_tool_validate():
    tool = Tool(calculator)
    bare = tool.schema["function"]
    for args in ({"expression": "1 + 2"}, {"expression": 3}, {}, {"expression": "1", "x": 1}, [1], "1"):
        assert validate_arguments(tool.schema, args) == tool.validate(args) == validate_arguments(bare, args)
    assert validate_arguments(tool.schema, {"expression": 3}) == (
        "Error: bad arguments for calculator: argument expression must be string, got 3. calculator takes "
        "(expression: string).")
    assert validate_arguments({"name": "ping"}, {}) is None  # no parameters: a tool without arguments
    assert validate_arguments({"name": "ping"}, {"x": 1}) == ("Error: bad arguments for ping: unknown argument(s) x. "
                                                             "ping takes ().")
    with pytest.raises(ValueError, match="validate_arguments: not a tool schema"):
        validate_arguments(json.loads('{"type": "function"}'), {})


def test_sft_rows_and_the_episode_first_render_build_the_same_system_message(tokenizer):
    """With a system prompt and a template without ``tools=`` (SmolLM2): the SFT trace's prompt messages equal the
    episode renderer's for the same problem (one function, ``prompt_with_tools``, builds both)."""
    from lit_llm.rollouts.episodes import EpisodeRenderer

    (row,) = CalculatorEnv.make_sft_rows(1, seed=5, system_prompt="Be brief.")
    (problem,) = CalculatorEnv.make_rows(1, seed=5)
    env = CalculatorEnv()
    first = env.reset({**problem, "prompt": [{"role": "system", "content": "Be brief."}, *problem["prompt"]]})
    renderer = EpisodeRenderer(tokenizer)
    assert not renderer.takes_tools
    assert renderer.prompt_messages(first, env.tools) == row["messages"][:2]
    assert row["messages"][0] == {"role": "system", "content": "Be brief.\n\n" + tools_system_prompt([calculator])}
