"""Seeded per-row sampling: each row draws from its own generator, independent of the batch and the global RNG.

:func:`row_seed` derives the seed of sample ``k`` of a row from the row's base seed; :func:`sample_from_probs` draws
one id per row by inverse CDF from uniforms drawn up front per row. Used by
:func:`~lit_llm.policy.generation.generate_tokens` ``seeds=`` (the generate version's ``sampling_seed``), which
re-exports :func:`row_seed` and :func:`sample_from_probs`. :func:`splitmix64` is the seed mixer (the rollouts' row
and turn seeds use it too).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["row_seed", "sample_from_probs", "splitmix64"]

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014): a bijection of ``[0, 2**64)`` with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)




def row_seed(base: int, k: int) -> int:
    """The seed of sample ``k`` of a row whose base seed is ``base``: ``splitmix64(splitmix64(base) ^ k) >> 1``.

    Used by the generate version for ``num_samples=n`` (sample ``k`` of row ``b`` samples with
    ``row_seed(sampling_seed[b], k)``, ``k = 0`` without ``num_samples``). Nearby bases and indices give unrelated
    seeds (no ``base * m + k`` collisions), and the result fits an int64, so it can itself be stored as a
    ``sampling_seed``.

    Args:
        base: any integer in ``[-2**63, 2**64)``; taken modulo ``2**64`` (an int64's bit pattern).
        k: the sample index, ``>= 0``.

    Returns:
        An int in ``[0, 2**63)``.

    Raises:
        ValueError: ``base`` or ``k`` is not an integer (bools are rejected) or is out of range.
    """
    if isinstance(base, bool) or not isinstance(base, numbers.Integral) or not -(1 << 63) <= int(base) <= _MASK64:
        raise ValueError(f"row_seed: base must be an integer in [-2**63, 2**64), got {base!r}.")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= int(k) <= _MASK64:
        raise ValueError(f"row_seed: k must be a non-negative integer below 2**64, got {k!r}.")
    return splitmix64(splitmix64(int(base) & _MASK64) ^ int(k)) >> 1


def _check_seeds(seeds: Sequence[int] | Tensor, batch: int) -> list[int]:
    """``seeds`` as ``batch`` Python ints modulo ``2**64``; ``ValueError`` naming ``seeds`` otherwise."""
    if isinstance(seeds, Tensor):
        if seeds.dtype.is_floating_point or seeds.dtype.is_complex or seeds.dtype == torch.bool:
            raise ValueError(f"generate_tokens: seeds must hold integers (one int64 per prompt row), got a tensor of "
                             f"dtype {seeds.dtype}.")
        if seeds.ndim != 1:
            raise ValueError(f"generate_tokens: seeds must be 1-D (one seed per prompt row), got shape "
                             f"{list(seeds.shape)}.")
        values = seeds.tolist()
    elif isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise ValueError(f"generate_tokens: seeds must be a sequence of ints or a 1-D integer tensor, got "
                         f"{type(seeds).__name__}.")
    else:
        values = list(seeds)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not -(1 << 63) <= int(v) <= _MASK64:
                raise ValueError(f"generate_tokens: seeds[{i}] must be an integer in [-2**63, 2**64), got {v!r}.")
    if len(values) != batch:
        raise ValueError(f"generate_tokens: seeds has {len(values)} entries for {batch} prompt rows; pass exactly one "
                         f"seed per row (after repeating prompts for several samples).")
    return [int(v) & _MASK64 for v in values]


def _row_uniforms(seeds: list[int], steps: int, device: torch.device) -> Tensor:
    """``[steps, B]`` float64 uniforms in ``[0, 1)``: column ``i`` is ``torch.rand(steps)`` of a generator on
    ``device`` seeded with ``seeds[i]``. Drawn once up front (``B`` generator calls per decode, not per step); a
    row's draws depend only on its seed and ``steps``."""
    rows = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        rows.append(torch.rand(steps, generator=gen, device=device, dtype=torch.float64))
    return torch.stack(rows, dim=1)


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling of one id per row, in one batched op: row ``i`` draws the smallest ``j`` with
    ``cdf_i[j] > uniforms[i] * cdf_i[-1]``, where ``cdf_i`` is the float64 cumulative sum of ``probs[i]``.

    Rows need not be normalised. A token with zero probability is never drawn: its cumulative value equals its
    predecessor's, so the strict ``>`` skips it, and a target at or past the end of the CDF (``u * total`` rounding
    up to ``total``, or ``u = 1``) is clamped to the first position where the CDF reaches its total, which is a
    positive-probability token. Summing in float64 keeps the distortion of tiny probabilities far below fp32's
    (``V * 2**-53`` rather than ``V * 2**-24`` of mass).

    Args:
        probs: ``[B, V]`` non-negative weights (any float dtype), each row with a positive finite sum; rows that
            violate this (NaN, all zeros) give an unspecified id in ``[0, V)``.
        uniforms: ``[B]`` floats in ``[0, 1]`` (float64 recommended), on ``probs``' device.

    Returns:
        ``[B]`` ``torch.long`` ids.

    Raises:
        ValueError: ``probs`` is not 2-D, or ``uniforms`` is not ``[B]``.
    """
    if probs.ndim != 2 or uniforms.shape != probs.shape[:1]:
        raise ValueError(f"sample_from_probs: expected probs [B, V] and uniforms [B], got {list(probs.shape)} and "
                         f"{list(uniforms.shape)}.")
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, uniforms.to(torch.float64)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # first position reaching the total: a positive token
    return torch.minimum(idx, last).squeeze(1)
