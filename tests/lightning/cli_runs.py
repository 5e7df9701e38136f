"""Shared checks of ``lit-llm`` runs in a subprocess (imported by the CLI tests of this folder)."""

from __future__ import annotations

import subprocess


def first_error(proc: subprocess.CompletedProcess) -> str:
    """The one ``lit-llm: error:`` line of a failed run; asserts exit status 2 and no traceback on stderr."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("lit-llm: error:")]
    return line
