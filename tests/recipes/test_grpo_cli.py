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


def _run(tmp: Path, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_llm.lightning.cli", "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"),
           "--trainer.default_root_dir", str(tmp), "--model.init_args.reward_funcs", '["test_grpo_cli:frac_reward"]',
           "--model.init_args.reward_weights", "null", "--model.init_args.num_generations", "8",
           "--model.init_args.max_new_tokens", "4", "--model.init_args.micro_batch_size", "16",
           "--model.init_args.optimizer.init_args.lr", "0.03", *args]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


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
