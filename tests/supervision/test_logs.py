"""Following a growing log: everything appended before the end is passed on, in order."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from snapctl.supervision.logs import follow_log


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
