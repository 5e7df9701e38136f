"""The loss heads' masks, defined once: which positions the ``sft`` (prompt-masked), ``rlhf`` (assistant-masked) and
``generic`` (attention-masked) heads train on, given the positions that have a prediction.

Used by the log-prob version's ``get_<head>_dist`` / ``head_mask`` (:mod:`lit_llm.policy.dists`, which finds the
response of the ``sft`` head from the prompt, the history or the assistant mask) and by
:func:`lit_llm.objectives.sft.loss_mask` (which the SFT data module uses to drop rows with nothing to train).
Masks are ``[B, T]`` ``torch.bool``.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

__all__ = ["HEADS", "Head", "head_positions", "scorable_positions"]

Head = Literal["sft", "rlhf", "generic"]
#: The loss heads (TorchRL's ``get_dist`` variants).
HEADS: tuple[str, ...] = ("sft", "rlhf", "generic")


def scorable_positions(attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """``[B, T]`` bool: the attended positions that have a prediction: every attended token but each row's first
    (with ``position_ids``, packed rows: every sequence's first, where its position id is 0)."""
    if position_ids is not None:
        return attention_mask & (position_ids > 0)
    return attention_mask & (attention_mask.long().cumsum(-1) > 1)


def head_positions(head: str, scorable: Tensor, *, assistant_mask: Tensor | None = None,
                   response_mask: Tensor | None = None) -> Tensor:
    """The positions a loss head trains on: ``generic`` every scorable position; ``rlhf`` the scorable assistant
    tokens (``assistant_mask``, every assistant turn, DESIGN.md property 3); ``sft`` the scorable tokens of the last
    turn's response (``response_mask``: after the prompt rendered with the generation prompt, through the stop
    token).

    Args:
        head: ``"sft"``, ``"rlhf"`` or ``"generic"``.
        scorable: ``[B, T]`` bool (:func:`scorable_positions`).
        assistant_mask: ``[B, T]`` bool, needed by ``rlhf``.
        response_mask: ``[B, T]`` bool, needed by ``sft``.

    Raises:
        ValueError: an unknown head, or the mask it needs missing (callers name where it comes from first).
    """
    if head == "generic":
        return scorable
    needed = {"rlhf": assistant_mask, "sft": response_mask}
    if head not in needed:
        raise ValueError(f"Unknown loss head {head!r}; choose one of {', '.join(map(repr, HEADS))}.")
    mask = needed[head]
    if mask is None:
        raise ValueError(f"loss head {head!r} needs {'assistant_mask' if head == 'rlhf' else 'response_mask'}.")
    return mask & scorable
