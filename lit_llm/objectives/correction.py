"""Sampler/trainer mismatch: its measurement and the rollout importance-sampling correction (TIS / MIS).

The sampler (the generate version, or an asynchronous copy of the weights) and the trainer (the log-prob version's
training forward) score the same sampled ids slightly differently: another kernel path, another precision (bf16
autocast), stale weights in asynchronous mode. With ``old_log_probs: recompute`` the GRPO ratio's denominator is the
trainer's own no-grad forward, so the ratio is exactly 1 at the first on-policy iteration; the gap to the sampler is
then corrected by a per-token or per-sequence weight ``w = pi_old / pi_rollout`` (recomputed-old over generation-time
probability) that multiplies the policy-gradient term of every loss token:

* ``token_truncate`` (TIS, truncated importance sampling; F. Yao et al., "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", 2025): ``w_t = min(exp(old_t - rollout_t), clip_max)``.
* ``sequence_truncate``: ``w_i = min(exp(sum_t (old_t - rollout_t)), clip_max)`` on every token of completion ``i``.
* ``token_mask`` / ``sequence_mask`` (MIS, masked importance sampling; J. Liu et al., "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch", 2025): the same weights, not capped, and a token
  (or every token of a sequence) whose weight lies outside ``[clip_min, clip_max]`` **leaves the loss and every
  denominator** (the loss mask), kept tokens are weighted by ``w``.

``clip_min`` (mask modes only) defaults to ``1 / clip_max`` (verl's auto-reciprocal); ``0`` removes the lower bound.

Mapping to peers (same formulas; the sequence weight is the product of the token ratios in all three):

* ``token_truncate`` / ``sequence_truncate``: TRL ``GRPOConfig(vllm_importance_sampling_correction=True,
  vllm_importance_sampling_mode="token_truncate" | "sequence_truncate", vllm_importance_sampling_cap=clip_max)``;
  verl ``algorithm.rollout_is_level: token | sequence``, ``rollout_is_mode: truncate``,
  ``rollout_is_threshold: clip_max``.
* ``token_mask`` / ``sequence_mask``: verl ``rollout_is_mode: mask`` with ``rollout_is_threshold: clip_max`` and
  ``rollout_is_threshold_lower: clip_min`` (verl also removes masked tokens from ``response_mask``, hence from the
  denominator, as here). TRL's ``"token_mask"`` / ``"sequence_mask"`` zero the weights above the cap only
  (``clip_min: 0`` here) and keep the masked tokens in the denominator.

TRL recomputes the old log-probs whenever this correction is on, as ``rollout_correction`` requires
``old_log_probs: recompute`` here.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lit_llm.objectives.reduction import check_per_token, k3_kl, masked_min_max

__all__ = ["ROLLOUT_CORRECTIONS", "RolloutCorrection", "RolloutWeights", "check_rollout_correction",
           "mismatch_metrics", "rollout_correction_weights"]

RolloutCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class RolloutWeights(NamedTuple):
    """Output of :func:`rollout_correction_weights` (all ``[B, T]``, no gradient).

    Attributes:
        weight: float, ``w`` on kept loss tokens (capped at ``clip_max`` in truncate modes), 0.0 elsewhere.
        keep: bool, the loss tokens that stay in the loss and its denominators (the input mask in truncate modes).
        corrected: bool, loss tokens whose weight was capped (truncate modes) or that were dropped (mask modes).
    """

    weight: Tensor
    keep: Tensor
    corrected: Tensor


def check_rollout_correction(mode: str, clip_max: float, clip_min: float | None) -> None:
    """Validate a rollout-correction setting.

    Raises:
        ValueError: unknown ``mode``; ``clip_max`` not a finite number >= 1; ``clip_min`` outside ``[0, 1]``; a
            ``clip_min`` with a truncate mode (truncation caps from above only).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"Unknown rollout_correction {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTIONS)}.")
    if isinstance(clip_max, bool) or not isinstance(clip_max, int | float) or not math.isfinite(clip_max) \
            or clip_max < 1:
        raise ValueError(f"rollout_correction_clip_max must be a finite number >= 1 (the cap C of the importance "
                         f"weight, TRL's vllm_importance_sampling_cap), got {clip_max!r}.")
    if clip_min is not None:
        if mode.endswith("truncate"):
            raise ValueError(f"rollout_correction_clip_min={clip_min} is only used by the mask modes (token_mask, "
                             f"sequence_mask); {mode} caps from above only. Unset it or pick a mask mode.")
        if isinstance(clip_min, bool) or not isinstance(clip_min, int | float) or not 0 <= clip_min <= 1:
            raise ValueError(f"rollout_correction_clip_min must lie in [0, 1] (0 = no lower bound), got {clip_min!r}.")


def rollout_correction_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *,
                               mode: RolloutCorrection, clip_max: float = 2.0,
                               clip_min: float | None = None) -> RolloutWeights:
    """Importance weights ``pi_old / pi_rollout`` of the loss tokens and the tokens they keep (module docstring).

    Computed in log space (``log w = old - rollout``, summed over the row's loss tokens for the sequence modes), so a
    long sequence cannot overflow.

    Args:
        old_log_probs: ``[B, T]`` float, the trainer's recomputed log-probs of the sampled ids (no grad).
        rollout_log_probs: ``[B, T]`` float, the sampler's generation-time log-probs of the same ids.
        mask: ``[B, T]`` bool, the loss tokens (after truncation masking).
        mode: a :data:`RolloutCorrection` other than ``"none"``.
        clip_max: the cap ``C`` (>= 1).
        clip_min: lower bound of the mask modes (``None``: ``1 / clip_max``; 0: none).

    Returns:
        :class:`RolloutWeights`.

    Raises:
        ValueError: invalid settings (:func:`check_rollout_correction`), ``mode="none"``, shape mismatch.
    """
    check_rollout_correction(mode, clip_max, clip_min)
    if mode == "none":
        raise ValueError("rollout_correction_weights: mode 'none' has no weights; do not call it.")
    check_per_token(old_log_probs, name="old_log_probs")
    check_per_token(rollout_log_probs, name="rollout_log_probs", shape=old_log_probs.shape)
    delta = torch.where(mask, old_log_probs.detach().double() - rollout_log_probs.detach().double(), 0.0)
    log_w = delta.sum(-1, keepdim=True).expand_as(delta) if mode.startswith("sequence") else delta
    log_max = math.log(clip_max)
    if mode.endswith("truncate"):
        keep = mask
        corrected = mask & (log_w > log_max)
    else:
        low = 1.0 / clip_max if clip_min is None else clip_min
        log_min = math.log(low) if low > 0 else -math.inf
        keep = mask & (log_w <= log_max) & (log_w >= log_min)
        corrected = mask & ~keep
    weight = torch.where(keep, torch.exp(log_w.clamp(max=log_max)), 0.0).to(old_log_probs.dtype)
    return RolloutWeights(weight, keep, corrected)


def mismatch_metrics(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sampler/trainer mismatch on the same sampled ids: k3 KL and the range of ``pi_trainer / pi_rollout``.

    ``kl`` estimates ``KL(pi_rollout || pi_trainer)`` from the sampler's own samples with Schulman's k3,
    ``r - 1 - log r``, ``r = exp(trainer - rollout)`` (>= 0 per token; 0 when both agree), as verl's rollout-IS
    metrics. Call it with the trainer log-probs of the first on-policy iteration.

    Args:
        log_probs: ``[B, T]`` float, the trainer's log-probs (gradient ignored).
        rollout_log_probs: ``[B, T]`` float, the generation-time log-probs of the same ids.
        mask: ``[B, T]`` bool, the tokens to measure.

    Returns:
        0-d float32 tensors: ``mismatch/kl`` (token mean), ``mismatch/ratio_min``, ``mismatch/ratio_max`` (1 when
        ``mask`` is empty) and ``mismatch/num_tokens``.
    """
    lp = log_probs.detach()
    k3 = k3_kl(rollout_log_probs.detach(), lp, mask)
    n = mask.sum()
    count = n.float().clamp(min=1.0)
    lo, hi = masked_min_max(torch.exp(lp - rollout_log_probs.detach()).float(), mask)
    return {"mismatch/kl": torch.where(mask, k3, 0.0).sum().float() / count,
            "mismatch/ratio_min": lo,
            "mismatch/ratio_max": hi,
            "mismatch/num_tokens": n.float()}
