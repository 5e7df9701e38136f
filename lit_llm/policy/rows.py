"""Reading per-row entries of a ``[B]`` tensordict: nested keys, unpadded 1-D rows, strings, dense tensors.

Padding is never read from ids (pad == eos for SmolLM2): a dense ``[B, T]`` entry is unpadded with its attention mask.
Shared by :mod:`lit_llm.policy.common`, :mod:`lit_llm.policy.dists` and :mod:`lit_llm.policy.inputs`;
:func:`read_rows` and :func:`read_strings` are re-exported by :mod:`lit_llm.policy.common`.
"""

from __future__ import annotations

import warnings

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

__all__ = ["read_rows", "read_strings"]


def _key(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def read_rows(td: TensorDictBase, key: NestedKey, *, attention_key: NestedKey | None = None) -> list[Tensor] | None:
    """Read a per-row 1-D tensor entry of a ``[B]`` tensordict as ``B`` unpadded rows.

    A lazy stack (ragged rows) is returned row by row. A dense ``[B, T]`` tensor is unpadded with the attention
    mask found at ``attention_key`` (when present with the same shape), since padding can never be read from the ids
    (pad == eos for SmolLM2); without a mask every position is a real token.

    Args:
        td: a tensordict with ``batch_dims == 1``.
        key: the entry, e.g. ``("tokens", "full")``.
        attention_key: where a dense entry's attention mask lives, e.g. ``("masks", "all_attention_mask")``.

    Returns:
        ``B`` 1-D tensors, or ``None`` when the entry is absent.
    """
    rows = _rows_of(td, key)
    if rows is None or attention_key is None:
        return rows
    masks = _rows_of(td, attention_key)
    if masks is None or any(m.shape != r.shape for m, r in zip(masks, rows)):
        return rows
    return [r[m.bool()] for r, m in zip(rows, masks)]


def _rows_of(td: TensorDictBase, key: NestedKey) -> list[Tensor] | None:
    if not _present(td, key):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        value = td.get(key, None, as_list=True)
    if value is None:
        return None
    if isinstance(value, Tensor):
        return list(value.unbind(0))
    return [torch.as_tensor(v) for v in value]


def read_strings(td: TensorDictBase, key: NestedKey) -> list[str] | None:
    """Read a per-row ``str`` entry of a ``[B]`` tensordict as a list of ``B`` strings (``None`` when absent)."""
    if not _present(td, key):
        return None
    value = td.get(key, None)
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [str(v) for v in value]


def _present(td: TensorDictBase, key: NestedKey) -> bool:
    key = _key(key)
    try:
        return td.get(key, None) is not None
    except Exception:  # a ragged lazy stack cannot be stacked by a plain get, but it is there
        return True


def _real_rows(ids: Tensor, attention_mask: Tensor) -> list[Tensor]:
    """The unpadded rows of ``[B, T]`` ids (any padding side)."""
    return [row[m] for row, m in zip(ids.unbind(0), attention_mask.unbind(0))]


def _dense(td: TensorDictBase, key: NestedKey) -> Tensor | None:
    """``td[key]`` when it is one dense tensor (``None`` when absent, ragged or not a tensor)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            value = td.get(key, None)
    except Exception:  # a ragged lazy stack cannot be stacked
        return None
    return value if isinstance(value, Tensor) else None
