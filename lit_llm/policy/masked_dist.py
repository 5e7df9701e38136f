"""``ChunkedLLMMaskedCategorical``: the log-prob version's masked distribution, computed from hidden states.

:class:`~lit_llm.distributions.LLMMaskedCategorical` holds ``[..., T, V]`` logits; for a real vocabulary that is the
largest tensor of a training step (8 x 512 x 49,152 fp32 = 805 MB for SmolLM2, several times over in autograd). This
subclass holds the backbone's final hidden states ``[..., T, H]`` aligned to the tokens they predict (see
:func:`~lit_llm.policy.logprobs.token_hidden_states`) plus the LM head, and answers :meth:`log_prob`,
:meth:`entropy` and :meth:`log_prob_and_entropy` with the chunked kernel
:func:`~lit_llm.policy.kernel.chunked_token_log_probs`: only masked-in positions go through the head, ``chunk_size``
rows at a time, and the backward pass recomputes each chunk's logits. Everything else of the base class (``logits``,
``probs``, ``mode``, ``sample``, ``masked_logits``) works by materialising the logits on demand.
"""

from __future__ import annotations

import torch
import torch.distributions as D
from torch import Tensor

from lit_llm.distributions import LLMMaskedCategorical, check_mask
from lit_llm.policy.deferred import check_value
from lit_llm.policy.kernel import IGNORE_INDEX, _check_scalars, _chunk_logits, chunked_token_log_probs

__all__ = ["ChunkedLLMMaskedCategorical"]

_NAME = "ChunkedLLMMaskedCategorical"


class ChunkedLLMMaskedCategorical(LLMMaskedCategorical):
    """Next-token categoricals ``softmax((hidden @ weight.T + bias) / temperature)`` at every position, position-masked.

    Same semantics as :class:`~lit_llm.distributions.LLMMaskedCategorical` (``batch_shape = [..., T]``,
    ``event_shape = ()``, masked positions give 0.0 and no gradient in ``log_prob``/``entropy`` and ``ignore_index``
    in ``sample``/``mode``), but built from hidden states so that no ``[..., T, V]`` tensor exists unless
    :attr:`logits` (or ``probs``/``mode``/``sample``/``masked_logits``, which go through it) is read.

    ``hidden[..., t, :]`` is the state that predicts the token at ``t`` (for a causal LM: the backbone output at
    ``t - 1``, as :func:`~lit_llm.policy.logprobs.token_hidden_states` returns it). The log-prob version of
    :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper` builds it (``get_dist`` and the ``get_*_dist``
    heads) and sets :attr:`tokens` to the ids aligned with the mask, so ``dist.log_prob(dist.tokens)`` is
    ``log_probs.full`` on the masked-in positions.

    Args:
        hidden: ``[..., T, H]`` hidden states (any float dtype; keeps its autograd graph), e.g. ``[B, T, H]``.
        weight: ``[V, H]`` LM-head weight (``model.get_output_embeddings().weight``), same device as ``hidden``.
        mask: ``[..., T]`` bool (or 0/1 integers); True = the position is scored.
        bias: optional ``[V]`` LM-head bias.
        temperature: logits are divided by it (> 0), as in sampling.
        chunk_size: hidden-state rows per LM-head chunk (>= 1); peak extra memory ~ ``chunk_size * V * 4`` bytes.
        matmul_dtype: dtype of the LM-head matmuls (``None`` = fp32, or fp64 for fp64 inputs; see
            :func:`~lit_llm.policy.kernel.chunked_token_log_probs`). Softmax and reductions are fp32 either way.
        ignore_index: the id that ``sample``/``mode`` put at masked positions (default -100).

    Attributes:
        tokens: the token ids ``[..., T]`` aligned with the mask, set by the wrapper (``None`` otherwise).

    Raises:
        ValueError: ``hidden`` not a float tensor with >= 2 dims, ``weight`` not ``[V, H]`` float with
            ``H = hidden.shape[-1]``, ``bias`` not ``[V]``, devices that differ, a mask that is not ``[..., T]``
            bool/int, a bad ``temperature``/``chunk_size``/``matmul_dtype``. Messages name the argument and the fix.

    Example:
        >>> hidden = torch.ones(1, 2, 1)                                  # [B=1, T=2, H=1]
        >>> weight = torch.log(torch.tensor([[1.0], [2.0], [3.0]]))       # [V=3, H=1]: logits ln1, ln2, ln3
        >>> dist = ChunkedLLMMaskedCategorical(hidden, weight, torch.tensor([[True, False]]))
        >>> dist.log_prob(torch.tensor([[2, -100]]))                      # [[ln(3/6), 0.0]]
        tensor([[-0.6931,  0.0000]])
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        mask: Tensor,
        *,
        bias: Tensor | None = None,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        matmul_dtype: torch.dtype | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        if not isinstance(hidden, Tensor) or hidden.dim() < 2 or not hidden.dtype.is_floating_point:
            raise ValueError(
                f"{_NAME}: hidden must be a floating-point tensor [..., T, H] (hidden[..., t, :] predicts the token "
                f"at t; see token_hidden_states); got {_describe(hidden)}."
            )
        if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point \
                or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"{_NAME}: weight must be the [V, H] floating-point LM-head weight with H = hidden.shape[-1] = "
                f"{hidden.shape[-1]}; got {_describe(weight)}. Pass model.get_output_embeddings().weight."
            )
        if bias is not None and (not isinstance(bias, Tensor) or bias.shape != weight.shape[:1]
                                 or not bias.dtype.is_floating_point):
            raise ValueError(f"{_NAME}: bias must be None or a float [V] = [{weight.shape[0]}] tensor (the LM-head "
                             f"bias); got {_describe(bias)}.")
        for arg, value in (("weight", weight), ("bias", bias)):
            if value is not None and value.device != hidden.device:
                raise ValueError(f"{_NAME}: {arg} is on {value.device} but hidden is on {hidden.device}; move them "
                                 f"to one device.")
        _check_scalars(temperature, chunk_size)
        if matmul_dtype is not None and (not isinstance(matmul_dtype, torch.dtype)
                                         or not matmul_dtype.is_floating_point):
            raise ValueError(f"{_NAME}: matmul_dtype must be None or a floating torch.dtype (e.g. torch.bfloat16); "
                             f"got {matmul_dtype!r}.")
        self._hidden, self._weight, self._bias = hidden, weight, bias
        self._mask = check_mask(mask, hidden.shape[:-1], _NAME, "hidden.shape[:-1]")
        if self._mask.device != hidden.device:
            raise ValueError(f"{_NAME}: mask is on {self._mask.device} but hidden is on {hidden.device}; move them to "
                             f"one device.")
        self.temperature = float(temperature)
        self.chunk_size = chunk_size
        self.matmul_dtype = matmul_dtype
        self.ignore_index = int(ignore_index)
        self.tokens: Tensor | None = None
        D.Distribution.__init__(self, batch_shape=hidden.shape[:-1], event_shape=torch.Size(), validate_args=False)

    # --- inputs ---------------------------------------------------------------------------------------------------
    @property
    def hidden(self) -> Tensor:
        """The aligned hidden states ``[..., T, H]`` (not copied)."""
        return self._hidden

    @property
    def weight(self) -> Tensor:
        """The LM-head weight ``[V, H]``."""
        return self._weight

    @property
    def bias(self) -> Tensor | None:
        """The LM-head bias ``[V]`` or ``None``."""
        return self._bias

    @property
    def num_classes(self) -> int:
        """Vocabulary size ``V``."""
        return self._weight.shape[0]

    # --- full-logit views (materialised on demand) -----------------------------------------------------------------
    @property
    def _logits(self) -> Tensor:
        # the base class's probs / masked_logits / mode / sample read this: materialised on each access, never cached
        dtype = self._mm_dtype()
        h = self._hidden.reshape(-1, self._hidden.shape[-1])
        with torch.autocast(self._hidden.device.type, enabled=False):
            z = _chunk_logits(h, self._weight.to(dtype), self._bias, self.temperature, dtype)
        return z.reshape(*self.batch_shape, z.shape[-1])

    @property
    def logits(self) -> Tensor:
        """Tempered logits ``(hidden @ weight.T + bias) / temperature``, fp32 ``[..., T, V]`` (fp64 for fp64 inputs),
        at every position (masked ones included), with autograd.

        Computed on each access and not cached: this is the ``[..., T, V]`` tensor the class exists to avoid (so are
        ``probs``, ``masked_logits``, ``mode`` and ``sample``, inherited, which read it). The matmul runs in
        ``matmul_dtype`` with autocast off, as in the kernel. For the argmax of the *given* tokens (token accuracy)
        use ``log_prob_and_entropy(value, return_hits=True)``, which needs no extra LM-head pass.
        """
        return self._logits

    # --- scores (chunked kernel) -----------------------------------------------------------------------------------
    def log_prob(self, value: Tensor) -> Tensor:
        """``log p(value[..., t])`` at masked-in positions from the chunked LM head, 0.0 (no gradient) elsewhere.

        Args:
            value: ``[..., T]`` integer token ids (e.g. ``dist.tokens``). At masked positions any value is allowed;
                at masked-in positions it must lie in ``[0, V)``. Leading sample dims (``[S, ..., T]``) broadcast
                against the batch shape (the hidden states are then expanded, i.e. copied, per sample).

        Returns:
            fp32 ``[..., T]`` (broadcast shape of ``value`` and the batch shape), differentiable w.r.t. the hidden
            states and the head.

        Raises:
            ValueError: float/bool values, a shape that does not broadcast, or an id outside ``[0, V)`` at a
                masked-in position (the message names the first such position; inside a training step,
                :func:`~lit_llm.policy.deferred.deferred_checks`, raised at the step's one host read).
        """
        return self._score(value, "log_prob", entropy=False, hits=False)

    def entropy(self) -> Tensor:
        """Entropy ``-sum_v p_v log p_v`` of each masked-in position's distribution, fp32 ``[..., T]``; 0.0 (no
        gradient) at masked positions. One chunked LM-head pass over the masked-in positions."""
        targets = torch.zeros(self.batch_shape, dtype=torch.long, device=self._hidden.device)
        return self._score(targets, "entropy", entropy=True, hits=False)[1]

    def log_prob_and_entropy(self, value: Tensor, *, return_hits: bool = False
                             ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
        """:meth:`log_prob` and :meth:`entropy` (and the token accuracy) in **one** chunked LM-head pass.

        What a training step calls: ``lp, ent, hits = dist.log_prob_and_entropy(dist.tokens, return_hits=True)``.

        Args:
            value: ``[..., T]`` integer token ids, as for :meth:`log_prob`.
            return_hits: also return ``hits``: bool ``[..., T]``, True where ``value`` is the argmax of the tempered
                logits (greedy decoding would have produced it), False at masked positions. It comes from the same
                chunks (no second LM-head pass) and carries no gradient; ``hits.sum() / mask.sum()`` is the token
                accuracy.

        Returns:
            ``(log_prob, entropy)`` or ``(log_prob, entropy, hits)``; ``log_prob`` and ``entropy`` fp32 ``[..., T]``
            (0.0 and no gradient at masked positions), as :meth:`log_prob` and :meth:`entropy` return them.

        Raises:
            ValueError: see :meth:`log_prob`.
        """
        return self._score(value, "log_prob_and_entropy", entropy=True, hits=return_hits)

    # --- internals ------------------------------------------------------------------------------------------------
    def _mm_dtype(self) -> torch.dtype:
        if self.matmul_dtype is not None:
            return self.matmul_dtype
        return torch.promote_types(torch.promote_types(self._hidden.dtype, self._weight.dtype), torch.float32)

    def _score(self, value: Tensor, name: str, *, entropy: bool, hits: bool):
        if not isinstance(value, Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool \
                or value.dtype.is_complex:
            raise ValueError(
                f"{_NAME}.{name}: value must be an integer tensor of token ids [..., T] (torch.long, e.g. dist.tokens);"
                f" got {getattr(value, 'dtype', type(value).__name__)}."
            )
        try:
            shape = torch.broadcast_shapes(value.shape, self.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"{_NAME}.{name}: value shape {tuple(value.shape)} does not broadcast to the batch shape "
                f"{tuple(self.batch_shape)} (= hidden.shape[:-1]); pass ids aligned with the mask (dist.tokens)."
            ) from None
        mask = self._mask.expand(shape)
        value = value.to(self._hidden.device).expand(shape).long()
        bad = mask & ((value < 0) | (value >= self.num_classes))

        def out_of_vocabulary() -> ValueError:
            pos = tuple(int(i) for i in bad.nonzero()[0])
            return ValueError(
                f"{_NAME}.{name}: value at masked-in position {pos} is {int(value[pos])}, outside the vocabulary "
                f"[0, {self.num_classes}). Use ignore_index ({self.ignore_index}) only where mask is False."
            )

        check_value(bad.any(), out_of_vocabulary)  # inside a training step: read with the step's one host read
        hidden = self._hidden
        if shape != self.batch_shape:
            hidden = hidden.expand(*shape, hidden.shape[-1])
        targets = value.masked_fill(~mask | bad, IGNORE_INDEX)  # a deferred bad id is not scored meanwhile
        return chunked_token_log_probs(
            hidden, self._weight, targets, bias=self._bias, temperature=self.temperature, chunk_size=self.chunk_size,
            return_entropy=entropy, matmul_dtype=self.matmul_dtype, return_hits=hits,
        )

    def __repr__(self) -> str:
        return (f"{_NAME}(hidden: {tuple(self._hidden.shape)} {self._hidden.dtype}, vocab: {self.num_classes}, "
                f"mask: {int(self._mask.sum())}/{self._mask.numel()} positions, temperature={self.temperature}, "
                f"chunk_size={self.chunk_size}, ignore_index={self.ignore_index})")


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
