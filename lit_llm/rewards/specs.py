"""Reward-function specs: the built-ins by name (:func:`builtin_rewards`) and :func:`resolve_reward`, which turns a
built-in's name, ``"package.module:function"`` or ``"path/to/rewards.py:function"`` into the function (the user's
code is loaded by :mod:`lit_llm.imports`)."""

from __future__ import annotations

import difflib
import inspect
import os
import sys

from lit_llm.imports import load_target, split_import_path
from lit_llm.rewards.answers import (
    arithmetic_answer_reward,
    concise_number_reward,
    gsm8k_answer_reward,
    strict_arithmetic_reward,
    strict_number_format_reward,
)
from lit_llm.rewards.base import RewardError, RewardFn
from lit_llm.rewards.graded import (
    bare_number_closeness_curriculum_reward,
    bare_number_closeness_reward,
    bare_number_digit_reward,
)
from lit_llm.rewards.tool_format import tool_call_format_reward

__all__ = ["builtin_rewards", "resolve_reward"]

def builtin_rewards() -> dict[str, RewardFn]:
    """The reward functions shipped in this package, by name (what a bare name in ``reward_funcs`` may be)."""
    fns = (arithmetic_answer_reward, bare_number_closeness_curriculum_reward, bare_number_closeness_reward,
           bare_number_digit_reward, concise_number_reward, gsm8k_answer_reward,
           strict_arithmetic_reward, strict_number_format_reward, tool_call_format_reward)
    return {fn.__name__: fn for fn in fns}


def resolve_reward(spec: RewardFn | str) -> RewardFn:
    """The reward function a spec names.

    Args:
        spec: a callable (returned as is); a built-in's name (``"strict_arithmetic_reward"``, see
            :func:`builtin_rewards`); ``"package.module:function"`` (``"package.module.function"`` also works): the
            module imported as is, else from the current directory, which is put on ``sys.path`` (appended) as
            ``python -m`` does, so ``rewards:my_fn`` finds ``./rewards.py`` without ``PYTHONPATH``; or
            ``"path/to/file.py:function"`` (relative to the current directory, or absolute), loaded with
            ``importlib.util.spec_from_file_location`` under a stable module name, its folder appended to
            ``sys.path`` so it imports the modules beside it.

    Raises:
        RewardError: (a ``ValueError``) an unknown name (listing the built-ins), a module or file that cannot be found
            or imported, a missing attribute; each names the spec, what was tried and the fix.
        TypeError: ``spec`` is neither a callable nor a string, or names a non-callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"A reward function must be a callable or a string (a built-in name, 'module:function' or "
                        f"'path/to/file.py:function'), got {spec!r}.")
    builtins = builtin_rewards()
    text = spec.strip()
    if not any(c in text for c in (":", ".", "/", os.sep)):
        if text in builtins:
            return builtins[text]
        close = difflib.get_close_matches(text, list(builtins), n=1, cutoff=0.8)  # "_reward" alone: no match
        raise RewardError(f"Unknown reward function {spec!r} (a reward_funcs / eval_reward_funcs entry): not a "
                          f"built-in" + (f" (did you mean {close[0]!r}?)" if close else "") + ". Built-in reward "
                          f"functions: {sorted(builtins)}. For your own function give 'module:function' (a module "
                          f"importable or in the current directory {os.getcwd()}) or 'path/to/file.py:function'.")
    if ":" not in text and text.endswith(".py"):
        raise RewardError(f"Reward function {spec!r} names a file but no function; give "
                          f"'{text}:function_name'.")
    target, attr, is_file = split_import_path(text)
    if not target or not attr:
        raise RewardError(f"Reward function {spec!r} must look like 'module:function' or 'path/to/file.py:function' "
                          f"(or a built-in name: {sorted(builtins)}).")
    module = load_target(target, spec, is_file, what="reward function",
                         entry=" (a reward_funcs / eval_reward_funcs entry)", error=RewardError)
    if not hasattr(module, attr):
        where = f"file {target!r}" if is_file else f"module {target!r}"
        if module is sys.modules[__package__]:  # lit_llm.rewards itself
            listed = f"Built-in reward functions: {sorted(builtins)}."
        else:
            listed = "Its functions: " + str(sorted(n for n, v in vars(module).items() if inspect.isfunction(v)
                                                    and not n.startswith("_") and v.__module__ == module.__name__))
        raise RewardError(f"Cannot import reward function {spec!r}: {where} has no attribute {attr!r}. {listed} "
                          f"Check the name.")
    obj = getattr(module, attr)
    if not callable(obj):
        raise TypeError(f"Reward function {spec!r} resolved to a non-callable {type(obj).__name__}.")
    return obj
