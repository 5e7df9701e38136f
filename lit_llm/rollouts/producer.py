"""Asynchronous rollouts: a background thread produces the next rollout batches from a copy of the weights.

The producer iterates the prompt loader and, for each prompt batch, loads the most recently staged weights
(:meth:`AsyncRollouts.sync_weights`, called every ``sync_every`` optimizer steps by
:class:`~lit_llm.lightning.versions.PolicyVersionSwitch`) into its own engine's model and calls
:meth:`~lit_llm.rollouts.engine.RolloutEngine.rollout`. A rollout generated with weights of version ``v`` and consumed
when the trained policy is at version ``s`` has staleness ``s - v``; the GRPO ratio uses its generation-time
log-probs, so the staleness is importance-corrected, and rollouts staler than ``max_staleness`` are dropped and
counted. Reproducible only up to thread timing (which weights a batch is generated with depends on when the sync
lands).

With a shared inference engine (vLLM, ``copy_weights=False``) there is no copy: the producer's engine samples from
the engine the trainer pushes into, and :meth:`AsyncRollouts.between_rollouts` runs the push on the trainer's thread
once the rollout in flight is done (never during one, so every rollout comes from one version of the weights).

Under sharded training (FSDP2) the copy is not a deep copy: :func:`~lit_llm.rollouts.model_copy.unsharded_copy`
builds a plain model of the same architecture holding the full weights (one full copy per rank, as under DDP), and
:meth:`AsyncRollouts.sync_weights` gathers the shards (``full_tensor()``). Both are collectives, run on the trainer's
thread by every rank at the same step; the producer thread only generates from its plain copy, with no collective.

Resume: when the prompt iterable is stateful (``state_dict()`` / ``load_state_dict()``, e.g.
:class:`~lit_llm.lightning.grpo_data.PromptBatchLoader`), every produced batch travels through the queue with the
loader's state right after its prompt batch was drawn (and rolled out), and :attr:`AsyncRollouts.consumed_state` is the
state of the last batch the consumer took (yielded, or dropped as stale): the position of the batches *training
consumed*, not of those the producer drew ahead. A checkpoint that stores it resumes with the first batch training had
not taken; the batches that were queued or being generated are drawn again and regenerated from the restored weights
(the queue itself is not saved). Each new iteration (a new epoch, a resume) rewinds the loader to that state first,
and the producer thread starts at the first ``next()``, not at ``iter()``: an ``iter()`` that is never advanced
(Lightning's iterability check) draws nothing.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from lit_llm.policy.frozen_weights import cast_frozen_matmul_weights
from lit_llm.policy.sharding import is_sharded
from lit_llm.policy.thread_context import current_device_index
from lit_llm.rollouts.batch import RolloutBatch
from lit_llm.rollouts.engine import RolloutEngine, RolloutError
from lit_llm.rollouts.model_copy import full_weights, unsharded_copy

__all__ = ["AsyncRollouts"]

_STOP = object()


def _loader_state(prompts: Any) -> dict[str, Any] | None:
    """``prompts.state_dict()`` (a copy), or ``None`` when it has none."""
    fn = getattr(prompts, "state_dict", None)
    return dict(fn()) if callable(fn) else None


class AsyncRollouts:
    """Iterable of rollout batches produced on a background thread from a separately held copy of the weights.

    The producer thread iterates ``prompts`` (e.g. a prompt ``DataLoader``), and for each prompt batch loads the most
    recently staged weights (:meth:`sync_weights`) into its engine's model and calls
    :meth:`RolloutEngine.rollout`; at most ``queue_size`` finished batches wait. Iterating yields them in order;
    a batch whose staleness ``trainer_version - policy_version`` exceeds ``max_staleness`` is dropped and counted
    in :attr:`num_dropped`. The trainer side reports its version with :meth:`set_trainer_version` (and
    :meth:`sync_weights`). An exception in the producer is re-raised by the next ``next()`` with its traceback.

    Note: the engine must own its model (a copy of the trained one, see :meth:`from_policy`). With a
    ``seed`` its rows sample from per-row generators (never the process RNG), seeded by the prompt batch's index in
    the run (:meth:`_batch_index`: a resumed run's batch gets the seeds it had, and no epoch repeats another's).

    The producer thread starts at the first ``next()`` of an iteration (an iterator that is never advanced draws no
    prompt). With a stateful ``prompts`` (``state_dict()`` / ``load_state_dict()``), :attr:`consumed_state` is its
    state after the last batch the consumer took (yielded or dropped as stale), and every new iteration first rewinds
    ``prompts`` to it, so prompt batches drawn ahead but never taken are drawn again (see the module docstring).

    Args:
        engine: a :class:`RolloutEngine` over the copy of the weights.
        prompts: an iterable of prompt batches (re-iterated by every ``iter()``, i.e. every epoch).
        max_staleness: the largest accepted ``trainer_version - policy_version`` (0 = only rollouts from the current
            weights; note that a dataloader that prefetches one batch makes most rollouts at least 1 step old).
        queue_size: finished batches kept ahead (>= 1).
        rollout_context: a factory of the context each rollout runs in on the producer thread, besides
            ``torch.no_grad()`` (e.g. the trainer's precision context: autocast is thread-local).

    Raises:
        RolloutError: ``max_staleness < 0`` or ``queue_size < 1``.
    """

    def __init__(self, engine: RolloutEngine, prompts: Iterable[Mapping[str, Any]], *, max_staleness: int = 1,
                 queue_size: int = 1, rollout_context: Callable[[], AbstractContextManager] | None = None) -> None:
        if max_staleness < 0 or queue_size < 1:
            raise RolloutError(f"AsyncRollouts: max_staleness must be >= 0 and queue_size >= 1, got {max_staleness}, "
                               f"{queue_size}.")
        self.engine, self.prompts = engine, prompts
        self.max_staleness, self.queue_size = max_staleness, queue_size
        self.rollout_context = rollout_context or nullcontext
        self.trainer_version = engine.version
        self.num_dropped = 0
        self.num_produced = 0
        self._consumed: dict[str, Any] | None = None  # prompts' state after the last batch taken (stateful prompts)
        self._staged: tuple[dict[str, Tensor], int, bool] | None = None
        self._lock = threading.Lock()
        self._generating = threading.RLock()  # held by the producer around each rollout (see between_rollouts)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_policy(cls, policy: Any, prompts: Iterable[Mapping[str, Any]], *, max_staleness: int = 1,
                    queue_size: int = 1, version: int = 0,
                    rollout_context: Callable[[], AbstractContextManager] | None = None,
                    engine_cls: type[RolloutEngine] = RolloutEngine, compute_dtype: torch.dtype | None = None,
                    **engine_kwargs: Any) -> AsyncRollouts:
        """Build an engine over a copy of ``policy.model`` (same wrapper settings) and wrap it.

        The copy is ``copy.deepcopy(policy.model)``, or, when the model is sharded with FSDP2
        (:func:`~lit_llm.policy.sharding.is_sharded`), a plain model of the same architecture holding its full weights
        (:func:`~lit_llm.rollouts.model_copy.unsharded_copy`: no deep copy of the shards; a collective, so every rank
        calls this together, on the trainer's thread). Either way eval mode, no grad, on this rank's device.

        Args:
            policy: the generate version (see :class:`RolloutEngine`); its model is copied, not shared.
            prompts, max_staleness, queue_size: see the class.
            version: version of the weights being copied.
            compute_dtype: the compute dtype of the autocast the rollouts run in (``torch.bfloat16`` under
                ``bf16-mixed``): the copy's ``Linear`` weights (not its norms, embeddings or LM head) are cast to it
                once (:func:`~lit_llm.policy.frozen_weights.cast_frozen_matmul_weights`), instead of by autocast at
                every decode step; the same numbers. Synced weights are rounded to it by ``load_state_dict``'s copy,
                as autocast would round them. ``None``: the copy keeps the trained model's dtypes.
            engine_cls: the engine class: :class:`RolloutEngine`, or
                :class:`~lit_llm.rollouts.episodes.EpisodeEngine` for multi-turn episodes (its options, e.g. from
                ``episode=`` :class:`~lit_llm.rollouts.settings.EpisodeSettings`, in ``engine_kwargs``).
            **engine_kwargs: ``engine_cls`` keyword arguments.
        """
        if is_sharded(policy.model):
            model = unsharded_copy(policy.model)
        else:
            model = copy.deepcopy(policy.model).eval().requires_grad_(False)
        if compute_dtype is not None:
            cast_frozen_matmul_weights(model, compute_dtype)
        settings = {**policy._settings(), **policy._batching_settings()}
        twin = type(policy)(model, **settings)
        engine = engine_cls(twin, **engine_kwargs, version=version)
        return cls(engine, prompts, max_staleness=max_staleness, queue_size=queue_size,
                   rollout_context=rollout_context)

    @classmethod
    def from_engine(cls, engine: RolloutEngine, prompts: Iterable[Mapping[str, Any]], *, max_staleness: int = 1,
                    queue_size: int = 1, version: int | None = None,
                    rollout_context: Callable[[], AbstractContextManager] | None = None,
                    trainer_state_fn: Callable[[], Any] | None = None, copy_weights: bool = True,
                    compute_dtype: torch.dtype | None = None) -> AsyncRollouts:
        """A producer over a twin of ``engine``: the same class, settings (taken whole, :meth:`RolloutEngine.
        twin_kwargs`), reward functions and rank, over a copy of its policy's weights (:meth:`from_policy`), or
        with ``copy_weights=False`` over the same policy (a shared inference engine such as vLLM, whose weights the
        trainer pushes through :meth:`between_rollouts`).

        Args:
            engine: the trainer's engine (over the trained weights, or over the shared inference engine).
            prompts, max_staleness, queue_size, rollout_context: see the class.
            version: version of the weights being copied (default: the engine's).
            trainer_state_fn: the twin's ``trainer_state_fn`` (default: the engine's).
            copy_weights: copy the policy's model (``False``: share the policy, no copy).
            compute_dtype: see :meth:`from_policy` (with ``copy_weights`` only).
        """
        kwargs = engine.twin_kwargs()
        if trainer_state_fn is not None:
            kwargs["trainer_state_fn"] = trainer_state_fn
        version = engine.version if version is None else version
        if not copy_weights:
            twin = type(engine)(engine.policy, **kwargs, version=version)
            return cls(twin, prompts, max_staleness=max_staleness, queue_size=queue_size,
                       rollout_context=rollout_context)
        return cls.from_policy(engine.policy, prompts, max_staleness=max_staleness, queue_size=queue_size,
                               version=version, rollout_context=rollout_context, engine_cls=type(engine),
                               compute_dtype=compute_dtype, **kwargs)

    def __len__(self) -> int:
        return len(self.prompts)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------- trainer side
    @torch.no_grad()
    def sync_weights(self, source: torch.nn.Module | Mapping[str, Tensor], version: int, *,
                     trainable_only: bool = False) -> None:
        """Stage a copy of the trained weights; the producer loads them before its next batch.

        Sharded (FSDP2) weights are gathered whole here (:func:`~lit_llm.rollouts.model_copy.full_weights`: one
        all-gather per tensor): a collective, so every rank must call this at the same step, on the trainer's
        thread (:class:`~lit_llm.lightning.versions.PolicyVersionSwitch` calls it from ``on_train_batch_end`` on every
        rank when ``global_step % sync_every == 0``); the producer thread only reads the staged plain tensors.

        Args:
            source: the trained model (or its state dict); tensors are cloned (``DTensor``: gathered) now, so
                training may go on.
            version: the trained policy's version (optimizer steps), also recorded as the trainer version.
            trainable_only: stage only the parameters that require grad (``source`` must be a module), e.g. the LoRA
                adapters: the copy's frozen base never changes, so only the adapters are copied.
        """
        staged = full_weights(source, trainable_only=trainable_only)  # type: ignore[arg-type]
        with self._lock:
            self._staged = (staged, int(version), not trainable_only)
        self.set_trainer_version(version)

    def between_rollouts(self, fn: Callable[[], Any], version: int) -> Any:
        """Call ``fn`` on this (the trainer's) thread while the producer generates nothing, then record ``version``
        as the weights the producer's engine samples with and as the trainer version. Waits for the rollout in flight
        (generation and rewards) to finish; the producer's next rollout starts after ``fn`` returns. For a shared
        inference engine (``copy_weights=False``): ``fn`` pushes the trained weights into it.

        Returns:
            ``fn()``'s result.
        """
        with self._generating:
            result = fn()
            self.engine.version = int(version)
        self.set_trainer_version(version)
        return result

    def generation_turn(self) -> threading.RLock:
        """The lock the producer holds around each rollout: hold it to use a shared engine from another thread
        (e.g. greedy evaluation on the trainer's thread) without meeting a rollout half-way."""
        return self._generating

    def set_trainer_version(self, version: int) -> None:
        """Record the trained policy's current version (staleness is measured against it)."""
        self.trainer_version = int(version)

    def staleness(self, rollout: RolloutBatch) -> int:
        """``trainer_version - policy_version`` of a rollout batch."""
        return self.trainer_version - int(rollout.policy_version.max())

    @property
    def consumed_state(self) -> dict[str, Any] | None:
        """The prompt loader's ``state_dict()`` after the last prompt batch the consumer took: its rollout yielded, or
        dropped as staler than ``max_staleness`` (a dropped batch counts as consumed). Before any batch is taken, the
        loader's own state (where the next iteration starts); ``None`` when ``prompts`` has no ``state_dict``."""
        if self._consumed is not None:
            return dict(self._consumed)
        return _loader_state(self.prompts)

    def restore_prompts(self, state: Mapping[str, Any]) -> None:
        """Stop a running producer (after its current batch) and load ``state`` into the prompt loader
        (``prompts.load_state_dict``): the next iteration starts there and :attr:`consumed_state` is ``state``.

        Raises:
            TypeError: ``prompts`` has no ``load_state_dict``.
        """
        load = getattr(self.prompts, "load_state_dict", None)
        if not callable(load):
            raise TypeError(f"AsyncRollouts.restore_prompts: the prompt iterable ({type(self.prompts).__name__}) has "
                            f"no load_state_dict(); use a stateful loader such as PromptBatchLoader.")
        self.close()
        load(dict(state))
        self._consumed = _loader_state(self.prompts)

    # -------------------------------------------------------------------------------------------- producer
    def _batch_index(self) -> int:
        """The seed step of the prompt batch just drawn: its index in the whole run, ``epoch * len(prompts) +
        position - 1``, for a :class:`~lit_llm.lightning.grpo_data.PromptBatchLoader`-like loader (the same batch
        gets the same seeds after a resume, and the sync mode's ``global_step`` when nothing was dropped), else the
        number of batches produced so far (never restarting at an epoch, so no epoch repeats another's seeds)."""
        state = _loader_state(self.prompts)
        if state is not None and {"epoch", "position"} <= set(state):
            try:
                return int(state["epoch"]) * len(self.prompts) + int(state["position"]) - 1
            except TypeError:  # no len()
                pass
        return self.num_produced

    def _produce(self, it: Iterator[Mapping[str, Any]], q: queue.Queue, stop: threading.Event,
                 device_index: int | None = None) -> None:
        try:
            if device_index is not None:  # the CUDA device of the thread that started it (thread-local)
                torch.cuda.set_device(device_index)
            for batch in it:
                if stop.is_set():
                    return
                with self._lock:
                    staged, self._staged = self._staged, None
                if staged is not None:
                    weights, version, strict = staged
                    self.engine.load_weights(weights, version, strict=strict)
                step = self._batch_index()
                with self._generating, torch.no_grad(), self.rollout_context():
                    td = self.engine.rollout(batch, step=step)
                state = _loader_state(self.prompts)  # after the draw (and any batch the rollout drew)
                self.num_produced += 1
                while not stop.is_set():
                    try:
                        q.put((td, state), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer
            q.put(e)
            return
        q.put(_STOP)

    def __iter__(self) -> Iterator[RolloutBatch]:
        """An iterator whose first ``next()`` stops any previous producer, rewinds a stateful ``prompts`` to
        :attr:`consumed_state` (the batches a previous producer drew but nobody took are drawn again), starts a
        producer over a fresh ``iter(prompts)`` and yields its batches. Nothing starts until that first ``next()``."""
        return self._consume()

    def _start(self) -> queue.Queue:
        self.close()
        load = getattr(self.prompts, "load_state_dict", None)
        if self._consumed is not None and callable(load):
            load(dict(self._consumed))
        else:
            self._consumed = _loader_state(self.prompts)
        stop, q = threading.Event(), queue.Queue(maxsize=self.queue_size)
        self._stop, self._queue = stop, q
        self._thread = threading.Thread(target=self._produce, name="lit_llm-async-rollouts", daemon=True,
                                        args=(iter(self.prompts), q, stop, current_device_index()))
        self._thread.start()
        return q

    def _consume(self) -> Iterator[RolloutBatch]:
        q = self._start()
        while True:
            item = q.get()
            if item is _STOP:
                return
            if isinstance(item, BaseException):
                raise item
            td, state = item
            if state is not None:  # taken, trained or dropped: a checkpoint from now on resumes after it
                self._consumed = state
            if self.staleness(td) > self.max_staleness:
                self.num_dropped += 1
                continue
            yield td

    def close(self) -> None:
        """Stop the producer thread (after its current batch) and forget the queue."""
        if self._thread is not None:
            self._stop.set()
            q = self._queue
            while self._thread.is_alive():
                if q is not None:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass
                self._thread.join(timeout=0.05)
            self._thread = None
        self._queue = None

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass

