"""The GRPO objective honours the episode loss mask: environment ids (mask 0) inside a completion change nothing --
every loss type, GSPO's sequence ratio, the mismatch metrics, the rollout corrections, KL and entropy, the step
counts and the gradients equal those of the same rows with the environment ids cut out."""

from __future__ import annotations

import pytest
import torch

from lit_llm.objectives.grpo import LOSS_TYPES, GRPOObjective, grpo_loss


def episode_rows(seed: int = 0):
    """4 rows of sampled and environment segments; per-token tensors hold garbage (+-30) on environment ids."""
    g = torch.Generator().manual_seed(seed)
    layouts = [[("m", 3), ("e", 4), ("m", 2)], [("m", 5)], [("m", 1), ("e", 2), ("m", 2), ("e", 3), ("m", 4)],
               [("m", 2), ("e", 6), ("m", 1)]]
    width = max(sum(n for _, n in lay) for lay in layouts)
    b = len(layouts)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    for i, lay in enumerate(layouts):
        pos = 0
        for src, n in lay:
            loss_mask[i, pos:pos + n] = src == "m"
            pos += n
    values = {k: -torch.rand(b, width, generator=g) * 2 for k in ("log_probs", "old", "rollout", "ref")}
    values["entropy"] = torch.rand(b, width, generator=g) * 3
    for v in values.values():  # environment ids and padding: garbage that must never count
        v[~loss_mask] = torch.where(torch.rand(int((~loss_mask).sum()), generator=g) > 0.5, 30.0, -30.0)
    return loss_mask, values, torch.tensor([0.7, -1.2, 0.3, 0.9]), torch.tensor([False, False, True, False])


def compact(loss_mask, values):
    """The same rows with only their loss-masked positions, right-padded."""
    n = int(loss_mask.sum(-1).max())
    mask = torch.zeros(loss_mask.shape[0], n, dtype=torch.bool)
    out = {k: torch.zeros(loss_mask.shape[0], n) for k in values}
    for i in range(loss_mask.shape[0]):
        c = int(loss_mask[i].sum())
        mask[i, :c] = True
        for k, v in values.items():
            out[k][i, :c] = v[i][loss_mask[i]]
    return mask, out


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", ["none", "token_truncate", "sequence_mask"])
def test_environment_ids_change_nothing(loss_type, level, correction):
    loss_mask, values, adv, truncated = episode_rows()
    c_mask, c_values = compact(loss_mask, values)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28 if loss_type != "cispo" else 5.0,
              beta=0.04, entropy_coef=0.01, truncated=truncated, mask_truncated_completions=True,
              max_completion_length=32, rollout_correction=correction)
    results = []
    for mask, v in ((loss_mask, values), (c_mask, c_values)):
        lp = v["log_probs"].clone().requires_grad_(True)
        ent = v["entropy"].clone().requires_grad_(True)
        loss, metrics = grpo_loss(lp, v["old"], adv, mask, ref_log_probs=v["ref"], entropy=ent,
                                  rollout_log_probs=v["rollout"], **kw)
        loss.backward()
        results.append((loss, metrics, lp.grad, mask))
    (loss, metrics, grad, _), (c_loss, c_metrics, c_grad, _) = results
    assert torch.allclose(loss, c_loss, atol=1e-6)
    assert metrics.keys() == c_metrics.keys()
    for k in metrics:
        assert torch.allclose(metrics[k], c_metrics[k], atol=1e-6), k
    assert (grad[~loss_mask] == 0).all()
    for i in range(loss_mask.shape[0]):
        c = int(loss_mask[i].sum())
        assert torch.allclose(grad[i][loss_mask[i]], c_grad[i, :c], atol=1e-7)


def test_step_counts_count_sampled_ids_only():
    loss_mask, values, adv, truncated = episode_rows(1)
    c_mask, c_values = compact(loss_mask, values)
    for loss_type in LOSS_TYPES:
        obj = GRPOObjective(loss_type=loss_type, mask_truncated_completions=True, rollout_correction="token_mask",
                            epsilon_high=5.0 if loss_type == "cispo" else None)
        a = obj.local_count(loss_mask, truncated, values["old"], values["rollout"])
        b = obj.local_count(c_mask, truncated, c_values["old"], c_values["rollout"])
        assert int(a) == int(b)
    assert int(GRPOObjective().local_count(loss_mask)) == int(loss_mask.sum()) == 20
