"""The threaded batcher's machinery: the queue and worker thread one wrapper (or several versions) share
(:class:`_Batcher`: which queued rows form the next batch, running it, handing each caller its rows), one caller's
request (:class:`_Request`), the structure that decides which rows may share a batch (:func:`_signature`), and how a
batch's exception reaches its callers (:func:`_reraise`). The scheduling rules are those of
:mod:`lit_llm.policy.batching`, whose :class:`~lit_llm.policy.batching.BatchingMixin` drives this queue."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase, is_tensorclass, lazy_stack

__all__ = ["BatchingCancelledError", "BatchingInputError"]


class BatchingCancelledError(RuntimeError, concurrent.futures.CancelledError):
    """A queued request was dropped by ``cleanup_batching(flush=False)`` before it ran.

    Also a :class:`concurrent.futures.CancelledError` (what TorchRL's batcher raises), so ``except CancelledError``
    written for TorchRL catches it; ``except RuntimeError`` keeps working too.
    """


class BatchingInputError(ValueError):
    """A request the batcher cannot queue: wrong ``batch_dims``, no rows, or rows that cannot be stacked."""


def _signature(obj: Any) -> tuple:
    """Hashable structure of one row: keys, classes and, per tensor, dtype/ndim/device (lengths may differ)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, obj.ndim, obj.device)
    if is_tensorclass(obj):
        return (type(obj).__name__, _signature(obj._tensordict))
    if isinstance(obj, TensorDictBase):
        if isinstance(obj, (NonTensorData, NonTensorStack)):
            return ("non-tensor",)
        return ("td", tuple(sorted((str(k), _signature(v)) for k, v in obj.items())))
    return ("other", type(obj).__name__)


def _describe_mismatch(a: tuple, b: tuple) -> str:
    """A short human description of how two row signatures differ (keys first)."""
    if a[0] == "td" and b[0] == "td":
        ka, kb = dict(a[1]), dict(b[1])
        if ka.keys() != kb.keys():
            return f"keys {sorted(ka)} vs {sorted(kb)}"
        for k in ka:
            if ka[k] != kb[k]:
                return f"key {k!r}: {_describe_mismatch(ka[k], kb[k])}"
    if a[0] == b[0] and len(a) == 2 and len(b) == 2 and isinstance(a[1], tuple) and isinstance(b[1], tuple):
        return _describe_mismatch(a[1], b[1])
    return f"{a} vs {b}"


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a usable __eq__ never share a batch
        return False


def _reraise(exc: BaseException, tb: Any, n_rows: int, n_callers: int) -> None:
    """Raise a copy of ``exc`` (same type and message) with the worker's traceback, chained from the original.

    Each caller gets its own copy so that concurrent re-raises never mutate one shared traceback; an exception that
    cannot be copied is re-raised as is.
    """
    try:
        err = copy.copy(exc)
    except Exception:  # noqa: BLE001 - un-copyable exception
        err = None
    if err is None or type(err) is not type(exc):
        raise exc.with_traceback(tb)
    note = f"raised by the batching worker on a shared batch of {n_rows} row(s) from {n_callers} caller(s)"
    err.__notes__ = [*getattr(exc, "__notes__", []), note]
    raise err.with_traceback(tb) from exc


@dataclass(eq=False)
class _Request:
    """One caller's call: its rows, the function and kwargs, and where the results go."""

    rows: list[TensorDictBase]
    fn: Callable
    kwargs: dict[str, Any]
    signature: tuple
    deadline: float
    solo: bool = False  # run alone, unsplit, on the caller's own tensordict (``_run_exclusive``)
    order: int | None = None  # ``batch_order``: rows sort by (order, arrival, row index); None sorts last
    arrival: int = 0  # set by ``_Batcher.submit``
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    error: BaseException | None = None
    error_tb: Any = None
    error_batch: tuple[int, int] = (0, 0)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)
        self.remaining = len(self.rows)

    def compatible(self, other: _Request) -> bool:
        if self.solo or other.solo or self.signature != other.signature or self.fn != other.fn:
            return False
        return self.kwargs.keys() == other.kwargs.keys() and all(
            _same_value(v, other.kwargs[k]) for k, v in self.kwargs.items())

    def fail(self, exc: BaseException, tb: Any = None, batch: tuple[int, int] = (0, 0)) -> None:
        if not self.done.is_set():
            self.error, self.error_tb, self.error_batch = exc, tb, batch
            self.done.set()


class _Batcher:
    """Queue + worker thread shared by one wrapper (or by several versions when asked).

    Args:
        min_batch_size: rows that trigger a batch (>= 1; ``None``: one row, as TorchRL reads an unset size).
        max_batch_size: most rows per call of the function (``None``: no limit).
        timeout: seconds a row may wait before it runs with whatever is queued (> 0, finite).
    """

    def __init__(self, min_batch_size: int | None, max_batch_size: int | None, timeout: float) -> None:
        self.min_batch_size, self.max_batch_size, self.timeout = min_batch_size, max_batch_size, timeout
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[_Request, int]] = []  # (request, row index), FIFO
        self._arrivals = 0  # requests submitted so far (their arrival numbers)
        self._thread: threading.Thread | None = None
        self._stop = False  # worker: run everything queued regardless of min size/deadline, then exit
        self._processing = 0  # rows in the batch being run
        self.batches_run = 0
        self.rows_run = 0

    def __reduce__(self):  # deepcopy / pickle give a fresh, idle batcher with the same settings
        return (_Batcher, (self.min_batch_size, self.max_batch_size, self.timeout))

    # -------------------------------------------------------------------------------------------- caller side
    def submit(self, request: _Request) -> None:
        with self._cond:
            request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
            self._queue.extend((request, i) for i in range(len(request.rows)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="lit_llm-batching-worker", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def set_min_batch_size(self, rows: int) -> None:
        """Change the rows that trigger a batch; a batch already that large runs at once."""
        with self._cond:
            self.min_batch_size = rows
            self._cond.notify_all()

    def is_worker_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def shutdown(self, *, flush: bool, wait: bool = True) -> None:
        """Stop the worker; cancel (``flush=False``) or run (``flush=True``) what is queued; optionally join."""
        with self._cond:
            if not flush:
                exc = BatchingCancelledError(
                    "batching cleaned up: cleanup_batching(flush=False) dropped this request before it ran; call the "
                    "wrapper again, or use cleanup_batching(flush=True) to run queued requests instead.")
                for req, _ in self._queue:
                    req.fail(exc)
                self._queue.clear()
            thread = self._thread
            if thread is None:
                return
            self._stop = True
            self._cond.notify_all()
        if wait and thread is not threading.current_thread():
            thread.join()

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queue_size": len(self._queue),
                "pending_requests": len({id(r) for r, _ in self._queue}),
                "processing": self._processing > 0,
                "processing_rows": self._processing,
                "worker_alive": self._thread is not None and self._thread.is_alive(),
                "batches_run": self.batches_run,
                "rows_run": self.rows_run,
            }

    # -------------------------------------------------------------------------------------------- worker side
    def _next_batch(self, now: float) -> list[tuple[_Request, int]] | float:
        """Under the lock: pop the next ready batch, or return the seconds until one may become ready."""
        groups: list[list[tuple[_Request, int]]] = []
        for item in self._queue:
            for g in groups:
                if g[0][0] is item[0] or g[0][0].compatible(item[0]):
                    g.append(item)
                    break
            else:
                groups.append([item])
        for g in groups:  # FIFO: groups are ordered by their oldest row
            if self._stop or g[0][0].solo or len(g) >= (self.min_batch_size or 1) or g[0][0].deadline <= now:
                if any(r.order is not None for r, _ in g):  # (order, arrival, row); unordered rows last, FIFO
                    g = sorted(g, key=_row_rank)
                batch = g if g[0][0].solo else g[: self.max_batch_size]
                taken = {(id(r), i) for r, i in batch}
                self._queue = [it for it in self._queue if (id(it[0]), it[1]) not in taken]
                return batch
        return max(min(g[0][0].deadline for g in groups) - now, 0.0)

    def _worker(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never leave a caller blocked if the worker dies
            with self._cond:
                for req, _ in self._queue:
                    req.fail(exc, exc.__traceback__)
                self._queue.clear()
                self._stop, self._thread = False, None
            raise

    def _serve(self) -> None:
        while True:
            with self._cond:
                while True:
                    self._queue = [it for it in self._queue if not it[0].done.is_set()]  # drop failed requests' rows
                    if not self._queue:
                        if self._stop:
                            self._stop, self._thread = False, None
                            self._cond.notify_all()
                            return
                        self._cond.wait()
                        continue
                    batch = self._next_batch(time.monotonic())
                    if isinstance(batch, list):
                        break
                    self._cond.wait(timeout=batch)
                self._processing = len(batch)
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._processing = 0
                    self.batches_run += 1
                    self.rows_run += len(batch)
                del batch

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        requests = list({id(r): r for r, _ in batch}.values())
        live = [(r, i) for r, i in batch if not r.done.is_set()]
        if not live:
            return
        head = live[0][0]
        if head.solo:
            try:
                head.results[0] = head.fn(head.rows[0], **head.kwargs)
            except BaseException as exc:  # noqa: BLE001 - delivered to its caller
                head.fail(exc, exc.__traceback__, (len(head.rows), 1))
                if not isinstance(exc, Exception):
                    raise
            head.done.set()
            return
        try:
            stacked = lazy_stack([r.rows[i] for r, i in live])
            out = head.fn(stacked, **head.kwargs)
            if not isinstance(out, TensorDictBase) and not is_tensorclass(out):
                raise TypeError(f"batched function {head.fn!r} returned {type(out).__name__}; expected a tensordict")
            if out.batch_dims < 1 or out.batch_size[0] != len(live):
                raise RuntimeError(
                    f"batched function {head.fn!r} returned batch_size={list(out.batch_size)} for a stacked input of "
                    f"{len(live)} rows; it must return one output row (leading dim) per input row.")
            rows_out = [stacked.tensordicts[k] for k in range(len(live))] if out is stacked else out.unbind(0)
        except BaseException as exc:  # noqa: BLE001 - delivered to the callers of this batch only
            for r in requests:
                r.fail(exc, exc.__traceback__, (len(live), len(requests)))
            if not isinstance(exc, Exception):
                raise
            return
        for (r, i), row in zip(live, rows_out):
            r.results[i] = row
            r.remaining -= 1
            if r.remaining == 0 and not r.done.is_set():
                r.done.set()


def _row_rank(item: tuple[_Request, int]) -> tuple[int, int, int, int]:
    """Sort key of a queued row: ``(batch_order, arrival, row index)``, rows without an order after ordered ones."""
    req, i = item
    return (0, req.order, req.arrival, i) if req.order is not None else (1, 0, req.arrival, i)

