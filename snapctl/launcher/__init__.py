"""The server side of the v1 startup-capture protocol, as a library any Python server can call.

A server in startup mode builds its engine, then hands control to :func:`run_startup_capture`
with an object implementing :class:`StartupHooks`. The function prepares (canary, release,
rehearsal, release), states its capture facts where snapctl asked for them
(:mod:`snapctl.protocol.facts`), publishes ``capture-ready.json``, waits for an activation, runs the
challenge/release handshake, recovers, checks the canary against the oracle and returns the
host and port the server may now bind. Any failure writes ``error.json`` and raises
:class:`StartupCaptureError`; the server must then exit without binding.

Nothing here starts a thread, and nothing holds a descriptor while the process waits at the
capture barrier, where CRIU checkpoints it. Once an activation is accepted (no checkpoint
follows), the wait for its release is woken by inotify; that descriptor is kept open, without a
watch, for the rest of the process's life, because closing one waits for a kernel grace period.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from snapctl.errors import CanaryMismatchError, SnapctlError
from snapctl.launcher._control import DEFAULT_POLL_S, ServerControl, describe_error
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.facts import CaptureFacts, facts_path_from_env, write_facts
from snapctl.protocol.models import ControlFile, ErrorReport, Oracle, Phase, SnapshotConfig

__all__ = [
    "DEFAULT_POLL_S",
    "BindTarget",
    "StartupCaptureError",
    "StartupHooks",
    "StatingHooks",
    "report_failure",
    "run_startup_capture",
]


class StartupHooks(Protocol):
    """What the server provides. Each hook runs in the server's main thread."""

    def canary(self) -> Oracle:
        """Run the fixed private canary (greedy, one token) and return its result."""

    def release_memory(self) -> None:
        """Drop reloadable memory (weights, KV cache) before capture."""

    def restore_memory(self) -> None:
        """Bring back what release_memory dropped: under the ``reload`` policy the weights
        from their files; under ``in-image`` only the caches (the weights never left)."""


@runtime_checkable
class StatingHooks(StartupHooks, Protocol):
    """Hooks that also state the capture's facts; hooks without them state none."""

    def capture_facts(self) -> CaptureFacts:
        """The memory policy and the first load's parameter digests (after the rehearsal)."""


@dataclass(frozen=True)
class BindTarget:
    """Where the activated server binds its public socket."""

    host: str | None
    port: int
    activation_id: str
    kind: str


class StartupCaptureError(SnapctlError, RuntimeError):
    """The startup capture failed; ``error.json`` was written (when possible)."""

    phase: Phase  # always set here, unlike on SnapctlError

    def __init__(self, phase: Phase, message: str) -> None:
        super().__init__(f"{phase}: {message}", phase=phase)


def run_startup_capture(
    config: SnapshotConfig, hooks: StartupHooks, *, poll_s: float = DEFAULT_POLL_S
) -> BindTarget:
    """Run prepare → capture-ready → activation → challenge/release → recover → validated.

    ``config.timeout_s`` bounds each wait for a control file, counting only time this process
    spends waiting (not time frozen by CRIU). ``poll_s`` is the interval between probes for
    ``activation.json`` at the capture barrier (see :mod:`snapctl.launcher._control`).
    """
    capture_id = uuid.uuid4().hex  # made at start, before anything can fail
    # The launcher takes over from engine initialization; its own checks fail in that phase,
    # as vLLM validates the control directory before building the engine.
    phase: Phase = Phase.INITIALIZE_ENGINE
    control: ServerControl | None = None
    try:
        config = SnapshotConfig.model_validate(config.model_dump())
        control_dir = ControlDir(config.control_dir)
        # From here error.json can be attempted: every write re-validates the directory, so
        # nothing is written into one that fails the safety checks.
        control = ServerControl(control_dir, capture_id, config.timeout_s, poll_s)
        if not (poll_s > 0 and poll_s <= config.timeout_s):
            raise ValueError("poll_s must be positive and at most timeout_s")
        control_dir.validate(require_empty=True)

        phase = Phase.PREPARE
        oracle = hooks.canary()
        hooks.release_memory()
        # Rehearse one full recovery before capture, so a copy never discovers it cannot.
        hooks.restore_memory()
        _require_match(oracle, hooks.canary(), "rehearsal canary")
        hooks.release_memory()
        facts_path = facts_path_from_env()
        if facts_path is not None and isinstance(hooks, StatingHooks):
            write_facts(facts_path, hooks.capture_facts())

        phase = Phase.CAPTURE_BARRIER
        control.publish_ready(oracle)
        activation = control.wait_for_activation()

        phase = Phase.RECOVER
        control.write_status("recovering")
        phase = Phase.RECOVERY_RESTORE_MEMORY
        hooks.restore_memory()
        phase = Phase.RECOVERY_CANARY
        _require_match(oracle, hooks.canary(), "recovery canary")
        phase = Phase.RECOVER
        control.write_status("validated")
        return BindTarget(
            host=activation.host,
            port=activation.port,
            activation_id=activation.activation_id,
            kind=activation.kind,
        )
    except BaseException as error:
        described = describe_error(error)
        name = type(error).__name__
        message = name if described == name else f"{name}: {described}"
        if control is None:
            # No validated config: there is no control directory we may write into.
            raise StartupCaptureError(phase, f"{message} (error.json not written)") from error
        secondary = control.write_error(phase, error)
        if secondary is not None:
            message += f" (error.json not written: {type(secondary).__name__}: {secondary})"
        raise StartupCaptureError(phase, message) from error


def report_failure(
    config: SnapshotConfig, phase: Phase, error: BaseException, activation_id: str | None = None
) -> None:
    """Record a failure outside :func:`run_startup_capture` in ``error.json`` (best effort):
    the engine failed to start before it, or binding failed after ``validated``."""
    try:
        control = ControlDir(config.control_dir)
        ready = control.read(ControlFile.CAPTURE_READY)
        report = ErrorReport(
            # Without capture-ready.json no capture happened: any fresh id names this start.
            capture_id=uuid.uuid4().hex if ready is None else ready.capture_id,
            activation_id=activation_id,
            phase=phase.value,
            error_type=type(error).__name__,
            error=describe_error(error),
        )
        control.write(report, overwrite=True)
    except Exception as secondary:
        logging.getLogger(__name__).warning("could not write error.json: %s", secondary)


def _require_match(oracle: Oracle, result: Oracle, what: str) -> None:
    difference = oracle.mismatch(result)
    if difference is not None:
        raise CanaryMismatchError(f"{what} does not match the oracle: {difference}")
