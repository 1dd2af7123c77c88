"""Reading an activation's log (``snapctl logs``), and following it as it grows
(``--follow``), in chunks and decoded as text the same way in-process and through the agent.

watchdog reports writes to the log's directory; a poll every ``poll_s`` backs it up, so a
missed event costs at most that long. The observer thread's start and stop cost (milliseconds)
does not matter here, unlike in the activation handshake, which waits on raw inotify.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

CHUNK_BYTES = 65536


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
    """Write what ``path`` holds, in chunks, unless ``until()`` turns true first (never the
    whole log in memory at once: a server may have written gigabytes)."""
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
    is true and everything written before it was passed on. Returns the final offset."""
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
                if finished:
                    return log.tell()
                changed.wait(poll_s)
                changed.clear()
    finally:
        observer.stop()
        observer.join()
