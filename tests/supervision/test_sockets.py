"""A private unix socket is 0600 from its creation, and the process umask is left alone."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from snapctl.supervision.sockets import bind_private


def test_0600_from_the_bind_whatever_the_umask_and_the_umask_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the chmod after the bind: the mode must come from the bind itself.
    monkeypatch.setattr("snapctl.supervision.sockets.os.chmod", lambda path, mode: None)
    previous = os.umask(0)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            bind_private(sock, tmp_path / "s.sock")
            assert stat.S_IMODE((tmp_path / "s.sock").stat().st_mode) == 0o600
        assert os.umask(0) == 0  # what it was set to here, not 0o177
    finally:
        os.umask(previous)


def test_a_plain_bind_under_that_umask_would_be_open(tmp_path: Path) -> None:
    """What the test above guards against: without the fchmod the umask alone decides."""
    previous = os.umask(0)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(tmp_path / "open.sock"))
            assert stat.S_IMODE((tmp_path / "open.sock").stat().st_mode) == 0o777
    finally:
        os.umask(previous)
