"""Reward parsing, the built-in rewards, reward-function specs, required columns, trainer_state and the checked
weighted combination (TRL semantics)."""

from __future__ import annotations

import json
import math
import sys
import uuid
from decimal import Decimal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rewards import (
    RewardError,
    RewardFunctions,
    TrainerState,
    arithmetic_answer_reward,
    bare_number_closeness_curriculum_reward,
    bare_number_closeness_reward,
    bare_number_digit_reward,
    builtin_rewards,
    closeness_tolerance,
    concise_number_reward,
    extract_gsm8k_answer,
    gsm8k_answer_reward,
    last_number,
    normalize_number,
    required_columns,
    requires_columns,
    resolve_reward,
    strict_arithmetic_reward,
    strict_number_format_reward,
    tool_call_format_reward,
)

BUILTINS = ["arithmetic_answer_reward", "bare_number_closeness_curriculum_reward", "bare_number_closeness_reward",
            "bare_number_digit_reward", "concise_number_reward", "gsm8k_answer_reward",
            "strict_arithmetic_reward",
            "strict_number_format_reward", "tool_call_format_reward"]
# The answer / number-format built-ins the audits below run on bare text prompts (the tool reward needs known tools:
# its own tests are at the end of this file).
TEXT_BUILTINS = [n for n in BUILTINS if n != "tool_call_format_reward"]
ANSWER_REWARDS = [arithmetic_answer_reward, bare_number_closeness_curriculum_reward, bare_number_closeness_reward,
                  bare_number_digit_reward, gsm8k_answer_reward, strict_arithmetic_reward]


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
    answers = ["Work...\n#### 72", "#### 1,000", "#### 5", "#### 5", None, "#### 5"]
    completions = ["She sold 72 clips.", "#### 1000.00", "I think 6, no wait: #### 5", "5 or 6", "42", "no idea"]
    assert gsm8k_answer_reward([""] * 6, completions, None, answer=answers) == [1.0, 1.0, 1.0, 0.0, None, 0.0]
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


# ------------------------------------------------------------------ no built-in scores a missing answer as correct
def test_unparsable_reference_is_not_correct():
    """The issue's case: no number in the completion and 'Paris' as the answer used to compare None == None -> 1.0."""
    assert arithmetic_answer_reward(["q"], ["\n"], answer=["Paris"]) == [None]
    for fn in ANSWER_REWARDS:
        for ref in ["Paris", None, "", "  ", float("nan"), "####", True]:
            for completion in ["\n", "", "Paris", "no number", "12"]:
                assert fn(["q"], [completion], None, answer=[ref]) == [None], (fn.__name__, ref, completion)


def test_completion_without_answer_is_not_correct():
    for fn in ANSWER_REWARDS:
        assert fn(["q"] * 3, ["", "\n", "I don't know"], None, answer=["12", " 12 ", 12]) == [0.0, 0.0, 0.0]
    assert strict_number_format_reward(["q"] * 2, ["", "Paris"]) == [0.0, 0.0]
    assert concise_number_reward(["q"] * 2, ["", "Paris"]) == [0.0, 0.0]


no_digits = st.text(max_size=30).filter(lambda t: not any(c.isdigit() for c in t))


@settings(max_examples=150, deadline=None)
@given(ref=st.one_of(st.none(), no_digits, st.just(float("nan"))), completion=st.text(max_size=30))
def test_every_builtin_skips_a_reference_without_a_number(ref, completion):
    """Audit of the built-ins: a missing or digit-free reference is never scored, whatever the completion."""
    for name in TEXT_BUILTINS:
        fn = builtin_rewards()[name]
        got = fn(["q"], [completion], None, answer=[ref])
        if "answer" in required_columns(fn):
            assert got == [None], (name, ref, completion)
        else:  # format rewards do not read the answer
            assert got == fn(["q"], [completion], None), name


@settings(max_examples=150, deadline=None)
@given(ref=st.one_of(st.integers(-999, 999), st.text(max_size=20)), completion=no_digits)
def test_every_builtin_gives_nothing_to_a_completion_without_a_number(ref, completion):
    """Audit of the built-ins: a completion without a digit never scores above 0 (answer or format)."""
    for name in TEXT_BUILTINS:
        (value,) = builtin_rewards()[name](["q"], [completion], None, answer=[ref])
        assert value is None or value == 0.0, (name, ref, completion, value)


# ----------------------------------------------------------------------------------------------- specs
def test_builtin_names_resolve_and_unknown_names_list_them():
    assert sorted(builtin_rewards()) == BUILTINS
    assert resolve_reward("strict_arithmetic_reward") is strict_arithmetic_reward
    assert RewardFunctions(["gsm8k_answer_reward"]).funcs == [gsm8k_answer_reward]
    listed = r"Built-in reward functions: \['arithmetic_answer_reward', 'bare_number_closeness_curriculum_reward', " \
             r"'bare_number_closeness_reward', 'bare_number_digit_reward', " \
             r"'concise_number_reward', " \
             r"'gsm8k_answer_reward', 'strict_arithmetic_reward', 'strict_number_format_reward', " \
             r"'tool_call_format_reward'\]"
    with pytest.raises(RewardError, match=r"Unknown reward function 'accuracy_reward' \(a reward_funcs / "
                                          r"eval_reward_funcs entry\): not a built-in\. " + listed):
        RewardFunctions(["accuracy_reward"])
    with pytest.raises(RewardError, match=r"'lit_llm.rewards:nope': module 'lit_llm.rewards' has no attribute "
                                          r"'nope'\. " + listed):
        resolve_reward("lit_llm.rewards:nope")
    with pytest.raises(TypeError, match="must be a callable or a string"):
        resolve_reward(3)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty working folder that is not on sys.path (as a user's project folder under ``lit-llm fit``), with
    sys.path and the modules imported from it restored after the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        if str(tmp_path) in str(getattr(module, "__file__", "") or ""):
            del sys.modules[name]


REWARDS_PY = '''
def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [float(len(c)) for c in completions]

def _helper():
    return 0

LIMIT = 3
'''


def test_module_from_the_current_directory_without_pythonpath(user_folder):
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (user_folder / f"{name}.py").write_text(REWARDS_PY)
    with pytest.raises(ModuleNotFoundError):  # the folder is not importable as such (no PYTHONPATH=.)
        __import__(name)
    fn = resolve_reward(f"{name}:length_reward")
    assert fn(["q", "q"], ["ab", "abcd"]) == [2.0, 4.0]
    assert fn.__module__ == name  # imported as `python -m` would: same module name, importable again
    assert resolve_reward(f"{name}.length_reward") is fn
    # a package in the folder
    pkg = user_folder / f"pkg_{name}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(REWARDS_PY)
    total, _ = RewardFunctions([f"pkg_{name}.scores:length_reward"])(["q"], ["abc"], None)
    assert total.tolist() == [3.0]


def test_module_errors_name_the_spec_and_the_fix(user_folder):
    name = f"absent_{uuid.uuid4().hex[:8]}"
    with pytest.raises(RewardError, match=rf"Reward function '{name}:fn' \(a reward_funcs / eval_reward_funcs "
                                          rf"entry\): no module '{name}'; tried importing it \(it is not installed\) "
                                          rf"and the current directory .* \(no {name}\.py .*'path/to/{name}\.py:fn'"):
        resolve_reward(f"{name}:fn")
    broken = f"broken_{uuid.uuid4().hex[:8]}"
    (user_folder / f"{broken}.py").write_text("import not_a_real_dependency_xyz\n")
    with pytest.raises(RewardError, match=rf"Importing module '{broken}' .* No module named "
                                          r"'not_a_real_dependency_xyz' \(a module it imports is missing"):
        resolve_reward(f"{broken}:fn")
    lacking = f"lacking_{uuid.uuid4().hex[:8]}"
    (user_folder / f"{lacking}.py").write_text(REWARDS_PY)
    with pytest.raises(RewardError, match=r"has no attribute 'nope'\. Its functions: \['length_reward'\]"):
        resolve_reward(f"{lacking}:nope")
    with pytest.raises(TypeError, match="resolved to a non-callable int"):
        resolve_reward(f"{lacking}:LIMIT")


def test_file_path_spec_imports_the_modules_beside_it(user_folder):
    """The shared file loader appends the file's folder to sys.path: a reward file imports its sibling modules."""
    helpers = f"reward_helpers_{uuid.uuid4().hex[:8]}"
    sub = user_folder / "rewards_dir"
    sub.mkdir()
    (sub / f"{helpers}.py").write_text("BONUS = 0.5\n")
    (sub / "scored.py").write_text(f"from {helpers} import BONUS\n\n\ndef bonus_reward(prompts, completions, "
                                   f"**kwargs):\n    return [BONUS + len(c) for c in completions]\n")
    assert resolve_reward("rewards_dir/scored.py:bonus_reward")(["q"], ["abc"]) == [3.5]
    assert sys.path[-1] == str(sub.resolve())


def test_file_path_specs(user_folder, tmp_path_factory):
    sub = user_folder / "my rewards"
    sub.mkdir()
    (sub / "rewards.py").write_text(REWARDS_PY + "\nfrom dataclasses import dataclass\n\n@dataclass\nclass D:\n"
                                                "    x: int = 1\n")
    fn = resolve_reward("my rewards/rewards.py:length_reward")
    assert fn(["q"], ["abcde"]) == [5.0]
    absolute = resolve_reward(f"{sub / 'rewards.py'}:length_reward")
    assert absolute is fn  # one stable module per file, loaded once
    assert sys.modules[fn.__module__].D().x == 1  # registered before running (dataclasses look it up)
    assert fn.__module__.startswith("lit_llm_reward_file_rewards_")
    other = tmp_path_factory.mktemp("elsewhere") / "rewards.py"
    other.write_text(REWARDS_PY.replace("len(c)", "2 * len(c)"))
    assert resolve_reward(f"{other}:length_reward")(["q"], ["ab"]) == [4.0]  # same stem, different module
    with pytest.raises(RewardError, match=r"Reward function file 'nowhere/r\.py' of 'nowhere/r\.py:fn' not found "
                                          r"\(looked for .*nowhere/r\.py; a relative path is taken from the current "
                                          r"directory"):
        resolve_reward("nowhere/r.py:fn")
    with pytest.raises(RewardError, match=r"'my rewards/rewards\.py' names a file but no function; give "
                                          r"'my rewards/rewards\.py:function_name'"):
        resolve_reward("my rewards/rewards.py")
    (user_folder / "bad.py").write_text("raise RuntimeError('oops')\n")
    with pytest.raises(RewardError, match=r"Running reward function file '.*bad\.py' of 'bad\.py:fn' raised "
                                          r"RuntimeError: oops"):
        resolve_reward("bad.py:fn")
    with pytest.raises(RewardError, match=r"file 'my rewards/rewards.py' has no attribute 'nope'\. Its functions: "
                                          r"\['length_reward'\]"):
        resolve_reward("my rewards/rewards.py:nope")


# ------------------------------------------------------------------------------------- required columns
def test_required_columns_from_signatures_and_declarations():
    def plain(prompts, completions, completion_ids, trainer_state, answer, level, weight=1.0, **kwargs):
        return [0.0] * len(completions)

    def keyword_only(prompts, completions, *, solution, hint=None, **kwargs):
        return [0.0] * len(completions)

    @requires_columns("answer")
    def declared(prompts, completions, completion_ids=None, *, source, **kwargs):
        return [0.0] * len(completions)

    class Scorer:
        def __call__(self, prompts, completions, ground_truth, **kwargs):
            return [0.0] * len(completions)

    assert required_columns(plain) == ("answer", "level")
    assert required_columns(keyword_only) == ("solution",)
    assert required_columns(declared) == ("answer", "source")
    assert required_columns(Scorer()) == ("ground_truth",)
    assert required_columns(len) == ()  # no signature to read
    assert {n: required_columns(f) for n, f in builtin_rewards().items()} == {
        "arithmetic_answer_reward": ("answer",), "bare_number_closeness_curriculum_reward": ("answer",),
        "bare_number_closeness_reward": ("answer",), "bare_number_digit_reward": ("answer",),
        "concise_number_reward": (), "gsm8k_answer_reward": ("answer",),
        "strict_arithmetic_reward": ("answer",), "strict_number_format_reward": (), "tool_call_format_reward": ()}


def test_check_columns_names_function_column_and_dataset_columns():
    def needs_level(prompts, completions, completion_ids, level, **kwargs):
        return [float(x) for x in level]

    rf = RewardFunctions([strict_number_format_reward, gsm8k_answer_reward, needs_level])
    assert rf.required_columns == {"strict_number_format_reward": (), "gsm8k_answer_reward": ("answer",),
                                   "needs_level": ("level",)}
    rf.check_columns(["answer", "level", "extra"])
    with pytest.raises(RewardError, match=r"^reward function 'gsm8k_answer_reward' needs the column 'answer'; reward "
                                          r"function 'needs_level' needs the column 'level', but the held-out prompts "
                                          r"has only the columns \['question'\]\. Add the column"):
        rf.check_columns(["question"], source="the held-out prompts")


# ------------------------------------------------------------------------------------------ trainer_state
def test_trainer_state_reaches_every_function():
    seen = []

    def record(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.append(trainer_state)
        return [float(trainer_state.global_step)] * len(completions)

    def schedule(prompts, completions, completion_ids, **kwargs):  # TRL style: read it from kwargs
        state = kwargs["trainer_state"]
        return [state.global_step / state.max_steps] * len(completions)

    state = TrainerState(global_step=3, epoch=0.5, max_steps=12)
    total, per = RewardFunctions([record, schedule])(["p"] * 2, ["a", "b"], None, trainer_state=state, answer=[1, 2])
    assert seen == [state] and seen[0] is state
    assert per["schedule"].tolist() == [0.25, 0.25] and total.tolist() == [3.25, 3.25]
    RewardFunctions([record])(["p"], ["a"], None)  # outside training: the default state
    assert seen[-1] == TrainerState(global_step=0, epoch=0.0, max_steps=0)
    with pytest.raises(AttributeError):
        state.global_step = 4  # frozen: a reward function cannot move the trainer


# ------------------------------------------------------------------------------------------ tool-call format
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                         "parameters": {"type": "object", "required": ["expression"], "properties": {
                                             "expression": {"type": "string", "description": "the expression"}}}}}
TOOLS_PROMPT = [{"role": "system", "content": "Tools in <tools></tools> tags:\n<tools>\n" + json.dumps(CALC)
                 + "\n</tools>\nCall with <tool_call></tool_call>."}, {"role": "user", "content": "What is 2 * 3?"}]


def call(name="calculator", args='{"expression": "2 * 3"}'):
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def test_tool_call_format_reward_hand_values():
    """Tools from the prompt's <tools> block; one value per completion, written by hand."""
    completions = [
        call(),                                                          # a string completion with a valid call
        [{"role": "assistant", "content": call()}, {"role": "tool", "name": "calculator", "content": "6"},
         {"role": "assistant", "content": "6"}],                         # a whole episode
        [{"role": "assistant", "content": "It is 6."}],                  # no call
        [{"role": "assistant", "content": call(name="calc")}],           # unknown tool
        [{"role": "assistant", "content": call(args='{"expression": 6}')}],      # wrong argument type
        [{"role": "assistant", "content": call(args="{}")}],             # missing required argument
        [{"role": "assistant", "content": call(args='{"expression": "1", "x": 2}')}],  # unknown argument
        [{"role": "assistant", "content": "<tool_call>{not json}</tool_call>"},
         {"role": "tool", "content": "Error"}, {"role": "assistant", "content": call()}],  # bad turn, then good
        [{"role": "assistant", "content": "<tool_call>{not json}</tool_call>"}],  # bad markup only
        [{"role": "user", "content": call()}, {"role": "tool", "content": call()},
         {"role": "assistant", "content": "6"}],                         # calls outside assistant turns: ignored
        [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "2*3"}}}]}],  # structured call
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "calculator", "arguments": '{"expression": "2*3"}'}}]}],  # structured, arguments as JSON text
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "calculator", "arguments": "{oops"}}]}],              # structured, unreadable arguments
        '{"name": "calculator", "parameters": {"expression": "2 * 3"}}',  # Llama-3.1's bare JSON call
    ]
    expected = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert tool_call_format_reward([TOOLS_PROMPT] * len(completions), completions) == expected


def tool(expression: str) -> str:
    """Evaluate.

    Args:
        expression: the expression.
    """
    return expression


def test_tool_call_format_reward_tools_column():
    """The ``tools`` column (schemas, JSON text, functions) wins over the prompt; an empty list knows no tool; a
    call of a tool the row does not offer is 0.0."""
    good, named_tool = call(), call(name="tool", args='{"expression": "x"}')
    prompts = [[{"role": "user", "content": "q"}]] * 5
    got = tool_call_format_reward(prompts, [good, good, named_tool, good, good],
                                  tools=[[CALC], json.dumps([CALC]), [tool], [], [tool]])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert tool_call_format_reward([TOOLS_PROMPT], [good], tools=[None]) == [1.0]  # None entry: the prompt's tools


def test_tool_call_format_reward_errors():
    with pytest.raises(RewardError, match=r"row 0 has no known tools: no 'tools' column entry and no "
                                          r"<tools>\.\.\.</tools> block in its prompt\. Fix: add a 'tools' column"):
        tool_call_format_reward(["What is 2 * 3?"], [call()])
    with pytest.raises(RewardError, match=r"row 0: the 'tools' column must be a list of tool schemas"):
        tool_call_format_reward(["q"], [call()], tools=[CALC])
    with pytest.raises(RewardError, match=r"row 0: 3 in the 'tools' column is not a tool schema"):
        tool_call_format_reward(["q"], [call()], tools=[[3]])
    with pytest.raises(RewardError, match=r"row 0: the 'tools' column is a string but not JSON"):
        tool_call_format_reward(["q"], [call()], tools=["[oops"])
    with pytest.raises(ValueError, match=r"column 'tools' must hold one entry per completion \(2\)"):
        tool_call_format_reward(["q", "q"], [call(), call()], tools=[[CALC]])
    assert resolve_reward("tool_call_format_reward") is tool_call_format_reward
    total, per_fn = RewardFunctions(["tool_call_format_reward"])([TOOLS_PROMPT] * 2, [call(), "6"], None)
    assert total.tolist() == [1.0, 0.0]


def test_bare_number_closeness_reward_exact_values():
    # 1 - |x - a| / max(|a|, 1) for a bare integer, clipped at 0; 0 for anything that is not a bare integer.
    completions = ["82", "80", "41", "192", "43 + 39 = 82", " 82\n", "82.", "-82", "0", "3"]
    answers = ["82"] * 8 + ["0", "0"]
    got = bare_number_closeness_reward([], completions, None, answer=answers)
    assert got == [1.0, 1.0 - 2 / 82, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert bare_number_closeness_reward([], [chat("85"), "7"], None, answer=["-10", None]) == [0.0, None]


def test_bare_number_digit_reward_exact_values():
    # share of digit positions (units up, over the longer number) that agree; sign must agree; text scores 0
    completions = ["82", "12", "80", "182", "28", "2", "43 + 39 = 82", " 82\n", "82.", "-82", "100", "100", "-7", "0"]
    answers = ["82"] * 10 + ["103", "82", "-17", "0"]
    got = bare_number_digit_reward([], completions, None, answer=answers)
    assert got == [1.0, 1 / 2, 1 / 2, 2 / 3, 0.0, 1 / 2, 0.0, 1.0, 0.0, 0.0, 2 / 3, 0.0, 1 / 2, 1.0]
    assert bare_number_digit_reward([], [chat("85"), "7"], None, answer=["85", None]) == [1.0, None]


def test_bare_number_digit_reward_gives_a_constant_guess_less_than_the_units_digit():
    # the constant-guess optimum of the closeness reward (issue 17): "100" for every 2-digit sum vs a policy that only
    # gets the units digit right (tens and hundreds wrong), over all sums a + b with a, b in 10..99
    sums = [a + b for a in range(10, 100) for b in range(10, 100)]
    constant = sum(bare_number_digit_reward([], ["100"] * len(sums), None, answer=[str(x) for x in sums])) / len(sums)
    units_only = [str((x % 10) + 10 * ((x // 10 + 5) % 10)) if x < 100 else str(200 + x % 10) for x in sums]
    computed = sum(bare_number_digit_reward([], units_only, None, answer=[str(x) for x in sums])) / len(sums)
    closeness = sum(bare_number_closeness_reward([], ["100"] * len(sums), None, answer=[str(x) for x in sums]))
    assert constant < 0.3 < closeness / len(sums)
    assert computed > constant


def test_bare_number_closeness_curriculum_narrows_the_window():
    # tolerance s: 1.0 at step 0, linear to 0.1 at step 20, then 0.1; reward max(0, 1 - |x - a| / (s * |a|)).
    assert [closeness_tolerance(t) for t in (0, 10, 20, 100)] == [1.0, 1.0 - 0.9 * 10 / 20, 0.1, 0.1]
    assert closeness_tolerance(-3) == 1.0
    completions, answers = ["80", "105", "100", "1 + 1"], ["100"] * 4
    at = {t: bare_number_closeness_curriculum_reward([], completions, None, trainer_state=TrainerState(global_step=t),
                                                     answer=answers) for t in (0, 10, 20, 40)}
    assert at[0] == [0.8, 0.95, 1.0, 0.0]
    assert at[10] == pytest.approx([1 - 20 / 55, 1 - 5 / 55, 1.0, 0.0], rel=1e-12)  # s = 0.55
    assert at[20] == pytest.approx([0.0, 1 - 5 / 10, 1.0, 0.0], rel=1e-12)  # s = 0.1
    assert at[40] == at[20]
    assert bare_number_closeness_curriculum_reward([], ["90"], None, answer=["100"]) == [0.9]  # no trainer_state


def test_reward_function_without_kwargs_gets_an_error_listing_the_keywords():
    def only_completions(completions):
        return [1.0] * len(completions)

    def raises_type_error_inside(completions, **kwargs):
        return [len(None) for _ in completions]  # a TypeError of the body, not of the signature

    rf = RewardFunctions([only_completions])
    with pytest.raises(RewardError, match=r"'only_completions' does not accept the keywords it is called with .*"
                                          r"\['prompts', 'completions', 'completion_ids', 'trainer_state', 'answer'\]"
                                          r".*add \*\*kwargs .* def only_completions\(completions, \*\*kwargs\)"):
        rf(prompts=["q"], completions=["1"], completion_ids=None, answer=["1"])
    with pytest.raises(RewardError, match=r"'raises_type_error_inside' raised TypeError: .* on sample 0"):
        RewardFunctions([raises_type_error_inside])(prompts=["q"], completions=["1"], completion_ids=None)
