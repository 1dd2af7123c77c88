"""A process pinned by pidfd, and the stop sequence (SIGTERM, wait, SIGKILL, verify)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import time
from collections.abc import Iterable, Iterator

import psutil

from snapctl.errors import SnapctlError
from snapctl.supervision import clock

PR_SET_CHILD_SUBREAPER = 36
# The same process reads the same start time (snapctl.supervision.clock), or one a few
# milliseconds off where psutil wrote it; a PID reused by another process differs by far more.
START_TIME_TOLERANCE_S = 0.05


class ProcessGoneError(SnapctlError):
    """The process is gone, or its PID now belongs to another process."""


def become_subreaper() -> None:
    """Adopt orphaned descendants (CRIU-restored trees) so they can be waited for and reaped."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def start_time(pid: int) -> float:
    """When ``pid`` started (seconds since the epoch, fixed against clock steps: see
    :mod:`snapctl.supervision.clock`)."""
    try:
        return clock.start_time(pid)
    except (FileNotFoundError, ProcessLookupError) as error:
        raise ProcessGoneError(f"process {pid} does not exist", pid=pid) from error


# A zombie (killed, not yet reaped: where PID 1 never reaps, never) keeps its PID and start
# time, but runs nothing and cleans up nothing: it is as dead as a process that is gone.
# /proc/PID/stat's state letters for a zombie and a dead process ("x" on kernels before 4.14).
DEAD_STATES = frozenset({"Z", "X", "x"})


def same_start(now: float, recorded: float) -> bool:
    """Whether a start time read now and one recorded earlier are the same process's.

    A record written before snapctl fixed one ``btime`` per boot (:mod:`snapctl.supervision.
    clock`) holds psutil's start time, which adds the ``btime`` its process read: whole
    seconds, which an NTP adjustment of a few milliseconds can move across a second, so such
    a record may be one second off. A process that reuses the PID starts far more than a
    second later (the PID space must wrap first), so both are the same process.
    """
    difference = abs(now - recorded)
    return min(difference, abs(difference - 1.0)) <= START_TIME_TOLERANCE_S


def is_same_process(pid: int, expected_start: float) -> bool:
    """True while ``pid`` is still the process that started at ``expected_start`` and still
    runs (a zombie with that start time does not)."""
    try:
        state, ticks = clock.read_stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return False
    return same_start(clock.since_boot(ticks), expected_start) and state not in DEAD_STATES


class PinnedProcess:
    """A process held by pidfd; ``expected_start`` (when given) must match its start time."""

    def __init__(self, pid: int, expected_start: float | None = None) -> None:
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError as error:
            raise ProcessGoneError(f"process {pid} does not exist", pid=pid) from error
        self.pid = pid
        # Read the start time after the pidfd exists: if it still matches, the pidfd
        # refers to the recorded process and not to a later one with the same PID.
        self.start_time = start_time(pid)
        if expected_start is not None and not same_start(self.start_time, expected_start):
            self.close()
            raise ProcessGoneError(
                f"pid {pid} now belongs to another process (start time differs)", pid=pid
            )

    def alive(self) -> bool:
        if self._pidfd is None:
            return False
        exited = select.select([self._pidfd], [], [], 0)[0]
        return not exited

    def wait(self, timeout_s: float) -> bool:
        """Wait until the process exits; True if it did within ``timeout_s``."""
        if self._pidfd is None:
            return True
        exited = bool(select.select([self._pidfd], [], [], max(timeout_s, 0))[0])
        if exited:
            self._reap()
        return exited

    def _reap(self) -> None:
        # Our child or an adopted orphan must be reaped, or it stays a zombie.
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, os.WNOHANG)

    def signal(self, signum: int) -> None:
        if self._pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, signum)
        except ProcessLookupError:
            pass  # ESRCH: already exited, which is what stopping wants
        except OSError as error:
            if error.errno != errno.ESRCH:
                raise

    def stop(self, stop_timeout_s: float = 10.0, kill_timeout_s: float = 10.0) -> str:
        """SIGTERM, wait, SIGKILL; return how it ended ("exited", "terminated", "killed")."""
        if not self.alive():
            self.wait(0)
            return "exited"
        self.signal(signal.SIGTERM)
        if self.wait(stop_timeout_s):
            return "terminated"
        self.signal(signal.SIGKILL)
        if self.wait(kill_timeout_s):
            return "killed"
        message = f"process {self.pid} survived SIGKILL for {kill_timeout_s} s"
        raise SnapctlError(message, pid=self.pid)

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __enter__(self) -> PinnedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def each_argv() -> Iterator[tuple[int, list[str]]]:
    """Every process's PID and argv (``/proc/PID/cmdline``; a process that exits while we
    look, or a kernel thread, is left out)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                raw = cmdline.read()
        except OSError:
            continue
        if raw:
            yield int(entry.name), [os.fsdecode(arg) for arg in raw.rstrip(b"\0").split(b"\0")]


def status_field(status_text: str, name: str) -> str | None:
    """The value of field ``name`` (``CapEff``, ``Seccomp``, ``NSpid``, ...) in the text of a
    ``/proc/PID/status``; None where it has none."""
    for line in status_text.splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    return None


# Capability bit numbers from linux/capability.h: those snapctl checks it holds.
CAPABILITIES: dict[str, int] = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_NET_ADMIN": 12,
    "CAP_SYS_CHROOT": 18,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_SYS_RESOURCE": 24,
    "CAP_CHECKPOINT_RESTORE": 40,
}


def effective_capabilities(status_text: str) -> int:
    """The ``CapEff`` mask from the text of a ``/proc/PID/status``; ValueError without one."""
    value = status_field(status_text, "CapEff")
    if value is None:
        raise ValueError("no CapEff line in the process's status")
    return int(value, 16)


def missing_capabilities(status_text: str, names: Iterable[str]) -> list[str]:
    """Which of the capabilities ``names`` (keys of :data:`CAPABILITIES`) the process whose
    ``/proc/PID/status`` text this is lacks (all of them where it shows no mask)."""
    try:
        mask = effective_capabilities(status_text)
    except ValueError:
        mask = 0
    return [name for name in names if not mask >> CAPABILITIES[name] & 1]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents before their children, from each task's
    ``/proc/PID/task/TID/children`` (a few reads per process, where psutil scans every
    process of the host). Like any scan of a running tree, a fork during it may be missed;
    a process gone meanwhile is left out. Without that file (a kernel built without
    CONFIG_PROC_CHILDREN), psutil's scan."""
    found = [pid]
    for parent in found:  # grows as children are found: breadth first
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", "rb") as children:
                    found.extend(int(child) for child in children.read().split())
            except FileNotFoundError:
                if not os.path.exists(f"/proc/{parent}/task/{task}"):
                    continue  # the thread ended
                with contextlib.suppress(psutil.NoSuchProcess):
                    return [pid, *(child.pid for child in psutil.Process(pid).children(True))]
            except OSError:
                continue
    return list(dict.fromkeys(found))


def _present(pid: int) -> bool:
    """Whether ``pid`` exists and is not dead: a zombie whose parent never reaps it (a
    container's ``sleep infinity`` as PID 1, which a restored tree's root is reparented to)
    runs nothing and holds nothing but its PID."""
    try:
        state, _ = clock.read_stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return psutil.pid_exists(pid)
    return state not in DEAD_STATES


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` exists (or each is a zombie); return those still present
    at the deadline."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if _present(pid)]
        if left:
            time.sleep(0.02)
    return left
