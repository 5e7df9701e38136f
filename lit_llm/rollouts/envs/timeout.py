""":func:`call_with_timeout`: a call on a daemon thread, waited for at most a timeout. Shared by a tool's call
(:class:`lit_llm.rollouts.envs.tools.Tool`) and an environment's step (:mod:`lit_llm.rollouts.episode_loop`); its own
module so that ``tools`` does not import ``base`` (which names ``Tool``) back. Re-exported by
:mod:`lit_llm.rollouts.envs.base`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["call_with_timeout"]


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
