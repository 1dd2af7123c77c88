"""The wire between the agent and the supervisors it has forked, shared by both processes:
its writing end (:class:`Reporter`, in a supervisor), its reading end (:func:`relay` and
:func:`wait_parked`, in the agent), the errors it carries, how a request travels on it, and
the handle the agent keeps on a parked copy's order socket. Imports no other pool module
but the models.

The report wire, from a supervisor (a pipe) or a parked copy (its socket): one JSON object a
line, ``{"lane", "progress"}`` any number of times, then ``{"report": {...}}`` or the error
(:meth:`SnapctlError.to_wire`); a park job reports ``{"parked": record}`` instead of a report.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from snapctl.activation.requests import BakeRequest, CopyRequest
from snapctl.errors import ExitStatus, RelayedError, SnapctlError, wire_outcome
from snapctl.phases import HostPhase
from snapctl.pool.models import ActivationOrder, ParkedRecord

# on_progress(lane, step): lane "" for a single copy, "copy N" for one of --count N.
LaneProgress = Callable[[str, str], None]


class SupervisorError(RelayedError):
    """A supervisor (a copy's, a donor's, a bake's) could not start, capture or activate
    (its error, relayed)."""


class ParkedCopyUnusableError(SnapctlError):
    """A parked copy refused its order before activating anything (it was gone, its image
    was removed or replaced since it was parked, the request does not fit how it was
    restored, a malformed order); nothing of it serves: restore a fresh copy instead."""

    exit_status = ExitStatus.ACTIVATION_FAILED


@dataclass(frozen=True)
class ParkedHandle:
    """A parked copy that :meth:`WarmPool.take` handed out: its order socket (all its
    activation needs), its id and image, and its supervisor."""

    id: str
    image: str
    socket: Path
    supervisor_pid: int
    supervisor_start_time: float


class Reporter:
    """The report wire's writing end, in a supervisor: a pipe or a socket."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "w")
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """Write ``message``; whether it was delivered (False: its reader is gone)."""
        with self._lock:
            try:
                self._file.write(json.dumps(message) + "\n")
                self._file.flush()
            except (OSError, ValueError):  # a reader gone early
                return False
        return True

    def progress(self, lane: str, step: str) -> None:
        self.send({"lane": lane, "progress": step})

    def error(self, error: BaseException) -> int:
        """Send ``error`` as the outcome; return the exit status it stands for."""
        outcome = wire_outcome(error)
        if not isinstance(error, KeyboardInterrupt | SnapctlError):
            traceback.print_exc()  # a bug: the agent says so instead of "exited early"
        self.send(outcome)
        return int(outcome["status"])

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.close()


def relay(lines: Iterable[bytes], on_progress: LaneProgress, what: str = "copy") -> dict[str, Any]:
    """Read a supervisor's report wire up to its outcome: the report, or its error raised."""
    for line in lines:
        message = json.loads(line)
        if "progress" in message:
            on_progress(message.get("lane", ""), message["progress"])
            continue
        if "error" in message:
            raise SupervisorError.from_wire(message)
        report: dict[str, Any] = message["report"]
        return report
    raise SupervisorError(
        f"the {what}'s supervisor exited before reporting", phase=HostPhase.SUPERVISE
    )


def wait_parked(lines: Iterable[bytes]) -> ParkedRecord:
    """Read a park job's wire until it parked (its record) or failed (its error raised)."""

    def ignore(lane: str, step: str) -> None:
        pass

    for line in lines:
        message = json.loads(line)
        if "parked" in message:
            return ParkedRecord.model_validate_json(json.dumps(message["parked"]))
        if "progress" in message:
            continue
        relay([line], ignore)  # raises its error
    raise SupervisorError(
        "the parked copy's supervisor exited before parking", phase=HostPhase.RESTORE
    )


def request_payload(request: CopyRequest) -> dict[str, Any]:
    """The request as it travels to a supervisor, the API key's value included (JSON's
    dump masks it; supervisors are ours, reached only over pipes and 0600 sockets)."""
    payload = request.model_dump(mode="json")
    payload["api_key"] = None if request.api_key is None else request.api_key.get_secret_value()
    return payload


def order_line(request: CopyRequest | None) -> bytes:
    """The one :class:`ActivationOrder` a parked copy's socket takes, as its line: activate it
    for ``request`` (its API key included, see :func:`request_payload`), or (None) discard it."""
    action: Literal["activate", "discard"] = "discard" if request is None else "activate"
    order = ActivationOrder(action=action, request=request).model_dump(mode="json")
    if request is not None:
        order["request"] = request_payload(request)
    return json.dumps(order).encode() + b"\n"


def capture_payload(request: BakeRequest) -> dict[str, Any]:
    """A donor or bake request as it travels to its supervisor: the environment's values
    included (JSON's dump masks them; see :func:`request_payload`)."""
    payload = request.model_dump(mode="json")
    payload["environ"] = {name: value.get_secret_value() for name, value in
                          request.environ.items()}  # fmt: skip
    payload["env"] = {name: value.get_secret_value() for name, value in request.env.items()}
    return payload
