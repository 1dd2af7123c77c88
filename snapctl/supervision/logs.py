"""Reading an activation's log (``snapctl logs``), and following it as it grows
(``--follow``), in chunks and decoded as text the same way in-process and through the agent;
and keeping it bounded (:func:`bound_log`): a server that logs for weeks does not fill the disk.

watchdog reports writes to the log's directory; a poll every ``poll_s`` backs it up, so a
missed event costs at most that long. The observer thread's start and stop cost (milliseconds)
does not matter here, unlike in the activation handshake, which waits on raw inotify.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

CHUNK_BYTES = 65536
# A server log past LOG_CAP_BYTES is cut: its first KEPT_HEAD_BYTES (how the server started)
# and its latest KEPT_TAIL_BYTES go to ``server.log.old``, and the log starts over, so that an
# activation's logs never hold much more than the cap plus what was kept.
LOG_CAP_BYTES = 64 << 20
KEPT_HEAD_BYTES = 1 << 20
KEPT_TAIL_BYTES = 16 << 20
OLD_SUFFIX = ".old"


def old_log(path: Path) -> Path:
    """Where :func:`bound_log` keeps what it cut from ``path``."""
    return path.with_name(path.name + OLD_SUFFIX)


def bound_log(
    path: Path, cap: int = LOG_CAP_BYTES, head: int = KEPT_HEAD_BYTES, tail: int = KEPT_TAIL_BYTES
) -> bool:
    """If ``path`` holds more than ``cap`` bytes: keep its head and latest tail, with a line
    saying how much was cut between them, in :func:`old_log` (replacing an earlier one), and
    truncate ``path``; True when it did. The server appends (``O_APPEND``), so it writes on from
    the start; what it appends between the last read here and the truncation is lost."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= cap:
        return False
    staged = path.with_name(f".{path.name}{OLD_SUFFIX}.tmp")
    try:
        with path.open("rb") as log, open(staged, "wb", opener=_private) as kept:
            kept.write(log.read(head))
            resume = max(head, size - tail)
            kept.write(f"\n[snapctl: {resume - head} bytes of this log were cut here]\n".encode())
            log.seek(resume)
            while chunk := log.read(CHUNK_BYTES):
                kept.write(chunk)
        os.replace(staged, old_log(path))
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    os.truncate(path, 0)
    return True


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class TextChunks:
    """A log's bytes passed on as text, decoded as UTF-8 across chunks: a character split
    between two chunks still reads as itself; an invalid byte, or a character cut off at the
    end (:meth:`flush`), reads as U+FFFD."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, chunk: bytes) -> None:
        if text := self._decoder.decode(chunk):
            self._write(text)

    def flush(self) -> None:
        if text := self._decoder.decode(b"", final=True):
            self._write(text)


def read_log(
    path: Path, write: Callable[[bytes], None], *, until: Callable[[], bool] = lambda: False
) -> None:
    """Write what ``path`` holds (after what :func:`bound_log` kept of it, if it cut it), in
    chunks, unless ``until()`` turns true first (never a whole log in memory at once)."""
    with contextlib.suppress(FileNotFoundError):
        read_log_part(old_log(path), write, until=until)
    read_log_part(path, write, until=until)


def read_log_part(
    path: Path, write: Callable[[bytes], None], *, until: Callable[[], bool] = lambda: False
) -> None:
    """Write what the one file ``path`` holds, in chunks, unless ``until()`` turns true."""
    with path.open("rb") as log:
        while not until() and (chunk := log.read(CHUNK_BYTES)):
            write(chunk)


def pass_log(
    path: Path, write: Callable[[str], None], *, done: Callable[[], bool] | None = None,
    until: Callable[[], bool] = lambda: False,
) -> None:  # fmt: skip
    """Write ``path``'s text (see :class:`TextChunks`): what it holds and, given ``done``
    (``--follow``), what is appended until ``done()``; either way unless ``until()`` turns
    true first. What ``snapctl logs`` prints, in-process and through the agent alike."""
    text = TextChunks(write)
    if done is None:
        read_log(path, text.write, until=until)
    else:
        with contextlib.suppress(FileNotFoundError):  # what bound_log kept of it, first
            read_log_part(old_log(path), text.write, until=until)
        follow_log(path, text.write, done=lambda: done() or until())
    text.flush()


class _Wake(FileSystemEventHandler):
    def __init__(self, path: Path, event: threading.Event) -> None:
        self.path = str(path)
        self.event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.src_path == self.path:
            self.event.set()


def follow_log(
    path: Path,
    write: Callable[[bytes], None],
    *,
    done: Callable[[], bool],
    offset: int = 0,
    poll_s: float = 1.0,
) -> int:
    """Write what ``path`` holds from ``offset`` on, then what is appended, until ``done()``
    is true and everything written before it was passed on; a log that :func:`bound_log` cut
    is followed on from its new start. Returns the final offset."""
    changed = threading.Event()
    observer = Observer()
    observer.schedule(_Wake(path, changed), str(path.parent), recursive=False)
    observer.start()
    try:
        with path.open("rb") as log:
            log.seek(offset)
            while True:
                finished = done()  # checked before the last read, so nothing is cut off
                while chunk := log.read(CHUNK_BYTES):
                    write(chunk)
                if os.fstat(log.fileno()).st_size < log.tell():  # cut by bound_log
                    log.seek(0)
                    continue
                if finished:
                    return log.tell()
                changed.wait(poll_s)
                changed.clear()
    finally:
        observer.stop()
        observer.join()
