"""GRPO maths: advantages (GRPO, RLOO, REINFORCE++) and the per-token surrogates (clipped PPO-style, GSPO's sequence
ratio, CISPO) with their normalisations.

Formulas follow DeepSeekMath (Shao et al. 2024, arXiv:2402.03300, eqs. 3-4) as implemented by TRL's
``GRPOTrainer`` (``_generate_and_score_completions`` for advantages, ``_compute_loss`` for the loss), with the
clip-higher of DAPO (Yu et al. 2025, arXiv:2503.14476), the Dr. GRPO denominator (Liu et al. 2025,
arXiv:2503.20783), GSPO's length-normalised sequence ratio (Zheng et al. 2025, arXiv:2507.18071), CISPO's clipped
importance-weighted REINFORCE (MiniMax-M1, arXiv:2506.13585), the RLOO baseline (Ahmadian et al. 2024,
arXiv:2402.14740) and REINFORCE++ (Hu 2025, arXiv:2501.03262). The sampler/trainer correction lives in
:mod:`lit_llm.objectives.correction`. Per-token tensors are ``[B, T]`` aligned to ``tokens.full``; the completion
mask selects the response tokens. See :mod:`lit_llm.objectives.reduction` for the step-normalisation contract
(DESIGN.md property 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_llm.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    ScaleRewards,
    check_advantage_settings,
    check_num_generations,
    compute_advantages,
)
from lit_llm.objectives.correction import (
    RolloutCorrection,
    check_rollout_correction,
    mismatch_metrics,
    rollout_correction_weights,
)
from lit_llm.objectives.loss_types import LOSS_TYPES, LossType, LossTypeName, get_loss_type
from lit_llm.objectives.reduction import as_bool_mask, check_per_token, check_value, k3_kl, masked_min_max

__all__ = ["ADVANTAGE_ESTIMATORS", "LOSS_TYPES", "AdvantageEstimator", "GRPOObjective", "ScaleRewards",
           "check_advantage_settings", "check_num_generations", "compute_advantages", "effective_completion_mask",
           "grpo_loss"]

ImportanceSamplingLevel = Literal["token", "sequence"]


def effective_completion_mask(
    completion_mask: Tensor, truncated: Tensor | None = None, mask_truncated_completions: bool = False
) -> Tensor:
    """The completion mask after truncation masking: the tokens every GRPO denominator counts.

    Use it to count ``num_items_in_batch`` (``effective_completion_mask(...).sum()`` summed over the micro-batches
    and ranks of the step) so the count matches the loss.

    Args:
        completion_mask: ``[B, T]`` bool, True on response tokens.
        truncated: ``[B]`` bool, True where the completion hit ``max_new_tokens`` without a stop token.
        mask_truncated_completions: drop every token of truncated completions (DAPO, TRL option of that name).

    Returns:
        ``[B, T]`` bool.

    Raises:
        ValueError: ``mask_truncated_completions`` without ``truncated``, or ``truncated`` not of shape ``[B]``.
    """
    mask = as_bool_mask(completion_mask, name="completion_mask")
    if not mask_truncated_completions:
        return mask
    if truncated is None:
        raise ValueError("mask_truncated_completions=True needs truncated ([B] bool, True where generation hit "
                         "max_new_tokens); pass it or set mask_truncated_completions=False.")
    if not isinstance(truncated, Tensor) or tuple(truncated.shape) != (mask.shape[0],):
        shape = tuple(truncated.shape) if isinstance(truncated, Tensor) else type(truncated).__name__
        raise ValueError(f"truncated must be a [B]={mask.shape[0]} bool tensor, got {shape}.")
    return mask & ~truncated.bool().to(mask.device)[:, None]


def _masked_mean(x: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum().detach().float() / count


def _check_loss_settings(loss_type: str, importance_sampling_level: str, epsilon: float, epsilon_high: float | None,
                         beta: float, entropy_coef: float) -> LossType:
    """The settings rules of :func:`grpo_loss` / :class:`GRPOObjective`; returns the loss type's strategy."""
    rule = get_loss_type(loss_type)
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"Unknown importance_sampling_level {importance_sampling_level!r}; choose 'token' (GRPO) or "
                         f"'sequence' (GSPO).")
    for name, v in (("epsilon", epsilon), ("epsilon_high", epsilon if epsilon_high is None else epsilon_high),
                    ("beta", beta), ("entropy_coef", entropy_coef)):
        if isinstance(v, bool) or not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
    return rule


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: LossTypeName = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    truncated: Tensor | None = None,
    mask_truncated_completions: bool = False,
    max_completion_length: int | None = None,
    num_items_in_batch: float | int | Tensor | None = None,
    num_sequences_in_batch: float | int | Tensor | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    entropy_coef: float = 0.0,
    rollout_log_probs: Tensor | None = None,
    rollout_correction: RolloutCorrection = "none",
    rollout_correction_clip_max: float = 2.0,
    rollout_correction_clip_min: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GRPO-family surrogate (TRL ``GRPOTrainer._compute_loss``) with its loss type's denominator.

    Let ``M`` be the loss mask: the completion mask after truncation masking and, with a ``*_mask``
    ``rollout_correction``, after the tokens the correction drops. The importance ratio is

    * ``importance_sampling_level="token"`` (GRPO): ``r_t = exp(logp_t - old_t)``;
    * ``"sequence"`` (GSPO, arXiv:2507.18071 eq. 7): ``s_i = exp(sum_t M (logp_t - old_t) / max(1, sum_t M))`` for
      every token of row ``i`` (length-normalised, with gradient; TRL's ``importance_sampling_level="sequence"``).
      The paper clips it at ``epsilon = 3e-4``, ``epsilon_high = 4e-4`` (its section 5.1): a length-normalised ratio
      stays within ~1e-3 of 1. The defaults stay TRL's token-level ``0.2``, which GSPO then practically never clips:
      set both for GSPO (the defaults are not switched by the level so that one knob never changes another's meaning).

    The per-token policy term ``pg_t`` is, with ``A`` the row's advantage:

    * every ``loss_type`` but ``"cispo"``: ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``;
    * ``"cispo"`` (MiniMax-M1, arXiv:2506.13585 eq. 4; TRL ``loss_type="cispo"``): ``-sg(min(r, epsilon_high)) A
      logp_t`` -- the stop-gradient, clipped importance weight times the log-prob, so every token keeps a gradient;
      ``epsilon_high`` is CISPO's ``eps_max`` (the cap itself, as in TRL; no lower bound), and is required.

    ``loss_t = w_t pg_t + beta k3_t - entropy_coef H_t`` with ``w_t`` the rollout correction weight
    (:func:`~lit_llm.objectives.correction.rollout_correction_weights`, 1 without), ``k3 = exp(ref - logp) - (ref -
    logp) - 1`` and ``H_t`` the entropy of the policy's distribution at ``t`` (an entropy bonus). Denominators (``S``
    = the sum of ``M * loss_t``):

    * ``"grpo"``: ``sum_i (sum_t M loss / max(1, sum_t M)) / num_sequences_in_batch`` — per-sequence token mean,
      then the mean over the step's sequences (DeepSeekMath eq. 3; TRL divides the micro-batch mean by the
      accumulation steps, equal when micro-batches have equal sizes).
    * ``"bnpo"``: ``S / max(1, local sum of M)`` — local micro-batch token count, by definition (TRL). The value is a
      micro-batch mean: average it over micro-batches and ranks (Lightning's and DDP's own averaging do exactly that).
    * ``"dr_grpo"``: ``S / (num_sequences_in_batch * max_completion_length)`` — a constant (Dr. GRPO).
    * ``"dapo"`` (default) and ``"cispo"``: ``S / num_items_in_batch`` — the token count of the whole optimizer step,
      all micro-batches and ranks (DAPO's token-level loss, CISPO's ``1 / sum_i |o_i|``; TRL's
      ``num_items_in_batch``).

    ``num_items_in_batch`` / ``num_sequences_in_batch`` default to this micro-batch's counts (correct only without
    accumulation on one rank). With step-level counts the losses of a step's micro-batches **sum** to the step loss;
    a Lightning caller multiplies them by ``accumulate_grad_batches * world_size`` to undo Lightning/DDP averaging
    (TRL divides ``num_items_in_batch`` by ``num_processes`` for the same reason). Ignored by the other loss types.

    Args:
        log_probs: ``[B, T]`` float32 log-probs of the sampled tokens under the trained policy (with grad).
        old_log_probs: ``[B, T]`` float32 log-probs of the ratio's denominator (no grad): the generation-time ones
            (``old_log_probs: rollout``) or the trainer's no-grad recompute before the step (``recompute``); equal to
            ``log_probs`` on the first iteration of on-policy data with ``recompute``, so ``ratio == 1``.
        advantages: ``[B]`` float, one per completion (see :func:`compute_advantages`).
        completion_mask: ``[B, T]`` bool, True on response tokens (stop token included).
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"`` or ``"cispo"``.
        epsilon: lower clip ``1 - epsilon`` (and upper when ``epsilon_high`` is None). TRL default 0.2. Unused by
            ``"cispo"``.
        epsilon_high: upper clip ``1 + epsilon_high`` (DAPO clip-higher, e.g. 0.28); ``"cispo"``: the weight cap.
        beta: KL coefficient; > 0 requires ``ref_log_probs``.
        ref_log_probs: ``[B, T]`` float32 log-probs of the frozen reference policy; ``kl`` is reported when given.
        entropy: ``[B, T]`` float per-token entropies of the policy, reported as ``entropy`` when given; with grad
            when ``entropy_coef > 0``.
        truncated: ``[B]`` bool, completions that hit ``max_new_tokens``.
        mask_truncated_completions: exclude truncated completions from the loss and every denominator.
        max_completion_length: ``max_new_tokens``; required by ``"dr_grpo"``.
        num_items_in_batch: step-level token count for ``"dapo"`` / ``"cispo"`` (after every mask).
        num_sequences_in_batch: step-level sequence count for ``"grpo"`` and ``"dr_grpo"``.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        entropy_coef: entropy bonus coefficient (>= 0; needs ``entropy`` with grad).
        rollout_log_probs: ``[B, T]`` generation-time log-probs; when given, the sampler/trainer mismatch metrics are
            reported (:func:`~lit_llm.objectives.correction.mismatch_metrics` of ``log_probs``; meaningful at the first
            iteration). Required by ``rollout_correction``.
        rollout_correction: ``"none"``, ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or
            ``"sequence_mask"`` (:mod:`lit_llm.objectives.correction`): weights ``old / rollout``; ``old_log_probs``
            should then be the recomputed ones.
        rollout_correction_clip_max, rollout_correction_clip_min: the weight's bounds (see the correction module).

    Returns:
        ``(loss, metrics)``: 0-d ``loss`` with grad; ``metrics`` of detached 0-d float32 tensors, local token means
        over ``M``: ``loss``, ``clip_ratio/low_mean`` (``ratio < 1 - epsilon`` and ``A < 0``),
        ``clip_ratio/high_mean`` (``ratio > 1 + epsilon_high`` and ``A > 0``; ``"cispo"``: ``ratio > epsilon_high``),
        ``clip_ratio/region_mean`` (either), ``ratio_mean``, ``ratio_min``, ``ratio_max`` (of the importance ratio
        used, sequence-level for GSPO; 1 when ``M`` is empty), ``kl`` and ``entropy`` (when given), ``num_tokens``
        (local sum of ``M``), ``normalizer`` (the denominator used); with ``rollout_log_probs`` the ``mismatch/*``
        metrics over the loss tokens before the correction's masking; with a correction
        ``rollout_correction/weight_mean`` (over ``M``) and ``rollout_correction/corrected_fraction`` (tokens capped
        or dropped, over the tokens before masking).

    Raises:
        ValueError: unknown ``loss_type`` / level / correction; shape mismatches; non-finite advantages; negative
            ``epsilon``/``beta``/``entropy_coef``; ``"cispo"`` without ``epsilon_high``; ``beta > 0`` without
            ``ref_log_probs``; ``entropy_coef > 0`` without ``entropy`` that carries a gradient; ``"dr_grpo"`` without
            ``max_completion_length``; ``mask_truncated_completions`` without ``truncated``; a correction without
            ``rollout_log_probs``; a step count below the local count.
        TypeError: log-probs not floating point, masks not bool.
    """
    rule = _check_loss_settings(loss_type, importance_sampling_level, epsilon, epsilon_high, beta, entropy_coef)
    rule.check(epsilon_high=epsilon_high, max_completion_length=max_completion_length)
    check_rollout_correction(rollout_correction, rollout_correction_clip_max, rollout_correction_clip_min)
    check_per_token(log_probs, name="log_probs")
    check_per_token(old_log_probs, name="old_log_probs", shape=log_probs.shape)
    mask = effective_completion_mask(
        as_bool_mask(completion_mask, name="completion_mask", shape=log_probs.shape), truncated,
        mask_truncated_completions,
    )
    b = log_probs.shape[0]
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != (b,):
        shape = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must be a [B]={b} tensor (one per completion), got {shape}.")
    check_value(~torch.isfinite(advantages).all(),
                lambda: ValueError("advantages holds NaN/inf; check the rewards fed to compute_advantages."))
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if beta > 0 and ref_log_probs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_log_probs ([B, T] log-probs of the frozen reference policy); "
                         f"pass them or set beta=0.")
    if entropy_coef > 0 and (entropy is None or (log_probs.requires_grad and not entropy.requires_grad)):
        raise ValueError(f"entropy_coef={entropy_coef} > 0 needs entropy ([B, T] per-token entropies of the policy "
                         f"with their gradient, e.g. dist.log_prob_and_entropy); pass it undetached or set "
                         f"entropy_coef=0.")
    if rollout_log_probs is not None:
        check_per_token(rollout_log_probs, name="rollout_log_probs", shape=log_probs.shape)
    elif rollout_correction != "none":
        raise ValueError(f"rollout_correction={rollout_correction!r} needs rollout_log_probs ([B, T] generation-time "
                         f"log-probs of the sampled ids); pass them or set rollout_correction='none'.")

    extra: dict[str, Tensor] = {}
    weight = None
    if rollout_log_probs is not None:
        extra.update(mismatch_metrics(log_probs, rollout_log_probs, mask))
    if rollout_correction != "none":
        corr = rollout_correction_weights(old_log_probs, rollout_log_probs, mask, mode=rollout_correction,
                                          clip_max=rollout_correction_clip_max,
                                          clip_min=rollout_correction_clip_min)
        extra["rollout_correction/corrected_fraction"] = (corr.corrected.sum().float()
                                                          / mask.sum().float().clamp(min=1.0))
        mask, weight = corr.keep, corr.weight.to(log_probs.dtype)

    adv = advantages.detach().to(log_probs.dtype)[:, None]
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    if importance_sampling_level == "sequence":
        seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.expand_as(log_probs)
    ratio = torch.exp(log_ratio)
    per_token, low, high = rule.policy_term(ratio, adv, log_probs, mask, eps_low, eps_high)
    if weight is not None:
        per_token = per_token * weight
    kl = None
    if ref_log_probs is not None:
        check_per_token(ref_log_probs, name="ref_log_probs", shape=log_probs.shape)
        kl = k3_kl(log_probs, ref_log_probs, mask)
        if beta > 0:
            per_token = per_token + beta * kl
    if entropy is not None:
        check_per_token(entropy, name="entropy", shape=log_probs.shape)
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * torch.where(mask, entropy, torch.zeros_like(entropy))
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))

    seq_counts = mask.sum(-1)
    num_tokens = seq_counts.sum()
    step_count = num_sequences_in_batch if rule.counts == "sequences" else num_items_in_batch
    loss, denom = rule.reduce(per_token, seq_counts, num_tokens, step_count, max_completion_length)

    count = num_tokens.float().clamp(min=1.0)
    r_det = ratio.detach()
    empty = num_tokens == 0  # on the device: the metrics of an empty mask are 1, chosen without a host read
    one = torch.ones((), device=log_probs.device)
    lo, hi = masked_min_max(r_det, mask)
    metrics = {
        "loss": loss.detach().float(),
        "clip_ratio/low_mean": _masked_mean(low.float(), mask, count),
        "clip_ratio/high_mean": _masked_mean(high.float(), mask, count),
        "clip_ratio/region_mean": _masked_mean((low | high).float(), mask, count),
        "ratio_mean": torch.where(empty, one, _masked_mean(r_det, mask, count)),
        "ratio_min": lo,
        "ratio_max": hi,
        "num_tokens": num_tokens.float(),
        "normalizer": denom.detach().float(),
        **extra,
    }
    if weight is not None:
        metrics["rollout_correction/weight_mean"] = torch.where(empty, one, _masked_mean(weight, mask, count))
    if kl is not None:
        metrics["kl"] = _masked_mean(kl, mask, count)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask, count)
    return loss, metrics


@dataclass(frozen=True)
class GRPOObjective:
    """The GRPO loss of one optimizer step, micro-batch by micro-batch: TRL's flat knobs bound together, with the
    per-``loss_type`` step count and the ``bnpo`` rescale, both from the loss type's strategy (:attr:`rule`,
    :mod:`lit_llm.objectives.loss_types`). :class:`~lit_llm.lightning.grpo.GRPOModule` builds it from its flat knobs
    (the YAML surface).

    It is also the protocol of a user's objective (``model.objective: my_loss:MyObjective``): subclass it (a frozen
    dataclass; extra fields need defaults) and override :meth:`__call__` (the loss of a micro-batch and its metrics,
    which must keep :func:`grpo_loss`'s keys: the module logs them, :data:`~lit_llm.lightning.grpo_metrics.
    REQUIRED_METRICS`; returning ``super().__call__(...)``'s metrics with your loss keeps them) and/or
    :meth:`local_count` (the step count); the class's ``loss_type`` default says which denominator it uses.

    Usage for one optimizer step over micro-batches ``mb_1..mb_k`` on ``W`` ranks::

        count = sum(objective.local_count(mb.loss_mask, mb.truncated, mb.old_log_probs, mb.rollout_log_probs)
                    for mb in mbs)   # then all-reduce (sum)
        for mb in mbs:
            loss, metrics = objective(log_probs, mb.old_log_probs, mb.advantage, mb.loss_mask, step_count=count,
                                      num_micro_batches=k, world_size=W, truncated=mb.truncated,
                                      rollout_log_probs=mb.rollout_log_probs)

    Step counts (the denominator each ``loss_type`` states in :func:`grpo_loss`): ``dapo``, ``cispo`` and ``bnpo``
    count loss tokens after truncation masking and the rollout correction's masking, ``grpo`` and ``dr_grpo`` count
    sequences (rows). ``bnpo`` is a local mean by definition: its micro-batch loss is divided by ``num_micro_batches *
    world_size`` so that the step loss is the mean of the micro-batch means over micro-batches and ranks (the caller
    multiplies by ``world_size`` to undo DDP's gradient averaging, as for every loss type).

    Attributes:
        loss_type: ``"dapo"``, ``"grpo"``, ``"dr_grpo"``, ``"bnpo"`` or ``"cispo"`` (see :func:`grpo_loss`).
        epsilon: lower clip ``1 - epsilon`` (and the upper one when ``epsilon_high`` is ``None``).
        epsilon_high: upper clip ``1 + epsilon_high`` (DAPO clip-higher); CISPO's weight cap ``eps_max``.
        beta: k3 KL coefficient (> 0 needs reference log-probs).
        mask_truncated_completions: drop truncated completions from the loss and every count (DAPO).
        max_completion_length: ``max_new_tokens`` of generation (``dr_grpo``'s constant denominator).
        importance_sampling_level: ``"token"`` (GRPO) or ``"sequence"`` (GSPO).
        entropy_coef: entropy bonus coefficient.
        rollout_correction: sampler/trainer correction (:mod:`lit_llm.objectives.correction`).
        rollout_correction_clip_max: the weight cap ``C``.
        rollout_correction_clip_min: lower bound of the mask modes (``None``: ``1 / C``).
    """

    loss_type: LossTypeName = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    mask_truncated_completions: bool = False
    max_completion_length: int | None = None
    importance_sampling_level: ImportanceSamplingLevel = "token"
    entropy_coef: float = 0.0
    rollout_correction: RolloutCorrection = "none"
    rollout_correction_clip_max: float = 2.0
    rollout_correction_clip_min: float | None = None

    def __post_init__(self) -> None:
        rule = _check_loss_settings(self.loss_type, self.importance_sampling_level, self.epsilon, self.epsilon_high,
                                    self.beta, self.entropy_coef)
        rule.check(epsilon_high=self.epsilon_high, max_completion_length=self.max_completion_length)
        check_rollout_correction(self.rollout_correction, self.rollout_correction_clip_max,
                                 self.rollout_correction_clip_min)
        object.__setattr__(self, "_rule", rule)

    @property
    def rule(self) -> LossType:
        """The :mod:`~lit_llm.objectives.loss_types` strategy of :attr:`loss_type`."""
        return self._rule

    def loss_tokens(self, loss_mask: Tensor, truncated: Tensor | None = None, old_log_probs: Tensor | None = None,
                    rollout_log_probs: Tensor | None = None) -> Tensor:
        """``[B, T]`` bool: the tokens that enter the loss and its token counts: ``loss_mask`` after truncation
        masking and, with a ``*_mask`` rollout correction, after the tokens it drops.

        Raises:
            ValueError: a mask correction without ``old_log_probs`` and ``rollout_log_probs``.
        """
        mask = effective_completion_mask(loss_mask, truncated, self.mask_truncated_completions)
        if self.rollout_correction.endswith("_mask"):
            if old_log_probs is None or rollout_log_probs is None:
                raise ValueError(f"rollout_correction={self.rollout_correction!r} drops tokens from the step count: "
                                 f"pass old_log_probs and rollout_log_probs to local_count.")
            mask = rollout_correction_weights(old_log_probs, rollout_log_probs, mask, mode=self.rollout_correction,
                                              clip_max=self.rollout_correction_clip_max,
                                              clip_min=self.rollout_correction_clip_min).keep
        return mask

    def local_count(self, loss_mask: Tensor, truncated: Tensor | None = None, old_log_probs: Tensor | None = None,
                    rollout_log_probs: Tensor | None = None) -> Tensor:
        """This micro-batch's share of the step denominator: loss tokens (:meth:`loss_tokens`; ``dapo``, ``cispo``,
        ``bnpo``) or rows (``grpo``, ``dr_grpo``), a 0-d tensor on ``loss_mask``'s device.

        Args:
            loss_mask: ``[B, T]`` bool, the completion tokens that enter the loss.
            truncated: ``[B]`` bool (needed with ``mask_truncated_completions``).
            old_log_probs, rollout_log_probs: ``[B, T]`` (needed with a ``*_mask`` rollout correction).
        """
        if self.rule.counts == "sequences":
            return torch.full((), loss_mask.shape[0], dtype=torch.long, device=loss_mask.device)
        return self.loss_tokens(loss_mask, truncated, old_log_probs, rollout_log_probs).sum()

    def __call__(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                 step_count: Tensor | float | int, num_micro_batches: int = 1, world_size: int = 1,
                 ref_log_probs: Tensor | None = None, entropy: Tensor | None = None,
                 truncated: Tensor | None = None,
                 rollout_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """:func:`grpo_loss` of one micro-batch with the step-level ``step_count`` (sum of :meth:`local_count` over
        the step's micro-batches and ranks) passed as the right denominator for :attr:`loss_type`.

        Args:
            log_probs, old_log_probs, advantages, ref_log_probs, entropy, truncated, rollout_log_probs: see
                :func:`grpo_loss` (``[B, T]`` / ``[B]``).
            loss_mask: ``[B, T]`` bool completion tokens of the loss (``completion_mask`` of :func:`grpo_loss`).
            step_count: the step's count (tokens or sequences, see the class docstring).
            num_micro_batches: micro-batches of the step on this rank (``bnpo`` only).
            world_size: ranks (``bnpo`` only).

        Returns:
            ``(loss, metrics)`` as :func:`grpo_loss`; ``metrics["loss"]`` is the rescaled loss for ``bnpo``.
        """
        key = "num_sequences_in_batch" if self.rule.counts == "sequences" else "num_items_in_batch"
        counts = {} if self.rule.counts == "local" else {key: step_count}
        loss, metrics = grpo_loss(
            log_probs, old_log_probs, advantages, loss_mask, loss_type=self.loss_type, epsilon=self.epsilon,
            epsilon_high=self.epsilon_high, beta=self.beta, ref_log_probs=ref_log_probs, entropy=entropy,
            truncated=truncated, mask_truncated_completions=self.mask_truncated_completions,
            max_completion_length=self.max_completion_length, importance_sampling_level=self.importance_sampling_level,
            entropy_coef=self.entropy_coef, rollout_log_probs=rollout_log_probs,
            rollout_correction=self.rollout_correction, rollout_correction_clip_max=self.rollout_correction_clip_max,
            rollout_correction_clip_min=self.rollout_correction_clip_min, **counts)
        loss = self.rule.rescale(loss, num_micro_batches, world_size)  # bnpo: its share of the step's mean
        metrics["loss"] = loss.detach().float()
        return loss, metrics
