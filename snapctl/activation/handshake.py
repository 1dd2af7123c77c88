"""The capturer side of one activation: activation → challenge → release → validated, then
public HTTP readiness probed through the activation's network namespace."""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from snapctl.activation.timeouts import server_timeout_hint
from snapctl.errors import ExitStatus, SnapctlError, WaitTimeoutError
from snapctl.namespaces.netns import NetnsConnector
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import (
    Activation,
    Challenge,
    ControlFile,
    ErrorReport,
    Phase,
    Release,
    Status,
)
from snapctl.protocol.waiter import ControlDirWatcher

# Without inotify, how often a "recovering" status.json is re-read.
STATUS_REPOLL_S = 0.05
# What a wait gets once the deadline has passed: one last look, then WaitTimeoutError
# (a wait refuses a timeout of zero or less as a programming error).
LAST_LOOK_S = 1e-3
# The longest one readiness probe may wait for an answer before it tries again.
PROBE_TRY_S = 2.0
# Between readiness probes: 1 ms at first (a restored server binds within milliseconds of
# validating), doubling up to 5 ms (one that takes seconds to bind is not hammered).
PROBE_FIRST_WAIT_S = 0.001
PROBE_MAX_WAIT_S = 0.005
# Readiness as vLLM's users probe it (open in vLLM and the fixture); with an API key, then
# an authenticated request as well.
READY_PATH = "/health"
AUTHENTICATED_PATH = "/v1/models"


class ActivationError(SnapctlError):
    """The server refused or failed the activation (``error.json``), or never became ready."""

    exit_status = ExitStatus.ACTIVATION_FAILED

    def __init__(
        self, message: str, *, phase: Phase | None = None, report: ErrorReport | None = None
    ) -> None:
        super().__init__(message, phase=phase)
        self.report = report


def reported_phase(report: ErrorReport) -> Phase | None:
    """The protocol phase ``error.json`` names; None for a name outside the protocol (the
    message still quotes it, and ``report`` keeps it)."""
    try:
        return Phase(report.phase)
    except ValueError:
        return None


@dataclass
class HandshakeTimings:
    """Milliseconds from writing activation.json to each step the server took."""

    challenge_ms: float = 0.0
    validated_ms: float = 0.0
    http_ready_ms: float = 0.0
    phases: list[str] = field(default_factory=list)


def _fail_on_error(arrival_name: ControlFile, model: object) -> None:
    if arrival_name is ControlFile.ERROR:
        assert isinstance(model, ErrorReport)
        raise ActivationError(
            f"server reported {model.error_type} in phase {model.phase!r}: {model.error}"
            + server_timeout_hint(model.error_type, model.error),
            phase=reported_phase(model),
            report=model,
        )


def activate(
    control: ControlDir,
    *,
    capture_id: str,
    activation_id: str,
    kind: Literal["donor", "copy"],
    host: str | None,
    port: int,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
) -> HandshakeTimings:
    """Run the handshake; return when ``status.json`` says validated (raise on error.json)."""
    timings = HandshakeTimings()
    activation = Activation(
        capture_id=capture_id,
        activation_id=activation_id,
        kind=kind,
        native_complete=True,
        host=host,
        port=port,
    )
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(deadline - time.monotonic(), LAST_LOOK_S)

    with ControlDirWatcher(control) as watcher:
        started = time.monotonic()
        control.write(activation)
        name, challenge = watcher.wait_for(
            (ControlFile.CHALLENGE, ControlFile.ERROR), left(), alive=alive
        )
        _fail_on_error(name, challenge)
        timings.challenge_ms = (time.monotonic() - started) * 1000
        if not isinstance(challenge, Challenge):
            raise ActivationError("challenge.json is not a challenge", phase=Phase.CAPTURE_BARRIER)
        if (challenge.capture_id, challenge.activation_id) != (capture_id, activation_id):
            raise ActivationError(
                "challenge.json names another capture or activation", phase=Phase.CAPTURE_BARRIER
            )
        control.write(Release.answering(challenge))
        while True:
            name, model = watcher.wait_for(
                (ControlFile.ERROR, ControlFile.STATUS), left(), alive=alive
            )
            _fail_on_error(name, model)
            assert isinstance(model, Status)
            if model.activation_id != activation_id:
                raise ActivationError("status.json names another activation", phase=Phase.RECOVER)
            if not timings.phases or timings.phases[-1] != model.phase:
                timings.phases.append(model.phase)
            if model.phase == "validated":
                break
            # "recovering": the next change is validated or error.json; status.json exists
            # already, so wait_for would return at once (and never time out): the deadline is
            # ours to check, then sleep until the directory changes.
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"the server was still recovering after {timeout_s:g} s "
                    f"(status.json in {control.path})",
                    awaited=("status.json validated",),
                    phase=Phase.RECOVER,
                    path=control.path,
                )
            watcher.wait_for_change(min(STATUS_REPOLL_S, left()))
        timings.validated_ms = (time.monotonic() - started) * 1000
    return timings


class _NetnsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, connector: NetnsConnector, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._connector = connector

    def connect(self) -> None:
        self.sock = self._connector.connect(self.host, self.port, self.timeout or 2.0)


def http_get(
    connector: NetnsConnector,
    host: str,
    port: int,
    path: str,
    api_key: str | None = None,
    timeout_s: float = 5.0,
) -> tuple[int, bytes]:
    """One GET inside the namespace; returns (status, body)."""
    connection = _NetnsHTTPConnection(connector, host, port, timeout_s)
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def probe_http_ready(
    connector: NetnsConnector,
    host: str,
    port: int,
    *,
    api_key: str | None,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
    timeout_hint: str = "",
) -> float:
    """Poll until the server is ready as its users probe it, ``GET /health`` answering 200
    (no key needed: vLLM and the fixture leave it open); with ``api_key`` also until an
    authenticated ``GET /v1/models`` answers 200. Return the seconds it took.
    ``timeout_hint`` ends the timeout's message (the option that sets ``timeout_s``)."""
    started = time.monotonic()
    deadline = started + timeout_s
    checks = [READY_PATH, *([AUTHENTICATED_PATH] if api_key else [])]
    last = "no answer"
    wait_s = PROBE_FIRST_WAIT_S
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise ActivationError(
                "server exited before its public port answered", phase=Phase.SERVE
            )
        path = checks[0]
        try:
            # Each try ends by the deadline: the probe's timeout is the whole probe's.
            each_s = min(PROBE_TRY_S, max(deadline - time.monotonic(), LAST_LOOK_S))
            status, body = http_get(connector, host, port, path, api_key, timeout_s=each_s)
            if status == 200:
                checks.pop(0)
                if not checks:
                    return time.monotonic() - started
                continue  # the next check at once: the server is up
            if status in (401, 403):
                # Up, but refusing our key (or asking for one): waiting longer cannot help.
                given = "is wrong" if api_key else "is missing (give it with --api-key-env)"
                raise ActivationError(
                    f"public port {host}:{port} answers {path} with HTTP {status}: the API key "
                    f"{given}",
                    phase=Phase.SERVE,
                )
            last = f"{path}: HTTP {status}: {body[:200]!r}"
        except (TimeoutError, OSError, http.client.HTTPException) as error:
            last = f"{path}: {type(error).__name__}: {error}"
        time.sleep(wait_s)
        wait_s = min(wait_s * 2, PROBE_MAX_WAIT_S)
    raise ActivationError(
        f"public port {host}:{port} never answered {checks[0]} with 200 within {timeout_s:g} s"
        f"{timeout_hint} (last: {last})",
        phase=Phase.SERVE,
    )
