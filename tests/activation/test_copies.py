"""start_copies' bookkeeping around the parallel starts, with start_copy stood in for."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation import copy
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.tools import RealImageChecks, Tools
from snapctl.criu import CriuBinary
from snapctl.statedir import StateDir


class NoVerify(RealImageChecks):
    def verify(self, image: Path, state: StateDir) -> Any:
        return None


NO_VERIFY = Tools(images=NoVerify())


class FakeSession:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_copies_started_are_stopped_when_another_start_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[FakeSession] = []
    first_done = threading.Event()

    def start_copy(image: Path, options: LaunchOptions, **kwargs: Any) -> tuple[FakeSession, None]:
        if options.name == "c-2":
            first_done.wait(10)
            raise RuntimeError("unexpected failure in copy 2")
        session = FakeSession()
        started.append(session)
        first_done.set()
        return session, None

    monkeypatch.setattr(copy, "start_copy", start_copy)
    criu = CriuBinary(path=Path("/bin/false"), version="4.2.1", source="option")
    with pytest.raises(RuntimeError, match="copy 2"):
        copy.start_copies(
            tmp_path, LaunchOptions(name="c"), 2, criu=criu, native=None,  # type: ignore[arg-type]
            publish_base=None, state=StateDir(tmp_path), progress_for=lambda label: print,
            tools=NO_VERIFY,
        )  # fmt: skip
    assert [session.stopped for session in started] == [True]


def test_all_or_nothing_stops_the_copies_that_started_and_names_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapctl.activation.copy import RestoreError

    started: list[FakeSession] = []

    def start_copy(image: Path, options: LaunchOptions, **kwargs: Any) -> tuple[FakeSession, None]:
        if options.name == "c-2":
            raise RestoreError("criu restore failed", phase="restore")
        session = FakeSession()
        started.append(session)
        return session, None

    monkeypatch.setattr(copy, "start_copy", start_copy)
    criu = CriuBinary(path=Path("/bin/false"), version="4.2.1", source="option")
    with pytest.raises(copy.SnapctlError, match=r"1 of 3 copies failed.*criu restore") as info:
        results = copy.start_copies(
            tmp_path, LaunchOptions(name="c"), 3, criu=criu, native=None,  # type: ignore[arg-type]
            publish_base=None, state=StateDir(tmp_path), progress_for=lambda label: print,
            tools=NO_VERIFY,
        )  # fmt: skip
        copy.require_all(results, 0.0)  # type: ignore[arg-type]
    assert info.value.phase == "restore"
    assert info.value.exit_status == RestoreError.exit_status  # the first failure's, not 1
    assert len(started) == 2 and all(session.stopped for session in started)
