"""The GRPO training loader: one batch = the prompts of one optimizer step per rank, in a seeded per-epoch order,
resumable (``state_dict`` / ``load_state_dict``, saved by Lightning in checkpoints).

:class:`PromptBatchLoader` is what :class:`~lit_llm.lightning.grpo_data.GRPODataModule` returns as its training
loader (re-exported there); :func:`collate_prompts` turns rows into the column-wise batch the rollout engine takes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["PromptBatchLoader", "collate_prompts"]


def collate_prompts(rows: Sequence[dict[str, Any]]) -> dict[str, list]:
    """Column-wise prompt batch: ``{key: [row[key] for row in rows]}`` (``prompt_ids`` stay a list of tensors).

    Raises:
        ValueError: no rows, or rows with different keys.
    """
    if not rows:
        raise ValueError("collate_prompts: empty batch.")
    keys = list(rows[0])
    for r in rows[1:]:
        if list(r) != keys:
            raise ValueError(f"collate_prompts: rows have different keys ({keys} vs {list(r)}).")
    return {k: [r[k] for r in rows] for k in keys}


class PromptBatchLoader:
    """Resumable iterable of prompt batches for one rank (one batch = the prompts of one optimizer step).

    Each epoch shuffles the rows with ``seed + epoch``; a global step takes ``batch_size * world_size`` rows, dealt to
    the ranks round-robin; a final incomplete step is dropped (so every step has the same number of prompts).

    Args:
        rows: prompt rows (with ``prompt_ids``).
        batch_size: prompts per step per rank.
        seed: shuffling seed.
        shuffle: shuffle every epoch.
        rank, world_size: this rank and the number of ranks.

    Raises:
        ValueError: ``batch_size < 1`` or fewer rows than one global step needs.
    """

    def __init__(self, rows: list[dict[str, Any]], *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size (prompts per step) must be >= 1, got {batch_size}.")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._num_steps = len(rows) // (batch_size * world_size)
        if self._num_steps == 0:
            raise ValueError(f"{len(rows)} prompts (data.num_train, or the rows of data.path) cannot fill one step of "
                             f"batch_size={batch_size} x {world_size} rank(s); add prompts or lower data.batch_size.")

    def __len__(self) -> int:
        return self._num_steps

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """This rank's row indices of every step of ``epoch`` (deterministic in ``seed`` and ``epoch``)."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        g = self.batch_size * self.world_size
        return [order[s * g:(s + 1) * g][self.rank::self.world_size] for s in range(self._num_steps)]

    def __iter__(self) -> Iterator[dict[str, list]]:
        if self.position >= self._num_steps:
            self.epoch, self.position = self.epoch + 1, 0
        plan = self.epoch_plan(self.epoch)
        while self.position < self._num_steps:
            step = plan[self.position]
            self.position += 1  # counted when handed out: a checkpoint after this step resumes after it
            yield collate_prompts([self.rows[i] for i in step])

    def next_batch(self) -> dict[str, list] | None:
        """The next step's prompt batch of the current epoch, handed out outside the iteration (dynamic sampling's
        extra prompts): the running iteration skips it, a checkpoint counts it; ``None`` once the epoch's steps are
        all handed out (the next epoch starts with the fit loop's next iteration)."""
        if self.position >= self._num_steps:
            return None
        step = self.epoch_plan(self.epoch)[self.position]
        self.position += 1
        return collate_prompts([self.rows[i] for i in step])

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the epoch and the number of its steps already handed out (by the iteration or
        :meth:`next_batch`). ``position == len(self)`` is the end of ``epoch``: the next iteration starts
        ``epoch + 1``. An asynchronous producer saves this state as it was after the last batch training consumed
        (:class:`~lit_llm.lightning.versions.StatefulAsyncRollouts`), not the position it drew ahead to."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (Lightning calls it when resuming from a checkpoint); the next iteration
        starts there.

        Raises:
            ValueError: ``state`` lacks an integer ``epoch`` or ``position`` >= 0.
        """
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"PromptBatchLoader.load_state_dict: expected {{'epoch': int, 'position': int}} (the "
                             f"checkpoint's loops.fit_loop.state_dict.combined_loader entry), got {state!r}.") from e
        if epoch < 0 or position < 0:
            raise ValueError(f"PromptBatchLoader.load_state_dict: epoch and position must be >= 0, got {state!r}.")
        self.epoch, self.position = epoch, position
