"""Keeping an activation running: in the foreground until Ctrl-C or the server exits, or in
a detached supervisor process that outlives the command; and stopping one from its record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from snapctl.activation.session import CleanupAudit, Session, end_stragglers
from snapctl.errors import SnapctlError
from snapctl.namespaces import mounts
from snapctl.namespaces.layout import ActivationDirs
from snapctl.supervision.process import PinnedProcess, ProcessGoneError
from snapctl.supervision.state import ActivationRecord, StateDir


def run_until_stopped(session: Session, stop_timeout_s: float = 10.0) -> tuple[str, CleanupAudit]:
    """Serve until the tree exits, or SIGINT/SIGTERM arrives; then stop and audit."""
    return run_all_until_stopped([session], stop_timeout_s)[0]


def run_all_until_stopped(
    sessions: list[Session], stop_timeout_s: float = 10.0
) -> list[tuple[str, CleanupAudit]]:
    """Serve until every tree exited, or SIGINT/SIGTERM arrives; then stop and audit each.

    A tree that exits (or is stopped with ``snapctl stop``, or was killed as unsafe, see
    ``Session.failure``) is cleaned up at once, while the others keep serving.
    """
    stop = threading.Event()
    results: dict[int, tuple[str, CleanupAudit]] = {}

    def request_stop(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set() and len(results) < len(sessions):
            for index, session in enumerate(sessions):
                if index not in results and not session.alive():
                    results[index] = session.stop(stop_timeout_s)
            stop.wait(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for index, session in enumerate(sessions):
        if index not in results:
            results[index] = session.stop(stop_timeout_s)
    return [results[index] for index in range(len(sessions))]


def detach(start: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """Fork a supervisor that runs ``start``; only the supervisor (child) returns.

    ``start`` returns what the supervisor will supervise and a report (a pydantic model or a
    JSON-ready dict). The parent prints the child's report (or error) and exits with its status.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as reader:
            line = reader.readline()
        if not line:
            sys.stderr.write("error: the detached supervisor exited before reporting\n")
            os._exit(1)
        message = json.loads(line)
        if message.get("error"):
            sys.stderr.write(f"error: {message['error']}\n")
            os._exit(int(message.get("status", 1)))
        sys.stdout.write(json.dumps(message["report"]) + "\n")
        sys.stdout.flush()
        os._exit(0)
    os.close(read_fd)
    os.setsid()
    writer = os.fdopen(write_fd, "w")
    try:
        supervised, report = start()
    except SnapctlError as error:
        status = int(getattr(error, "exit_status", 1))
        writer.write(json.dumps({"error": error.message, "status": status}) + "\n")
        writer.close()
        os._exit(1)
    record = report.model_dump(mode="json") if hasattr(report, "model_dump") else report
    writer.write(json.dumps({"report": record}) + "\n")
    writer.close()
    # Detach stdio from the terminal: the supervisor lives on alone.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return supervised, report


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
        how = root.stop(stop_timeout_s)
        root.close()
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
    if dirs.root.exists():
        left += end_stragglers(dirs, stop_timeout_s)
    if dirs.root.exists() and not left:
        dirs.remove()
    state.drop_record(record.name)
    return how, CleanupAudit(
        processes=left,
        mounts=mounts.mounts_under(dirs.root) if dirs.root.exists() else [],
        directories=[str(dirs.root)] if dirs.root.exists() else [],
        listeners=[],
    )


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
        left = end_stragglers(dirs, stop_timeout_s)
        if not left:
            dirs.remove()
        for record in mine:
            state.drop_record(record.name)
        collected.append(
            CollectedActivation(
                activation_id=root.name,
                names=[r.name for r in mine],
                processes_ended=sorted(set(ended)),
                audit=CleanupAudit(
                    processes=left,
                    mounts=mounts.mounts_under(root) if root.exists() else [],
                    directories=[str(root)] if root.exists() else [],
                    listeners=[],
                ),
            )
        )
    return collected
