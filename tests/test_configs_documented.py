"""Every YAML under ``configs/`` documents each of its leaf keys and names no developer-checkout path.

A leaf key is one whose value is not a mapping (``class_path`` and section headers such as ``trainer:`` or
``init_args:`` are exempt). Its comment is the inline ``# ...`` on its line plus the comment-only lines right below it
that are indented past the key (continuations), or the comment-only lines right above it at the key's own column (not
the file's opening comment block). The items of a list value are covered by the key's comment. The comment must say
more than the key's name: at least two words that are neither words of the key nor filler words.

The keys come from PyYAML (so nothing is missed); the line scan below only finds each key's line and comment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXEMPT_KEYS = {"class_path"}
FILLER = {"a", "an", "the", "of", "to", "in", "on", "for", "is", "and", "or", "be", "by", "it", "its", "this", "that",
          "with", "as", "at", "value", "setting", "option", "key", "number", "set"}
KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<dashes>(?:-\s+)*)(?P<key>[A-Za-z_][\w.\-]*)\s*:(?:\s+|$)(?P<rest>.*)$")
# Path-like string values that point into somebody's checkout or home instead of a user-given location.
DEV_PATH = re.compile(r"(^\.\./|^~|^/(home|Users|work|root|tmp)/|(^|/)shared/data/)")


def split_comment(text: str) -> tuple[str, str | None]:
    """``(value, comment)`` of the text after a key's colon: the comment starts at a ``#`` outside quotes that
    begins the text or follows whitespace."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1:].strip()
    return text.strip(), None


def scan_comments(text: str) -> dict[tuple[str, ...], list[str]]:
    """Each key path (list indices dropped) -> the comments found for it (one entry per occurrence)."""
    lines = text.splitlines()
    header_end = 0
    while header_end < len(lines) and (not lines[header_end].strip() or lines[header_end].lstrip().startswith("#")):
        header_end += 1
    found: dict[tuple[str, ...], list[str]] = {}
    stack: list[tuple[int, str]] = []
    for n, line in enumerate(lines):
        m = KEY_LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        column = len(m["indent"]) + len(m["dashes"])  # "- key:" (a list item's key) sits past the dash
        while stack and stack[-1][0] >= column:
            stack.pop()
        path = tuple(k for _, k in stack) + (m["key"],)
        stack.append((column, m["key"]))
        parts = []
        _, inline = split_comment(m["rest"])
        if inline:
            parts.append(inline)
        j = n + 1  # continuation lines: comment-only, indented past the key
        while j < len(lines) and lines[j].lstrip().startswith("#") and \
                len(lines[j]) - len(lines[j].lstrip()) > column:
            parts.append(lines[j].strip().lstrip("#").strip())
            j += 1
        j = n - 1  # comment lines right above, at the key's column (not the file's opening block)
        above = []
        while j >= header_end and lines[j].lstrip().startswith("#") and \
                len(lines[j]) - len(lines[j].lstrip()) == column:
            above.append(lines[j].strip().lstrip("#").strip())
            j -= 1
        parts.extend(reversed(above))
        found.setdefault(path, []).append(" ".join(parts))
    return found


def leaf_keys(node: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of every leaf key (value not a mapping) of a parsed YAML document, through lists of
    mappings (indices dropped)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            p = (*path, str(k))
            if isinstance(v, dict):
                out.extend(leaf_keys(v, p))
            elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
                for x in v:
                    out.extend(leaf_keys(x, p))
            else:
                out.append((p, v))
    return out


def words(text: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if w}


def says_more(key: str, comment: str) -> bool:
    """Whether ``comment`` has at least two words that are not words of ``key`` nor filler."""
    return len(words(comment) - words(key.replace("_", " ")) - FILLER) >= 2


def problems_of(text: str) -> list[str]:
    doc = yaml.safe_load(text) or {}
    comments = scan_comments(text)
    problems = []
    for path, value in leaf_keys(doc):
        key = path[-1]
        name = ".".join(path)
        strings = value if isinstance(value, list) else [value]
        for s in strings:
            if isinstance(s, str) and DEV_PATH.search(s):
                problems.append(f"{name}: {s!r} is a path inside a developer checkout or home; use null (with a "
                                f"comment saying what to pass) or a Hub id")
        if key in EXEMPT_KEYS:
            continue
        if path not in comments:
            problems.append(f"{name}: not found by the line scan (write it as 'key: value' on one line)")
            continue
        for comment in comments[path]:
            if not comment:
                problems.append(f"{name}: no comment (inline, or on the line above at the key's indentation)")
            elif not says_more(key, comment):
                problems.append(f"{name}: the comment {comment!r} only restates the key's name")
    return problems


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_leaf_key_is_documented(config):
    problems = problems_of(config.read_text(encoding="utf-8"))
    assert not problems, f"configs/{config.name}:\n  " + "\n  ".join(problems)


def test_configs_exist():
    assert len(CONFIGS) >= 5


def test_checker_finds_each_kind_of_problem():
    text = (
        "# file header, not a key's comment\n"
        "seed_everything: 0\n"
        "trainer:\n"
        "  max_steps: 10   # max steps\n"
        "  # optimizer steps before the run stops\n"
        "  val_check_interval: 5\n"
        "  log_every_n_steps: 1           # rows of metrics.csv: one\n"
        "                                 # per optimizer step\n"
        "  devices: 1\n"
        "model:\n"
        "  class_path: x.Y\n"
        "  init_args:\n"
        "    funcs:                       # reward functions summed with weights\n"
        "      - a:b\n"
        "    path: ../shared/data/train.jsonl  # training rows of the task\n"
        "    name: \"a # b\"\n"
    )
    assert problems_of(text) == [
        "seed_everything: no comment (inline, or on the line above at the key's indentation)",
        "trainer.max_steps: the comment 'max steps' only restates the key's name",
        "trainer.devices: no comment (inline, or on the line above at the key's indentation)",
        "model.init_args.path: '../shared/data/train.jsonl' is a path inside a developer checkout or home; use null "
        "(with a comment saying what to pass) or a Hub id",
        "model.init_args.name: no comment (inline, or on the line above at the key's indentation)",
    ]


def test_checker_reads_list_items_of_mappings():
    text = ("trainer:\n"
            "  callbacks:\n"
            "    - class_path: a.B\n"
            "      init_args:\n"
            "        every: 3                 # steps between two saves\n"
            "        other: 1\n")
    assert problems_of(text) == ["trainer.callbacks.init_args.other: no comment (inline, or on the line above at the "
                                 "key's indentation)"]
