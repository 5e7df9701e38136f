"""The chunked kernel reuses one logits buffer for every chunk of a pass (issue 31: a fresh ``[C, V]`` tensor per
chunk cost ~1 s of page faults per 4,096-row forward + backward on a CPU): every chunk writes the same memory, and the
results equal, bit for bit, those of fresh per-chunk tensors (the ``out=None`` path)."""

from __future__ import annotations

import pytest
import torch

from lit_llm.policy import kernel
from lit_llm.policy.logprobs import chunked_token_log_probs


def run(hidden, weight, bias, targets, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    lp, ent, hits = chunked_token_log_probs(h, w, targets, bias=b, return_entropy=True, return_hits=True, **kw)
    (lp.sum() * 0.3 + ent.sum() * 0.7).backward()
    return [lp, ent, hits, h.grad, w.grad] + ([] if b is None else [b.grad])


@pytest.mark.parametrize("matmul_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_buffer_per_pass_and_the_same_numbers_as_fresh_chunks(monkeypatch, matmul_dtype, with_bias):
    g = torch.Generator().manual_seed(3)
    rows, vocab, chunk = 23, 300, 8  # chunks of 8, 8, 7 rows
    hidden, weight = torch.randn(rows, 16, generator=g), torch.randn(vocab, 16, generator=g) * 0.3
    bias = torch.randn(vocab, generator=g) if with_bias else None
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::4] = -100  # 17 scored rows: chunks of 8, 8, 1
    real = kernel._chunk_logits
    seen: list[tuple[int, int]] = []

    def recording(h, weight, bias, temperature, dtype, out=None):
        z = real(h, weight, bias, temperature, dtype, out=out)
        seen.append((h.shape[0], out.data_ptr()))
        assert z.data_ptr() == out.data_ptr() and z.dtype == torch.float32
        return z

    monkeypatch.setattr(kernel, "_chunk_logits", recording)
    reused = run(hidden, weight, bias, targets, chunk_size=chunk, temperature=0.7, matmul_dtype=matmul_dtype)
    assert [n for n, _ in seen] == [8, 8, 1, 8, 8, 1]  # forward, then the backward's recompute
    assert len({p for _, p in seen[:3]}) == 1 and len({p for _, p in seen[3:]}) == 1

    monkeypatch.setattr(kernel, "_chunk_logits", lambda h, w, b, t, d, out=None: real(h, w, b, t, d))
    fresh = run(hidden, weight, bias, targets, chunk_size=chunk, temperature=0.7, matmul_dtype=matmul_dtype)
    for a, b in zip(reused, fresh, strict=True):
        assert torch.equal(a, b)


def test_buffer_rows_are_the_chunk_or_fewer():
    w = torch.zeros(50, 4)
    assert kernel._logits_buffer(3, 8, w, torch.float32).shape == (3, 50)
    assert kernel._logits_buffer(20, 8, w, torch.bfloat16).shape == (8, 50)
    assert kernel._logits_buffer(20, 8, w, torch.bfloat16).dtype == torch.float32
    assert kernel._logits_buffer(0, 8, w.double(), torch.float64).shape == (0, 50)
