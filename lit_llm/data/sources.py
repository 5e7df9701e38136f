"""Reading a data source into rows with their ids: a local JSONL / Parquet / CSV / JSON file, or a Hugging Face Hub
dataset name when online.

Every row comes back as ``(sample_id, row)``: ``"file:line"`` (1-based line) for JSONL, read by
:func:`lit_llm.data.rows.read_jsonl` so a bad line is named; ``"file:row N"`` (1-based row) for Parquet, CSV and
JSON files and ``"name:split:row N"`` for Hub datasets, read through the ``datasets`` library
(``datasets.load_dataset``). Columns Arrow fills with ``None`` inside message dicts (a message list where only some
messages carry ``tool_calls``, say) are dropped, so a row reads back as it was written.

Text is UTF-8: a JSONL / CSV / TSV / JSON file with a byte that is not UTF-8 is one :class:`DataFormatError` naming
the file, the line, the column and the byte, and the fix (re-save as UTF-8, e.g. ``iconv -f latin1 -t utf-8``)
(:func:`non_utf8_position`). Parquet strings are UTF-8 by construction; a top-level ``binary`` column's values are
decoded as UTF-8 text (a value that does not decode is the same error, naming the row and the column).

Source syntax (``--data.path``, ``--data.eval_path``):

* a local file: ``*.jsonl`` / ``*.ndjson`` (one JSON object per line), ``*.parquet``, ``*.csv``, ``*.tsv``, ``*.json``
  (JSON lines or an array of objects);
* a Hub dataset: ``NAME``, ``NAME:SPLIT`` or ``NAME:CONFIG:SPLIT`` (e.g. ``openai/gsm8k:main:test``); the split
  defaults to the caller's (``train`` for the training data, ``test`` for evaluation data). Offline
  (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set) a Hub name is an error naming the fix.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from lit_llm.data.rows import DataFormatError, read_jsonl

__all__ = ["FILE_SUFFIXES", "HubOfflineError", "hub_offline", "non_utf8_position", "read_rows"]

#: Local file suffixes and the ``datasets`` builder that reads each (``None`` = the JSONL reader of this package).
FILE_SUFFIXES: dict[str, str | None] = {".jsonl": None, ".ndjson": None, ".parquet": "parquet", ".csv": "csv",
                                        ".tsv": "csv", ".json": "json"}


class HubOfflineError(DataFormatError):
    """A Hub dataset name was given while the Hub is off (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to a true value (read at call time)."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _looks_like_file(source: str) -> bool:
    p = Path(source)
    return (p.suffix.lower() in FILE_SUFFIXES or source.startswith((".", "/", "~")) or source.count("/") > 1
            or os.sep in source.replace("/", "") or p.exists())


def _drop_null_keys(value: Any) -> Any:
    """Arrow gives every struct in a list the union of the keys: drop the ``None`` ones inside lists of dicts."""
    if isinstance(value, list):
        return [({k: _drop_null_keys(v) for k, v in x.items() if v is not None} if isinstance(x, dict)
                 else _drop_null_keys(x)) for x in value]
    return value


@contextlib.contextmanager
def _quiet_datasets(datasets: Any) -> Iterator[None]:
    """No progress bar and no ``datasets`` log line while a local file is read: a file it cannot read is our one
    error line (its own "Failed to read file ..." line would come first)."""
    bars = not datasets.utils.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.utils.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.utils.enable_progress_bars()


def _load(builder_or_name: str, *, where: str, fix: str, quiet: bool = False, **kwargs: Any) -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("Reading Parquet / CSV / JSON files or Hub datasets needs the `datasets` package: "
                          "pip install datasets") from e
    try:
        with _quiet_datasets(datasets) if quiet else contextlib.nullcontext():
            return datasets.load_dataset(builder_or_name, **kwargs)
    except (FileNotFoundError, ValueError, TypeError, KeyError, OSError) as e:
        raise DataFormatError(f"{where}: cannot be read by datasets.load_dataset ({type(e).__name__}: {e}). "
                              f"Fix: {fix}") from e
    except Exception as e:  # datasets / pyarrow raise their own error types (DatasetGenerationError, ArrowInvalid)
        raise DataFormatError(f"{where}: cannot be read by datasets.load_dataset ({type(e).__name__}: {e}). "
                              f"Fix: {fix}") from e


def non_utf8_position(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """Where a text file first breaks UTF-8: ``(line, column, byte)`` (1-based line and byte column, the byte's
    value), or ``None`` when the whole file decodes. Read line by line in binary (a UTF-8 sequence never holds
    ``\\n``, so each line decodes on its own)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return lineno, e.start + 1, raw[e.start]
    return None


def _encoding_fix(p: Path, option: str) -> str:
    return (f"Fix: re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {p.name} > {p.stem}.utf8{p.suffix}` (latin1 "
            f"if it came from Excel or an old Windows tool; `file -i {p.name}` guesses the encoding), and point "
            f"{option} at the new file.")


def _non_utf8_error(p: Path, option: str) -> DataFormatError | None:
    """The one-line error for a text file that is not UTF-8, or ``None`` when it decodes."""
    found = non_utf8_position(p)
    if found is None:
        return None
    line, column, byte = found
    return DataFormatError(f"{p}:{line}: byte 0x{byte:02x} at column {column} is not UTF-8 (the file is in another "
                           f"encoding). {_encoding_fix(p, option)}")


def _text(value: Any, where: str, column: str, p: Path, option: str) -> Any:
    """A Parquet ``binary`` value as UTF-8 text (other values as they are)."""
    if not isinstance(value, (bytes, bytearray)):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{where}: column {column!r}: byte 0x{value[e.start]:02x} at position {e.start + 1} is "
                              f"not UTF-8 (a binary column in another encoding). Fix: re-save the column as UTF-8 "
                              f"text, e.g. in pandas `df[{column!r}] = df[{column!r}].str.decode('latin1')` then "
                              f"`df.to_parquet(...)`, and point {option} at the new file.") from None


def _rows_of(ds: Any, prefix: str, limit: int | None, text_of: Any = None) -> list[tuple[str, dict[str, Any]]]:
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    rows = [(f"{prefix}:row {i}", {k: _drop_null_keys(v) for k, v in row.items()})
            for i, row in enumerate(ds.to_list(), start=1)]
    if text_of is not None:
        rows = [(sid, {k: text_of(v, sid, k) for k, v in row.items()}) for sid, row in rows]
    return rows


def read_rows(source: str | os.PathLike, *, split: str = "train", option: str = "--data.path",
              on_bad_row: Literal["raise", "skip"] = "raise", skipped: Any = None,
              limit: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Read a local file or a Hub dataset into ``[(sample_id, row), ...]``.

    Args:
        source: a file path or a Hub dataset spec (see the module docstring).
        split: the Hub split when ``source`` names none (``"train"`` for training data, ``"test"`` for evaluation).
        option: the CLI option holding ``source`` (``--data.path``, ``--data.eval_path``), named in errors.
        on_bad_row: JSONL only: ``"raise"`` stops at a line that is not a JSON object, ``"skip"`` counts it in
            ``skipped`` (Parquet / CSV / JSON files are read whole by ``datasets``: a broken file is one error).
        skipped: collects skipped JSONL lines (a :class:`lit_llm.data.rows.Skipped`).
        limit: keep the first ``limit`` rows (``None`` = all).

    Returns:
        The rows (dicts of column -> value) with their ids, in file order.

    Raises:
        FileNotFoundError: a path-like ``source`` that does not exist (names ``option`` and the supported suffixes).
        HubOfflineError: a Hub name while ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set.
        DataFormatError: an unsupported suffix, a file ``datasets`` cannot read, an empty dataset, a bad JSONL line,
            a byte that is not UTF-8 (file, line or row, column and byte named, with the ``iconv`` fix).
    """
    text = str(source)
    p = Path(text).expanduser()
    suffixes = ", ".join(FILE_SUFFIXES)
    if _looks_like_file(text):
        if not p.is_file():
            raise FileNotFoundError(f"Data file {str(p)!r} not found. Point {option} at a file ({suffixes}) or, "
                                    f"online, a Hugging Face Hub dataset name such as openai/gsm8k:main:train.")
        suffix = p.suffix.lower()
        if suffix not in FILE_SUFFIXES:
            raise DataFormatError(f"{p}: unsupported file type {suffix or '(no suffix)'!r} for {option}. Fix: save "
                                  f"the data as one of {suffixes}.")
        builder = FILE_SUFFIXES[suffix]
        kwargs: dict[str, Any] = {"data_files": str(p), "split": "train"}
        if suffix == ".tsv":
            kwargs["delimiter"] = "\t"
        try:
            if builder is None:
                rows = read_jsonl(p, on_bad_row=on_bad_row, skipped=skipped, option=option)
                return [(f"{p}:{line}", row) for line, row in rows[:limit]]
            ds = _load(builder, where=str(p), fix=f"check that {p.name} is a valid {builder.upper()} file of rows.",
                       quiet=True, **kwargs)
        except (UnicodeDecodeError, DataFormatError) as e:
            bad = None if builder == "parquet" else _non_utf8_error(p, option)
            if bad is None:
                raise
            raise bad from e
        text_of = None
        if builder == "parquet":
            def text_of(value: Any, where: str, column: str) -> Any:
                return _text(value, where, column, p, option)
        out = _rows_of(ds, str(p), limit, text_of)
        if not out:
            raise DataFormatError(f"{p}: the file holds no row (empty dataset). Fix: point {option} at a non-empty "
                                  f"file.")
        return out
    parts = text.split(":")
    if len(parts) > 3 or not all(parts):
        raise DataFormatError(f"{text!r} ({option}) is neither a file ({suffixes}) nor a Hub dataset spec NAME, "
                              f"NAME:SPLIT or NAME:CONFIG:SPLIT.")
    name, config, hub_split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1
                                                                                  else split)
    if hub_offline():
        raise HubOfflineError(
            f"{text!r} ({option}) is not a local file, and as a Hugging Face Hub dataset name it cannot be loaded "
            f"offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set). Fix: download the dataset where the Hub is "
            f"reachable and point {option} at a local file ({suffixes}), or unset HF_HUB_OFFLINE.")
    ds = _load(name, where=f"Hub dataset {text!r} ({option})", name=config, split=hub_split,
               fix="check the dataset name, config and split (NAME:CONFIG:SPLIT), or point to a local file.")
    out = _rows_of(ds, f"{name}:{hub_split}", limit)
    if not out:
        raise DataFormatError(f"Hub dataset {text!r} ({option}): split {hub_split!r} holds no row.")
    return out
