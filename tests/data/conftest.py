"""The data tests read the real-model chat templates committed under ``tests/fixtures/chat_templates`` (copies of
the shared ones, with their licence files), so a fresh clone runs them with nothing beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURE_TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


@pytest.fixture(scope="session")
def templates_dir() -> Path:
    return FIXTURE_TEMPLATES
