"""Serving one copy request from the agent: with a parked copy (:func:`activate_taken`), or
with a restore in a fresh supervisor (:func:`copy_via_supervisor`). Either way the copy lives
in its own supervisor process, and this side only relays its progress and its report. A donor
or a bake request is served the same way, in a fresh supervisor (:func:`capture_via_supervisor`).

Runs in the agent (in the thread serving the request); the wire it reads is
:mod:`snapctl.pool.wire`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest
from snapctl.errors import INTERRUPTED_MESSAGE, ExitStatus
from snapctl.phases import HostPhase
from snapctl.pool.cancel import Cancel
from snapctl.pool.spawner import Spawner, SpawnerGoneError
from snapctl.pool.wire import (
    LaneProgress,
    ParkedCopyUnusableError,
    ParkedHandle,
    SupervisorError,
    capture_payload,
    order_line,
    relay,
    request_payload,
)
from snapctl.statedir import StateDir

if TYPE_CHECKING:
    from snapctl.pool.warm import WarmPool

__all__ = [
    "LaneProgress",
    "ParkedCopyUnusableError",
    "ParkedHandle",
    "SupervisorError",
    "activate_from_pool",
    "activate_taken",
    "capture_payload",
    "capture_via_supervisor",
    "copy_via_supervisor",
    "relay",
    "request_payload",
]


def copy_via_supervisor(
    request: CopyRequest,
    state: StateDir,
    progress: LaneProgress,
    *,
    spawner: Spawner,
) -> dict[str, Any]:
    """No parked copy: restore and activate in a fresh supervisor forked by ``spawner``;
    return its report (``from_pool`` false; ``--count N``: the CopiesReport) once it serves,
    or raise its error (:class:`SupervisorError`, with the supervisor's exit status)."""
    job = {"kind": "copy", "state": str(state.root), "request": request_payload(request)}
    return _run_in_supervisor(job, spawner, progress, "copy")


def capture_via_supervisor(
    request: BakeRequest, state: StateDir, progress: LaneProgress, *, spawner: Spawner,
    cancel: Cancel | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Capture in a fresh supervisor forked by ``spawner``, in the client's directory and
    environment: a :class:`DonorRequest` returns the donor's report once it serves (its
    supervisor then supervises it, as ``donor --detach`` does), a :class:`BakeRequest` the
    bake's report once its image is published; or raises the supervisor's error. ``cancel``
    (its client gone) interrupts the capture: it then raises the interrupted start's error."""
    kind = "donor" if isinstance(request, DonorRequest) else "bake"
    job = {"kind": kind, "state": str(state.root), "request": capture_payload(request)}
    return _run_in_supervisor(job, spawner, progress, kind, cancel)


def _run_in_supervisor(
    job: dict[str, Any], spawner: Spawner, progress: LaneProgress, what: str,
    cancel: Cancel | None = None,
) -> dict[str, Any]:  # fmt: skip
    cancel = cancel or Cancel()
    if cancel.requested:  # its client left before it began: nothing starts
        raise SupervisorError(INTERRUPTED_MESSAGE, exit_status=ExitStatus.INTERRUPTED)
    try:
        spawned = spawner.launch(job)
    except SpawnerGoneError as error:
        raise SupervisorError(str(error), phase=HostPhase.SUPERVISE) from error
    try:
        with cancel.supervising(spawned.pidfd), os.fdopen(spawned.read_fd, "rb") as reader:
            return relay(reader, progress, what)
    except SupervisorError as error:
        if cancel.requested and error.phase == HostPhase.SUPERVISE:
            # Terminated before its signal handlers were in place: nothing had started.
            raise SupervisorError(
                INTERRUPTED_MESSAGE, exit_status=ExitStatus.INTERRUPTED
            ) from error
        raise
    finally:
        if spawned.pidfd is not None:
            os.close(spawned.pidfd)


def activate_taken(
    handle: ParkedHandle, request: CopyRequest, progress: LaneProgress
) -> dict[str, Any]:
    """Send the activation order to a parked copy and relay its progress; return its report
    (``from_pool`` true) once it serves. Raises :class:`ParkedCopyUnusableError` when nothing
    was activated (the copy is gone or its image changed: fall back to a fresh restore), or
    its activation's error (:class:`SupervisorError`; the copy was stopped)."""
    if request.count != 1:
        raise ValueError("a parked copy serves one copy request (count 1)")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            conn.connect(str(handle.socket))
            conn.sendall(order_line(request))
        except OSError as error:
            raise ParkedCopyUnusableError(
                f"parked copy {handle.id} does not answer ({error.strerror}); restore instead",
                phase=HostPhase.POOL, path=handle.socket,
            ) from error  # fmt: skip
        heard: list[str] = []

        def relayed(lane: str, step: str) -> None:
            heard.append(step)
            progress(lane, step)

        with conn.makefile("rb") as reader:
            try:
                return relay(reader, relayed)
            except SupervisorError as error:
                # Refused before anything was activated, or gone before it began (discarded
                # as its agent took it, say): a fresh restore can still serve the request.
                if error.phase == HostPhase.POOL or (
                    error.phase == HostPhase.SUPERVISE and not heard
                ):
                    raise ParkedCopyUnusableError(
                        error.message, phase=HostPhase.POOL, path=handle.socket
                    ) from error
                raise
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def activate_from_pool(
    pool: WarmPool, request: CopyRequest, progress: LaneProgress
) -> dict[str, Any] | None:
    """Take a parked copy that fits ``request`` and activate it: its report (``from_pool``
    true). None when none was ready, or the one taken could not serve (it is discarded and
    the caller restores a fresh one); an activation that failed raises its error."""
    handle = pool.take(Path(request.image), request)
    if handle is None:
        return None
    try:
        return activate_taken(handle, request, progress)
    except ParkedCopyUnusableError as error:
        pool.forget(handle)  # still parked, maybe: it is nobody's now
        progress("", f"parked copy unusable ({error.message}): restoring")
        return None
    finally:
        pool.settled(handle)  # served or not: refills may start
