"""GRPO maths: group-relative advantages and the per-token clipped surrogate with its four normalisations.

Formulas follow DeepSeekMath (Shao et al. 2024, arXiv:2402.03300, eqs. 3-4) as implemented by TRL's
``GRPOTrainer`` (``_generate_and_score_completions`` for advantages, ``_compute_loss`` for the loss), with the
clip-higher of DAPO (Yu et al. 2025, arXiv:2503.14476) and the Dr. GRPO denominator (Liu et al. 2025,
arXiv:2503.20783). Per-token tensors are ``[B, T]`` aligned to ``tokens.full``; the completion mask selects the
response tokens. See :mod:`lit_llm.objectives.reduction` for the step-normalisation contract (DESIGN.md property 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_llm.objectives.reduction import as_bool_mask, check_per_token, k3_kl, resolve_normalizer

__all__ = ["GRPOObjective", "compute_advantages", "effective_completion_mask", "grpo_loss"]

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]


def compute_advantages(
    rewards: Tensor, num_generations: int, *, scale_rewards: ScaleRewards = "group", eps: float = 1e-4
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantages ``A_i = (r_i - mean(group)) / (std + eps)``.

    Rows are grouped contiguously: rows ``[k*G, (k+1)*G)`` are the ``G = num_generations`` completions of prompt
    ``k``. ``std`` is the unbiased (n-1) standard deviation, as ``torch.std`` in TRL's
    ``_generate_and_score_completions``; ``eps = 1e-4`` is TRL's constant.

    * ``"group"``: std of each group (DeepSeekMath, TRL default).
    * ``"batch"``: centred per group, scaled by the std of the whole batch (TRL ``scale_rewards="batch"``).
    * ``"none"``: centred only (Dr. GRPO).

    A group whose rewards are all equal (std ``isclose`` to 0) gets advantage exactly 0 and is counted in
    ``frac_reward_zero_std`` (computed from the group std in every mode; TRL uses the batch std in ``"batch"`` mode).

    Args:
        rewards: ``[N]`` float, total reward per completion, ``N = num_prompts * num_generations``.
        num_generations: group size ``G`` (>= 2).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the std before dividing.

    Returns:
        ``(advantages, stats)``: ``advantages`` ``[N]`` float32 (no grad). ``stats`` holds 0-d float32 tensors
        ``reward_mean``, ``reward_std`` (unbiased std of the batch), ``reward_group_std_mean`` (mean group std, TRL's
        ``reward_std``) and ``frac_reward_zero_std`` (fraction of groups with zero std).

    Raises:
        ValueError: ``num_generations < 2``; ``N`` not divisible by ``num_generations``; ``rewards`` not 1-D or
            holding NaN/inf; unknown ``scale_rewards``; negative ``eps``.
    """
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2 (a group needs 2 completions to have a std), got "
                         f"{num_generations!r}; set num_generations to 2 or more.")
    if not isinstance(rewards, Tensor) or rewards.ndim != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [N], got {shape}.")
    if rewards.numel() == 0 or rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a positive multiple of num_generations="
                         f"{num_generations}; the batch must hold num_generations completions per prompt.")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; choose 'group', 'batch' or 'none'.")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}.")
    r = rewards.detach().float()
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards holds non-finite values at sample indices {bad}; a reward function returned "
                         f"NaN/inf (RewardFunctions names the function).")
    groups = r.view(-1, num_generations)
    group_mean = groups.mean(dim=1, keepdim=True)
    group_std = groups.std(dim=1, keepdim=True)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    adv = groups - group_mean
    if scale_rewards == "group":
        adv = adv / (group_std + eps)
    elif scale_rewards == "batch":
        adv = adv / (r.std() + eps)
    adv = torch.where(zero_std, torch.zeros_like(adv), adv).reshape(-1)
    stats = {
        "reward_mean": r.mean(),
        "reward_std": r.std(),
        "reward_group_std_mean": group_std.mean(),
        "frac_reward_zero_std": zero_std.float().mean(),
    }
    return adv, stats


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


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: LossType = "dapo",
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped surrogate of GRPO (TRL ``GRPOTrainer._compute_loss``, token-level importance sampling).

    ``ratio = exp(logp - old_logp)``; ``loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
    + beta * k3_t`` with ``k3 = exp(ref - logp) - (ref - logp) - 1``. Denominators, all counted on the mask **after**
    truncation masking (``M`` = that mask, ``S`` = the sum of ``M * loss_t``):

    * ``"grpo"``: ``sum_i (sum_t M loss / max(1, sum_t M)) / num_sequences_in_batch`` — per-sequence token mean,
      then the mean over the step's sequences (DeepSeekMath eq. 3; TRL divides the micro-batch mean by the
      accumulation steps, equal when micro-batches have equal sizes).
    * ``"bnpo"``: ``S / max(1, local sum of M)`` — local micro-batch token count, by definition (TRL). The value is a
      micro-batch mean: average it over micro-batches and ranks (Lightning's and DDP's own averaging do exactly that).
    * ``"dr_grpo"``: ``S / (num_sequences_in_batch * max_completion_length)`` — a constant (Dr. GRPO).
    * ``"dapo"`` (default): ``S / num_items_in_batch`` — the token count of the whole optimizer step, all
      micro-batches and ranks (DAPO's token-level loss; TRL's ``num_items_in_batch``).

    ``num_items_in_batch`` / ``num_sequences_in_batch`` default to this micro-batch's counts (correct only without
    accumulation on one rank). With step-level counts the losses of a step's micro-batches **sum** to the step loss;
    a Lightning caller multiplies them by ``accumulate_grad_batches * world_size`` to undo Lightning/DDP averaging
    (TRL divides ``num_items_in_batch`` by ``num_processes`` for the same reason). Ignored by the other loss types.

    Args:
        log_probs: ``[B, T]`` float32 log-probs of the sampled tokens under the trained policy (with grad).
        old_log_probs: ``[B, T]`` float32 log-probs at generation time (no grad); equal to ``log_probs`` on the first
            iteration of on-policy data, so ``ratio == 1``.
        advantages: ``[B]`` float, one per completion (see :func:`compute_advantages`).
        completion_mask: ``[B, T]`` bool, True on response tokens (stop token included).
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"``.
        epsilon: lower clip ``1 - epsilon`` (and upper when ``epsilon_high`` is None). TRL default 0.2.
        epsilon_high: upper clip ``1 + epsilon_high`` (DAPO clip-higher, e.g. 0.28).
        beta: KL coefficient; > 0 requires ``ref_log_probs``.
        ref_log_probs: ``[B, T]`` float32 log-probs of the frozen reference policy; ``kl`` is reported when given.
        entropy: ``[B, T]`` float per-token entropies of the policy, reported as ``entropy`` when given.
        truncated: ``[B]`` bool, completions that hit ``max_new_tokens``.
        mask_truncated_completions: exclude truncated completions from the loss and every denominator.
        max_completion_length: ``max_new_tokens``; required by ``"dr_grpo"``.
        num_items_in_batch: step-level token count for ``"dapo"`` (after truncation masking).
        num_sequences_in_batch: step-level sequence count for ``"grpo"`` and ``"dr_grpo"``.

    Returns:
        ``(loss, metrics)``: 0-d ``loss`` with grad; ``metrics`` of detached 0-d float32 tensors, local token means
        over ``M``: ``loss``, ``clip_ratio/low_mean`` (``ratio < 1 - epsilon`` and ``A < 0``),
        ``clip_ratio/high_mean`` (``ratio > 1 + epsilon_high`` and ``A > 0``), ``clip_ratio/region_mean`` (either),
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` (1 when ``M`` is empty), ``kl`` and ``entropy`` (when given),
        ``num_tokens`` (local sum of ``M``), ``normalizer`` (the denominator used).

    Raises:
        ValueError: unknown ``loss_type``; shape mismatches; non-finite advantages; negative ``epsilon``/``beta``;
            ``beta > 0`` without ``ref_log_probs``; ``"dr_grpo"`` without ``max_completion_length``;
            ``mask_truncated_completions`` without ``truncated``; a step count below the local count.
        TypeError: log-probs not floating point, masks not bool.
    """
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose 'grpo', 'bnpo', 'dr_grpo' or 'dapo'.")
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
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages holds NaN/inf; check the rewards fed to compute_advantages.")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    for name, v in (("epsilon", eps_low), ("epsilon_high", eps_high), ("beta", beta)):
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
    if beta > 0 and ref_log_probs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_log_probs ([B, T] log-probs of the frozen reference policy); "
                         f"pass them or set beta=0.")
    if loss_type == "dr_grpo" and (not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length (int >= 1, the max_new_tokens of "
                         f"generation), got {max_completion_length!r}.")

    adv = advantages.detach().to(log_probs.dtype)[:, None]
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_log_probs is not None:
        check_per_token(ref_log_probs, name="ref_log_probs", shape=log_probs.shape)
        kl = k3_kl(log_probs, ref_log_probs, mask)
        if beta > 0:
            per_token = per_token + beta * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))

    seq_counts = mask.sum(-1)
    num_tokens = seq_counts.sum()
    local_seqs = torch.tensor(b, device=log_probs.device)
    if loss_type == "grpo":
        denom = resolve_normalizer(local_seqs, num_sequences_in_batch, name="num_sequences_in_batch")
        loss = (per_token.sum(-1) / seq_counts.clamp(min=1)).sum() / denom
    elif loss_type == "bnpo":
        denom = num_tokens.float().clamp(min=1.0)
        loss = per_token.sum() / denom
    elif loss_type == "dr_grpo":
        denom = resolve_normalizer(local_seqs, num_sequences_in_batch, name="num_sequences_in_batch")
        denom = denom * max_completion_length
        loss = per_token.sum() / denom
    else:
        denom = resolve_normalizer(num_tokens, num_items_in_batch, name="num_items_in_batch")
        loss = per_token.sum() / denom

    count = num_tokens.float().clamp(min=1.0)
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    r_det = ratio.detach()
    empty = num_tokens.item() == 0
    one = torch.ones((), device=log_probs.device)
    metrics = {
        "loss": loss.detach().float(),
        "clip_ratio/low_mean": _masked_mean(low.float(), mask, count),
        "clip_ratio/high_mean": _masked_mean(high.float(), mask, count),
        "clip_ratio/region_mean": _masked_mean((low | high).float(), mask, count),
        "ratio_mean": _masked_mean(r_det, mask, count) if not empty else one,
        "ratio_min": r_det[mask].min().float() if not empty else one,
        "ratio_max": r_det[mask].max().float() if not empty else one,
        "num_tokens": num_tokens.float(),
        "normalizer": denom.detach().float(),
    }
    if kl is not None:
        metrics["kl"] = _masked_mean(kl, mask, count)
    if entropy is not None:
        check_per_token(entropy, name="entropy", shape=log_probs.shape)
        metrics["entropy"] = _masked_mean(entropy, mask, count)
    return loss, metrics


@dataclass(frozen=True)
class GRPOObjective:
    """The GRPO loss of one optimizer step, micro-batch by micro-batch: TRL's flat knobs bound together, with the
    per-``loss_type`` step count and the ``bnpo`` rescale (internal interface of :class:`~lit_llm.lightning.grpo.
    GRPOModule`; the YAML surface stays the module's flat knobs).

    Usage for one optimizer step over micro-batches ``mb_1..mb_k`` on ``W`` ranks::

        count = sum(objective.local_count(mb.loss_mask, mb.truncated) for mb in mbs)   # then all-reduce (sum)
        for mb in mbs:
            loss, metrics = objective(log_probs, mb.old_log_probs, mb.advantage, mb.loss_mask, step_count=count,
                                      num_micro_batches=k, world_size=W, truncated=mb.truncated)

    Step counts (the denominator each ``loss_type`` states in :func:`grpo_loss`): ``dapo`` and ``bnpo`` count loss
    tokens after truncation masking, ``grpo`` and ``dr_grpo`` count sequences (rows). ``bnpo`` is a local mean by
    definition: its micro-batch loss is divided by ``num_micro_batches * world_size`` so that the step loss is the
    mean of the micro-batch means over micro-batches and ranks (the caller multiplies by ``world_size`` to undo DDP's
    gradient averaging, as for every loss type).

    Attributes:
        loss_type: ``"dapo"``, ``"grpo"``, ``"dr_grpo"`` or ``"bnpo"`` (see :func:`grpo_loss`).
        epsilon: lower clip ``1 - epsilon`` (and the upper one when ``epsilon_high`` is ``None``).
        epsilon_high: upper clip ``1 + epsilon_high`` (DAPO clip-higher).
        beta: k3 KL coefficient (> 0 needs reference log-probs).
        mask_truncated_completions: drop truncated completions from the loss and every count (DAPO).
        max_completion_length: ``max_new_tokens`` of generation (``dr_grpo``'s constant denominator).
    """

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    mask_truncated_completions: bool = False
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"Unknown loss_type {self.loss_type!r}; choose 'grpo', 'bnpo', 'dr_grpo' or 'dapo'.")

    def local_count(self, loss_mask: Tensor, truncated: Tensor | None = None) -> Tensor:
        """This micro-batch's share of the step denominator: loss tokens after truncation masking (``dapo``,
        ``bnpo``) or rows (``grpo``, ``dr_grpo``), a 0-d tensor on ``loss_mask``'s device.

        Args:
            loss_mask: ``[B, T]`` bool, the completion tokens that enter the loss.
            truncated: ``[B]`` bool (needed with ``mask_truncated_completions``).
        """
        if self.loss_type in ("grpo", "dr_grpo"):
            return torch.tensor(loss_mask.shape[0], device=loss_mask.device)
        return effective_completion_mask(loss_mask, truncated, self.mask_truncated_completions).sum()

    def __call__(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                 step_count: Tensor | float | int, num_micro_batches: int = 1, world_size: int = 1,
                 ref_log_probs: Tensor | None = None, entropy: Tensor | None = None,
                 truncated: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """:func:`grpo_loss` of one micro-batch with the step-level ``step_count`` (sum of :meth:`local_count` over
        the step's micro-batches and ranks) passed as the right denominator for :attr:`loss_type`.

        Args:
            log_probs, old_log_probs, advantages, ref_log_probs, entropy, truncated: see :func:`grpo_loss`
                (``[B, T]`` / ``[B]``).
            loss_mask: ``[B, T]`` bool completion tokens of the loss (``completion_mask`` of :func:`grpo_loss`).
            step_count: the step's count (tokens or sequences, see the class docstring).
            num_micro_batches: micro-batches of the step on this rank (``bnpo`` only).
            world_size: ranks (``bnpo`` only).

        Returns:
            ``(loss, metrics)`` as :func:`grpo_loss`; ``metrics["loss"]`` is the rescaled loss for ``bnpo``.
        """
        counts = {"dapo": {"num_items_in_batch": step_count}, "grpo": {"num_sequences_in_batch": step_count},
                  "dr_grpo": {"num_sequences_in_batch": step_count}, "bnpo": {}}[self.loss_type]
        loss, metrics = grpo_loss(
            log_probs, old_log_probs, advantages, loss_mask, loss_type=self.loss_type, epsilon=self.epsilon,
            epsilon_high=self.epsilon_high, beta=self.beta, ref_log_probs=ref_log_probs, entropy=entropy,
            truncated=truncated, mask_truncated_completions=self.mask_truncated_completions,
            max_completion_length=self.max_completion_length, **counts)
        if self.loss_type == "bnpo":  # a local mean: average it over the step's micro-batches and ranks
            loss = loss / (num_micro_batches * world_size)
            metrics["loss"] = loss.detach().float()
        return loss, metrics
