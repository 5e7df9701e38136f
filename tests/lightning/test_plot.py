"""Training-curve PNG from sparse CSVLogger logs (``lit_llm.plot``): panel table, joining resumed
versions (later version wins on overlapping steps), constants left out, integer step ticks, the PNG itself, and the
real ``lit-llm fit`` + resume + ``lit-llm plot`` path on the tiny GRPO config."""

from __future__ import annotations

import csv
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lit_llm.plot import (
    PANEL_SPECS,
    collect_panels,
    find_metrics_files,
    load_metrics,
    main,
    panel_for,
    plot_training_curves,
)
from lit_llm.plot import draw as plot_mod

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def frac_reward(prompts, completions, completion_ids, **kwargs):
    """Varying reward for the CLI test (imported by the subprocess as ``test_plot:frac_reward``)."""
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


def odd_reward(prompts, completions, completion_ids, **kwargs):
    """A second varying reward (``test_plot:odd_reward``): the fraction of odd token ids."""
    return [sum(i % 2 for i in c) / max(1, len(c)) for c in completion_ids]


def id_reward(prompts, completions, completion_ids, **kwargs):
    """The mean token id / 50,000 (``test_plot:id_reward``): changes whenever the greedy completion does."""
    return [sum(c) / max(1, len(c)) / 50_000 for c in completion_ids]


def _write_csv(path: Path, rows: list[dict[str, float | int]], hparams: str | None = "lr: 0.001\n",
               ckpt_path: str | None = None, config: bool = False) -> Path:
    """Write rows the way CSVLogger does (one header with every key, empty cells where a row logged nothing);
    ``config=True`` also writes the ``config.yaml`` that ``lit-llm fit`` saves (with ``ckpt_path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    if hparams is not None:
        (path.parent / "hparams.yaml").write_text(hparams)
    if config:
        (path.parent / "config.yaml").write_text(f"seed_everything: 0\ntrainer:\n  max_steps: 9\n"
                                                 f"ckpt_path: {ckpt_path if ckpt_path is not None else 'null'}\n")
    return path


def sft_rows(steps: range, epoch_every: int = 4, lr: float = 1e-4) -> list[dict]:
    """SFT-like: a train row per step, a val row every ``epoch_every`` steps; constant lr."""
    rows = []
    for s in steps:
        rows.append({"epoch": s // epoch_every, "step": s, "train/loss": 2.0 - 0.1 * s, "train/nll": 2.1 - 0.1 * s,
                     "train/ppl": 7.0 + s, "train/token_accuracy": 0.3 + 0.01 * s, "train/grad_norm": 1.5 + s,
                     "train/lr": lr, "train/tokens": 512.0 * (s + 1), "train/step_tokens": 512.0,
                     "train/entropy": 3.0 - 0.1 * s, "train/tokens_per_sec": 100.0 + s})
        if (s + 1) % epoch_every == 0:
            rows.append({"epoch": s // epoch_every, "step": s, "val/loss": 1.9 - 0.1 * s, "val/token_accuracy": 0.35,
                         "val/ppl": 6.0})
    return rows


def grpo_row(s: int, k: float = 0.0) -> dict:
    """Every metric GRPOModule logs per step (lit_llm/lightning/grpo.py docstring); ``k`` shifts the values."""
    return {
        "epoch": 0, "step": s, "train/reward": 0.1 * s + k, "train/reward_std": 0.05 + 0.01 * s,
        "train/rewards/answer/mean": 0.2 * s, "train/rewards/answer/std": 0.1,
        "train/rewards/format/mean": 0.5 + 0.01 * s, "train/rewards/format/std": 0.2,
        "train/frac_reward_zero_std": 0.5 - 0.01 * s, "train/completions/mean_length": 20.0 + s,
        "train/completions/min_length": 5.0, "train/completions/max_length": 32.0,
        "train/completions/clipped_ratio": 0.25, "train/loss": 0.01 * s, "train/kl": 0.001 * s,
        "train/entropy": 2.0 - 0.01 * s, "train/clip_ratio/low_mean": 0.0, "train/clip_ratio/high_mean": 0.01 * s,
        "train/clip_ratio/region_mean": 0.01 * s, "train/ratio_mean": 1.0, "train/ratio_min": 0.9 - 0.01 * s,
        "train/ratio_max": 1.1 + 0.01 * s, "train/staleness": 0.0, "train/dropped_rollouts": 0.0,
        "time/generation": 1.0 + s, "time/rollout_wait": 0.0, "time/training": 0.5, "time/step": 1.5 + s,
        "train/tokens_per_sec": 100.0 + s, "rollout/tokens_per_sec": 50.0 + s, "train/grad_norm": 0.5 + s,
        "train/lr": 1e-6, "train/tokens": 100.0 * s, "train/step_tokens": 100.0,
    }


def _parse(rows: list[dict]) -> list[dict[str, str]]:
    """Round-trip through the csv module (values become strings, missing cells ``""``)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return [{k: str(r[k]) if k in r else "" for k in keys} for r in rows]


def _names(panels) -> dict[str, list[str]]:
    return {t: [s.name for s in series] for t, series in panels.items()}


def _curve(series) -> dict[float, float]:
    return dict(zip(series.steps, series.values))


# ------------------------------------------------------------------------------------------------ panel table
@pytest.mark.parametrize(
    "column, panel",
    [
        ("eval/strict_arithmetic_reward", "Eval accuracy (greedy)"), ("eval/accuracy", "Eval accuracy (greedy)"),
        ("train/reward", "Reward"), ("train/reward_std", "Reward"),
        ("train/rewards/strict_format/mean", "Reward per function"),
        ("train/rewards/strict_format/std", "Reward per function"),
        ("train/loss", "Loss"), ("train/nll", "Loss"), ("val/loss", "Loss"), ("train/loss_step", "Loss"),
        ("train/token_accuracy", "Token accuracy"), ("val/token_accuracy", "Token accuracy"),
        ("train/mismatch_kl", "Sampler/trainer mismatch"), ("train/mismatch/ratio_max", "Sampler/trainer mismatch"),
        ("train/kl", "KL to reference"), ("train/entropy", "Entropy"), ("val/entropy", "Entropy"),
        ("train/ratio_mean", "Policy ratio"), ("train/ratio_min", "Policy ratio"), ("train/ratio_max", "Policy ratio"),
        ("train/clip_ratio/low_mean", "Clip ratios"), ("train/clip_ratio/region_mean", "Clip ratios"),
        ("train/completions/mean_length", "Completion length"), ("train/completions/max_length", "Completion length"),
        ("train/frac_reward_zero_std", "Zero-std groups, truncation"),
        ("train/completions/clipped_ratio", "Zero-std groups, truncation"),
        ("train/episodes/turns_mean", "Episodes"), ("train/turns", "Episodes"), ("train/tool_calls", "Episodes"),
        ("train/episodes/tool_calls_mean", "Episodes"), ("train/episodes/turns_max", "Episodes"),
        ("train/episodes/tool_call_rate", "Episode rates"), ("train/episodes/tool_success_rate", "Episode rates"),
        ("train/episodes/truncated", "Episode rates"), ("train/episodes/truncated/max_turns", "Episode rates"),
        ("train/episodes/sampled_tokens_mean", "Episode tokens"), ("train/episodes/env_tokens_mean", "Episode tokens"),
        ("train/reward_by_turns/2", "Reward by turn count"), ("time/episode_generation", "Time per step"),
        ("time/tools", "Time per step"), ("time/env", "Time per step"),
        ("train/tokens_per_sec", "Throughput"), ("rollout/tokens_per_sec", "Throughput"),
        ("train/real_tokens_per_sec", "Throughput"),
        ("time/generation", "Time per step"), ("time/step", "Time per step"),
        ("train/staleness", "Async rollouts"), ("train/dropped_rollouts", "Async rollouts"),
        ("train/sampling_rounds", "Dynamic sampling"),
        ("train/grad_norm", "Gradient norm"), ("train/lr", "Learning rate"), ("lr-AdamW", "Learning rate"),
        ("train/skipped_steps", "Skipped steps"),
        # left out on purpose
        ("step", None), ("epoch", None), ("train/ppl", None), ("val/ppl", None), ("train/tokens", None),
        ("train/step_tokens", None), ("val/tokens", None),
        # unknown metrics get a panel of their own, titled with their name
        ("train/some_new_metric", "train/some_new_metric"), ("train/kleene", "train/kleene"),
    ],
)
def test_panel_for(column, panel):
    assert panel_for(column) == panel


def test_panel_titles_are_unique():
    titles = [s.title for s in PANEL_SPECS]
    assert len(set(titles)) == len(titles)


def test_collect_panels_grpo_one_panel_per_concept():
    rows = [grpo_row(s) for s in range(6)]
    rows.insert(3, {"epoch": 0, "step": 2, "eval/strict": 0.25, "eval/answer": 0.5})
    rows.append({"epoch": 0, "step": 5, "eval/strict": 0.5, "eval/answer": 0.75})
    panels = collect_panels(_parse(rows))
    assert _names(panels) == {
        "Eval accuracy (greedy)": ["eval/strict", "eval/answer"],
        "Reward": ["train/reward"],  # reward_std is its band; frac_reward_zero_std is not a reward
        "Reward per function": ["train/rewards/answer/mean", "train/rewards/format/mean"],
        "Loss": ["train/loss"],
        "KL to reference": ["train/kl"],
        "Entropy": ["train/entropy"],
        "Policy ratio": ["train/ratio_mean", "train/ratio_min", "train/ratio_max"],
        "Clip ratios": ["train/clip_ratio/low_mean", "train/clip_ratio/high_mean", "train/clip_ratio/region_mean"],
        "Completion length": ["train/completions/mean_length", "train/completions/min_length",
                              "train/completions/max_length"],
        "Zero-std groups, truncation": ["train/frac_reward_zero_std", "train/completions/clipped_ratio"],
        "Throughput": ["train/tokens_per_sec", "rollout/tokens_per_sec"],
        "Time per step": ["time/generation", "time/rollout_wait", "time/training", "time/step"],
        "Async rollouts": ["train/staleness", "train/dropped_rollouts"],
        "Gradient norm": ["train/grad_norm"],
        "Learning rate": ["train/lr"],
    }
    (reward,) = panels["Reward"]
    assert reward.label == "train/reward"
    assert reward.steps == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert reward.values == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert reward.std == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09, 0.10])
    answer, fmt = panels["Reward per function"]
    assert (answer.label, fmt.label) == ("answer", "format")
    assert answer.values == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]) and answer.std == pytest.approx([0.1] * 6)
    assert fmt.std == pytest.approx([0.2] * 6)
    strict, ans = panels["Eval accuracy (greedy)"]
    assert (strict.label, strict.steps, strict.values) == ("strict", [2.0, 5.0], [0.25, 0.5])
    assert (ans.label, ans.steps, ans.values) == ("answer", [2.0, 5.0], [0.5, 0.75])
    assert [s.label for s in panels["Time per step"]] == ["generation", "rollout_wait", "training", "step"]
    assert [s.label for s in panels["Clip ratios"]] == ["low_mean", "high_mean", "region_mean"]
    assert [s.is_constant for s in panels["Clip ratios"]] == [True, False, False]
    assert all(s.is_constant for s in panels["Learning rate"] + panels["Async rollouts"])


def test_collect_panels_sft_and_unknown_metric():
    rows = sft_rows(range(8))
    rows[0]["train/new_thing"] = 3.0
    rows[5]["train/new_thing"] = 4.0
    panels = collect_panels(_parse(rows))
    assert _names(panels) == {
        "Loss": ["train/loss", "train/nll", "val/loss"],
        "Token accuracy": ["train/token_accuracy", "val/token_accuracy"],
        "Entropy": ["train/entropy"],
        "Throughput": ["train/tokens_per_sec"],
        "Gradient norm": ["train/grad_norm"],
        "Learning rate": ["train/lr"],
        "train/new_thing": ["train/new_thing"],  # unknown: own panel, after the known ones
    }
    val = panels["Loss"][2]
    assert val.steps == [3.0, 7.0] and val.values == pytest.approx([1.6, 1.2]) and val.std is None
    assert _curve(panels["train/new_thing"][0]) == {0.0: 3.0, 4.0: 4.0}  # rows[5] is the step-4 train row


def test_collect_panels_skips_blank_nan_and_text_and_uses_row_index_without_step():
    rows = [{"train/loss": "1.0"}, {"train/loss": "nan"}, {"train/loss": ""}, {"train/loss": "oops"},
            {"train/loss": "0.5"}, {"train/loss": "inf"}]
    (series,) = collect_panels(rows)["Loss"]
    assert series.steps == [0.0, 4.0] and series.values == [1.0, 0.5]
    # a std column without its mean stays a curve of its own; a std is never folded into another panel's mean
    lone = collect_panels([{"step": "1", "train/reward_std": "0.2"}])
    assert _names(lone) == {"Reward": ["train/reward_std"]} and lone["Reward"][0].std is None
    # the last value logged at a step wins
    (loss,) = collect_panels([{"step": "3", "train/loss": "1"}, {"step": "3", "train/loss": "2"}])["Loss"]
    assert _curve(loss) == {3.0: 2.0}


# ------------------------------------------------------------------------------------------------ joining versions
def _grpo_version(steps: range, evals: list[int], k: float) -> list[dict]:
    """Train rows at ``steps`` (values shifted by ``k``) and greedy-eval rows at ``evals`` (value step/100 + k)."""
    rows = []
    for s in steps:
        rows.append(grpo_row(s, k))
        if s in evals:
            rows.append({"epoch": 0, "step": s, "eval/strict": s / 100 + k})
    for s in evals:
        if s not in steps:
            rows.insert(0, {"epoch": 0, "step": s, "eval/strict": s / 100 + k})
    return rows


def test_two_versions_with_overlap_join_later_wins(tmp_path):
    """version_0 ran steps 0-9 (evals at 2, 5, 8); it was resumed from its step-5 checkpoint: version_1 first
    re-runs the evaluation due at that checkpoint (logged at step 4), then trains steps 5-12 (evals at 7, 10).
    Joined by hand: train steps 0-4 from version_0, 5-12 from version_1; evals 2 (v0), 4, 7, 10 (v1); version_0's
    abandoned steps 5-9 and its evals 5, 8 are gone."""
    run = tmp_path / "run" / "csv"
    _write_csv(run / "version_0" / "metrics.csv", _grpo_version(range(0, 10), [2, 5, 8], k=0.0), config=True)
    _write_csv(run / "version_1" / "metrics.csv", _grpo_version(range(5, 13), [4, 7, 10], k=1.0),
               ckpt_path="runs/run/checkpoints/epoch=0-step=5.ckpt", config=True)
    rows, files = load_metrics(tmp_path / "run")
    assert [f.parent.name for f in files] == ["version_0", "version_1"]
    panels = collect_panels(rows)
    (reward,) = panels["Reward"]
    assert reward.steps == [float(s) for s in range(13)]
    expected = [0.0, 0.1, 0.2, 0.3, 0.4] + [1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2]
    assert reward.values == pytest.approx(expected)
    (ev,) = panels["Eval accuracy (greedy)"]
    assert ev.steps == [2.0, 4.0, 7.0, 10.0] and ev.values == pytest.approx([0.02, 1.04, 1.07, 1.10])

    # explicit version: no joining
    rows0, files0 = load_metrics(run, version=0)
    assert [f.parent.name for f in files0] == ["version_0"] and len(rows0) == 13
    with pytest.raises(FileNotFoundError, match=r"no version_7/metrics.csv .*versions found: \[0, 1\]"):
        load_metrics(run, version=7)


def test_three_versions_chain(tmp_path):
    run = tmp_path / "csv"
    _write_csv(run / "version_0" / "metrics.csv", sft_rows(range(0, 6)), config=True)
    _write_csv(run / "version_1" / "metrics.csv", [dict(r, **{"train/loss": 5.0}) for r in sft_rows(range(4, 9))],
               ckpt_path="last", config=True)
    _write_csv(run / "version_2" / "metrics.csv", [dict(r, **{"train/loss": 7.0}) for r in sft_rows(range(8, 10))],
               ckpt_path="last", config=True)
    rows, files = load_metrics(run)
    assert [f.parent.name for f in files] == ["version_0", "version_1", "version_2"]
    loss = _curve(collect_panels(rows)["Loss"][0])
    assert loss == pytest.approx({0.0: 2.0, 1.0: 1.9, 2.0: 1.8, 3.0: 1.7, 4.0: 5.0, 5.0: 5.0, 6.0: 5.0, 7.0: 5.0,
                                  8.0: 7.0, 9.0: 7.0})


@pytest.mark.parametrize("case", ["fresh_rerun", "not_resumed_config", "other_hparams_no_config"])
def test_unrelated_versions_are_not_joined(tmp_path, case):
    run = tmp_path / "lightning_logs"
    _write_csv(run / "version_0" / "metrics.csv", sft_rows(range(0, 8)), config=case == "not_resumed_config")
    newer = sft_rows(range(0, 4)) if case == "fresh_rerun" else sft_rows(range(6, 12))
    _write_csv(run / "version_1" / "metrics.csv", newer, config=case == "not_resumed_config",
               hparams="lr: 0.1\n" if case == "other_hparams_no_config" else None)
    rows, files = load_metrics(run)
    assert [f.parent.name for f in files] == ["version_1"]
    assert len(rows) == len(newer)


def test_resumed_config_joins_despite_changed_hparams(tmp_path):
    run = tmp_path / "csv"
    _write_csv(run / "version_0" / "metrics.csv", sft_rows(range(0, 6)), config=True)
    _write_csv(run / "version_1" / "metrics.csv", sft_rows(range(6, 9), lr=5e-5), hparams="lr: 0.00005\n",
               ckpt_path="'runs/x/checkpoints/last.ckpt'", config=True)
    rows, files = load_metrics(run)
    assert len(files) == 2
    lr = _curve(collect_panels(rows)["Learning rate"][0])
    assert lr == pytest.approx({**{float(s): 1e-4 for s in range(6)}, **{float(s): 5e-5 for s in range(6, 9)}})


def test_find_metrics_files_layouts(tmp_path):
    root = tmp_path / "runs" / "sft"
    for v in (2, 10, 9):
        _write_csv(root / "csv" / f"version_{v}" / "metrics.csv", sft_rows(range(2)))
    (root / "wandb" / "offline-run-1").mkdir(parents=True)
    names = ["version_2", "version_9", "version_10"]
    # version folders sort by number (version_10 after version_9); default_root_dir: the run is found below it
    assert [f.parent.name for f in find_metrics_files(root)] == names
    assert [f.parent.name for f in find_metrics_files(root / "csv")] == names
    single = root / "csv" / "version_9"
    assert find_metrics_files(single) == [single / "metrics.csv"]
    assert find_metrics_files(single / "metrics.csv") == [single / "metrics.csv"]
    _write_csv(tmp_path / "runs" / "grpo" / "csv" / "version_0" / "metrics.csv", [grpo_row(0)])
    with pytest.raises(ValueError, match=r"holds 2 runs with a metrics.csv .*pass one of them as LOG_DIR"):
        find_metrics_files(tmp_path / "runs")


# ------------------------------------------------------------------------------------------------ the PNG
def _png(path: Path) -> dict:
    """Open the PNG (decodes every pixel) and return its size, text chunks and pixel array."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return {"size": im.size, "pixels": np.asarray(im), **im.text}


def test_plot_grpo_run_png_constants_left_out(tmp_path):
    root = tmp_path / "grpo_run"
    _write_csv(root / "csv" / "version_0" / "metrics.csv", _grpo_version(range(0, 20), [4, 9, 14], 0.0),
               config=True)
    _write_csv(root / "csv" / "version_1" / "metrics.csv", _grpo_version(range(15, 40), [19, 24, 29, 34, 39], 0.0),
               ckpt_path="last", config=True)
    result = plot_training_curves(root)
    assert result.path == root / "training_curves.png"
    titles = ["Eval accuracy (greedy)", "Reward", "Reward per function", "Loss", "KL to reference", "Entropy",
              "Policy ratio", "Clip ratios", "Completion length", "Zero-std groups, truncation", "Throughput",
              "Time per step", "Gradient norm"]
    assert result.titles == titles  # no "Learning rate", no "Async rollouts": constant
    assert result.constants == pytest.approx({"train/staleness": 0.0, "train/dropped_rollouts": 0.0,
                                              "train/lr": 1e-6})
    assert [f.parent.name for f in result.files] == ["version_0", "version_1"] and result.resumed_at == [15.0]
    assert result.panels["Reward"][0].steps == [float(s) for s in range(40)]
    info = _png(result.path)
    assert info["Description"] == "panels: " + "; ".join(titles)
    assert info["Title"] == "Training curves: grpo_run/csv (version_0, version_1)"
    width, height = info["size"]
    assert (width, height) == (info["pixels"].shape[1], info["pixels"].shape[0])
    assert width >= 1600 and height >= 1600  # 3 columns x 5 rows
    assert info["pixels"].std() > 10  # drawn, not blank
    assert sorted(p.name for p in root.iterdir()) == ["csv", "training_curves.png"]  # no temp file left


def test_step_ticks_are_integers_and_shared(tmp_path):
    rows = [{"step": s, "train/loss": 1.0 / (s + 1), "train/kl": 0.1 * s} for s in range(4)]
    panels = collect_panels(_parse(rows))
    fig = plot_mod._figure(panels, {"train/lr": 0.001}, "t")
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["Loss", "KL to reference"]
    for ax in axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks  # the default locator would give 0.5 steps
        assert ax.get_xlim() == axes[0].get_xlim()
    assert "Constant (no panel): train/lr = 0.001" in fig._supxlabel.get_text()


def test_near_constant_series_have_no_offset_notation():
    """Entropy 10.78980 .. 10.78983 reads as itself on the y axis, not as an offset "1e-5+1.07898e1"."""
    rows = [{"step": s, "train/entropy": 10.7898 + 1e-5 * s, "train/loss": 1.0 / (s + 1)} for s in range(4)]
    fig = plot_mod._figure(collect_panels(_parse(rows)), {}, "t")
    fig.canvas.draw()
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    entropy = axes["Entropy"]
    assert entropy.yaxis.get_major_formatter().get_useOffset() is False
    assert entropy.yaxis.get_offset_text().get_text() == ""
    low, high = entropy.get_ylim()
    labels = [t.get_text() for t, v in zip(entropy.get_yticklabels(), entropy.get_yticks()) if low <= v <= high]
    assert labels and all(label.startswith("10.7898") for label in labels), labels
    assert all(ax.yaxis.get_major_formatter().get_useOffset() is False for ax in axes.values())


def test_plot_sft_run_custom_out_and_main(tmp_path, capsys):
    log = _write_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", sft_rows(range(10)))
    result = plot_training_curves(log, tmp_path / "figs" / "sft.png")
    assert result.path == tmp_path / "figs" / "sft.png"
    assert result.titles == ["Loss", "Token accuracy", "Entropy", "Throughput", "Gradient norm"]
    assert result.constants == {"train/lr": 1e-4}
    assert _png(result.path)["Description"] == "panels: " + "; ".join(result.titles)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(result.path.stat().st_mode) == 0o666 & ~umask  # as a plain open() would, not mkstemp's 0600

    assert main([str(tmp_path / "lightning_logs")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "lightning_logs" / "training_curves.png")
    assert (tmp_path / "lightning_logs" / "training_curves.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------------------ errors
def test_no_metrics_csv_names_dir_and_csv_logger(tmp_path, capsys):
    (tmp_path / "empty_run" / "wandb").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as e:
        plot_training_curves(tmp_path / "empty_run")
    msg = str(e.value)
    assert str(tmp_path / "empty_run") in msg and "CSVLogger" in msg and "--trainer.logger" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_training_curves(tmp_path / "nope")
    assert main([str(tmp_path / "empty_run")]) == 1
    assert capsys.readouterr().err.startswith("lit-llm plot: error: no metrics.csv found in")
    assert not (tmp_path / "empty_run" / "training_curves.png").exists()


def test_unplottable_csv_lists_columns_and_writes_nothing(tmp_path):
    log = _write_csv(tmp_path / "version_0" / "metrics.csv",
                     [{"epoch": 0, "step": s, "train/tokens": 10.0 * s, "train/loss": ""} for s in range(3)])
    with pytest.raises(ValueError) as e:
        plot_training_curves(tmp_path)
    assert "columns found: ['epoch', 'step', 'train/loss', 'train/tokens']" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0"]
    log.write_text("")
    with pytest.raises(ValueError, match=r"columns found: none \(empty file\)"):
        plot_training_curves(log)
    _write_csv(log, [{"step": s, "train/lr": 0.1, "train/loss": 2.0} for s in range(3)])
    with pytest.raises(ValueError, match=r"every plotted column is constant \(train/loss = 2, train/lr = 0.1\)"):
        plot_training_curves(log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0"]


def test_failed_write_leaves_old_png_intact_and_no_temp_file(tmp_path, monkeypatch):
    _write_csv(tmp_path / "version_0" / "metrics.csv", sft_rows(range(4)))
    out = tmp_path / "training_curves.png"
    out.write_bytes(b"old")
    from matplotlib.figure import Figure

    def broken_savefig(self, f, **kwargs):
        f.write(PNG_MAGIC + b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        plot_mod.plot_training_curves(tmp_path)
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training_curves.png", "version_0"]


# ------------------------------------------------------------------------------------------------ real CLI run
def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "lit_llm.lightning.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _csv_points(path: Path) -> dict[str, dict[float, float]]:
    """{column: {step: value}} of one metrics.csv, the last value per step."""
    out: dict[str, dict[float, float]] = {}
    for row in csv.DictReader(path.open()):
        for k, v in row.items():
            if k not in ("step", "epoch") and v != "" and math.isfinite(float(v)):
                out.setdefault(k, {})[float(row["step"])] = float(v)
    return out


@pytest.mark.slow
def test_grpo_tiny_cli_resumed_once_plot(tmp_path):
    """``lit-llm fit`` of the tiny GRPO config for 5 steps (checkpoint at step 3), resumed from the step-3
    checkpoint up to step 8, then ``lit-llm plot``: one curve per metric across both versions, version_1's values
    on the overlapping steps 3-4, the expected panels, and a PNG that opens."""
    common = ["fit", "--config", str(ROOT / "configs" / "grpo_tiny.yaml"), "--trainer.default_root_dir", "run",
              "--model.init_args.reward_funcs", '["test_plot:frac_reward", "test_plot:odd_reward"]',
              "--model.init_args.reward_weights", "null",
              "--model.init_args.eval_reward_funcs", '["test_plot:id_reward", "test_plot:odd_reward"]',
              "--model.init_args.optimizer.init_args.lr", "0.03", "--model.init_args.log_samples_every", "0"]
    _cli(tmp_path, *common, "--trainer.max_steps", "5")
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("*step=3.ckpt")
    _cli(tmp_path, *common, "--trainer.max_steps", "8", "--ckpt_path", str(ckpt))
    proc = _cli(tmp_path, "plot", "run", "--out", str(tmp_path / "curves.png"))
    assert proc.stdout.strip() == str(tmp_path / "curves.png")

    result = plot_training_curves(tmp_path / "run", tmp_path / "curves2.png")
    assert [f.parent.name for f in result.files] == ["version_0", "version_1"]
    v0 = _csv_points(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")
    v1 = _csv_points(tmp_path / "run" / "csv" / "version_1" / "metrics.csv")
    first = min(s for pts in v1.values() for s in pts)  # version_1 starts at its checkpoint
    assert result.resumed_at == [first]
    # metrics at global_step (steps done): version_0 logs steps 1-5, version_1 (from the step-3 checkpoint) 4-8
    assert first <= 4.0 and sorted(v1["train/reward"]) == [4.0, 5.0, 6.0, 7.0, 8.0]
    assert sorted(v0["train/reward"]) == [1.0, 2.0, 3.0, 4.0, 5.0]  # steps 4, 5 overlap
    drawn = {s.name: s for series in result.panels.values() for s in series}
    for name in ("train/reward", "time/step", "train/tokens_per_sec", "eval/id_reward", "eval/odd_reward"):
        # by hand: version_0 up to version_1's first step, then version_1 (later wins on overlapping steps)
        expected = {s: v for s, v in v0[name].items() if s <= first}
        expected.update(v1.get(name, {}))
        assert _curve(drawn[name]) == expected, name
    assert _curve(drawn["time/step"])[4.0] == v1["time/step"][4.0] != v0["time/step"][4.0]  # v1 wins, not v0
    assert sorted(drawn["train/reward"].steps) == [float(s) for s in range(1, 9)]
    assert drawn["train/reward"].std is not None  # reward_std is its band
    assert [s.label for s in result.panels["Reward per function"]] == ["frac_reward", "odd_reward"]
    assert [s.label for s in result.panels["Eval accuracy (greedy)"]] == ["id_reward", "odd_reward"]
    for title in ("Eval accuracy (greedy)", "Reward", "Reward per function", "Loss", "Entropy", "Policy ratio",
                  "Throughput", "Time per step", "Gradient norm"):
        assert title in result.titles, result.titles
    assert "Learning rate" not in result.titles and "train/lr" in result.constants
    assert "Async rollouts" not in result.titles  # sync run: staleness 0 throughout
    for png in ("curves.png", "curves2.png"):
        info = _png(tmp_path / png)
        assert info["Description"] == "panels: " + "; ".join(result.titles)
        assert info["pixels"].ndim == 3 and info["pixels"].std() > 10


def test_setup_rows_at_step_0_do_not_restart_a_resumed_version(tmp_path):
    """A resumed version that (as SFT runs did) logs ``data/*`` counts at step 0 before training on from step 4
    still continues version_0: its start is its first non-``data/*`` row (step 4), not 0."""
    run = tmp_path / "csv"
    data = {"step": 0, "data/train_samples": 32.0, "data/truncated": 0.0}
    _write_csv(run / "version_0" / "metrics.csv", [data, *sft_rows(range(0, 4))], config=True)
    _write_csv(run / "version_1" / "metrics.csv", [data, *[dict(r, **{"train/loss": 5.0})
                                                          for r in sft_rows(range(4, 8))]],
               ckpt_path="last", config=True)
    result = plot_training_curves(run, tmp_path / "c.png")
    assert [f.parent.name for f in result.files] == ["version_0", "version_1"]
    assert result.resumed_at == [4.0]
    loss = _curve(result.panels["Loss"][0])
    assert loss == pytest.approx({0.0: 2.0, 1.0: 1.9, 2.0: 1.8, 3.0: 1.7, 4.0: 5.0, 5.0: 5.0, 6.0: 5.0, 7.0: 5.0})


def test_validate_only_version_adds_eval_points_not_a_new_run(tmp_path):
    """``lit-llm validate`` into a GRPO run's folder writes a version with only ``eval/*`` rows (version_2, at the
    checkpoint's step 9; an older validate wrote one at step 0: version_1). The training curve comes from version_0;
    the eval panel gets the validate points at their step, later wins (step 0: version_1's 0.5 over version_0's)."""
    run = tmp_path / "csv"
    _write_csv(run / "version_0" / "metrics.csv", _grpo_version(range(0, 10), [0, 3, 6, 9], k=0.0), config=True)
    _write_csv(run / "version_1" / "metrics.csv", [{"epoch": 0, "step": 0, "eval/strict": 0.5}],
               ckpt_path="runs/x/checkpoints/last.ckpt", config=True)
    _write_csv(run / "version_2" / "metrics.csv", [{"step": 9, "data/train_samples": 8.0},
                                                   {"epoch": 0, "step": 9, "eval/strict": 0.75}],
               ckpt_path="runs/x/checkpoints/last.ckpt", config=True)
    rows, files = load_metrics(run)
    assert [f.parent.name for f in files] == ["version_0", "version_1", "version_2"]
    panels = collect_panels(rows)
    (reward,) = panels["Reward"]
    assert reward.steps == [float(s) for s in range(10)]
    (ev,) = panels["Eval accuracy (greedy)"]
    assert _curve(ev) == pytest.approx({0.0: 0.5, 3.0: 0.03, 6.0: 0.06, 9.0: 0.75})
    result = plot_training_curves(run, tmp_path / "c.png")  # no "every plotted column is constant"
    assert result.resumed_at == [] and "Reward" in result.titles

    # evaluations only: the newest alone, as before
    only = tmp_path / "only"
    _write_csv(only / "version_0" / "metrics.csv", [{"step": 0, "eval/strict": 0.5}])
    _write_csv(only / "version_1" / "metrics.csv", [{"step": 4, "eval/strict": 0.25}])
    rows, files = load_metrics(only)
    assert [f.parent.name for f in files] == ["version_1"] and len(rows) == 1


@pytest.mark.slow
def test_sft_tiny_cli_resumed_once_plot_joins_both_versions(tmp_path):
    """``lit-llm fit`` of ``sft_tiny`` for 4 steps, resumed with ``--ckpt_path last`` up to 8, then ``lit-llm plot``:
    the data counts are logged by version_0 only (at step 0), and the plot joins both versions (it used to read
    version_1 alone: its step-0 ``data/*`` row read as a fresh start)."""
    common = ["fit", "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--trainer.default_root_dir", "run"]
    _cli(tmp_path, *common, "--trainer.max_steps", "4")
    _cli(tmp_path, *common, "--trainer.max_steps", "8", "--ckpt_path", "last")
    v0 = _csv_points(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")
    v1 = _csv_points(tmp_path / "run" / "csv" / "version_1" / "metrics.csv")
    assert v0["data/train_samples"] == {0.0: pytest.approx(v0["data/train_samples"][0.0])}
    assert not any(k.startswith("data/") for k in v1)
    result = plot_training_curves(tmp_path / "run", tmp_path / "curves.png")
    assert [f.parent.name for f in result.files] == ["version_0", "version_1"]
    drawn = {s.name: s for series in result.panels.values() for s in series}
    expected = {**v0["train/loss"], **v1["train/loss"]}
    assert _curve(drawn["train/loss"]) == expected and len(expected) == 8
    assert result.resumed_at == [min(v1["train/loss"])]


def test_host_memory_columns_share_one_panel():
    rows = [{"step": "1", "memory/host_rss_gib": "2.5", "memory/host_peak_rss_gib": "7.0"},
            {"step": "2", "memory/host_rss_gib": "2.25", "memory/host_peak_rss_gib": "8.5"}]
    panels = collect_panels(rows)
    assert list(panels) == ["Host memory"]
    assert {s.label: s.values for s in panels["Host memory"]} == {"host_rss_gib": [2.5, 2.25],
                                                                   "host_peak_rss_gib": [7.0, 8.5]}


def test_gpu_memory_columns_share_one_panel_after_host_memory():
    rows = [{"step": "1", "memory/host_rss_gib": "2.5", "memory/cuda_allocated_gib": "1.5",
             "memory/cuda_peak_gib": "3"},
            {"step": "2", "memory/host_rss_gib": "2.0", "memory/cuda_allocated_gib": "1.25",
             "memory/cuda_peak_gib": "4"}]
    panels = collect_panels(rows)
    assert list(panels) == ["Host memory", "GPU memory"]
    assert {s.label: s.values for s in panels["GPU memory"]} == {"cuda_allocated_gib": [1.5, 1.25],
                                                                  "cuda_peak_gib": [3.0, 4.0]}


#: A Python run on a machine without matplotlib (issue 28: an offline GPU machine should not need its 21 MiB of
#: wheels): its import fails and its metadata is absent (torchmetrics, imported by Lightning, imports matplotlib when
#: the metadata says it is installed), then the training modules and the CLI are imported.
WITHOUT_MATPLOTLIB = """
import importlib.metadata, sys
sys.modules["matplotlib"] = None  # `import matplotlib` raises ImportError; importlib.util.find_spec gives None
real_version = importlib.metadata.version
def version(name):
    if name.lower() == "matplotlib":
        raise importlib.metadata.PackageNotFoundError(name)
    return real_version(name)
importlib.metadata.version = version
import lit_llm.lightning, lit_llm.lightning.grpo, lit_llm.lightning.cli, lit_llm.lightning.plot
print(sorted(m for m in sys.modules if m.startswith("matplotlib.")), sys.modules["matplotlib"])
"""


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and Lightning (~5-10 s on 2 cores)
def test_lit_llm_lightning_imports_without_matplotlib():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] None"  # no matplotlib module was imported
