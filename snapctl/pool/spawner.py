"""The spawner: a single-threaded child of the agent that forks every supervisor.

Forking from a threaded process copies locks other threads held, so the agent forks this
child once, before it starts any thread (with snapctl's activation code already imported, so
each supervisor starts without importing anything), and asks it for supervisors over a
socket pair. Each job comes with the write end of a pipe, passed as a file descriptor: the
supervisor writes its progress and its outcome there, one JSON object a line, and the
agent's thread that asked reads them. The acknowledgement carries a pidfd of the supervisor
(opened while it was certainly this spawner's child), so that the agent can signal that very
process later (cancel a request whose client left) and never a pid reused since. Supervisors
are reaped by the kernel (SIGCHLD ignored here) and outlive the spawner; the spawner exits
when the agent closes its end or dies.

The :class:`Spawner` handle runs in the agent, :func:`_serve` in the spawner child; what a
supervisor runs is injected (:data:`JobRunner`): this module imports no other pool module.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

Job = dict[str, Any]
# Runs in the forked supervisor: the job, and the pipe it reports on. Never returns.
JobRunner = Callable[[Job, int], None]

# Above the agent's request body limit (snapctl.agent.server.MAX_BODY_BYTES) and the wrapper
# around it, so that no request the agent accepted is cut short here.
_MAX_JOB_BYTES = 4 << 20


class SpawnerGoneError(RuntimeError):
    """The spawner exited (or was killed): no supervisor can be started any more."""


@dataclass(frozen=True)
class SpawnedJob:
    """A supervisor just forked: the read end of its report pipe, and a pidfd that pins it
    (None if it was gone before it could be pinned). The caller closes both."""

    read_fd: int
    pidfd: int | None


class Spawner:
    """The agent's handle on its spawner child; :meth:`spawn` is safe from any thread."""

    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid = pid
        self._channel = channel
        self._lock = threading.Lock()

    @classmethod
    def start(cls, runner: JobRunner) -> Self:
        """Fork the spawner now: call before this process starts any thread. ``runner``
        runs each job in its supervisor (the agent's: :func:`snapctl.pool.supervisor.run_job`,
        imported before the fork, with everything a supervisor needs)."""
        if threading.active_count() > 1:
            raise RuntimeError("the spawner must be started before any thread")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns to the caller
            ours.close()
            code = 0
            try:
                _serve(theirs, runner)
            except BaseException:
                code = 1
            os._exit(code)
        theirs.close()
        return cls(pid, ours)

    def spawn(self, job: Job) -> int:
        """Fork a supervisor for ``job``; return the read end of its report pipe (the caller
        closes it). Raises :class:`SpawnerGoneError` if the spawner is gone."""
        spawned = self.launch(job)
        if spawned.pidfd is not None:
            os.close(spawned.pidfd)
        return spawned.read_fd

    def launch(self, job: Job) -> SpawnedJob:
        """Fork a supervisor for ``job``: its report pipe and its pidfd (see
        :class:`SpawnedJob`). Raises :class:`SpawnerGoneError` if the spawner is gone."""
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        fd_size = array.array("i").itemsize
        pidfds = array.array("i")
        try:
            payload = json.dumps(job).encode()
            with self._lock:
                try:
                    fds = array.array("i", [write_fd])
                    self._channel.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                    ack, ancillary, _flags, _address = self._channel.recvmsg(
                        64, socket.CMSG_SPACE(fd_size)
                    )
                except OSError as error:
                    raise SpawnerGoneError(f"the spawner is gone: {error}") from error
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    pidfds.frombytes(data[: len(data) - len(data) % fd_size])
            if not ack:
                raise SpawnerGoneError("the spawner is gone (it closed its end)")
        except BaseException:
            os.close(read_fd)
            for fd in pidfds:
                os.close(fd)
            raise
        finally:
            os.close(write_fd)
        for extra in pidfds[1:]:
            os.close(extra)
        return SpawnedJob(read_fd, pidfds[0] if pidfds else None)

    def close(self) -> None:
        """End the spawner (supervisors it forked keep running) and reap it."""
        with contextlib.suppress(OSError):
            self._channel.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _serve(channel: socket.socket, runner: JobRunner) -> None:
    """The spawner's loop: one job a message; fork its supervisor; acknowledge."""
    # The kernel reaps the supervisors: nothing here waits on them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # The agent's Ctrl-C or SIGTERM is for the agent: it closes this end when it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd_size = array.array("i").itemsize
    while True:
        payload, ancillary, _flags, _address = channel.recvmsg(
            _MAX_JOB_BYTES, socket.CMSG_SPACE(fd_size)
        )
        if not payload:
            return  # the agent closed its end, or died
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fd_size])
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            channel.send(b"refused")
            continue
        pipe_fd = fds[0]
        try:
            job = json.loads(payload)
            pid = os.fork()
        except (ValueError, OSError):
            # A job that cannot be read (truncated: bigger than a message) or forked (EAGAIN)
            # is refused; the spawner itself goes on serving the next.
            os.close(pipe_fd)
            channel.send(b"refused")
            continue
        if pid == 0:  # pragma: no cover - the supervisor
            channel.close()
            for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_DFL)
            os.setsid()
            # Not the agent's stdin: a supervisor reads nothing, and outlives whatever that is.
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            code = 1
            try:
                runner(job, pipe_fd)
                code = 0
            finally:
                os._exit(code)
        os.close(pipe_fd)
        pidfd = _pin_child(pid)
        if pidfd is None:
            channel.send(b"ok")
            continue
        try:
            channel.sendmsg(
                [b"ok"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))]
            )
        finally:
            os.close(pidfd)


def _pin_child(pid: int) -> int | None:
    """A pidfd of the child ``pid`` just forked, or None if it is gone already. SIGCHLD is
    ignored here, so a child that exited is reaped at once and its pid free for reuse: the
    pidfd counts only if ``waitid`` on it still finds a child of this process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # ECHILD: the pid is someone else's now
        os.close(pidfd)
        return None
    return pidfd
