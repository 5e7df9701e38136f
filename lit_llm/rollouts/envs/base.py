"""The environment interface of multi-turn episodes (TorchRL ``ChatEnv``-like names: ``reset`` / ``step``), and
:func:`resolve_environment`, which turns a config entry (a class, an import path, a LightningCLI-style dict or a
built-in name) into a factory of fresh environments.

One :class:`Environment` instance serves ONE episode: the episode engine builds a fresh one per episode from the
factory, calls :meth:`Environment.reset` with the dataset row, then alternates model turns and
:meth:`Environment.step` until a step is ``done`` (or the engine's own limits stop the episode), then
:meth:`Environment.close`. Instances are used from one worker thread and may hold per-episode state.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_llm.rollouts.envs.tools import Tool

__all__ = ["EnvStep", "Environment", "EnvironmentSpecError", "builtin_environment_name", "builtin_environments",
           "call_with_timeout", "prompt_messages", "resolve_environment", "unimplemented_method"]


class EnvironmentSpecError(ValueError):
    """An environment spec (class, import path, dict, built-in name) that does not resolve to an environment class."""


@dataclass
class EnvStep:
    """What an environment returns for one model turn.

    Attributes:
        messages: new messages to append: tool results ``{"role": "tool", "name": ..., "content": ...}`` or user
            feedback ``{"role": "user", "content": ...}``; ``[]`` when ``done``.
        reward: this step's reward (the episode's reward is the SUM over its steps).
        done: the episode is over.
        info: statistics the episode engine aggregates, all optional: ``"tool_calls"`` (int), ``"tool_errors"``
            (int), ``"tool_time"`` (seconds, float), ``"reason"`` (str: why the episode ended, e.g. ``"answer"``,
            ``"tool_error"``, ``"parse_error"``, ``"tool_timeout"``, ``"max_turns"``); environments may add more.
    """

    messages: list[dict[str, Any]]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The initial messages of a dataset row: its ``"prompt"`` as a message list (copied), a string prompt as one
    user message.

    Raises:
        ValueError: ``row`` has no ``"prompt"``, or it is neither a str nor a list of message dicts.
    """
    if not isinstance(row, Mapping) or "prompt" not in row:
        keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(f"Environment.reset: the dataset row needs a 'prompt' column (a str or a list of messages), "
                         f"got {keys}.")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"Environment.reset: the row's 'prompt' must be a str or a non-empty list of message dicts, got "
                     f"{prompt!r:.120}.")


def _last_assistant(messages: Sequence[Mapping[str, Any]]) -> str:
    """The content of the last message, which must be the model's assistant turn (else a ValueError)."""
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        got = last.get("role") if isinstance(last, Mapping) else last
        raise ValueError(f"Environment.step: the conversation must end with the model's assistant message, got "
                         f"{got!r:.80} last.")
    content = last.get("content")
    if not isinstance(content, str):
        raise ValueError(f"Environment.step: the last assistant message's content must be a str (the decoded turn), "
                         f"got {type(content).__name__}.")
    return content


class Environment:
    """A multi-turn environment: one instance per EPISODE (the engine builds a fresh one from a factory for each
    episode; instances may hold per-episode state and are used from one worker thread).

    Subclasses implement :meth:`step` (and :meth:`reset` when the initial messages are not the row's prompt).

    Attributes:
        tools: tools offered to the model (:class:`~lit_llm.rollouts.envs.tools.Tool`; may be empty). Passed to the
            chat template's ``tools=`` (their schemas) or described in a system message.
        required_columns: dataset columns :meth:`reset` / the environment needs (checked at setup with a clear
            error).
        max_turns: the model turns the episode may have, ``None`` when unknown. The episode engine sets it on each
            fresh instance to its own ``max_turns`` (the smaller of the two when the instance already has a value),
            so an environment that tells the model how many turns are left (:class:`~lit_llm.rollouts.envs.
            GuessNumberEnv`) tells the truth.
    """

    tools: list[Tool] = []  # a read-only default: subclasses assign their own list
    required_columns: tuple[str, ...] = ()
    max_turns: int | None = None

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The initial messages of the episode of dataset row ``row`` (a dict with ``"prompt"`` and the dataset's
        other columns), e.g. ``[{"role": "user", "content": ...}]``, optionally a system message first.

        Default: the row's prompt (:func:`prompt_messages`).
        """
        return prompt_messages(row)

    def step(self, messages: list[dict[str, Any]]) -> EnvStep:
        """React to the conversation so far; its last message is the model's latest assistant turn
        (``{"role": "assistant", "content": <decoded text of the sampled ids, skip_special_tokens=True>}``).

        Must not raise for anything the model wrote (bad markup, wrong answers): turn it into messages / rewards.

        Returns:
            An :class:`EnvStep`: the new messages (roles ``"system"``, ``"user"`` or ``"tool"``, ``str`` content;
            rendered after the turn, then the model answers) or ``[]`` with ``done=True``; the step's ``reward``
            (a finite number; the episode's reward is the sum over its steps); ``done``; and ``info`` (optional
            statistics and the ``"reason"`` the episode ended).

        Raises:
            NotImplementedError: not overridden (the episode engine's setup reports it first:
                :meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement step(messages) -> EnvStep.")

    def close(self) -> None:
        """Release per-episode resources (default: nothing)."""


def unimplemented_method(env: Any) -> str | None:
    """What an environment instance's class must still write, or ``None``: ``"step(messages) -> EnvStep"`` for an
    :class:`Environment` subclass that does not override :meth:`Environment.step`, ``"score(answer, row) -> float"``
    for a :class:`~lit_llm.rollouts.envs.ToolEnv` subclass that does not override its ``score``. Duck-typed
    environments (not subclasses) are not checked. The check of the episode engine's setup
    (:meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`): a tiny model's turns may never end, so the
    environment may never be stepped before a real model trains."""
    from lit_llm.rollouts.envs.tool_env import ToolEnv

    cls = type(env)
    if isinstance(env, Environment) and cls.step is Environment.step:
        return "step(messages) -> EnvStep"
    if isinstance(env, ToolEnv) and cls.step is ToolEnv.step and cls.score is ToolEnv.score:
        return "score(answer, row) -> float"
    return None


def builtin_environments() -> dict[str, type[Environment]]:
    """The shipped environments by name (what a bare name in a config may be)."""
    from lit_llm.rollouts.envs.calculator import CalculatorEnv
    from lit_llm.rollouts.envs.guess_number import GuessNumberEnv

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
    """A built-in name or an import path -> the object (``lit_llm.rewards``' loader: a module importable as is or
    from the current directory, or a ``.py`` file)."""
    from lit_llm.rewards import RewardError, _import_module, _load_file

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
    target, sep, attr = text.rpartition(":")
    if not sep:
        if text.endswith(".py"):
            raise EnvironmentSpecError(f"Environment {spec!r} names a file but no class; give '{text}:MyEnv'.")
        target, _, attr = text.rpartition(".")
    if not target or not attr:
        raise EnvironmentSpecError(f"Environment {spec!r} must look like 'package.module:MyEnv' or "
                                   f"'path/to/file.py:MyEnv' (or a built-in name: {sorted(builtins)}).")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    try:  # the loader of reward functions: importable modules, modules of the cwd, files
        module = _load_file(target, text) if is_file else _import_module(target, text)  # names a string
    except RewardError as e:
        message = (str(e).replace(" (a reward_funcs / eval_reward_funcs entry)", "")
                   .replace("Reward function file", "File").replace("reward function file", "file")
                   .replace("Reward function", "Import path").replace("reward function", "import path"))
        raise EnvironmentSpecError(f"Environment {spec!r} could not be loaded: {message} (An environment spec is "
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


def call_with_timeout(fn: Callable[[], Any], timeout: float | None,
                      name: str) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn()`` on a daemon thread named ``name`` and wait at most ``timeout`` seconds (``None``: until it ends).

    Returns:
        ``(finished, value, error)``: ``finished`` is False when ``fn`` still runs after ``timeout`` (the thread is
        abandoned: as a daemon it never blocks the caller nor the interpreter's exit, and its result is dropped);
        otherwise ``value`` is what ``fn`` returned or ``error`` what it raised (anything, ``BaseException`` included).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("error")
