"""Observing the host around a qualification run: listeners in an activation's network
namespace, and what a run may have left behind (processes, directories, mounts, /dev/shm).

The session's own stop audit (:class:`~snapctl.activation.session.CleanupAudit`) knows the PIDs
and directories it created; a run that failed inside ``start_donor`` or ``start_copy`` leaves
the caller no session, so :func:`residue` also scans the host against a baseline taken before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from snapctl.models import StrictModel
from snapctl.namespaces import mounts
from snapctl.statedir import StateDir

HOST_SHM = Path("/dev/shm")
TCP_LISTEN = "0A"
LINK_REMAP_PREFIX = "link_remap."


class Residue(StrictModel):
    """What a host scan found of a run after it ended (all empty means nothing)."""

    processes: list[str] = []
    activation_dirs: list[str] = []
    mounts: list[str] = []
    shm_files: list[str] = []

    @property
    def clean(self) -> bool:
        return not (self.processes or self.activation_dirs or self.mounts or self.shm_files)

    def describe(self) -> str:
        parts = [f"{k}: {v}" for k, v in self.model_dump().items() if v]
        return "; ".join(parts) or "clean"


@dataclass(frozen=True)
class Baseline:
    """The host before a run: what existed then is not the run's."""

    activations: frozenset[str]
    logs: frozenset[str]
    shm: frozenset[str]
    # (PID, start time): a PID reused by one of the run's processes is still the run's.
    descendants: frozenset[tuple[int, float]]

    def new_logs(self, state: StateDir) -> list[str]:
        """Activation ids whose log directories appeared since (the run's activations)."""
        return sorted(_listdir(state.logs) - self.logs)


def _descendants() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
    return alive


def _listdir(path: Path) -> set[str]:
    try:
        return set(os.listdir(path))
    except FileNotFoundError:
        return set()


def take_baseline(state: StateDir) -> Baseline:
    return Baseline(
        activations=frozenset(_listdir(state.activations)),
        logs=frozenset(_listdir(state.logs)),
        shm=frozenset(_listdir(HOST_SHM)),
        descendants=frozenset(_identities(_descendants())),
    )


def _identities(processes: list[psutil.Process]) -> list[tuple[int, float]]:
    found = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(_identity(proc))
    return found


def _identity(process: psutil.Process) -> tuple[int, float]:
    return process.pid, process.create_time()


def _still_running(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until none of ``processes`` runs; those still running at the deadline.
    ``is_running`` compares start times, so a PID reused meanwhile is not mistaken for one."""
    deadline = time.monotonic() + timeout_s
    left = processes
    while True:
        left = [proc for proc in left if proc.is_running()]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def residue(
    state: StateDir, baseline: Baseline, shm_names: Iterable[str] = (), grace_s: float = 5.0
) -> Residue:
    """Processes of ours still running, new activation directories, mounts under them, and
    host /dev/shm files that are ours (named like the activation's) or new link remaps."""
    new = []
    for proc in _descendants():
        with contextlib.suppress(psutil.NoSuchProcess):
            if _identity(proc) not in baseline.descendants:
                new.append(proc)
    # A namespace's other processes are reaped asynchronously after its PID 1 died.
    processes = []
    for proc in _still_running(new, grace_s):
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(f"{proc.pid} {proc.name()}")
    ours = set(shm_names)
    shm = sorted(
        name
        for name in _listdir(HOST_SHM)
        if name in ours or (name.startswith(LINK_REMAP_PREFIX) and name not in baseline.shm)
    )
    activations = state.activations
    return Residue(
        processes=processes,
        activation_dirs=sorted(
            str(activations / name) for name in _listdir(activations) - baseline.activations
        ),
        mounts=mounts.mounts_under(activations) if activations.exists() else [],
        shm_files=shm,
    )


def link_remaps(shm_dir: Path) -> list[str]:
    """``link_remap.*`` files in an activation's /dev/shm (CRIU should have removed them)."""
    return sorted(name for name in _listdir(shm_dir) if name.startswith(LINK_REMAP_PREFIX))


def _listening_ports(table: str, port: int) -> list[str]:
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != TCP_LISTEN:
            continue
        address, _, hex_port = fields[1].rpartition(":")
        if int(hex_port, 16) == port:
            found.append(f"{address}:{port}")
    return found


class ListenerWatch:
    """Polls the TCP tables of ``pid``'s network namespace for a listener on ``port``.

    The tables are read through a descriptor of ``/proc/PID/net`` opened at start, so a later
    process reusing the PID is never looked at; polling ends when the process is gone. With
    ``alive`` (a pinned process's), the descriptor is only kept if the process still ran once
    it was opened: otherwise the PID may already name another process.
    """

    def __init__(
        self,
        pid: int,
        port: int,
        interval_s: float = 0.002,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.port = port
        self.interval_s = interval_s
        self.polls = 0
        self.seen: list[str] = []
        self._stop = threading.Event()
        try:
            self._dir = os.open(f"/proc/{pid}/net", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self._stop.set()  # already gone: zero polls, which the check reports
            return
        if alive is not None and not alive():
            os.close(self._dir)
            self._stop.set()
            return
        self._thread = threading.Thread(target=self._run, name=f"listeners-{pid}", daemon=True)
        self._thread.start()

    def _read(self, name: str) -> str:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks).decode()
        finally:
            os.close(fd)

    def poll_once(self) -> bool:
        """One look at both tables; False once the process (and so its tables) is gone."""
        if self._stop.is_set():
            return False
        try:
            tables = [self._read("tcp"), self._read("tcp6")]
        except OSError:
            return False
        self.polls += 1
        for table in tables:
            for listener in _listening_ports(table, self.port):
                if listener not in self.seen:
                    self.seen.append(listener)
        return True

    def _run(self) -> None:
        while not self._stop.is_set() and self.poll_once():
            self._stop.wait(self.interval_s)

    def stop(self) -> tuple[list[str], int]:
        """Stop polling; return the listeners seen and the number of polls."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=5)
            os.close(self._dir)
        return list(self.seen), self.polls
