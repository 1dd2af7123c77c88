"""Keeping an activation running: in the foreground until Ctrl-C or the server exits, or in
a detached supervisor process that outlives the command; and stopping one from its record, or
while it starts, from its name's reservation."""

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
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from snapctl.activation.session import CleanupAudit, Session, remove_activation
from snapctl.cgroups import ActivationCgroup
from snapctl.errors import ExitStatus, RelayedError, SnapctlError, wire_outcome
from snapctl.namespaces.layout import CREATING_SUFFIX, ActivationDirs, ActivationOwner
from snapctl.progress import Progress
from snapctl.statedir import ActivationRecord, StateDir, UnknownActivationError
from snapctl.statedir.names import LOCK_SUFFIX, NAME_PATTERN, ReservationHolder, boot_id
from snapctl.supervision import clock
from snapctl.supervision.leftovers import TMP_GRACE_S
from snapctl.supervision.logs import bound_log
from snapctl.supervision.process import (
    DEAD_STATES,
    PinnedProcess,
    ProcessGoneError,
    is_same_process,
    same_start,
)
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
                with contextlib.suppress(OSError):  # a full disk: the log grows, the copy serves
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
    command = os.getpid()
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

    if os.getppid() != command:
        # The command was killed before this start reserved its name, so nothing could find
        # and stop it (snapctl stop NAME): it does not start. Killed from here on, it is
        # found by its name's reservation, taken first thing.
        os._exit(ExitStatus.INTERRUPTED)
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


# A process writes itself into a name's lock file right after it locked it; a lock file that
# names no live process is looked at again for this long before the name is taken for unused.
HOLDER_WRITE_WAIT_S = 0.5
# An interrupted start stops what it started with its own timeouts (its tree: SIGTERM, the
# default stop wait, then SIGKILL; a tree still being launched may wait out all of it): the
# holder of its name gets this long on top of ``stop``'s timeout before it is killed.
START_CLEANUP_S = 15.0


def pin_holder(holder: ReservationHolder) -> PinnedProcess | None:
    """The process that reserved a name, pinned by pidfd, while it still runs (this boot,
    the same start: never another process that was given its PID); else None."""
    if holder.boot_id != boot_id():
        return None
    try:
        pinned = PinnedProcess(holder.pid)
    except ProcessGoneError:
        return None
    try:
        # Read after the pidfd exists: if the start still matches, the pidfd is the holder's.
        status, ticks = clock.read_stat(holder.pid)
    except (FileNotFoundError, ProcessLookupError):
        status, ticks = "X", -1
    if ticks != holder.start_ticks or status in DEAD_STATES:
        pinned.close()
        return None
    return pinned


def live_holder(state: StateDir, name: str) -> PinnedProcess | None:
    """The live process that holds ``name``'s reservation, pinned; None when none does."""
    holder = state.name_holder(name)
    return None if holder is None else pin_holder(holder)


def _record_named(state: StateDir, name: str) -> ActivationRecord | None:
    try:
        return state.find_record(name)
    except UnknownActivationError:
        return None


def stop_named(
    state: StateDir, name: str, stop_timeout_s: float = 10.0
) -> tuple[str, str, CleanupAudit]:
    """``snapctl stop NAME``: stop the activation ``name`` names and audit; return its name,
    how it stopped and the audit. A recorded one is stopped from its record
    (:func:`stop_recorded`); one still starting, before it has a record, is found by its
    name's reservation and stopped there (:func:`stop_starting`). Neither:
    :class:`UnknownActivationError`."""
    deadline = time.monotonic() + HOLDER_WRITE_WAIT_S
    lock = state.records / f"{name}{LOCK_SUFFIX}"
    while True:
        record = _record_named(state, name)
        if record is not None:
            how, audit = stop_recorded(record, state, stop_timeout_s)
            return record.name, how, audit
        holder = live_holder(state, name)
        if holder is not None:
            break
        if not lock.exists() or time.monotonic() >= deadline:
            raise UnknownActivationError(f"no activation named {name!r} (see snapctl ps)")
        time.sleep(0.02)  # locked a moment ago and not yet written down, or just released
    with holder:
        # Its start may have ended since: then it is recorded, and only that activation stops.
        record = _record_named(state, name)
        if record is not None:
            how, audit = stop_recorded(record, state, stop_timeout_s)
            return record.name, how, audit
        how, audit = stop_starting(holder, state, stop_timeout_s)
    return name, how, audit


def stop_starting(
    holder: PinnedProcess, state: StateDir, stop_timeout_s: float = 10.0
) -> tuple[str, CleanupAudit]:
    """Stop a start in progress from the process that reserved its name: SIGTERM, which its
    :class:`StopSignals` turn into an interrupted start that stops what it started (or, had
    the start just ended, into the stop of what it serves); SIGKILL if it has not ended
    ``stop_timeout_s`` after its own cleanup's time (:data:`START_CLEANUP_S`). Then what it
    left is stopped and removed as ``gc`` would (its records and activations), and audited.
    A start of several copies is one start: all of them stop."""
    try:
        ended = holder.stop(stop_timeout_s + START_CLEANUP_S)
        how = "killed while starting" if ended == "killed" else "interrupted while starting"
    except SnapctlError as error:
        how = error.message  # stuck in the kernel: the audit lists what is left
    audits = _stop_left_by(state, holder, stop_timeout_s)
    return how, CleanupAudit(
        processes=sorted({pid for audit in audits for pid in audit.processes}),
        mounts=[mount for audit in audits for mount in audit.mounts],
        directories=[directory for audit in audits for directory in audit.directories],
        listeners=[listener for audit in audits for listener in audit.listeners],
        shm_files=[name for audit in audits for name in audit.shm_files],
    )


def _stop_left_by(
    state: StateDir, holder: PinnedProcess, stop_timeout_s: float
) -> list[CleanupAudit]:
    """Stop and remove what the (now dead) process ``holder`` left, and audit each: the
    records whose supervisor it was, and the activations it owns (``owner.json``)."""

    def its(pid: int, start: float | None) -> bool:
        return pid == holder.pid and start is not None and same_start(start, holder.start_time)

    audits = [
        stop_recorded(record, state, stop_timeout_s)[1]
        for record in state.load_records()
        if its(record.supervisor_pid, record.supervisor_start_time)
    ]
    for root in sorted(state.activations.iterdir()) if state.activations.is_dir() else []:
        dirs = ActivationDirs(root=root, logs=state.logs / root.name)
        owner = None if root.name.startswith(".") else dirs.owner()
        if owner is not None and its(owner.pid, owner.start_time):
            audits.append(_collect(state, dirs, state.load_records(), stop_timeout_s).audit)
    for path in sorted(state.activations.glob(f".*{CREATING_SUFFIX}")):
        with contextlib.suppress(OSError, ValueError):
            creator = ActivationOwner.model_validate_json((path / "owner.json").read_bytes())
            if its(creator.pid, creator.start_time):
                shutil.rmtree(path, ignore_errors=True)
    return audits


def starting_names(state: StateDir, exclude_pids: frozenset[int] = frozenset()) -> list[str]:
    """Names reserved by a live process that have no record yet: activations still starting
    (not garbage; ``snapctl stop NAME`` stops them). Holders in ``exclude_pids`` (a warm
    pool's parked copies) are left out."""
    if not state.records.is_dir():
        return []
    recorded = {path.name.removesuffix(".json") for path in state.records.glob("*.json")}
    found = []
    for path in sorted(state.records.glob(f"*{LOCK_SUFFIX}")):
        name = path.name.removesuffix(LOCK_SUFFIX)
        if name in recorded or not NAME_PATTERN.fullmatch(name):
            continue
        holder = live_holder(state, name)
        if holder is not None:
            with holder:
                if holder.pid not in exclude_pids:
                    found.append(name)
    return found


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
        collected.append(_collect(state, dirs, records, stop_timeout_s))
    return collected


def _collect(
    state: StateDir, dirs: ActivationDirs, records: list[ActivationRecord], stop_timeout_s: float
) -> CollectedActivation:
    """Stop and remove one activation whose owner is dead, and drop its records."""
    mine = [r for r in records if r.activation_id == dirs.root.name]
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
    return CollectedActivation(
        activation_id=dirs.root.name,
        names=[r.name for r in mine],
        processes_ended=sorted(set(ended)),
        audit=audit,
    )


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
            owner = None  # killed before its owner file was complete
        if owner.alive() if owner else _creator_may_live(state, path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _creator_may_live(state: StateDir, creating: Path) -> bool:
    """Whether the process making ``creating``, whose owner file is not complete, may still
    be writing it. An unnamed activation's id is its name, reserved by that very process
    before it made the directory: its holder says. Else (a named one) it is judged by age."""
    activation_id = creating.name[1:].removesuffix(CREATING_SUFFIX)
    holder = state.name_holder(activation_id) if NAME_PATTERN.fullmatch(activation_id) else None
    if holder is None:
        return time.time() - creating.stat().st_mtime < TMP_GRACE_S
    pinned = pin_holder(holder)
    if pinned is None:
        return False
    pinned.close()
    return True


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
