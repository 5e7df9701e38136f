"""recipes/sft.py runs top to bottom with the tiny model and leaves metrics, checkpoints and a loadable HF folder."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_recipe():
    spec = importlib.util.spec_from_file_location("recipe_sft", ROOT / "recipes" / "sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sft_recipe_tiny(tmp_path):
    recipe = load_recipe()
    out = recipe.main(["--model", "tiny", "--format", "arithmetic", "--num-samples", "16", "--batch-size", "4",
                       "--micro-batch-size", "2", "--lr", "3e-3", "--max-steps", "6", "--max-length", "64",
                       "--out", str(tmp_path / "run")])
    assert out == tmp_path / "run" / "hf"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64  # the tiny model
    rows = list(csv.DictReader((tmp_path / "run/csv/version_0/metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert (tmp_path / "run/checkpoints/last.ckpt").is_file()
