"""Work handed to another thread under the caller's thread-local state: the calling thread's grad mode, autocast
dtype and current CUDA device (:func:`caller_context`) restored around the work on the other thread
(:func:`in_context`). Used by the batcher's worker, the rollout workers, the episode threads and the asynchronous
producer.

Why the device: ``torch.cuda.current_device()`` is per thread and a new thread starts on device 0. A rank of a
multi-GPU run sets its own device on its main thread (Lightning does); a thread that runs the model without taking
it would put whatever uses the current device (``torch.cuda.*`` calls, Triton kernels, CUDA graphs, an unindexed
``"cuda"``) on GPU 0. Tested on the CPU only, with ``torch.cuda``'s functions replaced by a per-thread fake
(tests/policy/test_device_threads.py); no GPU has run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

__all__ = ["ThreadContext", "caller_context", "current_device_index", "in_context"]


class ThreadContext(NamedTuple):
    """The thread-local state a thread that runs the model must take from its caller.

    Attributes:
        grad_enabled: ``torch.is_grad_enabled()``.
        autocast_dtype: the autocast dtype on the call's device type (``None``: autocast off).
        device_index: ``torch.cuda.current_device()`` (``None``: CUDA not available or not initialised).
    """

    grad_enabled: bool
    autocast_dtype: torch.dtype | None
    device_index: int | None = None


def current_device_index() -> int | None:
    """The calling thread's current CUDA device, or ``None`` when CUDA is not available or not initialised (then
    nothing has chosen a device yet, and reading it must not initialise CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def caller_context(device_type: str) -> ThreadContext:
    """The calling thread's grad mode, autocast dtype on ``device_type`` (``"cpu"``, ``"cuda"``) and current CUDA
    device: all three are thread-local, so work handed to another thread (the batcher's worker) must carry them."""
    enabled = torch.is_autocast_enabled(device_type)
    return ThreadContext(torch.is_grad_enabled(), torch.get_autocast_dtype(device_type) if enabled else None,
                         current_device_index())


@contextlib.contextmanager
def in_context(context: ThreadContext | tuple, device_type: str) -> Iterator[None]:
    """Run the block under a :func:`caller_context`: grad mode, autocast dtype (or off) and, when the caller had
    one, its current CUDA device (``torch.cuda.set_device``, only when this thread's differs; not restored
    afterwards: the threads that call this run the model only)."""
    context = ThreadContext(*context)
    if context.device_index is not None and torch.cuda.current_device() != context.device_index:
        torch.cuda.set_device(context.device_index)
    amp = torch.autocast(device_type, dtype=context.autocast_dtype) if context.autocast_dtype is not None else \
        torch.autocast(device_type, enabled=False)
    with torch.set_grad_enabled(context.grad_enabled), amp:
        yield
