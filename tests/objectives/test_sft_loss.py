"""Supervised loss heads: masks, hand-computed losses, step normalisation (property 6), KL, non-finite guard."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.objectives import NonFiniteLossError, check_finite, loss_mask, sft_loss

# Two rows aligned to tokens.full [B=2, T=6]; row 1 is left-padded by 2.
ATTN = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
RESPONSE = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
ASSISTANT = torch.tensor([[0, 0, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
LOG_PROBS = torch.tensor([[0.0, -0.5, -1.0, -1.5, -2.0, -2.5], [0.0, 0.0, 0.0, -0.2, -0.4, -0.6]])


def masks():
    return dict(attention_mask=ATTN, assistant_mask=ASSISTANT, response_mask=RESPONSE)


def test_loss_mask_per_head():
    assert loss_mask("generic", **masks()).tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert loss_mask("sft", **masks()).tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert loss_mask("rlhf", **masks()).tolist() == [[0, 0, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert loss_mask("generic", **masks()).dtype == torch.bool


def test_loss_mask_drops_first_attended_and_padding():
    # A response mask that (wrongly) covers padding and the first attended token: neither has a prediction.
    resp = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert loss_mask("sft", attention_mask=ATTN, response_mask=resp).tolist() == [
        [0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
    ]


@pytest.mark.parametrize(
    ("head", "reduction", "expected"),
    [
        # generic: row0 nll 0.5+1+1.5+2+2.5 = 7.5 over 5 tokens, row1 0.2+0.4+0.6 = 1.2 over 3 tokens.
        ("generic", "token_mean", 8.7 / 8),
        ("generic", "sequence_mean", (7.5 / 5 + 1.2 / 3) / 2),  # 0.95
        ("generic", "sum", 8.7),
        # sft: row0 2+2.5 = 4.5 (2 tokens), row1 1.2 (3 tokens).
        ("sft", "token_mean", 5.7 / 5),
        ("sft", "sequence_mean", (4.5 / 2 + 1.2 / 3) / 2),  # 1.325
        # rlhf: row0 1+2+2.5 = 5.5 (3 tokens), row1 1.2 (3 tokens).
        ("rlhf", "token_mean", 6.7 / 6),
        ("rlhf", "sum", 6.7),
    ],
)
def test_sft_loss_hand_values(head, reduction, expected):
    loss, metrics = sft_loss(LOG_PROBS, loss_mask(head, **masks()), reduction=reduction)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(expected, abs=1e-6)
    assert "kl" not in metrics


def test_sft_metrics_counts():
    _, m = sft_loss(LOG_PROBS, loss_mask("sft", **masks()))
    assert m["num_tokens"].item() == 5
    assert m["num_sequences"].item() == 2
    assert m["normalizer"].item() == 5
    assert m["nll_sum"].item() == pytest.approx(5.7, abs=1e-6)


def test_two_micro_batches_equal_single_batch():
    mask = loss_mask("generic", **masks())  # 5 tokens in row 0, 3 in row 1
    lp = LOG_PROBS.clone().requires_grad_(True)
    full, _ = sft_loss(lp, mask)
    full.backward()
    g_full = lp.grad.clone()
    lp.grad = None
    parts = [sft_loss(lp[i : i + 1], mask[i : i + 1], normalizer=8)[0] for i in range(2)]
    assert parts[0].item() == pytest.approx(7.5 / 8, abs=1e-6)
    assert parts[1].item() == pytest.approx(1.2 / 8, abs=1e-6)
    total = parts[0] + parts[1]
    total.backward()
    assert total.item() == pytest.approx(1.0875, abs=1e-6)
    # The mean of per-micro-batch means would be (1.5 + 0.4) / 2 = 0.95: not the step's token mean.
    assert abs(total.item() - 0.95) > 0.1
    torch.testing.assert_close(lp.grad, g_full, atol=1e-6, rtol=0)
    # Each masked token gets gradient -1/8; unmasked 0.
    assert lp.grad.tolist() == [[0.0] + [-0.125] * 5, [0.0, 0.0, 0.0, -0.125, -0.125, -0.125]]


def test_sequence_mean_with_global_sequence_count():
    mask = loss_mask("generic", **masks())
    parts = [
        sft_loss(LOG_PROBS[i : i + 1], mask[i : i + 1], reduction="sequence_mean", normalizer=2)[0] for i in (0, 1)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(0.95, abs=1e-6)


def test_kl_to_reference():
    mask = loss_mask("generic", **masks())
    loss, m = sft_loss(LOG_PROBS, mask, ref_log_probs=LOG_PROBS.clone(), kl_coef=0.5)
    assert m["kl"].item() == 0.0
    assert loss.item() == pytest.approx(1.0875, abs=1e-6)
    # ref = logp - 1 on every token: k3 = exp(-1) - (-1) - 1 = exp(-1) = 0.36787944.
    loss, m = sft_loss(LOG_PROBS, mask, ref_log_probs=LOG_PROBS - 1.0, kl_coef=0.5)
    assert m["kl"].item() == pytest.approx(0.36787944, abs=1e-6)
    assert loss.item() == pytest.approx(1.0875 + 0.5 * 0.36787944, abs=1e-6)
    # ref = logp + 1: k3 = exp(1) - 1 - 1 = 0.71828183 > 0.
    _, m = sft_loss(LOG_PROBS, mask, ref_log_probs=LOG_PROBS + 1.0)
    assert m["kl"].item() == pytest.approx(0.71828183, abs=1e-6)


def test_kl_ignores_garbage_at_padding():
    mask = loss_mask("generic", **masks())
    ref = LOG_PROBS.clone()
    ref[1, 0] = float("inf")
    lp = LOG_PROBS.clone()
    lp[1, 1] = float("-inf")
    lp.requires_grad_(True)
    loss, m = sft_loss(lp, mask, ref_log_probs=ref, kl_coef=1.0)
    loss.backward()
    assert m["kl"].item() == 0.0
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(head="sft", attention_mask=ATTN), "response_mask"),
        (dict(head="rlhf", attention_mask=ATTN), "assistant_mask"),
        (dict(head="prompt", attention_mask=ATTN), "Unknown loss head 'prompt'"),
        (dict(head="sft", attention_mask=ATTN, response_mask=RESPONSE[:, :5]), "response_mask has shape"),
    ],
)
def test_loss_mask_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        loss_mask(**kwargs)


def test_loss_mask_rejects_float_mask():
    with pytest.raises(TypeError, match="attention_mask must be torch.bool"):
        loss_mask("generic", attention_mask=ATTN.float())


def test_sft_loss_errors():
    mask = loss_mask("generic", **masks())
    with pytest.raises(ValueError, match="mask selects no token"):
        sft_loss(LOG_PROBS, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        sft_loss(LOG_PROBS, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="normalizer=3 is smaller than this micro-batch's own count 8"):
        sft_loss(LOG_PROBS, mask, normalizer=3)
    with pytest.raises(ValueError, match="Unknown reduction 'mean'"):
        sft_loss(LOG_PROBS, mask, reduction="mean")
    with pytest.raises(ValueError, match="normalizer must be None with reduction='sum'"):
        sft_loss(LOG_PROBS, mask, reduction="sum", normalizer=8)
    with pytest.raises(ValueError, match="mask has shape"):
        sft_loss(LOG_PROBS, mask[:, :5])
    with pytest.raises(TypeError, match="log_probs must be a floating-point"):
        sft_loss(LOG_PROBS.long(), mask)


def test_check_finite():
    check_finite(torch.tensor(1.5), step=3, sample_ids=[1, 2])
    with pytest.raises(NonFiniteLossError, match=r"Loss is nan at step 7 for the batch with sample ids \[11, 42\]"):
        check_finite(torch.tensor(float("nan")), step=7, sample_ids=torch.tensor([11, 42]))
    with pytest.raises(NonFiniteLossError, match=r"Loss is inf at step 0 .*\[a, b\]"):
        check_finite(float("inf"), step=0, sample_ids=["a", "b"])
    with pytest.raises(ValueError, match="scalar loss"):
        check_finite(torch.ones(2), step=0)


@st.composite
def batches(draw):
    b = draw(st.integers(2, 6))
    t = draw(st.integers(2, 8))
    rows = []
    for _ in range(b):
        row = draw(st.lists(st.booleans(), min_size=t, max_size=t))
        row[draw(st.integers(1, t - 1))] = True  # at least one trainable token, never needed at position 0
        rows.append(row)
    vals = draw(st.lists(st.floats(-8.0, 0.0, width=32), min_size=b * t, max_size=b * t))
    split = draw(st.integers(1, b - 1))
    return torch.tensor(vals).reshape(b, t), torch.tensor(rows), split


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["token_mean", "sequence_mean"]))
def test_split_invariance(batch, reduction):
    lp, mask, split = batch
    full, m = sft_loss(lp, mask, reduction=reduction)
    norm = m["normalizer"]
    a, _ = sft_loss(lp[:split], mask[:split], reduction=reduction, normalizer=norm)
    b, _ = sft_loss(lp[split:], mask[split:], reduction=reduction, normalizer=norm)
    assert math.isclose((a + b).item(), full.item(), rel_tol=1e-5, abs_tol=1e-5)
