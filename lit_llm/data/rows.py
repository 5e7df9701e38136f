"""Row-level pieces shared by the dataset readers (:mod:`lit_llm.data.datasets`) and the source readers
(:mod:`lit_llm.data.sources`): the data error, the skipped-row record, the JSONL reader and the coercion of a column
into messages. Both modules import this one, so neither imports the other at call time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["DataFormatError", "Skipped", "check_renames", "note_skip", "read_jsonl", "to_messages"]


class DataFormatError(ValueError):
    """A data file or one of its rows is unusable; the message names the file, the line, the key and the fix."""


@dataclass
class Skipped:
    """Rows skipped by ``on_bad_row="skip"``: ``count`` and the first few ``(sample_id, reason)``."""

    count: int = 0
    first: list[tuple[str, str]] = field(default_factory=list)


def read_jsonl(path: str | os.PathLike, *, on_bad_row: Literal["raise", "skip"] = "raise",
               skipped: Skipped | None = None, option: str = "--data.path") -> list[tuple[int, dict[str, Any]]]:
    """Read a JSONL file into ``[(line_number, row), ...]`` (1-based line numbers; blank lines ignored).

    Args:
        path: the ``.jsonl`` file.
        on_bad_row: ``"raise"`` stops at the first line that is not a JSON object; ``"skip"`` counts it in
            ``skipped`` and goes on.
        skipped: collects skipped lines when ``on_bad_row="skip"``.
        option: the CLI option that holds ``path`` (``--data.path``, ``--data.val_path``, ...), named in errors.

    Returns:
        The rows, each a ``dict``.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message says how to point ``option`` at a file).
        DataFormatError: a line is not a JSON object (``on_bad_row="raise"``), or the file holds no row.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"Data file {str(p)!r} not found. Point {option} at a JSONL file with one JSON "
                                f"object per line (e.g. /path/to/gsm8k/train.jsonl).")
    rows: list[tuple[int, dict[str, Any]]] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                msg = f"{p}:{lineno}: not a JSON object ({e}). Fix: write one JSON object per line."
                if on_bad_row == "raise":
                    raise DataFormatError(msg + " Or set --data.on_bad_row skip to skip bad rows.") from None
                note_skip(skipped, f"{p}:{lineno}", msg)
                continue
            rows.append((lineno, row))
    if not rows:
        raise DataFormatError(f"{p}: the file holds no JSON row (empty dataset). Fix: point --data.path at a "
                              f"non-empty JSONL file.")
    return rows


def note_skip(skipped: Skipped | None, sample_id: str, reason: str) -> None:
    """Count a skipped row in ``skipped`` (when given), keeping the first five ``(sample_id, reason)``."""
    if skipped is not None:
        skipped.count += 1
        if len(skipped.first) < 5:
            skipped.first.append((sample_id, reason))


def to_messages(value: Any, default_role: str, key: str, where: str) -> list[dict[str, Any]]:
    """A row column as a message list: a string is one message of ``default_role``; a list of
    ``{"role": str, "content": str}`` dicts is copied.

    Args:
        value: the column's value.
        default_role: the role of a string value (``"user"`` for a prompt, ``"assistant"`` for a completion).
        key: the column name, named in errors.
        where: the row's sample id, named in errors.

    Raises:
        DataFormatError: neither a string nor a non-empty list of role/content dicts (names the row, the key and
            the index).
    """
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for i, m in enumerate(value):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataFormatError(f"{where}: {key}[{i}] must be {{'role': str, 'content': str}}, got keys "
                                      f"{sorted(m)}. Fix the row.")
        return [dict(m) for m in value]
    raise DataFormatError(f"{where}: {key!r} must be a string or a non-empty list of {{'role', 'content'}} messages, "
                          f"got {type(value).__name__}. Fix the row.")


_messages = to_messages  # the older private name


def check_renames(rename: Mapping[str, str], columns: Sequence[str], where: str,
                  origin: Mapping[str, str] | None = None) -> None:
    """Refuse a ``rename_columns`` entry that would silently do nothing or lose a column: a source column the data
    does not have, or a new name that is already a column (not itself renamed) or the target of another entry.

    Args:
        rename: ``{file column: new name}``.
        columns: the first row's columns (every row has them: the readers check).
        where: the first row's ``file:line`` / ``file:row N``.
        origin: ``{file column: option}`` naming where an entry comes from (default ``--data.rename_columns``).

    Raises:
        DataFormatError: names the entry, the file and its columns, and the fix.
    """
    origin = origin or {}
    file = where.rsplit(":", 1)[0]
    kept = [c for c in columns if c not in rename]
    for old, new in rename.items():
        option = origin.get(old, "--data.rename_columns")
        if old not in columns:
            raise DataFormatError(f"{option} renames column {old!r} to {new!r}, but {file} has no column {old!r} "
                                  f"(its columns: {sorted(columns)}). Fix: use one of its columns as the key.")
        clash = [o for o, n in rename.items() if n == new and o != old and o in columns]
        if new in kept or clash:
            other = f"column {new!r}" if new in kept else f"column {clash[0]!r} (also renamed to {new!r})"
            raise DataFormatError(f"{option} renames column {old!r} to {new!r}, but {file} also has {other}: one "
                                  f"would silently replace the other (its columns: {sorted(columns)}). Fix: rename "
                                  f"or drop one of them.")
