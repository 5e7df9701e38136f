"""GRPO on the colocated vLLM engine, through the CLI (in this process, so the engine's calls can be counted):
the shipped ``configs/grpo_vllm_tiny.yaml`` samples every rollout and greedy evaluation with vLLM and pushes the
trained weights before every generation whose weights changed; a rerun gives identical rollouts (fp32, eager,
per-row seeds); a resumed run's first rollout uses the restored weights; LoRA, async rollouts and tool-using episodes
run on the engine too. One engine serves the whole module (same settings: ``shared_engine``)."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_llm.lightning.cli import main
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.policy.vllm_wrapper import vLLMWrapper

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "grpo_vllm_tiny.yaml")
#: The tiny config's engine settings, for runs of other configs (the same engine is reused).
SAME_ENGINE = ["--model.init_args.model", "tiny-vllm", "--model.init_args.use_vllm", "true",
               "--model.init_args.vllm_kv_cache_gib", "0.25", "--model.init_args.vllm_max_model_length", "512",
               "--trainer.precision", "32-true"]


def fit(root: Path, *extra: str, config: str = CONFIG):
    return main(["fit", "--config", config, "--trainer.default_root_dir", str(root),
                 "--trainer.enable_progress_bar", "false", *extra])


def metrics(root: Path, version: int = 0) -> list[dict[str, str]]:
    with open(root / "csv" / f"version_{version}" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train/reward")]


@pytest.fixture
def counted(monkeypatch):
    """Every vLLM generate call as ``(rows, weights the engine held, the trainer's weights)``."""
    state = SimpleNamespace(calls=[], versions=None)
    sample, setup = vLLMWrapper._sample, PolicyVersionSwitch.setup

    def recorded(self, prompts, seeds, n):
        v = state.versions
        state.calls.append((len(prompts) * n, v.vllm.pushed_at, v.weights_key()))
        return sample(self, prompts, seeds, n)

    def remember(self, trainer, pl_module, stage):
        state.versions = self
        return setup(self, trainer, pl_module, stage)

    monkeypatch.setattr(vLLMWrapper, "_sample", recorded)
    monkeypatch.setattr(PolicyVersionSwitch, "setup", remember)
    return state


def test_shipped_config_samples_with_vllm_and_pushes_every_step(tmp_path, counted):
    cli = fit(tmp_path / "run")
    assert counted.versions is cli.model.versions and isinstance(cli.model.engine.policy, vLLMWrapper)
    # generate calls: one per rollout (4 steps x 4 prompts x 4 samples) + one per greedy evaluation (8 prompts at
    # steps 0, 2 and 4); each saw the weights the trainer had (pushed at fit start, then before the rollouts of
    # steps 1 and 3 and the evaluations after steps 2 and 4, whose rollouts reuse them)
    assert [rows for rows, _, _ in counted.calls] == [8, 16, 16, 8, 16, 16, 8]
    assert all(pushed == current for _, pushed, current in counted.calls)
    assert cli.model.versions.vllm.num_pushes == 5
    rows = metrics(tmp_path / "run")
    assert [float(r["rollout/weight_pushes"]) for r in rows] == [1.0, 2.0, 3.0, 4.0]
    # fp32 engine and trainer on the same weights: vLLM's log-probs are the trainer's to rounding, at every step
    assert all(float(r["train/mismatch/kl"]) < 1e-9 for r in rows), [r["train/mismatch/kl"] for r in rows]
    assert all(float(r["time/weight_push"]) > 0 for r in rows)


def test_rerun_identical_and_resume_rolls_out_from_restored_weights(tmp_path):
    part = tmp_path / "part"
    fit(part, "--trainer.max_steps", "2")
    full = tmp_path / "full"
    fit(full)
    again = tmp_path / "again"
    fit(again)
    keys = ["step", "train/reward", "train/completions/mean_length", "train/loss", "train/mismatch/kl"]
    first = [{k: r[k] for k in keys} for r in metrics(full)]
    assert first == [{k: r[k] for k in keys} for r in metrics(again)]
    assert (full / "csv/version_0/rollout_samples.csv").read_text() == \
        (again / "csv/version_0/rollout_samples.csv").read_text()
    # `part` stopped at step 2; resumed to 4 now that the engine holds `again`'s step-4 weights, its rollouts must come
    # from the checkpoint's weights (pushed at fit start), so its steps 3-4 equal the uninterrupted run's
    fit(part, "--ckpt_path", "last")
    resumed = [{k: r[k] for k in keys} for r in metrics(part, version=1)]
    assert resumed == first[2:]


def test_lora_async_recompute_and_episodes_on_the_engine(tmp_path):
    lora = fit(tmp_path / "lora", "--trainer.max_steps", "2", "--model.init_args.use_peft", "true",
               "--model.init_args.lora_dropout", "0.0", "--trainer.val_check_interval", "2")
    assert lora.model.versions.vllm.num_pushes >= 2
    assert all(float(r["train/mismatch/kl"]) < 1e-9 for r in metrics(tmp_path / "lora"))  # base + merged adapters
    run = fit(tmp_path / "async", "--trainer.max_steps", "3", "--model.init_args.rollout_mode", "async",
              "--model.init_args.max_staleness", "3")
    producer = run.model.async_rollouts
    assert producer.engine.policy is run.model.engine.policy and run.model.versions.num_syncs == 3
    assert len(metrics(tmp_path / "async")) == 3
    fit(tmp_path / "recompute", "--trainer.max_steps", "2", "--model.init_args.old_log_probs", "recompute",
        "--model.init_args.rollout_correction", "token_truncate")
    rows = metrics(tmp_path / "recompute")  # the correction's weights are recomputed-old / vLLM's probabilities
    assert len(rows) == 2 and all(float(r["train/rollout_correction/weight_mean"]) > 0.99 for r in rows)
    tools = fit(tmp_path / "tools", "--trainer.max_steps", "2", *SAME_ENGINE,
                config=str(ROOT / "configs" / "grpo_tools_tiny.yaml"))
    assert isinstance(tools.model.engine.policy, vLLMWrapper)
    rows = metrics(tmp_path / "tools")
    assert len(rows) == 2 and all(any(k.startswith("train/episodes/") and v for k, v in r.items()) for r in rows)


def test_more_than_one_process_is_refused_naming_it(tmp_path):
    """The DDP decision (issue 27 item 6): one colocated engine per trainer process, so ``use_vllm`` with 2 gloo ranks
    is refused by every rank at setup, before an engine starts (vLLM would initialise its own process group)."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "fit", "--config", CONFIG,
                           "--trainer.default_root_dir", str(tmp_path), "--trainer.devices", "2",
                           "--trainer.strategy", "ddp"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = {ln for ln in proc.stderr.splitlines() if ln.startswith("lit-llm: error:")}
    assert errors == {"lit-llm: error: use_vllm runs one colocated engine in one trainer process; this run has 2 "
                      "processes (trainer.devices / num_nodes). Train on one device (--trainer.devices 1) or set "
                      "use_vllm: false (rollouts on the trained model)."}
    assert "Traceback" not in proc.stderr
