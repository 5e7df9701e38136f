"""Padding of ragged 1-D rows into one ``[B, T]`` tensor (shared by the containers and the policy layer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pad_rows"]


def pad_rows(rows: Sequence[Tensor], pad_value: int | float | bool, *, side: str = "left") -> Tensor:
    """Stack 1-D tensors into ``[B, T_max]``, padding on ``side`` with ``pad_value``.

    Args:
        rows: ``B`` 1-D tensors of one dtype.
        pad_value: fill value.
        side: ``"left"`` (default) or ``"right"``.

    Returns:
        ``[B, T_max]`` tensor of the rows' dtype (``[B, 0]`` when every row is empty).
    """
    width = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), width), pad_value, dtype=rows[0].dtype if rows else torch.long,
                     device=rows[0].device if rows else None)
    for i, r in enumerate(rows):
        if r.numel():
            if side == "left":
                out[i, width - r.numel():] = r
            else:
                out[i, :r.numel()] = r
    return out
