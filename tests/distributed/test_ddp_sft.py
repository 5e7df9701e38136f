"""SFT under 2-process DDP (gloo, CPU) through the real ``lit-llm`` CLI, with the tiny model.

One reference run (27 samples, 4 per rank per step: the dataset is not divisible by world size x batch, so the last
step of each epoch gives rank 0 two samples and rank 1 one), its repeat with the same seed, and a run stopped at
step 3 and resumed with ``--ckpt_path last``. Every rank records what it trained on and its weights' hash after
every step (tests/distributed/ddp_probe.py).
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

pytestmark = pytest.mark.slow

NUM_SAMPLES, BATCH, STEPS = 27, 4, 6
STEPS_PER_EPOCH = NUM_SAMPLES // (2 * BATCH) + 1  # 3 full steps + 1 step of 3 samples (2 on rank 0, 1 on rank 1)
ARGS = ("--trainer.max_steps", str(STEPS), "--data.num_samples", str(NUM_SAMPLES), "--data.batch_size", str(BATCH),
        "--data.micro_batch_size", "2", "--data.eval_limit", "7", "--trainer.val_check_interval", "3",
        "--samples.num_samples", "1", "--checkpoint.every_n_train_steps", "3")


def _make_run(name: str, root: Path) -> DDPRun:
    if name == "resumed":
        launch(root, "sft_tiny.yaml", *ARGS, "--trainer.max_steps", "3")
        return launch(root, "sft_tiny.yaml", *ARGS, "--ckpt_path", "last")
    return launch(root, "sft_tiny.yaml", *ARGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("ddp_sft"), _make_run)


@pytest.mark.timeout(240)
def test_sft_ddp_exits_zero_and_weights_identical_on_every_step(runs):
    run = runs.get("a")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    assert [s["global_step"] for s in run.ranks[0]["steps"]] == list(range(1, STEPS + 1))
    assert_checkpoints_written_by_rank_zero_only(run)
    assert "epoch=0-step=3.ckpt" in run.ranks[0]["checkpoint_writes"]


@pytest.mark.timeout(60)
def test_sft_ddp_ranks_see_distinct_shards_and_uneven_last_step(runs):
    r0, r1 = (r["steps"] for r in runs.get("a").ranks)
    for a, b in zip(r0, r1):
        assert not set(a["sample_ids"]) & set(b["sample_ids"]), (a["global_step"], a["sample_ids"], b["sample_ids"])
    epoch0 = [s for a, b in zip(r0[:STEPS_PER_EPOCH], r1[:STEPS_PER_EPOCH]) for s in a["sample_ids"] + b["sample_ids"]]
    counts = Counter(epoch0)
    assert len(counts) == NUM_SAMPLES and set(counts.values()) == {1}  # every sample once per epoch, on one rank
    sizes = sorted((len(a["sample_ids"]), len(b["sample_ids"])) for a, b in zip(r0[:STEPS_PER_EPOCH],
                                                                               r1[:STEPS_PER_EPOCH]))
    assert sizes == [(2, 1), (4, 4), (4, 4), (4, 4)]  # the uneven last step: 2 samples on rank 0, 1 on rank 1


@pytest.mark.timeout(60)
def test_sft_ddp_logged_token_count_is_sum_over_ranks(runs):
    run = runs.get("a")
    per_rank = [[s["tokens"] for s in r["steps"]] for r in run.ranks]
    expected = [a + b for a, b in zip(*per_rank)]
    assert run.metrics("train/step_tokens") == expected
    cumulative = [sum(expected[: i + 1]) for i in range(len(expected))]
    assert run.metrics("train/tokens") == cumulative
    assert per_rank[0] != per_rank[1]  # the ranks really counted different tokens


@pytest.mark.timeout(240)
def test_sft_ddp_same_seed_same_weights(runs):
    a, b = runs.get("a"), runs.get("b")
    assert_clean_exit(b)
    assert [s["hash"] for s in a.ranks[0]["steps"]] == [s["hash"] for s in b.ranks[0]["steps"]]
    assert a.metrics("train/loss") == b.metrics("train/loss")


@pytest.mark.timeout(300)
def test_sft_ddp_resume_from_last_checkpoint(runs):
    a, resumed = runs.get("a"), runs.get("resumed")
    assert_clean_exit(resumed)
    assert_same_weights_every_step(resumed)
    assert [s["global_step"] for s in resumed.ranks[0]["steps"]] == [4, 5, 6]  # exactly the remaining steps
    for r in range(2):  # the same data, in the same order, on the same rank
        got = [s["sample_ids"] for s in resumed.ranks[r]["steps"]]
        assert got == [s["sample_ids"] for s in a.ranks[r]["steps"][3:]]
    assert resumed.ranks[0]["final_hash"] == a.ranks[0]["final_hash"]
    assert resumed.metrics("train/loss", version=1) == pytest.approx(a.metrics("train/loss")[3:], rel=1e-6)
