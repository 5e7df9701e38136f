"""Value checks kept on the device and read on the host once per optimizer step (issue 28).

A check of a tensor's values (``bool(bad.any())``) is a device-to-host sync: the host waits for every kernel queued
before it. Inside a training step (:meth:`lit_llm.lightning.module.PolicyModule.training_step`, which opens a
:func:`deferred_checks` block around its micro-batches) the checks of the losses (:mod:`lit_llm.objectives`) and of
the log-prob path (:mod:`lit_llm.policy.kernel`, :mod:`lit_llm.policy.logprobs`, :mod:`lit_llm.policy.inputs`,
:mod:`lit_llm.policy.masked_dist`) are recorded instead and read with the step's one host read; the first failed
check then raises its own error, before the optimizer step. Outside such a block (a public call) :func:`check_value`
reads and raises at once, as before. A deferred check lets the computation run on the bad input until the step's
read, so the callers whose bad input would crash an index (an id outside the vocabulary, a prompt index out of
range) make the computation safe first (the values replaced, the error still raised at the read).

Re-exported by :mod:`lit_llm.objectives.reduction`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = ["DeferredChecks", "check_value", "deferred_checks", "deferring"]

_ACTIVE = threading.local()  # .checks: the DeferredChecks of the innermost deferred_checks() block of this thread


class DeferredChecks:
    """The value checks of a block (one optimizer step), kept on the device and read on the host once: a check of a
    tensor's values is a device-to-host sync, and a loss makes several per micro-batch (issue 28).

    Each entry is a 0-d bool tensor (True = failed) and the function that builds its error (called only on failure,
    so a message may read the tensors then).
    """

    def __init__(self) -> None:
        self._failed: list[Tensor] = []
        self._errors: list[Callable[[], Exception]] = []

    def add(self, failed: Tensor, error: Callable[[], Exception]) -> None:
        self._failed.append(failed.reshape(()))
        self._errors.append(error)

    def failed(self) -> Tensor | None:
        """0-d bool: whether any check failed (on the device, not read), or ``None`` when nothing was checked."""
        return torch.stack(self._failed).any() if self._failed else None

    def verify(self) -> None:
        """Raise the error of the first failed check (one host read; nothing when every check passed)."""
        if not self._failed:
            return
        for failed, error in zip(torch.stack(self._failed).tolist(), self._errors):
            if failed:
                raise error()


@contextlib.contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Inside the block, :func:`check_value` (the value checks of the losses and of the log-prob path) records its
    checks in the yielded :class:`DeferredChecks` instead of reading them at once; the caller verifies them
    (:meth:`DeferredChecks.verify`, or folded into its own host read with :meth:`DeferredChecks.failed`). Used by
    :meth:`lit_llm.lightning.module.PolicyModule.training_step` around the micro-batches of a step. Thread-local."""
    checks, previous = DeferredChecks(), getattr(_ACTIVE, "checks", None)
    _ACTIVE.checks = checks
    try:
        yield checks
    finally:
        _ACTIVE.checks = previous


def check_value(failed: Tensor, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` when the 0-d bool tensor ``failed`` is True: at once (one host read), or, inside
    :func:`deferred_checks`, when that block's owner verifies the block's checks.

    Raises:
        Exception: ``error()``, outside :func:`deferred_checks` and when ``failed``.
    """
    checks = getattr(_ACTIVE, "checks", None)
    if checks is not None:
        checks.add(failed, error)
    elif bool(failed):
        raise error()


def deferring() -> bool:
    """Whether this thread is inside a :func:`deferred_checks` block (a failed :func:`check_value` then raises later,
    so a caller whose bad input would index out of range must make it safe first)."""
    return getattr(_ACTIVE, "checks", None) is not None
