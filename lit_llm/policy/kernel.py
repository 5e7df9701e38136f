"""The chunked LM-head kernel: per-token log-prob (and entropy) = log-softmax + gather over the LM head, computed in
chunks of positions, never ``[B, T, V]`` logits (DESIGN.md, Memory and speed).

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

Model-level callers (hidden states aligned to the tokens they predict, ``log_probs.full`` of DESIGN.md property 4)
live in :mod:`lit_llm.policy.logprobs`, which re-exports this module's public names.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_llm.policy.deferred import check_value

__all__ = ["IGNORE_INDEX", "chunked_token_log_probs", "naive_token_log_probs"]

IGNORE_INDEX = -100
"""Target value that is not scored: its log-prob (and entropy) is 0.0 and it gets no gradient."""


def _check_scalars(temperature: float, chunk_size: int) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0 (1.0 = the model's distribution); got {temperature!r}.")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 (hidden-state rows per LM-head chunk); got {chunk_size!r}.")


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, dtype: torch.dtype,
                  out: Tensor | None = None) -> Tensor:
    """fp32 logits ``[C, V]`` of one chunk of rows ``h: [C, H]``; the matmul runs in ``dtype``.

    ``out``: a buffer of at least ``C`` rows of ``[*, V]`` in the logits' dtype (``dtype`` promoted to fp32) whose
    first ``C`` rows are written and returned (the chunk loops reuse one buffer for every chunk: a fresh ``[C, V]``
    tensor per chunk costs a page fault per 4 KiB on a CPU, ~8% of a chunked forward + backward); ``None``: a new
    tensor."""
    h = h.to(dtype)
    acc = torch.promote_types(dtype, torch.float32)
    if out is not None and acc == dtype:
        z = out[:h.shape[0]]
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias.to(dtype), h, weight.t(), out=z)
    else:
        z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias.to(dtype), h, weight.t())
        z = z.to(acc) if out is None else out[:h.shape[0]].copy_(z)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _logits_buffer(n: int, chunk_size: int, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The one ``[min(n, chunk_size), V]`` logits buffer a chunk loop reuses (``dtype`` promoted to fp32)."""
    return torch.empty((min(n, chunk_size), weight.shape[0]), dtype=torch.promote_types(dtype, torch.float32),
                       device=weight.device)


#: Bytes of the row block :func:`_sum_exp_times` works through on a CPU (cache-sized: the block is exponentiated,
#: multiplied and summed while it is in cache, one buffer reused for every block).
ENTROPY_BLOCK_BYTES = 1 << 22


def _sum_exp_times(z: Tensor, buffer: Tensor | None = None) -> Tensor:
    """``(exp(z) * z).sum(1)`` of a chunk's shifted logits ``z: [C, V]`` (fp32 or fp64; not modified), the entropy's
    ``sum_j e^{z'_j} z'_j`` term, with one buffer instead of the formula's two ``[C, V]`` temporaries.

    On a CPU the rows go through one reused buffer in blocks of about :data:`ENTROPY_BLOCK_BYTES` (at least 2 rows,
    a trailing single row joined to the block before it): fresh ``[C, V]`` temporaries cost a page fault per 4 KiB
    and a trip to memory per pass, more than the arithmetic (issue 31: 0.35 s per 1,024 x 49,152 chunk, now 0.07
    s). Each row is reduced alone either way, so the values equal the whole-chunk ``(exp(z) * z).sum(1)`` bit for
    bit (a block of one row is reduced by another path, hence never one row unless ``C == 1``). Elsewhere (GPU) the
    buffer is the whole ``[C, V]`` chunk (three kernels; not run on a GPU yet).

    ``buffer``: a reusable :func:`_entropy_buffer` of a chunk at least as tall as ``z``
    (``None``: allocated here).

    Returns:
        ``[C]``, ``z``'s dtype.
    """
    n, v = z.shape
    rows = _entropy_block_rows(z)
    buf = buffer if buffer is not None else _entropy_buffer(z)
    out = torch.empty(n, dtype=z.dtype, device=z.device)
    s = 0
    while s < n:
        e = n if n - (s + rows) == 1 else min(s + rows, n)  # never leave a single row for the last block
        block = torch.exp(z[s:e], out=buf[:e - s])
        out[s:e] = block.mul_(z[s:e]).sum(1)
        s = e
    return out


def _entropy_block_rows(z: Tensor) -> int:
    """Rows of :func:`_sum_exp_times`' block for chunks like ``z: [C, V]`` (the whole chunk off the CPU)."""
    n, v = z.shape
    return max(2, ENTROPY_BLOCK_BYTES // (v * z.element_size())) if z.device.type == "cpu" else n


def _entropy_buffer(z: Tensor) -> Tensor:
    """The block buffer :func:`_sum_exp_times` works in for chunks like ``z: [C, V]`` (a block and the trailing row
    it may take: at most ``C`` rows)."""
    return torch.empty((min(_entropy_block_rows(z) + 1, z.shape[0]), z.shape[1]), dtype=z.dtype, device=z.device)


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
        zbuf = _logits_buffer(n, chunk_size, weight, mm_dtype)  # one [C, V] buffer for every chunk
        ebuf = _entropy_buffer(zbuf) if want_entropy else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                z = _chunk_logits(h[s:e], w, bias, temperature, mm_dtype, out=zbuf)
                target_logit = z.gather(1, y[s:e, None]).squeeze(1)
                if want_hits:
                    m, arg = z.max(1, keepdim=True)  # max and argmax in one pass
                    hits[s:e] = arg.squeeze(1) == y[s:e]
                else:
                    m = z.amax(1, keepdim=True)
                z.sub_(m)  # z' = z - max, in place
                if want_entropy:
                    sum_pz = _sum_exp_times(z, ebuf)  # sum_j e^{z'_j} z'_j (one reused buffer, z untouched)
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
        zbuf = _logits_buffer(n, chunk_size, weight, mm_dtype)  # reused by every chunk, as pbuf
        pbuf = torch.empty_like(zbuf) if use_ent else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                gl = g_logp[s:e, None].to(acc)
                z = _chunk_logits(h[s:e], w, bias, tau, mm_dtype, out=zbuf)
                z.sub_(lse[s:e, None])  # log p
                if use_ent:
                    p = torch.exp(z, out=pbuf[:e - s])
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
    chunk's logits are computed into one fp32 buffer that every chunk of the pass reuses, and reduced to a
    log-sum-exp and the target logit. The backward
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
            outside ``[0, V)`` that is not ``ignore_index``, ``temperature <= 0`` or ``chunk_size < 1``. Inside a
            training step (:func:`~lit_llm.policy.deferred.deferred_checks`) the target check is raised at the
            step's one host read, those targets left out meanwhile.

    Host syncs: the ``nonzero`` of the scored positions (outside a training step, one more for the target check).
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
    valid = (flat_y >= 0) & (flat_y < vocab) & (flat_y != ignore_index)  # the scored positions
    bad = ~valid & (flat_y != ignore_index)  # left out of the computation even when its error is deferred

    def out_of_vocabulary() -> ValueError:
        pos = int(bad.nonzero()[0])
        return ValueError(
            f"chunked_token_log_probs: targets (flattened) position {pos} holds {int(flat_y[pos])}, outside the "
            f"vocabulary [0, {vocab}) and not ignore_index={ignore_index}. Mask such positions with {ignore_index}."
        )

    check_value(bad.any(), out_of_vocabulary)  # inside a training step: read with the step's one host read
    if matmul_dtype is None:
        mm_dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    else:
        mm_dtype = matmul_dtype
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    idx = valid.nonzero().squeeze(1)  # the one host sync of a call (its size is the number of scored positions)
    all_valid = idx.numel() == flat_y.numel()
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
