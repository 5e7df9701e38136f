"""Drawing the training curves (:func:`plot_training_curves`): the panels with data, row by row, constant panels
left out and listed under the figure, dotted lines where resumed versions start; the PNG written atomically
(:class:`CurvesPlot` says what was written). matplotlib is imported only when drawing."""

from __future__ import annotations

import math
import os
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lit_llm.plot.logs import _join_versions, _version_number, find_metrics_files, load_metrics
from lit_llm.plot.panels import _SPEC_BY_TITLE, Series, collect_panels

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CurvesPlot", "plot_training_curves"]


@dataclass
class CurvesPlot:
    """What :func:`plot_training_curves` wrote.

    Attributes:
        path: the PNG.
        panels: ``{panel title: [Series, ...]}`` of the panels drawn, in figure order (row by row).
        constants: ``{column: value}`` of the columns left out as constant (listed under the figure).
        files: the ``metrics.csv`` files read, oldest version first.
        resumed_at: the first step of each version after the first (drawn as dotted vertical lines).
    """

    path: Path
    panels: dict[str, list[Series]]
    constants: dict[str, float] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    resumed_at: list[float] = field(default_factory=list)

    @property
    def titles(self) -> list[str]:
        """Panel titles in figure order."""
        return list(self.panels)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _figure(panels: dict[str, list[Series]], constants: dict[str, float], title: str,
            resumed_at: Sequence[float] = ()) -> Figure:
    """The figure: panels row by row (1, 2 or 3 columns), constants listed under it, a dotted vertical line where
    each resumed version starts."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(panels)
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(5.6 * ncols, 3.3 * nrows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
    for ax, (panel, series) in zip(axes, panels.items()):
        spec = _SPEC_BY_TITLE.get(panel)
        for s in series:
            few = len(s.steps) <= 30
            bound = s.name.endswith(("min", "max", "min_length", "max_length"))  # extremes dashed, thinner
            (line,) = ax.plot(s.steps, s.values, label=s.label, linewidth=0.9 if bound else 1.4,
                              linestyle="--" if bound else "-", marker="o" if few else None, markersize=3.5)
            if s.std is not None:
                lo = [v - d for v, d in zip(s.values, s.std)]
                hi = [v + d for v, d in zip(s.values, s.std)]
                # the band shares its line's colour; the y label says "± 1 std", so no legend entry of its own
                ax.fill_between(s.steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0, label="_nolegend_")
        for x in resumed_at:
            ax.axvline(x, color="0.45", linestyle=":", linewidth=1.0, label="_nolegend_")
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(spec.ylabel if spec is not None else panel, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides inner tick labels; keep them on every panel
        # no offset: a near-constant series (entropy 10.78980 .. 10.78981) reads 10.7898, not "1e-5+1.07898e1"
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
        if len(series) > 1 or series[0].label != panel:
            ax.legend(fontsize=7, loc="best")
    for ax in axes[:n]:
        ax.set_xlabel("optimizer step", fontsize=8)
    for ax in axes[n:]:
        ax.set_visible(False)
    if constants:
        listed = ", ".join(f"{c} = {_fmt(v)}" for c, v in constants.items())
        fig.supxlabel(textwrap.fill(f"Constant (no panel): {listed}", 40 * ncols), fontsize=8)
    return fig


def _save(fig: Figure, out: Path, metadata: dict[str, str]) -> None:
    """Write ``fig`` as a PNG at ``out`` atomically (temporary file in the same folder + rename), with the mode a plain
    ``open`` gives (``0o666`` less the umask: ``mkstemp`` makes 0600)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_training_curves(log_dir: str | Path, out: str | Path | None = None, *,
                         version: int | None = None) -> CurvesPlot:
    """Write a PNG of the training curves of a ``CSVLogger`` run.

    One panel per concept with data (:data:`~lit_llm.plot.panels.PANEL_SPECS`, then one per unknown column),
    constant panels left out and listed under the figure; x axis = optimizer step (integer ticks, shared). The panel
    titles are also stored in the PNG's ``Description`` text chunk (``"panels: Eval accuracy (greedy); Reward;
    ..."``).

    Args:
        log_dir: the run's log folder (see :func:`find_metrics_files`); the versions of a resumed run are joined
            (see :func:`load_metrics`).
        out: PNG path; default ``<log_dir>/training_curves.png`` (next to ``metrics.csv`` when ``log_dir`` is
            the file). Parent folders are created. Written atomically (temporary file + rename): on error no
            partial file is left.
        version: plot only ``version_<version>``.

    Returns:
        A :class:`CurvesPlot`: the PNG path, the panels drawn (titles and series), the constant columns left out
        and the files read.

    Raises:
        FileNotFoundError: no ``metrics.csv`` under ``log_dir`` (the run must use Lightning's ``CSVLogger``).
        ValueError: the CSV has no plottable column (the message lists the columns found), every plottable column
            is constant (the message lists them with their values), or ``log_dir`` holds several runs.
    """
    if version is None:
        rows, files, resumed_at = _join_versions(find_metrics_files(log_dir))
    else:
        (rows, files), resumed_at = load_metrics(log_dir, version=version), []
    collected = collect_panels(rows)
    if not collected:
        columns = sorted({k for r in rows for k in r if k is not None})
        raise ValueError(
            f"{', '.join(str(f) for f in files)} has no plottable column with data; columns found: "
            f"{columns or 'none (empty file)'}. Every numeric column is drawn except step, epoch, */ppl, */tokens "
            "and */step_tokens."
        )
    panels = {t: ss for t, ss in collected.items() if not all(s.is_constant for s in ss)}
    constants = {s.name: s.values[-1] for t, ss in collected.items() if t not in panels for s in ss}
    if not panels:
        listed = ", ".join(f"{c} = {_fmt(v)}" for c, v in constants.items())
        raise ValueError(f"{', '.join(str(f) for f in files)}: every plotted column is constant ({listed}); "
                         "there is no curve to draw. Train for more steps.")
    root = Path(log_dir)
    out_path = Path(out) if out is not None else (root.parent if root.is_file() else root) / "training_curves.png"
    versions = [f.parent.name for f in files if _version_number(f.parent) is not None]
    run_dir = files[-1].parent.parent if versions else files[-1].parent
    run = "/".join(run_dir.absolute().parts[-2:])  # e.g. "sft_tiny/csv": the logger folder alone is often just "csv"
    title = f"Training curves: {run} ({', '.join(versions)})" if versions else f"Training curves: {run}"
    metadata = {"Title": title, "Description": "panels: " + "; ".join(panels)}
    _save(_figure(panels, constants, title, resumed_at), out_path, metadata)
    return CurvesPlot(out_path, panels, constants, files, resumed_at)
