"""Training-curve PNG from sparse CSVLogger logs (``lit_llm.lightning.plot``)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lit_llm.lightning import plot as plot_mod
from lit_llm.lightning.plot import (
    collect_panels,
    find_metrics_files,
    load_metrics,
    main,
    panel_for,
    plot_training_curves,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_csv(path: Path, rows: list[dict[str, float | int]], hparams: str | None = "lr: 0.001\n") -> Path:
    """Write rows the way CSVLogger does: one header with every key, empty cells where a row logged nothing."""
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
    return path


def sft_rows(steps: range, epoch_every: int = 4) -> list[dict]:
    """SFT-like: a train row per step, a val row and an epoch-end row every ``epoch_every`` steps."""
    rows = []
    for s in steps:
        rows.append({"epoch": s // epoch_every, "step": s, "train/loss": 2.0 - 0.1 * s, "train/nll": 2.0 - 0.1 * s,
                     "train/ppl": 7.0, "train/token_accuracy": 0.3 + 0.01 * s, "train/grad_norm": 1.5,
                     "train/lr": 1e-4, "train/tokens": 512.0 * (s + 1)})
        if (s + 1) % epoch_every == 0:
            rows.append({"epoch": s // epoch_every, "step": s, "val/loss": 1.9 - 0.1 * s, "val/token_accuracy": 0.35})
    return rows


def grpo_rows(steps: range) -> list[dict]:
    rows = []
    for s in steps:
        rows.append({"epoch": 0, "step": s, "train/loss": 0.01 * s, "train/reward_mean": 0.1 * s,
                     "train/reward_std": 0.05, "train/kl": 0.001 * s, "train/completion_length_mean": 20.0 + s,
                     "train/completion_length_min": 5.0, "train/completion_length_max": 32.0, "train/lr": 1e-6,
                     "train/grad_norm": 0.5, "train/clip_ratio": 0.0})
        if s % 3 == 2:
            rows.append({"epoch": 0, "step": s, "eval/accuracy": 0.25 + 0.01 * s})
    return rows


def _parse(rows: list[dict]) -> list[dict[str, str]]:
    """Round-trip through the csv module (values become strings, missing cells ``""``)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return [{k: str(r[k]) if k in r else "" for k in keys} for r in rows]


def _titles(panels) -> dict[str, list[str]]:
    return {t: [s.name for s in series] for t, series in panels.items()}


# ------------------------------------------------------------------------------------------------ panel grouping
@pytest.mark.parametrize(
    "column, panel",
    [
        ("train/loss", "Loss"), ("train/loss_step", "Loss"), ("train/loss_epoch", "Loss"), ("val/loss", "Loss"),
        ("train/reward_mean", "Reward"), ("rollout/reward_answer_match", "Reward"),
        ("train/token_accuracy", "Accuracy"), ("eval/accuracy", "Accuracy"), ("val/acc", "Accuracy"),
        ("train/kl", "KL divergence"), ("train/kl_loss", "KL divergence"),
        ("train/completion_length_mean", "Completion length"), ("rollout/response_len", "Completion length"),
        ("train/lr", "Learning rate"), ("lr-AdamW", "Learning rate"), ("train/learning_rate", "Learning rate"),
        ("train/grad_norm", "Gradient norm"), ("grad_2.0_norm_total", "Gradient norm"),
        ("step", None), ("epoch", None), ("train/ppl", None), ("train/tokens", None), ("train/clip_ratio", None),
        ("train/kleene", None), ("train/rollout_lrs", None),
    ],
)
def test_panel_for(column, panel):
    assert panel_for(column) == panel


def test_collect_panels_sft_exact():
    panels = collect_panels(_parse(sft_rows(range(8))))
    assert _titles(panels) == {
        "Loss": ["train/loss", "val/loss"],
        "Accuracy": ["train/token_accuracy", "val/token_accuracy"],
        "Learning rate": ["train/lr"],
        "Gradient norm": ["train/grad_norm"],
    }
    val = panels["Loss"][1]
    assert val.steps == [3.0, 7.0]
    assert val.values == pytest.approx([1.6, 1.2])
    assert val.std is None
    train = panels["Loss"][0]
    assert train.steps == [float(s) for s in range(8)]
    assert train.values == pytest.approx([2.0 - 0.1 * s for s in range(8)])


def test_collect_panels_grpo_reward_band_and_sparse_eval():
    panels = collect_panels(_parse(grpo_rows(range(6))))
    assert _titles(panels) == {
        "Loss": ["train/loss"],
        "Reward": ["train/reward_mean"],  # reward_std is the band, not a curve
        "Accuracy": ["eval/accuracy"],
        "KL divergence": ["train/kl"],
        "Completion length": [
            "train/completion_length_mean", "train/completion_length_min", "train/completion_length_max",
        ],
        "Learning rate": ["train/lr"],
        "Gradient norm": ["train/grad_norm"],
    }
    reward = panels["Reward"][0]
    assert reward.values == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert reward.std == pytest.approx([0.05] * 6)
    ev = panels["Accuracy"][0]
    assert ev.steps == [2.0, 5.0] and ev.values == pytest.approx([0.27, 0.30])


def test_collect_panels_skips_blank_nan_and_text_and_uses_row_index_without_step():
    rows = [{"train/loss": "1.0"}, {"train/loss": "nan"}, {"train/loss": ""}, {"train/loss": "oops"},
            {"train/loss": "0.5"}, {"train/loss": "inf"}]
    (series,) = collect_panels(rows)["Loss"]
    assert series.steps == [0.0, 4.0] and series.values == [1.0, 0.5]
    # a std column without a mean sibling stays a curve of its own
    lone = collect_panels([{"step": "1", "train/reward_std": "0.2"}])
    assert _titles(lone) == {"Reward": ["train/reward_std"]}


# ------------------------------------------------------------------------------------------------ finding / joining
def test_resumed_versions_are_joined_by_step(tmp_path):
    run = tmp_path / "csv"
    _write_csv(run / "version_0" / "metrics.csv", sft_rows(range(0, 8)))
    # resumed from the checkpoint of step 5: version_1 re-logs steps 6, 7 with different values
    resumed = [dict(r, **{"train/loss": 9.0}) if "train/loss" in r else r for r in sft_rows(range(6, 12))]
    _write_csv(run / "version_1" / "metrics.csv", resumed)
    rows, files = load_metrics(run)
    assert [f.parent.name for f in files] == ["version_0", "version_1"]
    train_loss = collect_panels(rows)["Loss"][0]
    loss = dict(zip(train_loss.steps, train_loss.values))
    assert sorted(loss) == [float(s) for s in range(12)]
    assert [loss[s] for s in (5.0, 6.0, 7.0, 11.0)] == pytest.approx([1.5, 9.0, 9.0, 9.0])
    # explicit version: no joining
    rows0, files0 = load_metrics(run, version=0)
    assert [f.parent.name for f in files0] == ["version_0"] and len(rows0) == len(sft_rows(range(8)))
    with pytest.raises(FileNotFoundError, match=r"no version_7/metrics.csv .*versions found: \[0, 1\]"):
        load_metrics(run, version=7)


@pytest.mark.parametrize("case", ["fresh_rerun", "other_hparams"])
def test_unrelated_versions_are_not_joined(tmp_path, case):
    run = tmp_path / "lightning_logs"
    _write_csv(run / "version_0" / "metrics.csv", sft_rows(range(0, 8)))
    newer = sft_rows(range(0, 4)) if case == "fresh_rerun" else sft_rows(range(6, 12))
    _write_csv(run / "version_1" / "metrics.csv", newer, hparams="lr: 0.1\n" if case == "other_hparams" else None)
    rows, files = load_metrics(run)
    assert [f.parent.name for f in files] == ["version_1"]
    assert len(rows) == len(newer)


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
    _write_csv(tmp_path / "runs" / "grpo" / "csv" / "version_0" / "metrics.csv", grpo_rows(range(2)))
    with pytest.raises(ValueError, match=r"holds 2 runs with a metrics.csv .*pass one of them as LOG_DIR"):
        find_metrics_files(tmp_path / "runs")


# ------------------------------------------------------------------------------------------------ the PNG
def _png_text(path: Path) -> dict[str, str]:
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return {"size": im.size, **im.text}


def test_plot_grpo_run_writes_png_with_expected_panels(tmp_path):
    root = tmp_path / "grpo_run"
    _write_csv(root / "csv" / "version_0" / "metrics.csv", grpo_rows(range(0, 20)))
    _write_csv(root / "csv" / "version_1" / "metrics.csv", grpo_rows(range(15, 40)))
    out = plot_training_curves(root)
    assert out == root / "training_curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    info = _png_text(out)
    assert info["Description"] == (
        "panels: Loss; Reward; Accuracy; KL divergence; Completion length; Learning rate; Gradient norm"
    )
    assert info["Title"] == "Training curves: grpo_run/csv (version_0, version_1)"
    assert info["size"][0] > 1000 and info["size"][1] > 1000  # 2 columns x 4 rows at 110 dpi
    assert sorted(p.name for p in root.iterdir()) == ["csv", "training_curves.png"]  # no temp file left


def test_plot_sft_run_custom_out_and_main(tmp_path, capsys):
    log = _write_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", sft_rows(range(10)))
    out = plot_training_curves(log, tmp_path / "figs" / "sft.png")
    assert out == tmp_path / "figs" / "sft.png" and out.read_bytes()[:8] == PNG_MAGIC
    assert _png_text(out)["Description"] == "panels: Loss; Accuracy; Learning rate; Gradient norm"

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
