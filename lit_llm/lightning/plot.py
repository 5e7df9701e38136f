"""Training-curve PNG from a Lightning ``CSVLogger`` run (``lit-llm plot LOG_DIR``).

Lightning's ``CSVLogger`` writes ``<save_dir>/<name>/version_<N>/metrics.csv``: one row per logging call, with
only the columns logged by that call filled (the file is *sparse*), plus ``step`` and ``epoch``. ``step`` is
``global_step``, the optimizer steps done, as progress lines and ``eval_samples.csv`` count them: a step's training
metrics at the step it completes (the first at 1), the evaluation after step N at N, the pre-training evaluation and
the ``data/*`` counts at 0 (the lit-llm modules log an explicit ``step``; Lightning's default for manual optimization
would be one less). ``lit-llm validate`` logs at the checkpoint's step; such an evaluation-only version adds its
points to the eval panels (later wins) and is no new run.

A run resumed with ``--ckpt_path`` gets a new ``version_N`` folder; this module joins
the versions of one run into one curve per metric (:func:`load_metrics`: where steps overlap after a resume, the
later version wins) and draws **one panel per concept** (:data:`PANEL_SPECS`, in this order):

=================================  =====================================================================  ==========
panel                              columns (regular expression searched in the name)                      unit
=================================  =====================================================================  ==========
Eval accuracy (greedy)             ``eval/<reward fn>``: greedy evaluation on held-out prompts            reward
Reward                             ``train/reward`` with a ±1 std band from ``train/reward_std``          reward
Reward per function                ``train/rewards/<fn>/mean`` with a ±1 std band from ``.../std``         reward
Loss                               ``train/loss``, ``train/nll``, ``val/loss``                            per token
Token accuracy                     ``train/token_accuracy``, ``val/token_accuracy``                       fraction
Sampler/trainer mismatch           any name with ``mismatch`` (``train/mismatch_kl``...)                  nats, ratio
KL to reference                    ``train/kl``                                                           nats/token
Entropy                            ``train/entropy``, ``val/entropy``                                     nats/token
Policy ratio                       ``train/ratio_{mean,min,max}`` (π_θ / π_old)                           ratio
Clip ratios                        ``train/clip_ratio/{low,high,region}_mean``                            fraction
Completion length                  ``train/completions/{mean,min,max}_length``                            tokens
Zero-std groups, truncation        ``train/frac_reward_zero_std``, ``train/completions/clipped_ratio``    fraction
Dynamic sampling                   ``train/sampling_rounds`` (``dynamic_sampling``: rollouts per step)     count
Episode rates                      ``train/episodes/{tool_call_rate,tool_success_rate,truncated[/...]}``  fraction
Episode tokens                     ``train/episodes/{sampled,env}_tokens_mean``                           tokens
Reward by turn count               ``train/reward_by_turns/<k>``                                          reward
Episodes                           other names with ``turns``/``tool_calls``/``episode`` (turns_mean...)  count
Throughput                         ``*tokens_per_sec`` (``train/``, ``rollout/``, ``train/real_``)         tokens/s
Time per step                      ``time/*`` (generation, rollout wait, training, step, tools, env...)   s
Async rollouts                     ``train/staleness``, ``train/dropped_rollouts``                        steps, count
Gradient norm                      ``train/grad_norm``                                                    L2 norm
Learning rate                      ``train/lr``, ``lr-<Optimizer>`` (LearningRateMonitor)                 lr
Skipped steps                      ``train/skipped_steps`` (non-finite steps skipped)                     count
Host memory                        ``memory/host_rss_gib``, ``memory/host_peak_rss_gib``                  GiB
=================================  =====================================================================  ==========

A column goes to the first spec of that list whose pattern it matches; a spec's named group ``label`` (when it has
one) is the legend label. A column named like a mean's standard deviation (``X_std`` or ``X/std`` beside ``X`` or
``X/mean``) is drawn as the ±1 std band of that mean, not as a curve.

**Left out on purpose** (:data:`IGNORED`): ``step``, ``epoch``, ``*/ppl`` (``exp`` of the per-token loss: the loss
curve on another scale), ``*/tokens`` and ``*/step_tokens`` (token counts: cumulative or per batch, not a training
signal).

**Any other column** (a metric no spec knows yet) gets a panel of its own, titled with the column name, after the
known panels: a new metric is never hidden, and no panel mixes unknown units. To group it with others, add a
:class:`PanelSpec` to :data:`PANEL_SPECS`.

**Constants**: a panel whose every series is constant (one value throughout, or a single point: a fixed learning
rate, ``train/staleness`` of a synchronous run) is not drawn; its columns and values are listed under the figure
(and returned in :attr:`CurvesPlot.constants`). The x axis is the optimizer step with integer ticks, shared by all
panels; a dotted vertical line marks the step where each resumed version starts.

Usage::

    lit-llm plot runs/grpo_tiny                  # -> runs/grpo_tiny/training_curves.png
    lit-llm plot runs/sft/csv --out curves.png --version 3
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "IGNORED",
    "PANEL_SPECS",
    "CurvesPlot",
    "PanelSpec",
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


@dataclass(frozen=True)
class PanelSpec:
    """One panel: its title, y-axis label and the columns it draws.

    Attributes:
        title: panel title (the key of :func:`collect_panels`' result).
        ylabel: y-axis label, with the unit.
        pattern: regular expression searched (:func:`re.search`) in the column name; a named group ``label``, when
            present and matched, is the legend label (default: the column name).
    """

    title: str
    ylabel: str
    pattern: str

    def match(self, column: str) -> re.Match[str] | None:
        """The match of :attr:`pattern` in ``column``, or ``None``."""
        return re.search(self.pattern, column)


PANEL_SPECS: tuple[PanelSpec, ...] = (
    PanelSpec("Eval accuracy (greedy)", "mean reward of greedy completions", r"^eval/(?P<label>.+)$"),
    PanelSpec("Reward", "reward (mean ± 1 std over completions)", r"^(?P<label>(train|rollout)/reward)(_std)?$"),
    PanelSpec("Reward per function", "reward (mean ± 1 std over completions)",
              r"^train/rewards/(?P<label>.+)/(mean|std)$"),
    PanelSpec("Loss", "loss (per token)", r"(^|/)(loss|nll)(_step|_epoch)?$"),
    PanelSpec("Token accuracy", "next-token accuracy (fraction)", r"(^|/)token_accuracy$"),
    PanelSpec("Sampler/trainer mismatch", "KL (nats/token) / ratio", r"mismatch"),
    PanelSpec("KL to reference", "KL (nats/token)", r"(^|/)kl$"),
    PanelSpec("Entropy", "entropy (nats/token)", r"(^|/)entropy$"),
    PanelSpec("Policy ratio", "π_θ / π_old over completion tokens", r"(^|/)ratio_(mean|min|max)$"),
    PanelSpec("Clip ratios", "fraction of completion tokens", r"(^|/)clip_ratio/(?P<label>.+)$"),
    PanelSpec("Completion length", "length (tokens)", r"(^|/)completions/(?P<label>(mean|min|max)_length)$"),
    PanelSpec("Zero-std groups, truncation", "fraction (groups / completions)",
              r"(^|/)(frac_reward_zero_std|completions/clipped_ratio)$"),
    PanelSpec("Dynamic sampling", "rollouts per step", r"(^|/)sampling_rounds$"),
    PanelSpec("Episode rates", "fraction of episodes / of tool calls",
              r"^train/episodes/(?P<label>(tool_call_rate|tool_success_rate|truncated(/.+)?))$"),
    PanelSpec("Episode tokens", "tokens per episode", r"^train/episodes/(?P<label>(sampled|env)_tokens_mean)$"),
    PanelSpec("Reward by turn count", "mean reward of the episodes with k turns",
              r"^train/reward_by_turns/(?P<label>.+)$"),
    PanelSpec("Episodes", "count per episode", r"^(?!time/)(.*[/_])?(turns?|tool_calls?|episodes?)([/_]|$)"),
    PanelSpec("Throughput", "tokens / s", r"tokens_per_sec$"),
    PanelSpec("Time per step", "seconds", r"^time/(?P<label>.+)$"),
    PanelSpec("Async rollouts", "steps behind / rollouts dropped", r"(^|/)(staleness|dropped_rollouts)$"),
    PanelSpec("Gradient norm", "gradient L2 norm (before clipping)", r"(^|/)grad_norm$"),
    PanelSpec("Learning rate", "learning rate", r"((^|/)lr$|(^|/)learning_rate$|^lr-)"),
    PanelSpec("Skipped steps", "non-finite steps skipped (cumulative)", r"(^|/)skipped_steps$"),
    PanelSpec("Host memory", "resident set (GiB)", r"^memory/(?P<label>host_(peak_)?rss_gib)$"),
)
"""Panels in display order; a column goes to the first that matches (see the module docstring)."""

IGNORED: str = r"^(step|epoch)$|(^|/)(ppl|tokens|step_tokens)$"
"""Columns never drawn (regular expression): the step/epoch axes, perplexity (exp of the loss), token counts."""

_SPEC_BY_TITLE = {s.title: s for s in PANEL_SPECS}


@dataclass
class Series:
    """One curve of a panel.

    Attributes:
        name: the CSV column.
        label: the legend label (the spec's ``label`` group, else ``name``).
        steps: x values, the optimizer step of each point, increasing.
        values: y values, finite floats, same length as ``steps``.
        std: standard deviations at the same points (drawn as a ``values ± std`` band), or ``None``; NaN where
            the std column has no value at that step.
    """

    name: str
    label: str
    steps: list[float]
    values: list[float]
    std: list[float] | None = None

    @property
    def is_constant(self) -> bool:
        """One value throughout (or a single point), band included."""
        same = all(v == self.values[0] for v in self.values)
        if self.std is not None:
            same = same and all(d == self.std[0] or (math.isnan(d) and math.isnan(self.std[0])) for d in self.std)
        return same


def panel_for(column: str) -> str | None:
    """Title of the panel that draws ``column``: a :data:`PANEL_SPECS` title, the column name itself for a column no
    spec matches, or ``None`` for an :data:`IGNORED` column."""
    if re.search(IGNORED, column):
        return None
    for spec in PANEL_SPECS:
        if spec.match(column):
            return spec.title
    return column


def _label(column: str, title: str) -> str:
    spec = _SPEC_BY_TITLE.get(title)
    m = spec.match(column) if spec is not None else None
    if m is not None and "label" in m.re.groupindex and m.group("label"):
        return m.group("label")
    return column


def _to_float(value: object) -> float | None:
    if value is None or value == "":
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _mean_of(column: str, columns: Sequence[str]) -> str | None:
    """The mean column whose ±std band ``column`` is: ``X_std`` -> ``X`` / ``X_mean``, ``X/std`` -> ``X/mean`` /
    ``X``; ``None`` when ``column`` is no std or no such mean exists."""
    for sep in ("_", "/"):
        if column.endswith(sep + "std"):
            base = column[: -len(sep + "std")]
            for mean in (base + sep + "mean", base):
                if mean in columns:
                    return mean
    return None


def collect_panels(rows: Sequence[Mapping[str, object]]) -> dict[str, list[Series]]:
    """Group the numeric columns of sparse metric rows into panels, one curve per column.

    Args:
        rows: metric rows as :class:`csv.DictReader` gives them (values are strings, ``""`` when the row does not
            log that column) or already numbers, in logging order (for a resumed run: oldest version first, as
            :func:`load_metrics` returns them). The x value of a row is its ``step``; when no row has a ``step``,
            the row index is used. Rows without a step (when others have one), empty, non-numeric and non-finite
            values are skipped. Where several rows give one column a value at the same step, the **last** wins
            (a resumed version re-logging a step).

    Returns:
        ``{panel title: [Series, ...]}``: the :data:`PANEL_SPECS` panels with data in their order, then one panel
        per unknown column (titled with its name) in column order; series in column order, each sorted by step.
        A std column whose mean exists in the same panel is that series' band, not a curve. Constant panels are
        still here (:func:`plot_training_curves` leaves them out of the figure).
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
                points[c][x] = y

    title_of = {c: t for c in columns if points[c] and (t := panel_for(c)) is not None}
    band_of = {mean: c for c in title_of if (mean := _mean_of(c, list(title_of))) and title_of[mean] == title_of[c]}
    folded = set(band_of.values())
    panels: dict[str, list[Series]] = {}
    for c, title in title_of.items():
        if c in folded:
            continue
        steps = sorted(points[c])
        std = None
        if c in band_of:
            stds = points[band_of[c]]
            std = [stds.get(s, math.nan) for s in steps]
        panels.setdefault(title, []).append(Series(c, _label(c, title), steps, [points[c][s] for s in steps], std))
    known = [s.title for s in PANEL_SPECS if s.title in panels]
    return {t: panels[t] for t in known + [t for t in panels if t not in _SPEC_BY_TITLE]}


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


_SETUP_COLUMN = r"^data/"
"""Columns a run logs once at setup (data counts), not at a training step: they do not mark where a version starts."""
_EVAL_COLUMN = r"^(eval|val|test)/"
"""Evaluation columns: a version with only these (and setup columns) is a ``validate`` / ``test`` run's."""


def _logged(row: Mapping[str, object]) -> list[str]:
    """The columns ``row`` gives a value (``step`` and ``epoch`` left out)."""
    return [k for k, v in row.items() if k not in (_STEP, _EPOCH) and k is not None and _to_float(v) is not None]


def _steps(rows: list[dict[str, str]]) -> list[float]:
    """Steps of the rows that log something besides setup columns (``data/*``): where a version starts."""
    return [x for r in rows if (x := _to_float(r.get(_STEP))) is not None
            and any(not re.search(_SETUP_COLUMN, c) for c in _logged(r))]


def _is_evaluation_only(rows: list[dict[str, str]]) -> bool:
    """A version with evaluation columns and no training column (``lit-llm validate`` / ``test`` into a run's
    folder)."""
    cols = {c for r in rows for c in _logged(r) if not re.search(_SETUP_COLUMN, c)}
    return bool(cols) and all(re.search(_EVAL_COLUMN, c) for c in cols)


def _hparams(metrics_file: Path) -> str | None:
    h = metrics_file.parent / "hparams.yaml"
    return h.read_text(encoding="utf-8") if h.is_file() else None


def _resumed(metrics_file: Path) -> bool | None:
    """Whether the version was started with a ``ckpt_path`` (from the ``config.yaml`` ``lit-llm fit`` saves next to
    the metrics); ``None`` when there is no such file or key (a run outside ``lit-llm``)."""
    cfg = metrics_file.parent / "config.yaml"
    if not cfg.is_file():
        return None
    m = re.search(r"^ckpt_path:[ \t]*(.*?)[ \t]*$", cfg.read_text(encoding="utf-8"), re.MULTILINE)
    if m is None:
        return None
    return m.group(1).strip("'\"") not in ("", "null", "~", "None")


def load_metrics(log_dir: str | Path, version: int | None = None) -> tuple[list[dict[str, str]], list[Path]]:
    """Read the metric rows of the newest run under ``log_dir``, joining the versions of a resumed run.

    Lightning starts a new ``version_N`` folder when a run is resumed from a checkpoint. Going back from the newest
    version, an older version is joined in front when the newer one is its continuation: the newer version starts
    at a later step than the older one did (a fresh re-run starts again at step 0), and it was resumed — its
    ``config.yaml`` (saved by ``lit-llm fit``) has a ``ckpt_path``; without a ``config.yaml``, the two
    ``hparams.yaml`` must be identical (when both exist). Where the steps overlap, the later version wins: of the
    older version, the rows after the newer version's first step are dropped (they belong to the abandoned part of
    the run), and at that first step the newer version's values replace the older ones column by column
    (:func:`collect_panels` keeps the last value per step).

    Args:
        log_dir: see :func:`find_metrics_files`.
        version: read only ``version_<version>`` (no joining); default: automatic as above.

    Returns:
        ``(rows, files)``: the rows (``csv.DictReader`` dicts, oldest version first) and the files read, oldest
        first.

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
    rows, chain, _ = _join_versions(files)
    return rows, chain


def _join_versions(files: list[Path]) -> tuple[list[dict[str, str]], list[Path], list[float]]:
    """:func:`load_metrics`' joining; also returns the first step of each joined version after the oldest.

    Evaluation-only versions (:func:`_is_evaluation_only`: ``lit-llm validate`` into the run's folder) take no part
    in the chain: the training versions are joined, then the rows of every evaluation-only version newer than the
    chain's oldest are appended (their points land on the eval panels at their step; later wins)."""
    evaluations = [f for f in files if _is_evaluation_only(_read_csv(f))]
    training = [f for f in files if f not in evaluations]
    if not training:  # nothing but evaluations: the newest alone, as before
        return _read_csv(files[-1]), [files[-1]], []
    rows, chain, starts = _join_training(training)
    first = files.index(chain[0])
    extra = [f for f in evaluations if files.index(f) > first]
    rows = rows + [r for f in extra for r in _read_csv(f)]
    return rows, sorted(chain + extra, key=files.index), starts


def _join_training(files: list[Path]) -> tuple[list[dict[str, str]], list[Path], list[float]]:
    chain = [files[-1]]
    chunks = [_read_csv(files[-1])]
    starts: list[float] = []
    for older in reversed(files[:-1]):
        newer_steps = _steps(chunks[0])
        older_rows = _read_csv(older)
        older_steps = _steps(older_rows)
        if not newer_steps or not older_steps or min(older_steps) >= min(newer_steps):
            break
        resumed = _resumed(chain[0])
        if resumed is False:
            break
        if resumed is None:
            h_old, h_new = _hparams(older), _hparams(chain[0])
            if h_old is not None and h_new is not None and h_old != h_new:
                break
        start = min(newer_steps)
        chunks.insert(0, [r for r in older_rows if (x := _to_float(r.get(_STEP))) is None or x <= start])
        chain.insert(0, older)
        starts.insert(0, start)
    return [r for chunk in chunks for r in chunk], chain, starts


# ---------------------------------------------------------------------------------------------------- drawing
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

    One panel per concept with data (:data:`PANEL_SPECS`, then one per unknown column), constant panels left out
    and listed under the figure; x axis = optimizer step (integer ticks, shared). The panel titles are also stored
    in the PNG's ``Description`` text chunk (``"panels: Eval accuracy (greedy); Reward; ..."``).

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


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``lit-llm plot LOG_DIR [--out PNG] [--version N]``.

    Prints the PNG path and returns 0; on a missing log or unplottable CSV prints ``lit-llm plot: error: ...`` to
    stderr and returns 1.
    """
    parser = argparse.ArgumentParser(
        prog="lit-llm plot",
        description="Write a PNG of the training curves of a run logged with Lightning's CSVLogger: one panel per "
        "concept (eval accuracy, reward ± std, per-function rewards, loss, KL, entropy, clip ratios, completion "
        "length, throughput, ...); the versions of a resumed run are joined.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the run folder (trainer.default_root_dir), its CSVLogger "
                        "folder (holding version_*) or one metrics.csv")
    parser.add_argument("--out", metavar="PNG", default=None, help="output path (default LOG_DIR/training_curves.png)")
    parser.add_argument("--version", type=int, default=None,
                        help="plot only version_N (default: the newest run, its resumed versions joined)")
    args = parser.parse_args(argv)
    try:
        result = plot_training_curves(args.log_dir, args.out, version=args.version)
    except (FileNotFoundError, ValueError) as e:
        print(f"lit-llm plot: error: {e}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


def command(argv: Sequence[str]) -> None:
    """:func:`main` with the ``lit-llm`` subcommand signature: raises ``SystemExit(1)`` on error."""
    rc = main(argv)
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    sys.exit(main())
