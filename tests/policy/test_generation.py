"""Tests of the KV-cache decoding loop's shared prefill (identical prompts prefilled once)."""

from __future__ import annotations

import torch

from lit_llm.policy.generation import generate_tokens, pad_rows, resolve_generation_config, unique_rows


def test_unique_rows_first_occurrence_and_inverse():
    rows = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6]), torch.tensor([0, 7]), torch.tensor([7])]
    ids = pad_rows(rows, 0)  # [0, 7] and [7] pad to the same ids but differ in length
    unique, inverse = unique_rows(ids, [r.numel() for r in rows])
    assert unique.tolist() == [0, 1, 3] and inverse.tolist() == [0, 1, 0, 2, 1]
    assert torch.equal(ids[unique][inverse], ids)
    unique, inverse = unique_rows(ids[:2], [2, 1])
    assert unique.tolist() == [0, 1] and inverse is None


def test_repeated_prompts_decode_like_single_prompts(tiny):
    """A GRPO-style batch [p, p, p, q, q, q] (prefilled once per distinct prompt) == decoding each prompt alone."""
    p, q = torch.tensor([1, 503, 2050, 17]), torch.tensor([44, 45])
    config = resolve_generation_config({"max_new_tokens": 6, "do_sample": False}, tiny)
    both = generate_tokens(tiny, [p, p, p, q, q, q], config)
    for rows, prompt in ((range(3), p), (range(3, 6), q)):
        alone = generate_tokens(tiny, [prompt], config)
        for r in rows:
            assert torch.equal(both.response_ids[r], alone.response_ids[0])
            torch.testing.assert_close(both.response_log_probs[r], alone.response_log_probs[0], rtol=1e-5, atol=1e-5)
