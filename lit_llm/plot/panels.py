"""Which metric column goes to which panel of the training-curve figure: :data:`PANEL_SPECS` (one panel per concept,
in display order; the table in the :mod:`lit_llm.plot` docstring), :data:`IGNORED`, and :func:`collect_panels`, the
sparse metric rows grouped into panels of :class:`Series` (a std column folded into its mean's band)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["IGNORED", "PANEL_SPECS", "PanelSpec", "Series", "collect_panels", "panel_for"]

_STEP, _EPOCH = "step", "epoch"


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
    PanelSpec("GPU memory", "allocated (GiB)", r"^memory/(?P<label>cuda_(allocated|peak)_gib)$"),
)
"""Panels in display order; a column goes to the first that matches (see the :mod:`lit_llm.plot` docstring)."""

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
            :func:`~lit_llm.plot.logs.load_metrics` returns them). The x value of a row is its ``step``; when no
            row has a ``step``, the row index is used. Rows without a step (when others have one), empty,
            non-numeric and non-finite values are skipped. Where several rows give one column a value at the same
            step, the **last** wins (a resumed version re-logging a step).

    Returns:
        ``{panel title: [Series, ...]}``: the :data:`PANEL_SPECS` panels with data in their order, then one panel
        per unknown column (titled with its name) in column order; series in column order, each sorted by step.
        A std column whose mean exists in the same panel is that series' band, not a curve. Constant panels are
        still here (:func:`~lit_llm.plot.draw.plot_training_curves` leaves them out of the figure).
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
