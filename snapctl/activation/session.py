"""A running activation: its processes, directories, namespace connector and publisher, and
how it is stopped and audited so that nothing is left behind."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.activation.container import Container, ContainerHold
from snapctl.activation.memory import InPlace, Memory
from snapctl.activation.states import SessionState, TransitionError, check_transition
from snapctl.cgroups import ActivationCgroup
from snapctl.criu.lazy.transfer import LazyTransfer, PagesStatus
from snapctl.errors import SnapctlError
from snapctl.images import load_manifest
from snapctl.images.lock import ImageHold
from snapctl.namespaces import mounts
from snapctl.namespaces.layout import ActivationDirs
from snapctl.namespaces.netns import NetnsConnector, Publisher
from snapctl.protocol.atomic import write_json_atomic
from snapctl.protocol.controldir import ControlDir
from snapctl.statedir import STOPPED_FILE, ActivationRecord, StateDir, StopOutcome
from snapctl.statedir.names import NameReservation
from snapctl.supervision.process import (
    PinnedProcess,
    ProcessGoneError,
    descendants,
    each_argv,
    start_time,
    wait_gone,
)
from snapctl.supervision.signals import cleaning, track, untrack


class CleanupAudit(BaseModel):
    """What an activation left behind after it stopped (all empty means clean)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    processes: list[int]
    mounts: list[str]
    directories: list[str]
    listeners: list[str]
    # Names the activation used in its private /dev/shm (link remaps included) that exist in
    # the host's /dev/shm: a leak through the sandbox, or a leftover of a failed cleanup.
    shm_files: list[str] = []

    @property
    def clean(self) -> bool:
        return not (
            self.processes or self.mounts or self.directories or self.listeners or self.shm_files
        )

    def describe(self) -> str:
        parts = [f"{k}: {v}" for k, v in self.model_dump().items() if v]
        return "; ".join(parts) or "clean"


HOST_SHM = Path("/dev/shm")


def criu_processes(work_dir: Path) -> list[int]:
    """PIDs of CRIU processes working for the activation whose work dir is ``work_dir``: its
    restore and its ``lazy-pages`` daemon (whose own work dir, while its transfer is held, is
    below it; see ``snapctl.criu.lazy.relay``), and a donor's dump, which has no work dir there
    (its images go to the staging directory beside the image) but runs the activation's action
    script.

    They run in the host's namespaces, so they do not see the activation's tmpfs; their
    ``--work-dir`` or ``--action-script`` (one per activation) names them instead. A dump runs
    in a session of its own, so it outlives a SIGKILL of snapctl's process group.
    """
    found = []
    for pid, argv in each_argv():
        # Only CRIU: another program with such an argument there is none of ours. CRIU runs
        # as itself, through its loader, or under kdat's unshare + sh wrapper.
        if not any("criu" in os.path.basename(arg) for arg in argv):
            continue
        for flag in ("--work-dir", "--action-script"):
            index = argv.index(flag) + 1 if flag in argv else len(argv)
            if index < len(argv) and Path(argv[index]).is_relative_to(work_dir):
                found.append(pid)
                break
    return sorted(found)


def end_stragglers(dirs: ActivationDirs, timeout_s: float) -> list[int]:
    """SIGKILL every process that still sees this activation's tmpfs, and its CRIU processes
    (a restore, a lazy-pages daemon) if any is left; return the survivors.

    After a normal stop there are none (PID 1 of the namespace took them along, and the
    session stopped its daemon); they appear when a start was interrupted before the tree's root
    was pinned, e.g. while CRIU restored, or when snapctl itself was killed. Membership is
    re-checked after pinning, so a reused PID is never signalled. The search runs again until
    it finds nothing (a sandbox's init may move from its argv to its mounts while gc looks, a
    process may appear meanwhile), and a process signalled that has not exited by the deadline
    is a survivor even where the search no longer sees it (an exiting namespace init has left
    its namespaces already, but not yet exited).
    """

    def members() -> list[int]:
        return sorted({*dirs.processes(), *criu_processes(dirs.work)})

    deadline = time.monotonic() + timeout_s
    while True:
        pinned: list[PinnedProcess] = []
        for pid in members():
            with contextlib.suppress(ProcessGoneError):
                process = PinnedProcess(pid)
                if pid in members():
                    process.signal(signal.SIGKILL)
                    pinned.append(process)
                else:
                    process.close()
        stuck = []
        for process in pinned:
            if not process.wait(max(deadline - time.monotonic(), 0.0)):
                stuck.append(process.pid)
            process.close()
        left = sorted({*stuck, *members()})
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def remove_activation(
    dirs: ActivationDirs, left: list[int], timeout_s: float, cgroup: ActivationCgroup | None = None
) -> CleanupAudit:
    """The end of every stop: end stragglers, then unmount and delete the activation's
    directories and its cgroup unless a process (``left``, a straggler, one still in the cgroup)
    survived; audit what remains. Listeners and /dev/shm files are for the caller to add: only
    a session knows them."""
    left = sorted({*left, *end_stragglers(dirs, timeout_s)})
    if cgroup is not None:
        left = sorted({*left, *end_cgroup(cgroup, timeout_s)})
    if not left and dirs.root.exists():
        dirs.remove()
    remains = dirs.root.exists()
    cgroup_left = cgroup is not None and not cgroup.remove()
    return CleanupAudit(
        processes=left,
        mounts=mounts.mounts_under(dirs.root) if remains else [],
        directories=([str(dirs.root)] if remains else [])
        + ([f"cgroup {cgroup.path}"] if cgroup is not None and cgroup_left else []),
        listeners=[],
    )


def end_cgroup(cgroup: ActivationCgroup, timeout_s: float) -> list[int]:
    """SIGKILL whatever is still in the activation's cgroup (only its own processes are ever
    there); return the survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        pinned = []
        for pid in cgroup.pids():
            with contextlib.suppress(ProcessGoneError):
                process = PinnedProcess(pid)
                if pid in cgroup.pids():
                    process.signal(signal.SIGKILL)
                    pinned.append(process)
                else:
                    process.close()
        for process in pinned:
            process.wait(max(deadline - time.monotonic(), 0.0))
            process.close()
        left = cgroup.pids()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def cgroup_fields(cgroup: ActivationCgroup | None) -> dict[str, object]:
    """An activation record's cgroup fields."""
    if cgroup is None:
        return {}
    return {
        "cgroup": cgroup.path, "cgroup_dirs": cgroup.record(),
        "memory_limit_bytes": cgroup.limits.memory_bytes, "cpus": cgroup.limits.cpus,
    }  # fmt: skip


def _port_open(address: tuple[str, int]) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(address) == 0


@dataclass
class Session:
    """One activation from launch or restore until it is stopped."""

    name: str
    activation_id: str
    kind: str
    dirs: ActivationDirs
    state_dir: StateDir
    # Changed only through advance(); see snapctl.activation.states.
    state: SessionState = SessionState.CREATED
    image: Path | None = None
    root: PinnedProcess | None = None
    launcher: subprocess.Popen[bytes] | None = None
    # Every PID the tree ever had (audited after the stop), and the tree as last seen.
    tree_pids: list[int] = field(default_factory=list)
    current_pids: list[int] = field(default_factory=list)
    connector: NetnsConnector | None = None
    publisher: Publisher | None = None
    # Where the server itself listens on a network others reach (a copy in a container, on
    # the container's), with nothing relaying; None: ``publisher`` relays, if anything does.
    published_directly: tuple[str, int] | None = None
    host: str | None = None
    port: int = 8000
    # A shared hold on the image while the copy still reads it: through the restore, and for a
    # lazy copy until its pages are complete.
    image_hold: ImageHold | None = None
    memory: Memory = field(default_factory=InPlace)
    # Why the activation was stopped behind the user's back (a lazy-pages daemon that died).
    failure: str | None = None
    # The name, held until the record is dropped (see snapctl.statedir.names).
    reservation: NameReservation | None = None
    # Its own cgroup (None where this host gives none and no limit was asked for).
    cgroup: ActivationCgroup | None = None
    # The running container it is restored into (``copy --into-container``), or None.
    container: Container | None = None
    # Its hold on that container (one copy per container), released when it stops.
    container_hold: ContainerHold | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _record_saved: bool = field(default=False, repr=False)
    _stop_result: tuple[str, CleanupAudit] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # From here until stop() ends, an interrupted command still stops it (see signals).
        track(self)

    def advance(self, target: SessionState) -> None:
        """Change state, as the lifecycle allows (a bug otherwise: TransitionError)."""
        with self._lock:
            check_transition(self.state, target)
            self.state = target

    @property
    def stopped(self) -> bool:
        return self.state in (SessionState.STOPPED, SessionState.FAILED)

    @property
    def tree(self) -> PinnedProcess:
        """The tree's root, pinned; only once it was launched or restored."""
        if self.root is None:
            raise TransitionError(f"activation {self.name} has no tree yet ({self.state})")
        return self.root

    def launched(self, launcher: subprocess.Popen[bytes], root: PinnedProcess) -> None:
        self.launcher, self.root = launcher, root

    def rename(self, reservation: NameReservation) -> None:
        """Go by ``reservation``'s name from now on (a parked copy taken under the name its
        user asked for), releasing the name it had; only before it serves."""
        with self._lock:
            if self._record_saved:
                raise TransitionError(f"activation {self.name} is recorded already")
            previous, self.reservation, self.name = self.reservation, reservation, reservation.name
        if previous is not None:
            previous.release()

    @property
    def lazy(self) -> LazyTransfer | None:
        """A lazy copy's page transfer, watched; None for a donor or a plain copy."""
        return self.memory.transfer

    @property
    def control(self) -> ControlDir:
        return ControlDir(self.dirs.control)

    def alive(self) -> bool:
        return self.root is not None and self.root.alive()

    @property
    def published(self) -> str | None:
        """``HOST:PORT`` where the server is published (by the host side's relay, or where it
        listens itself), or None."""
        if self.publisher is not None:
            return "{}:{}".format(*self.publisher.address)
        if self.published_directly is not None:
            return "{}:{}".format(*self.published_directly)
        return None

    def remember_tree(self) -> None:
        """Record every PID of the tree now (root and parents first, as ``current_pids``), to
        audit them after the stop; reports reuse it rather than look again."""
        if self.root is None:
            return
        if not self.root.alive():
            return
        self.current_pids = descendants(self.root.pid)
        self.tree_pids = sorted(set(self.tree_pids) | set(self.current_pids))

    @property
    def pages(self) -> PagesStatus | None:
        """The lazy page transfer's status; None for a donor or a plain copy."""
        return self.memory.status()

    def release_image(self) -> None:
        with self._lock:
            if self.image_hold is not None:
                self.image_hold.release()
                self.image_hold = None

    def kill_unsafe(self, reason: str) -> None:
        """SIGKILL the tree now: it can no longer be trusted to run (see ``criu.lazy.transfer``)."""
        with self._lock:
            self.failure = self.failure or reason
            if self.root is not None:
                self.root.signal(signal.SIGKILL)

    def pages_done(self, status: PagesStatus) -> None:
        """The lazy transfer ended: let go of the image and record the outcome."""
        self.release_image()
        if status.state == "complete":
            self._save_record_if_kept()

    def save_record(self) -> None:
        with self._lock:
            self._record_saved = True
            self._write_record()

    def _save_record_if_kept(self) -> None:
        with self._lock:
            if self._record_saved and not self.stopped:
                self._write_record()

    def _write_record(self) -> None:
        root = self.tree
        me = os.getpid()
        transfer = self.memory.transfer
        self.state_dir.save_record(
            ActivationRecord(
                name=self.name,
                activation_id=self.activation_id,
                kind=self.kind,
                image=str(self.image) if self.image else None,
                root_pid=root.pid,
                root_start_time=root.start_time,
                supervisor_pid=me,
                supervisor_start_time=start_time(me),
                activation_dir=str(self.dirs.root),
                logs_dir=str(self.dirs.logs),
                host=self.host,
                port=self.port,
                published=self.published,
                created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                lazy_pages_start_time=None if transfer is None else transfer.daemon.start_time,
                **self.memory.report_fields(),
                **cgroup_fields(self.cgroup),
            )
        )

    def stop(
        self, stop_timeout_s: float = 10.0, *, failed: bool = False
    ) -> tuple[str, CleanupAudit]:
        """Stop the tree (TERM, wait, KILL), tear down, and audit. Safe to call twice.
        ``failed``: the stop ends a start that failed (the session ends ``failed``)."""
        with self._lock:
            if self._stop_result is not None:
                # Once stopped, its name may be someone else's: nothing is torn down again.
                return self._stop_result
            if self.state is not SessionState.STOPPING:
                check_transition(self.state, SessionState.STOPPING)
                self.state = SessionState.STOPPING
        how = "not started"
        listening = self.publisher.address if self.publisher else None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        if self.root is not None:
            self.remember_tree()
            try:
                how = self.root.stop(stop_timeout_s)
            except SnapctlError as error:
                # Unkillable (stuck in the kernel): the rest must still be torn down, and the
                # audit below lists the survivor.
                how = error.message
            with self._lock:
                self.root.close()
        leftover_daemon = self.memory.stop()
        self.release_image()
        if self.launcher is not None:
            try:
                self.launcher.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
        shm_names = self._shm_names()
        # Killing PID 1 ends its namespace, but the kernel reaps the rest asynchronously.
        left = wait_gone(self.tree_pids, stop_timeout_s) + leftover_daemon
        if self.cgroup is not None:
            # The kernel killed part of the tree for its memory limit: that is why it ended.
            self.failure = self.failure or self.cgroup.killed_by_memory_limit()
        audit = remove_activation(self.dirs, left, stop_timeout_s, self.cgroup)
        if self.failure is not None:
            # The logs outlive the activation: say there why it was stopped.
            with contextlib.suppress(OSError):
                (self.dirs.logs / "failure.txt").write_text(self.failure + "\n")
        listeners = (
            [f"{listening[0]}:{listening[1]}"] if listening and _port_open(listening) else []
        )
        shm_files = sorted(name for name in shm_names if os.path.lexists(HOST_SHM / name))
        result = how, audit.model_copy(update={"listeners": listeners, "shm_files": shm_files})
        # Before the record goes: whoever sees it gone (a foreground copy through the agent)
        # finds how it ended.
        self._keep_outcome(*result)
        with self._lock:
            if not self.stopped:
                self.state = SessionState.FAILED if failed else SessionState.STOPPED
            self.state_dir.drop_record(self.name)
            if self.reservation is not None:
                self.reservation.release()
            if self.container_hold is not None:
                self.container_hold.release()
        untrack(self)
        self._stop_result = result
        return result

    def _keep_outcome(self, how: str, audit: CleanupAudit) -> None:
        outcome = StopOutcome(
            name=self.name, stopped=how, audit=audit.model_dump(), failure=self.failure
        )
        with contextlib.suppress(OSError, SnapctlError):  # the stop itself went on regardless
            write_json_atomic(self.dirs.logs / STOPPED_FILE, outcome)

    def stop_failed_start(self, error: BaseException) -> None:
        """Stop after a start failed with ``error`` and, for a :class:`SnapctlError`, add what
        the cleanup found and where the logs are; a lazy transfer's failure, the cause of what
        the start then saw, leads the message."""
        cleaning()  # a signal from here on must not cut this cleanup short
        _, audit = self.stop(failed=True)
        if isinstance(error, SnapctlError):
            if self.failure is not None and self.failure not in error.message:
                error.message = f"{self.failure}: {error.message}"
            error.message += f" (cleanup: {audit.describe()}; logs: {self.dirs.logs})"
            error.args = (error.message,)

    def _shm_names(self) -> set[str]:
        """What this activation had in its /dev/shm, and what its image saved from there."""
        names: set[str] = set()
        with contextlib.suppress(OSError):
            names.update(os.listdir(self.dirs.shm))
        if self.image is not None:
            with contextlib.suppress(SnapctlError):
                names.update(load_manifest(self.image).shm_files)
        return names
