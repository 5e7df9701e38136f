"""Finding a run's ``metrics.csv`` files (:func:`find_metrics_files`) and reading them (:func:`load_metrics`), the
versions of a resumed run joined into one (later version wins where steps overlap) and ``lit-llm validate``'s
evaluation-only versions added to the eval panels."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from lit_llm.plot.panels import _EPOCH, _STEP, _to_float

__all__ = ["find_metrics_files", "load_metrics"]

_VERSION_RE = re.compile(r"^version_(\d+)$")


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
    (:func:`~lit_llm.plot.panels.collect_panels` keeps the last value per step).

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
