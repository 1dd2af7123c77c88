"""One inotify watch on a control directory, on a descriptor that is pooled, never closed.

Closing an inotify descriptor waits for a kernel grace period (long next to a handshake,
docs/protocol.md), whether or not its watch was removed first; removing a watch does not. So a
watch gives its descriptor back to a per-process pool when it ends, and the next watch reuses
it.
(watchdog's observer opens and closes one per watch, plus a thread: fine for following a log
(:mod:`snapctl.supervision.logs`), too slow for a handshake measured in milliseconds.)

Used by the capturer's waits (:mod:`snapctl.protocol.waiter`) and by the server once it has
accepted an activation (:mod:`snapctl.launcher`). The server must not hold one while it waits
at the capture barrier, where CRIU checkpoints it: a pooled descriptor would be in the image.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading

# Every way a file can appear or change in the directory (the waiter re-reads to decide):
# IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE.
CHANGE_EVENTS = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200

_libc = ctypes.CDLL(None, use_errno=True)
_idle_descriptors: list[int] = []
_idle_lock = threading.Lock()


class DirectoryWatch:
    """An inotify watch on one directory, on a non-blocking descriptor taken from the pool.

    Raises OSError when inotify cannot be set up (say the per-user instance limit is reached);
    callers then wait by polling alone.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with _idle_lock:
            fd = _idle_descriptors.pop() if _idle_descriptors else -1
        if fd < 0:
            fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"inotify_init1: {os.strerror(errno)}")
        wd = _libc.inotify_add_watch(fd, os.fsencode(path), CHANGE_EVENTS)
        if wd < 0:
            errno = ctypes.get_errno()
            _release(fd)
            raise OSError(errno, f"inotify_add_watch {os.fspath(path)}: {os.strerror(errno)}")
        self.fd, self.wd = fd, wd
        self.drain()  # whatever a previous user left queued (its watch's IN_IGNORED)

    def drain(self) -> None:
        """Forget the events seen so far (the caller is about to re-read the directory)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 65536):
                pass

    def wait(self, timeout_s: float) -> None:
        """Return when an event arrives or ``timeout_s`` passes."""
        select.select([self.fd], [], [], timeout_s)

    def close(self) -> None:
        """Remove the watch and give the descriptor back to the pool (it stays open); a second
        call does nothing: pooled twice, one descriptor would serve two watches at once."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        # Fails harmlessly when the directory is gone: the kernel dropped the watch already.
        _libc.inotify_rm_watch(fd, self.wd)
        _release(fd)


def _release(fd: int) -> None:
    with _idle_lock:
        _idle_descriptors.append(fd)
