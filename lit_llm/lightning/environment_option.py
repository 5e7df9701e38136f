"""The ``environment`` option of :class:`~lit_llm.lightning.grpo.GRPOModule`: its value as jsonargparse reads it
(:class:`EnvironmentConfig`), its import (or not, :func:`environment_unresolved`), its checkpoint form
(:func:`environment_hparam`) and the check of a built-in environment against a built-in task
(:func:`check_environment_task`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from lit_llm.lightning.grpo_data import BUILTIN_TASKS, ENVIRONMENT_TASKS
from lit_llm.rollouts.envs import EnvironmentSpecError, builtin_environment_name, resolve_environment

__all__ = ["EnvironmentConfig", "EnvironmentSpec", "check_environment_task", "environment_factory",
           "environment_hparam", "environment_unresolved", "user_code_unresolved"]

#: An environment spec (:func:`~lit_llm.rollouts.envs.resolve_environment`): a built-in name, an import path, a
#: ``{"class_path": ..., "init_args": {...}}`` dict (or, in Python, a class or factory).
EnvironmentSpec = str | dict[str, Any]


class EnvironmentConfig:
    """An ``environment`` value from a config file or the command line (a string or a ``{class_path, init_args}``
    dict), held as given until :class:`GRPOModule` unwraps it (:attr:`spec`).

    Why a wrapper: jsonargparse treats any dict with ``class_path`` + ``init_args`` inside a subclass's init args as a
    class spec of its own and imports ``class_path`` with plain ``__import__`` when it merges configs, so
    ``{class_path: my_agent.MyEnv, init_args: ...}`` failed with ``No module named 'my_agent'`` for a module in the
    current directory and ``my_agent:MyEnv`` / ``path/to/file.py:MyEnv`` failed as import paths. Registered as a
    jsonargparse type (its value serializes back to the plain spec in ``--print_config`` and saved configs), the
    spec reaches :func:`~lit_llm.rollouts.envs.resolve_environment` untouched, whose loader puts the cwd first.
    """

    __slots__ = ("spec",)

    def __init__(self, spec: EnvironmentSpec) -> None:
        if isinstance(spec, EnvironmentConfig):
            spec = spec.spec
        if not isinstance(spec, (str, dict)):
            raise ValueError(f"environment must be a built-in name, an import path 'my_agent:MyEnv' or a "
                             f"{{class_path: ..., init_args: {{...}}}} mapping, got {type(spec).__name__} "
                             f"{spec!r:.80}.")
        self.spec = spec

    def __repr__(self) -> str:
        return f"EnvironmentConfig({self.spec!r})"

    def __str__(self) -> str:
        """The spec as given (what the CLI's error hint shows after the option)."""
        return str(self.spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnvironmentConfig) and other.spec == self.spec

    __hash__ = None  # type: ignore[assignment]


def _register_environment_config() -> None:
    from jsonargparse.typing import register_type

    register_type(EnvironmentConfig, serializer=lambda c: c.spec, deserializer=EnvironmentConfig)


_register_environment_config()


_ENVIRONMENT_UNRESOLVED: contextvars.ContextVar[bool] = contextvars.ContextVar("lit_llm_environment_unresolved",
                                                                               default=False)


@contextlib.contextmanager
def environment_unresolved() -> Iterator[None]:
    """Within this context, :class:`GRPOModule` keeps its ``environment`` spec (and its ``objective``) without
    importing it: what loading a checkpoint for its weights alone needs (``lit-llm export``, ``chat``, ``evaluate``; see
    :func:`lit_llm.lightning.export.load_checkpoint_module`), from a folder where the environment's module is not
    importable. The module's ``env_factory`` then raises ``RuntimeError`` when called (episodes need the
    environment), and ``hparams["environment"]`` stays as saved."""
    token = _ENVIRONMENT_UNRESOLVED.set(True)
    try:
        yield
    finally:
        _ENVIRONMENT_UNRESOLVED.reset(token)


def user_code_unresolved() -> bool:
    """Whether the module is being built inside :func:`environment_unresolved` (weights-only loading): then neither
    the ``environment`` nor a user's ``objective`` (:func:`~lit_llm.lightning.grpo_options.build_objective` falls
    back to the built-in objective) is imported."""
    return _ENVIRONMENT_UNRESOLVED.get()


def _unresolved_factory(spec: Any) -> Callable[[], Any]:
    def make() -> Any:
        raise RuntimeError(f"GRPOModule: this module was loaded for its weights only, without importing its "
                           f"environment {spec!r:.100} (environment_unresolved); rebuild it outside that context (e.g. "
                           f"lit-llm fit / validate from the run's folder) to run episodes.")
    return make


def environment_hparam(spec: Any) -> Any:
    """``spec`` as the module's ``environment`` hyperparameter: a class or function (also a dict's ``class_path``)
    becomes its import path ``"module:QualifiedName"``, so checkpoints hold plain data (Lightning loads them with
    ``weights_only``); strings, dicts of strings and objects without an importable name (local classes) are kept."""
    if isinstance(spec, dict):
        return {**spec, "class_path": environment_hparam(spec["class_path"])} if "class_path" in spec else spec
    qualname, module = getattr(spec, "__qualname__", None), getattr(spec, "__module__", None)
    if isinstance(spec, str) or not qualname or not module or "<locals>" in qualname:
        return spec
    return f"{module}:{qualname}"


def check_environment_task(env_factory: Callable[[], Any] | None, task: str | None) -> None:
    """Check that a built-in environment runs on its own built-in task's rows.

    ``model.environment: calculator`` with ``data.task: arithmetic`` would train without any error (the arithmetic
    rows have the ``answer`` column the calculator needs) on prompts the environment was not made for. Only built-in
    pairs are checked: a user environment, or the prompts of a file (``task`` ``None``), may be anything (their
    columns are checked by :meth:`~lit_llm.rollouts.EpisodeEngine.check_columns`).

    Args:
        env_factory: the module's environment factory (``None``: single-turn GRPO; nothing to check).
        task: the data module's ``task`` (:data:`~lit_llm.lightning.grpo_data.BUILTIN_TASKS`, or ``None`` for a file).

    Raises:
        ValueError: a built-in environment (:func:`~lit_llm.rollouts.envs.builtin_environment_name`) with another
            built-in task; the message names both options and the fixes.
    """
    name = None if env_factory is None else builtin_environment_name(env_factory)
    if name is None or task not in BUILTIN_TASKS or task == name:
        return
    other = (f"set --model.init_args.environment {task} for {task!r} episodes" if task in ENVIRONMENT_TASKS
             else f"drop --model.init_args.environment for single-turn GRPO on the {task!r} prompts")
    raise ValueError(f"GRPOModule: model.environment={name!r} plays its episodes on the rows of data.task={name!r}, "
                     f"but data.task={task!r}: its prompts were not made for the {name!r} environment (training "
                     f"would run without an error, on the wrong task). Fix: set --data.task {name}, or --data.task "
                     f"null with --data.path <your rows> (a 'prompt' column and the environment's columns), or "
                     f"{other}.")


def environment_factory(environment: EnvironmentConfig | EnvironmentSpec | None
                        ) -> tuple[Any, Callable[[], Any] | None]:
    """``(spec, factory)`` of an ``environment`` option: the plain spec (unwrapped from :class:`EnvironmentConfig`)
    and a factory of fresh environments (``None`` without an environment; one that raises ``RuntimeError`` inside
    :func:`environment_unresolved`).

    Raises:
        EnvironmentSpecError: a spec that does not resolve, prefixed ``"GRPOModule: model.environment: "`` (the CLI's
            hint looks options up by name).
    """
    if isinstance(environment, EnvironmentConfig):  # from the CLI: the plain spec (also in hparams)
        environment = environment.spec
    if environment is None:
        return None, None
    if _ENVIRONMENT_UNRESOLVED.get():  # loaded for the weights alone (export): the spec is not imported
        return environment, _unresolved_factory(environment)
    try:
        return environment, resolve_environment(environment)
    except EnvironmentSpecError as e:
        raise EnvironmentSpecError(f"GRPOModule: model.environment: {e}") from e
