"""Threaded batcher (issue 4). INTERFACE PLACEHOLDER: the batching helper replaces the internals.

Contract used by :class:`lit_llm.policy.common.LLMWrapperBase`:

- ``self._init_batching(batching, min_batch_size, max_batch_size, batching_timeout)`` in ``__init__``;
- ``self._run_maybe_batched(tensordict, fn, **kwargs)`` in ``forward``: calls ``fn(tensordict, **kwargs)`` directly when
  batching is off; when on, queues the rows of ``tensordict`` (batch_dims 0 or 1) and runs ``fn`` on shared stacked
  batches, returning exactly this caller's rows;
- ``cleanup_batching(flush=False)``, ``get_batching_state()``, property ``batching``;
- ``_batching_settings()`` returns the kwargs that ``get_new_version`` passes on to a new wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["BatchingMixin"]


class BatchingMixin:
    def _init_batching(self, batching: bool | None, min_batch_size: int | None, max_batch_size: int | None,
                       batching_timeout: float = 10.0) -> None:
        self._batching = bool(batching) or min_batch_size is not None or max_batch_size is not None
        self._min_batch_size = min_batch_size if min_batch_size is not None else (1 if self._batching else None)
        self._max_batch_size = max_batch_size
        self._batching_timeout = batching_timeout

    @property
    def batching(self) -> bool:
        return self._batching

    def _batching_settings(self) -> dict[str, Any]:
        return dict(batching=self._batching, min_batch_size=self._min_batch_size, max_batch_size=self._max_batch_size,
                    batching_timeout=self._batching_timeout)

    def _run_maybe_batched(self, tensordict, fn: Callable, **kwargs):
        return fn(tensordict, **kwargs)

    def cleanup_batching(self, flush: bool = False) -> None:
        pass

    def get_batching_state(self) -> dict[str, Any]:
        return {"batching_enabled": self._batching, "queue_size": 0}
