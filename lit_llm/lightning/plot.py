"""Training-curve PNG from a Lightning ``CSVLogger`` run (``lit-llm plot LOG_DIR``).

Lightning's ``CSVLogger`` writes ``<save_dir>/<name>/version_<N>/metrics.csv``: one row per logging call, with
only the columns logged by that call filled (the file is *sparse*), plus ``step`` (the optimizer step, Lightning's
``global_step``) and ``epoch``. This module reads that file with the :mod:`csv` module, groups its columns into
panels by substring (so any prefix works: ``train/``, ``val/``, ``eval/``, ``rollout/``...) and draws one panel per
group that has data:

* **Loss** (per-token loss): names containing ``loss`` (``train/loss``, ``train/loss_step``, ``val/loss``).
* **Reward** (reward-function units): names containing ``reward``; a ``*std*`` column is drawn as a ±1 std band
  around its ``*mean*`` sibling (``train/reward_std`` around ``train/reward_mean``).
* **Accuracy** (fraction, 0-1): ``accuracy`` or the word ``acc`` (``train/token_accuracy``, ``eval/accuracy``).
* **KL divergence** (nats/token): the word ``kl`` (``train/kl``, ``train/kl_mean``).
* **Completion length** (tokens): ``length`` or the word ``len`` (``train/completion_length_mean/min/max``).
* **Learning rate**: the word ``lr`` or ``learning_rate`` (``train/lr``, ``lr-AdamW``).
* **Gradient norm** (L2, before clipping): ``grad`` and ``norm`` (``train/grad_norm``).

Matching is case-insensitive; a "word" is a run of ``[a-z0-9]`` in the name. A column goes to the first panel of
this order that matches it: reward, accuracy, KL, length, learning rate, gradient norm, loss (so ``train/kl_loss``
is a KL curve, ``train/reward_loss`` a reward curve). Columns that match no panel (``train/ppl``, ``train/tokens``...)
are not drawn. The x axis is ``step``.

Usage::

    python -m lit_llm.lightning.plot lightning_logs            # -> lightning_logs/training_curves.png
    python -m lit_llm.lightning.plot runs/sft --out curves.png --version 3
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PANEL_SPECS",
    "Series",
    "collect_panels",
    "command",
    "find_metrics_files",
    "load_metrics",
    "main",
    "panel_for",
    "plot_training_curves",
]

_STEP, _EPOCH = "step", "epoch"
_VERSION_RE = re.compile(r"^version_(\d+)$")


def _words(column: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", column.lower()) if w]


@dataclass(frozen=True)
class _PanelSpec:
    """One panel: its title, y-axis label and the rule that claims a column."""

    title: str
    """Panel title (also the key of :func:`collect_panels`)."""
    ylabel: str
    """Y-axis label, with the unit."""
    substrings: tuple[str, ...] = ()
    """The column belongs here when its lower-cased name contains any of these..."""
    words: tuple[str, ...] = ()
    """...or when one of its ``[a-z0-9]+`` words equals one of these..."""
    all_of: tuple[str, ...] = ()
    """...or when it contains all of these substrings."""

    def claims(self, column: str) -> bool:
        name = column.lower()
        return (
            any(s in name for s in self.substrings)
            or any(w in self.words for w in _words(name))
            or (bool(self.all_of) and all(s in name for s in self.all_of))
        )


PANEL_SPECS: tuple[_PanelSpec, ...] = (
    _PanelSpec("Loss", "loss (per token)", substrings=("loss",)),
    _PanelSpec("Reward", "reward (mean ± 1 std over completions)", substrings=("reward",)),
    _PanelSpec("Accuracy", "accuracy (fraction, 0–1)", substrings=("accuracy",), words=("acc",)),
    _PanelSpec("KL divergence", "KL to reference (nats/token)", words=("kl",)),
    _PanelSpec("Completion length", "length (tokens)", substrings=("length",), words=("len",)),
    _PanelSpec("Learning rate", "learning rate", substrings=("learning_rate",), words=("lr",)),
    _PanelSpec("Gradient norm", "gradient L2 norm (before clipping)", all_of=("grad", "norm")),
)
"""Panels in display order; see the module docstring for the matching rules."""

# First match wins in this order (more specific groups before the generic "loss").
_MATCH_ORDER = ("Reward", "Accuracy", "KL divergence", "Completion length", "Learning rate", "Gradient norm", "Loss")
_SPEC_BY_TITLE = {s.title: s for s in PANEL_SPECS}


@dataclass
class Series:
    """One curve of a panel.

    Attributes:
        name: the CSV column (the legend label).
        steps: x values, the optimizer step of each point, increasing.
        values: y values, finite floats, same length as ``steps``.
        std: standard deviations at the same points (drawn as a ``values ± std`` band), or ``None``. Comes from the
            sibling column whose name has ``std`` in place of the last ``mean`` (``train/reward_mean`` ->
            ``train/reward_std``); NaN where that column has no value at the step.
    """

    name: str
    steps: list[float]
    values: list[float]
    std: list[float] | None = None


def panel_for(column: str) -> str | None:
    """Title of the panel that draws ``column``, or ``None`` (``step``, ``epoch`` and unmatched columns)."""
    if column in (_STEP, _EPOCH):
        return None
    for title in _MATCH_ORDER:
        if _SPEC_BY_TITLE[title].claims(column):
            return title
    return None


def _to_float(value: object) -> float | None:
    if value is None or value == "":
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _std_partner(column: str, columns: Iterable[str]) -> str | None:
    idx = column.rfind("mean")
    if idx < 0:
        return None
    partner = column[:idx] + "std" + column[idx + 4 :]
    return partner if partner in columns else None


def collect_panels(rows: Sequence[Mapping[str, object]]) -> dict[str, list[Series]]:
    """Group the numeric columns of sparse metric rows into panels.

    Args:
        rows: metric rows as :class:`csv.DictReader` gives them (values are strings, ``""`` when the row does not
            log that column) or already numbers. The x value of a row is its ``step``; when no row has a ``step``,
            the row index is used. Rows without a step (when others have one), empty, non-numeric and non-finite
            values are skipped.

    Returns:
        ``{panel title: [Series, ...]}`` in :data:`PANEL_SPECS` order, only panels with at least one point; series
        in column order, each sorted by step. A ``*std*`` column whose ``*mean*`` sibling exists is folded into that
        series as its band instead of being a curve of its own.
    """
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key is not None and key not in columns:
                columns.append(key)
    has_step = any(_to_float(row.get(_STEP)) is not None for row in rows)

    points: dict[str, dict[float, float]] = {c: {} for c in columns}
    for i, row in enumerate(rows):
        x = _to_float(row.get(_STEP)) if has_step else float(i)
        if x is None:
            continue
        for c in columns:
            y = _to_float(row.get(c))
            if y is not None:
                points[c][x] = y  # a later row at the same step wins (e.g. a resumed version)

    std_of = {c: p for c in columns if (p := _std_partner(c, columns)) is not None and points[p]}
    folded = set(std_of.values())
    panels: dict[str, list[Series]] = {}
    for c in columns:
        title = panel_for(c)
        if title is None or c in folded or not points[c]:
            continue
        steps = sorted(points[c])
        std = None
        if c in std_of:
            stds = points[std_of[c]]
            std = [stds.get(s, math.nan) for s in steps]
        panels.setdefault(title, []).append(Series(c, steps, [points[c][s] for s in steps], std))
    order = [s.title for s in PANEL_SPECS]
    return {t: panels[t] for t in order if t in panels}


# ---------------------------------------------------------------------------------------------------- finding logs
def _version_number(path: Path) -> int | None:
    m = _VERSION_RE.match(path.name)
    return int(m.group(1)) if m else None


def find_metrics_files(log_dir: str | Path) -> list[Path]:
    """All ``metrics.csv`` of one run, oldest version first.

    ``log_dir`` may be the ``metrics.csv`` itself, a ``version_N`` folder, the folder holding ``version_*``
    folders (``lightning_logs``, ``<save_dir>/<name>``), or a folder above exactly one such run (the trainer's
    ``default_root_dir``).

    Raises:
        FileNotFoundError: ``log_dir`` does not exist, or holds no ``metrics.csv``.
        ValueError: ``log_dir`` holds several unrelated runs (it names them; pass one of them).
    """
    root = Path(log_dir)
    if not root.exists():
        raise FileNotFoundError(f"log_dir {str(root)!r} does not exist; pass the folder the run logged to.")
    if root.is_file():
        return [root]
    if (root / "metrics.csv").is_file():
        return [root / "metrics.csv"]
    versions = sorted(
        (p for p in root.glob("version_*/metrics.csv") if _version_number(p.parent) is not None),
        key=lambda p: _version_number(p.parent),  # type: ignore[arg-type,return-value]
    )
    if versions:
        return versions
    found = sorted(root.rglob("metrics.csv"))
    runs = sorted({p.parent.parent if _version_number(p.parent) is not None else p.parent for p in found})
    if len(runs) == 1:
        return find_metrics_files(runs[0])
    if len(runs) > 1:
        listed = ", ".join(str(r) for r in runs)
        raise ValueError(f"log_dir {str(root)!r} holds {len(runs)} runs with a metrics.csv ({listed}); "
                         "pass one of them as LOG_DIR.")
    raise FileNotFoundError(
        f"no metrics.csv found in {str(root)!r} (nor in its version_* folders or subfolders). The run must log with "
        "Lightning's CSVLogger: `lit-llm fit` adds one under <trainer.default_root_dir>/csv unless --trainer.logger "
        "replaces the default loggers; then make --trainer.logger include one (YAML: `trainer: {logger: "
        "[{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: runs/x}}]}`) and pass its folder "
        "as LOG_DIR."
    )


def _read_csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="", encoding="utf-8") as f:
        return [dict(row) for row in csv.DictReader(f)]


def _steps(rows: list[dict[str, str]]) -> list[float]:
    return [x for r in rows if (x := _to_float(r.get(_STEP))) is not None]


def _hparams(metrics_file: Path) -> str | None:
    h = metrics_file.parent / "hparams.yaml"
    return h.read_text(encoding="utf-8") if h.is_file() else None


def load_metrics(log_dir: str | Path, version: int | None = None) -> tuple[list[dict[str, str]], list[Path]]:
    """Read the metric rows of the newest run under ``log_dir``, joining the versions of a resumed run.

    Lightning starts a new ``version_N`` folder when a run is resumed from a checkpoint. Going back from the newest
    version, an older version is joined in front when it started at an earlier step (a fresh re-run starts at the
    same step as the old one) and its ``hparams.yaml`` is identical (when both have one); its rows from the step the
    newer version starts at onward are dropped (the resumed version re-logged them).

    Args:
        log_dir: see :func:`find_metrics_files`.
        version: read only ``version_<version>`` (no joining); default: automatic as above.

    Returns:
        ``(rows, files)``: the rows (``csv.DictReader`` dicts, in step order across versions) and the files read,
        oldest first.

    Raises:
        FileNotFoundError: no ``metrics.csv`` (see :func:`find_metrics_files`) or no ``version_<version>``.
    """
    files = find_metrics_files(log_dir)
    if version is not None:
        chosen = [f for f in files if _version_number(f.parent) == version]
        if not chosen:
            have = sorted(v for f in files if (v := _version_number(f.parent)) is not None)
            raise FileNotFoundError(f"no version_{version}/metrics.csv under {str(log_dir)!r}; versions found: "
                                    f"{have or 'none'}. Pass one of them as --version, or omit it.")
        return _read_csv(chosen[0]), chosen

    chain = [files[-1]]
    chunks = [_read_csv(files[-1])]
    for older in reversed(files[:-1]):
        newer_steps = _steps(chunks[0])
        older_rows = _read_csv(older)
        older_steps = _steps(older_rows)
        if not newer_steps or not older_steps or min(older_steps) >= min(newer_steps):
            break
        h_old, h_new = _hparams(older), _hparams(chain[0])
        if h_old is not None and h_new is not None and h_old != h_new:
            break
        start = min(newer_steps)
        chunks.insert(0, [r for r in older_rows if (x := _to_float(r.get(_STEP))) is None or x < start])
        chain.insert(0, older)
    return [r for chunk in chunks for r in chunk], chain


# ---------------------------------------------------------------------------------------------------- drawing
def _draw(panels: dict[str, list[Series]], out: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels)
    ncols = 1 if n == 1 else 2
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(6.0 * ncols, 3.4 * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (panel, series) in zip(axes, panels.items()):
        spec = _SPEC_BY_TITLE[panel]
        for s in series:
            few = len(s.steps) <= 30
            bound = _words(s.name)[-1:] in (["min"], ["max"])  # extremes dashed, thinner than the mean
            (line,) = ax.plot(s.steps, s.values, label=s.name, linewidth=0.9 if bound else 1.3,
                              linestyle="--" if bound else "-", marker="o" if few else None, markersize=3.5)
            if s.std is not None:
                lo = [v - d for v, d in zip(s.values, s.std)]
                hi = [v + d for v, d in zip(s.values, s.std)]
                # the band shares its line's colour; the y label says "± 1 std", so no legend entry of its own
                ax.fill_between(s.steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0, label="_nolegend_")
        ax.set_title(panel)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(spec.ylabel)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        if len(series) > 4:  # a crowded legend goes under the panel, where it cannot hide the curves
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2)
        else:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[n:]:
        ax.set_visible(False)

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110,
                        metadata={"Title": title, "Description": "panels: " + "; ".join(panels)})
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_training_curves(log_dir: str | Path, out: str | Path | None = None, *, version: int | None = None) -> Path:
    """Write a PNG of the training curves of a ``CSVLogger`` run.

    One panel per group with data (see :data:`PANEL_SPECS`): loss (train and val), reward (mean ± std band),
    accuracy, KL, completion length, learning rate, gradient norm; x axis = optimizer step. The panel titles are
    also stored in the PNG's ``Description`` text chunk (``"panels: Loss; Reward; ..."``).

    Args:
        log_dir: the run's log folder (see :func:`find_metrics_files`); resumed versions are joined
            (see :func:`load_metrics`).
        out: PNG path; default ``<log_dir>/training_curves.png`` (next to ``metrics.csv`` when ``log_dir`` is
            the file). Parent folders are created. Written atomically (temporary file + rename): on error no
            partial file is left.
        version: plot only ``version_<version>``.

    Returns:
        The path of the PNG.

    Raises:
        FileNotFoundError: no ``metrics.csv`` under ``log_dir`` (the run must use Lightning's ``CSVLogger``).
        ValueError: the CSV has no plottable column (the message lists the columns found), or ``log_dir`` holds
            several runs.
    """
    rows, files = load_metrics(log_dir, version=version)
    panels = collect_panels(rows)
    if not panels:
        columns = sorted({k for r in rows for k in r if k is not None})
        raise ValueError(
            f"{', '.join(str(f) for f in files)} has no plottable column with data; columns found: "
            f"{columns or 'none (empty file)'}. Plotted columns contain one of: loss, reward, accuracy/acc, kl, "
            "length/len, lr/learning_rate, grad+norm (e.g. train/loss, val/loss, train/reward_mean)."
        )
    root = Path(log_dir)
    out_path = Path(out) if out is not None else (root.parent if root.is_file() else root) / "training_curves.png"
    versions = [f.parent.name for f in files if _version_number(f.parent) is not None]
    run_dir = files[-1].parent.parent if versions else files[-1].parent
    run = "/".join(run_dir.absolute().parts[-2:])  # e.g. "sft_tiny/csv": the logger folder alone is often just "csv"
    title = f"{run} ({', '.join(versions)})" if versions else run
    _draw(panels, out_path, f"Training curves: {title}")
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m lit_llm.lightning.plot LOG_DIR [--out PNG] [--version N]``.

    Prints the PNG path and returns 0; on a missing log or unplottable CSV prints ``error: ...`` to stderr and
    returns 1.
    """
    parser = argparse.ArgumentParser(
        prog="lit-llm plot",
        description="Write a PNG of the training curves (loss, reward, accuracy, KL, lengths, lr, grad norm) of a "
        "run logged with Lightning's CSVLogger.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the CSVLogger folder (holding metrics.csv or version_*)")
    parser.add_argument("--out", metavar="PNG", default=None, help="output path (default LOG_DIR/training_curves.png)")
    parser.add_argument("--version", type=int, default=None, help="plot only version_N (default: newest run)")
    args = parser.parse_args(argv)
    try:
        path = plot_training_curves(args.log_dir, args.out, version=args.version)
    except (FileNotFoundError, ValueError) as e:
        print(f"lit-llm plot: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def command(argv: Sequence[str]) -> None:
    """:func:`main` with the ``lit-llm`` subcommand signature: raises ``SystemExit(1)`` on error."""
    rc = main(argv)
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    sys.exit(main())
