"""Masked token distributions for LLM losses (TorchRL names and semantics, no TorchRL dependency).

- :class:`LLMMaskedCategorical`: a categorical over the vocabulary at every position of ``[..., T, V]`` logits, with a
  *position-level* mask ``[..., T]``. Masked positions contribute 0.0 to ``log_prob`` and ``entropy`` and sample
  ``ignore_index``; the logits are never copied with ``-inf`` filled in (TorchRL's ``LLMMaskedCategorical``,
  ``torchrl/modules/distributions/discrete.py``, does so lazily for sampling; here sampling needs no copy either, only
  :attr:`LLMMaskedCategorical.masked_logits` makes one, for callers that want it).
- :class:`LogProbDistribution`: a pseudo-distribution over precomputed per-token log-probs ``[..., T]`` (e.g. the
  ``log_probs.full`` of the generate version), as in TorchRL's ``torchrl/modules/llm/policies/common.py``.
"""

from __future__ import annotations

import torch
import torch.distributions as D
from torch import Tensor

__all__ = ["LLMMaskedCategorical", "LogProbDistribution", "check_mask"]


def check_mask(mask: Tensor, shape: torch.Size, owner: str, what: str) -> Tensor:
    """A position-level mask checked against ``shape`` (``what`` names that shape, ``owner`` the caller, in errors).

    Returns:
        ``mask`` as a bool tensor.

    Raises:
        ValueError: ``mask`` is not a bool / integer tensor, or its shape is not ``shape``.
    """
    if not isinstance(mask, Tensor) or mask.dtype.is_floating_point:
        raise ValueError(
            f"{owner}: mask must be a bool (or 0/1 integer) tensor of shape {tuple(shape)} (True = position is "
            f"scored); got {mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}."
        )
    if mask.shape != shape:
        raise ValueError(
            f"{owner}: mask shape {tuple(mask.shape)} must equal {what} {tuple(shape)} (a position-level mask aligned "
            f"to the tokens). Token-level masks [..., T, V] are not supported: mask the logits yourself instead."
        )
    return mask.bool()


class LLMMaskedCategorical(D.Distribution):
    """Categorical next-token distributions at every position, with a position-level mask.

    ``batch_shape = logits.shape[:-1]`` (``[..., T]``), ``event_shape = ()``: a value is one token id per position.
    Probabilities are ``softmax(logits)`` in fp32 (bf16/fp16 logits are upcast inside each method). Masked positions
    (``mask == False``) are *ignored*: ``log_prob`` and ``entropy`` give 0.0 there (and no gradient),
    ``sample``/``mode`` give ``ignore_index`` there, whatever the logits hold. Nothing is cached: no masked copy of
    the logits is made unless :attr:`masked_logits` is read.

    Args:
        logits: ``[..., T, V]`` unnormalised next-token logits (any float dtype), e.g. ``[B, T, V]``.
        mask: ``[..., T]`` bool; True = the position is scored (e.g. an assistant or response token).
        ignore_index: the token id used for masked positions in values and samples (default -100, as in
            ``torch.nn.functional.cross_entropy``).

    Raises:
        ValueError: logits with fewer than 1 dim or not floating point, or a mask that is not ``[..., T]`` bool/int.

    Example:
        >>> logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]]))  # [B=1, T=2, V=3]
        >>> dist = LLMMaskedCategorical(logits, mask=torch.tensor([[True, False]]))
        >>> dist.log_prob(torch.tensor([[2, -100]]))  # [[ln(3/6), 0.0]]
        tensor([[-0.6931,  0.0000]])
    """

    arg_constraints: dict = {}
    has_enumerate_support = False

    def __init__(self, logits: Tensor, mask: Tensor, ignore_index: int = -100) -> None:
        if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.dtype.is_floating_point:
            raise ValueError(
                "LLMMaskedCategorical: logits must be a floating-point tensor [..., T, V]; got "
                f"{type(logits).__name__}{tuple(logits.shape) if isinstance(logits, Tensor) else ''}."
            )
        self._logits = logits
        self._mask = check_mask(mask, logits.shape[:-1], "LLMMaskedCategorical", "logits.shape[:-1]")
        self.ignore_index = int(ignore_index)
        super().__init__(batch_shape=logits.shape[:-1], event_shape=torch.Size(), validate_args=False)

    # --- views ----------------------------------------------------------------------------------------------------
    @property
    def logits(self) -> Tensor:
        """The original, unmasked logits ``[..., T, V]`` (not normalised, not copied)."""
        return self._logits

    @property
    def mask(self) -> Tensor:
        """The position mask ``[..., T]`` (bool)."""
        return self._mask

    @property
    def num_classes(self) -> int:
        """Vocabulary size ``V``."""
        return self._logits.shape[-1]

    @property
    def probs(self) -> Tensor:
        """``softmax(logits)`` in fp32, ``[..., T, V]``, at every position (masked ones included; a new tensor)."""
        return torch.softmax(self._logits.float(), dim=-1)

    @property
    def masked_logits(self) -> Tensor:
        """A copy of the logits with every entry of masked positions set to the dtype's lowest value (TorchRL's view).

        Materialises a full ``[..., T, V]`` tensor: only for callers that need it.
        """
        return self._logits.masked_fill(~self._mask.unsqueeze(-1), torch.finfo(self._logits.dtype).min)

    # --- scores ---------------------------------------------------------------------------------------------------
    def log_prob(self, value: Tensor) -> Tensor:
        """``log softmax(logits)[..., t, value[..., t]]`` at unmasked positions, 0.0 at masked ones.

        Args:
            value: ``[..., T]`` integer token ids. At masked positions any value is allowed (``ignore_index`` is the
                convention); at unmasked positions it must lie in ``[0, V)``. Values with leading sample dims
                (``[S, ..., T]``) broadcast against the logits.

        Returns:
            fp32 ``[..., T]`` (broadcast shape of ``value`` and the batch shape).

        Raises:
            ValueError: float/bool values, a shape that does not broadcast to the batch shape, or an unmasked
                position holding an id outside ``[0, V)`` (the message names the first such position).
        """
        if not isinstance(value, Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(
                f"LLMMaskedCategorical.log_prob: value must be an integer tensor of token ids [..., T]; got "
                f"{getattr(value, 'dtype', type(value).__name__)}."
            )
        try:
            shape = torch.broadcast_shapes(value.shape, self.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"LLMMaskedCategorical.log_prob: value shape {tuple(value.shape)} does not broadcast to the batch "
                f"shape {tuple(self.batch_shape)} (= logits.shape[:-1])."
            ) from None
        mask = self._mask.expand(shape)
        value = value.expand(shape).long()
        bad = mask & ((value < 0) | (value >= self.num_classes))
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"LLMMaskedCategorical.log_prob: value at unmasked position {pos} is {int(value[pos])}, outside the "
                f"vocabulary [0, {self.num_classes}). Use ignore_index ({self.ignore_index}) only where mask is False."
            )
        logits = self._logits.float()
        lse = torch.logsumexp(logits, dim=-1)  # [..., T]
        safe = value.masked_fill(~mask, 0)
        logits_b = logits.expand(*shape, self.num_classes)
        picked = logits_b.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        return torch.where(mask, picked - lse, torch.zeros((), dtype=logits.dtype, device=logits.device))

    def entropy(self) -> Tensor:
        """Entropy ``-sum_v p_v log p_v`` per position, fp32 ``[..., T]``; 0.0 at masked positions (no gradient)."""
        logp = torch.log_softmax(self._logits.float(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return torch.where(self._mask, ent, torch.zeros((), dtype=ent.dtype, device=ent.device))

    # --- samples --------------------------------------------------------------------------------------------------
    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        """Draw token ids from ``softmax(logits)`` at each position; ``ignore_index`` at masked positions.

        Args:
            sample_shape: leading sample dims ``S``.

        Returns:
            long ``[*S, ..., T]``. Uses the global torch RNG (seed with ``torch.manual_seed``).
        """
        sample_shape = torch.Size(sample_shape)
        probs = self.probs.reshape(-1, self.num_classes)
        n = max(sample_shape.numel(), 1)
        draws = torch.multinomial(probs, n, replacement=True)  # [prod(batch), n]
        draws = draws.t().reshape(*sample_shape, *self.batch_shape)
        return draws.masked_fill(~self._mask, self.ignore_index)

    @property
    def mode(self) -> Tensor:
        """``argmax(logits)`` per position (long ``[..., T]``), ``ignore_index`` at masked positions."""
        return self._logits.argmax(-1).masked_fill(~self._mask, self.ignore_index)

    @property
    def deterministic_sample(self) -> Tensor:
        """Same as :attr:`mode` (TorchRL's name for the deterministic action)."""
        return self.mode

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(logits: {tuple(self._logits.shape)} {self._logits.dtype}, "
                f"mask: {int(self._mask.sum())}/{self._mask.numel()} positions, ignore_index={self.ignore_index})")


class LogProbDistribution(D.Distribution):
    """Pseudo-distribution over precomputed per-token log-probs (no logits needed).

    Not a real distribution over the vocabulary: it only knows the log-prob of the token that *was* at each
    position, so :meth:`log_prob` returns the stored values (masked) whatever ids it is given, provided their shape
    matches. Use it to feed old/reference log-probs (e.g. ``log_probs.full`` from the generate version) to code written
    against :class:`LLMMaskedCategorical`. ``sample`` and ``entropy`` raise ``NotImplementedError``.

    Args:
        log_probs: ``[..., T]`` float log-probs of the tokens ``x_t`` (fp32 by convention).
        mask: optional ``[..., T]`` bool; False positions give 0.0. ``None`` = every position is scored.

    Raises:
        ValueError: ``log_probs`` not a floating tensor with at least 1 dim, or a mask of another shape / float dtype.
    """

    arg_constraints: dict = {}

    def __init__(self, log_probs: Tensor, mask: Tensor | None = None) -> None:
        if not isinstance(log_probs, Tensor) or log_probs.dim() < 1 or not log_probs.dtype.is_floating_point:
            raise ValueError(
                "LogProbDistribution: log_probs must be a floating-point tensor [..., T]; got "
                f"{type(log_probs).__name__}{tuple(log_probs.shape) if isinstance(log_probs, Tensor) else ''}."
            )
        self.log_probs = log_probs
        self.mask = None if mask is None else check_mask(mask, log_probs.shape, "LogProbDistribution",
                                                          "log_probs.shape")
        super().__init__(batch_shape=log_probs.shape, event_shape=torch.Size(), validate_args=False)

    def log_prob(self, value: Tensor) -> Tensor:
        """The stored log-probs ``[..., T]``, 0.0 where ``mask`` is False.

        Args:
            value: token ids ``[..., T]``; only their shape is checked (the ids the log-probs were computed for are
                assumed).

        Raises:
            ValueError: ``value.shape != log_probs.shape``.
        """
        if tuple(value.shape) != tuple(self.log_probs.shape):
            raise ValueError(
                f"LogProbDistribution.log_prob: value shape {tuple(value.shape)} must equal the stored log_probs shape "
                f"{tuple(self.log_probs.shape)}: pass the token ids the log-probs were computed for."
            )
        if self.mask is None:
            return self.log_probs
        return torch.where(self.mask, self.log_probs, torch.zeros((), dtype=self.log_probs.dtype,
                                                                  device=self.log_probs.device))

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        """Not available: only one token's log-prob per position is known."""
        raise NotImplementedError(
            "LogProbDistribution.sample: precomputed log-probs hold one token's log-prob per position, not the full "
            "distribution. Build an LLMMaskedCategorical from logits (wrapper.get_dist) to sample."
        )

    def entropy(self) -> Tensor:
        """Not available: the entropy needs the full distribution."""
        raise NotImplementedError(
            "LogProbDistribution.entropy: the entropy needs the full next-token distribution; compute it with "
            "model_token_log_probs(..., return_entropy=True) or an LLMMaskedCategorical."
        )
