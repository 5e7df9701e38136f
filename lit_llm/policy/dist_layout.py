"""Where a log-prob version's masked distribution lives, built from its input without any forward pass:
:class:`DistLayout` (ids and masks of full sequences, or the GRPO prompt/completion layout of :data:`COMPLETION_KEYS`)
and the mask arithmetic over it: the last run of assistant tokens (:func:`_last_run`, per packed sequence with
:func:`_sequence_ids`) and the re-padding index of ``get_dist(padding_side=...)`` (:func:`_repad_index`). Read by
:mod:`lit_llm.policy.dists` (which re-exports :class:`DistLayout` and :data:`COMPLETION_KEYS`), ``inputs.py`` and
``logprob_version.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["COMPLETION_KEYS", "DistLayout"]

COMPLETION_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prompt_index")
"""Top-level keys of the GRPO prompt/completion layout of :meth:`LLMWrapperBase.get_dist` (plus optional
``loss_mask``)."""


@dataclass
class DistLayout:
    """Where a log-prob version's distribution lives; built from the input without any forward pass.

    Attributes:
        tokens: ``[B, T]`` integer ids the distribution's positions refer to (``dist.tokens``).
        attention_mask: ``[B, T]`` bool, real tokens (GRPO layout: ``completion_mask``).
        assistant_mask: ``[B, T]`` bool in the same layout, or ``None`` when unknown.
        source: the input (``[B]``-flattened for full sequences), for prompt lookups and ``mask_key``.
        single: the input had batch shape ``[]``: the dist is over ``[T]`` (row 0).
        completion: the GRPO layout's tensors (``COMPLETION_KEYS`` plus the effective ``loss_mask``), else ``None``.
        position_ids: packed rows (:mod:`lit_llm.data.packing`): ``[B, T]`` long positions restarting at 0 for each
            sequence of a row (0 at padding), else ``None``.
    """

    tokens: Tensor
    attention_mask: Tensor
    assistant_mask: Tensor | None
    source: TensorDictBase
    single: bool = False
    completion: dict[str, Tensor] | None = None
    position_ids: Tensor | None = None


def _last_run(mask: Tensor, sequences: Tensor | None = None) -> Tensor:
    """``[B, T]`` bool: the last contiguous run of True of each row (all False for a row without any); with
    ``sequences`` (``[B, T]`` long ids of the packed sequences, see :func:`_sequence_ids`), of each sequence."""
    pos = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    none = torch.full_like(pos, -1)
    if sequences is None:
        last = torch.where(mask, pos, none).amax(-1, keepdim=True)
        start = torch.where(~mask & (pos < last), pos, none).amax(-1, keepdim=True) + 1
        return mask & (pos >= start) & (pos <= last)
    flat, n = sequences.flatten(), int(sequences.max()) + 1
    per_seq = torch.full((n,), -1, dtype=pos.dtype, device=pos.device)
    last = per_seq.scatter_reduce(0, flat, torch.where(mask, pos, none).flatten(), "amax")[flat].view_as(pos)
    # the last masked-out position before that run, inside the same sequence (-1: the run starts the sequence)
    start = per_seq.scatter_reduce(0, flat, torch.where(~mask & (pos < last), pos, none).flatten(), "amax")
    start = start[flat].view_as(pos) + 1
    return mask & (pos >= start) & (pos <= last)


def _sequence_ids(position_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, T]`` long: a distinct id per packed sequence over the whole batch (a new one at each real token with
    position 0, and at each row start); padding shares its neighbours' ids and is never masked in."""
    starts = (attention_mask & (position_ids == 0)).long()
    starts[:, 0] = 1
    return starts.flatten().cumsum(0).view_as(starts) - 1


def _repad_index(attention_mask: Tensor, side: str) -> Tensor:
    """``[B, T]`` gather index moving each row's contiguous block of real tokens to ``side``."""
    t = attention_mask.shape[-1]
    pos = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    count = attention_mask.long().sum(-1, keepdim=True)
    first = torch.where(attention_mask, pos, torch.full_like(pos, t)).amin(-1, keepdim=True)
    first = torch.where(count > 0, first, torch.zeros_like(first))
    start = torch.zeros_like(first) if side == "right" else t - count  # where the block goes
    return (pos - start + first) % t
