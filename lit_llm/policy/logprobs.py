"""Memory-lean per-token log-probs: log-softmax + gather over the LM head, computed in chunks of positions.

The naive way to score a batch, ``log_softmax(model(ids).logits).gather(-1, targets)``, materialises fp32 logits of
shape ``[B, T, V]`` (8 x 512 x 49,152 x 4 bytes = 805 MB for SmolLM2) and autograd keeps several such tensors for the
backward pass. :func:`chunked_token_log_probs` instead applies the LM head to ``chunk_size`` rows of the final hidden
states at a time, keeps only the per-row log-sum-exp, and *recomputes* each chunk's logits in the backward pass
(the same recompute trick as Liger-Kernel's fused linear cross-entropy and torchtune's chunked cross-entropy). Extra
memory is about ``chunk_size * V * 4`` bytes per buffer whatever ``B * T`` is.

Maths (per row with logits ``z = (h W^T + b) / tau``, ``lse = logsumexp(z)``, ``p = softmax(z)``, target ``y``):

- ``log p(y) = z_y - lse``; ``d log p(y) / dz = onehot(y) - p``.
- entropy ``H = lse - sum_j p_j z_j``; ``dH / dz_k = -p_k (log p_k + H)``.
- ``dz/dh = W / tau``, ``dz/dW = h / tau`` (outer product), ``dz/db = 1 / tau``.

Hidden states aligned to the tokens they predict come from :func:`token_hidden_states` (full rows, either padding
side) and :func:`completion_hidden_states` (the GRPO prompt/completion layout, prompts shared through a KV cache);
:func:`model_token_log_probs` and :func:`completion_log_probs` are those plus the kernel, giving ``log_probs.full`` of
DESIGN.md property 4: ``out[:, t] = log p(x_t | x_<t)``, 0.0 at each row's first real token and at padding. The
masked distributions of the log-prob version (:class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical`) run
the same kernel on the same aligned hidden states.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_llm.policy.generation import cache_kwarg, pad_rows

__all__ = ["IGNORE_INDEX", "chunked_token_log_probs", "completion_hidden_states", "completion_log_probs",
           "model_token_log_probs", "naive_token_log_probs", "token_hidden_states"]

IGNORE_INDEX = -100
"""Target value that is not scored: its log-prob (and entropy) is 0.0 and it gets no gradient."""


def _check_scalars(temperature: float, chunk_size: int) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0 (1.0 = the model's distribution); got {temperature!r}.")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 (hidden-state rows per LM-head chunk); got {chunk_size!r}.")


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, dtype: torch.dtype) -> Tensor:
    """fp32 logits ``[C, V]`` of one chunk of rows ``h: [C, H]``; the matmul runs in ``dtype``."""
    h = h.to(dtype)
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias.to(dtype), h, weight.t())
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Autograd function over the *valid* rows: ``h [N, H]``, ``y [N]`` (all targets in ``[0, V)``).

    Saves only ``h``, ``weight``, ``bias``, ``y`` and the per-row ``lse`` / entropy; recomputes logits in backward.
    Returns ``(log_probs [N], entropy [N] or [0], hits [N] or [0])``; ``hits`` (bool, non-differentiable) is
    ``argmax(z) == y``, taken from the same ``z.max(1)`` that stabilises the log-sum-exp.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, temperature, chunk_size, want_entropy, mm_dtype, want_hits):
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=h.device)
        hits = torch.empty(n if want_hits else 0, dtype=torch.bool, device=h.device)
        w = weight.to(mm_dtype)  # no copy when already in mm_dtype
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                z = _chunk_logits(h[s:e], w, bias, temperature, mm_dtype)
                target_logit = z.gather(1, y[s:e, None]).squeeze(1)
                if want_hits:
                    m, arg = z.max(1, keepdim=True)  # max and argmax in one pass
                    hits[s:e] = arg.squeeze(1) == y[s:e]
                else:
                    m = z.amax(1, keepdim=True)
                z.sub_(m)  # z' = z - max, in place
                if want_entropy:
                    pz = torch.exp(z) * z  # sum_j e^{z'_j} z'_j (second buffer only when entropy is asked)
                    sum_pz = pz.sum(1)
                    del pz
                z.exp_()
                sum_exp = z.sum(1)
                del z
                lse[s:e] = m.squeeze(1) + sum_exp.log()
                logp[s:e] = target_logit - lse[s:e]
                if want_entropy:
                    # H = lse - sum p z = log(sum e^{z'}) - sum e^{z'} z' / sum e^{z'}
                    ent[s:e] = sum_exp.log() - sum_pz / sum_exp
        ctx.save_for_backward(h, weight, bias, y, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.mm_dtype = temperature, chunk_size, mm_dtype
        ctx.want_entropy = want_entropy
        ctx.set_materialize_grads(False)  # unused outputs (e.g. entropy) get None, not a zero tensor
        ctx.mark_non_differentiable(hits)
        return logp, ent, hits

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_hits):
        h, weight, bias, y, lse, ent = ctx.saved_tensors
        tau, chunk_size, mm_dtype = ctx.temperature, ctx.chunk_size, ctx.mm_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        use_ent = ctx.want_entropy and g_ent is not None
        n = h.shape[0]
        acc = torch.promote_types(mm_dtype, torch.float32)  # dtype of the per-chunk logits and gradients
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=acc, device=h.device)
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=h.device) if need_b else None
        w = weight.to(mm_dtype)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                gl = g_logp[s:e, None].to(acc)
                z = _chunk_logits(h[s:e], w, bias, tau, mm_dtype)
                z.sub_(lse[s:e, None])  # log p
                if use_ent:
                    p = torch.exp(z)
                    # dL/dz = -p * (g_logp + g_ent * (log p + H)) + g_logp * onehot(y)
                    z.add_(ent[s:e, None]).mul_(g_ent[s:e, None].to(acc)).add_(gl).mul_(p).neg_()
                    del p
                else:
                    z.exp_().mul_(-gl)  # -p * g_logp
                z.scatter_add_(1, y[s:e, None], gl)
                if tau != 1.0:
                    z.div_(tau)
                gz = z.to(mm_dtype)  # no copy unless the matmuls run in a lower precision
                if need_h:
                    grad_h[s:e] = torch.mm(gz, w)
                if need_w:
                    h_c = h[s:e].to(mm_dtype)
                    if mm_dtype == acc:
                        grad_w.addmm_(gz.t(), h_c)
                    else:
                        grad_w.add_(torch.mm(gz.t(), h_c))
                if need_b:
                    grad_b.add_(z.sum(0))
                del z, gz
        return (
            grad_h.to(h.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None, None, None, None, None, None,
        )


def chunked_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
    ignore_index: int = IGNORE_INDEX,
    return_hits: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Per-position log-prob of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``, in chunks.

    ``hidden[..., t, :]`` scores ``targets[..., t]``: callers shift (for a causal LM, ``hidden[:, :-1]`` scores
    ``input_ids[:, 1:]``). The ``B * T`` rows are flattened; rows whose target is ``ignore_index`` are dropped before
    any work (so padding costs nothing) and get 0.0. The remaining rows are processed ``chunk_size`` at a time: the
    chunk's logits are computed, upcast to fp32, reduced to a log-sum-exp and the target logit, and freed. The backward
    pass recomputes each chunk's logits (one extra LM-head matmul) instead of keeping ``[B, T, V]`` activations, so the
    extra memory is about ``chunk_size * V * 4`` bytes (two such buffers when the entropy needs a gradient), plus an
    fp32 ``[V, H]`` accumulator for the weight gradient. Autocast is disabled inside; the result is fp32 regardless
    of the input dtype (e.g. bf16 hidden states from a ``bf16-mixed`` backbone).

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype), e.g. ``[B, T, H]``.
        weight: ``[V, H]`` LM-head weight (``model.get_output_embeddings().weight``).
        targets: ``[...]`` long token ids in ``[0, V)`` or ``ignore_index``; same leading shape as ``hidden``.
        bias: optional ``[V]`` LM-head bias.
        temperature: logits are divided by it (> 0), as in sampling; the log-probs are those of the full
            temperature-scaled distribution.
        chunk_size: rows per chunk (>= 1). Peak extra memory scales with ``chunk_size * V``.
        return_entropy: also return the entropy ``-sum_v p_v log p_v`` of each row's distribution (with gradient).
        matmul_dtype: dtype of the LM-head matmuls (forward and backward). ``None`` (default) = fp32 (fp64 if an
            input is fp64), the accurate choice for old/reference log-probs; ``torch.bfloat16`` is ~4x faster on
            AVX-512-BF16 CPUs at ~1e-2 absolute log-prob error. Softmax, log-sum-exp and all reductions are fp32
            either way.
        ignore_index: target value that is not scored (default -100).
        return_hits: also return ``hits``, bool ``[...]``: the target is the argmax of the (tempered) logits, i.e.
            greedy decoding would have produced it (a token accuracy). Computed inside the same chunk loop (the
            ``z.max(1)`` that stabilises the log-sum-exp gives the argmax), so it costs no extra LM-head pass. Ties
            go to the lowest id, as ``torch.argmax``. False where ``targets == ignore_index``; no gradient.

    Returns:
        ``log_probs``: fp32 ``[...]`` (same shape as ``targets``); ``(log_probs, entropy)`` when ``return_entropy``;
        ``(log_probs, hits)`` when ``return_hits``; ``(log_probs, entropy, hits)`` when both. ``log_probs`` and
        ``entropy`` are fp32 and 0.0 where ``targets == ignore_index``; ``hits`` is bool. Differentiable w.r.t.
        ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: shape mismatch between ``hidden``/``weight``/``targets``/``bias``, non-integer targets, a target
            outside ``[0, V)`` that is not ``ignore_index``, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    _check_scalars(temperature, chunk_size)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"chunked_token_log_probs: weight must be [V, H] with H = hidden.shape[-1]; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}. Pass model.get_output_embeddings().weight."
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"chunked_token_log_probs: targets must have hidden's leading shape {tuple(hidden.shape[:-1])}; got "
            f"{tuple(targets.shape)}. hidden[..., t, :] scores targets[..., t]: shift before calling."
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"chunked_token_log_probs: targets must be integer ids (torch.long); got {targets.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"chunked_token_log_probs: bias must be [V]={tuple(weight.shape[:1])} not {tuple(bias.shape)}")
    vocab = weight.shape[0]
    flat_y = targets.reshape(-1).long()
    valid = flat_y != ignore_index
    bad = valid & ((flat_y < 0) | (flat_y >= vocab))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise ValueError(
            f"chunked_token_log_probs: targets (flattened) position {pos} holds {int(flat_y[pos])}, outside the "
            f"vocabulary [0, {vocab}) and not ignore_index={ignore_index}. Mask such positions with {ignore_index}."
        )
    if matmul_dtype is None:
        mm_dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    else:
        mm_dtype = matmul_dtype
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    all_valid = bool(valid.all())
    idx = None if all_valid else valid.nonzero().squeeze(1)
    h_v = flat_h if all_valid else flat_h.index_select(0, idx)
    y_v = flat_y if all_valid else flat_y.index_select(0, idx)
    logp_v, ent_v, hits_v = _ChunkedTokenLogProbs.apply(
        h_v, weight, bias, y_v, float(temperature), chunk_size, return_entropy, mm_dtype, return_hits
    )

    def scatter(v: Tensor) -> Tensor:
        if all_valid:
            return v.reshape(targets.shape)
        out = torch.zeros(flat_y.shape[0], dtype=v.dtype, device=v.device)
        return out.index_copy(0, idx, v).reshape(targets.shape)

    out = (scatter(logp_v),)
    if return_entropy:
        out += (scatter(ent_v),)
    if return_hits:
        out += (scatter(hits_v),)
    return out[0] if len(out) == 1 else out


def naive_token_log_probs(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Reference: ``log_softmax(logits.float() / temperature).gather(-1, targets)`` on full logits (tests, benchmarks).

    Args:
        logits: ``[..., V]`` logits (any float dtype; upcast to fp32).
        targets: ``[...]`` long ids; ``ignore_index`` positions give 0.0.
        temperature: logits are divided by it (> 0).
        ignore_index: target value that is not scored.

    Returns:
        fp32 ``[...]`` log-probs. Materialises ``[..., V]`` fp32 log-softmax: use :func:`chunked_token_log_probs`
        outside tests.
    """
    _check_scalars(temperature, 1)
    valid = targets != ignore_index
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = logp.gather(-1, targets.masked_fill(~valid, 0).long().unsqueeze(-1)).squeeze(-1)
    return out.masked_fill(~valid, 0.0)


_UNSUPPORTED_HEAD_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _backbone_and_head(model, name: str = "model_token_log_probs"):
    """``(backbone, head)`` of an HF causal LM; raises when the head post-processes logits the kernel cannot mimic."""
    config = getattr(model, "config", None)
    for key in _UNSUPPORTED_HEAD_CONFIG:
        value = getattr(config, key, None)
        if value is not None and not (key == "logits_scaling" and value == 1.0):
            raise NotImplementedError(
                f"{name}: model.config.{key}={value!r} post-processes the logits, which the chunked "
                f"kernel does not do. Use naive_token_log_probs(model(...).logits, ...) for this model."
            )
    backbone = getattr(model, "model", None)
    if backbone is None and hasattr(model, "get_decoder"):
        backbone = model.get_decoder()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{name}: {type(model)._name__} must be an HF causal LM with a backbone (model.model or "
            f"model.get_decoder()) and a linear head (model.get_output_embeddings()); pass an AutoModelForCausalLM."
        )
    return backbone, head


def lm_head(model) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of an HF causal LM's output head, checked as the kernel needs it.

    Raises:
        ValueError: no backbone or linear head.
        NotImplementedError: the config post-processes logits (softcapping, logit scale).
    """
    _, head = _backbone_and_head(model, "lm_head")
    return head.weight, getattr(head, "bias", None)


def _check_mask(input_ids: Tensor, attention_mask: Tensor, name: str = "model_token_log_probs") -> Tensor:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"{name}: input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"{name}: input_ids must be integer ids (torch.long), got {input_ids.dtype}")
    mask = attention_mask.bool()
    # One contiguous block of 1s per row (left or right padding): at most one 0->1 rise, counting a 1 at t=0 as one.
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()
    if bool((rises > 1).any()):
        row = int((rises > 1).nonzero()[0])
        raise ValueError(
            f"{name}: attention_mask row {row} has holes (padding inside the sequence). Only left- or "
            f"right-padded rows (one contiguous block of 1s) are supported; re-pad the batch."
        )
    return mask


def _predicted(mask: Tensor) -> Tensor:
    """``[B, T]`` bool: real tokens with a real token before them (the positions that have a prediction)."""
    out = torch.zeros_like(mask)
    out[:, 1:] = mask[:, 1:] & mask[:, :-1]
    return out


def _run_backbone(backbone, ids: Tensor, mask: Tensor) -> Tensor:
    """Last hidden states ``[B, T, H]`` of left- or right-padded rows, positions from the mask, no cache."""
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    # padding ids are never read (masked out of attention and zeroed below), but the embedding still looks them up
    out = backbone(input_ids=ids.long().masked_fill(~mask, 0), attention_mask=mask.long(), position_ids=position_ids,
                   use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _align(hidden: Tensor, predicted: Tensor) -> Tensor:
    """Shift ``[B, T, H]`` right by one (``out[:, t] = hidden[:, t-1]``), zeros where nothing is predicted."""
    shifted = torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))  # one [B, T, H] copy; pad's backward is a slice
    return shifted.masked_fill_(~predicted.unsqueeze(-1), 0.0)


def token_hidden_states(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Final hidden states of an HF causal LM aligned to the tokens they predict: ``out[:, t]`` scores ``x_t``.

    Runs the backbone (``model.model`` or ``model.get_decoder()``, never the LM head) once with
    ``position_ids = attention_mask.cumsum(-1) - 1`` clamped at 0, so a padded row gets the positions of the unpadded
    row, and shifts its output right by one position. Feed the result to :func:`chunked_token_log_probs` with the
    head ``model.get_output_embeddings()`` and ``input_ids`` as targets to get ``log_probs.full``. Padding is read from
    ``attention_mask`` only, never from ids (SmolLM2's pad id equals its end-of-turn id); the ids at padding are never
    looked at. Keeps autograd (gradients reach the backbone's parameters when grad is enabled).

    Args:
        model: an HF ``*ForCausalLM`` (e.g. ``LlamaForCausalLM``).
        input_ids: ``[B, T]`` long token ids, left- **or** right-padded.
        attention_mask: ``[B, T]`` bool or 0/1 integers; 1 = real token; one contiguous block of 1s per row.

    Returns:
        ``[B, T, H]`` in the backbone's dtype: ``out[:, t]`` = backbone output at ``t - 1`` (the state that predicts
        ``input_ids[:, t]``) where ``x_t`` and ``x_{t-1}`` are both real tokens; zeros at ``t = 0``, at each row's
        first real token and at padding (positions with no prediction).

    Raises:
        ValueError: shapes differ / are not 2-D, float ids, a mask with holes, a model without backbone or head.
        NotImplementedError: the config post-processes logits (``final_logit_softcapping``, ``logit_scale``,
            ``logits_scaling`` != 1), which the kernel does not reproduce.
    """
    mask = _check_mask(input_ids, attention_mask, "token_hidden_states")
    backbone, _ = _backbone_and_head(model, "token_hidden_states")
    return _align(_run_backbone(backbone, input_ids, mask), _predicted(mask))


def model_token_log_probs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
    score_mask: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced ``log_probs.full`` of an HF causal LM without materialising ``[B, T, V]`` logits.

    :func:`token_hidden_states` (one backbone pass, positions from the mask) followed by
    :func:`chunked_token_log_probs` over the head ``model.get_output_embeddings()``. Padding is read from
    ``attention_mask`` only. Gradients flow to the model parameters when grad is enabled.

    Args:
        model: an HF ``*ForCausalLM`` (e.g. ``LlamaForCausalLM``).
        input_ids: ``[B, T]`` long token ids, left- or right-padded.
        attention_mask: ``[B, T]`` 0/1 (any int or bool dtype); 1 = real token; one contiguous block per row.
        temperature: the sampling temperature (> 0); log-probs are those of the full temperature-scaled distribution
            (DESIGN.md property 4), not renormalised after top-k/top-p.
        chunk_size: rows per LM-head chunk (see :func:`chunked_token_log_probs`).
        return_entropy: also return the per-position entropy of the predicting distribution.
        matmul_dtype: dtype of the LM-head matmul (``None`` = fp32; see :func:`chunked_token_log_probs`).
        score_mask: optional ``[B, T]`` bool: score only these positions (e.g. a GRPO completion mask); the LM head
            is applied there only, so prompt tokens cost the backbone alone (TRL's ``logits_to_keep``). Other
            positions are 0.0. ``None`` = every real token.

    Returns:
        fp32 ``[B, T]`` with ``out[:, t] = log p(x_t | x_<t)`` for every real token that has a real token before it
        (and is in ``score_mask`` when given); 0.0 at each row's first real token (position 0 of the unpadded row),
        at padding and outside ``score_mask``. With
        ``return_entropy``: ``(log_probs, entropy)``, the entropy at ``t`` being that of ``p(. | x_<t)``, zeroed alike.

    Raises:
        ValueError: shapes differ / are not 2-D, float ids, a mask with holes, bad temperature or chunk size, a model
            without backbone or head.
        NotImplementedError: the config post-processes logits (``final_logit_softcapping``, ``logit_scale``,
            ``logits_scaling`` != 1), which the kernel does not reproduce.
    """
    _check_scalars(temperature, chunk_size)
    mask = _check_mask(input_ids, attention_mask)
    backbone, head = _backbone_and_head(model)
    scored = _predicted(mask)
    if score_mask is not None:
        if score_mask.shape != input_ids.shape:
            raise ValueError(f"score_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(score_mask.shape)}.")
        scored = scored & score_mask.bool()
    hidden = _align(_run_backbone(backbone, input_ids, mask), scored)
    targets = input_ids.long().masked_fill(~scored, IGNORE_INDEX)
    return chunked_token_log_probs(
        hidden, head.weight, targets, bias=getattr(head, "bias", None), temperature=temperature,
        chunk_size=chunk_size, return_entropy=return_entropy, matmul_dtype=matmul_dtype,
    )


def _check_completion_inputs(name: str, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                             completion_mask: Tensor, prompt_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate the GRPO prompt/completion layout; returns ``(prompt_mask, completion_mask, prompt_index)`` as
    bool, bool, long."""
    n_rows, comp_len = completion_ids.shape if completion_ids.dim() == 2 else (-1, -1)
    if (prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or completion_ids.dim() != 2
            or completion_mask.shape != completion_ids.shape or prompt_index.shape != (n_rows,)):
        raise ValueError(
            f"{name}: expected prompt_ids/prompt_mask [P, Lp], completion_ids/completion_mask [N, Lc] "
            f"and prompt_index [N]; got {tuple(prompt_ids.shape)}, {tuple(prompt_mask.shape)}, "
            f"{tuple(completion_ids.shape)}, {tuple(completion_mask.shape)}, {tuple(prompt_index.shape)}.")
    for arg, value in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name}: {arg} must be integer token ids (torch.long), got {value.dtype}.")
    pmask = prompt_mask.bool()
    if prompt_ids.shape[1] == 0 or not bool(pmask[:, -1].all()) or bool((pmask[:, 1:] < pmask[:, :-1]).any()):
        raise ValueError(f"{name}: every prompt row must be non-empty and left-padded (its real tokens "
                         "end at the last column); re-pad the prompts on the left.")
    cmask = completion_mask.bool()
    if bool((cmask[:, 1:] > cmask[:, :-1]).any()):
        raise ValueError(f"{name}: completion_mask rows must be right-padded (1s then 0s); re-pad the "
                         "completions on the right.")
    if n_rows == 0 or comp_len == 0:
        raise ValueError(f"{name}: no completion to score (completion_ids "
                         f"{tuple(completion_ids.shape)}); give at least one row with at least one completion token.")
    if prompt_index.dtype.is_floating_point or prompt_index.dtype == torch.bool:
        raise ValueError(f"{name}: prompt_index must be integer row indices, got {prompt_index.dtype}.")
    index = prompt_index.long()
    if int(index.min()) < 0 or int(index.max()) >= prompt_ids.shape[0]:
        raise ValueError(f"{name}: prompt_index must lie in [0, {prompt_ids.shape[0]}); got values in "
                         f"[{int(index.min())}, {int(index.max())}].")
    return pmask, cmask, index


def completion_hidden_states(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    prompt_index: Tensor,
    *,
    share_prompts: bool = True,
) -> Tensor:
    """Final hidden states of ``N`` completions of ``P <= N`` prompts (a GRPO micro-batch), aligned to the completion.

    Row ``i`` is the sequence ``prompt_ids[prompt_index[i]]`` (real tokens) followed by ``completion_ids[i]`` (real
    tokens); ``out[i, t]`` is the state that predicts ``completion_ids[i, t]`` (for ``t = 0`` the last prompt token's
    output). Positions count from each row's first real prompt token, as in :func:`token_hidden_states`, so the
    numbers do not depend on padding. Feed it to :func:`chunked_token_log_probs` with ``completion_ids`` as targets.

    With ``share_prompts`` (default) each of the ``P`` prompts goes through the backbone **once**: its KV cache (which
    keeps its autograd history) is gathered to the ``N`` rows with ``prompt_index`` and only the completion tokens
    are run on top of it. A GRPO group is ``G`` completions of one prompt, so the backbone sees
    ``P * prompt + N * completion`` tokens instead of ``N * (prompt + completion)``. Values and gradients equal the
    full rows' up to float rounding: the shared prompt activations receive the sum of their rows' gradients, which is
    what the full rows' backward accumulates too. ``share_prompts=False`` runs the ``N`` full rows left-padded
    through :func:`token_hidden_states` (needed when the backbone keeps no cache, e.g. under gradient checkpointing
    in training mode).

    Args:
        model: an HF ``*ForCausalLM`` (its backbone must take a ``DynamicCache`` when ``share_prompts``).
        prompt_ids: ``[P, Lp]`` long, **left**-padded prompts (any padding id: padding is read from the masks).
        prompt_mask: ``[P, Lp]`` bool/0-1, 1 = real prompt token; every row non-empty and left-padded.
        completion_ids: ``[N, Lc]`` long, **right**-padded completions.
        completion_mask: ``[N, Lc]`` bool/0-1, 1 = real completion token (a prefix of each row).
        prompt_index: ``[N]`` long in ``[0, P)``, the prompt of each completion row.
        share_prompts: run each prompt through the backbone once (see above).

    Returns:
        ``[N, Lc, H]`` in the backbone's dtype, with autograd; zeros where ``completion_mask`` is 0.

    Raises:
        ValueError: shapes that do not line up, float ids, no completion token (``N == 0`` or
            ``Lc == 0``), a prompt row that is empty or not left-padded, a completion mask that is not right-padded,
            a non-integer ``prompt_index`` or one outside ``[0, P)``; a model without backbone or head.
        RuntimeError: ``share_prompts`` and the backbone returned no ``DynamicCache`` (gradient checkpointing in
            training mode turns caching off): pass ``share_prompts=False``.
        NotImplementedError: see :func:`token_hidden_states`.
    """
    return _completion_hidden_states("completion_hidden_states", model, prompt_ids, prompt_mask, completion_ids,
                                     completion_mask, prompt_index, share_prompts)


def _completion_hidden_states(name: str, model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                              completion_mask: Tensor, prompt_index: Tensor, share_prompts: bool) -> Tensor:
    pmask, cmask, index = _check_completion_inputs(name, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                   prompt_index)
    backbone, _ = _backbone_and_head(model, name)
    if not share_prompts:
        return _full_rows_completion_hidden(backbone, prompt_ids, pmask, completion_ids, cmask, index)
    comp_len = completion_ids.shape[1]
    # padding ids are never read (masked out of attention and scoring), but the embedding still looks them up
    prompt_ids, completion_ids = prompt_ids.long().masked_fill(~pmask, 0), completion_ids.long().masked_fill(~cmask, 0)
    p_pos = (pmask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=prompt_ids, attention_mask=pmask.long(), position_ids=p_pos, use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise RuntimeError(f"{name}: the backbone returned no DynamicCache (gradient checkpointing in "
                           "training mode turns caching off); pass share_prompts=False.")
    for layer in cache.layers:
        layer.batch_select_indices(index)
    last_prompt_hidden = out.last_hidden_state[:, -1]  # predicts each row's first completion token
    attn = torch.cat([pmask[index], cmask], 1).long()
    c_pos = pmask.long().sum(-1)[index, None] + torch.arange(comp_len, device=completion_ids.device)[None]
    hidden_c = backbone(input_ids=completion_ids, attention_mask=attn, position_ids=c_pos, use_cache=True,
                        **{cache_kwarg(backbone): cache}).last_hidden_state
    hidden = torch.cat([last_prompt_hidden[index, None].to(hidden_c.dtype), hidden_c[:, :-1]], 1)
    return hidden.masked_fill(~cmask.unsqueeze(-1), 0.0)


def _full_rows_completion_hidden(backbone, prompt_ids: Tensor, pmask: Tensor, completion_ids: Tensor, cmask: Tensor,
                                 index: Tensor) -> Tensor:
    """:func:`completion_hidden_states` without prompt sharing: left-pad the ``N`` full rows and run them."""
    p_len, c_len = pmask.sum(-1)[index], cmask.sum(-1)
    rows = [torch.cat([prompt_ids[j, prompt_ids.shape[1] - int(p_len[i]):], completion_ids[i, :int(c_len[i])]])
            for i, j in enumerate(index.tolist())]
    ids = pad_rows([r.long() for r in rows], 0)
    width = ids.shape[1]
    col = torch.arange(width, device=ids.device)[None]
    attn = col >= width - (p_len + c_len)[:, None]
    hidden = _align(_run_backbone(backbone, ids, attn), _predicted(attn))
    # back to the completion layout: row i's completion occupies the last c_len[i] columns
    gather = (width - c_len[:, None] + torch.arange(cmask.shape[1], device=ids.device)[None]).clamp(max=width - 1)
    out = hidden.gather(1, gather.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return out.masked_fill(~cmask.unsqueeze(-1), 0.0)


def completion_log_probs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    prompt_index: Tensor,
    *,
    share_prompts: bool = True,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced log-probs of ``N`` completions of ``P <= N`` prompts (a GRPO micro-batch), completions only.

    :func:`completion_hidden_states` (prompts shared through a KV cache by default, see there) followed by
    :func:`chunked_token_log_probs` on the completion tokens only (the LM head never runs on prompt positions, like
    TRL's ``logits_to_keep``). Positions count from each row's first real prompt token, so the numbers do not depend
    on padding, and they equal the full rows' ``model(ids).logits`` log-probs (values and gradients) in both modes.

    Args:
        model: an HF ``*ForCausalLM`` (its backbone must take a ``DynamicCache`` when ``share_prompts``).
        prompt_ids: ``[P, Lp]`` long, **left**-padded prompts (any padding id: padding is read from the masks).
        prompt_mask: ``[P, Lp]`` bool/0-1, 1 = real prompt token; every row non-empty and left-padded.
        completion_ids: ``[N, Lc]`` long, **right**-padded completions.
        completion_mask: ``[N, Lc]`` bool/0-1, 1 = real completion token (a prefix of each row).
        prompt_index: ``[N]`` long in ``[0, P)``, the prompt of each completion row.
        share_prompts: run each prompt through the backbone once; ``False`` scores the full left-padded rows (needed
            under gradient checkpointing in training mode, which turns the cache off).
        temperature, chunk_size, return_entropy, matmul_dtype: see :func:`model_token_log_probs`.

    Returns:
        fp32 ``[N, Lc]`` with ``out[i, t] = log p(c_t | prompt, c_<t)``, 0.0 where ``completion_mask`` is 0; with
        ``return_entropy``, ``(log_probs, entropy)`` alike.

    Raises:
        ValueError: see :func:`completion_hidden_states`; bad temperature or chunk size.
        RuntimeError: ``share_prompts`` and the backbone returned no ``DynamicCache``: pass ``share_prompts=False``.
    """
    _check_scalars(temperature, chunk_size)
    hidden = _completion_hidden_states("completion_log_probs", model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, prompt_index, share_prompts)
    weight, bias = lm_head(model)
    targets = completion_ids.long().masked_fill(~completion_mask.bool(), IGNORE_INDEX)
    return chunked_token_log_probs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size,
                                   return_entropy=return_entropy, matmul_dtype=matmul_dtype)
