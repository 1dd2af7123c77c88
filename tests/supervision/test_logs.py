"""Following a growing log: everything appended before the end is passed on, in order."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from snapctl.supervision.logs import bound_log, follow_log, old_log, pass_log, read_log


def test_follow_passes_on_everything_written_until_done(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"before\n")
    finished = threading.Event()
    received: list[bytes] = []

    def server() -> None:
        with log.open("ab") as out:
            for index in range(50):
                out.write(f"line {index}\n".encode())
                out.flush()
                time.sleep(0.002)
        finished.set()  # the activation stops right after its last write

    writer = threading.Thread(target=server)
    writer.start()
    end = follow_log(log, received.append, done=finished.is_set, poll_s=0.05)
    writer.join()
    expected = b"before\n" + b"".join(f"line {i}\n".encode() for i in range(50))
    assert b"".join(received) == expected
    assert end == len(expected)


def test_follow_from_an_offset_and_already_done(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"old\nnew\n")
    received: list[bytes] = []
    assert follow_log(log, received.append, done=lambda: True, offset=4) == 8
    assert received == [b"new\n"]


def test_a_log_past_its_cap_keeps_its_head_and_tail_and_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"H" * 10 + b"x" * 100 + b"T" * 20)
    assert bound_log(log, cap=200) is False  # under the cap: left alone
    assert bound_log(log, cap=100, head=10, tail=20) is True
    assert log.read_bytes() == b""
    kept = old_log(log).read_bytes()
    assert kept == b"H" * 10 + b"\n[snapctl: 100 bytes of this log were cut here]\n" + b"T" * 20
    assert oct(old_log(log).stat().st_mode & 0o777) == "0o600"
    with log.open("ab") as server:  # the server appends on, from the start
        server.write(b"after\n")
    received: list[bytes] = []
    read_log(log, received.append)
    assert b"".join(received) == kept + b"after\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_follower_goes_on_from_the_start_of_a_log_that_was_cut(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"a" * 64)
    received: list[bytes] = []
    rounds = iter(range(100))

    def done() -> bool:
        round_ = next(rounds)
        if round_ == 1:  # after the follower read the first 64 bytes
            bound_log(log, cap=32, head=0, tail=0)
            log.write_bytes(b"new\n")
        return round_ >= 2

    follow_log(log, received.append, done=done, poll_s=0.01)
    assert b"".join(received) == b"a" * 64 + b"new\n"


def test_a_missing_log_is_still_an_error_to_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path / "server.log", lambda chunk: None)


def test_a_cut_that_cannot_be_kept_leaves_no_staged_file(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * 100)
    old_log(log).mkdir()  # nothing can replace it
    with pytest.raises(OSError):
        bound_log(log, cap=10, head=1, tail=1)
    assert log.read_bytes() == b"x" * 100  # not truncated: nothing was kept
    assert not list(tmp_path.glob(".*.tmp"))


def test_following_a_cut_log_shows_what_was_kept_first(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"start\n" + b"x" * 100 + b"end\n")
    bound_log(log, cap=10, head=6, tail=4)
    log.write_bytes(b"after\n")
    followed: list[str] = []
    pass_log(log, followed.append, done=lambda: True)
    read: list[str] = []
    pass_log(log, read.append)
    assert "".join(followed) == "".join(read)
    assert "".join(read).startswith("start\n") and "".join(read).endswith("end\nafter\n")
