"""The design card is the path that runs: counters on tiny SFT and GRPO fits through the CLI with the shipped configs
(no extra flags but a shorter run) show the log-prob version's masked distributions built and scored, the callback
switching versions, and (GRPO) the generate version called by rollout workers through the threaded batcher; the
synchronous GRPO config is bit-reproducible with the batcher on."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest
import torch

from lit_llm.lightning.cli import main
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.policy.batching import BatchingMixin
from lit_llm.policy.masked_dist import ChunkedLLMMaskedCategorical
from lit_llm.policy.transformers_wrapper import TransformersWrapper

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def counters(monkeypatch):
    """Count calls on the design card's objects (wrapping, not replacing, the real methods)."""
    counts: Counter = Counter()

    def spy(cls, name, key=None, when=None):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            if when is None or when(self, args, kwargs):
                counts[key or name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for head in ("get_dist", "get_sft_dist", "get_rlhf_dist", "get_generic_dist"):
        spy(TransformersWrapper, head, when=lambda self, a, k: not self.generate)
    spy(ChunkedLLMMaskedCategorical, "__init__", "dist_built")
    spy(ChunkedLLMMaskedCategorical, "log_prob_and_entropy", "dist_scored")
    spy(TransformersWrapper, "forward", "generate_version_calls", when=lambda self, a, k: self.generate)
    spy(BatchingMixin, "_run_maybe_batched", "batched_generate_calls",
        when=lambda self, a, k: self._batcher is not None and getattr(self, "generate", False))
    spy(PolicyVersionSwitch, "generating", "switch_to_generate")
    spy(PolicyVersionSwitch, "on_train_batch_start", "callback_batch_start")
    spy(PolicyVersionSwitch, "rollout", "rollouts")
    return counts


def test_sft_fit_scores_the_log_prob_versions_distributions(tmp_path, counters):
    cli = main(["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path),
                "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--samples.num_samples", "1"])
    assert cli.trainer.global_step == 2
    versions = cli.model.versions
    assert isinstance(versions, PolicyVersionSwitch) and versions in cli.trainer.callbacks
    # configs/sft_tiny.yaml: head "sft", 2 micro-batches per step -> get_sft_dist per micro-batch (+ validation)
    assert counters["get_sft_dist"] >= 4 and counters["dist_built"] == counters["get_sft_dist"]
    assert counters["dist_scored"] == counters["dist_built"]
    assert counters["switch_to_generate"] >= 1 and versions.num_greedy_calls >= 1  # ValidationSamples, greedy
    assert counters["rollouts"] == 0


def test_trainer_callbacks_cannot_drop_the_version_switch(tmp_path, counters):
    cli = main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path),
                "--trainer.max_steps", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.callbacks+",
                "lightning.pytorch.callbacks.LearningRateMonitor"])
    assert any(isinstance(c, PolicyVersionSwitch) for c in cli.trainer.callbacks)
    assert counters["callback_batch_start"] == 1 and counters["rollouts"] == 1


def _losses(root: Path) -> list[str]:
    with open(root / "csv" / "version_0" / "metrics.csv") as f:
        return [r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")]


REWARD_MODULE = """
def even_ids(completion_ids, **kwargs):
    \"\"\"A reward the random tiny model earns sometimes: the fraction of even completion ids.\"\"\"
    return [sum(i % 2 == 0 for i in c) / max(1, len(c)) for c in completion_ids]
"""


def test_grpo_fit_rollouts_through_the_batcher_and_bit_reproducible(tmp_path, counters, monkeypatch):
    rollouts: list[list] = [[], []]
    original = PolicyVersionSwitch.rollout
    run = {"i": 0}

    def keep(self, batch, step):
        r = original(self, batch, step)
        rollouts[run["i"]].append(r)
        return r

    monkeypatch.setattr(PolicyVersionSwitch, "rollout", keep)
    (tmp_path / "even_rewards.py").write_text(REWARD_MODULE)  # rewards that vary: losses and gradients are not 0
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = []
    for i in range(2):
        run["i"] = i
        cli = main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir",
                    str(tmp_path / str(i)), "--trainer.max_steps", "3", "--trainer.num_sanity_val_steps", "0",
                    "--model.init_args.reward_funcs", "[even_rewards:even_ids]",
                    "--model.init_args.reward_weights", "null"])
        modules.append(cli.model)
    engine = modules[0].engine
    # configs/grpo_tiny.yaml: 4 prompts x 4 generations, batching on, one worker per prompt group
    assert engine.batching and engine.num_workers is None
    state = engine.batched_policy(4, group_size=4).get_batching_state()  # rows: each prompt once, 4 samples each
    assert state["batches_run"] == 3 and state["rows_run"] == 12  # one shared forward batch per rollout
    assert engine.num_policy_calls == 3 * 4  # 4 workers per rollout
    assert counters["batched_generate_calls"] == 2 * 3 * 4  # both runs: every worker call went through the batcher
    # the loss reads the log-prob version's distributions: one per micro-batch (16 rows, micro_batch_size 8)
    assert counters["get_dist"] >= 2 * 3 * 2 and counters["dist_scored"] >= 2 * 3 * 2
    # bit for bit: rollouts, losses, weights
    assert len(rollouts[0]) == len(rollouts[1]) == 3
    for a, b in zip(*rollouts):
        for key in ("prompt_ids", "completion_ids", "completion_mask", "old_log_probs", "reward", "advantage"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
    losses = _losses(tmp_path / "0")
    assert losses == _losses(tmp_path / "1") and len(losses) == 3 and any(float(x) != 0.0 for x in losses)
    for p, q in zip(modules[0].model.parameters(), modules[1].model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", [["--model.init_args.batching", "true"], ["--model.init_args.batching", "false"],
                                  ["--model.init_args.rollout_mode", "async"]], ids=["batcher", "direct", "async"])
def test_rollouts_generate_under_the_trainers_precision(tmp_path, monkeypatch, mode):
    """Rollouts are produced in a callback hook (outside training_step) and on other threads (rollout workers, the
    batcher, the async producer): they still run under the trainer's autocast, as training does."""
    import lit_llm.policy.generate_version as wrapper  # where the generate version reads generate_tokens

    seen: list[bool] = []
    original = wrapper.generate_tokens

    def record(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return original(*args, **kwargs)

    monkeypatch.setattr(wrapper, "generate_tokens", record)
    for precision, expected in (("bf16-mixed", True), ("32-true", False)):
        seen.clear()
        main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir",
              str(tmp_path / precision), "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0",
              "--trainer.precision", precision, *mode])
        assert len(seen) >= 2 and all(s is expected for s in seen), (precision, seen)
