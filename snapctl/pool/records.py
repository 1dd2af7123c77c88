"""Parked copies as the state directory knows them (``STATE/pool/<id>/parked.json``), and
ending one from its record alone: what a new agent does with what an earlier one parked."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
from pathlib import Path

from snapctl.pool.models import PARKED_ID_PATTERN, ParkedRecord
from snapctl.supervision.process import PinnedProcess, ProcessGoneError
from snapctl.supervision.state import StateDir

RECORD_NAME = "parked.json"
SOCKET_NAME = "order.sock"
LOG_NAME = "supervisor.log"
# A parked supervisor asked to stop discards its copy (stop, audit, remove): given this long.
DISCARD_TIMEOUT_S = 20.0


def pool_dir(state: StateDir) -> Path:
    return state.root / "pool"


def parked_home(state: StateDir, parked_id: str) -> Path:
    return pool_dir(state) / parked_id


def load_parked_records(state: StateDir) -> list[tuple[Path, ParkedRecord | None]]:
    """Every parked copy's directory with its record (None: missing or unreadable)."""
    found: list[tuple[Path, ParkedRecord | None]] = []
    root = pool_dir(state)
    if not root.is_dir():
        return found
    pattern = re.compile(PARKED_ID_PATTERN)
    for home in sorted(root.iterdir()):
        if not home.is_dir() or not pattern.fullmatch(home.name):
            continue
        try:
            record: ParkedRecord | None = ParkedRecord.model_validate_json(
                (home / RECORD_NAME).read_bytes()
            )
        except (OSError, ValueError):
            record = None
        found.append((home, record))
    return found


def _pinned(pid: int | None, start_time: float | None) -> PinnedProcess | None:
    if pid is None or start_time is None:
        return None
    try:
        return PinnedProcess(pid, start_time)
    except ProcessGoneError:
        return None


def discard_recorded(
    record: ParkedRecord, state: StateDir, timeout_s: float = DISCARD_TIMEOUT_S
) -> list[int]:
    """End a parked copy from its record, whoever parked it; return the PIDs ended here.

    Its supervisor, if alive, is asked (SIGTERM) and given ``timeout_s`` to discard the copy
    itself; then, or if it was gone, whatever it left is ended here: its tree and lazy-pages
    daemon (pinned by start time), its activation's directories, its pool directory.
    """
    from snapctl.activation.session import remove_activation
    from snapctl.namespaces.layout import ActivationDirs

    ended: list[int] = []
    supervisor = _pinned(record.supervisor_pid, record.supervisor_start_time)
    if supervisor is not None:
        with supervisor:
            with contextlib.suppress(ProcessGoneError):
                supervisor.signal(signal.SIGTERM)
            if not supervisor.wait(timeout_s):
                with contextlib.suppress(ProcessGoneError):
                    supervisor.signal(signal.SIGKILL)
                supervisor.wait(timeout_s)
                ended.append(record.supervisor_pid)
    root = _pinned(record.root_pid, record.root_start_time)
    if root is not None:
        with root:
            with contextlib.suppress(Exception):  # stuck in the kernel: the audit says so
                root.stop(timeout_s)
            ended.append(root.pid)
    daemon = _pinned(record.lazy_pages_pid, record.lazy_pages_start_time)
    if daemon is not None:
        with daemon:
            with contextlib.suppress(ProcessGoneError):
                daemon.signal(signal.SIGKILL)
            daemon.wait(timeout_s)
            ended.append(daemon.pid)
    if record.activation_id is not None:
        dirs = ActivationDirs(
            root=state.activations / record.activation_id,
            logs=state.logs / record.activation_id,
        )
        if dirs.root.exists():
            ended += dirs.processes()
            remove_activation(dirs, [], timeout_s)
            shutil.rmtree(dirs.logs, ignore_errors=True)  # a parked copy never served
    shutil.rmtree(parked_home(state, record.id), ignore_errors=True)
    return sorted(set(ended))


def sweep_parked(state: StateDir, grace_s: float = 60.0) -> list[str]:
    """``snapctl gc``, with or without an agent: end what parked copies whose supervisor died
    left behind (a live one discards itself once its agent is gone), and remove pool
    directories without a record that are older than ``grace_s``; return what went."""
    import time

    from snapctl.supervision.process import is_same_process

    removed = []
    for home, record in load_parked_records(state):
        if record is None:
            with contextlib.suppress(OSError):
                if time.time() - home.stat().st_mtime < grace_s:
                    continue  # being created right now: its record is written first thing
            shutil.rmtree(home, ignore_errors=True)
            removed.append(str(home))
        elif not is_same_process(record.supervisor_pid, record.supervisor_start_time):
            discard_recorded(record, state)
            removed.append(str(home))
    return removed
