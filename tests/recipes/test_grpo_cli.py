"""GRPO through the real ``lit-llm`` CLI: every GRPO config parses; the tiny config trains (sync and async), writes
checkpoints and metrics, and a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["grpo_tiny.yaml", "grpo_arithmetic.yaml", "grpo_gsm8k.yaml"]


def frac_reward(prompts, completions, completion_ids, **kwargs):
    """Trivial reward (imported by the CLI subprocess as ``test_grpo_cli:frac_reward``)."""
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


@pytest.mark.parametrize("config", CONFIGS)
def test_grpo_configs_parse(config, capsys):
    from lit_llm.lightning.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: lit_llm.lightning.grpo.GRPOModule" in out
    assert "class_path: lit_llm.lightning.grpo_data.GRPODataModule" in out


def odd_answers_only(prompts, completions, completion_ids, answer, **kwargs):
    """frac_reward where the problem's answer is odd; 0.5 for every completion of an even one (a zero-std group)."""
    return [0.5 if int(a) % 2 == 0 else frac_reward(None, None, [c])[0] for a, c in zip(answer, completion_ids)]


def _cli(tmp: Path, config: str, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_llm.lightning.cli", "fit", "--config", str(ROOT / "configs" / config),
           "--trainer.default_root_dir", str(tmp), *args]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _run(tmp: Path, *args: str) -> None:
    _cli(tmp, "grpo_tiny.yaml", "--model.init_args.reward_funcs", '["test_grpo_cli:frac_reward"]',
         "--model.init_args.reward_weights", "null", "--model.init_args.num_generations", "8",
         "--model.init_args.max_new_tokens", "4", "--model.init_args.micro_batch_size", "16",
         "--model.init_args.optimizer.init_args.lr", "0.03", *args)


def _train_rows(tmp: Path, version: int = 0) -> list[dict[str, str]]:
    with open(tmp / "csv" / f"version_{version}" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train/reward")]


@pytest.mark.slow
def test_grpo_tiny_cli_sync_trains_checkpoints_and_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    _run(full, "--trainer.max_steps", "6")
    rows = _train_rows(full)
    assert len(rows) == 6
    for key in ("train/reward", "train/loss", "train/entropy", "train/clip_ratio/region_mean", "time/generation",
                "time/training", "train/tokens_per_sec", "train/frac_reward_zero_std",
                "train/completions/mean_length", "train/rewards/frac_reward/mean", "train/staleness"):
        assert all(math.isfinite(float(r[key])) for r in rows), key
    assert (full / "checkpoints" / "last.ckpt").exists()
    assert (full / "csv" / "version_0" / "rollout_samples.csv").exists()
    assert (full / "csv" / "version_0" / "eval_samples.csv").exists()

    _run(part, "--trainer.max_steps", "3")
    _run(part, "--trainer.max_steps", "6", "--ckpt_path", "last")
    resumed = _train_rows(part, 1)
    assert len(resumed) == 3  # exactly the remaining steps
    assert [r["train/reward"] for r in _train_rows(part, 0) + resumed] == [r["train/reward"] for r in rows]
    a = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(part / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 6
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])

    # export of a GRPO checkpoint: an HF folder whose weights are the trained policy's
    from transformers import AutoModelForCausalLM

    from lit_llm.lightning.export import export_checkpoint

    out = export_checkpoint(full / "checkpoints" / "last.ckpt", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, a["state_dict"]["model." + name]), name


@pytest.mark.slow
def test_grpo_tiny_cli_async(tmp_path):
    _run(tmp_path, "--trainer.max_steps", "4", "--model.init_args.rollout_mode", "async",
         "--model.init_args.max_staleness", "2")
    rows = _train_rows(tmp_path)
    assert 1 <= len(rows) <= 4
    assert all(float(r["train/staleness"]) <= 2 for r in rows)
    assert all(math.isfinite(float(r["train/loss"])) for r in rows)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4


@pytest.mark.slow
def test_grpo_gsm8k_config_runs(tmp_path, gsm8k_dir):
    """configs/grpo_gsm8k.yaml as shipped (GSM8K prompts, final-answer reward, truncation masking, greedy eval),
    with the tiny model and short budgets so that it fits the slow suite."""
    _cli(tmp_path, "grpo_gsm8k.yaml", "--model.init_args.model", "tiny", "--data.init_args.tokenizer", "tiny",
         "--data.init_args.path", str(gsm8k_dir / "train.jsonl"), "--data.init_args.eval_path",
         str(gsm8k_dir / "test.jsonl"), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.limit_val_batches", "1", "--data.init_args.eval_batch_size", "4",
         "--model.init_args.max_new_tokens", "12", "--model.init_args.eval_max_new_tokens", "8", "--wandb", "false")
    rows = _train_rows(tmp_path)
    assert len(rows) == 2
    keys = ("train/loss", "train/rewards/gsm8k_answer_reward/mean", "train/completions/clipped_ratio")
    assert all(math.isfinite(float(r[k])) for r in rows for k in keys)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        evals = [r for r in csv.DictReader(f) if r.get("eval/gsm8k_answer_reward")]
    assert len(evals) == 1 and 0.0 <= float(evals[0]["eval/gsm8k_answer_reward"]) <= 1.0
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_demo_config_runs_dynamic_sampling_and_resumes_exactly(tmp_path):
    """configs/grpo_arithmetic.yaml as shipped (strict + closeness-curriculum rewards, dynamic sampling, fp32) with
    the tiny model: it draws extra prompt batches (the random model earns nothing, so every group is zero-std and
    every step takes the 3 rounds); and a dynamic-sampling run stopped at step 3 and resumed continues exactly like an
    uninterrupted one (the loader's position counts the extra batches)."""
    demo = tmp_path / "demo"
    demo.mkdir()
    _cli(demo, "grpo_arithmetic.yaml", "--model.init_args.model", "tiny", "--data.init_args.tokenizer", "tiny",
         "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0",
         "--model.init_args.max_new_tokens", "4", "--wandb", "false")
    rows = _train_rows(demo)
    assert [float(r["train/sampling_rounds"]) for r in rows] == [3.0, 3.0]
    assert all(float(r["train/frac_reward_zero_std"]) == 1.0 for r in rows)

    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    dynamic = ("--model.init_args.dynamic_sampling", "true", "--model.init_args.reward_funcs",
               '["test_grpo_cli:odd_answers_only"]', "--data.init_args.batch_size", "4")
    _run(full, *dynamic, "--trainer.max_steps", "6")
    rows = _train_rows(full)
    assert len(rows) == 6 and any(float(r["train/sampling_rounds"]) > 1 for r in rows)
    _run(part, *dynamic, "--trainer.max_steps", "3")
    _run(part, *dynamic, "--trainer.max_steps", "6", "--ckpt_path", "last")
    resumed = _train_rows(part, 1)
    assert [r["train/reward"] for r in _train_rows(part, 0) + resumed] == [r["train/reward"] for r in rows]
    assert [r["train/sampling_rounds"] for r in _train_rows(part, 0) + resumed] == [
        r["train/sampling_rounds"] for r in rows]
    a = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(part / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
