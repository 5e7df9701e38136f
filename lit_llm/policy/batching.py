"""Threaded batcher: many concurrent callers of one policy served in shared forward passes (issue 4).

:class:`BatchingMixin` is inherited by :class:`lit_llm.policy.common.LLMWrapperBase`. With batching on, each call of
``forward`` splits its tensordict into rows (batch element ``[]`` items), queues them, and waits; a single worker
thread stacks queued rows from all callers (``tensordict.lazy_stack``, so ragged rows are fine), calls the wrapped
function once per shared batch, splits the output with ``unbind(0)`` and hands every caller exactly its own rows, in
its own order.

Scheduling rules (rows = batch elements, counted before ``num_samples``):

* a batch runs as soon as ``min_batch_size`` compatible rows wait;
* a batch never holds more than ``max_batch_size`` rows (``None``: no limit); a bigger request is split over several
  batches and reassembled;
* a row that has waited ``batching_timeout`` seconds is run with whatever compatible rows are queued, so a caller
  returns after at most the timeout plus the batches in flight;
* rows are *compatible* when they come from the same function (compared with ``==``: pass a bound method, not a
  fresh closure per call) with equal keyword arguments and have the same structure (batch shape, keys, tensor
  dtypes, ndims and devices; lengths may differ). Incompatible rows never share a batch:
  each kind runs in its own batches, so one caller's odd input cannot fail another caller;
* the function runs on the worker thread only, never on two threads at once;
* inside a batch, rows are ordered by ``(batch_order, arrival, row index)``: a caller may pass an integer
  ``batch_order`` (``forward(td, batch_order=k)``), which is not a keyword argument of the function (rows with
  different orders share batches); requests without one come after the ordered ones, in arrival order. Nobody passing
  an order gives plain FIFO. With ``max_batch_size``, the first rows in this order are the ones taken.

Deterministic batches (synchronous GRPO with several rollout workers): give the wrapper
``min_batch_size = `` the total rows of the step (every worker's rows, before ``num_samples``), no
``max_batch_size`` (or one at least that large) and a ``batching_timeout`` longer than the slowest worker takes to
submit, and let worker ``k`` call ``policy(td_k, batch_order=k)`` with distinct ``k``. The batch then only starts
once every row is queued and holds exactly the rows of one unbatched call ``policy(cat(td_0, td_1, ...))`` in
worker order, so it computes the same numbers bit for bit (with per-row ``"sampling_seed"``, also the same samples;
see :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`), and ``get_batching_state()["batches_run"]``
grows by one per step. If a worker never submits, the others run without it when the timeout fires (no longer
deterministic, never a deadlock). Rows of different structures (e.g. with and without ``"sampling_seed"``) still run
in separate batches.

Errors: an exception raised by the function reaches every caller with rows in that batch (a same-type copy carrying
the original traceback, chained ``from`` the original) and nobody else; the worker keeps serving. A request whose own
rows cannot be stacked together is rejected in the caller's thread with :class:`BatchingInputError`.

Contract used by :class:`~lit_llm.policy.common.LLMWrapperBase`:

- ``self._init_batching(batching, min_batch_size, max_batch_size, batching_timeout)`` in ``__init__``;
- ``self._run_maybe_batched(tensordict, fn, batch_order=None, **kwargs)`` in ``forward``;
- ``cleanup_batching(flush=False)``, ``get_batching_state()``, property ``batching`` (settable);
- ``_batching_settings()``: the kwargs ``get_new_version`` passes to the new wrapper;
  ``new._adopt_batching_state(old)``: make the new wrapper share ``old``'s queue and worker (only when asked).

This module is the mixin (settings, the caller's side of a request); the queue and its worker thread are
:mod:`lit_llm.policy.batch_queue`, and :func:`caller_context` / :func:`in_context` (re-exported here) are
:mod:`lit_llm.policy.thread_context`.
"""

from __future__ import annotations

import math
import numbers
import time
import weakref
from collections.abc import Callable
from typing import Any

from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensorclass, lazy_stack

from lit_llm.policy.batch_queue import (
    BatchingCancelledError,
    BatchingInputError,
    _Batcher,
    _describe_mismatch,
    _Request,
    _reraise,
    _signature,
)
from lit_llm.policy.thread_context import caller_context, in_context

__all__ = ["BatchingCancelledError", "BatchingInputError", "BatchingMixin", "caller_context", "in_context"]


def _check_batch_size(name: str, value: int | None, *, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (or None), got {value!r}.")


class BatchingMixin:
    """Adds threaded batching to a ``TensorDictModuleBase`` (see the module docstring for the semantics).

    The host class calls :meth:`_init_batching` in ``__init__`` and routes ``forward`` through
    :meth:`_run_maybe_batched`.
    """

    def _init_batching(self, batching: bool | None, min_batch_size: int | None, max_batch_size: int | None,
                       batching_timeout: float = 10.0) -> None:
        """Validate and store the batching settings.

        Args:
            batching: ``True``/``False`` turns batching on/off; ``None`` turns it on iff ``min_batch_size`` or
                ``max_batch_size`` is given.
            min_batch_size: rows that trigger a shared forward pass. ``None`` with ``batching=True`` is stored as
                ``1`` (TorchRL's rule); ``None`` with only ``max_batch_size`` given stays ``None`` (as TorchRL keeps
                it, and reports it in :meth:`get_batching_state`) and batches from one row, TorchRL's documented
                meaning.
            max_batch_size: most rows per forward pass (default ``None``: no limit). Must be >= ``min_batch_size``.
            batching_timeout: seconds (float > 0, finite) a row waits for ``min_batch_size`` rows before it runs
                with whatever is queued.

        Raises:
            ValueError: a size that is not a positive integer, ``max_batch_size < min_batch_size``, or a timeout
                that is not a positive finite number.
        """
        _check_batch_size("min_batch_size", min_batch_size, minimum=1)
        _check_batch_size("max_batch_size", max_batch_size, minimum=1)
        if min_batch_size is not None and max_batch_size is not None and max_batch_size < min_batch_size:
            raise ValueError(f"min_batch_size ({min_batch_size}) must be <= max_batch_size ({max_batch_size}) "
                             f"(TorchRL's rule): max_batch_size={max_batch_size} is smaller than "
                             f"min_batch_size={min_batch_size}, so a batch could never start. Raise max_batch_size "
                             f"or lower min_batch_size.")
        if (isinstance(batching_timeout, bool) or not isinstance(batching_timeout, (int, float))
                or not math.isfinite(batching_timeout) or batching_timeout <= 0):
            raise ValueError(f"batching_timeout must be a positive finite number of seconds, got {batching_timeout!r}.")
        if batching and min_batch_size is None:
            min_batch_size = 1  # TorchRL: batching=True alone batches from one row (stored as 1)
        if batching is None:
            batching = min_batch_size is not None or max_batch_size is not None
        self._min_batch_size, self._max_batch_size = min_batch_size, max_batch_size
        self._batching_timeout = float(batching_timeout)
        self._batcher: _Batcher | None = None
        self.batching = bool(batching)

    def _new_batcher(self) -> _Batcher:
        batcher = _Batcher(self._min_batch_size, self._max_batch_size, self._batching_timeout)
        # Garbage collection of the wrapper lets the worker exit once idle (never joins: may run on any thread).
        self._batching_finalizer = weakref.finalize(self, batcher.shutdown, flush=True, wait=False)
        return batcher

    @property
    def batching(self) -> bool:
        """Whether calls are queued and served in shared batches. Setting it to ``False`` first runs what is queued
        (``cleanup_batching(flush=True)``); setting it to ``True`` starts a fresh queue (the worker starts on the
        first call)."""
        return self._batcher is not None

    @batching.setter
    def batching(self, value: bool) -> None:
        if value and self._batcher is None:
            self._batcher = self._new_batcher()
        elif not value and self._batcher is not None:
            batcher, self._batcher = self._batcher, None
            self._batching_finalizer.detach()
            batcher.shutdown(flush=True)

    def _batching_settings(self) -> dict[str, Any]:
        """The constructor kwargs that carry these batching settings over to a new version (not the queue).

        When batching is off this gives ``batching=None`` and no sizes, so ``get_new_version(min_batch_size=8)``
        turns batching on in the new version.
        """
        if not self.batching:
            return dict(batching=None, min_batch_size=None, max_batch_size=None,
                        batching_timeout=self._batching_timeout)
        # max_batch_size alone (min None) is carried as batching=None, so the new version keeps min None too
        alone = self._min_batch_size is None and self._max_batch_size is not None
        return dict(batching=None if alone else True, min_batch_size=self._min_batch_size,
                    max_batch_size=self._max_batch_size, batching_timeout=self._batching_timeout)

    def _adopt_batching_state(self, other: BatchingMixin) -> None:
        """Share ``other``'s queue and worker (``get_new_version(..., share_batching_state=True)``).

        Both wrappers then feed one worker, so their functions never run at the same time (they share the model).
        Requests of different versions never share a batch (different functions).

        Raises:
            ValueError: ``other`` has batching off, or this wrapper's settings differ from ``other``'s.
        """
        if other._batcher is None:
            raise ValueError("share_batching_state=True: the source wrapper has batching off, so there is no batching "
                             "state to share; turn batching on, or pass share_batching_state=False.")
        mine, theirs = self._batching_settings(), other._batching_settings()
        if mine != theirs:
            raise ValueError(f"share_batching_state=True needs the same batching settings on both versions, got "
                             f"{mine} vs {theirs}; drop the batching overrides or pass share_batching_state=False.")
        if self._batcher is not other._batcher:
            self.batching = False
            self._batcher = other._batcher
            self._batching_finalizer = weakref.finalize(self, other._batcher.shutdown, flush=True, wait=False)

    def _run_maybe_batched(self, tensordict: TensorDictBase, fn: Callable[..., TensorDictBase], *,
                           batch_order: int | None = None, **kwargs: Any) -> TensorDictBase:
        """Call ``fn(tensordict, **kwargs)`` directly, or through the shared queue when batching is on.

        Args:
            tensordict: the input, ``batch_dims`` 0 (one row) or 1 (``[B]`` rows; dense or lazily stacked, ragged
                entries allowed). Higher ``batch_dims`` (e.g. ``[B, n]`` for the log-prob version) are split along
                the leading dim too; such rows only share batches with rows of the same shape.
            fn: the unbatched forward: takes a ``[N]`` lazy stack of rows and returns a tensordict whose leading
                batch dim is ``N`` (e.g. ``[N]``, or ``[N, n]`` with ``num_samples=n``). It may write into its input
                and return it (in-place wrappers).
            batch_order: where this call's rows go inside a shared batch: rows sort by ``(batch_order, arrival,
                row index)``, calls without an order after ordered ones (see the module docstring's deterministic
                recipe). Not passed to ``fn`` and not compared for compatibility. Ignored with batching off.
            **kwargs: passed to ``fn``; only calls with equal kwargs share a batch.

        Returns:
            With batching off, whatever ``fn`` returns. With batching on: for ``batch_dims`` 0, this row's output
            (``[]``, or ``[n]`` with ``num_samples``) — the input object itself when ``fn`` works in place; for
            ``batch_dims`` 1, a ``[B, ...]`` lazy stack of this caller's output rows in input order (the input object
            itself when it is a lazy stack and ``fn`` works in place; a dense ``[B]`` input is never modified).

        Raises:
            BatchingInputError: an empty ``[0]`` batch, or rows with different structures.
            ValueError: ``batch_order`` is not an integer (or ``None``).
            BatchingCancelledError: ``cleanup_batching(flush=False)`` dropped the request before it ran.
            Exception: whatever ``fn`` raised on a batch holding this caller's rows (same type and message, the
                original traceback, ``__cause__`` = the original exception).
        """
        if batch_order is not None:
            if isinstance(batch_order, bool) or not isinstance(batch_order, numbers.Integral):
                raise ValueError(f"batch_order must be an int (or None), got {batch_order!r}.")
            batch_order = int(batch_order)
        batcher = self._batcher
        if batcher is None or batcher.is_worker_thread():  # re-entrant call from fn itself: run inline
            return fn(tensordict, **kwargs)
        if not isinstance(tensordict, TensorDictBase) and not is_tensorclass(tensordict):
            raise BatchingInputError(f"batching: expected a TensorDict input, got {type(tensordict).__name__}.")
        single = tensordict.batch_dims == 0
        if not single and tensordict.batch_size[0] == 0:
            raise BatchingInputError("batching: input has batch_size=[0] (no rows); pass at least one row.")
        rows = [tensordict] if single else list(tensordict.unbind(0))
        sigs = [(tuple(r.batch_size), _signature(r)) for r in rows]
        for k, s in enumerate(sigs[1:], start=1):
            if s != sigs[0]:
                raise BatchingInputError(
                    f"batching: input rows 0 and {k} cannot be stacked together ({_describe_mismatch(sigs[0], s)}); "
                    f"every row of one call needs the same keys and tensor dtypes/ndims. Split the call or make the "
                    f"rows uniform.")
        request = _Request(rows, fn, kwargs, sigs[0], time.monotonic() + batcher.timeout, order=batch_order)
        batcher.submit(request)
        request.done.wait()
        if request.error is not None:
            _reraise(request.error, request.error_tb, *request.error_batch)
        results = request.results
        if single:
            return results[0]
        if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0 and all(
                a is b for a, b in zip(results, tensordict.tensordicts)):
            return tensordict
        return lazy_stack(results)

    def _run_exclusive(self, tensordict: TensorDictBase, fn: Callable[..., TensorDictBase],
                       **kwargs: Any) -> TensorDictBase:
        """Call ``fn(tensordict, **kwargs)`` alone: on the worker when batching is on (so it never overlaps a shared
        batch), inline otherwise. For calls whose output depends on the whole batch (``logits_only`` padded to the
        batch's longest row, a caller-provided ``tensordict_out``) and must not be merged with other callers.

        Returns:
            Exactly what ``fn`` returns.

        Raises:
            BatchingCancelledError: ``cleanup_batching(flush=False)`` dropped the request before it ran.
            Exception: whatever ``fn`` raised (a same-type copy with the original traceback, chained from it).
        """
        batcher = self._batcher
        if batcher is None or batcher.is_worker_thread():
            return fn(tensordict, **kwargs)
        request = _Request([tensordict], fn, kwargs, (), time.monotonic(), solo=True)
        batcher.submit(request)
        request.done.wait()
        if request.error is not None:
            _reraise(request.error, request.error_tb, *request.error_batch)
        return request.results[0]

    def cleanup_batching(self, flush: bool = False) -> None:
        """Empty the queue and stop the worker thread; batching stays on (the next call starts a new worker).

        Args:
            flush: ``True`` runs everything queued first (callers get real results); ``False`` fails every queued
                caller at once with :class:`BatchingCancelledError` ("batching cleaned up"). A batch already running
                always completes. Returns once the worker has exited.
        """
        if self._batcher is not None:
            self._batcher.shutdown(flush=flush)

    def set_min_batch_size(self, rows: int) -> None:
        """Change, while batching is on, how many queued rows trigger a shared forward pass (the queue and worker this
        wrapper uses: with ``share_batching_state=True`` every wrapper sharing them; the settings a new version copies
        are unchanged). For callers in lock-step, such as episodes taking turns: the one caller that knows how many
        of them are still running lowers it as they finish, so every round runs as soon as all live callers have
        queued, without waiting ``batching_timeout`` for finished ones. Two such callers on one queue would
        overwrite each other's count: give each its own batching version.

        Raises:
            ValueError: batching is off; ``rows`` is not an integer >= 1, or exceeds ``max_batch_size``.
        """
        if self._batcher is None:
            raise ValueError("set_min_batch_size: batching is off on this wrapper; turn it on first (batching=True or "
                             "get_new_version(batching=True, min_batch_size=...)).")
        _check_batch_size("min_batch_size", rows if rows is not None else 0, minimum=1)
        if self._batcher.max_batch_size is not None and rows > self._batcher.max_batch_size:
            raise ValueError(f"set_min_batch_size: {rows} rows exceed max_batch_size={self._batcher.max_batch_size}; "
                             f"pass at most max_batch_size.")
        self._batcher.set_min_batch_size(int(rows))

    def get_batching_state(self) -> dict[str, Any]:
        """Monitoring snapshot.

        Returns:
            ``{"batching_enabled": False}`` when off; otherwise also ``min_batch_size``, ``max_batch_size``,
            ``batching_timeout`` (s), ``queue_size`` (rows waiting), ``pending_requests`` (callers with queued rows),
            ``processing`` (bool), ``processing_rows``, ``worker_alive``, ``batches_run``, ``rows_run``; and
            TorchRL's names for the same facts: ``timeout`` (= ``batching_timeout``), ``pending_futures``
            (= ``pending_requests``) and ``lock_state`` (``"locked"`` while a batch runs, else ``"unlocked"``).
        """
        if self._batcher is None:
            return {"batching_enabled": False}
        b = self._batcher
        state = {"batching_enabled": True, "min_batch_size": b.min_batch_size, "max_batch_size": b.max_batch_size,
                 "batching_timeout": b.timeout, **b.state()}
        state.update(timeout=state["batching_timeout"], pending_futures=state["pending_requests"],
                     lock_state="locked" if state["processing"] else "unlocked")
        return state
