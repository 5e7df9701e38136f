"""The SFT packer (lit_llm.data.packing): best-fit-decreasing packs, the packed collate and its inverse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.data.datasets import TokenizedExample, collate
from lit_llm.data.packing import best_fit_decreasing, collate_packed, is_packed, least_padding_packs, unpack_rows

PAD = 7


def sample(i: int, n: int, prompt: int) -> TokenizedExample:
    """Row ``i``: ``n`` ids ``1000*i + j`` (distinct across rows), the last ``n - prompt`` of them assistant /
    response tokens."""
    ids = 1000 * (i + 1) + torch.arange(n)
    resp = torch.arange(n) >= prompt
    return TokenizedExample(ids, resp.clone(), resp, ids[:prompt], f"f:{i}")


rows_strategy = st.integers(1, 40).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=1, max_size=12)))


@settings(max_examples=200, deadline=None)
@given(rows_strategy)
def test_best_fit_decreasing_places_every_row_once_within_capacity(case):
    cap, lengths = case
    packs = best_fit_decreasing(lengths, cap)
    placed = sorted(i for p in packs for i in p)
    assert placed == list(range(len(lengths)))  # every row exactly once, none split
    assert all(sum(lengths[i] for i in p) <= cap for p in packs)
    # best fit: no two packs could be merged when both are at most half full, and the count is within the bound
    # of any first-fit-like packer: fewer than twice the lower bound ceil(total / cap), plus one
    lower = -(-sum(lengths) // cap)
    assert lower <= len(packs) <= 2 * lower + 1
    halves = [p for p in packs if 2 * sum(lengths[i] for i in p) <= cap]
    assert len(halves) <= 1


def slots(packs, lengths):
    """Positions a right-padded [P, L] batch of these packs puts through the model."""
    return len(packs) * max(sum(lengths[i] for i in p) for p in packs)


@settings(max_examples=200, deadline=None)
@given(rows_strategy)
def test_least_padding_packs_never_pads_more_than_unpacked_or_bfd(case):
    cap, lengths = case
    packs = least_padding_packs(lengths, cap)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))  # every row once, none split
    assert all(p and sum(lengths[i] for i in p) <= cap for p in packs)
    assert slots(packs, lengths) <= len(lengths) * max(lengths)  # the unpacked micro-batch
    assert slots(packs, lengths) <= slots(best_fit_decreasing(lengths, cap), lengths)


def test_least_padding_packs_exact():
    # packs of 512: unpacked 8 x 200 = 1600 positions; bfd fills 490 + 510 + 80 (3 x 510 = 1530, 35% padding);
    # least padding deals them longest first to the shortest of 4 packs: 4 x 270 = 1080 positions, no padding
    lengths = [200, 190, 180, 170, 100, 90, 80, 70]
    assert [sum(lengths[i] for i in p) for p in best_fit_decreasing(lengths, 512)] == [490, 510, 80]
    assert least_padding_packs(lengths, 512) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert least_padding_packs([170] * 8, 512) == [[i] for i in range(8)]  # 4 x 340 ties 8 x 170: shorter wins
    assert least_padding_packs([2, 2, 2, 3, 3], 6) == [[3, 4], [0, 1, 2]]  # bfd's 2 x 6 beats LPT's 3 x 5


def test_best_fit_decreasing_exact_packs():
    # longest first: 6 opens pack 0 (room 4), 5 opens pack 1 (room 5), 4 -> pack 0 (room 0: the tightest fit),
    # 3 -> pack 1 (room 2), 2 -> pack 1 (room 0), 1 opens pack 2
    assert best_fit_decreasing([3, 6, 1, 5, 2, 4], 10) == [[1, 5], [3, 0, 4], [2]]
    assert best_fit_decreasing([4, 4, 4], 4) == [[0], [1], [2]]


@pytest.mark.parametrize("packer", [best_fit_decreasing, least_padding_packs])
@pytest.mark.parametrize("lengths, cap", [([3, 11], 10), ([0, 2], 10), ([2], 0)])
def test_packers_refuse_rows_they_cannot_place(packer, lengths, cap):
    with pytest.raises(ValueError, match="max_length|never split"):
        packer(lengths, cap)


@settings(max_examples=150, deadline=None)
@given(rows_strategy, st.data(), st.sampled_from(["least_padding", "bfd"]))
def test_collate_packed_layout(case, data, strategy):
    cap, lengths = case
    prompts = [data.draw(st.integers(0, n)) for n in lengths]
    samples = [sample(i, n, p) for i, (n, p) in enumerate(zip(lengths, prompts))]
    mb = collate_packed(samples, pad_token_id=PAD, max_length=cap, strategy=strategy)
    assert is_packed(mb)
    ids, attn, pos, rows = mb["input_ids"], mb["attention_mask"].bool(), mb["position_ids"], mb["row_index"]
    assert ids.shape[1] <= cap and mb["sample_ids"] == [s.sample_id for s in samples]
    assert ids.shape[1] == int(attn.sum(-1).max())  # padded to the longest pack only
    # right padding: the real tokens of each pack are one block from column 0
    assert torch.equal(attn, torch.arange(ids.shape[1])[None] < attn.sum(-1, keepdim=True))
    assert bool((ids[~attn] == PAD).all()) and bool((rows[~attn] == -1).all()) and bool((pos[~attn] == 0).all())
    for i, s in enumerate(samples):
        where = rows == i
        assert int(where.sum()) == len(s)  # every row exactly once ...
        assert int(where.any(-1).sum()) == 1  # ... in one pack, never split
        k = int(where.any(-1).nonzero())
        cols = where[k].nonzero().flatten()
        assert torch.equal(cols, torch.arange(int(cols[0]), int(cols[0]) + len(s)))  # contiguous
        assert torch.equal(ids[k, cols], s.input_ids)
        assert torch.equal(pos[k, cols], torch.arange(len(s)))  # position ids restart at 0 for every row
        assert torch.equal(mb["assistant_mask"][k, cols], s.assistant_mask)
        assert torch.equal(mb["response_mask"][k, cols], s.response_mask)
    # unpacking gives exactly the unpacked collate of the same rows
    plain = collate(samples, pad_token_id=PAD)
    for key, fill in (("input_ids", PAD), ("attention_mask", 0), ("assistant_mask", False),
                      ("response_mask", False)):
        assert torch.equal(unpack_rows(mb[key], mb["unpack_index"], mb["row_lengths"], fill=fill), plain[key]), key


def test_unpack_rows_trailing_dims_and_gradient():
    samples = [sample(0, 3, 1), sample(1, 2, 0), sample(2, 4, 2)]
    mb = collate_packed(samples, pad_token_id=PAD, max_length=5)
    # packs: [row 2 (4 tokens)], [row 0 (3), row 1 (2)]
    assert mb["row_index"].tolist() == [[2, 2, 2, 2, -1], [0, 0, 0, 1, 1]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    x = torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 5, 2).requires_grad_()
    out = unpack_rows(x, mb["unpack_index"], mb["row_lengths"], fill=-1.0)
    assert out.shape == (3, 4, 2)
    expected = torch.tensor([[[10, 11], [12, 13], [14, 15], [-1, -1]],
                             [[16, 17], [18, 19], [-1, -1], [-1, -1]],
                             [[0, 1], [2, 3], [4, 5], [6, 7]]], dtype=torch.float32)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad.tolist() == [[[1, 1]] * 4 + [[0, 0]], [[1, 1]] * 5]
    with pytest.raises(ValueError, match="unpack_index"):
        unpack_rows(x[:1], mb["unpack_index"], mb["row_lengths"])


def test_collate_packed_refuses_rows_longer_than_a_pack():
    with pytest.raises(ValueError, match="never split"):
        collate_packed([sample(0, 6, 1)], pad_token_id=PAD, max_length=5)
    with pytest.raises(ValueError, match="empty"):
        collate_packed([], pad_token_id=PAD, max_length=5)
    with pytest.raises(ValueError, match="strategy"):
        collate_packed([sample(0, 2, 1)], pad_token_id=PAD, max_length=5, strategy="wrapped")
