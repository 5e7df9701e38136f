"""CalculatorEnv: the safe calculator agrees with Python's arithmetic, refuses everything else, rows are seeded and
train/eval disjoint, and the episode logic (tool turn -> result; final answer scored exactly)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rollouts.envs import CalculatorEnv, EnvStep, ToolCall, calculator, evaluate_expression
from lit_llm.rollouts.envs.calculator import format_number, split_of


@st.composite
def expressions(draw, depth=3):
    """(text, value) of a random expression over + - * and parentheses; the value computed on the tree."""
    if depth == 0 or draw(st.booleans()):
        n = draw(st.integers(-10_000, 10_000))
        return (f"({n})" if n < 0 else str(n)), n
    (lt, lv), (rt, rv) = draw(expressions(depth=depth - 1)), draw(expressions(depth=depth - 1))
    op = draw(st.sampled_from("+-*"))
    value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op]
    return f"({lt} {op} {rt})", value


@settings(max_examples=200, deadline=None)
@given(expressions())
def test_calculator_agrees_with_python_integer_arithmetic(case):
    text, value = case
    assert evaluate_expression(text) == value
    assert calculator(text) == str(value)


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6).filter(bool))
def test_division_and_modulo_as_python(a, b):
    assert evaluate_expression(f"{a} / ({b})") == a / b
    assert evaluate_expression(f"{a} // ({b})") == a // b
    assert evaluate_expression(f"{a} % ({b})") == a % b


@pytest.mark.parametrize(
    ("text", "expected"),
    [("347 * 5812", "2016764"), ("2598 + 2070 - 6364", "-1696"), ("2 ** 10", "1024"), ("10 / 4", "2.5"),
     ("10 / 2", "5"), ("2 / 3", "0.666666666667"), ("-(3 - 5) * 2", "4"), ("347 × 5812", "2016764"),
     ("347 x 5812", "2016764"), ("1,234 + 1", "1235"), ("2^5", "32"), ("12 ÷ 4 =", "3"), ("1.5 * 2", "3"),
     ("2 ** -1", "0.5")],
)
def test_calculator_values(text, expected):
    assert calculator(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [("__import__('os').system('echo hi')", "is not supported"), ("abs(-3)", "is not supported"),
     ("x + 1", "the name 'x' is not supported"), ("'a' * 3", "the constant 'a' is not supported"),
     ("True + 1", "the constant True is not supported"), ("3 +", "is not an arithmetic expression"),
     ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("2 ** 101", "exponents above 100"),
     ("99999 ** 99", "more than 200 digits"), ("(-8) ** 0.5", "not a real number"), ("", "empty"),
     ("1 + " * 60 + "1", "longer than 200 characters"), ("[1, 2]", "List is not supported"),
     ("1e309 * 1", "too large"), ("3 < 4", "Compare is not supported")],
)
def test_calculator_refuses_everything_else(text, match):
    with pytest.raises(ValueError, match=match):
        evaluate_expression(text)


def test_format_number():
    assert [format_number(v) for v in (7, -7.0, 0.1 + 0.2, 1e20, 2.5)] == ["7", "-7", "0.3", "1e+20", "2.5"]


def test_make_rows_is_seeded_distinct_and_exact():
    rows = CalculatorEnv.make_rows(50, seed=3)
    assert rows == CalculatorEnv.make_rows(50, seed=3)
    assert rows != CalculatorEnv.make_rows(50, seed=4)
    assert len({r["expression"] for r in rows}) == 50
    for i, r in enumerate(rows):
        a, op, b, *rest = r["expression"].split()
        if op == "*":
            assert not rest and 100 <= int(a) <= 999 and 100 <= int(b) <= 9999
            assert int(r["answer"]) == int(a) * int(b)
        else:
            assert (op, rest[0]) == ("+", "-") and all(1000 <= int(x) <= 9999 for x in (a, b, rest[1]))
            assert int(r["answer"]) == int(a) + int(b) - int(rest[1])
        assert r["prompt"] == [{"role": "user", "content": f"What is {r['expression']}? Use the calculator tool, "
                                                           f"then give the final answer as a number."}]
        assert r["sample_id"] == f"calculator-train:{i}"
    assert {r["expression"].split()[1] for r in rows} == {"*", "+"}


def test_train_and_eval_rows_are_disjoint():
    train = {r["expression"] for s in range(3) for r in CalculatorEnv.make_rows(200, seed=s)}
    evals = {r["expression"] for s in range(3) for r in CalculatorEnv.make_rows(100, seed=s, split="eval")}
    assert not train & evals
    assert all(split_of(e) == "eval" for e in evals) and all(split_of(e) == "train" for e in train)
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        CalculatorEnv.make_rows(1, split="test")
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        CalculatorEnv.make_rows(0)


def test_episode_tool_call_then_exact_answer():
    row = {"prompt": [{"role": "user", "content": "What is 347 * 5812?"}], "answer": "2016764"}
    env = CalculatorEnv()
    history = env.reset(row)
    assert history == row["prompt"] and history[0] is not row["prompt"][0]  # a copy
    history.append({"role": "assistant", "content": ToolCall("calculator", {"expression": "347 * 5812"}).to_text()})
    step = env.step(history)
    assert (step.messages, step.reward, step.done) == ([{"role": "tool", "name": "calculator",
                                                          "content": "2016764"}], 0.0, False)
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (1, 0)
    history += step.messages
    for answer, reward in [("The answer is 2,016,764.", 1.0), ("2016764.0", 1.0), ("2016764 or 2016765", 0.0),
                           ("About two million.", 0.0), ("2016765", 0.0)]:
        assert env.step(history + [{"role": "assistant", "content": answer}]) == EnvStep(
            [], reward, True, {"reason": "answer"})


def test_calculator_errors_become_tool_messages():
    env = CalculatorEnv(tool_error_penalty=0.1)
    env.reset({"prompt": "q", "answer": "1"})
    step = env.step([{"role": "assistant", "content": ToolCall("calculator", {"expression": "import os"}).to_text()}])
    assert step.messages == [{"role": "tool", "name": "calculator", "content": "Error: calculator raised ValueError: "
                              "'import os' is not an arithmetic expression; use numbers, + - * / // % ** and "
                              "parentheses, e.g. '347 * 5812'."}]
    assert (step.reward, step.done, step.info["tool_errors"]) == (-0.1, False, 1)


def test_score_needs_a_numeric_answer():
    env = CalculatorEnv()
    env.reset({"prompt": "q", "answer": "n/a", "sample_id": "s1"})
    with pytest.raises(ValueError, match=r"the row's 'answer' must be a number, got 'n/a' \(row s1\)"):
        env.step([{"role": "assistant", "content": "3"}])
