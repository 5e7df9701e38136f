"""resolve_environment: every spec form (class, factory, built-in name, import paths incl. file.py:Class relative to
the cwd, LightningCLI dict) gives a factory of fresh environments; each bad spec a clear error."""

from __future__ import annotations

import functools
import uuid

import pytest

from lit_llm.rollouts.envs import (
    CalculatorEnv,
    Environment,
    EnvironmentSpecError,
    EnvStep,
    GuessNumberEnv,
    builtin_environments,
    resolve_environment,
)

ENV_FILE = '''
from lit_llm.rollouts.envs import Environment, EnvStep


class EchoEnv(Environment):
    def __init__(self, reward: float = 1.0):
        self.reward = reward

    def step(self, messages):
        return EnvStep([], reward=self.reward, done=True)


def make_echo():
    return EchoEnv(0.5)


NOT_AN_ENV = 3
'''


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A fresh module name written in a temporary working directory."""
    name = f"user_envs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    return name


def fresh(factory):
    a, b = factory(), factory()
    assert a is not b  # one instance per episode
    return a


def test_builtin_names_and_classes():
    assert builtin_environments() == {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}
    assert resolve_environment("calculator") is CalculatorEnv
    assert resolve_environment(" guess_number ") is GuessNumberEnv
    assert resolve_environment(GuessNumberEnv) is GuessNumberEnv
    assert isinstance(fresh(resolve_environment("calculator")), CalculatorEnv)


def test_import_paths():
    assert resolve_environment("lit_llm.rollouts.envs:GuessNumberEnv") is GuessNumberEnv
    assert resolve_environment("lit_llm.rollouts.envs.calculator.CalculatorEnv") is CalculatorEnv


def test_module_and_file_from_the_working_directory(in_tmp):
    cls = resolve_environment(f"{in_tmp}:EchoEnv")
    assert cls.__name__ == "EchoEnv" and issubclass(cls, Environment)
    from_file = resolve_environment(f"{in_tmp}.py:EchoEnv")
    assert from_file.__name__ == "EchoEnv"
    assert fresh(from_file).step([]) == EnvStep([], 1.0, True)
    factory = resolve_environment(f"./{in_tmp}.py:make_echo")  # a factory function
    assert fresh(factory).reward == 0.5


def test_dict_specs_with_init_args(in_tmp):
    factory = resolve_environment({"class_path": f"{in_tmp}.py:EchoEnv", "init_args": {"reward": 0.25}})
    assert isinstance(factory, functools.partial)
    assert fresh(factory).step([]).reward == 0.25
    guess = fresh(resolve_environment({"class_path": "guess_number", "init_args": {"max_guesses": 3}}))
    assert (type(guess), guess.max_guesses) == (GuessNumberEnv, 3)
    calc = fresh(resolve_environment({"class_path": CalculatorEnv, "init_args": {"on_tool_error": "end"}}))
    assert calc.on_tool_error == "end"
    assert resolve_environment({"class_path": "lit_llm.rollouts.envs:CalculatorEnv"}) is CalculatorEnv


def test_factory_callables():
    factory = resolve_environment(lambda: GuessNumberEnv(max_guesses=2))
    assert fresh(factory).max_guesses == 2
    with pytest.raises(TypeError, match="returned int, not an environment"):
        resolve_environment(lambda: 3)()


def test_a_factory_with_required_arguments_fails_at_resolve_time(in_tmp):
    """A tool function given as the environment fails when the spec is resolved, not at the first episode."""
    fix = ("but an environment factory is called with none, once per episode. Point it at the Environment class, or "
           "at a function without required arguments that returns a fresh environment (a tool function goes in a "
           "ToolEnv subclass's tools list).")
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment("lit_llm.rollouts.envs:calculator")
    assert str(e.value) == ("Environment 'lit_llm.rollouts.envs:calculator' names the function calculator(expression), "
                            f"which needs the argument(s) ['expression'], {fix}")

    def make(level, *, seed):
        return GuessNumberEnv()
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment(make)
    assert str(e.value).startswith("Environment factory names the function make(level, *, seed), which needs the "
                                   "argument(s) ['level', 'seed'], ")
    assert fresh(resolve_environment(functools.partial(make, 1, seed=2))).max_guesses == 7  # bound: fine
    assert fresh(resolve_environment(f"{in_tmp}:make_echo")).reward == 0.5  # a zero-argument factory


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("calculater", r"Unknown environment 'calculater': not a built-in \(did you mean 'calculator'\?\)\. Built-in "
                       r"environments: \['calculator', 'guess_number'\]"),
        ("no_such_module_xyz:Env", r"Environment 'no_such_module_xyz:Env' could not be loaded: Import path "
                                   r"'no_such_module_xyz:Env': no module 'no_such_module_xyz'"),
        ("missing_dir/missing.py:Env", r"could not be loaded: File 'missing_dir/missing.py' of .* not found"),
        ("lit_llm.rollouts.envs:NopeEnv", r"Environment 'lit_llm.rollouts.envs:NopeEnv': module "
                                          r"'lit_llm.rollouts.envs' has no attribute 'NopeEnv'; its environment "
                                          r"classes are \['CalculatorEnv', 'Environment', 'GuessNumberEnv', "
                                          r"'ToolEnv'\]"),
        ("envs.py", r"names a file but no class; give 'envs.py:MyEnv'"),
        ("pkg.", r"must look like 'package.module:MyEnv'"),
        ("collections:OrderedDict", r"^Environment 'collections:OrderedDict' names the class OrderedDict, which "
                                    r"lacks reset\(row\) and step\(messages\), so it is not an environment\. "
                                    r"Subclass lit_llm\.rollouts\.envs\.Environment and write step\(messages\)"),
        ({"class_path": "calculator", "args": {}}, r"a dict needs 'class_path' .* unknown keys \['args'\]"),
        ({"init_args": {}}, r"a dict needs 'class_path'"),
        ({"class_path": "calculator", "init_args": {"max_guesses": 3}},
         r"CalculatorEnv does not take these init_args \(got an unexpected keyword argument 'max_guesses'\); its "
         r"parameters are \['tool_timeout', 'on_tool_error', 'tool_error_penalty', 'max_calls_per_turn'\]"),
        ({"class_path": "calculator", "init_args": [1]}, "'init_args' must be a mapping"),
        ({"class_path": "collections:OrderedDict"}, "'class_path' names the class OrderedDict, which lacks"),
        ({"class_path": "collections:namedtuple"}, "'class_path' must name an Environment class"),
    ],
)
def test_bad_specs(spec, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EnvironmentSpecError, match=match):
        resolve_environment(spec)


def test_file_attribute_that_is_not_an_environment(in_tmp):
    with pytest.raises(EnvironmentSpecError, match=r"resolved to 3, not an Environment class"):
        resolve_environment(f"{in_tmp}.py:NOT_AN_ENV")


RESET_ONLY = '''
class ResetOnly:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]
'''


def test_a_class_without_step_says_what_it_lacks_and_what_to_subclass(tmp_path, monkeypatch):
    (tmp_path / "reset_only.py").write_text(RESET_ONLY)
    monkeypatch.chdir(tmp_path)
    fix = ("so it is not an environment. Subclass lit_llm.rollouts.envs.Environment and write step(messages) -> "
           "EnvStep (reset(row) defaults to the row's prompt), or lit_llm.rollouts.envs.ToolEnv for a tool task (set "
           "its tools and write score(answer, row)).")
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment("reset_only.py:ResetOnly")
    assert str(e.value) == f"Environment 'reset_only.py:ResetOnly' names the class ResetOnly, which lacks " \
                           f"step(messages), {fix}"
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment({"class_path": "reset_only.py:ResetOnly"})
    assert str(e.value) == f"Environment spec {{'class_path': 'reset_only.py:ResetOnly'}}: 'class_path' names the " \
                           f"class ResetOnly, which lacks step(messages), {fix}"

    class Plain:
        pass
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment(Plain)
    assert str(e.value) == (f"Environment spec {Plain.__qualname__} names the class {Plain.__qualname__}, which lacks "
                            f"reset(row) and step(messages), {fix}")


def test_init_args_of_a_class_without_parameters():
    class NoArgs(Environment):
        def step(self, messages):
            return EnvStep([], done=True)
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment({"class_path": NoArgs, "init_args": {"bogus": 1}})
    assert str(e.value).endswith("NoArgs does not take these init_args (got an unexpected keyword argument "
                                 "'bogus'); it takes no arguments: drop 'init_args'.")


def test_instances_and_other_types_are_type_errors():
    with pytest.raises(TypeError, match="got an environment instance \\(GuessNumberEnv\\); each episode needs a fresh "
                                        "one: give the class GuessNumberEnv"):
        resolve_environment(GuessNumberEnv())
    with pytest.raises(TypeError, match="An environment spec must be an Environment class.* got int 42"):
        resolve_environment(42)


def test_envs_package_never_imports_lightning():
    import subprocess
    import sys

    code = ("import sys, lit_llm.rollouts.envs; "
            "print(sorted({m.split('.')[0] for m in sys.modules if 'lightning' in m}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # DESIGN.md layers: rollouts never import Lightning


def test_file_spec_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """An environment file given by path imports its sibling modules (its folder is appended to sys.path), from
    another working directory, also from inside its functions (the folder stays on sys.path)."""
    import sys

    helpers = f"helpers_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / f"{helpers}.py").write_text("CAP = 'Paris'\n")
    (folder / "env2.py").write_text(
        f"from {helpers} import CAP\nfrom lit_llm.rollouts.envs import Environment, EnvStep\n\n\n"
        "class E2(Environment):\n    def step(self, messages):\n"
        f"        from {helpers} import CAP as again\n"
        "        return EnvStep([], reward=float(messages[-1]['content'] == CAP == again), done=True)\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    env = resolve_environment("../dir/env2.py:E2")()
    assert env.step([{"role": "assistant", "content": "Paris"}]) == EnvStep([], 1.0, True)
    assert sys.path[-1] == str(folder.resolve())  # appended, after the installed packages
    (folder / "env3.py").write_text("import missing_helper_xyz\n")
    with pytest.raises(EnvironmentSpecError) as e:
        resolve_environment("../dir/env3.py:E3")
    assert str(e.value).startswith(
        f"Environment '../dir/env3.py:E3' could not be loaded: Running file '{folder.resolve() / 'env3.py'}' of "
        f"'../dir/env3.py:E3' raised ModuleNotFoundError: No module named 'missing_helper_xyz'. Install the module, "
        f"or put it beside the file (its folder {folder.resolve()} is on sys.path, after the installed packages). "
        f"(An environment spec is ")
    sys.modules.pop(helpers)
