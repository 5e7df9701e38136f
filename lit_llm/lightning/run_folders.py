"""Nothing half-written by a fit that failed before it logged anything (issue 30 leftover 5).

Lightning creates each logger's folder (``<default_root_dir>/csv/version_N``) when the fit starts, before the data
module's ``setup`` reads the data and before the modules' own checks; a bad data file or option found there used to
leave an empty ``version_N`` (or one holding only ``config.yaml`` / ``hparams.yaml``), which then shifted the next
run's version number and showed up in ``lit-llm plot`` as a run without metrics. :func:`remove_unused_log_dirs`
removes such folders after a failed run, and the parents this run created when they are left empty.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["UNUSED_LOG_FILES", "remove_unused_log_dirs"]

#: Files a logger folder holds before anything was logged (LightningCLI's ``config.yaml``, the loggers'
#: ``hparams.yaml``): a folder with only these is removed after a failed run; any other file keeps it.
UNUSED_LOG_FILES = frozenset({"config.yaml", "hparams.yaml"})


def _remove_if_empty(path: str) -> bool:
    try:
        os.rmdir(path)
    except OSError:  # not empty, or already gone
        return False
    return True


def remove_unused_log_dirs(loggers: Iterable[Any], *, root: str | os.PathLike | None,
                           root_existed: bool) -> list[str]:
    """Remove the log folders of a failed run that hold nothing logged.

    Args:
        loggers: the trainer's loggers; each one's ``log_dir`` (``csv/version_N``) that exists and holds only
            :data:`UNUSED_LOG_FILES` is removed, then its parent (``csv``) when left empty.
        root: ``trainer.default_root_dir``; removed too when left empty and ``root_existed`` is false.
        root_existed: whether ``root`` existed before the run (a folder the user made is never removed).

    Returns:
        The folders removed.
    """
    removed: list[str] = []
    for logger in loggers:
        log_dir = getattr(logger, "log_dir", None)
        if not isinstance(log_dir, str | os.PathLike) or not os.path.isdir(log_dir):
            continue
        names = set(os.listdir(log_dir))
        if not names <= UNUSED_LOG_FILES:
            continue
        for name in names:
            os.remove(os.path.join(log_dir, name))
        if _remove_if_empty(log_dir):
            removed.append(str(log_dir))
            parent = os.path.dirname(os.path.normpath(log_dir))
            if (root is None or os.path.abspath(parent) != os.path.abspath(root)) and _remove_if_empty(parent):
                removed.append(parent)
    if root is not None and not root_existed and _remove_if_empty(root):
        removed.append(str(root))
    return removed
