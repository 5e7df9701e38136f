"""Work handed to another thread under the caller's thread-local autograd and autocast state: the calling thread's
grad mode and autocast dtype (:func:`caller_context`) restored around the work on the other thread
(:func:`in_context`). Used by the batcher's worker, the rollout workers and the episode threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["caller_context", "in_context"]


def caller_context(device_type: str) -> tuple[bool, torch.dtype | None]:
    """The calling thread's grad mode and autocast dtype on ``device_type`` (``None`` = autocast off): both are
    thread-local, so work handed to another thread (the batcher's worker) must carry them."""
    enabled = torch.is_autocast_enabled(device_type)
    return torch.is_grad_enabled(), torch.get_autocast_dtype(device_type) if enabled else None


@contextlib.contextmanager
def in_context(context: tuple[bool, torch.dtype | None], device_type: str) -> Iterator[None]:
    """Run the block under a :func:`caller_context` (grad mode, autocast dtype or off)."""
    grad, dtype = context
    amp = torch.autocast(device_type, dtype=dtype) if dtype is not None else \
        torch.autocast(device_type, enabled=False)
    with torch.set_grad_enabled(grad), amp:
        yield
