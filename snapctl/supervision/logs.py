"""Following an activation's log as it grows (``snapctl logs --follow``).

watchdog reports writes to the log's directory; a poll every ``poll_s`` backs it up, so a
missed event costs at most that long. The observer thread's start and stop cost (milliseconds)
does not matter here, unlike in the activation handshake, which waits on raw inotify.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

CHUNK_BYTES = 65536


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
