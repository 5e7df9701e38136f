"""Loading the user's code a config names: ``"package.module:name"`` (a module importable as is, else from the
current directory, as ``python -m`` would import it) or ``"path/to/file.py:name"`` (a Python file). The loader behind
reward-function specs (:func:`lit_llm.rewards.resolve_reward`), environment specs
(:func:`lit_llm.rollouts.envs.resolve_environment`) and a user's objective (``model.objective``); its errors name
the spec, what was tried and the fix, in the words of the caller (``what``) and as the caller's error class
(``error``). Calling that code with a time limit: :func:`call_with_timeout` (a reward function, an environment's
``reset`` / ``step``, a tool).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["call_bounded", "call_with_timeout", "check_timeout", "import_module", "load_file", "load_target",
           "split_import_path"]


def split_import_path(text: str) -> tuple[str, str, bool]:
    """``"target:name"`` (without a ``:``, ``"target.name"``) -> ``(target, name, is_file)``.

    ``target`` or ``name`` is ``""`` when the text lacks it; ``is_file`` says the target is a path (it ends with
    ``.py`` or holds a path separator), to be loaded with :func:`load_file` rather than :func:`import_module`."""
    target, sep, attr = text.rpartition(":")
    if not sep:
        target, _, attr = text.rpartition(".")
    return target, attr, target.endswith(".py") or "/" in target or os.sep in target


def _is_missing(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` says ``module`` itself (or a package above it) is missing, not something it imports."""
    return error.name is not None and (module == error.name or module.startswith(error.name + "."))


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def import_module(module: str, spec: str, *, what: str = "import path", entry: str = "",
                  error: type[Exception] = ValueError) -> Any:
    """``module`` imported as is, else from the current directory (put on ``sys.path`` as ``python -m`` does).

    Args:
        module: the dotted module name.
        spec: the whole spec (``"module:name"``), named in errors.
        what: what the spec is, in errors (``"reward function"``: ``"Reward function 'x:f' ..."``).
        entry: said after the spec in the not-found error (e.g. ``" (a reward_funcs entry)"``).
        error: the exception class raised.

    Raises:
        error: the module is neither importable nor in the current directory (naming a near file there), or a
            module it imports is missing. Any other exception of the module's own code propagates as is.
    """
    for attempt in range(2):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not _is_missing(e, module):
                raise error(f"Importing module {module!r} of {what} {spec!r} failed: {e} (a module "
                            f"it imports is missing; install it).") from e
            if attempt:
                cwd, where = os.getcwd(), module.replace(".", "/")
                here = sorted(p.stem for p in Path(cwd).glob("*.py"))
                close = difflib.get_close_matches(module, here, n=1, cutoff=0.6)
                fn = spec.rpartition(":")[2]
                hint = f" Did you mean '{close[0]}:{fn}' ({close[0]}.py is there)?" if close else ""
                raise error(
                    f"{_capitalized(what)} {spec!r}{entry}: no module {module!r}; "
                    f"tried importing it (it is not installed) and the current directory {cwd} (no {where}.py nor "
                    f"package {where}/).{hint} Fix the module name, run from the folder that holds it, or give the "
                    f"file: 'path/to/{module.rpartition('.')[2]}.py:{spec.rpartition(':')[2]}'.") from e
        cwd = os.getcwd()
        if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
            sys.path.append(cwd)  # appended: a file of the folder never shadows an installed module
        importlib.invalidate_caches()  # files written since the interpreter started
    raise AssertionError("unreachable")


def load_file(path: str, spec: str, *, what: str = "file", error: type[Exception] = ValueError) -> Any:
    """The module of a Python file (relative to the current directory or absolute), loaded once under a stable name
    (``lit_llm_reward_file_<stem>_<hash of the path>``, kept in ``sys.modules``, whichever spec loads it).

    The file's folder is put on ``sys.path`` before it runs, so it imports the modules beside it (``from helpers
    import CAP`` with ``helpers.py`` in the same folder) as a script does. It is **appended**, and left there: an
    installed module is never shadowed by a file of that folder (``python script.py`` prepends instead), and
    imports the file makes later (inside its functions) still find their modules. Sibling modules are imported
    under their plain names, so two such folders should not hold different modules of the same name.

    Args:
        path: the file.
        spec: the whole spec (``"path/to/file.py:name"``), named in errors.
        what: what the file is, in errors (``"reward function file"``: ``"Reward function file 'x.py' ..."``).
        error: the exception class raised.

    Raises:
        error: the file does not exist, is not a Python module, or raised while it ran (chained; the hint names the
            fix, e.g. for a module it imports that is missing).
    """
    file = Path(path).expanduser()
    file = (file if file.is_absolute() else Path.cwd() / file).resolve()
    if not file.is_file():
        raise error(f"{_capitalized(what)} {path!r} of {spec!r} not found (looked for {file}; a relative path "
                    f"is taken from the current directory {os.getcwd()}). Fix the path.")
    stem = re.sub(r"\W", "_", file.stem)
    name = f"lit_llm_reward_file_{stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{_capitalized(what)} {str(file)!r} of {spec!r} is not a Python module; give a .py file.")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(file.parent)
    if not any(os.path.abspath(p or os.curdir) == folder for p in sys.path):
        sys.path.append(folder)  # appended: a file of the folder never shadows an installed module
        importlib.invalidate_caches()
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        hint = "Fix the file."
        if isinstance(e, ModuleNotFoundError):
            hint = (f"Install the module, or put it beside the file (its folder {folder} is on sys.path, after the "
                    f"installed packages).")
        raise error(f"Running {what} {str(file)!r} of {spec!r} raised {type(e).__name__}: {e}. "
                    f"{hint}") from e
    return module


def load_target(target: str, spec: str, is_file: bool, *, what: str, entry: str = "",
                error: type[Exception] = ValueError) -> Any:
    """The module ``target`` of a spec split by :func:`split_import_path`: :func:`load_file` for a path (``what``
    then reads ``"<what> file"``), else :func:`import_module`.

    Raises:
        error: as :func:`load_file` / :func:`import_module`.
    """
    if is_file:
        return load_file(target, spec, what=f"{what} file", error=error)
    return import_module(target, spec, what=what, entry=entry, error=error)


def call_with_timeout(fn: Callable[[], Any], timeout: float | None,
                      name: str) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn()`` on a daemon thread named ``name`` and wait at most ``timeout`` seconds (``None``: until it ends).

    Python cannot stop a thread: a call that times out is abandoned and **keeps running** (as a daemon it never
    blocks the caller nor the interpreter's exit; its result is dropped; whatever it holds stays held).

    Returns:
        ``(finished, value, error)``: ``finished`` is False when ``fn`` still runs after ``timeout``; otherwise
        ``value`` is what ``fn`` returned or ``error`` what it raised (anything, ``BaseException`` included).
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


def call_bounded(fn: Callable[[], Any], timeout: float | None, name: str) -> tuple[bool, Any]:
    """``(finished, fn())``: ``fn`` called directly when ``timeout`` is ``None``, else through
    :func:`call_with_timeout` (``(False, None)`` once ``timeout`` seconds have passed; the call is abandoned and keeps
    running). What ``fn`` raised is re-raised in the caller's thread."""
    if timeout is None:
        return True, fn()
    finished, out, error = call_with_timeout(fn, timeout, name)
    if error is not None:
        raise error
    return finished, out


def check_timeout(name: str, value: Any, error: type[Exception] = ValueError) -> None:
    """``value`` is a number of seconds ``> 0`` or ``None`` (no limit).

    Raises:
        error: ``"<name> must be a number of seconds > 0, or null for no limit, got <value>."``
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a number of seconds > 0, or null for no limit, got {value!r}.")
