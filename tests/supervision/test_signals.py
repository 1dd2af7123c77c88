"""SIGINT/SIGTERM at every point of a foreground or detached start: whatever was started is
stopped, a cleanup in progress is never cut short, and the process is never killed by the
default action (which would leave an activation without its supervisor).

The activations are stand-ins that record what happened to them; the signals are real, sent
to this process at injected points.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.restore import RestoreError
from snapctl.activation.session import CleanupAudit, Session
from snapctl.activation.supervise import DetachedStartError, detach
from snapctl.cli.serving import run_in_foreground
from snapctl.errors import ExitStatus
from snapctl.namespaces.layout import ActivationDirs
from snapctl.statedir import StateDir
from snapctl.supervision.signals import StopSignals, cleaning, track, untrack

CLEAN = CleanupAudit(processes=[], mounts=[], directories=[], listeners=[])


class FakeSession:
    """An activation stand-in: tracked like a Session from creation until it stops."""

    def __init__(
        self, events: list[str], name: str = "fake", on_stop: Callable[[], None] = lambda: None
    ) -> None:
        self.name, self.failure, self.lazy = name, None, None
        self.events = events
        self.stops = 0
        self._on_stop = on_stop
        track(self)

    def alive(self) -> bool:
        return self.stops == 0

    def stop(self, stop_timeout_s: float = 10.0) -> tuple[str, CleanupAudit]:
        self.stops += 1
        self.events.append(f"stop {self.name} begins")
        self._on_stop()  # a signal here must not cut the cleanup short
        self.events.append(f"stop {self.name} ends")
        untrack(self)
        return "terminated", CLEAN


def kill_me(signum: int) -> None:
    os.kill(os.getpid(), signum)


SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.fixture(autouse=True)
def default_handlers() -> Any:
    """Each test starts from, and must leave, the default SIGTERM action."""
    yield
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_while_starting_stops_what_was_started(signum: int) -> None:
    events: list[str] = []

    def start(steps: Any) -> tuple[Any, Any]:
        session = FakeSession(events)
        kill_me(signum)  # e.g. during the restore: raises here
        events.append("start went on")  # never reached
        return session, {}

    with pytest.raises(KeyboardInterrupt):
        run_in_foreground(start, as_json=True, show=print)
    assert events == ["stop fake begins", "stop fake ends"]


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_after_the_session_exists_but_before_its_caller_has_it(signum: int) -> None:
    events: list[str] = []

    def start(steps: Any) -> tuple[Any, Any]:
        result = (FakeSession(events), {})
        kill_me(signum)  # the start is done; only the return to the caller is left
        return result

    with pytest.raises(KeyboardInterrupt):
        run_in_foreground(start, as_json=True, show=print)
    assert events == ["stop fake begins", "stop fake ends"]


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_while_the_report_prints_stops_the_copy_in_order(signum: int) -> None:
    events: list[str] = []

    def show(report: Any) -> None:
        kill_me(signum)  # the 0.9 s window of issue 21: default action, unsupervised copy
        events.append("report printed")

    run_in_foreground(lambda steps: (FakeSession(events), {}), as_json=False, show=show)
    assert events == ["report printed", "stop fake begins", "stop fake ends"]


def test_a_second_signal_during_the_cleanup_does_not_cut_it_short() -> None:
    events: list[str] = []

    def start(steps: Any) -> tuple[Any, Any]:
        FakeSession(events, on_stop=lambda: kill_me(signal.SIGTERM))
        kill_me(signal.SIGINT)
        return None, {}

    with pytest.raises(KeyboardInterrupt):
        run_in_foreground(start, as_json=True, show=print)
    assert events == ["stop fake begins", "stop fake ends"]


def test_a_failing_report_still_stops_every_copy() -> None:
    events: list[str] = []

    def show(report: Any) -> None:
        raise BrokenPipeError("stdout went away")

    with pytest.raises(BrokenPipeError):
        run_in_foreground(
            lambda steps: ([FakeSession(events, "a"), FakeSession(events, "b")], {}),
            as_json=False, show=show,
        )  # fmt: skip
    assert events == ["stop a begins", "stop a ends", "stop b begins", "stop b ends"]


def test_signals_request_the_stop_once_started() -> None:
    with StopSignals() as signals:
        signals.started()
        kill_me(signal.SIGTERM)  # no KeyboardInterrupt, no death
        assert signals.requested.is_set() and signals.received == signal.SIGTERM


def test_a_signal_to_the_command_while_a_detached_start_runs_stops_that_start() -> None:
    # The supervisor (a fork) starts; SIGTERM to the parent is passed on to it; its start is
    # interrupted, stops what it started, and says so; the parent's error says 130.
    def start(progress_for: Any) -> tuple[Any, Any]:
        FakeSession([])
        progress_for("")("restoring")  # the parent sends SIGTERM to itself on this
        signal.pause()  # until the forwarded SIGTERM interrupts the start
        return None, {}

    with pytest.raises(DetachedStartError, match="interrupted while starting") as info:
        detach(start, on_progress=lambda lane, step: kill_me(signal.SIGTERM))
    assert info.value.exit_status == ExitStatus.INTERRUPTED


@contextlib.contextmanager
def not_interrupted() -> Iterator[None]:
    """Fail (rather than end the test run) where a signal raised in the middle of a cleanup."""
    try:
        yield
    except KeyboardInterrupt:
        pytest.fail("a signal during the cleanup raised KeyboardInterrupt")


def test_a_first_signal_during_a_failed_starts_cleanup_does_not_cut_it_short() -> None:
    # The start failed by itself; the signal comes while its cleanup stops what it started:
    # it is recorded, the cleanup runs to its end, and the start's own error is what leaves.
    events: list[str] = []

    def start(steps: Any) -> tuple[Any, Any]:
        FakeSession(events, on_stop=lambda: kill_me(signal.SIGINT))
        raise RestoreError("the restore failed")

    with not_interrupted(), pytest.raises(RestoreError):
        run_in_foreground(start, as_json=True, show=print)
    assert events == ["stop fake begins", "stop fake ends"]


def test_a_first_signal_during_a_failed_detached_starts_cleanup_does_not_cut_it_short() -> None:
    # In the supervisor: the cleanup of a start that failed by itself gets SIGTERM; the parent
    # still hears the start's own error, not "interrupted" (which a cut-short cleanup says).
    def start(progress_for: Any) -> tuple[Any, Any]:
        FakeSession([], on_stop=lambda: kill_me(signal.SIGTERM))
        raise RestoreError("the restore failed")

    with pytest.raises(DetachedStartError, match="the restore failed") as info:
        detach(start)
    assert info.value.exit_status == ExitStatus.ACTIVATION_FAILED  # its own, not 130


class SignalledSession(Session):
    """A real Session whose stop gets a signal halfway (nothing was launched to stop)."""

    events: list[str]

    def stop(
        self, stop_timeout_s: float = 10.0, *, failed: bool = False
    ) -> tuple[str, CleanupAudit]:
        self.events.append("stop begins")
        kill_me(signal.SIGINT)
        self.events.append("stop ends")
        untrack(self)
        return "not started", CLEAN


def test_a_first_signal_during_stop_failed_start_does_not_cut_it_short(tmp_path: Path) -> None:
    session = SignalledSession(
        name="fake", activation_id="a1", kind="copy", state_dir=StateDir(tmp_path / "state"),
        dirs=ActivationDirs(root=tmp_path / "root", logs=tmp_path / "logs"),
    )  # fmt: skip
    session.events = []
    error = RestoreError("the restore failed")
    with StopSignals() as signals, not_interrupted():
        session.stop_failed_start(error)
        assert signals.requested.is_set() and signals.received == signal.SIGINT
    assert session.events == ["stop begins", "stop ends"]
    assert "cleanup: clean" in error.message


def test_another_threads_cleanup_leaves_the_main_threads_start_interruptible() -> None:
    # copy --count: one copy's start fails and cleans up in its worker thread (where no signal
    # raises); the others, still starting, must still be interrupted by the first signal.
    with StopSignals():
        worker = threading.Thread(target=cleaning)
        worker.start()
        worker.join(timeout=10)
        with pytest.raises(KeyboardInterrupt):
            kill_me(signal.SIGINT)


def test_a_signal_while_deferring_interrupts_once_the_body_has_ended() -> None:
    done: list[str] = []
    with StopSignals() as signals, pytest.raises(KeyboardInterrupt), signals.deferring():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("the body ran to its end")
    assert done == ["the body ran to its end"] and signals.requested.is_set()


def test_an_interrupt_while_criu_starts_never_loses_the_running_criu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal lands inside Popen (CRIU forked, not yet ours): the start still returns
    the process, and finish raises the interrupt only once CRIU has exited."""
    from snapctl.criu import run as run_module
    from tests.criu.fakes import install_fake_criu

    criu = install_fake_criu(tmp_path, "#!/bin/sh\nsleep 0.3\nexit 0\n")
    real_popen = run_module.subprocess.Popen

    def popen_then_signal(*args: Any, **kwargs: Any) -> Any:
        process = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # before Popen could return it
        return process

    monkeypatch.setattr(run_module.subprocess, "Popen", popen_then_signal)
    with StopSignals():
        try:
            started = run_module.start_criu(criu, "restore", tmp_path, tmp_path / "restore.log")
        except KeyboardInterrupt:
            pytest.fail("the interrupt escaped CRIU's start: the running CRIU was lost")
        with pytest.raises(KeyboardInterrupt):
            started.finish(10)
    assert started.process.returncode == 0  # waited for, not orphaned
