""":class:`GracefulStop`: ``SIGTERM`` / ``SIGINT`` end a ``fit`` at the next safe point, with a resumable ``last.ckpt``.

A cluster's preemption (``SIGTERM``, e.g. SLURM's ``scancel`` or a Kubernetes eviction) or Ctrl-C (``SIGINT``) while
training:

1. the first signal is recorded, with one line on stderr; training goes on to the next **safe point**: the end of the
   current training batch (one optimizer step; ``num_iterations`` steps for GRPO), or the end of a validation run
   inside ``fit``;
2. there, the ranks agree (``strategy.reduce_boolean_decision(..., all=False)``: a signal on any rank stops every
   rank together; the signal number is reduced with ``max``), every :class:`~lightning.pytorch.callbacks.
   ModelCheckpoint` with ``save_last`` writes ``last.ckpt`` at once (the same save as its every-N-steps one, so
   ``--ckpt_path last`` resumes exactly), and ``trainer.should_stop`` ends the fit the way Lightning's early stopping
   does, without the validation Lightning runs after a stop request when none was due at that step
   (``trainer.limit_val_batches`` is 0 for the rest of the fit and restored at its end); an evaluation due at that
   step still runs (after the checkpoint), as in an uninterrupted run;
3. ``lit-llm fit`` then exits with status **143** after ``SIGTERM`` and **130** after ``SIGINT`` (``128 + signal``, what
   a shell reports for a process killed by that signal; :func:`stop_exit_code`), never 0;
4. a **second** signal exits at once: the process kills itself with that signal (default action), after killing the
   DDP ranks it launched. A save it interrupts never leaves a half-written checkpoint under a checkpoint's name: a
   single-file checkpoint is written to a temporary file and renamed (Lightning), and a sharded checkpoint folder
   (``ModelParallelStrategy``) is written beside its place and swapped in by the CLI's
   :class:`~lit_llm.lightning.callbacks.StepCheckpoint` (:mod:`lit_llm.lightning.sharded_save`), so the previous
   complete checkpoint stays (a ``ModelCheckpoint`` of your own under that strategy rewrites its folders in place:
   Lightning's behaviour);
5. the **same** signal again within :data:`DEBOUNCE_S` (2 s) of the first is not a second one but the same request
   delivered twice (a job runner that signals the whole process group, e.g. ``timeout`` with a group kill, SLURM,
   ``kill -- -PGID``, or torchrun forwarding a signal its workers also got, reaches a process twice within
   milliseconds): one line on stderr, and the stop goes on as in 1-3. The other stop signal within the window, or
   the same one after it, exits at once (4). The window is timed when Python runs the handler
   (:func:`time.monotonic`, read in the main thread between bytecodes), not at delivery: copies that arrive while
   the main thread is inside one C call run the handler once; a C call longer than the window between the two
   would make the copy a second signal.

Lightning's own ``SIGTERM`` handling (``_SignalConnector``: sets ``trainer.received_sigterm``, which makes its loops
raise ``SIGTERMException`` after the batch: a ``SystemExit`` with status 0, loggers finalized as failed, no checkpoint;
under DDP it broadcasts from inside the signal handler) is registered when the trainer starts running; this callback
replaces both handlers from ``on_train_start`` to ``on_train_end`` (Lightning restores the originals at its teardown)
and still honours ``trainer.received_sigterm`` for a ``SIGTERM`` that arrived before training started and let it
start (a ``SIGTERM`` during model loading or the step-0 evaluation ends the process there, by Lightning's or the
default handler, exit 143 with no checkpoint: nothing was trained yet). Handlers can
only be installed from the main thread (elsewhere the callback does nothing); a ``SIGTERM`` Lightning received
before counts as a first signal received at ``on_train_start`` (for the window). A main thread blocked inside a C
call (a collective waiting for a hung rank) runs Python signal handlers only when the call returns: then only
``SIGKILL`` ends the process.

The modules add the callback themselves (:meth:`~lit_llm.lightning.module.PolicyModule.configure_callbacks`), so
``--trainer.callbacks`` cannot drop it; ``trainer.fit`` called from Python returns normally after a stop
(:func:`stop_exit_code` says why).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_llm.lightning.callbacks import validation_follows

__all__ = ["DEBOUNCE_S", "STOP_SIGNALS", "GracefulStop", "stop_exit_code"]

#: The signals that stop a fit gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Seconds after the first stop signal within which the same signal again is the same request delivered twice (a
#: process group signalled as a whole), not the second signal that exits at once.
DEBOUNCE_S = 2.0


def _say(text: str) -> None:
    """One line on stderr from a signal handler (``os.write``: no buffered stream is re-entered)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class GracefulStop(Callback):
    """Stop ``fit`` cleanly on ``SIGTERM`` / ``SIGINT`` (see the module docstring).

    Args:
        clock: seconds of a monotonic clock, read in the signal handler for :data:`DEBOUNCE_S` (tests pass a fake).

    Attributes:
        signal: the signal that stopped the fit (any rank's; ``None`` while running or when it ended otherwise).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.signal: int | None = None
        self._clock = clock
        self._received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self._trainer: Trainer | None = None
        self._limit_val_batches: int | float | None = None

    # ------------------------------------------------------------------------------------------------ handlers
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the handlers (main thread only); a ``SIGTERM`` Lightning already received counts as the first."""
        self.signal, self._received, self._trainer = None, None, trainer
        if trainer.received_sigterm:
            self._received, self._received_at = signal.SIGTERM, self._clock()
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()
        self._restore_validation(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()  # after an exception (on_train_end did not run)
        self._restore_validation(trainer)
        self._trainer = None

    def _restore_validation(self, trainer: Trainer) -> None:
        """Give ``trainer.limit_val_batches`` back (a later ``trainer.validate()`` reads it)."""
        if self._limit_val_batches is not None:
            trainer.limit_val_batches, self._limit_val_batches = self._limit_val_batches, None

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # not replaced since (Lightning restores its originals)
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        trainer = self._trainer
        rank = f"[rank {trainer.global_rank}] " if trainer is not None and trainer.world_size > 1 else ""
        now = self._clock()  # a Python handler runs in the main thread between bytecodes: any call is safe here
        if self._received is None:
            self._received, self._received_at = signum, now
            _say(f"{rank}lit-llm: {name} received: stopping after the current optimizer step and writing last.ckpt "
                 f"(exit status {128 + signum}); send it again after {DEBOUNCE_S:g} s to exit at once.")
            return
        if signum == self._received and now - self._received_at < DEBOUNCE_S:  # one request delivered twice
            _say(f"{rank}lit-llm: {name} again within {DEBOUNCE_S:g} s of the first: the same stop request (still "
                 f"stopping after the current optimizer step).")
            return
        second = f"second {name}" if signum == self._received else \
            f"{name} after {signal.Signals(self._received).name}"  # a signal of the other kind is a second one too
        _say(f"{rank}lit-llm: {second}: exiting at once (a checkpoint being written is dropped; the last "
             f"complete one stays).")
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        if launcher is not None:  # the DDP ranks this process started would wait for it forever
            launcher.kill(signal.SIGKILL)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    # ------------------------------------------------------------------------------------------------ safe points
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        due = validation_follows(trainer)  # before should_stop, which Lightning answers with a validation
        if self._stop_if_asked(trainer) and not due:
            self._limit_val_batches, trainer.limit_val_batches = trainer.limit_val_batches, 0

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._trainer is trainer:
            self._stop_if_asked(trainer)

    def _stop_if_asked(self, trainer: Trainer) -> bool:
        """At a safe point, on every rank: stop when any rank received a signal (one collective). Returns whether
        it stopped the fit here."""
        if self.signal is not None:
            return False
        local = self._received or (signal.SIGTERM if trainer.received_sigterm else 0)
        if not trainer.strategy.reduce_boolean_decision(bool(local), all=False):
            return False
        signum = int(local)
        if trainer.world_size > 1:
            signum = int(trainer.strategy.reduce(torch.tensor(signum, device=trainer.strategy.root_device),
                                                 reduce_op="max"))
        self.signal = signum
        saved = []
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.save_last:
                cb._save_last_checkpoint(trainer, cb._monitor_candidates(trainer))
                saved.append(cb.last_model_path)
        trainer.should_stop = True
        where = f"{', '.join(saved)} written (resume with --ckpt_path last)" if saved else "no checkpoint callback"
        rank_zero_info(f"lit-llm: {signal.Signals(signum).name}: training stopped after step {trainer.global_step}; "
                       f"{where}; exit status {128 + signum}.")
        return True


def stop_exit_code(trainer: Trainer | None) -> int | None:
    """``128 + signal`` when a :class:`GracefulStop` of ``trainer`` stopped its fit (143 for ``SIGTERM``, 130 for
    ``SIGINT``), else ``None``."""
    for cb in getattr(trainer, "callbacks", None) or ():
        if isinstance(cb, GracefulStop) and cb.signal is not None:
            return 128 + int(cb.signal)
    return None
