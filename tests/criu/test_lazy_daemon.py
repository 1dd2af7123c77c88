"""spawn_lazy_pages_daemon and LazyTransfer against a fake ``criu lazy-pages``: readiness through
--status-fd, a daemon that fails or stalls before it listens, and the watcher's three outcomes."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary, CriuError
from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.daemon import LazyPagesDaemon, spawn_lazy_pages_daemon
from snapctl.criu.lazy.relay import TransferHold
from snapctl.criu.lazy.transfer import LazyTransfer, PagesStatus
from tests.criu.fakes import install_fake_criu

# A fake criu: records its argv, then as FAKE_MODE says: "ready" writes the status byte to the
# --status-fd descriptor and exits FAKE_EXIT after FAKE_SLEEP seconds; "fail" exits 1 at once;
# "hang" never becomes ready.
FAKE_CRIU = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/argv"
prev=
for arg in "$@"; do
    [ "$prev" = --status-fd ] && fd=$arg
    [ "$prev" = --log-file ] && log=$arg
    prev=$arg
done
echo "(00.000001) Version: 4.2.1" > "$log"
case "$FAKE_MODE" in
    ready) printf '\\0' >&"$fd"; exec {fd}>&-; sleep "$FAKE_SLEEP"; exit "$FAKE_EXIT" ;;
    fail) echo "(00.000050) Error (criu/uffd.c:1): no pstree" >> "$log"; exit 1 ;;
    hang) exec sleep 30 ;;
esac
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CriuBinary:
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_SLEEP", "30")
    monkeypatch.setenv("FAKE_EXIT", "0")
    return install_fake_criu(tmp_path, FAKE_CRIU)


def start(fake: CriuBinary, tmp_path: Path, timeout_s: float = 10) -> LazyPagesDaemon:
    """Spawn the daemon and wait until it listens, as restore_tree_lazily does."""
    daemon = spawn_lazy_pages_daemon(
        fake, tmp_path / "img", tmp_path / "work", tmp_path / "logs" / "lazy-pages.log"
    )
    daemon.wait_ready(timeout_s)
    return daemon


def test_ready_daemon_runs_on_its_own_work_dir(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    daemon = start(fake, tmp_path)
    try:
        assert daemon.poll() is None
        argv = (tmp_path / "argv").read_text().splitlines()
        assert argv[0] == "lazy-pages" and argv[argv.index("--work-dir") + 1] == str(
            tmp_path / "work"
        )
        assert (tmp_path / "logs" / "lazy-pages.argv").exists()
        # Info level: its debug lines (one per transferred chunk) slow the transfer.
        assert argv[5] == "-v3"
    finally:
        daemon.kill()
    assert daemon.poll() == -signal.SIGKILL


@pytest.mark.parametrize(("mode", "match"), [("fail", "exited with status 1"), ("hang", "timed")])
def test_daemon_that_never_listens_is_an_error_and_is_gone(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, match: str
) -> None:
    monkeypatch.setenv("FAKE_MODE", mode)
    with pytest.raises(CriuError, match=match) as info:
        start(fake, tmp_path, timeout_s=1.0)
    assert info.value.action == "lazy-pages"
    if mode == "fail":
        assert "no pstree" in (info.value.log_tail or "")


def watch(
    daemon: LazyPagesDaemon, started: float | None = None
) -> tuple[LazyTransfer, list[str], list[PagesStatus]]:
    failures: list[str] = []
    done: list[PagesStatus] = []
    transfer = LazyTransfer(
        daemon, restore_started=time.monotonic() if started is None else started,
        on_failure=failures.append, on_done=done.append,
    )  # fmt: skip
    return transfer, failures, done


def test_exit_0_is_complete(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    monkeypatch.setenv("FAKE_SLEEP", "0.2")
    started = time.monotonic()  # before the daemon starts its 0.2 s
    transfer, failures, done = watch(start(fake, tmp_path), started)
    status = transfer.wait(10)
    assert status.state == "complete" and status.complete_s is not None and status.complete_at
    assert status.complete_s >= 0.2
    assert failures == [] and done == [status]


@pytest.mark.parametrize(("how", "says"), [("kill", "killed by SIGKILL"), ("exit", "status 3")])
def test_any_other_end_is_a_failure_reported_first(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, says: str
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    if how == "exit":
        monkeypatch.setenv("FAKE_SLEEP", "0")
        monkeypatch.setenv("FAKE_EXIT", "3")
    daemon = start(fake, tmp_path)
    transfer, failures, done = watch(daemon)
    if how == "kill":
        daemon.process.send_signal(signal.SIGKILL)
    status = transfer.wait(10)
    assert status.state == "failed" and status.failure is not None and says in status.failure
    assert failures == [status.failure] and done == [status]


def test_stop_is_not_a_failure(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    daemon = start(fake, tmp_path)
    transfer, failures, done = watch(daemon)
    assert transfer.status.state == "transferring"
    status = transfer.stop()
    assert status.state == "stopped" and failures == [] and done == [status]
    assert daemon.poll() is not None
    assert not [t for t in threading.enumerate() if t.name == f"lazy-pages-{daemon.pid}"]


def test_kill_signals_through_the_pidfd_never_by_pid(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The watcher thread reaps the daemon while kill() may run in another: a signal sent by PID
    # after that reap could reach whatever process reused the PID.
    monkeypatch.setenv("FAKE_MODE", "ready")
    daemon = start(fake, tmp_path)
    transfer, _, _ = watch(daemon)

    def no_kill_by_pid(pid: int, signum: int) -> None:
        raise AssertionError(f"signal {signum} sent to PID {pid} by number")

    monkeypatch.setattr("os.kill", no_kill_by_pid)
    status = transfer.stop()
    assert status.state == "stopped" and daemon.poll() == -signal.SIGKILL
    daemon.kill()  # again, once reaped: nothing to signal and no error


def test_a_relay_error_is_part_of_the_failure_and_kill_closes_the_hold(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    (tmp_path / "work").mkdir()
    (tmp_path / "daemon").mkdir()
    hold = TransferHold(tmp_path / "work", tmp_path / "daemon", hold_max_s=10)
    daemon = spawn_lazy_pages_daemon(
        fake, tmp_path / "img", tmp_path / "daemon", tmp_path / "lazy-pages.log", hold=hold
    )
    daemon.wait_ready(10)
    hold.start()
    transfer, failures, _ = watch(daemon)
    transfer.release_transfer(0.5)
    assert hold.released
    hold.error = "lazy-pages relay: no userfaultfd after PID 5"  # as the relay reports it
    daemon.process.send_signal(signal.SIGKILL)
    status = transfer.wait(10)
    assert failures == [status.failure]
    assert status.failure is not None and "by SIGKILL (lazy-pages relay: no" in status.failure
    daemon.kill()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):  # the hold no longer listens for a restore
        client.connect(str(tmp_path / "work" / "lazy-pages.socket"))
    client.close()


def test_releasing_an_unheld_transfer_does_nothing(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "ready")
    daemon = start(fake, tmp_path)
    transfer, failures, _ = watch(daemon)
    transfer.release_transfer()
    assert daemon.hold is None and transfer.status.state == "transferring"
    assert transfer.stop().state == "stopped" and failures == []


def learning(fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *,
             sleep_s: float) -> tuple[LazyTransfer, float, list[float]]:  # fmt: skip
    """A transfer whose daemon ends after ``sleep_s``, the restore's start, what it learns."""
    monkeypatch.setenv("FAKE_MODE", "ready")
    monkeypatch.setenv("FAKE_SLEEP", str(sleep_s))
    started = time.monotonic()
    learned: list[float] = []
    transfer = LazyTransfer(
        start(fake, tmp_path), restore_started=started, on_failure=lambda reason: None,
        on_done=lambda status: None, learn=learned.append,
    )  # fmt: skip
    return transfer, started, learned


@pytest.mark.parametrize("released", [True, False])
def test_a_complete_transfer_learns_until_its_first_release(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, released: bool
) -> None:
    transfer, started, learned = learning(fake, tmp_path, monkeypatch, sleep_s=0.3)
    if released:
        transfer.release_transfer(0.05)
        transfer.release_transfer(10)  # later: the first release counts
        at = time.monotonic() + 0.05 - started + tuning.LEARN_AFTER_RELEASE_S
    assert transfer.wait(10).state == "complete"
    if released:
        (until_s,) = learned
        assert at - 0.01 < until_s <= at
    else:
        assert learned == []  # not ready yet: nothing to learn from until it is


def test_a_transfer_that_ended_before_the_copy_was_ready_learns_at_its_release(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not held back, a transfer can end before the handshake does: its faults still count.
    transfer, started, learned = learning(fake, tmp_path, monkeypatch, sleep_s=0.1)
    assert transfer.wait(10).state == "complete" and learned == []
    before = time.monotonic() + 0.05 - started + tuning.LEARN_AFTER_RELEASE_S
    transfer.release_transfer(0.05)
    at = time.monotonic() + 0.05 - started + tuning.LEARN_AFTER_RELEASE_S
    transfer.release_transfer(0.0)  # once only: no second learning starts
    transfer.stop()  # waits for the learning
    (until_s,) = learned
    assert before <= until_s <= at
    assert [t for t in threading.enumerate() if t.name == "lazy-pages-learn"] == []


def test_a_copy_released_long_after_its_transfer_ended_learns_nothing(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parked with every page in: its activation's touches were no faults, so no set from it.
    monkeypatch.setattr(tuning, "LEARN_RELEASE_AFTER_END_MAX_S", 0.2)
    transfer, _, learned = learning(fake, tmp_path, monkeypatch, sleep_s=0.05)
    assert transfer.wait(10).state == "complete"
    time.sleep(0.3)
    transfer.release_transfer(0.05)
    transfer.stop()
    assert learned == []
