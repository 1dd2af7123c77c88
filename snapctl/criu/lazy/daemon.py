"""The lazy restore's CRIU processes: ``criu restore --lazy-pages`` and the copy's own
``criu lazy-pages`` daemon, started together, the daemon's background transfer held back
until the copy is ready (:mod:`snapctl.criu.lazy.relay`)."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import termios
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.pagemap import link_relative, relative_dir_of
from snapctl.criu.lazy.relay import TransferHold
from snapctl.criu.locate import CriuBinary
from snapctl.criu.ops import INVENTORY, RESTORE_LOG_LEVEL, restore_args
from snapctl.criu.run import CriuError, CriuProcess, CriuResult, spawn_criu, start_criu
from snapctl.supervision.process import start_time


class LazyPagesDaemon:
    """A ``criu lazy-pages`` process, our own child, serving one restore's page faults and then
    pushing the remaining pages; it exits 0 once every page was copied into the tree."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        log_path: Path,
        ready_fd: int | None = None,
        hold: TransferHold | None = None,
    ) -> None:
        self.process = process
        self.log_path = log_path
        self.pid = process.pid
        self.hold = hold
        # Read end of its --status-fd pipe until wait_ready has seen the ready byte.
        self._ready_fd = ready_fd
        # Pinned before anyone can reap it: the watcher thread reaps it in ``wait`` while
        # ``kill`` may run in another, and a signal by PID in between could hit a reused PID.
        self._pidfd: int | None = os.pidfd_open(process.pid)
        self.start_time = start_time(process.pid)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the daemon listens; otherwise kill it and raise :class:`CriuError`."""
        read_fd, self._ready_fd = self._ready_fd, None
        if read_fd is None:
            return
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CriuError("lazy-pages", None, self.log_path)
                if select.select([read_fd], [], [], left)[0]:
                    break
            if os.read(read_fd, 1) != b"\0":
                # The pipe closed without the ready byte: the daemon failed to start.
                status = self.wait(timeout_s)
                raise CriuError("lazy-pages", status, self.log_path)
        except BaseException:
            self.kill()
            raise
        finally:
            os.close(read_fd)

    def release_transfer(self, delay_s: float = 0.0) -> None:
        """Let a held background transfer start ``delay_s`` from now."""
        if self.hold is not None:
            self.hold.release(delay_s)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit status (negative: killed by that signal), or None at the deadline."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL and reap: once its tree is gone the daemon holds nothing worth a grace."""
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        if self._pidfd is not None:
            # ESRCH: it already exited (reaped or not), which is what killing wants.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self.process.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self.hold is not None:
            self.hold.close()

    def describe_exit(self, status: int) -> str:
        how = f"exited with status {status}"
        if status < 0:
            how = f"killed by {signal.Signals(-status).name}"
        if self.hold is not None and self.hold.error is not None:
            how += f" ({self.hold.error})"
        return how


def spawn_lazy_pages_daemon(
    criu: CriuBinary,
    images_dir: Path,
    work_dir: Path,
    log_path: Path,
    *,
    hold: TransferHold | None = None,
) -> LazyPagesDaemon:
    """Start ``criu lazy-pages`` for one restore; :meth:`LazyPagesDaemon.wait_ready` says when
    it listens. With ``hold``, the restore reaches the daemon through it (see
    :mod:`snapctl.criu.lazy.relay`), and the daemon's :meth:`~LazyPagesDaemon.kill` closes it.

    The daemon and ``criu restore --lazy-pages`` meet at ``lazy-pages.socket`` in their shared
    work dir (CRIU binds the relative name after ``chdir`` to ``-W``), so every restore needs
    its own work dir: two daemons on one work dir both report success while one of them took
    the other's socket. ``--status-fd`` tells us when the socket is bound; the daemon runs in
    the foreground as our child so that its exit status is ours to read.
    """
    read_fd, write_fd = os.pipe()
    try:
        args = ["--work-dir", str(work_dir), "--status-fd", str(write_fd)]
        process = spawn_criu(
            criu, "lazy-pages", images_dir, log_path, args, pass_fds=[write_fd],
            log_level=RESTORE_LOG_LEVEL,
        )  # fmt: skip
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return LazyPagesDaemon(process, log_path, ready_fd=read_fd, hold=hold)


class InventoryGate:
    """Holds a ``criu restore`` right after its kernel probe, until we let it go.

    ``criu restore --lazy-pages`` connects to its lazy-pages daemon early and fails if the
    daemon does not listen yet, so the daemon must be up first; but each CRIU process spends
    its first tens of milliseconds starting and probing the kernel (``kerndat``: no cache
    without a tmpfs /run; docs/lazy.md, step 3), which a lazy copy would pay twice in a row.
    The gate lets both start at once: the restore reads its images through a view whose
    ``inventory.img`` is a FIFO, and ``inventory.img`` is the first image CRIU 4.2 reads
    (``cr_restore_tasks`` checks it before it reads the process tree or connects to the
    daemon). We hold the FIFO open, so the restore's ``open`` returns and its ``read`` waits;
    :meth:`release` writes the real inventory once the daemon listens (and keeps the FIFO open
    until it was read). :meth:`close` without release hands the restore an empty inventory, on
    which it fails. The restore never waits on a gate that nobody holds: if snapctl dies, the
    FIFO's last writer is gone and the read returns.
    """

    def __init__(self, fifo: Path, inventory: Path) -> None:
        self._content = inventory.read_bytes()
        if len(self._content) > select.PIPE_BUF:
            # Larger than one atomic pipe write: release could block on a restore that died.
            raise ValueError(f"{inventory} is {len(self._content)} bytes, too big for a gate")
        os.mkfifo(fifo, 0o600)
        # O_RDWR: opening never blocks us, and the restore's open finds a writer at once.
        self._fd: int | None = os.open(fifo, os.O_RDWR | os.O_CLOEXEC)

    def release(self, reader_alive: Callable[[], bool], timeout_s: float) -> None:
        """Write the inventory, then close once the restore has read it: a FIFO's unread data
        is discarded when its last descriptor closes, and the restore may not have opened it
        yet (the daemon can be ready first). Gives up when the restore died or after
        ``timeout_s`` (the restore's own deadline ends it then)."""
        assert self._fd is not None
        os.write(self._fd, self._content)
        deadline = time.monotonic() + timeout_s
        unread = array.array("i", [0])
        while reader_alive() and time.monotonic() < deadline:
            fcntl.ioctl(self._fd, termios.FIONREAD, unread)
            if unread[0] == 0:
                break
            time.sleep(tuning.GATE_POLL_S)
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def gated_view(view: Path, target: Path) -> InventoryGate:
    """Create ``target``: every entry of the image ``view`` linked, but ``inventory.img`` a FIFO
    held by the returned gate (see :class:`InventoryGate`)."""
    target.mkdir(mode=0o700)
    relative_dir = relative_dir_of(view, target)
    for entry in view.absolute().iterdir():
        if entry.name != INVENTORY:
            link_relative(entry, target / entry.name, relative_dir)
    return InventoryGate(target / INVENTORY, view / INVENTORY)


def restore_tree_lazily(
    criu: CriuBinary,
    view: Path,
    work_dir: Path,
    logs: Path,
    pidfile: Path,
    *,
    external_dirs: Mapping[str, Path],
    timeout_s: float,
    on_daemon_ready: Callable[[LazyPagesDaemon], None],
    env: Mapping[str, str] | None = None,
    hold_transfer: bool = False,
    restore_criu: CriuBinary | None = None,
    root: Path | None = None,
    netns: str | None = None,
) -> tuple[CriuResult, LazyPagesDaemon]:
    """Start a copy's lazy-pages daemon and its ``criu restore --lazy-pages`` together, the
    restore held at an :class:`InventoryGate` until the daemon listens; return once the restore
    is done.

    With ``hold_transfer`` the daemon serves page faults but starts its background transfer
    only on :meth:`LazyPagesDaemon.release_transfer` (or :data:`TRANSFER_HOLD_MAX_S` after the
    restore finished): the two meet through a :class:`~snapctl.criu.lazy.relay.TransferHold`, the
    daemon in its own directory under ``work_dir``.

    ``view`` is the image as both read it; logs are ``lazy-pages.log`` and ``restore.log`` in
    ``logs``. ``restore_criu`` runs the restore (None: ``criu``, which runs the daemon): one
    that enters a container, say, while the daemon stays here; ``root`` and ``netns`` as
    :func:`~snapctl.criu.ops.restore_tree` takes them. ``on_daemon_ready`` takes the daemon
    over as soon as it listens (to watch it while the restore runs); if it was not called, a
    failure here leaves no daemon behind, and in no case a restore process. A daemon that fails
    to start raises its own :class:`CriuError` (action ``lazy-pages``), not the restore's that
    follows from it.
    """
    gate: InventoryGate | None = None
    hold: TransferHold | None = None
    daemon_dir = work_dir
    try:
        gate = gated_view(view, work_dir / "restore-images")
        if hold_transfer:
            daemon_dir = work_dir / "lazy-pages"
            daemon_dir.mkdir(mode=0o700)
            hold = TransferHold(work_dir, daemon_dir, hold_max_s=tuning.TRANSFER_HOLD_MAX_S)
    except (OSError, ValueError) as error:
        if gate is not None:
            gate.close()
        reason = f"could not be prepared: {error}"
        raise CriuError("restore", None, logs / "restore.log", "", reason=reason) from error
    daemon: LazyPagesDaemon | None = None
    restore: CriuProcess | None = None
    handed_over = False
    try:
        daemon = spawn_lazy_pages_daemon(criu, view, daemon_dir, logs / "lazy-pages.log", hold=hold)
        args = restore_args(work_dir, pidfile, external_dirs, lazy=True, root=root, netns=netns)
        restore = start_criu(
            restore_criu or criu, "restore", work_dir / "restore-images", logs / "restore.log",
            args, env=env, log_level=RESTORE_LOG_LEVEL,
        )  # fmt: skip
        daemon.wait_ready(timeout_s)
        if hold is not None:
            hold.start()
        gate.release(lambda: restore.process.poll() is None, timeout_s)
        on_daemon_ready(daemon)
        handed_over = True
        return restore.finish(timeout_s), daemon
    finally:
        gate.close()
        if restore is not None and restore.process.returncode is None:
            # Failed before the restore finished: with the gate closed it fails on its own.
            with contextlib.suppress(CriuError):
                restore.finish(timeout_s)
        if daemon is not None and not handed_over:
            daemon.kill()
        elif daemon is None and hold is not None:
            hold.close()
