"""TransferHold between a stand-in restore and a stand-in daemon, speaking CRIU's lazy-pages
socket protocol (PID, userfaultfd as SCM_RIGHTS, the finished word)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from snapctl.criu.lazy.relay import RESTORE_FINISHED, SOCKET_NAME, TransferHold, socket_path

pytestmark = pytest.mark.timeout(30)


def word(value: int) -> bytes:
    return value.to_bytes(4, sys.byteorder, signed=True)


FINISHED = word(RESTORE_FINISHED)


@dataclass
class FakeDaemon:
    """Listens like ``criu lazy-pages`` and records what arrives, fds kept apart per read."""

    listener: socket.socket
    received: list[tuple[bytes, list[int]]] = field(default_factory=list)
    hung_up: threading.Event = field(default_factory=threading.Event)
    got_finished: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 4, 1)
                if not data:
                    break
                self.received.append((data, fds))
                if data == FINISHED:
                    self.got_finished.set()
        self.hung_up.set()

    def data(self) -> bytes:
        return b"".join(chunk for chunk, _ in self.received)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    # Deeper than a Unix socket path may be: the hold binds and connects through a dir fd.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    restore_dir, daemon_dir = deep / "restore", deep / "daemon"
    restore_dir.mkdir(parents=True)
    daemon_dir.mkdir()
    return restore_dir, daemon_dir


@pytest.fixture
def daemon(dirs: tuple[Path, Path]) -> Iterator[FakeDaemon]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket_path(dirs[1] / SOCKET_NAME) as where:
        listener.bind(where)
    listener.listen(1)
    fake = FakeDaemon(listener)
    thread = threading.Thread(target=fake.serve, daemon=True)
    thread.start()
    yield fake
    listener.close()
    for _, fds in fake.received:
        for fd in fds:
            os.close(fd)


def hold_for(dirs: tuple[Path, Path], hold_max_s: float = 20.0) -> TransferHold:
    hold = TransferHold(dirs[0], dirs[1], hold_max_s=hold_max_s)
    hold.start()
    return hold


def connect_restore(restore_dir: Path) -> socket.socket:
    restore = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket_path(restore_dir / SOCKET_NAME) as where:
        restore.connect(where)
    return restore


def send_process(restore: socket.socket, pid: int, uffd: int) -> None:
    """What CRIU's send_uffd sends: the PID, then one byte carrying the descriptor."""
    restore.send(word(pid))
    socket.send_fds(restore, [b"\0"], [uffd])


def test_descriptors_pass_at_once_and_the_finished_word_waits_for_release(
    dirs: tuple[Path, Path], daemon: FakeDaemon
) -> None:
    hold = hold_for(dirs)
    read_end, write_end = os.pipe()
    restore = connect_restore(dirs[0])
    send_process(restore, 7, write_end)
    restore.send(word(-9))  # a zombie: no descriptor follows
    send_process(restore, 8, write_end)
    restore.send(FINISHED)
    restore.close()
    os.close(write_end)
    assert hold.finished_seen.wait(10)
    assert not daemon.got_finished.wait(0.3)
    assert daemon.data() == word(7) + b"\0" + word(-9) + word(8) + b"\0"
    # Each descriptor arrives on its own one-byte read, as CRIU's recv_fd expects.
    passed = [(chunk, fds) for chunk, fds in daemon.received if fds]
    assert [(chunk, len(fds)) for chunk, fds in passed] == [(b"\0", 1), (b"\0", 1)]
    os.write(passed[0][1][0], b"through")
    assert os.read(read_end, 7) == b"through"
    hold.release()
    assert daemon.got_finished.wait(10) and daemon.hung_up.wait(10)
    assert daemon.data().endswith(FINISHED) and hold.error is None
    hold.close()
    os.close(read_end)


def test_an_unreleased_hold_lets_go_after_its_maximum(
    dirs: tuple[Path, Path], daemon: FakeDaemon
) -> None:
    hold = hold_for(dirs, hold_max_s=0.2)
    restore = connect_restore(dirs[0])
    restore.send(FINISHED)
    assert daemon.got_finished.wait(10)
    assert hold.passed_on.wait(10) and not hold.released
    restore.close()
    hold.close()


def test_a_later_release_can_only_bring_the_start_forward(
    dirs: tuple[Path, Path], daemon: FakeDaemon
) -> None:
    hold = hold_for(dirs)
    hold.release(delay_s=60)
    restore = connect_restore(dirs[0])
    restore.send(FINISHED)
    assert hold.finished_seen.wait(10)
    hold.release(delay_s=120)
    assert not daemon.got_finished.wait(0.3) and not hold.passed_on.is_set()
    hold.release(delay_s=0)
    assert hold.passed_on.wait(10) and daemon.got_finished.wait(10)
    restore.close()
    hold.close()


def test_closing_drops_a_held_finished_word(dirs: tuple[Path, Path], daemon: FakeDaemon) -> None:
    hold = hold_for(dirs)
    restore = connect_restore(dirs[0])
    restore.send(word(-5))
    restore.send(FINISHED)
    assert hold.finished_seen.wait(10)
    hold.close()
    assert not hold.passed_on.is_set()
    # The daemon sees its restore hang up unfinished: CRIU's daemon then fails (and the copy).
    assert daemon.hung_up.wait(10)
    assert daemon.data() == word(-5) and not daemon.got_finished.is_set()
    restore.close()


def test_a_restore_that_dies_midway_hangs_up_the_daemon_too(
    dirs: tuple[Path, Path], daemon: FakeDaemon
) -> None:
    hold = hold_for(dirs)
    restore = connect_restore(dirs[0])
    restore.send(word(5))  # and no descriptor
    restore.close()
    assert daemon.hung_up.wait(10)
    assert daemon.data() == word(5) and not daemon.got_finished.is_set()
    hold.close()
    assert hold.error is not None and "no userfaultfd after PID 5" in hold.error


def test_closing_before_the_restore_connected_ends_the_relay(dirs: tuple[Path, Path]) -> None:
    hold = hold_for(dirs)
    hold.close()  # returns only once its thread has ended (a hang fails on the timeout)
    assert hold.error is None
    with pytest.raises(ConnectionRefusedError):
        connect_restore(dirs[0])


def open_fds() -> set[int]:
    # Less the listing's own descriptor, closed by the time it is looked at.
    return {int(n) for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")}


def test_faults_are_woken_while_held_and_its_copies_close_before_the_word_goes_on(
    dirs: tuple[Path, Path], daemon: FakeDaemon
) -> None:
    before = open_fds()
    hold = hold_for(dirs)
    read_end, write_end = os.pipe()  # a stand-in userfaultfd: its UFFDIO_WAKE fails, ignored
    restore = connect_restore(dirs[0])
    send_process(restore, 7, write_end)
    restore.send(FINISHED)
    restore.close()
    os.close(write_end)
    assert hold.finished_seen.wait(10)
    deadline = time.monotonic() + 10
    while hold.wakes < 3 and time.monotonic() < deadline:  # held: woken every FAULT_WAKE_S
        time.sleep(0.01)
    assert hold.wakes >= 3
    hold.release()
    assert daemon.got_finished.wait(10) and daemon.hung_up.wait(10)
    for _, fds in daemon.received:
        for fd in fds:
            os.close(fd)
    daemon.received.clear()
    os.close(read_end)
    # The relay's copy went before the word: the daemon's own close must be the last one.
    assert open_fds() <= before
    woken = hold.wakes
    time.sleep(0.05)
    assert hold.wakes == woken
    hold.close()
