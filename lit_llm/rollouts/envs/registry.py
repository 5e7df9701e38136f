"""Environment specs: the built-in environments by name (:func:`builtin_environments`,
:func:`builtin_environment_name`) and :func:`resolve_environment`, which turns a config entry (a class, an import
path, a LightningCLI-style dict or a built-in name) into a factory of fresh environments (the user's code is loaded
by :mod:`lit_llm.imports`)."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from lit_llm.imports import import_module, load_file, split_import_path
from lit_llm.rollouts.envs.base import Environment
from lit_llm.rollouts.envs.calculator import CalculatorEnv
from lit_llm.rollouts.envs.guess_number import GuessNumberEnv

__all__ = ["EnvironmentSpecError", "builtin_environment_name", "builtin_environments", "resolve_environment"]


class EnvironmentSpecError(ValueError):
    """An environment spec (class, import path, dict, built-in name) that does not resolve to an environment class."""


def builtin_environments() -> dict[str, type[Environment]]:
    """The shipped environments by name (what a bare name in a config may be)."""
    return {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}


def builtin_environment_name(factory: Any) -> str | None:
    """The built-in name of the environment ``factory`` builds: ``"calculator"`` for
    :class:`~lit_llm.rollouts.envs.CalculatorEnv` itself or a ``functools.partial`` of it (what
    :func:`resolve_environment` returns for a name, a class or a ``{class_path, init_args}`` dict), ``None`` for
    anything else (subclasses and user environments included)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return next((name for name, cls in builtin_environments().items() if factory is cls), None)


_DICT_HINT = "{'class_path': 'pkg.module:MyEnv', 'init_args': {...}}"


def _is_env_class(obj: Any) -> bool:
    return inspect.isclass(obj) and (issubclass(obj, Environment) or (callable(getattr(obj, "reset", None))
                                                                      and callable(getattr(obj, "step", None))))


def _load(path: str, spec: Any) -> Any:
    """A built-in name or an import path -> the object (:mod:`lit_llm.imports`, the loader of reward functions too:
    a module importable as is or from the current directory, or a ``.py`` file)."""
    builtins = builtin_environments()
    text = path.strip()
    if text in builtins:
        return builtins[text]
    if not any(c in text for c in (":", ".", "/", os.sep)):
        close = difflib.get_close_matches(text, list(builtins), n=1, cutoff=0.6)
        raise EnvironmentSpecError(
            f"Unknown environment {spec!r}: not a built-in" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f". Built-in environments: {sorted(builtins)}. For your own give 'package.module:MyEnv' (importable, "
            f"or a module in the current directory {os.getcwd()}), 'path/to/file.py:MyEnv', or "
            f"{_DICT_HINT}.")
    if ":" not in text and text.endswith(".py"):
        raise EnvironmentSpecError(f"Environment {spec!r} names a file but no class; give '{text}:MyEnv'.")
    target, attr, is_file = split_import_path(text)
    if not target or not attr:
        raise EnvironmentSpecError(f"Environment {spec!r} must look like 'package.module:MyEnv' or "
                                   f"'path/to/file.py:MyEnv' (or a built-in name: {sorted(builtins)}).")
    try:  # the loader of reward functions: importable modules, modules of the cwd, files
        if is_file:  # names a string
            module = load_file(target, text, what="file", error=EnvironmentSpecError)
        else:
            module = import_module(target, text, what="import path", error=EnvironmentSpecError)
    except EnvironmentSpecError as e:
        raise EnvironmentSpecError(f"Environment {spec!r} could not be loaded: {e} (An environment spec is "
                                   f"'package.module:MyEnv', 'path/to/file.py:MyEnv', {_DICT_HINT}, or a built-in "
                                   f"name: {sorted(builtins)}.)") from e
    if not hasattr(module, attr):
        where = f"file {target!r}" if is_file else f"module {target!r}"
        classes = sorted(n for n, v in vars(module).items() if not n.startswith("_") and _is_env_class(v))
        raise EnvironmentSpecError(f"Environment {spec!r}: {where} has no attribute {attr!r}; its environment "
                                   f"classes are {classes}. Check the name.")
    return getattr(module, attr)


def _not_an_environment(where: str, obj: Any) -> EnvironmentSpecError:
    """The error of a spec (``where`` names it) that resolved to ``obj``, which is not an environment class: for a
    class, the methods it lacks and the base classes to subclass."""
    if inspect.isclass(obj):
        lacks = " and ".join(m for m in ("reset(row)", "step(messages)")
                             if not callable(getattr(obj, m.partition("(")[0], None)))
        return EnvironmentSpecError(
            f"{where} names the class {obj.__qualname__}, which lacks {lacks}, so it is not an environment. Subclass "
            f"lit_llm.rollouts.envs.Environment and write step(messages) -> EnvStep (reset(row) defaults to the "
            f"row's prompt), or lit_llm.rollouts.envs.ToolEnv for a tool task (set its tools and write "
            f"score(answer, row)).")
    return EnvironmentSpecError(f"{where} resolved to {obj!r:.100}, not an Environment class (with reset(row) and "
                                f"step(messages)) nor a factory function. Point it at an Environment subclass, or a "
                                f"function that returns a fresh environment.")


def _checked_factory(factory: Callable[..., Any], spec: Any) -> Callable[[], Environment]:
    """``factory`` wrapped so each instance it returns is checked to be an environment.

    Raises:
        EnvironmentSpecError: ``factory`` needs arguments (it is called with none, once per episode).
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: checked on each call only
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            required = [p.name for p in signature.parameters.values() if p.default is p.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            name = getattr(factory, "__name__", type(factory).__name__)
            signature = signature.replace(parameters=[p.replace(annotation=p.empty)
                                                      for p in signature.parameters.values()],
                                          return_annotation=signature.empty)  # the names alone
            where = f"Environment {spec!r}" if isinstance(spec, str) else "Environment factory"
            raise EnvironmentSpecError(
                f"{where} names the function {name}{signature}, which needs the argument(s) {required}, but an "
                f"environment factory is called with none, once per episode. Point it at the Environment class, or "
                f"at a function without required arguments that returns a fresh environment (a tool function goes "
                f"in a ToolEnv subclass's tools list).") from None

    @functools.wraps(factory)
    def make() -> Environment:
        env = factory()
        if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
            raise TypeError(f"Environment factory {spec!r} returned {type(env).__name__}, not an environment (an "
                            f"object with reset(row) and step(messages)); return a fresh Environment instance.")
        return env

    return make


def resolve_environment(spec: Any) -> Callable[[], Environment]:
    """A factory of fresh environments (one per episode) from a config entry.

    Args:
        spec: one of

            * an :class:`Environment` subclass (or any class with ``reset`` and ``step``);
            * a zero-argument factory function returning a fresh environment (checked now to need no argument, and
              its result on each call);
            * a built-in name: ``"calculator"`` (:class:`~lit_llm.rollouts.envs.CalculatorEnv`),
              ``"guess_number"`` (:class:`~lit_llm.rollouts.envs.GuessNumberEnv`);
            * an import path ``"package.module:MyEnv"`` / ``"package.module.MyEnv"`` (imported as is, else from the
              current directory, as :func:`lit_llm.rewards.resolve_reward` does) or ``"path/to/file.py:MyEnv"``
              (relative to the current directory, or absolute; the file's folder is appended to ``sys.path``, so
              it imports the modules beside it);
            * a LightningCLI-style dict ``{"class_path": <any of the above strings>, "init_args": {...}}``: the
              factory calls ``MyEnv(**init_args)``; the arguments are checked against the signature now.

    Returns:
        A callable taking no arguments that returns a fresh environment (the class itself, or a
        ``functools.partial`` of it with the ``init_args``).

    Raises:
        EnvironmentSpecError: (a ``ValueError``) an unknown built-in name (listing them), an import path that does
            not resolve, a dict with other keys than ``class_path`` / ``init_args`` or with ``init_args`` the class
            does not take, a path naming something that is not an environment class, a factory function with
            required arguments; each names the spec and the fix.
        TypeError: an environment *instance* (one is needed per episode: give its class), or a spec of another type.
    """
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"class_path", "init_args"})
        if "class_path" not in spec or unknown:
            raise EnvironmentSpecError(f"Environment spec {dict(spec)!r}: a dict needs 'class_path' and optionally "
                                       f"'init_args' (got unknown keys {unknown}); e.g. {_DICT_HINT}.")
        init_args = spec.get("init_args") or {}
        if not isinstance(init_args, Mapping) or not all(isinstance(k, str) for k in init_args):
            raise EnvironmentSpecError(f"Environment spec {dict(spec)!r}: 'init_args' must be a mapping of keyword "
                                       f"arguments, got {init_args!r}.")
        target = spec["class_path"]
        cls = _load(target, spec) if isinstance(target, str) else target
        if inspect.isclass(cls) and not _is_env_class(cls):
            raise _not_an_environment(f"Environment spec {dict(spec)!r}: 'class_path'", cls)
        if not _is_env_class(cls):
            raise EnvironmentSpecError(f"Environment spec {dict(spec)!r}: 'class_path' must name an Environment class "
                                       f"(with reset(row) and step(messages)), got {cls!r:.100}.")
        try:
            inspect.signature(cls).bind(**init_args)
        except TypeError as e:
            params = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
            takes = f"its parameters are {params}" if params else "it takes no arguments: drop 'init_args'"
            raise EnvironmentSpecError(f"Environment spec {dict(spec)!r}: {cls.__name__} does not take these "
                                       f"init_args ({e}); {takes}.") from e
        return functools.partial(cls, **init_args) if init_args else cls
    if isinstance(spec, str):
        obj = _load(spec, spec)
        if _is_env_class(obj):
            return obj
        if inspect.isfunction(obj):
            return _checked_factory(obj, spec)
        raise _not_an_environment(f"Environment {spec!r}", obj)
    if _is_env_class(spec):
        return spec
    if inspect.isclass(spec):
        raise _not_an_environment(f"Environment spec {spec.__qualname__}", spec)
    if callable(getattr(spec, "reset", None)) and callable(getattr(spec, "step", None)):
        raise TypeError(f"resolve_environment got an environment instance ({type(spec).__name__}); each episode needs "
                        f"a fresh one: give the class {type(spec).__name__} (or a factory function, or "
                        f"{_DICT_HINT}).")
    if callable(spec):
        return _checked_factory(spec, spec)
    raise TypeError(f"An environment spec must be an Environment class, a factory function, a built-in name "
                    f"{sorted(builtin_environments())}, an import path 'package.module:MyEnv' / "
                    f"'path/to/file.py:MyEnv', or {_DICT_HINT}; got {type(spec).__name__} {spec!r:.80}.")
