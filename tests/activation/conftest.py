"""Fixtures shared by the real-CRIU activation tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from snapctl.activation.session import Session


@pytest.fixture
def running() -> Iterator[list[Session]]:
    """Sessions a test started: whatever it did not stop itself is stopped afterwards."""
    sessions: list[Session] = []
    yield sessions
    for session in sessions:
        if not session.stopped:
            session.stop(5.0)
