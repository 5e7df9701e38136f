"""Bring your own job through the real CLI (issue 13): a GRPO run on a JSONL file with a ``prompt`` column and an
extra column that reward functions defined in files of the working directory read, with no ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

REWARDS = '''
import json, os

def city_reward(prompts, completions, completion_ids, city, trainer_state, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "max_steps": trainer_state.max_steps,
                            "pairs": [[p, c] for p, c in zip(prompts, city)]}) + "\\n")
    return [float(c.lower() in text.lower()) for text, c in zip(completions, city)]
'''

SCORE = '''
def length_reward(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]
'''

ROWS = [{"prompt": f"The capital of country {i} is", "city": f"City{i}", "id": i} for i in range(12)]


@pytest.mark.slow
def test_grpo_on_a_prompt_file_with_rewards_from_the_working_directory(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "score.py").write_text(SCORE)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lit_llm.lightning.cli", "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"),
           "--trainer.default_root_dir", "run", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
           "--data.task", "null", "--data.path", "prompts.jsonl", "--data.num_eval", "4",
           "--model.init_args.reward_funcs", '["my_rewards:city_reward", "sub/score.py:length_reward"]',
           "--model.init_args.reward_weights", "null"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    by_prompt = {r["prompt"]: r["city"] for r in ROWS}
    for call in calls:  # every completion's column value belongs to its own prompt
        assert call["pairs"] and all(by_prompt[p] == c for p, c in call["pairs"])
    train = [c for c in calls if len(c["pairs"]) == 4 * 4]  # 4 prompts x 4 generations per step
    assert [c["step"] for c in train] == [0, 1] and {c["max_steps"] for c in train} == {2}
    evals = [c for c in calls if len(c["pairs"]) == 4]  # greedy evaluation of the 4 held-out prompts
    assert [c["step"] for c in evals] == [0, 2]  # before training and at step 2
    metrics = (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "eval/city_reward" in metrics and "train/rewards/length_reward/mean" in metrics
