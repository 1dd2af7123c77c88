"""The detached supervisor's hand-over: progress and errors reach the parent intact."""

from __future__ import annotations

import os

import pytest

from snapctl.activation.supervise import DetachedStartError, detach
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images.lock import ImageBusyError
from snapctl.phases import HostPhase


def test_progress_then_error_with_its_fields_reach_the_parent() -> None:
    seen: list[tuple[str, str]] = []

    def start(progress_for):  # type: ignore[no-untyped-def]
        progress_for("copy 1")("restoring")
        error = SnapctlError("it broke\n  detail line", phase="restore", path="/x/restore.log")
        error.exit_status = ExitStatus.VERIFY_FAILED  # type: ignore[attr-defined]
        raise error

    with pytest.raises(DetachedStartError) as info:
        detach(start, on_progress=lambda lane, step: seen.append((lane, step)))
    assert seen == [("copy 1", "restoring")]
    assert info.value.message == "it broke\n  detail line"
    assert info.value.phase is HostPhase.RESTORE and str(info.value.path) == "/x/restore.log"
    assert info.value.exit_status == ExitStatus.VERIFY_FAILED


def test_an_unexpected_exception_in_the_supervisor_is_reported() -> None:
    def start(progress_for):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug")

    expected = "unexpected RuntimeError in the supervisor: a bug"
    with pytest.raises(DetachedStartError, match=expected):
        detach(start)


def test_the_supervisor_exits_with_its_error_s_status(monkeypatch: pytest.MonkeyPatch) -> None:
    reaped: list[int] = []
    waitpid = os.waitpid

    def recording_waitpid(pid: int, options: int) -> tuple[int, int]:
        done = waitpid(pid, options)
        reaped.append(os.waitstatus_to_exitcode(done[1]))
        return done

    monkeypatch.setattr(os, "waitpid", recording_waitpid)

    def start(progress_for):  # type: ignore[no-untyped-def]
        raise ImageBusyError("image /x is in use", phase=HostPhase.IMAGE, path="/x")

    with pytest.raises(DetachedStartError) as info:
        detach(start)
    assert info.value.exit_status == ExitStatus.CONFLICT
    assert info.value.phase is HostPhase.IMAGE
    assert reaped == [ExitStatus.CONFLICT]
