"""docs/ARCHITECTURE.md's hop-by-hop walks name real code: every ``path.py:Name[.attr]`` reference resolves."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"`(lit_llm/[\w/]+\.py):([A-Za-z_][\w.]*)`")


def test_every_file_function_reference_resolves():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    refs = REF.findall(text)
    assert len(refs) >= 30, "the walks should name their hops as file:function"
    missing = []
    for path, name in refs:
        module = importlib.import_module(path[:-3].replace("/", "."))
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{path}:{name}")
                break
    assert not missing, f"ARCHITECTURE.md names code that does not exist: {missing}"
