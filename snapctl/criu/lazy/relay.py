"""The socket between a lazy restore and its lazy-pages daemon, relayed so that snapctl decides
when the daemon's background transfer starts.

CRIU 4.2's ``criu lazy-pages`` serves page faults only until the restore tells it, on their
shared socket, that the restore has finished; from that word on it also pushes every remaining
page, in chunks of up to 1 MiB between faults. The restore sends the word as soon as the tree is
restored, before the copy has recovered and answered its first request, so the transfer (2 GiB
of fresh memory filled on one of this machine's two cores) competes with exactly the work that
makes the copy ready. :class:`TransferHold` sits on that socket: it passes on every process's
userfaultfd at once, so faults are served from the first instruction, and holds the finished
word back until :meth:`TransferHold.release` (the copy is ready, or is about to need its memory
in bulk) or a deadline, whichever comes first.

The protocol relayed (``criu/uffd.c``): for each restored process an ``int`` PID and, unless it
is negative (a zombie), one byte carrying the process's userfaultfd as ``SCM_RIGHTS``; then the
``uint32`` :data:`RESTORE_FINISHED`; then the restore closes its end. Anything else ends the
relay, and a daemon whose restore hangs up before the finished word fails (and with it the copy).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# LAZY_PAGES_RESTORE_FINISHED in CRIU's criu/uffd.c ("ReSTore Finished"), never a valid PID.
RESTORE_FINISHED = 0x52535446
SOCKET_NAME = "lazy-pages.socket"
WORD = 4


class TransferHold:
    """Listens at ``restore_dir/lazy-pages.socket`` for the restore, relays to the daemon
    listening at ``daemon_dir/lazy-pages.socket``, and holds back the finished word.

    Create it before the restore starts (its socket must exist when the restore connects),
    :meth:`start` it once the daemon listens, :meth:`release` it when the transfer may start,
    :meth:`close` it when the copy ends. The word goes on ``hold_max_s`` after the restore sent
    it at the latest, released or not.
    """

    def __init__(self, restore_dir: Path, daemon_dir: Path, *, hold_max_s: float) -> None:
        self._daemon_socket = daemon_dir / SOCKET_NAME
        self._hold_max_s = hold_max_s
        self._changed = threading.Condition()
        self._release_at: float | None = None
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.finished_seen = threading.Event()
        self._listener = self._track(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        try:
            with socket_path(restore_dir / SOCKET_NAME) as where:
                self._listener.bind(where)
            self._listener.listen(1)
        except BaseException:
            self._listener.close()
            raise

    def start(self) -> None:
        """Accept the restore and relay (in a thread); the daemon must be listening."""
        self._thread = threading.Thread(target=self._relay, name="lazy-pages-hold", daemon=True)
        self._thread.start()

    def release(self, delay_s: float = 0.0) -> None:
        """Let the daemon start its background transfer ``delay_s`` from now (or once the
        restore has finished, if later). A later call can only bring the start forward."""
        release_at = time.monotonic() + delay_s
        with self._changed:
            if self._release_at is None or release_at < self._release_at:
                self._release_at = release_at
                self._changed.notify_all()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called (the transfer may still wait for its delay)."""
        with self._changed:
            return self._release_at is not None

    def close(self) -> None:
        """End the relay. A finished word still held is dropped, and the daemon then fails."""
        with self._changed:
            self._closed = True
            sockets = list(self._sockets)
            self._changed.notify_all()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for sock in sockets:
            sock.close()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._changed:
            self._sockets.append(sock)
            if self._closed:  # closed meanwhile: make the relay's next call on it fail
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        return sock

    def _relay(self) -> None:
        try:
            restore, _ = self._listener.accept()
            self._track(restore)
            daemon = self._track(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            with socket_path(self._daemon_socket) as where:
                daemon.connect(where)
            self._pass_on(restore, daemon)
        except OSError as error:
            if not self._closed:
                self.error = f"lazy-pages relay: {error}"
        finally:
            with self._changed:
                sockets, self._sockets = self._sockets, []
            for sock in sockets:
                sock.close()

    def _pass_on(self, restore: socket.socket, daemon: socket.socket) -> None:
        while True:
            word = restore.recv(WORD, socket.MSG_WAITALL)
            if len(word) < WORD:
                return  # the restore hung up early: so do we, and the daemon fails
            value = int.from_bytes(word, sys.byteorder, signed=True)
            if value == RESTORE_FINISHED:
                self.finished_seen.set()
                if self._wait_for_release():
                    daemon.sendall(word)
                return
            daemon.sendall(word)
            if value < 0:
                continue  # a zombie: no userfaultfd follows
            data, fds, _, _ = socket.recv_fds(restore, 1, 1)
            try:
                if len(data) != 1 or len(fds) != 1:
                    self.error = f"lazy-pages relay: no userfaultfd after PID {value}"
                    return
                socket.send_fds(daemon, [data], fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _wait_for_release(self) -> bool:
        """Wait until the release time, at most ``hold_max_s``; False: closed meanwhile."""
        deadline = time.monotonic() + self._hold_max_s
        with self._changed:
            while not self._closed:
                until = deadline if self._release_at is None else min(self._release_at, deadline)
                left = until - time.monotonic()
                if left <= 0:
                    return True
                self._changed.wait(left)
            return False


@contextlib.contextmanager
def socket_path(path: Path) -> Iterator[str]:
    """``path`` as a Unix socket can be bound or connected to: through a descriptor of its
    directory, since a socket's path is limited to 107 bytes and a state directory's is not."""
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
