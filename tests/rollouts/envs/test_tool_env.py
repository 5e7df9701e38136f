"""ToolEnv's step logic: tool turns, the final answer, and every kind of tool error under on_tool_error
"continue" / "end" with a penalty; it never raises for model output."""

from __future__ import annotations

import threading
import time

import pytest

from lit_llm.rollouts.envs import EnvStep, Tool, ToolCall, ToolEnv, ToolResult

RELEASE = threading.Event()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def fail(x: int) -> int:
    """Always fail.

    Args:
        x: ignored.
    """
    raise KeyError(x)


def hang(x: int) -> int:
    """Hang until the test releases it.

    Args:
        x: returned.
    """
    RELEASE.wait(30)
    return x


class AddEnv(ToolEnv):
    tools = [add, fail, hang]
    required_columns = ("answer",)

    def score(self, answer, row):
        return float(answer.strip() == str(row["answer"]))


@pytest.fixture(autouse=True)
def release_hung_tools():
    RELEASE.clear()
    yield
    RELEASE.set()


ROW = {"prompt": "What is 2 + 3?", "answer": 5}


def turn(env, text, history=None):
    history = history if history is not None else env.reset(ROW)
    return env.step(history + [{"role": "assistant", "content": text}])


def call(name, **arguments):
    return ToolCall(name, arguments).to_text()


def strip_times(step: EnvStep) -> EnvStep:
    info = dict(step.info)
    assert info.pop("tool_time", 0.0) >= 0.0
    info["tool_results"] = [ToolResult(r.name, r.content, r.error) for r in info.get("tool_results", [])]
    return EnvStep(step.messages, step.reward, step.done, info)


def test_reset_returns_the_prompt_and_keeps_the_row():
    env = AddEnv()
    assert env.reset(ROW) == [{"role": "user", "content": "What is 2 + 3?"}]
    assert env.row is ROW
    assert [t.name for t in env.tools] == ["add", "fail", "hang"]


def test_tool_turn_then_final_answer():
    env = AddEnv()
    history = env.reset(ROW)
    history.append({"role": "assistant", "content": "Let me add. " + call("add", a=2, b=3)})
    step = env.step(history)
    assert strip_times(step) == EnvStep([{"role": "tool", "name": "add", "content": "5"}], 0.0, False,
                                        {"tool_calls": 1, "tool_errors": 0,
                                         "tool_results": [ToolResult("add", "5")]})
    history += step.messages + [{"role": "assistant", "content": "5"}]
    assert env.step(history) == EnvStep([], 1.0, True, {"reason": "answer"})
    assert turn(AddEnv(), "6") == EnvStep([], 0.0, True, {"reason": "answer"})


def test_errors_continue_with_a_penalty_per_failing_call():
    env = AddEnv(tool_timeout=0.05, tool_error_penalty=0.25)
    text = call("add", a=1, b=2) + call("fail", x=3) + call("nope") + call("add", a="1", b=2) + call("hang", x=1)
    start = time.perf_counter()
    step = strip_times(turn(env, text))
    assert time.perf_counter() - start < 5.0  # the hung call was abandoned after 0.05 s
    bad_args = ('Error: bad arguments for add: argument a must be integer, got "1". add takes (a: integer, '
                'b: integer).')
    results = [ToolResult("add", "3"), ToolResult("fail", "Error: fail raised KeyError: 3", "exception"),
               ToolResult("nope", "Error: unknown tool 'nope'; the tools are ['add', 'fail', 'hang'].",
                          "unknown_tool"),
               ToolResult("add", bad_args, "bad_arguments"),
               ToolResult("hang", "Error: hang timed out after 0.05 s and was stopped.", "timeout")]
    assert step == EnvStep([r.message for r in results], -1.0, False,
                           {"tool_calls": 5, "tool_errors": 4, "tool_results": results})


@pytest.mark.parametrize(
    ("text", "reason", "ran"),
    [
        (call("add", a=1, b=2) + call("fail", x=3) + call("add", a=1, b=1), "tool_error", 2),
        (call("hang", x=1) + call("add", a=1, b=1), "tool_timeout", 1),
        (call("nope"), "tool_error", 1),
        (call("add", a=1), "tool_error", 1),
        ("<tool_call>{not json}</tool_call>", "parse_error", 1),
    ],
)
def test_on_tool_error_end_stops_at_the_first_failure(text, reason, ran):
    step = turn(AddEnv(on_tool_error="end", tool_error_penalty=0.5, tool_timeout=0.05), text)
    assert (step.messages, step.reward, step.done, step.info["reason"]) == ([], -0.5, True, reason)
    assert (step.info["tool_calls"], step.info["tool_errors"], len(step.info["tool_results"])) == (ran, 1, ran)


def test_parse_error_continues_as_a_tool_message():
    body = '{"name": "add", "arguments": {"a": 1,}}'
    step = strip_times(turn(AddEnv(), f"<tool_call>{body}</tool_call>"))
    assert body.index(",}") + 1 == 37  # where the JSON decoder stops, counted from the start of the JSON
    content = ("Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at "
               "character 37): '{\"name\": \"add\", \"arguments\": {\"a\": 1,}}'. Write <tool_call>{\"name\": ..., "
               "\"arguments\": {...}}</tool_call>.")
    assert step == EnvStep([{"role": "tool", "name": "invalid_tool_call", "content": content}], 0.0, False,
                           {"tool_calls": 1, "tool_errors": 1,
                            "tool_results": [ToolResult("invalid_tool_call", content, "parse_error")]})


def test_too_many_calls_in_one_turn():
    step = strip_times(turn(AddEnv(max_calls_per_turn=2), call("add", a=1, b=1) * 3))
    assert [m["content"] for m in step.messages] == ["2", "2", "Error: 3 tool calls in one turn; only the first 2 "
                                                               "were run."]
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (3, 1)


def test_refused_calls_count_as_calls_and_errors():
    """0 <= tool_errors <= tool_calls: a failing first call and a refused second one are 2 calls, 2 errors."""
    from lit_llm.rollouts.envs import CalculatorEnv

    env = CalculatorEnv(max_calls_per_turn=1, tool_error_penalty=0.5)
    env.reset({"prompt": "q", "answer": "1"})
    text = ToolCall("calculator", {"expression": "1/0"}).to_text() + ToolCall("calculator", {"expression": "2+2"}
                                                                            ).to_text()
    step = env.step([{"role": "assistant", "content": text}])
    assert {k: step.info[k] for k in ("tool_calls", "tool_errors")} == {"tool_calls": 2, "tool_errors": 2}
    assert step.reward == -1.0 and len(step.messages) == 2
    step = turn(AddEnv(max_calls_per_turn=1), call("add", a=1, b=1) * 4)
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (4, 3)


def test_subclass_reset_keeps_the_row_and_programming_errors_raise():
    class Custom(AddEnv):
        def reset(self, row):
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}]

    env = Custom()
    with pytest.raises(ValueError, match=r"step\(\) before reset\(row\)"):
        env.step([{"role": "assistant", "content": "5"}])
    assert turn(env, "5").reward == 1.0  # the wrapped reset kept the row for score
    with pytest.raises(ValueError, match="must end with the model's assistant message, got 'user' last"):
        env.step([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="content must be a str"):
        env.step([{"role": "assistant", "content": None}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"tool_timeout": 0}, "tool_timeout must be > 0"), ({"on_tool_error": "stop"}, "on_tool_error must be"),
     ({"tool_error_penalty": -1}, "tool_error_penalty must be a finite number >= 0"),
     ({"max_calls_per_turn": 0}, "max_calls_per_turn must be an integer >= 1")],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AddEnv(**kwargs)


def test_score_must_be_implemented():
    class NoScore(ToolEnv):
        tools = [add]

    with pytest.raises(NotImplementedError, match="NoScore must implement score"):
        turn(NoScore(), "5")


class PeekEnv(ToolEnv):
    """Tools written in the class body: a method (bound per instance), a Tool of a method (its timeout kept), a
    staticmethod and a classmethod."""

    prefix = "cls:"

    def __init__(self, secret: str = "abcdef", **kwargs):
        self.secret = secret
        super().__init__(**kwargs)

    def peek(self, n: int) -> str:
        """The first n letters of the secret.

        Args:
            n: how many letters.
        """
        return self.secret[:n]

    def last(self, n: int) -> str:
        """The last n letters of the secret.

        Args:
            n: how many letters.
        """
        return self.secret[-n:]

    @staticmethod
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: the text.
        """
        return text.upper()

    @classmethod
    def tag(cls, text: str) -> str:
        """Tag a text with the class prefix.

        Args:
            text: the text.
        """
        return cls.prefix + text

    tools = [peek, Tool(last, timeout=2.5), shout, tag]

    def score(self, answer, row):
        return float(answer == self.secret)


def test_methods_listed_in_the_class_body_are_bound_to_each_instance():
    env = PeekEnv("xyz123")
    assert [t.name for t in env.tools] == ["peek", "last", "shout", "tag"]
    assert env.tools[1].timeout == 2.5 and PeekEnv.tools[1].fn is PeekEnv.__dict__["last"]  # the class list kept
    text = call("peek", n=2) + call("last", n=3) + call("shout", text="hi") + call("tag", text="t")
    step = strip_times(turn(env, text))
    assert step.messages == [{"role": "tool", "name": "peek", "content": "xy"},
                             {"role": "tool", "name": "last", "content": "123"},
                             {"role": "tool", "name": "shout", "content": "HI"},
                             {"role": "tool", "name": "tag", "content": "cls:t"}]
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (4, 0)
    assert turn(PeekEnv("qq"), call("peek", n=1)).messages[0]["content"] == "q"  # each instance its own self
    assert turn(env, "xyz123") == EnvStep([], 1.0, True, {"reason": "answer"})


def test_class_body_methods_are_bound_without_toolenv_init():
    class NoInit(ToolEnv):  # a subclass that never calls ToolEnv.__init__: bound on first step
        def __init__(self):
            self.secret = "hello"

        peek = PeekEnv.peek
        tools = [peek]

        def score(self, answer, row):
            return 0.0

    assert turn(NoInit(), call("peek", n=4)).messages == [{"role": "tool", "name": "peek", "content": "hell"}]


def test_a_self_function_of_another_class_is_a_clear_error():
    class Other(ToolEnv):
        tools = [PeekEnv.peek]  # takes self, but an Other is no PeekEnv

        def score(self, answer, row):
            return 0.0

    with pytest.raises(TypeError) as e:
        Other()
    assert str(e.value) == (
        "Other: tool 'peek' (PeekEnv.peek) takes `self` first but is not a method of Other, so it cannot be bound to "
        "the environment. List the bound method in __init__ (`self.tools = [self.peek]` after super().__init__()), "
        "or make it a @staticmethod without `self`.")


@pytest.mark.parametrize("listed", ["class_body", "bound_in_init", "schemas_of_a_bound_method"])
def test_the_tool_cache_keeps_no_environment_alive(listed):
    """Tools and schemas are cached per plain function; a bound method (one per environment, per episode) is not
    cached, so a finished episode's environment is freed."""
    import gc
    import weakref

    from lit_llm.rollouts.envs import tool_schemas

    class InitEnv(PeekEnv):
        def __init__(self):
            super().__init__("abc")
            self.tools = [self.peek]

    env = PeekEnv("abc") if listed == "class_body" else InitEnv()
    assert turn(env, call("peek", n=1)).messages[0]["content"] == "a"
    if listed == "schemas_of_a_bound_method":  # what the renderer asks of a plain Environment's tools
        assert tool_schemas([env.peek])[0]["function"]["parameters"]["required"] == ["n"]
    ref = weakref.ref(env)
    del env
    gc.collect()
    assert ref() is None


class Scored(AddEnv):
    """score returns whatever the test put in ``value``."""

    value = None

    def score(self, answer, row):
        return self.value


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), (0.5, 0.5), (-2, -2.0)])
def test_score_of_a_real_number_is_the_reward(value, expected):
    import numpy as np

    for v in (value, np.float32(value), np.float64(value), *([np.int64(value)] if isinstance(value, int) else [])):
        env = Scored()
        env.value = v
        step = turn(env, "5")
        assert step == EnvStep([], expected, True, {"reason": "answer"}) and type(step.reward) is float


@pytest.mark.parametrize(("value", "error", "message"), [
    (None, TypeError, "Scored.score must return a real number (the reward of the final answer), got NoneType None "
                      "for the answer 'final 5'; return a float (e.g. 1.0 for a correct answer, 0.0 otherwise) on "
                      "every path."),
    (True, TypeError, "Scored.score must return a real number (the reward of the final answer), got bool True for "
                      "the answer 'final 5'; return a float (e.g. 1.0 for a correct answer, 0.0 otherwise) on every "
                      "path."),
    ("1.0", TypeError, "Scored.score must return a real number (the reward of the final answer), got str '1.0' for "
                       "the answer 'final 5'; return a float (e.g. 1.0 for a correct answer, 0.0 otherwise) on every "
                       "path."),
    (float("nan"), ValueError, "Scored.score returned nan for the answer 'final 5'; rewards must be finite numbers."),
    (float("-inf"), ValueError, "Scored.score returned -inf for the answer 'final 5'; rewards must be finite "
                                "numbers."),
])
def test_score_of_anything_else_is_an_error_naming_it(value, error, message):
    env = Scored()
    env.value = value
    with pytest.raises(error) as e:
        turn(env, "final 5")
    assert str(e.value) == message
