"""GRPO ``loss_type`` strategies: the one place that knows what each loss type does.

A loss type decides three things (TRL ``GRPOTrainer._compute_loss``, with the papers cited per class):

* its **policy term** per token (the PPO-style clipped surrogate, or CISPO's clipped importance-weighted REINFORCE);
* its **step count** (:attr:`LossType.counts`: the loss tokens of the optimizer step, or its sequences, or nothing
  for ``bnpo``, which is a local mean by definition) and how the summed per-token loss is divided by it;
* its **settings rules** (``cispo`` needs ``epsilon_high``, and :meth:`Cispo.advice` words the warning for a cap
  <= 1; ``dr_grpo`` needs ``max_completion_length``).

:func:`get_loss_type` returns the strategy of a name; :data:`LOSS_TYPE_CLASSES` lists them. Per-token tensors are
``[B, T]`` (rows = completions); masks are bool.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from torch import Tensor

from lit_llm.objectives.reduction import resolve_normalizer

__all__ = ["LOSS_TYPES", "LOSS_TYPE_CLASSES", "Bnpo", "Cispo", "Dapo", "DrGrpo", "Grpo", "LossType",
           "LossTypeName", "get_loss_type"]

LossTypeName = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]


class LossType:
    """A GRPO loss type (strategy): policy term, step count and denominator, settings rules.

    Subclasses set :attr:`name` and :attr:`counts` and override what differs from the default (the clipped
    surrogate divided by the step's loss-token count, i.e. ``dapo``).
    """

    #: The ``loss_type`` option's value.
    name: ClassVar[str] = ""
    #: What the step count counts: ``"tokens"`` (loss tokens of the step, all micro-batches and ranks),
    #: ``"sequences"`` (rows of the step) or ``"local"`` (none: the micro-batch's own token count).
    counts: ClassVar[Literal["tokens", "sequences", "local"]] = "tokens"

    def check(self, *, epsilon_high: float | None, max_completion_length: int | None) -> None:
        """Settings rules of this loss type (none by default).

        Raises:
            ValueError: a setting this loss type needs is missing (named with the fix).
        """

    def policy_term(self, ratio: Tensor, adv: Tensor, log_probs: Tensor, mask: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token policy loss and the clip indicators.

        Default (every loss type but ``cispo``; DeepSeekMath eq. 3 with DAPO's clip-higher):
        ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.

        Args:
            ratio: ``[B, T]`` importance ratio (with grad).
            adv: ``[B, 1]`` advantages (detached, the log-probs' dtype).
            log_probs: ``[B, T]`` log-probs with grad.
            mask: ``[B, T]`` bool loss tokens.
            eps_low, eps_high: the clip range (``cispo``: ``eps_high`` is the weight cap).

        Returns:
            ``(per_token [B, T], clipped_low [B, T] bool, clipped_high [B, T] bool)``.
        """
        clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
        return per_token, low, high

    def reduce(self, per_token: Tensor, seq_counts: Tensor, num_tokens: Tensor, step_count: Tensor | float | None,
               max_completion_length: int | None) -> tuple[Tensor, Tensor]:
        """The loss of the micro-batch from its masked per-token losses and this type's denominator.

        Default (``dapo``, ``cispo``): ``sum(per_token) / step_count`` with ``step_count`` the loss tokens of the
        whole optimizer step (TRL's ``num_items_in_batch``; this micro-batch's count when ``None``).

        Args:
            per_token: ``[B, T]`` per-token losses, 0 outside the loss tokens.
            seq_counts: ``[B]`` loss tokens per row.
            num_tokens: 0-d loss tokens of the micro-batch.
            step_count: the step's count of :attr:`counts` (``None``: this micro-batch's).
            max_completion_length: ``dr_grpo``'s constant.

        Returns:
            ``(loss, denominator)``: 0-d tensors.
        """
        denom = resolve_normalizer(num_tokens, step_count, name="num_items_in_batch")
        return per_token.sum() / denom, denom

    def rescale(self, loss: Tensor, num_micro_batches: int, world_size: int) -> Tensor:
        """The micro-batch loss as its share of the step loss (identity but for ``bnpo``)."""
        return loss


class Dapo(LossType):
    """``dapo`` (default; DAPO, Yu et al. 2025, arXiv:2503.14476): the token mean over every loss token of the
    optimizer step (all micro-batches and ranks)."""

    name = "dapo"


class Cispo(LossType):
    """``cispo`` (MiniMax-M1, arXiv:2506.13585 eq. 4; TRL ``loss_type="cispo"``): ``-sg(min(r, epsilon_high)) A
    logp_t``, the stop-gradient clipped importance weight times the log-prob (every token keeps a gradient);
    ``epsilon_high`` is the cap ``eps_max`` itself (no lower bound) and is required. Denominator: the step's loss
    tokens (CISPO's ``1 / sum_i |o_i|``)."""

    name = "cispo"

    def check(self, *, epsilon_high: float | None, max_completion_length: int | None) -> None:
        if epsilon_high is None or epsilon_high <= 0:
            raise ValueError(f"loss_type='cispo' needs epsilon_high > 0: it is CISPO's eps_max, the cap of the "
                             f"importance weight min(ratio, epsilon_high) (TRL; ScaleRL uses 4-5), got "
                             f"{epsilon_high!r}; set epsilon_high, e.g. 5.0.")

    @staticmethod
    def advice(epsilon_high: float | None) -> str | None:
        """What to say about a legal but likely mistaken cap (``0 < epsilon_high <= 1``: below the on-policy weight
        1, a clip width read as a cap), or ``None``."""
        if epsilon_high is None or not 0 < epsilon_high <= 1:
            return None
        return (f"loss_type='cispo' with epsilon_high={epsilon_high}: CISPO's epsilon_high is an absolute cap on the "
                f"importance-sampling weight (TRL's semantics, ScaleRL's eps_max), not a clip width, so every token's "
                f"weight is capped at {epsilon_high} (below the on-policy weight 1). Set epsilon_high above 1, e.g. "
                f"5.0 (TRL's recommended value for cispo).")

    def policy_term(self, ratio: Tensor, adv: Tensor, log_probs: Tensor, mask: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
        lp = torch.where(mask, log_probs, torch.zeros_like(log_probs))
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * lp
        return per_token, torch.zeros_like(mask), ratio > eps_high


class Grpo(LossType):
    """``grpo`` (DeepSeekMath eq. 3): each sequence's token mean, then the mean over the step's sequences (TRL
    divides the micro-batch mean by the accumulation steps, equal when micro-batches have equal sizes)."""

    name = "grpo"
    counts = "sequences"

    def reduce(self, per_token: Tensor, seq_counts: Tensor, num_tokens: Tensor, step_count: Tensor | float | None,
               max_completion_length: int | None) -> tuple[Tensor, Tensor]:
        local = torch.full((), per_token.shape[0], dtype=torch.long, device=per_token.device)
        denom = resolve_normalizer(local, step_count, name="num_sequences_in_batch")
        return (per_token.sum(-1) / seq_counts.clamp(min=1)).sum() / denom, denom


class DrGrpo(LossType):
    """``dr_grpo`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783): ``sum(per_token) / (sequences of the step *
    max_completion_length)``, a constant per step."""

    name = "dr_grpo"
    counts = "sequences"

    def check(self, *, epsilon_high: float | None, max_completion_length: int | None) -> None:
        """``max_completion_length`` (when given; the loss itself requires it) must be an int >= 1."""
        if max_completion_length is not None:
            self._check_length(max_completion_length)

    @staticmethod
    def _check_length(max_completion_length: object) -> None:
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) \
                or max_completion_length < 1:
            raise ValueError(f"loss_type='dr_grpo' needs max_completion_length (int >= 1, the max_new_tokens of "
                             f"generation), got {max_completion_length!r}.")

    def reduce(self, per_token: Tensor, seq_counts: Tensor, num_tokens: Tensor, step_count: Tensor | float | None,
               max_completion_length: int | None) -> tuple[Tensor, Tensor]:
        self._check_length(max_completion_length)
        local = torch.full((), per_token.shape[0], dtype=torch.long, device=per_token.device)
        denom = resolve_normalizer(local, step_count, name="num_sequences_in_batch") * max_completion_length
        return per_token.sum() / denom, denom


class Bnpo(LossType):
    """``bnpo`` (TRL): the micro-batch's own token mean (local by definition); the step loss is the mean of the
    micro-batch means over micro-batches and ranks (:meth:`rescale`)."""

    name = "bnpo"
    counts = "local"

    def reduce(self, per_token: Tensor, seq_counts: Tensor, num_tokens: Tensor, step_count: Tensor | float | None,
               max_completion_length: int | None) -> tuple[Tensor, Tensor]:
        denom = num_tokens.float().clamp(min=1.0)
        return per_token.sum() / denom, denom

    def rescale(self, loss: Tensor, num_micro_batches: int, world_size: int) -> Tensor:
        return loss / (num_micro_batches * world_size)


#: The built-in loss types by name (the ``loss_type`` option's choices, in TRL's order).
LOSS_TYPE_CLASSES: dict[str, type[LossType]] = {c.name: c for c in (Grpo, Bnpo, DrGrpo, Dapo, Cispo)}
LOSS_TYPES: tuple[str, ...] = tuple(LOSS_TYPE_CLASSES)


def get_loss_type(name: str) -> LossType:
    """The strategy of the loss type ``name``.

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    cls = LOSS_TYPE_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"Unknown loss_type {name!r}; choose one of {', '.join(LOSS_TYPES)}.")
    return cls()
