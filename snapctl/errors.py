"""The snapctl exception tree and the process exit codes.

Every error snapctl raises on purpose derives from :class:`SnapctlError` and may carry where it
happened as structured attributes (``phase``, ``path``, ``pid``, ``log_tail``), so callers and
the CLI can report it without parsing messages::

    SnapctlError                      base; phase, path, pid, log_tail
    ├── ProtocolError                 a control file or its directory broke the v1 protocol
    │   └── ControlDirError           the control directory itself is unsafe or unusable
    ├── WaitTimeoutError              a bounded wait expired (also a TimeoutError)
    ├── ProcessExitedError            the process being waited on is gone
    └── CanaryMismatchError           a canary result differs from its oracle

Messages are lowercase, name the field or path that failed, and never include secret values.
Lower-layer errors are translated at module boundaries and chained with ``from``.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path


class ExitStatus(IntEnum):
    """Process exit codes of the snapctl CLI."""

    OK = 0
    ERROR = 1
    USAGE = 2
    CAPTURE_FAILED = 3
    ACTIVATION_FAILED = 4
    VERIFY_FAILED = 5
    INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


class SnapctlError(Exception):
    """Base of every deliberate snapctl error.

    ``log_tail`` may be attached after the fact by a caller that owns the relevant log (for
    example when a waited-on child died); it is appended to the message.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str | None = None,
        path: str | Path | None = None,
        pid: int | None = None,
        log_tail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.phase = phase
        self.path = None if path is None else Path(path)
        self.pid = pid
        self.log_tail = log_tail

    def __str__(self) -> str:
        if not self.log_tail:
            return self.message
        return f"{self.message}\n--- log tail ---\n{self.log_tail.rstrip()}"


class ProtocolError(SnapctlError):
    """A control file is missing a guarantee of the v1 protocol (type, size, content, order)."""


class ControlDirError(ProtocolError):
    """The control directory is unsafe (symlink, owner, permissions) or in the wrong state."""


class _WaitError(SnapctlError):
    """A wait that did not see what it awaited; ``awaited`` names those things."""

    def __init__(
        self,
        message: str,
        *,
        awaited: Iterable[str] = (),
        phase: str | None = None,
        path: str | Path | None = None,
        pid: int | None = None,
        log_tail: str | None = None,
    ) -> None:
        super().__init__(message, phase=phase, path=path, pid=pid, log_tail=log_tail)
        self.awaited = tuple(awaited)


class WaitTimeoutError(_WaitError, TimeoutError):
    """A bounded wait expired."""


class ProcessExitedError(_WaitError):
    """The process a wait depended on exited before the awaited event happened."""


class CanaryMismatchError(SnapctlError):
    """A canary result differs from the oracle recorded before capture."""
