"""Resuming the training loader's position exactly: the asynchronous producer's checkpointed state (the batches
training consumed, :class:`StatefulAsyncRollouts`) and the loader state Lightning saves but does not always load back
(:func:`resume_train_loader`, :func:`restore_train_loader`). :class:`~lit_llm.lightning.versions.PolicyVersionSwitch`
calls them (re-exported from :mod:`lit_llm.lightning.versions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lit_llm.rollouts import AsyncRollouts

__all__ = ["StatefulAsyncRollouts", "restore_train_loader", "resume_train_loader"]


def resume_train_loader(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """Prepare a checkpoint for an exact resume of its train loader's plan; return the loader's saved state.

    Lightning's fit loop saves the train loader's ``state_dict`` (``loops.fit_loop.state_dict.combined_loader``, one
    entry per loader) but loads it back only when it counts the run as restarting mid-epoch: not with
    ``max_steps == -1`` when the checkpoint's epoch counts as finished, so the loader would start again at epoch 0.
    :class:`PolicyVersionSwitch` (:meth:`~PolicyVersionSwitch.on_load_checkpoint`) keeps the returned state and loads it
    into the loader itself when Lightning did not (:func:`restore_train_loader`): GRPO's
    :class:`~lit_llm.lightning.grpo_data.PromptBatchLoader` (or the asynchronous producer over it) and SFT's
    :class:`~lit_llm.lightning.datamodules.StepBatchLoader`, whose ``{"epoch", "position"}`` states work alike.

    An epoch that ``max_steps`` ended before its last batch also counts as finished in Lightning's checkpoint (a resume
    with more ``max_epochs`` would skip the rest of it and count one epoch too many); this rewrites the checkpoint's
    ``epoch_progress`` (in place) to the mid-epoch state a checkpoint written during that epoch holds, so Lightning
    resumes inside that epoch. Checkpoints of any lit_llm version load (no key of ours is read). (Lightning 2.6's loop
    state; ``tests/lightning/test_grpo_data.py`` checks the behaviour end to end on a real ``Trainer``.)

    One edge: an epoch whose loader ran out before Lightning's batch count (asynchronous stale drops, dynamic
    sampling's extra batches) and that ended the training looks the same, so its resume runs as one stopped inside
    the epoch: Lightning's resumed epoch takes the next epoch's first batches (as many as were missing), the next
    Lightning epoch the rest of it; the prompt batches are those of the uninterrupted run, ``current_epoch`` lags for
    those first batches (as in :class:`StatefulAsyncRollouts`'s edge; not tested).

    Returns:
        The saved loader states (``[]`` when the checkpoint holds none).
    """
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    batches, epochs = fit.get("epoch_loop.batch_progress"), fit.get("epoch_progress")
    if batches and epochs and not batches.get("is_last_batch", True) and batches["current"]["processed"] > 0:
        for p in (epochs["total"], epochs["current"]):  # stopped by max_steps before its epoch's last batch
            if p["ready"] == p["started"] == p["processed"] == p["completed"] > 0:
                p["processed"] = p["completed"] = p["started"] - 1
    return list(fit.get("state_dict", {}).get("combined_loader") or [])


def restore_train_loader(loader: Any, states: Sequence[Mapping[str, Any]]) -> bool:
    """Load the single saved state of :func:`resume_train_loader` into the train ``loader``
    (:class:`~lit_llm.lightning.grpo_data.PromptBatchLoader` or the asynchronous producer over it,
    :class:`~lit_llm.lightning.datamodules.StepBatchLoader`) unless it already holds it (Lightning restored
    it). Call before the loader's first ``next()``.

    Returns:
        Whether it loaded the state (``False``: none saved, already restored, or a loader without ``state_dict``).
    """
    if len(states) != 1 or not callable(getattr(loader, "load_state_dict", None)):
        return False
    if callable(getattr(loader, "state_dict", None)) and loader.state_dict() == dict(states[0]):
        return False
    loader.load_state_dict(dict(states[0]))
    return True


class StatefulAsyncRollouts(AsyncRollouts):
    """:class:`AsyncRollouts` whose ``state_dict`` / ``load_state_dict`` (saved in checkpoints by Lightning's fit loop)
    are the prompt loader's, at the position of the batches *training consumed*.

    The producer draws prompt batches ahead of training (one queued per ``queue_size``, one being generated); the
    saved state is :attr:`~lit_llm.rollouts.producer.AsyncRollouts.consumed_state`, the loader's state after the last
    batch training took (trained, or dropped as stale: dropped batches count as consumed), so a resumed run trains on
    the prompt batches the uninterrupted run would have taken from that step on, as long as no batch is dropped as
    stale. The batches that were in flight are not saved: the resumed producer draws them again and generates them
    from the restored weights, fresher than the copy the uninterrupted run's producer held, so a batch that run
    dropped (``max_staleness``, often with ``sync_every > 1``) may be trained after the resume, and every later step
    shifts by it (found by a trial: ``max_staleness 0`` or ``sync_every 3``, reproducible, not thread timing). Exact
    there would need the producer's older weights in the checkpoint.

    Under DDP every rank has its own loader and producer; none drops (the callback drops stale batches on all ranks
    together), so every rank consumes the same number of batches and records the same ``(epoch, position)``, and the
    state rank 0 writes is every rank's. The format is :meth:`~lit_llm.lightning.grpo_data.PromptBatchLoader.
    state_dict`'s plain ``{"epoch", "position"}``; a checkpoint written before this fix (the drawn-ahead position, same
    keys) loads, and resumes where its producer had drawn to.

    One edge, single process only: when the producer dropped batches of an epoch and then training took that epoch's
    last batch, Lightning does not know the epoch is over (it counted fewer batches than the loader's length), so a
    run resumed from a checkpoint of that step takes the next epoch's first batches (as many as were dropped) inside
    Lightning's resumed epoch: the prompt batches are the same, ``current_epoch`` lags for those batches."""

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}`` of the prompt loader after the last batch training consumed."""
        return self.consumed_state  # type: ignore[return-value]

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Load ``state`` into the prompt loader; the next iteration's producer starts there
        (:meth:`~lit_llm.rollouts.producer.AsyncRollouts.restore_prompts`)."""
        self.restore_prompts(state)
