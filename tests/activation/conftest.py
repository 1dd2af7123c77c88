"""Fixtures shared by the real-CRIU activation tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation.session import Session
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StateDir:
    """A fresh state directory (which also proves the fixture model's build path), with the
    tests' API key in the environment."""
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    return StateDir(tmp_path / "state")


@pytest.fixture
def running() -> Iterator[list[Session]]:
    """Sessions a test started: whatever it did not stop itself is stopped afterwards."""
    sessions: list[Session] = []
    yield sessions
    for session in sessions:
        if not session.stopped:
            session.stop(5.0)
