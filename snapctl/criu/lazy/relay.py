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

While it holds the word, the relay also wakes, every :data:`~snapctl.criu.lazy.tuning.FAULT_WAKE_S`,
the threads waiting on a page fault (``UFFDIO_WAKE`` over each process's whole address space,
through a duplicate of its userfaultfd). CRIU 4.2.1's daemon reads a fault, and if its
``UFFDIO_COPY`` fails with ``EAGAIN`` (the process's mappings are changing: another thread
forks, munmaps or madvises at that moment, as a multi-threaded server does all the time) it puts
the page back in its transfer list without waking the thread, which then waits until the
background transfer reaches that page: with the transfer held, until the hold ends. Woken, the
thread faults again and the daemon serves the new fault; a thread woken while its page is on
its way faults again too, and the daemon finds the page queued or already in place (a zero page
over a present one fails with ``EEXIST``, which it ignores). The duplicates are closed before
the word goes on, because once the transfer runs the daemon closes each process's userfaultfd
when that process's last page is in and relies on the close to unregister its memory and drop
it from its epoll set; a duplicate kept open past that leaves the process's later faults (on
pages the image never had) unserved and the daemon spinning on the closed descriptor.

The protocol relayed (``criu/uffd.c``): for each restored process an ``int`` PID and, unless it
is negative (a zombie), one byte carrying the process's userfaultfd as ``SCM_RIGHTS``; then the
``uint32`` :data:`RESTORE_FINISHED`; then the restore closes its end. Anything else ends the
relay, and a daemon whose restore hangs up before the finished word fails (and with it the copy).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from snapctl.criu.lazy import tuning

# LAZY_PAGES_RESTORE_FINISHED in CRIU's criu/uffd.c ("ReSTore Finished"), never a valid PID.
RESTORE_FINISHED = 0x52535446
SOCKET_NAME = "lazy-pages.socket"
WORD = 4
# linux/userfaultfd.h: _IOR(0xAA, _UFFDIO_WAKE, struct uffdio_range {u64 start, len}).
UFFDIO_WAKE = 0x8010AA02
# Every user address from the lowest mappable page (vm.mmap_min_addr is at most 64 KiB) to the
# top of x86-64's and arm64's 47/48-bit user spaces, as the kernel's range check accepts it.
_WAKE_START = 0x10000
_WAKE_RANGE = struct.pack("=QQ", _WAKE_START, 0x7FFFFFFFF000 - _WAKE_START)


class TransferHold:
    """Listens at ``restore_dir/lazy-pages.socket`` for the restore, relays to the daemon
    listening at ``daemon_dir/lazy-pages.socket``, and holds back the finished word.

    Create it before the restore starts (its socket must exist when the restore connects),
    :meth:`start` it once the daemon listens, :meth:`release` it when the transfer may start,
    :meth:`close` it when the copy ends. The word goes on ``hold_max_s`` after the restore sent
    it at the latest, released or not; :attr:`passed_on` is set once it has.
    """

    def __init__(self, restore_dir: Path, daemon_dir: Path, *, hold_max_s: float) -> None:
        self._daemon_socket = daemon_dir / SOCKET_NAME
        self._hold_max_s = hold_max_s
        self._changed = threading.Condition()
        self._release_at: float | None = None
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._uffds: list[int] = []  # duplicates, owned by the relay thread
        self.wakes = 0
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.finished_seen = threading.Event()
        self.passed_on = threading.Event()  # the finished word reached the daemon
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
        finally:
            self._close_uffds()

    def _wake_faults(self) -> None:
        for uffd in self._uffds:
            # ESRCH/EINVAL once a process exited or its mm is gone: nothing waits there.
            with contextlib.suppress(OSError):
                fcntl.ioctl(uffd, UFFDIO_WAKE, _WAKE_RANGE)
        self.wakes += 1

    def _close_uffds(self) -> None:
        uffds, self._uffds = self._uffds, []
        for uffd in uffds:
            os.close(uffd)

    def _pass_on(self, restore: socket.socket, daemon: socket.socket) -> None:
        while True:
            word = restore.recv(WORD, socket.MSG_WAITALL)
            if len(word) < WORD:
                return  # the restore hung up early: so do we, and the daemon fails
            value = int.from_bytes(word, sys.byteorder, signed=True)
            if value == RESTORE_FINISHED:
                self.finished_seen.set()
                released = self._wait_for_release()
                self._close_uffds()  # see above: before the transfer can start
                if released:
                    daemon.sendall(word)
                    self.passed_on.set()
                return
            daemon.sendall(word)
            if value < 0:
                continue  # a zombie: no userfaultfd follows
            data, fds, _, _ = socket.recv_fds(restore, 1, 1)
            try:
                if len(data) != 1 or len(fds) != 1:
                    self.error = f"lazy-pages relay: no userfaultfd after PID {value}"
                    return
                self._uffds.append(os.dup(fds[0]))
                socket.send_fds(daemon, [data], fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _wait_for_release(self) -> bool:
        """Wait until the release time, at most ``hold_max_s``, waking stalled faults
        meanwhile; False: closed meanwhile."""
        deadline = time.monotonic() + self._hold_max_s
        with self._changed:
            while not self._closed:
                until = deadline if self._release_at is None else min(self._release_at, deadline)
                left = until - time.monotonic()
                if left <= 0:
                    return True
                if not self._changed.wait(min(left, tuning.FAULT_WAKE_S)):
                    self._wake_faults()
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
