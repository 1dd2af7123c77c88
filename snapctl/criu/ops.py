"""The CRIU dump and restore that snapctl performs, with the options this layout needs."""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from snapctl.criu.locate import CriuBinary
from snapctl.criu.run import CriuError, CriuResult, log_tail, run_criu, spawn_criu

# CRIU writes its dump log while the tree is frozen, and its debug lines cost frozen time: 8% at
# 64 MB and 14% at 512 MB retained, against 4% at info level (python -m bench, donor pause).
# Info level still logs every step, warning and error; rerun the recorded argv with -v4 to debug.
DUMP_LOG_LEVEL = 3

# Options shared by dump and restore: the tree's loopback TCP connection (a TCPStore-like
# peer) and Unix sockets, glibc named semaphores (link remaps), file locks; no iptables
# network lock (not installed, and the tree has its own netns).
TREE_OPTIONS: tuple[str, ...] = (
    "--tcp-established",
    "--ext-unix-sk",
    "--link-remap",
    "--file-locks",
    "--network-lock",
    "skip",
)

ACTION_SCRIPT = """#!/bin/sh
# Written by snapctl. At post-dump the tree is still frozen: copy the activation's /dev/shm,
# hard links kept (cp -a), before CRIU deletes its link_remap files. A failure fails the dump.
set -eu
if [ "$CRTOOLS_SCRIPT_ACTION" = post-dump ]; then
    cp -a "/proc/$CRTOOLS_INIT_PID/root/dev/shm/." {shm_target}
fi
exit 0
"""


def write_action_script(path: Path, shm_target: Path) -> Path:
    """Create the post-dump action script that snapshots /dev/shm into ``shm_target``."""
    path.write_text(ACTION_SCRIPT.format(shm_target=shlex.quote(str(shm_target))))
    path.chmod(0o700)
    return path


def dump_tree(
    criu: CriuBinary,
    root_pid: int,
    images_dir: Path,
    log_path: Path,
    *,
    external_mounts: Mapping[str, str],
    action_script: Path,
    timeout_s: float,
    leave_running: bool = True,
    env: Mapping[str, str] | None = None,
) -> CriuResult:
    """``criu dump`` the tree rooted at ``root_pid`` (PID 1 of its namespaces)."""
    args = ["--tree", str(root_pid), *TREE_OPTIONS, "--action-script", str(action_script)]
    if leave_running:
        args.append("--leave-running")
    for key, target in external_mounts.items():
        args += ["--external", f"mnt[{target}]:{key}"]
    return run_criu(
        criu, "dump", images_dir, log_path, args, timeout_s=timeout_s, env=env,
        log_level=DUMP_LOG_LEVEL,
    )  # fmt: skip


def restore_tree(
    criu: CriuBinary,
    images_dir: Path,
    work_dir: Path,
    log_path: Path,
    pidfile: Path,
    *,
    external_dirs: Mapping[str, Path],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    lazy: bool = False,
) -> CriuResult:
    """``criu restore`` detached into new namespaces; the image directory is only read.

    With ``lazy``, private anonymous memory is left to the lazy-pages daemon already listening
    in ``work_dir`` (see :func:`start_lazy_pages_daemon`): the tree runs as soon as CRIU returns.
    """
    args = ["--work-dir", str(work_dir), "--restore-detached", "--root", "/"]
    args += ["--pidfile", str(pidfile), *TREE_OPTIONS]
    if lazy:
        args.append("--lazy-pages")
    for key, directory in external_dirs.items():
        args += ["--external", f"mnt[{key}]:{directory}"]
    return run_criu(criu, "restore", images_dir, log_path, args, timeout_s=timeout_s, env=env)


class LazyPagesDaemon:
    """A ``criu lazy-pages`` process, our own child, serving one restore's page faults and then
    pushing the remaining pages; it exits 0 once every page was copied into the tree."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        self.pid = process.pid
        # Pinned before anyone can reap it: the watcher thread reaps it in ``wait`` while
        # ``kill`` may run in another, and a signal by PID in between could hit a reused PID.
        self._pidfd: int | None = os.pidfd_open(process.pid)
        self.start_time = psutil.Process(process.pid).create_time()

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
        if self._pidfd is not None:
            # ESRCH: it already exited (reaped or not), which is what killing wants.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self.process.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def describe_exit(self, status: int) -> str:
        if status < 0:
            return f"killed by {signal.Signals(-status).name}"
        return f"exited with status {status}"


def start_lazy_pages_daemon(
    criu: CriuBinary,
    images_dir: Path,
    work_dir: Path,
    log_path: Path,
    *,
    timeout_s: float,
) -> LazyPagesDaemon:
    """Start ``criu lazy-pages`` for one restore and return once it listens.

    The daemon and ``criu restore --lazy-pages`` meet at ``lazy-pages.socket`` in their shared
    work dir (CRIU binds the relative name after ``chdir`` to ``-W``), so every restore needs
    its own work dir: two daemons on one work dir both report success while one of them took
    the other's socket. ``--status-fd`` tells us when the socket is bound; the daemon runs in
    the foreground as our child so that its exit status is ours to read.
    """
    read_fd, write_fd = os.pipe()
    try:
        args = ["--work-dir", str(work_dir), "--status-fd", str(write_fd)]
        process = spawn_criu(criu, "lazy-pages", images_dir, log_path, args, pass_fds=[write_fd])
    finally:
        os.close(write_fd)
    daemon = LazyPagesDaemon(process, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CriuError("lazy-pages", None, log_path, log_tail(log_path))
            if select.select([read_fd], [], [], left)[0]:
                break
        if os.read(read_fd, 1) != b"\0":
            # The pipe closed without the ready byte: the daemon failed to start.
            status = daemon.wait(timeout_s)
            raise CriuError("lazy-pages", status, log_path, log_tail(log_path))
    except BaseException:
        daemon.kill()
        raise
    finally:
        os.close(read_fd)
    return daemon
