"""The chunked kernel's entropy term in cache-sized row blocks (issue 31): the same numbers, bit for bit, as the
whole-chunk formula it replaced, and the log-probs the same with or without the entropy."""

from __future__ import annotations

import pytest
import torch

from lit_llm.policy import kernel
from lit_llm.policy.logprobs import chunked_token_log_probs


def whole_chunk_entropy(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The formula before issue 31, on one chunk: ``log(sum e^z') - sum(e^z' * z') / sum e^z'``, ``z' = z - max``."""
    z = torch.mm(hidden, weight.t())
    z = z - z.amax(1, keepdim=True)
    sum_pz = (torch.exp(z) * z).sum(1)
    sum_exp = torch.exp(z).sum(1)
    return sum_exp.log() - sum_pz / sum_exp


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 7, 10, 13])
def test_block_entropy_equals_whole_chunk_bit_for_bit(monkeypatch, threads, rows):
    # vocabulary above torch's 32,768-element grain: a one-row reduction then takes another (multi-thread) path
    vocab, blocks_of = 40_000, 3
    monkeypatch.setattr(kernel, "ENTROPY_BLOCK_BYTES", blocks_of * vocab * 4)  # blocks of 3 rows: 10 = 3 + 3 + 4
    g = torch.Generator().manual_seed(rows)
    hidden, weight = torch.randn(rows, 8, generator=g), torch.randn(vocab, 8, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lp, ent = chunked_token_log_probs(hidden, weight, targets, chunk_size=16, return_entropy=True)
        lp_only = chunked_token_log_probs(hidden, weight, targets, chunk_size=16)
        expected = whole_chunk_entropy(hidden, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ent, expected)
    assert torch.equal(lp, lp_only)


def test_sum_exp_times_leaves_its_input_and_never_a_single_row_block(monkeypatch):
    monkeypatch.setattr(kernel, "ENTROPY_BLOCK_BYTES", 2 * 5 * 4)  # 2 rows of 5 fp32 values per block
    z = torch.arange(15, dtype=torch.float32).reshape(3, 5) / -10  # shifted logits (<= 0)
    seen = []
    real_exp = torch.exp

    def exp(x, *, out):
        seen.append(x.shape[0])
        return real_exp(x, out=out)

    monkeypatch.setattr(kernel.torch, "exp", exp)
    out = kernel._sum_exp_times(z)
    assert seen == [3]  # 2 rows + the trailing single row joined to them
    assert torch.equal(z, torch.arange(15, dtype=torch.float32).reshape(3, 5) / -10)
    assert torch.equal(out, (real_exp(z) * z).sum(1))
