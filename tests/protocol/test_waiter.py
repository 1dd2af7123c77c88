"""The capturer's waiter: event-driven wake-up, polling fallback, deadline, liveness."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapctl.errors import ProcessExitedError, ProtocolError, WaitTimeoutError
from snapctl.protocol import waiter
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.inotify import DirectoryWatch
from snapctl.protocol.models import ControlFile
from snapctl.protocol.waiter import ControlDirWatcher, wait_for
from tests.protocol.factories import make_control_dir, make_error, make_ready, make_status


@pytest.fixture
def control(tmp_path: Path) -> ControlDir:
    return make_control_dir(tmp_path)


@pytest.fixture
def later() -> Iterator[Callable[[float, Callable[[], object]], None]]:
    """Run an action on a background thread after a delay; joined at teardown."""
    threads: list[threading.Thread] = []

    def schedule(delay_s: float, action: Callable[[], object]) -> None:
        def run() -> None:
            time.sleep(delay_s)
            action()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)

    yield schedule
    for thread in threads:
        thread.join(5)


def test_returns_a_present_file_at_once(control: ControlDir) -> None:
    control.write(make_ready())
    started = time.monotonic()
    arrival = wait_for(control, ControlFile.CAPTURE_READY, 5, poll_s=10)
    assert arrival.name is ControlFile.CAPTURE_READY
    assert arrival.model == make_ready()
    assert time.monotonic() - started < 2.0  # not after a poll, nor at the 5 s timeout


def test_file_events_wake_the_wait_long_before_the_poll_interval(
    control: ControlDir, later: Callable[[float, Callable[[], object]], None]
) -> None:
    writing: list[float] = []

    def publish() -> None:
        writing.append(time.monotonic())
        control.write(make_status())

    later(0.05, publish)
    # A 10 s poll interval: only an inotify event can end this wait quickly.
    arrival = wait_for(control, ControlFile.STATUS, 5, poll_s=10)
    woke = time.monotonic()
    assert arrival.model == make_status()
    assert woke - writing[0] < 2.0  # far below the poll interval, with room for a slow fsync


def test_polling_finds_the_file_when_events_are_lost(
    control: ControlDir,
    later: Callable[[float, Callable[[], object]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Events never wake the wait: only the poll interval can find the file.
    monkeypatch.setattr(
        waiter.DirectoryWatch, "wait", lambda self, timeout_s: time.sleep(timeout_s)
    )
    later(0.05, lambda: control.write(make_status()))
    started = time.monotonic()
    arrival = wait_for(control, ControlFile.STATUS, 5, poll_s=0.02)
    assert arrival.name is ControlFile.STATUS
    assert time.monotonic() - started < 1


def test_polling_alone_when_inotify_is_unavailable(
    control: ControlDir,
    later: Callable[[float, Callable[[], object]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_inotify(path: str) -> None:
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(waiter, "DirectoryWatch", no_inotify)
    later(0.05, lambda: control.write(make_status()))
    arrival = wait_for(control, ControlFile.STATUS, 5, poll_s=0.02)
    assert arrival.name is ControlFile.STATUS


def test_first_of_several_names_wins(
    control: ControlDir, later: Callable[[float, Callable[[], object]], None]
) -> None:
    later(0.05, lambda: control.write(make_error()))
    arrival = wait_for(control, [ControlFile.STATUS, ControlFile.ERROR], 5)
    assert arrival.name is ControlFile.ERROR
    assert arrival.model == make_error()


def test_names_are_checked_in_the_given_order(control: ControlDir) -> None:
    control.write(make_status())
    control.write(make_error())
    assert wait_for(control, [ControlFile.ERROR, ControlFile.STATUS], 5).name is ControlFile.ERROR
    assert wait_for(control, [ControlFile.STATUS, ControlFile.ERROR], 5).name is ControlFile.STATUS


def test_timeout_names_what_was_awaited(control: ControlDir) -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError) as caught:
        wait_for(control, [ControlFile.CHALLENGE, ControlFile.ERROR], 0.2)
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 1.0
    assert isinstance(caught.value, TimeoutError)
    assert "challenge.json or error.json" in str(caught.value)
    assert caught.value.awaited == ("challenge.json", "error.json")
    assert caught.value.path == control.path


def test_timeout_is_a_wall_clock_deadline_despite_spurious_events(
    control: ControlDir, later: Callable[[float, Callable[[], object]], None]
) -> None:
    def noise(index: int) -> Callable[[], object]:
        return lambda: (control.path / f"noise{index}").write_text("")

    for index in range(5):
        later(0.03 * index, noise(index))
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError):
        wait_for(control, ControlFile.STATUS, 0.3, poll_s=10)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("timeout_s", [0, -1, math.nan, math.inf, -math.inf])
def test_timeout_must_be_positive_and_finite(control: ControlDir, timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        wait_for(control, ControlFile.STATUS, timeout_s)


def test_timeout_must_be_a_number(control: ControlDir) -> None:
    with pytest.raises(TypeError):
        wait_for(control, ControlFile.STATUS, True)
    with pytest.raises(TypeError):
        wait_for(control, ControlFile.STATUS, "1")  # type: ignore[arg-type]


def test_poll_interval_must_be_positive(control: ControlDir) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        wait_for(control, ControlFile.STATUS, 1, poll_s=0)


def test_no_names_is_refused(control: ControlDir) -> None:
    with pytest.raises(ValueError, match="at least one"):
        wait_for(control, [], 1)


def test_dead_process_ends_the_wait_and_accepts_a_log_tail(control: ControlDir) -> None:
    calls: list[float] = []

    def alive() -> bool:
        calls.append(time.monotonic())
        return len(calls) < 3

    with pytest.raises(ProcessExitedError) as caught:
        wait_for(control, ControlFile.CAPTURE_READY, 5, alive=alive, poll_s=0.01)
    assert len(calls) == 3
    error = caught.value
    assert error.awaited == ("capture-ready.json",)
    error.log_tail = "Traceback ...\nRuntimeError: CUDA init failed\n"
    assert str(error).endswith("RuntimeError: CUDA init failed")
    assert "capture-ready.json" in str(error)


def test_file_written_just_before_exit_is_still_returned(control: ControlDir) -> None:
    def alive() -> bool:
        # The process writes error.json, then exits before the next round.
        if not control.file_path(ControlFile.ERROR).exists():
            control.write(make_error())
        return False

    arrival = wait_for(control, [ControlFile.CAPTURE_READY, ControlFile.ERROR], 5, alive=alive)
    assert arrival.name is ControlFile.ERROR


def test_invalid_file_is_an_error_not_a_wait(control: ControlDir) -> None:
    control.file_path(ControlFile.STATUS).write_text("{")
    with pytest.raises(ProtocolError, match=r"status\.json"):
        wait_for(control, ControlFile.STATUS, 5)


def test_unsafe_directory_is_refused(control: ControlDir) -> None:
    control.path.chmod(0o777)
    with pytest.raises(ProtocolError):
        wait_for(control, ControlFile.STATUS, 1)


def test_observer_threads_are_gone_after_the_wait(control: ControlDir) -> None:
    before = set(threading.enumerate())
    with pytest.raises(WaitTimeoutError):
        wait_for(control, ControlFile.STATUS, 0.05)
    control.write(make_status())
    wait_for(control, ControlFile.STATUS, 1)
    assert set(threading.enumerate()) <= before


def test_inotify_descriptor_is_reused_and_still_wakes_the_wait(
    tmp_path: Path, later: Callable[[float, Callable[[], object]], None]
) -> None:
    first, second = make_control_dir(tmp_path, "a"), make_control_dir(tmp_path, "b")
    with ControlDirWatcher(first) as watcher:
        assert watcher._inotify is not None
        descriptor = watcher._inotify.fd
        first.write(make_status())  # an event left queued for the next user to drain
    later(0.05, lambda: second.write(make_status()))
    with ControlDirWatcher(second) as watcher:
        assert watcher._inotify is not None and watcher._inotify.fd == descriptor
        # Polls every 10 s, times out after 5: only an event on the reused descriptor ends it.
        assert watcher.wait_for(ControlFile.STATUS, 5, poll_s=10).name is ControlFile.STATUS


def test_wait_for_change_wakes_when_a_present_file_is_replaced(
    control: ControlDir, later: Callable[[float, Callable[[], object]], None]
) -> None:
    control.write(make_status(phase="recovering"))
    with ControlDirWatcher(control) as watcher:
        assert watcher.wait_for(ControlFile.STATUS, 5).model == make_status(phase="recovering")
        later(0.05, lambda: control.write(make_status(phase="validated"), overwrite=True))
        started = time.monotonic()
        while watcher.wait_for(ControlFile.STATUS, 5).model != make_status(phase="validated"):
            # A 10 s timeout: without the replacement's events this loop would take minutes.
            watcher.wait_for_change(10)
            assert time.monotonic() - started < 5, "wait_for_change did not wake on the event"


def test_wait_for_change_returns_after_its_timeout(control: ControlDir) -> None:
    with ControlDirWatcher(control) as watcher:
        watcher.wait_for_change(0.01)  # nothing changes: returns once the timeout passed
    with pytest.raises(RuntimeError):
        ControlDirWatcher(control).wait_for_change(0.01)


def test_one_watcher_serves_a_sequence_of_waits(
    control: ControlDir, later: Callable[[float, Callable[[], object]], None]
) -> None:
    with ControlDirWatcher(control) as watcher:
        later(0.02, lambda: control.write(make_ready()))
        assert watcher.wait_for(ControlFile.CAPTURE_READY, 5).name is ControlFile.CAPTURE_READY
        later(0.02, lambda: control.write(make_status()))
        assert watcher.wait_for(ControlFile.STATUS, 5, poll_s=10).name is ControlFile.STATUS
    with pytest.raises(RuntimeError, match="only once"), watcher:
        pass


def test_watcher_must_be_entered(control: ControlDir) -> None:
    with pytest.raises(RuntimeError, match="with block"):
        ControlDirWatcher(control).wait_for(ControlFile.STATUS, 1)


def test_a_watch_closed_twice_gives_its_descriptor_back_once(tmp_path: Path) -> None:
    watch = DirectoryWatch(tmp_path)
    watch.close()
    watch.close()
    first, second = DirectoryWatch(tmp_path), DirectoryWatch(tmp_path)
    try:
        assert first.fd != second.fd
    finally:
        first.close()
        second.close()
