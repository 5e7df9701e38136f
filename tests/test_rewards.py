"""Reward parsing, the built-in rewards and the checked weighted combination (TRL semantics)."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rewards import (
    RewardError,
    RewardFunctions,
    arithmetic_answer_reward,
    extract_gsm8k_answer,
    gsm8k_answer_reward,
    last_number,
    normalize_number,
    strict_arithmetic_reward,
    strict_number_format_reward,
)


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,000", Decimal(1000)),
        ("$18", Decimal(18)),
        ("72.0", Decimal(72)),
        ("3.50", Decimal("3.5")),
        ("-7", Decimal(-7)),
        ("5.", Decimal(5)),
        ("abc", None),
        ("nan", None),
        (42, Decimal(42)),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", Decimal(72)),
        ("so it costs $1,234.00 in total. #### $1,234", Decimal(1234)),
        ("#### 5 apples, not 6", Decimal(5)),
        ("The answer is 12, then 13.", Decimal(13)),
        ("It is -3.", Decimal(-3)),
        ("no digits here", None),
        ("####", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_last_number():
    assert last_number("75 + 72 = 147") == Decimal(147)
    assert last_number("") is None
    assert last_number("pick 1,2,3") == Decimal(3)  # commas only as thousands separators
    assert last_number("about 12345 or 1,234,567.5") == Decimal("1234567.5")


def test_gsm8k_answer_reward():
    answers = ["Work...\n#### 72", "#### 1,000", "#### 5", "#### 5", None]
    completions = ["She sold 72 clips.", "#### 1000.00", "I think 6, no wait: #### 5", "5 or 6", "42"]
    assert gsm8k_answer_reward([""] * 5, completions, None, answer=answers) == [1.0, 1.0, 1.0, 0.0, None]
    # chat completions: the content of the last message
    assert gsm8k_answer_reward(["q"], [chat("Total: $72")], None, answer=["#### 72"]) == [1.0]


def test_arithmetic_rewards():
    completions = ["147", " 147\n", "75 + 72 = 147", "75 + 72 = 14", "147.0", "The answer is 147!", "-5"]
    answers = [147] * 6 + ["-5"]
    assert arithmetic_answer_reward([], completions, None, answer=answers) == [1, 1, 1, 0, 1, 1, 1]
    assert strict_arithmetic_reward([], completions, None, answer=answers) == [1, 1, 0, 0, 0, 0, 1]
    assert strict_number_format_reward([], completions, None) == [1, 1, 0, 0, 0, 0, 1]
    assert strict_number_format_reward([], [chat("12"), chat("12.")], None) == [1.0, 0.0]


def test_builtin_missing_column_errors():
    with pytest.raises(ValueError, match=r"gsm8k_answer_reward needs the dataset column 'answer'.*\['question'\]"):
        gsm8k_answer_reward(["q"], ["1"], None, question=["q"])
    with pytest.raises(ValueError, match=r"column 'answer' must hold one entry per completion \(2\)"):
        strict_arithmetic_reward(["q", "q"], ["1", "2"], None, answer=[1])


def test_weighted_sum_with_none():
    def fmt(prompts, completions, completion_ids, **kw):
        return [1.0, 0.0, None]

    def ans(prompts, completions, completion_ids, **kw):
        return [None, 1.0, 0.5]

    total, per = RewardFunctions([fmt, ans], weights=[0.5, 2.0])(["p"] * 3, ["a", "b", "c"], [[1], [2], [3]])
    # row 0: 0.5 * 1 (ans left out); row 1: 0.5 * 0 + 2 * 1; row 2: 2 * 0.5 (fmt left out)
    assert total.tolist() == [0.5, 2.0, 1.0]
    assert list(per) == ["fmt", "ans"]
    assert math.isnan(per["fmt"][2]) and per["fmt"][:2].tolist() == [1.0, 0.0]
    assert total.dtype == torch.float32


def test_import_paths_and_columns_passed_through():
    rf = RewardFunctions(["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards.strict_number_format_reward"])
    total, per = rf(["q1", "q2"], ["12", "13 "], [[1], [2]], answer=[12, 14])
    assert per["strict_arithmetic_reward"].tolist() == [1.0, 0.0]
    assert per["strict_number_format_reward"].tolist() == [1.0, 1.0]
    assert total.tolist() == [2.0, 1.0]


def test_all_none_row():
    def never(prompts, completions, completion_ids, **kw):
        return [None, 1.0]

    with pytest.raises(RewardError, match=r"Every reward function \['never'\] returned None for sample indices \[0\]"):
        RewardFunctions([never])(["p", "p"], ["a", "b"], None)
    with pytest.warns(UserWarning, match="total reward 0"):
        total, _ = RewardFunctions([never], allow_all_none=True)(["p", "p"], ["a", "b"], None)
    assert total.tolist() == [0.0, 1.0]


def test_function_errors_name_function_and_sample():
    def boom(prompts, completions, completion_ids, **kw):
        return [1.0 / len(c) for c in completions]  # ZeroDivisionError on the empty completion

    with pytest.raises(RewardError, match=r"Reward function 'boom' raised ZeroDivisionError: .* on sample 2 ") as e:
        RewardFunctions([boom])(["p"] * 3, ["a", "bb", ""], None)
    assert isinstance(e.value.__cause__, ZeroDivisionError)

    def short(prompts, completions, completion_ids, **kw):
        return [1.0]

    with pytest.raises(RewardError, match=r"'short' returned 1 values for 3 completions"):
        RewardFunctions([short])(["p"] * 3, ["a", "b", "c"], None)

    def nan(prompts, completions, completion_ids, **kw):
        return [0.0, float("nan")]

    with pytest.raises(RewardError, match=r"'nan' returned nan for sample 1"):
        RewardFunctions([nan])(["p"] * 2, ["a", "b"], None)

    def inf(prompts, completions, completion_ids, **kw):
        return [float("-inf"), 0.0]

    with pytest.raises(RewardError, match=r"'inf' returned -inf for sample 0"):
        RewardFunctions([inf])(["p"] * 2, ["a", "b"], None)

    def text(prompts, completions, completion_ids, **kw):
        return ["1", 0.0]

    with pytest.raises(RewardError, match=r"'text' returned '1' for sample 0"):
        RewardFunctions([text])(["p"] * 2, ["a", "b"], None)


def test_config_errors():
    with pytest.raises(RewardError, match="reward_weights has 1 entries but there are 2"):
        RewardFunctions([strict_number_format_reward, strict_arithmetic_reward], weights=[1.0])
    with pytest.raises(RewardError, match="Cannot import reward function 'lit_llm.rewards:nope'"):
        RewardFunctions(["lit_llm.rewards:nope"])
    with pytest.raises(RewardError, match="duplicate names"):
        RewardFunctions([strict_number_format_reward, strict_number_format_reward])
    with pytest.raises(RewardError, match="reward_funcs is empty"):
        RewardFunctions([])
    with pytest.raises(RewardError, match="finite numbers"):
        RewardFunctions([strict_number_format_reward], weights=[float("nan")])


@settings(max_examples=60, deadline=None)
@given(st.integers(-10**6, 10**6), st.sampled_from(["{:,}", "${:,}", "{}.0", "{}"]))
def test_gsm8k_formats_round_trip(n, fmt):
    completion = f"Some reasoning 3 + 4.\n#### {fmt.format(n)}"
    assert gsm8k_answer_reward(["q"], [completion], None, answer=[f"#### {n}"]) == [1.0]
    assert arithmetic_answer_reward(["q"], [f"so {fmt.format(n)}"], None, answer=[n]) == [1.0]


def test_concise_number_reward_hand_values():
    from lit_llm.rewards import concise_number_reward

    completions = ["85", " 85\n", "The answer is 85.", "60 + 25 = 85", "no idea", "", "-7"]
    expected = [1.0, 1.0, 2 / 17, 2 / 12, 0.0, 0.0, 1.0]
    assert concise_number_reward([None] * 7, completions) == pytest.approx(expected)
    chat = [[{"role": "assistant", "content": "It is 12"}]]
    assert concise_number_reward([None], chat) == pytest.approx([2 / 8])
