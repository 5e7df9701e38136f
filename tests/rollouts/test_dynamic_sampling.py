"""Dynamic sampling (DAPO): informative groups, the kept batch (rows exact, advantages recomputed over it, groups
renumbered, zero-std fill when the rounds run out), RolloutBatch.cat, and the seeds of extra rounds."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.rollouts import RolloutBatch
from lit_llm.rollouts.dynamic_sampling import informative_groups, select_groups
from lit_llm.rollouts.engine import mix_seed, row_seeds

G = 2
PAD = 0


def make_batch(prompts: list[list[int]], completions: list[list[int]], rewards: list[float], tag: str) -> RolloutBatch:
    """``len(prompts)`` groups of ``G`` rows; the log-probs of a row are ``-0.1 * (its token ids)`` (recognisable)."""
    n = len(completions)
    comps = [torch.tensor(c) for c in completions]
    return RolloutBatch.from_rows(
        prompts=[torch.tensor(p) for p in prompts], prompt_index=[i // G for i in range(n)], completions=comps,
        old_log_probs=[-0.1 * c.float() for c in comps], reward=torch.tensor(rewards),
        advantage=torch.full((n,), 9.0), truncated=[False] * n, group=[i // G for i in range(n)], policy_version=3,
        pad_token_id=PAD, rewards={"r": torch.tensor(rewards)}, sample_id=[f"{tag}{i // G}" for i in range(n)],
        completion=[f"{tag}-row{i}" for i in range(n)], generation_time=1.5, reward_time=0.25)


def rows_of(b: RolloutBatch) -> list[tuple[list[int], list[int], list[float], float, str]]:
    """Each row as (prompt ids, completion ids, old log-probs, reward, completion text): real tokens only."""
    out = []
    for i, full in enumerate(b.full_rows()):
        p = int(b.prompt_lengths[i])
        c = int(b.completion_lengths[i])
        out.append((full[:p].tolist(), full[p:].tolist(), b.old_log_probs[i, :c].tolist(), float(b.reward[i]),
                    b.completion[i]))
    return out


def test_informative_groups_is_unequal_rewards_per_group():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.25, 0.25, 2.0, 2.0 + 1e-12])
    assert informative_groups(r, 2).tolist() == [False, True, False, False]  # 1e-12 apart counts as equal
    assert informative_groups(r, 4).tolist() == [True, True]
    with pytest.raises(ValueError, match="multiple of num_generations=3"):
        informative_groups(r, 3)


def test_cat_keeps_every_row_exactly_and_offsets_prompts_and_groups():
    a = make_batch([[5, 6, 7], [8]], [[11, 12], [13], [14, 15, 16], [17]], [0.0, 1.0, 1.0, 1.0], "a")
    b = make_batch([[9, 9, 9, 9, 9]], [[21], [22, 23, 24, 25]], [0.5, 0.0], "b")
    c = RolloutBatch.cat([a, b])
    assert rows_of(c) == rows_of(a) + rows_of(b)
    assert c.prompt_index.tolist() == [0, 0, 1, 1, 2, 2] and c.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert c.prompt_ids.shape == (3, 5) and c.completion_ids.shape == (6, 4)
    assert c.prompt_mask.sum(-1).tolist() == [3, 1, 5] and not c.prompt_mask[:, 0].tolist()[0]  # left padding
    assert c.sample_id == ["a0", "a0", "a1", "a1", "b0", "b0"]
    assert c.generation_time == 3.0 and c.reward_time == 0.5
    with pytest.raises(ValueError, match="at least one batch"):
        RolloutBatch.cat([])


def test_select_groups_keeps_informative_groups_first_and_recomputes_advantages():
    # round 0: groups [1, 1] (zero std), [0, 1] (kept); round 1: [2, 2] (zero std), [0.5, 0] (kept), [3, 1] (kept)
    r0 = make_batch([[5], [6]], [[10], [11], [12], [13]], [1.0, 1.0, 0.0, 1.0], "x")
    r1 = make_batch([[7], [8], [9]], [[20], [21], [22], [23], [24], [25]], [2.0, 2.0, 0.5, 0.0, 3.0, 1.0], "y")
    out = select_groups([r0, r1], 2, G, scale_rewards="batch")
    # the first two informative groups in the order drawn: x1 (round 0), then y1 (round 1)
    assert out.sample_id == ["x1", "x1", "y1", "y1"]
    assert rows_of(out) == [rows_of(r0)[2], rows_of(r0)[3], rows_of(r1)[2], rows_of(r1)[3]]
    assert out.group.tolist() == [0, 0, 1, 1]
    # advantages over the kept rows: centred per group, divided by the std of the 4 kept rewards (unbiased) + 1e-4
    kept = [0.0, 1.0, 0.5, 0.0]
    mean = sum(kept) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in kept) / 3)
    expected = [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.25 / (std + 1e-4), -0.25 / (std + 1e-4)]
    assert out.advantage.tolist() == pytest.approx(expected, rel=1e-6)
    assert out.frac_reward_zero_std == pytest.approx(2 / 5)  # of the 5 groups drawn
    assert out.generation_time == 3.0 and out.reward_time == 0.5


def test_select_groups_fills_with_zero_std_groups_when_the_rounds_run_out():
    r0 = make_batch([[5], [6], [7]], [[10], [11], [12], [13], [14], [15]], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], "x")
    out = select_groups([r0], 3, G, scale_rewards="group")
    assert out.sample_id == ["x1", "x1", "x0", "x0", "x2", "x2"]  # the informative group, then zero-std in order
    # per-group std: [0, 1] -> -+0.7071 / (0.7071 + 1e-4); zero-std groups exactly 0
    s = math.sqrt(0.5)
    assert out.advantage.tolist() == pytest.approx([-0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0, 0, 0, 0], rel=1e-6)
    assert out.frac_reward_zero_std == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="3 groups drawn, fewer than the 4"):
        select_groups([r0], 4, G, scale_rewards="group")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2 * G, max_size=8 * G).filter(
    lambda r: len(r) % G == 0), min_size=1, max_size=3), st.integers(1, 4))
def test_select_groups_property_rows_come_from_the_drawn_groups(rounds, want):
    batches = [make_batch([[7 + i, k + 1] for k in range(len(r) // G)], [[100 * i + j + 1] for j in range(len(r))], r,
                          f"r{i}-") for i, r in enumerate(rounds)]
    drawn = sum(len(r) // G for r in rounds)
    if drawn < want:
        return
    out = select_groups(batches, want, G, scale_rewards="batch")
    assert out.num_rows == want * G and out.group.tolist() == [k // G for k in range(want * G)]
    flags = [informative_groups(b.reward, G) for b in batches]
    n_inf = sum(int(f.sum()) for f in flags)
    kept = informative_groups(out.reward, G)
    assert int(kept.sum()) == min(n_inf, want)  # as many informative groups as exist, up to the batch size
    assert kept.tolist() == sorted(kept.tolist(), reverse=True)  # informative ones first
    every_row = [row for b in batches for row in rows_of(b)]
    assert all(row in every_row for row in rows_of(out))
    assert len({(s, c) for s, c in zip(out.sample_id, out.completion)}) == want * G  # no row twice
    assert out.frac_reward_zero_std == pytest.approx(1 - n_inf / drawn)


def test_row_seeds_round_zero_unchanged_later_rounds_differ():
    base = mix_seed(5, 7, 0)
    assert row_seeds(5, 7, 0, 3, 4, 0).tolist() == row_seeds(5, 7, 0, 3, 4).tolist()
    r0, r1, r2 = (set(row_seeds(5, 7, 0, 3, 4, k).tolist()) for k in (0, 1, 2))
    assert not (r0 & r1) and not (r1 & r2) and not (r0 & r2)
    assert base >= 0


def test_select_groups_keeps_the_rollouts_device_whatever_the_default_device():
    # issue 28: the group ids are made on the rollout's device (the meta device stands in for a default CUDA device)
    r0 = make_batch([[5], [6]], [[10], [11], [12], [13]], [1.0, 1.0, 0.0, 1.0], "x")
    with torch.device("meta"):
        out = select_groups([r0], 2, G, scale_rewards="group")
    assert out.group.device.type == "cpu" and out.group.tolist() == [0, 0, 1, 1]
