"""GRPO under 2-process DDP (gloo, CPU) through the real ``lit-llm`` CLI, with the tiny model.

The reference run skews generation per rank (tests/distributed/ddp_probe.py, ``skew_generation``): rank 0's
completions stop at their first token, rank 1's always run to ``max_new_tokens`` -- generation is per rank and
collective-free, so this must finish without a hang and keep the ranks in step. Its 21 training prompts do not fill
a whole number of steps of 2 prompts x 2 ranks, and its 5 evaluation prompts do not split evenly over the ranks.
Also: a repeat with the same seed, a run stopped at step 3 and resumed with ``--ckpt_path last``, the
asynchronous rollout mode (and its resume), and dynamic sampling with a reward informative on rank 0 only.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from ddp_launch import (
    DDPRun,
    RunCache,
    assert_checkpoints_written_by_rank_zero_only,
    assert_clean_exit,
    assert_same_weights_every_step,
    launch,
)

from lit_llm.rollouts.engine import mix_seed

NUM_TRAIN, PROMPTS, G, MAX_NEW, STEPS = 21, 2, 4, 24, 6
STEPS_PER_EPOCH = NUM_TRAIN // (2 * PROMPTS)  # 5; the 21st prompt of an epoch is dropped
ARGS = ("--trainer.max_steps", str(STEPS), "--data.num_train", str(NUM_TRAIN), "--data.num_eval", "5",
        "--data.batch_size", str(PROMPTS), "--model.num_generations", str(G), "--model.max_new_tokens", str(MAX_NEW),
        "--model.eval_max_new_tokens", "4", "--trainer.val_check_interval", "3", "--checkpoint.every_n_train_steps",
        "3", "--trainer.num_sanity_val_steps", "0")

# async with no stale drop (staleness is thread timing): every produced batch is trained, so runs compare exactly
ASYNC_NO_DROPS = ("--model.rollout_mode", "async", "--model.max_staleness", "100")


def _make_run(name: str, root: Path) -> DDPRun:
    if name == "resumed":
        launch(root, "grpo_tiny.yaml", *ARGS, "--trainer.max_steps", "3", skew_generation=True)
        return launch(root, "grpo_tiny.yaml", *ARGS, "--ckpt_path", "last", skew_generation=True)
    if name == "dynamic":
        rewards = str(Path(__file__).resolve().parent / "ddp_rewards.py") + ":rank0_parity_reward"
        return launch(root, "grpo_tiny.yaml", *ARGS, "--model.dynamic_sampling", "true",
                      "--model.max_sampling_rounds", "3", "--model.reward_funcs", f"[{rewards}]",
                      "--model.reward_weights", "null", "--model.eval_reward_funcs", "[strict_arithmetic_reward]")
    if name == "async_full":
        return launch(root, "grpo_tiny.yaml", *ARGS, *ASYNC_NO_DROPS)
    if name == "async_resumed":
        launch(root, "grpo_tiny.yaml", *ARGS, *ASYNC_NO_DROPS, "--trainer.max_steps", "3")
        return launch(root, "grpo_tiny.yaml", *ARGS, *ASYNC_NO_DROPS, "--ckpt_path", "last")
    if name == "async":
        return launch(root, "grpo_tiny.yaml", *ARGS, "--trainer.max_steps", "4", "--model.rollout_mode", "async",
                      "--model.max_staleness", "1")
    return launch(root, "grpo_tiny.yaml", *ARGS, skew_generation=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("ddp_grpo"), _make_run)


def test_sampling_seed_differs_per_rank_and_rank0_keeps_the_single_process_stream():
    seeds = {mix_seed(0, s, r) for s in range(50) for r in range(8)}
    assert len(seeds) == 400
    assert mix_seed(3, 5, 0) == 3 * 1_000_003 + 5 * 7919  # rank 0 = the single-process seed of before


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_ddp_skewed_generation_lengths_finish_with_identical_weights(runs):
    run = runs.get("a")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    assert [s["global_step"] for s in run.ranks[0]["steps"]] == list(range(1, STEPS + 1))
    r0, r1 = (r["steps"] for r in run.ranks)
    assert all(n == 1 for s in r0 for n in s["completion_lengths"])  # rank 0 stopped at once
    assert all(n == MAX_NEW for s in r1 for n in s["completion_lengths"])  # rank 1 ran to max_new_tokens
    assert all(s["truncated"] == [True] * len(s["truncated"]) for s in r1)
    assert_checkpoints_written_by_rank_zero_only(run)
    # rollout metrics are over both ranks' completions (not rank 0's alone)
    assert run.metrics("train/completions/mean_length") == [(1 + MAX_NEW) / 2] * STEPS
    assert run.metrics("train/completions/min_length") == [1.0] * STEPS
    assert run.metrics("train/completions/max_length") == [float(MAX_NEW)] * STEPS
    assert run.metrics("train/completions/clipped_ratio") == [0.5] * STEPS
    assert len(run.metrics("eval/strict_arithmetic_reward")) == 2  # greedy evaluation on uneven shards ran twice


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_grpo_ddp_prompt_shards_groups_and_seeds(runs):
    r0, r1 = (r["steps"] for r in runs.get("a").ranks)
    for a, b in zip(r0, r1):
        assert len(a["prompt_ids"]) == len(b["prompt_ids"]) == PROMPTS
        assert not set(a["prompt_ids"]) & set(b["prompt_ids"])
        assert a["seed"] != b["seed"]  # each rank samples from its own stream
        for s in (a, b):  # groups never split: each prompt's G rows are contiguous, on this rank, one group id
            assert s["sample_ids"] == [p for p in s["prompt_ids"] for _ in range(G)]
            assert s["groups"] == [k for k in range(PROMPTS) for _ in range(G)]
    epoch0 = Counter(p for s in r0[:STEPS_PER_EPOCH] + r1[:STEPS_PER_EPOCH] for p in s["prompt_ids"])
    assert len(epoch0) == NUM_TRAIN - 1 and set(epoch0.values()) == {1}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_grpo_ddp_logged_token_count_is_sum_over_ranks(runs):
    run = runs.get("a")
    per_rank = [[s["tokens"] for s in r["steps"]] for r in run.ranks]
    assert per_rank[0] == [PROMPTS * G * 1.0] * STEPS and per_rank[1] == [PROMPTS * G * MAX_NEW * 1.0] * STEPS
    assert run.metrics("train/step_tokens") == [a + b for a, b in zip(*per_rank)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_ddp_same_seed_same_run(runs):
    a, b = runs.get("a"), runs.get("b")
    assert_clean_exit(b)
    for r in range(2):
        assert [s["hash"] for s in a.ranks[r]["steps"]] == [s["hash"] for s in b.ranks[r]["steps"]]
        assert [s["completions"] for s in a.ranks[r]["steps"]] == [s["completions"] for s in b.ranks[r]["steps"]]
    assert a.metrics("train/loss") == b.metrics("train/loss")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_ddp_resume_from_last_checkpoint(runs):
    a, resumed = runs.get("a"), runs.get("resumed")
    assert_clean_exit(resumed)
    assert_same_weights_every_step(resumed)
    assert [s["global_step"] for s in resumed.ranks[0]["steps"]] == [4, 5, 6]
    for r in range(2):
        ref = a.ranks[r]["steps"][3:]
        got = resumed.ranks[r]["steps"]
        assert [s["prompt_ids"] for s in got] == [s["prompt_ids"] for s in ref]
        assert [s["completions"] for s in got] == [s["completions"] for s in ref]
        assert [s["hash"] for s in got] == [s["hash"] for s in ref]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_ddp_async_rollouts_finish_in_step(runs):
    run = runs.get("async")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    steps = run.ranks[0]["steps"]
    assert run.ranks[0]["global_step"] == run.ranks[1]["global_step"] == 4
    assert len(steps) == len(run.ranks[1]["steps"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grpo_ddp_async_resume_trains_the_uninterrupted_runs_prompts(runs):
    """Stopped at step 3 (each rank's producer a batch or two ahead) and resumed: every rank trains the prompts of the
    uninterrupted asynchronous run at steps 4-6, across the epoch boundary (5 steps per epoch); the checkpoint holds
    the position of the batches consumed, the same on both ranks."""
    full, resumed = runs.get("async_full"), runs.get("async_resumed")
    assert_clean_exit(resumed)
    assert [s["global_step"] for s in resumed.ranks[0]["steps"]] == [4, 5, 6]
    for r in range(2):
        assert [s["sample_ids"] for s in resumed.ranks[r]["steps"]] == [
            s["sample_ids"] for s in full.ranks[r]["steps"][3:]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_ddp_dynamic_sampling_ranks_draw_the_same_rounds(runs):
    # rank 1's groups are all zero-std, so it wants another round every step; rank 0 must draw with it (the loaders
    # stay in step) although its own groups are informative: 3 rounds, then 2 where the epoch runs out (below); no
    # hang, identical weights
    run = runs.get("dynamic")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    assert run.metrics("train/sampling_rounds") == [3.0, 2.0] * (STEPS // 2)
    r0, r1 = (r["steps"] for r in run.ranks)
    for steps in (r0, r1):
        for s in steps:
            assert len(s["sample_ids"]) == PROMPTS * G and s["groups"] == [k for k in range(PROMPTS) for _ in range(G)]
    # 5 prompt batches per epoch and 3 rounds per step: each epoch feeds 2 steps (3 + 2 batches, the second step's
    # third round finds the epoch used up); a step trains prompts of its own rounds only, never one twice in an epoch
    for steps in (r0, r1):
        for epoch in range(STEPS // 2):
            trained = [p for s in steps[2 * epoch:2 * epoch + 2] for p in dict.fromkeys(s["sample_ids"])]
            assert len(trained) == len(set(trained)) == 2 * PROMPTS
    # rank 1 found nothing: it trains its own first batch (zero-std fill, first-drawn first)
    assert all(list(dict.fromkeys(s["sample_ids"])) == s["prompt_ids"] for s in r1)
