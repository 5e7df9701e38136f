"""Sharded training (FSDP2 through Lightning's ``ModelParallelStrategy``) with 2 gloo ranks on the CPU, through the
real ``lit-llm`` CLI and the tiny model (fp32):

* SFT with a KL reference (the reference sharded too), against the same run under DDP (an independent code path,
  the same data on the same ranks): rank 1 builds the model and the reference on the meta device and has their shards
  filled from rank 0 in ``configure_model`` (the line it prints), rank 0 loads them (the same losses therefore check
  rank 1's filled weights and rotary buffers); the same losses, KL, gradient norms, validation loss and final
  weights, to fp32 reduction-order tolerance; its distributed checkpoint folder exported to one HF folder; a run
  stopped after step 2 and resumed from its ``last.ckpt`` folder (``--ckpt_path last``): the same steps 3-4, and no
  staging folder (``lit_llm.lightning.sharded_save``) left behind;
* GRPO (sync rollouts) with LoRA and a KL reference (adapters disabled), rank 0 stopping every completion at its
  first token and rank 1 never stopping (tests/distributed/ddp_probe.py's ``skew_generation``): generation of
  different lengths on the two ranks does not deadlock; its LoRA checkpoint folder resumed for a third step in
  ``rollout_mode: async`` (the producer's plain copy of the gathered weights, built from the restored shards, skewed
  alike; its adapters synced after the step) and exported with the adapters merged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_launch import DDPRun, RunCache, assert_clean_exit, assert_same_weights_every_step, launch

pytestmark = pytest.mark.slow

SHARDED = ("--trainer.strategy", "ModelParallelStrategy", "--trainer.strategy.data_parallel_size", "2",
           "--trainer.strategy.tensor_parallel_size", "1")
SFT = ("--trainer.max_steps", "4", "--trainer.precision", "32-true", "--data.num_samples", "32", "--data.batch_size",
       "4", "--data.micro_batch_size", "2", "--data.eval_limit", "4", "--trainer.val_check_interval", "2",
       "--samples.num_samples", "1", "--checkpoint.every_n_train_steps", "2", "--model.init_args.kl_coef", "0.1")
GRPO = ("--trainer.max_steps", "2", "--trainer.precision", "32-true", "--data.num_train", "8", "--data.num_eval", "2",
        "--data.batch_size", "1", "--model.num_generations", "4", "--model.max_new_tokens", "6",
        "--model.eval_max_new_tokens", "3", "--model.beta", "0.1", "--trainer.val_check_interval", "2",
        "--trainer.num_sanity_val_steps", "0", "--model.init_args.use_peft", "true", "--model.init_args.lora_r", "4",
        "--model.init_args.lora_alpha", "8", "--model.init_args.reward_funcs", '["test_ddp_lora:frac_reward"]',
        "--model.init_args.reward_weights", "null", "--model.init_args.eval_reward_funcs",
        '["test_ddp_lora:frac_reward"]')


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunCache:
    def make(name: str, root: Path) -> DDPRun:
        if name == "ddp":
            return launch(root, "sft_tiny.yaml", *SFT)
        if name == "sharded":
            return launch(root, "sft_tiny.yaml", *SFT, strategy=SHARDED)
        if name == "resumed":  # stopped after step 2, resumed from its last.ckpt folder
            launch(root, "sft_tiny.yaml", *SFT, "--trainer.max_steps", "2", strategy=SHARDED)
            return launch(root, "sft_tiny.yaml", *SFT, "--ckpt_path", "last", strategy=SHARDED)
        if name == "grpo_resumed":  # the GRPO run's LoRA checkpoint folder resumed for one more step (async rollouts)
            return launch(cache.get("grpo").root, "grpo_tiny.yaml", *GRPO, "--trainer.max_steps", "3", "--ckpt_path",
                          "last", "--model.rollout_mode", "async", strategy=SHARDED, skew_generation=True)
        return launch(root, "grpo_tiny.yaml", *GRPO, strategy=SHARDED, skew_generation=True)

    cache = RunCache(tmp_path_factory.mktemp("sharded"), make)
    return cache


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` weights of a checkpoint file, or of a distributed checkpoint folder (consolidated)."""
    from lit_llm.lightning.sharded_checkpoint import checkpoint_file

    with checkpoint_file(ckpt) as file:
        state = torch.load(file, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


@pytest.mark.timeout(600)
def test_sharded_sft_matches_ddp(runs):
    ddp, sharded = runs.get("ddp"), runs.get("sharded")
    assert_clean_exit(sharded)
    # rank 1 built both models on the meta device (lit-llm fit under ModelParallelStrategy: sharded_init), rank 0 did
    # not; 46 = 2 models x (21 state-dict tensors + 2 rotary buffers)
    built = [line for line in sharded.output.splitlines() if "built on the meta device" in line]
    assert built == ["[rank 1] lit-llm: the policy model and its KL reference were built on the meta device (no "
                     "weights in host memory before configure_model); shards filled from rank 0 (46 tensors)."]
    assert "meta device" not in ddp.output
    assert_same_weights_every_step(sharded)  # the probe hashes the gathered (whole) weights
    for r in range(2):  # the same samples on the same rank at every step
        assert [s["sample_ids"] for s in sharded.ranks[r]["steps"]] == [s["sample_ids"] for s in ddp.ranks[r]["steps"]]
    assert [s["global_step"] for s in sharded.ranks[0]["steps"]] == [1, 2, 3, 4]
    # the gradient norm: summed over shards vs over whole tensors (fp32 order): measured within 3e-5 relative
    for key, rel in (("train/loss", 1e-5), ("train/kl", 1e-5), ("train/grad_norm", 1e-4), ("val/loss", 1e-5),
                     ("train/step_tokens", 0)):
        expected = ddp.metrics(key)
        assert len(expected) == (2 if key == "val/loss" else 4), key
        assert sharded.metrics(key) == pytest.approx(expected, rel=rel, abs=1e-7), key
    # the distributed checkpoint folder (one .distcp file per rank + meta.pt) holds the DDP run's final weights
    last = sharded.root / "checkpoints" / "last.ckpt"
    assert last.is_dir() and sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    got, expected = _weights(last), _weights(ddp.root / "checkpoints" / "last.ckpt")
    assert sorted(got) == sorted(expected)
    # fp32 reduction order, amplified by AdamW where a gradient is near 0: measured mean |diff| ~2e-8, max 5.3e-6 (one
    # embedding element), for weights ~0.017 that moved ~0.01
    for k in expected:
        diff = (got[k] - expected[k]).abs()
        assert float(diff.mean()) < 1e-7 and float(diff.max()) < 2e-5, (k, float(diff.mean()), float(diff.max()))
    assert torch.equal(got["model.lm_head.weight"], got["model.model.embed_tokens.weight"])  # still tied


@pytest.mark.timeout(300)
def test_sharded_checkpoint_folder_exports_to_one_hf_folder(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from lit_llm.lightning.export import export_checkpoint

    last = runs.get("sharded").root / "checkpoints" / "last.ckpt"
    out = export_checkpoint(last, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = _weights(last)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, saved[f"model.{name}"], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(600)
def test_sharded_resume_from_last_folder_repeats_steps_three_and_four(runs):
    sharded, resumed = runs.get("sharded"), runs.get("resumed")
    assert_clean_exit(resumed)
    assert [s["global_step"] for s in resumed.ranks[0]["steps"]] == [3, 4]
    for r in range(2):
        assert [s["sample_ids"] for s in resumed.ranks[r]["steps"]] == \
            [s["sample_ids"] for s in sharded.ranks[r]["steps"][2:]]
    assert resumed.metrics("train/loss", version=1) == pytest.approx(sharded.metrics("train/loss")[2:], rel=1e-6)
    assert resumed.ranks[0]["final_hash"] == sharded.ranks[0]["final_hash"]
    # every save (and top-1 removal) went through a staging folder swapped in by rank 0: none is left behind
    for run in (sharded, resumed):
        names = sorted(p.name for p in (run.root / "checkpoints").iterdir())
        assert "last.ckpt" in names and [n for n in names if n.startswith(".")] == [], names
        assert "Detected an existing checkpoint" not in run.output  # torch's warning when a folder is rewritten


@pytest.mark.timeout(600)
def test_sharded_grpo_lora_with_unequal_completion_lengths(runs):
    run = runs.get("grpo")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    r0, r1 = (r["steps"] for r in run.ranks)
    assert [s["global_step"] for s in r0] == [1, 2]
    assert all(n == 1 for s in r0 for n in s["completion_lengths"])  # rank 0: stopped at the first token
    assert all(n == 6 for s in r1 for n in s["completion_lengths"])  # rank 1: ran to max_new_tokens
    assert len({s["hash"] for s in r0}) == 2  # the adapters moved at each step
    losses = run.metrics("train/loss")
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert len(run.metrics("eval/frac_reward")) == 1  # the greedy evaluation at step 2 ran through the gathered model


@pytest.mark.timeout(600)
def test_sharded_lora_checkpoint_folder_resumes_and_exports_merged(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from lit_llm.lightning.export import export_checkpoint

    grpo = runs.get("grpo")
    run = runs.get("grpo_resumed")
    assert_clean_exit(run)
    assert_same_weights_every_step(run)
    assert [s["global_step"] for s in run.ranks[0]["steps"]] == [3]
    assert len(run.metrics("train/loss", version=1)) == 1
    # async: each rank's producer generated from its own plain copy (built from the restored shards at version 2, no
    # collective while generating): rank 0 stopped at the first token, rank 1 ran to max_new_tokens
    r0, r1 = (r["steps"][0]["completion_lengths"] for r in run.ranks)
    assert r0 == [1] * 4 and r1 == [6] * 4
    assert run.metrics("train/staleness", version=1) == [0.0]
    # the copy's log-probs of its samples vs the trained sharded model's: measured KL 3.2e-8 (sync steps: 7.9e-9)
    assert 0 <= run.metrics("train/mismatch/kl", version=1)[0] < 1e-6
    assert run.ranks[0]["steps"][0]["hash"] != grpo.ranks[0]["final_hash"]  # the adapters moved at step 3
    last = run.root / "checkpoints" / "last.ckpt"
    saved = _weights(last)  # a sharded LoRA checkpoint keeps the frozen base (the strategy's resume reads it all)
    assert any(".lora_A." in k for k in saved) and "model.base_model.model.lm_head.weight" in saved
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(last, tmp_path / "hf")).state_dict()
    assert not any("lora" in k for k in merged)
    assert torch.equal(merged["lm_head.weight"], saved["model.base_model.model.lm_head.weight"])
