"""Keeping an activation running: in the foreground until Ctrl-C or the server exits, or in
a detached supervisor process that outlives the command; and stopping one from its record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

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
    """Serve until every tree exited, or SIGINT/SIGTERM arrives; then stop and audit each."""
    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set() and any(session.alive() for session in sessions):
            stop.wait(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return [session.stop(stop_timeout_s) for session in sessions]


def detach(start: Callable[[], tuple[Session, Any]]) -> tuple[Session, Any] | None:
    """Fork a supervisor that runs ``start``; only the supervisor (child) returns.

    The parent prints the child's report line (or error) and exits with the child's status.
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
        session, report = start()
    except SnapctlError as error:
        writer.write(json.dumps({"error": str(error).splitlines()[0], "status": 1}) + "\n")
        writer.close()
        os._exit(1)
    writer.write(json.dumps({"report": report.model_dump(mode="json")}) + "\n")
    writer.close()
    # Detach stdio from the terminal: the supervisor lives on alone.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return session, report


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
        # The supervisor sees its tree gone, cleans up and exits; give it the time to.
        if not supervisor.wait(stop_timeout_s):
            supervisor.stop(stop_timeout_s)
        supervisor.close()
    dirs = ActivationDirs(
        root=state.activations / record.activation_id, logs=state.logs / record.activation_id
    )
    left = end_stragglers(dirs, stop_timeout_s) if dirs.root.exists() else []
    if dirs.root.exists() and not left:
        dirs.remove()
    state.drop_record(record.name)
    return how, CleanupAudit(
        processes=left,
        mounts=mounts.mounts_under(dirs.root) if dirs.root.exists() else [],
        directories=[str(dirs.root)] if dirs.root.exists() else [],
        listeners=[],
    )
