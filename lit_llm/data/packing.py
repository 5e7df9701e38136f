"""SFT packing: several tokenised rows concatenated into each sequence of a micro-batch, never attending to each other.

A **packed micro-batch** (:func:`collate_packed`) holds ``P`` packs of at most ``max_length`` tokens. Each pack is a
concatenation of whole rows (a row is never split across packs; rows longer than ``max_length`` are an error, the
data module truncates them when tokenising), right-padded to the longest pack. ``position_ids`` restart at 0 at the
first token of every row, which is how the model tells the rows apart: transformers builds a block-diagonal causal
mask from ``position_ids`` when it gets **no** attention mask and **no** KV cache (``use_cache=False``; see
:func:`lit_llm.policy.logprobs.token_hidden_states`), and flash-attention's varlen kernels read the same
``position_ids`` on GPU (documented by transformers, not tested here). Packing is applied to one micro-batch's rows
at a time, so an optimizer step holds exactly the rows it holds without packing. Two strategies:
:func:`least_padding_packs` (the default: the number of packs and their balance that put the fewest positions
through the model -- never more than the unpacked micro-batch, which is its ``k = N`` candidate) and TRL's
``packing=True`` default, best fit decreasing (:func:`best_fit_decreasing`, ``trl.data_utils.pack_dataset(...,
strategy="bfd")``), which fills packs to ``max_length`` but leaves the last ones short (padding up to the longest).

Losses are formed per original row: :func:`unpack_rows` gathers any ``[P, L, ...]`` per-position tensor back to the
``[N, T]`` layout of :func:`lit_llm.data.datasets.collate` on the same rows (same order), so token and sequence
normalisation count exactly what they count unpacked (DESIGN.md property 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lit_llm.data.datasets import TokenizedExample

__all__ = ["PACKED_KEYS", "best_fit_decreasing", "collate_packed", "is_packed", "least_padding_packs", "unpack_rows"]

PACKED_KEYS = ("position_ids", "row_index", "unpack_index", "row_lengths")
"""Keys a packed micro-batch holds beyond the unpacked one's (see :func:`collate_packed`)."""


def best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group row indices into packs of total length ``<= max_length`` (best-fit decreasing bin packing).

    Rows are taken longest first (ties: lower index first); each goes into the open pack with the **least** room left
    that still fits it (ties: the pack opened first), or opens a new pack. Deterministic; every index appears in
    exactly one pack; no row is split. Best-fit decreasing has the asymptotic worst case ``11/9`` of the optimal
    number of packs (Johnson 1973, as first-fit decreasing); it is the strategy TRL's ``pack_dataset`` defaults to.

    Args:
        lengths: token count of each row (``>= 1``).
        max_length: the pack capacity in tokens (``>= 1``).

    Returns:
        Packs in the order they were opened; each a list of row indices in the order they were placed.

    Raises:
        ValueError: ``max_length < 1``, a length below 1, or a row longer than ``max_length`` (rows are never split:
            truncate them first, as ``SFTDataModule`` does with its ``max_length``).
    """
    _check_lengths("best_fit_decreasing", lengths, max_length)
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        best = min((r, j) for j, r in enumerate(room) if r >= n) if any(r >= n for r in room) else None
        if best is None:
            packs.append([i])
            room.append(max_length - n)
        else:
            packs[best[1]].append(i)
            room[best[1]] -= n
    return packs


def _check_lengths(name: str, lengths: Sequence[int], max_length: int) -> None:
    if max_length < 1:
        raise ValueError(f"{name}: max_length must be >= 1, got {max_length}.")
    for i, n in enumerate(lengths):
        if n < 1 or n > max_length:
            raise ValueError(f"{name}: row {i} has {n} tokens; every row needs 1..max_length={max_length} tokens "
                             f"(rows are never split across packs; truncate them to max_length).")


def least_padding_packs(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group row indices into packs of total length ``<= max_length`` so that ``P * L`` (packs times the longest
    pack: the positions a right-padded ``[P, L]`` batch puts through the model) is smallest.

    For each candidate number of packs ``k`` from ``ceil(sum / max_length)`` to ``N``, rows are dealt longest first
    to the currently shortest pack (LPT scheduling, Graham 1969); a ``k`` whose deal overflows ``max_length`` is
    skipped; :func:`best_fit_decreasing`'s packs are one more candidate (LPT can miss a tight fit that BFD finds).
    The cheapest candidate wins; ties go to more (hence shorter) packs, whose attention costs less. ``k = N`` is one
    row per pack, the unpacked layout, so the result never pads more than the unpacked micro-batch, nor more than
    best fit decreasing.
    Deterministic; every index appears in exactly one pack; no row is split.

    Args:
        lengths: token count of each row (``>= 1``).
        max_length: the pack capacity in tokens (``>= 1``).

    Returns:
        Packs, each a list of row indices in the order they were placed (no empty pack).

    Raises:
        ValueError: ``max_length < 1``, a length below 1, or a row longer than ``max_length``.
    """
    _check_lengths("least_padding_packs", lengths, max_length)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bfd = best_fit_decreasing(lengths, max_length)
    best = (len(bfd) * max(sum(lengths[i] for i in p) for p in bfd), -len(bfd), bfd)
    for k in range(-(-sum(lengths) // max_length), len(lengths) + 1):
        packs: list[list[int]] = [[] for _ in range(k)]
        fill = [0] * k
        for i in order:
            j = min(range(k), key=lambda j: (fill[j], j))
            if fill[j] + lengths[i] > max_length:
                break
            packs[j].append(i)
            fill[j] += lengths[i]
        else:
            cost = (k * max(fill), -k)
            if cost < best[:2]:
                best = (*cost, packs)
    return best[2]


def collate_packed(samples: Sequence[TokenizedExample], *, pad_token_id: int, max_length: int,
                   strategy: str = "least_padding") -> dict[str, Any]:
    """Pack tokenised rows into ``P`` sequences of at most ``max_length`` tokens (see the module docstring).

    Args:
        samples: ``N >= 1`` rows, each of ``1..max_length`` tokens.
        pad_token_id: id written at padding (padding is read from ``attention_mask`` only, never from ids).
        max_length: pack capacity in tokens.
        strategy: ``"least_padding"`` (:func:`least_padding_packs`) or ``"bfd"`` (:func:`best_fit_decreasing`).

    Returns:
        ``{"input_ids": [P, L] long, "attention_mask": [P, L] long (0 at padding), "position_ids": [P, L] long (0 at
        the first token of each row, +1 per token, 0 at padding), "row_index": [P, L] long (index into
        ``sample_ids`` of the row at each position, -1 at padding), "assistant_mask" / "response_mask": [P, L] bool,
        "unpack_index": [N, T] long, "row_lengths": [N] long, "sample_ids": list[str] (N, the input order)}`` with
        ``L`` the longest pack (``<= max_length``) and ``T`` the longest row. Padding is on the right of each pack.
        ``unpack_index[r, j]`` is the flat position (``pack * L + column``) of row ``r``'s token ``j`` (0 for
        ``j >= row_lengths[r]``); :func:`unpack_rows` uses it.

    Raises:
        ValueError: ``samples`` is empty, a row is empty or longer than ``max_length``, or an unknown ``strategy``.
    """
    if not samples:
        raise ValueError("collate_packed: got an empty list of samples.")
    if strategy not in ("least_padding", "bfd"):
        raise ValueError(f"collate_packed: strategy must be 'least_padding' or 'bfd', got {strategy!r}.")
    lengths = [len(s) for s in samples]
    packs = (least_padding_packs if strategy == "least_padding" else best_fit_decreasing)(lengths, max_length)
    p, width, n, t = len(packs), max(sum(lengths[i] for i in pack) for pack in packs), len(samples), max(lengths)
    ids = torch.full((p, width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((p, width), dtype=torch.long)
    pos = torch.zeros((p, width), dtype=torch.long)
    row_index = torch.full((p, width), -1, dtype=torch.long)
    assistant = torch.zeros((p, width), dtype=torch.bool)
    response = torch.zeros((p, width), dtype=torch.bool)
    unpack_index = torch.zeros((n, t), dtype=torch.long)
    for k, pack in enumerate(packs):
        start = 0
        for i in pack:
            s, m = samples[i], lengths[i]
            cols = slice(start, start + m)
            ids[k, cols], attn[k, cols], pos[k, cols], row_index[k, cols] = s.input_ids, 1, torch.arange(m), i
            assistant[k, cols], response[k, cols] = s.assistant_mask, s.response_mask
            unpack_index[i, :m] = k * width + start + torch.arange(m)
            start += m
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "row_index": row_index,
            "assistant_mask": assistant, "response_mask": response, "unpack_index": unpack_index,
            "row_lengths": torch.tensor(lengths, dtype=torch.long), "sample_ids": [s.sample_id for s in samples]}


def is_packed(batch: dict[str, Any]) -> bool:
    """Whether a collated micro-batch is packed (holds ``unpack_index``, see :func:`collate_packed`)."""
    return "unpack_index" in batch


def unpack_rows(packed: Tensor, unpack_index: Tensor, row_lengths: Tensor, *, fill: float | bool = 0) -> Tensor:
    """Gather a per-position tensor of a packed micro-batch back to its rows: ``[P, L, *] -> [N, T, *]``.

    ``out[r, j] = packed.flatten(0, 1)[unpack_index[r, j]]`` for ``j < row_lengths[r]``, ``fill`` after (right
    padding), i.e. the layout :func:`lit_llm.data.datasets.collate` gives the same rows. Differentiable (a gather).

    Args:
        packed: ``[P, L]`` or ``[P, L, *]`` tensor aligned with the packs (log-probs, masks, hidden states).
        unpack_index: ``[N, T]`` long, from :func:`collate_packed`.
        row_lengths: ``[N]`` long, from :func:`collate_packed`.
        fill: value at the padding of each row (cast to ``packed``'s dtype).

    Returns:
        ``[N, T, *]`` tensor of ``packed``'s dtype and device.

    Raises:
        ValueError: ``packed`` has fewer than 2 dims, or the index does not fit it.
    """
    if packed.dim() < 2:
        raise ValueError(f"unpack_rows: packed must be [P, L, ...], got shape {tuple(packed.shape)}.")
    flat = packed.flatten(0, 1)
    index = unpack_index.to(packed.device)
    if index.numel() and (int(index.max()) >= flat.shape[0] or int(index.min()) < 0):
        raise ValueError(f"unpack_rows: unpack_index reaches position {int(index.max())} but the packs hold "
                         f"{flat.shape[0]}; pass the unpack_index of the same packed micro-batch.")
    out = flat[index]
    real = torch.arange(index.shape[1], device=packed.device)[None] < row_lengths.to(packed.device)[:, None]
    real = real.reshape(*real.shape, *([1] * (out.dim() - 2)))
    return torch.where(real, out, torch.as_tensor(fill, dtype=out.dtype, device=out.device))
