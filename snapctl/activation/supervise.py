"""Keeping an activation running: in the foreground until Ctrl-C or the server exits, or in
a detached supervisor process that outlives the command; and stopping one from its record."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from snapctl.activation.session import CleanupAudit, Session, remove_activation
from snapctl.cgroups import ActivationCgroup
from snapctl.errors import ExitStatus, RelayedError, SnapctlError, wire_outcome
from snapctl.namespaces.layout import CREATING_SUFFIX, ActivationDirs, ActivationOwner
from snapctl.progress import Progress
from snapctl.statedir import ActivationRecord, StateDir
from snapctl.supervision.leftovers import TMP_GRACE_S
from snapctl.supervision.logs import bound_log
from snapctl.supervision.process import PinnedProcess, ProcessGoneError, is_same_process
from snapctl.supervision.signals import STOP_SIGNALS, StopSignals, forward_to, stop_all_tracked


def run_until_stopped(session: Session, stop_timeout_s: float = 10.0) -> tuple[str, CleanupAudit]:
    """Serve until the tree exits, or SIGINT/SIGTERM arrives; then stop and audit."""
    return run_all_until_stopped([session], stop_timeout_s)[0]


# The supervising loop looks at each server's log size every this many rounds.
LOG_CHECK_ROUNDS = 5


def run_all_until_stopped(
    sessions: list[Session], stop_timeout_s: float = 10.0, stop: threading.Event | None = None
) -> list[tuple[str, CleanupAudit]]:
    """Serve until every tree exited, or a stop is requested; then stop and audit each.

    ``stop`` is the request of the caller's :class:`StopSignals` (which must be in place from
    before the sessions started); without one, SIGINT/SIGTERM request it from here on.
    A tree that exits (or is stopped with ``snapctl stop``, or was killed as unsafe, see
    ``Session.failure``) is cleaned up at once, while the others keep serving.
    """
    if stop is None:
        with StopSignals() as signals:
            signals.started()
            return run_all_until_stopped(sessions, stop_timeout_s, signals.requested)
    results: dict[int, tuple[str, CleanupAudit]] = {}
    rounds = 0
    while not stop.is_set() and len(results) < len(sessions):
        for index, session in enumerate(sessions):
            if index not in results and not session.alive():
                results[index] = session.stop(stop_timeout_s)
            elif index not in results and rounds % LOG_CHECK_ROUNDS == 0:
                bound_log(session.dirs.server_log)
        rounds += 1
        stop.wait(0.2)
    for index, session in enumerate(sessions):
        if index not in results:
            results[index] = session.stop(stop_timeout_s)
    return [results[index] for index in range(len(sessions))]


class DetachedStartError(RelayedError):
    """The detached supervisor could not start what it was asked to (its error, relayed)."""


@dataclass(frozen=True)
class InSupervisor:
    """What :func:`detach` returns in the forked supervisor: what it must now supervise, and
    the stop request its signals set (they are its own from the fork on)."""

    supervised: Any
    report: Any
    stop: threading.Event


def detach(
    start: Callable[[Callable[[str], Progress]], tuple[Any, Any]],
    on_progress: Callable[[str, str], None] = lambda lane, step: None,
) -> InSupervisor | dict[str, Any]:
    """Fork a supervisor that runs ``start(progress_for)`` and then outlives this command.

    In the supervisor this returns :class:`InSupervisor`. In the parent it relays the
    supervisor's progress to ``on_progress(lane, step)`` and returns its report (a JSON-ready
    dict) once the activation is ready, or raises its error as :class:`DetachedStartError`.

    SIGINT/SIGTERM never leave an activation without its supervisor: in the parent, until the
    report, they are passed on to the supervisor, whose start then stops what it started and
    reports that; in the supervisor, :class:`StopSignals` holds them from the fork on.
    """
    read_fd, write_fd = os.pipe()
    # Installed before the fork, so the supervisor has them from its first instruction.
    signals = StopSignals().install()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        signals.restore()
        previous = {signum: signal.signal(signum, forward_to(pid)) for signum in STOP_SIGNALS}
        try:
            return _relay(read_fd, on_progress)
        except DetachedStartError:
            os.waitpid(pid, 0)  # it exits right after reporting its error: reap it
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    os.close(read_fd)
    os.setsid()
    writer = os.fdopen(write_fd, "w")
    lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with lock, contextlib.suppress(OSError):  # a parent gone early changes nothing here
            writer.write(json.dumps(message) + "\n")
            writer.flush()

    def progress_for(lane: str) -> Progress:
        return lambda step: send({"lane": lane, "progress": step})

    try:
        try:
            supervised, report = start(progress_for)
        except BaseException:
            signals.cleaning()
            stop_all_tracked()  # what a start interrupted at any point had started
            raise
    except (KeyboardInterrupt, Exception) as error:
        send(wire_outcome(error))
        if isinstance(error, KeyboardInterrupt):
            os._exit(ExitStatus.INTERRUPTED)
        if not isinstance(error, SnapctlError):
            traceback.print_exc()  # a bug: the parent says so instead of "exited early"
        os._exit(error.exit_status if isinstance(error, SnapctlError) else ExitStatus.ERROR)
    signals.started()  # from here a signal asks the supervising loop to stop
    send({"report": report.model_dump(mode="json") if hasattr(report, "model_dump") else report})
    with contextlib.suppress(OSError):
        writer.close()
    # Detach stdio from the terminal: the supervisor lives on alone.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return InSupervisor(supervised, report, signals.requested)


def _relay(read_fd: int, on_progress: Callable[[str, str], None]) -> dict[str, Any]:
    with os.fdopen(read_fd, "rb") as reader:
        for line in reader:
            message = json.loads(line)
            if "progress" in message:
                on_progress(message["lane"], message["progress"])
                continue
            if "error" in message:
                raise DetachedStartError.from_wire(message)
            report: dict[str, Any] = message["report"]
            return report
    raise DetachedStartError("the detached supervisor exited before reporting")


def end_lazy_pages_daemon(record: ActivationRecord, timeout_s: float) -> list[int]:
    """SIGKILL a lazy copy's daemon from its record (pinned by start time, after its tree);
    return its PID if it survived."""
    if record.lazy_pages_pid is None:
        return []
    with (
        contextlib.suppress(ProcessGoneError),
        PinnedProcess(record.lazy_pages_pid, record.lazy_pages_start_time) as daemon,
    ):
        daemon.signal(signal.SIGKILL)
        if not daemon.wait(timeout_s):
            return [daemon.pid]
    return []


def stop_recorded(
    record: ActivationRecord, state: StateDir, stop_timeout_s: float = 10.0
) -> tuple[str, CleanupAudit]:
    """Stop an activation from its record (pinning PIDs by start time), then audit."""
    how = "exited"
    supervisor: PinnedProcess | None = None
    with contextlib.suppress(ProcessGoneError):
        supervisor = PinnedProcess(record.supervisor_pid, record.supervisor_start_time)
    try:
        root = PinnedProcess(record.root_pid, record.root_start_time)
    except ProcessGoneError:
        root = None
    if root is not None:
        try:
            how = root.stop(stop_timeout_s)
        except SnapctlError as error:
            # Stuck in the kernel: still clean up the rest; the audit lists what is left.
            how = error.message
        finally:
            root.close()
    if supervisor is not None and not supervisor.alive():
        supervisor.close()  # a zombie (killed, never reaped) cleans up nothing: we do it
        supervisor = None
    if supervisor is not None:
        # The supervisor sees the tree gone, cleans up and drops the record; give it the time.
        deadline = time.monotonic() + stop_timeout_s
        while state.record_path(record.name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        others = [
            r
            for r in state.load_records()
            if r.supervisor_pid == record.supervisor_pid and r.name != record.name
        ]
        if not others and not supervisor.wait(stop_timeout_s):
            supervisor.stop(stop_timeout_s)  # it supervised only this one and is stuck
        supervisor.close()
    # Normally the supervisor stopped it; not if the supervisor itself was gone.
    left = end_lazy_pages_daemon(record, stop_timeout_s)
    dirs = ActivationDirs(
        root=state.activations / record.activation_id, logs=state.logs / record.activation_id
    )
    audit = remove_activation(dirs, left, stop_timeout_s, recorded_cgroup(record))
    state.drop_record(record.name)
    return how, audit


def recorded_cgroup(record: ActivationRecord) -> ActivationCgroup | None:
    """The cgroup an activation record names, or None."""
    if record.cgroup is None or not record.cgroup_dirs:
        return None
    return ActivationCgroup.from_record(record.cgroup, record.cgroup_dirs)


class CollectedActivation(BaseModel):
    """One activation ``snapctl gc`` cleaned up after its snapctl process died."""

    model_config = ConfigDict(extra="forbid")

    activation_id: str
    names: list[str]
    processes_ended: list[int]
    audit: CleanupAudit


def collect_orphans(state: StateDir, stop_timeout_s: float = 10.0) -> list[CollectedActivation]:
    """Stop and remove every activation whose owning snapctl process is gone (killed with
    SIGKILL, or the machine's snapctl crashed); activations still owned are left alone."""
    collected = []
    records = state.load_records()
    for root in sorted(state.activations.iterdir()) if state.activations.is_dir() else []:
        if root.name.startswith("."):
            continue  # being created (see sweep_creating)
        dirs = ActivationDirs(root=root, logs=state.logs / root.name)
        owner = dirs.owner()
        if owner is not None and owner.alive():
            continue
        if owner is None and time.time() - root.stat().st_mtime < stop_timeout_s:
            continue  # being created right now: the owner file is written first thing
        mine = [r for r in records if r.activation_id == root.name]
        ended = []
        for record in mine:
            with (
                contextlib.suppress(ProcessGoneError),
                PinnedProcess(record.root_pid, record.root_start_time) as tree_root,
            ):
                tree_root.stop(stop_timeout_s)
                ended.append(record.root_pid)
        ended += dirs.processes()
        cgroups = [g for g in map(recorded_cgroup, mine) if g is not None]
        audit = remove_activation(dirs, [], stop_timeout_s, cgroups[0] if cgroups else None)
        for record in mine:
            state.drop_record(record.name)
        collected.append(
            CollectedActivation(
                activation_id=root.name,
                names=[r.name for r in mine],
                processes_ended=sorted(set(ended)),
                audit=audit,
            )
        )
    return collected


def sweep_creating(state: StateDir) -> list[str]:
    """Remove activation directories a killed process was still creating (nothing in them
    runs or is mounted yet: both come after the rename); return them."""
    removed = []
    for path in sorted(state.activations.glob(f".*{CREATING_SUFFIX}")):
        try:
            owner: ActivationOwner | None = ActivationOwner.model_validate_json(
                (path / "owner.json").read_bytes()
            )
        except (OSError, ValueError):
            owner = None  # killed before its owner file was complete: judged by age
        if owner.alive() if owner else time.time() - path.stat().st_mtime < TMP_GRACE_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def sweep_stale_records(state: StateDir) -> list[str]:
    """Drop records whose activation directory is gone and whose tree and supervisor are
    both dead (a stop killed between removing the activation and dropping its record)."""
    removed = []
    for record in state.load_records():
        if (state.activations / record.activation_id).exists():
            continue
        if is_same_process(record.root_pid, record.root_start_time) or is_same_process(
            record.supervisor_pid, record.supervisor_start_time
        ):
            continue
        state.drop_record(record.name)
        removed.append(str(state.record_path(record.name)))
    return removed
