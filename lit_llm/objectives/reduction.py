"""Shared helpers of the loss heads: input checks, the k3 KL estimator and explicit normalisers (DESIGN.md property 6).

All per-token tensors are aligned to ``tokens.full``: shape ``[B, T]``, ``log_probs[b, t] = log p(x_t | x_<t)``.

Normalisation contract used by every loss in :mod:`lit_llm.objectives`: a loss is returned as
``(sum of this micro-batch's per-token (or per-sequence) terms) / normalizer``, where ``normalizer`` is the count
over the **whole optimizer step** (all micro-batches of the gradient-accumulation window, all ranks) passed by the
caller. Summing the returned losses over the micro-batches and ranks of a step then gives exactly the step's mean.
Frameworks that average instead of sum (Lightning divides each micro-batch loss by ``accumulate_grad_batches``;
DDP averages gradients over ranks) must multiply the loss by ``accumulate_grad_batches * world_size`` to undo it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_llm.policy.deferred import DeferredChecks, check_value, deferred_checks

__all__ = ["DeferredChecks", "as_bool_mask", "check_per_token", "check_value", "deferred_checks", "k3_kl",
           "masked_min_max", "resolve_normalizer"]


def as_bool_mask(mask: Tensor, *, name: str, shape: torch.Size | tuple[int, ...] | None = None) -> Tensor:
    """Return ``mask`` as a ``torch.bool`` tensor after checking its shape.

    Args:
        mask: ``[B, T]`` bool tensor, or integer tensor of 0/1 (e.g. a HF ``attention_mask``).
        name: the argument name, used in error messages.
        shape: the expected shape; ``None`` only requires a 2-D tensor.

    Returns:
        ``[B, T]`` bool tensor.

    Raises:
        TypeError: ``mask`` is not a tensor, or is a floating-point tensor.
        ValueError: wrong shape, or integer values other than 0 and 1.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, T], got {type(mask).__name__}.")
    if shape is not None and tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but log_probs has shape {tuple(shape)}; align both "
                         f"to tokens.full [B, T].")
    if mask.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(mask.shape)}.")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} must be torch.bool (or 0/1 integers), got {mask.dtype}; pass mask.bool().")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"{name} holds values other than 0 and 1; pass a boolean mask.")
    return mask.bool()


def check_per_token(x: Tensor, *, name: str, shape: torch.Size | tuple[int, ...] | None = None) -> Tensor:
    """Check that ``x`` is a floating-point ``[B, T]`` tensor (log-probs, entropies) of the expected shape.

    Args:
        x: per-token values, ``[B, T]``, floating point (fp32 by convention).
        name: the argument name, used in error messages.
        shape: the expected shape; ``None`` only requires a 2-D tensor.

    Returns:
        ``x`` unchanged.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: ``x`` is not 2-D or its shape differs from ``shape``.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point torch.Tensor [B, T] (fp32 log-probs), got {got}.")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}.")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)} but expected {tuple(shape)} (aligned to tokens.full).")
    return x


def k3_kl(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of ``KL(pi || pi_ref)``: ``exp(ref - logp) - (ref - logp) - 1``.

    Source: J. Schulman, "Approximating KL Divergence" (2020), estimator k3; used by DeepSeekMath's GRPO
    (arXiv:2402.03300, eq. 4), TRL's ``GRPOTrainer._compute_loss`` and TorchRL's ``SFTLoss``/``GRPOLoss``.
    It is >= 0 for every token, 0 exactly where ``log_probs == ref_log_probs``.

    Args:
        log_probs: ``[B, T]`` float, log-probs of the sampled tokens under the trained policy (with grad).
        ref_log_probs: ``[B, T]`` float, log-probs under the frozen reference policy.
        mask: ``[B, T]`` bool; masked-out positions are 0 (their inputs are never exponentiated, so padding
            garbage cannot produce inf/NaN in the forward or backward pass).

    Returns:
        ``[B, T]`` per-token KL, dtype of ``log_probs``.
    """
    delta = torch.where(mask, ref_log_probs.detach() - log_probs, torch.zeros_like(log_probs))
    return torch.expm1(delta) - delta  # exp(d) - 1 - d, accurate for small d


def masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The min and max of ``x`` over ``mask`` as 0-d float32 tensors, 1.0 each when ``mask`` is empty, without a
    host read (``x[mask].min()`` sizes its output from the mask's values: a sync on a GPU).

    Args:
        x: ``[B, T]`` float (e.g. importance ratios).
        mask: ``[B, T]`` bool.

    Returns:
        ``(min, max)``: equal to ``x[mask].min()`` and ``x[mask].max()`` (NaN when a masked value is NaN).
    """
    empty = ~mask.any()
    one = torch.ones((), dtype=torch.float32, device=x.device)
    lo = torch.where(mask, x, torch.full_like(x, float("inf"))).amin().float()
    hi = torch.where(mask, x, torch.full_like(x, float("-inf"))).amax().float()
    return torch.where(empty, one, lo), torch.where(empty, one, hi)


def resolve_normalizer(local_count: Tensor, normalizer: float | int | Tensor | None, *, name: str) -> Tensor:
    """Return the denominator of a step-normalised loss: ``normalizer`` if given, else ``local_count``.

    Args:
        local_count: 0-d tensor, the count (tokens or sequences) of this micro-batch.
        normalizer: the count over the whole optimizer step (all micro-batches, all ranks), or ``None`` to fall back
            to ``local_count`` (correct only without gradient accumulation and on a single rank).
        name: the argument name, used in error messages.

    Returns:
        0-d float32 tensor on ``local_count``'s device, clamped to at least 1 so that an empty micro-batch gives 0.

    Raises:
        ValueError: ``normalizer`` is not a scalar, not finite, negative, or smaller than ``local_count`` (a step
            count can never be below the count of one of its micro-batches; usually the count was taken before a mask
            was applied). The value checks are :func:`check_value`'s (deferred inside :func:`deferred_checks`).
    """
    local = local_count.to(torch.float32)
    if normalizer is None:
        return local.clamp(min=1.0)
    if isinstance(normalizer, (int, float)):  # a host number: filled on the device, no host-to-device copy
        norm = torch.full((), float(normalizer), dtype=torch.float32, device=local.device)
    else:
        norm = torch.as_tensor(normalizer, dtype=torch.float32, device=local.device).detach()
    def bad_value() -> ValueError:  # built only on failure: a tensor's repr reads its values
        return ValueError(f"{name} must be a finite non-negative scalar count, got {normalizer!r}.")

    if norm.numel() != 1:
        raise bad_value()
    norm = norm.reshape(())
    invalid = ~torch.isfinite(norm) | (norm < 0)

    def error() -> ValueError:
        if bool(invalid):
            return bad_value()
        return ValueError(
            f"{name}={norm.item():g} is smaller than this micro-batch's own count {local.item():g}; it must count "
            f"the whole optimizer step (all micro-batches, all ranks) after every mask (incl. truncation masking).")

    check_value(invalid | (norm < local), error)
    return norm.clamp(min=1.0)
