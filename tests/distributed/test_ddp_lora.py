"""LoRA (``use_peft``) under 2-process DDP (gloo, CPU) through the real ``lit-llm`` CLI, with the tiny model: SFT, and
GRPO with a KL reference (the same model with its adapters disabled). Every rank holds the same weights after every
step, only the adapters change, and the checkpoint rank 0 wrote holds only the adapters and the base's identity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_launch import (
    DDPRun,
    RunCache,
    assert_checkpoints_written_by_rank_zero_only,
    assert_clean_exit,
    assert_same_weights_every_step,
    launch,
)

pytestmark = pytest.mark.slow

LORA = ("--model.init_args.use_peft", "true", "--model.init_args.lora_r", "4", "--model.init_args.lora_alpha", "8")
SFT = ("--trainer.max_steps", "3", "--data.num_samples", "16", "--data.batch_size", "2", "--data.micro_batch_size",
       "1", "--data.eval_limit", "2", "--trainer.val_check_interval", "3", "--samples.num_samples", "1")
GRPO = ("--trainer.max_steps", "3", "--data.num_train", "12", "--data.num_eval", "2", "--data.batch_size", "1",
        "--model.num_generations", "4", "--model.max_new_tokens", "6", "--model.eval_max_new_tokens", "2",
        "--model.beta", "0.1", "--trainer.val_check_interval", "3", "--trainer.num_sanity_val_steps", "0",
        "--model.init_args.reward_funcs", '["test_ddp_lora:frac_reward"]', "--model.init_args.reward_weights", "null",
        "--model.init_args.eval_reward_funcs", '["test_ddp_lora:frac_reward"]')


def frac_reward(prompts, completions, completion_ids, **kwargs):
    """Fraction of completion ids divisible by 8: non-zero advantages for the random tiny model (the arithmetic
    rewards are all 0 for it, and the adapters would then never move)."""
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


def _make_run(name: str, root: Path) -> DDPRun:
    if name == "sft":
        return launch(root, "sft_tiny.yaml", *SFT, *LORA)
    return launch(root, "grpo_tiny.yaml", *GRPO, *LORA)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("ddp_lora"), _make_run)


def _assert_adapter_checkpoint(run: DDPRun) -> None:
    saved = torch.load(run.root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    model_keys = [k for k in saved["state_dict"] if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert saved["lit_llm_peft"]["base_model"]["model_name_or_path"] == "tiny"
    assert len(saved["optimizer_states"][0]["state"]) == len(model_keys)
    assert saved["global_step"] == 3
    # every rank's generator states (gathered over gloo), so each rank's LoRA dropout stream continues on resume
    assert [sorted(state) for state in saved["lit_llm_rng_states"]] == [["cuda", "numpy", "python", "torch"]] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_lora_ddp_identical_weights_and_adapter_checkpoint(runs, name):
    run = runs.get(name)
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    hashes = [s["hash"] for s in run.ranks[0]["steps"]]
    assert len(set(hashes)) == len(hashes) == 3  # the adapters moved at every step
    assert_checkpoints_written_by_rank_zero_only(run)
    _assert_adapter_checkpoint(run)
    if name == "grpo":
        kl = run.metrics("train/kl")
        assert len(kl) == 3 and abs(kl[0]) < 1e-6 and kl[-1] > 0  # reference = base: KL 0 until adapters move
