"""Supervised loss heads (``sft`` / ``rlhf`` / ``generic``), step-level normalisation and the non-finite guard.

Pure tensor code: inputs are aligned to ``tokens.full`` ``[B, T]`` with ``log_probs[b, t] = log p(x_t | x_<t)``
(fp32, 0.0 at position 0 and at padding). See :mod:`lit_llm.objectives.reduction` for the normalisation contract
(DESIGN.md property 6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from lit_llm.objectives.reduction import as_bool_mask, check_per_token, check_value, k3_kl, resolve_normalizer
from lit_llm.policy.heads import Head, head_positions, scorable_positions

__all__ = ["NonFiniteLossError", "check_finite", "loss_mask", "sft_loss", "sft_step_count"]

Reduction = Literal["token_mean", "sequence_mean", "sum"]


class NonFiniteLossError(FloatingPointError):
    """The loss of a training step is NaN or infinite (raised by :func:`check_finite`)."""


def loss_mask(
    head: Head,
    *,
    attention_mask: Tensor,
    assistant_mask: Tensor | None = None,
    response_mask: Tensor | None = None,
) -> Tensor:
    """Choose the training mask of a loss head.

    Heads (names as in TorchRL's ``get_dist`` variants):

    * ``"sft"`` — prompt-masked: the response tokens of the last turn (``response_mask``, i.e. everything after the
      prompt rendered with the generation prompt, stop token included).
    * ``"rlhf"`` — assistant-masked: every assistant token of every turn (``assistant_mask``, DESIGN.md property 3).
    * ``"generic"`` — attention-masked: every attended token.

    Every head is intersected with ``attention_mask`` and drops the first attended position of each row, which has
    no preceding token and hence no prediction (its log-prob is 0 by convention).

    Args:
        head: ``"sft"``, ``"rlhf"`` or ``"generic"``.
        attention_mask: ``[B, T]`` bool (or 0/1 int), True at real tokens (left or right padding).
        assistant_mask: ``[B, T]`` bool, required for ``"rlhf"``.
        response_mask: ``[B, T]`` bool, required for ``"sft"``.

    Returns:
        ``[B, T]`` torch.bool mask of the positions that enter the loss.

    Raises:
        ValueError: unknown ``head``; the mask the head needs is missing; shapes differ.
        TypeError: a mask is not a bool / 0-1 integer tensor.
    """
    attn = as_bool_mask(attention_mask, name="attention_mask")
    if head == "sft" and response_mask is None:
        raise ValueError("loss head 'sft' needs response_mask ([B, T] bool, True on the last turn's response "
                         "tokens); pass masks.response or choose head='rlhf'/'generic'.")
    if head == "rlhf" and assistant_mask is None:
        raise ValueError("loss head 'rlhf' needs assistant_mask ([B, T] bool, True on every assistant token); "
                         "pass masks.assistant (apply_chat_template(return_assistant_tokens_mask=True)).")
    asst = None if assistant_mask is None else as_bool_mask(assistant_mask, name="assistant_mask", shape=attn.shape)
    resp = None if response_mask is None else as_bool_mask(response_mask, name="response_mask", shape=attn.shape)
    return head_positions(head, scorable_positions(attn), assistant_mask=asst, response_mask=resp)


def sft_loss(
    log_probs: Tensor,
    mask: Tensor,
    *,
    normalizer: float | int | Tensor | None = None,
    reduction: Reduction = "token_mean",
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked negative log-likelihood with explicit normalisation and an optional KL-to-reference term.

    ``loss = R(-log_probs) + kl_coef * R(k3)`` where ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3
    estimator, as the KL-to-reference option of TorchRL's ``SFTLoss``) and ``R`` is the reduction:

    * ``"token_mean"`` (default): ``sum over masked tokens / normalizer``; ``normalizer`` = number of unmasked
      tokens of the **whole optimizer step** (all micro-batches, all ranks). Summing the losses of the
      micro-batches of a step then equals the token mean of the full batch (DESIGN.md property 6).
    * ``"sequence_mean"``: each sequence's token mean, summed, ``/ normalizer``; ``normalizer`` = number of
      sequences of the step that have at least one masked token.
    * ``"sum"``: plain sum over masked tokens (``normalizer`` must be ``None``).

    When ``normalizer`` is ``None`` the local count of this micro-batch is used: correct only without gradient
    accumulation on one rank. Lightning averages micro-batch losses (and DDP averages over ranks), so a caller passing
    a step-level ``normalizer`` multiplies the loss by ``accumulate_grad_batches * world_size`` before returning it.

    Args:
        log_probs: ``[B, T]`` float32, ``log p(x_t | x_<t)`` of the trained policy (with grad).
        mask: ``[B, T]`` bool, positions in the loss (see :func:`loss_mask`).
        normalizer: step-level count (tokens or sequences, see ``reduction``), or ``None`` for the local count.
        reduction: ``"token_mean"``, ``"sequence_mean"`` or ``"sum"``.
        ref_log_probs: ``[B, T]`` float32 log-probs of a frozen reference policy (no grad), or ``None``.
        kl_coef: weight of the KL term; > 0 requires ``ref_log_probs``.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor with grad. ``metrics`` holds detached 0-d float32 tensors:
        ``loss``, ``nll`` (reduced NLL term), ``kl`` (reduced k3, only with ``ref_log_probs``), ``nll_sum`` and
        ``num_tokens`` (local masked sum and count: ``exp(sum nll_sum / sum num_tokens)`` is the step perplexity),
        ``num_sequences`` (local rows with >= 1 token), ``normalizer`` (the denominator used; 1 for ``"sum"``).

    Raises:
        ValueError: unknown ``reduction``; shapes differ; ``mask`` selects no token; ``kl_coef > 0`` without
            ``ref_log_probs``; ``normalizer`` with ``"sum"`` or smaller than the local count.
        TypeError: ``log_probs`` not floating point, ``mask`` not bool.
    """
    check_per_token(log_probs, name="log_probs")
    mask = as_bool_mask(mask, name="mask", shape=log_probs.shape)
    if reduction not in ("token_mean", "sequence_mean", "sum"):
        raise ValueError(f"Unknown reduction {reduction!r}; choose 'token_mean', 'sequence_mean' or 'sum'.")
    if kl_coef < 0 or not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}.")
    if kl_coef > 0 and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_log_probs ([B, T] log-probs of the frozen reference "
                         f"policy); pass them or set kl_coef=0.")
    if reduction == "sum" and normalizer is not None:
        raise ValueError("normalizer must be None with reduction='sum' (a sum has no denominator).")
    num_tokens = mask.sum()
    check_value(num_tokens == 0, lambda: ValueError(
        "mask selects no token in this micro-batch (every row has an empty loss mask); drop samples with no trainable "
        "tokens before batching (e.g. after max_length truncation)."))
    seq_counts = mask.sum(-1)
    num_sequences = (seq_counts > 0).sum()

    def reduce(per_token: Tensor) -> tuple[Tensor, Tensor]:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
        if reduction == "sum":
            return per_token.sum(), torch.ones((), device=per_token.device)
        if reduction == "token_mean":
            denom = resolve_normalizer(num_tokens, normalizer, name="normalizer")
            return per_token.sum() / denom, denom
        denom = resolve_normalizer(num_sequences, normalizer, name="normalizer")
        per_seq = per_token.sum(-1) / seq_counts.clamp(min=1)
        return per_seq.sum() / denom, denom

    nll_tokens = -log_probs
    nll, denom = reduce(nll_tokens)
    loss = nll
    metrics: dict[str, Tensor] = {}
    if ref_log_probs is not None:
        check_per_token(ref_log_probs, name="ref_log_probs", shape=log_probs.shape)
        kl, _ = reduce(k3_kl(log_probs, ref_log_probs, mask))
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.detach().float()
    metrics.update(
        loss=loss.detach().float(),
        nll=nll.detach().float(),
        nll_sum=torch.where(mask, nll_tokens, torch.zeros_like(nll_tokens)).sum().detach().float(),
        num_tokens=num_tokens.float(),
        num_sequences=num_sequences.float(),
        normalizer=denom.float(),
    )
    return loss, metrics


def sft_step_count(mask: Tensor, reduction: Reduction = "token_mean") -> Tensor:
    """This micro-batch's share of the step denominator of :func:`sft_loss`.

    Args:
        mask: ``[B, T]`` bool loss mask (see :func:`loss_mask`).
        reduction: ``"token_mean"`` counts the masked tokens; ``"sequence_mean"`` the rows with at least one.

    Returns:
        0-d long tensor; sum it over the micro-batches and ranks of the step and pass it as ``normalizer``.

    Raises:
        ValueError: ``reduction`` is ``"sum"`` (no denominator) or unknown.
    """
    mask = as_bool_mask(mask, name="mask")
    if reduction == "token_mean":
        return mask.sum()
    if reduction == "sequence_mean":
        return (mask.sum(-1) > 0).sum()
    raise ValueError(f"sft_step_count: reduction {reduction!r} has no step denominator; use 'token_mean' or "
                     f"'sequence_mean'.")


def check_finite(loss: Tensor | float, *, step: int, sample_ids: Sequence[int | str] | Tensor | None = None) -> None:
    """Raise :class:`NonFiniteLossError` if ``loss`` is NaN or infinite (call before ``backward``).

    Args:
        loss: the scalar loss of a micro-batch (0-d tensor or float).
        step: the global optimizer step, named in the message.
        sample_ids: ids of the batch's samples (dataset row indices or ids), named in the message.

    Raises:
        NonFiniteLossError: (a ``FloatingPointError``) naming the value, the step and the sample ids, with fixes.
        ValueError: ``loss`` is a tensor with more than one element.
    """
    if isinstance(loss, Tensor) and loss.numel() != 1:
        raise ValueError(f"check_finite expects a scalar loss, got shape {tuple(loss.shape)}.")
    value = float(loss.detach().float().reshape(())) if isinstance(loss, Tensor) else float(loss)
    if math.isfinite(value):
        return
    ids = sample_ids.tolist() if isinstance(sample_ids, Tensor) else list(sample_ids or [])
    shown = ", ".join(map(str, ids[:32])) + (f", ... (+{len(ids) - 32} more)" if len(ids) > 32 else "")
    raise NonFiniteLossError(
        f"Loss is {value} at step {step} for the batch with sample ids [{shown}]. The weights were not updated. "
        f"Fix: inspect those rows, lower the learning rate or enable gradient clipping, or configure the module to "
        f"skip non-finite steps."
    )
