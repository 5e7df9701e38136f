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

:func:`model_token_log_probs` runs an HF causal LM's backbone once and feeds its last hidden states to the kernel,
giving ``log_probs.full`` of DESIGN.md property 4: ``out[:, t] = log p(x_t | x_<t)``, 0.0 at each row's first real
token and at padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_llm.policy.generation import cache_kwarg, pad_rows

__all__ = ["IGNORE_INDEX", "chunked_token_log_probs", "completion_log_probs", "model_token_log_probs",
           "naive_token_log_probs"]

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
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, temperature, chunk_size, want_entropy, mm_dtype):
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=h.device)
        w = weight.to(mm_dtype)  # no copy when already in mm_dtype
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                z = _chunk_logits(h[s:e], w, bias, temperature, mm_dtype)
                target_logit = z.gather(1, y[s:e, None]).squeeze(1)
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
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
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
            None, None, None, None, None,
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
) -> Tensor | tuple[Tensor, Tensor]:
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

    Returns:
        ``log_probs``: fp32 ``[...]`` (same shape as ``targets``); ``(log_probs, entropy)`` when ``return_entropy``,
        both fp32 ``[...]``, 0.0 where ``targets == ignore_index``. Differentiable w.r.t. ``hidden``, ``weight`` and
        ``bias``.

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
    logp_v, ent_v = _ChunkedTokenLogProbs.apply(
        h_v, weight, bias, y_v, float(temperature), chunk_size, return_entropy, mm_dtype
    )

    def scatter(v: Tensor) -> Tensor:
        if all_valid:
            return v.reshape(targets.shape)
        out = torch.zeros(flat_y.shape[0], dtype=torch.float32, device=v.device)
        return out.index_copy(0, idx, v).reshape(targets.shape)

    if return_entropy:
        return scatter(logp_v), scatter(ent_v)
    return scatter(logp_v)


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


def _backbone_and_head(model):
    config = getattr(model, "config", None)
    for name in _UNSUPPORTED_HEAD_CONFIG:
        value = getattr(config, name, None)
        if value is not None and not (name == "logits_scaling" and value == 1.0):
            raise NotImplementedError(
                f"model_token_log_probs: model.config.{name}={value!r} post-processes the logits, which the chunked "
                f"kernel does not do. Use naive_token_log_probs(model(...).logits, ...) for this model."
            )
    backbone = getattr(model, "model", None)
    if backbone is None and hasattr(model, "get_decoder"):
        backbone = model.get_decoder()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"model_token_log_probs: {type(model).__name__} must be an HF causal LM with a backbone (model.model or "
            f"model.get_decoder()) and a linear head (model.get_output_embeddings()); pass an AutoModelForCausalLM."
        )
    return backbone, head


def _check_mask(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"model_token_log_probs: input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"model_token_log_probs: input_ids must be integer ids (torch.long), got {input_ids.dtype}")
    mask = attention_mask.bool()
    # One contiguous block of 1s per row (left or right padding): at most one 0->1 rise, counting a 1 at t=0 as one.
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()
    if bool((rises > 1).any()):
        row = int((rises > 1).nonzero()[0])
        raise ValueError(
            f"model_token_log_probs: attention_mask row {row} has holes (padding inside the sequence). Only left- or "
            f"right-padded rows (one contiguous block of 1s) are supported; re-pad the batch."
        )
    return mask


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

    Runs the backbone (``model.model`` or ``model.get_decoder()``) with ``position_ids = attention_mask.cumsum(-1) - 1``
    clamped at 0 (so a left-padded row gets the same positions as the unpadded row), then
    :func:`chunked_token_log_probs` over the head ``model.get_output_embeddings()``. Padding is read from
    ``attention_mask`` only, never from ids (SmolLM2's pad id equals its end-of-turn id). Gradients flow to the model
    parameters when grad is enabled.

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
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    # hidden[:, t-1] predicts x_t; score x_t only if x_t and x_{t-1} are both real tokens.
    scored = mask[:, 1:] & mask[:, :-1]
    if score_mask is not None:
        if score_mask.shape != input_ids.shape:
            raise ValueError(f"score_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(score_mask.shape)}.")
        scored = scored & score_mask[:, 1:].bool()
    targets = input_ids[:, 1:].long().masked_fill(~scored, IGNORE_INDEX)
    res = chunked_token_log_probs(
        hidden[:, :-1], head.weight, targets, bias=getattr(head, "bias", None), temperature=temperature,
        chunk_size=chunk_size, return_entropy=return_entropy, matmul_dtype=matmul_dtype,
    )
    pad = torch.zeros(input_ids.shape[0], 1, dtype=torch.float32, device=input_ids.device)
    if return_entropy:
        return torch.cat([pad, res[0]], 1), torch.cat([pad, res[1]], 1)
    return torch.cat([pad, res], 1)


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

    Row ``i`` is the sequence ``prompt_ids[prompt_index[i]]`` (real tokens) followed by ``completion_ids[i]`` (real
    tokens); its completion tokens are scored, never its prompt tokens (the LM head runs on completion positions
    only, like TRL's ``logits_to_keep``). Positions count from each row's first real prompt token, as in
    :func:`model_token_log_probs`, so the numbers do not depend on padding.

    With ``share_prompts`` (default) each of the ``P`` prompts goes through the backbone **once**: its KV cache (which
    keeps its autograd history) is gathered to the ``N`` rows with ``prompt_index`` and only the completion tokens
    are run on top of it. A GRPO group is ``G`` completions of one prompt, so the backbone sees
    ``P * prompt + N * completion`` tokens instead of ``N * (prompt + completion)``. The log-probs and the gradients
    equal the full rows' up to float rounding: the shared prompt activations receive the sum of their rows'
    gradients, which is what the full rows' backward accumulates too. ``share_prompts=False`` scores the full
    left-padded rows with :func:`model_token_log_probs` (needed when the backbone keeps no cache, e.g. under gradient
    checkpointing in training mode).

    Args:
        model: an HF ``*ForCausalLM`` (its backbone must take a ``DynamicCache`` when ``share_prompts``).
        prompt_ids: ``[P, Lp]`` long, **left**-padded prompts (any padding id: padding is read from the masks).
        prompt_mask: ``[P, Lp]`` bool/0-1, 1 = real prompt token; every row non-empty and left-padded.
        completion_ids: ``[N, Lc]`` long, **right**-padded completions.
        completion_mask: ``[N, Lc]`` bool/0-1, 1 = real completion token (a prefix of each row).
        prompt_index: ``[N]`` long in ``[0, P)``, the prompt of each completion row.
        share_prompts: run each prompt through the backbone once (see above).
        temperature, chunk_size, return_entropy, matmul_dtype: see :func:`model_token_log_probs`.

    Returns:
        fp32 ``[N, Lc]`` with ``out[i, t] = log p(c_t | prompt, c_<t)``, 0.0 where ``completion_mask`` is 0; with
        ``return_entropy``, ``(log_probs, entropy)`` alike.

    Raises:
        ValueError: shapes that do not line up, no completion token (``N == 0`` or ``Lc == 0``), a prompt row that is
            empty or not left-padded, a completion mask that is not right-padded, a non-integer ``prompt_index`` or
            one outside ``[0, P)``; see also :func:`model_token_log_probs`.
        RuntimeError: ``share_prompts`` and the backbone returned no ``DynamicCache`` (gradient checkpointing in
            training mode turns caching off): pass ``share_prompts=False``.
    """
    _check_scalars(temperature, chunk_size)
    n_rows, comp_len = completion_ids.shape if completion_ids.dim() == 2 else (-1, -1)
    if (prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or completion_ids.dim() != 2
            or completion_mask.shape != completion_ids.shape or prompt_index.shape != (n_rows,)):
        raise ValueError(
            f"completion_log_probs: expected prompt_ids/prompt_mask [P, Lp], completion_ids/completion_mask [N, Lc] "
            f"and prompt_index [N]; got {tuple(prompt_ids.shape)}, {tuple(prompt_mask.shape)}, "
            f"{tuple(completion_ids.shape)}, {tuple(completion_mask.shape)}, {tuple(prompt_index.shape)}.")
    pmask = prompt_mask.bool()
    if prompt_ids.shape[1] == 0 or not bool(pmask[:, -1].all()) or bool((pmask[:, 1:] < pmask[:, :-1]).any()):
        raise ValueError("completion_log_probs: every prompt row must be non-empty and left-padded (its real tokens "
                         "end at the last column); re-pad the prompts on the left.")
    cmask = completion_mask.bool()
    if bool((cmask[:, 1:] > cmask[:, :-1]).any()):
        raise ValueError("completion_log_probs: completion_mask rows must be right-padded (1s then 0s); re-pad the "
                         "completions on the right.")
    if n_rows == 0 or comp_len == 0:
        raise ValueError(f"completion_log_probs: no completion to score (completion_ids "
                         f"{tuple(completion_ids.shape)}); give at least one row with at least one completion token.")
    if prompt_index.dtype.is_floating_point or prompt_index.dtype == torch.bool:
        raise ValueError(f"completion_log_probs: prompt_index must be integer row indices, got {prompt_index.dtype}.")
    index = prompt_index.long()
    if n_rows and (int(index.min()) < 0 or int(index.max()) >= prompt_ids.shape[0]):
        raise ValueError(f"completion_log_probs: prompt_index must lie in [0, {prompt_ids.shape[0]}); got values in "
                         f"[{int(index.min())}, {int(index.max())}].")
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy,
                  matmul_dtype=matmul_dtype)
    if not share_prompts:
        return _full_rows_completion_log_probs(model, prompt_ids, pmask, completion_ids, cmask, index, **kwargs)
    backbone, head = _backbone_and_head(model)
    # padding ids are never read (masked out of attention and scoring), but the embedding still looks them up
    prompt_ids, completion_ids = prompt_ids.masked_fill(~pmask, 0), completion_ids.masked_fill(~cmask, 0)
    p_pos = (pmask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=prompt_ids, attention_mask=pmask.long(), position_ids=p_pos, use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise RuntimeError("completion_log_probs: the backbone returned no DynamicCache (gradient checkpointing in "
                           "training mode turns caching off); pass share_prompts=False.")
    for layer in cache.layers:
        layer.batch_select_indices(index)
    last_prompt_hidden = out.last_hidden_state[:, -1]  # predicts each row's first completion token
    attn = torch.cat([pmask[index], cmask], 1).long()
    c_pos = pmask.long().sum(-1)[index, None] + torch.arange(comp_len, device=completion_ids.device)[None]
    hidden_c = backbone(input_ids=completion_ids, attention_mask=attn, position_ids=c_pos, use_cache=True,
                        **{cache_kwarg(backbone): cache}).last_hidden_state
    hidden = torch.cat([last_prompt_hidden[index, None].to(hidden_c.dtype), hidden_c[:, :-1]], 1)
    targets = completion_ids.long().masked_fill(~cmask, IGNORE_INDEX)
    return chunked_token_log_probs(hidden, head.weight, targets, bias=getattr(head, "bias", None), **kwargs)


def _full_rows_completion_log_probs(model, prompt_ids: Tensor, pmask: Tensor, completion_ids: Tensor, cmask: Tensor,
                                    index: Tensor, **kwargs) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`completion_log_probs` without prompt sharing: left-pad the ``N`` full rows and score them."""
    p_len, c_len = pmask.sum(-1)[index], cmask.sum(-1)
    rows = [torch.cat([prompt_ids[j, prompt_ids.shape[1] - int(p_len[i]):], completion_ids[i, :int(c_len[i])]])
            for i, j in enumerate(index.tolist())]
    ids = pad_rows(rows, 0)
    width = ids.shape[1]
    col = torch.arange(width, device=ids.device)[None]
    attn = col >= width - (p_len + c_len)[:, None]
    score = col >= width - c_len[:, None]
    res = model_token_log_probs(model, ids, attn, score_mask=score, **kwargs)
    # back to the completion layout: row i's completion occupies the last c_len[i] columns
    gather = (width - c_len[:, None] + torch.arange(cmask.shape[1], device=ids.device)[None]).clamp(max=width - 1)

    def to_completion(x: Tensor) -> Tensor:
        return x.gather(1, gather).masked_fill(~cmask, 0.0)

    return tuple(to_completion(x) for x in res) if isinstance(res, tuple) else to_completion(res)
