"""Reading completions and reference answers: a completion's text (:func:`completion_text`), numbers written as in
GSM8K (:func:`normalize_number`, :func:`last_number`, :func:`extract_gsm8k_answer`) and the ``answer`` column the
built-in rewards compare with."""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["completion_text", "extract_gsm8k_answer", "last_number", "normalize_number"]

_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 1,234.5 | 1234 | $5 | -7
_INTEGER = re.compile(r"-?\d+")


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """Text of a completion: the string itself, or the ``content`` of the last message of a chat completion.

    Raises:
        TypeError: neither a string nor a list of message dicts with string ``content``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(f"A completion must be a str or a list of message dicts with str 'content', got {completion!r}.")


def normalize_number(text: str | int | float) -> Decimal | None:
    """Parse a number written as in GSM8K: drops ``,``, ``$`` and spaces; ``"1,000.00"`` == ``"1000"``.

    Returns:
        the value as a ``Decimal`` (so ``"3.50"`` == ``"3.5"`` and ``"72.0"`` == ``"72"``), or ``None`` if unparsable.
    """
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def last_number(text: str) -> Decimal | None:
    """The last number in ``text`` (``-?$?`` then ``1,234`` groups or digits, optional ``.digits``), normalised.

    Commas count only as thousands separators: ``"1,2,3"`` holds the numbers 1, 2 and 3. ``None`` if there is none.
    """
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last ``####`` if the text has one, else its last number (GSM8K answer convention)."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_number(found[0]) if found else None
    return last_number(text)


def _column(kwargs: dict[str, Any], name: str, n: int, fn: str) -> Sequence[Any]:
    if name not in kwargs:
        raise ValueError(f"{fn} needs the dataset column {name!r} (the reference answer), but the batch only has "
                         f"columns {sorted(kwargs)}; add it to the dataset or remove {fn} from the reward functions.")
    col = kwargs[name]
    if isinstance(col, (str, bytes)) or len(col) != n:
        raise ValueError(f"{fn}: column {name!r} must hold one entry per completion ({n}), got {col!r:.200}.")
    return col


def _reference(ref: Any, *, gsm8k: bool = False) -> Decimal | None:
    """A reference answer as a number (the whole value; with ``gsm8k`` a string's number after ``####``, else its
    last number); ``None`` when missing or not a number."""
    if ref is None or isinstance(ref, bool):
        return None
    return extract_gsm8k_answer(ref) if gsm8k and isinstance(ref, str) else normalize_number(ref)

