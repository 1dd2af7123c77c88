"""The snapctl exception tree and the process exit codes.

Every error snapctl raises on purpose derives from :class:`SnapctlError` and may carry where it
happened as structured attributes (``phase``, ``path``, ``pid``, ``log_tail``), so callers and
the CLI can report it without parsing messages::

    SnapctlError                      base; phase, path, pid, log_tail; exit_status
    ├── ProtocolError                 a control file or its directory broke the v1 protocol
    │   └── ControlDirError           the control directory itself is unsafe or unusable
    ├── WaitTimeoutError              a bounded wait expired (also a TimeoutError)
    ├── ProcessExitedError            the process being waited on is gone
    ├── CanaryMismatchError           a canary result differs from its oracle
    └── NoSpaceError                  a disk filled up (ENOSPC): where, and how much is free

The other packages derive their own errors from these (``ImageError``, ``CriuError``,
``RestoreError``, ...); docs/errors.md lists every class with its exit status.

Messages are lowercase, name the field or path that failed, and never include secret values.
Lower-layer errors are translated at module boundaries and chained with ``from``.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path


class ExitStatus(IntEnum):
    """Process exit codes of the snapctl CLI, one per kind of failure.

    ====  ==================  ==================================================================
    code  name                meaning
    ====  ==================  ==================================================================
    0     OK                  the command did what it was asked
    1     ERROR               a failure of no kind below (a bug is reported this way too)
    2     USAGE               a bad option, argument or name; nothing was started
    3     CAPTURE_FAILED      launching or capturing a server failed; no image was published
    4     ACTIVATION_FAILED   restoring or activating a copy or donor failed; nothing left running
    5     VERIFY_FAILED       an image, archive, host identity, canary or qualification check
                              failed
    6     CONFLICT            something is already there or in use: an image directory, an
                              activation name, a host port, an image a copy still holds
    7     UNAVAILABLE         this host lacks what the command needs: CRIU, disk space, an
                              address, a host mount
    130   INTERRUPTED         stopped by SIGINT or SIGTERM (128 + SIGINT, as shells report
                              Ctrl-C); whatever was started was stopped
    ====  ==================  ==================================================================

    Every error class declares its code as ``exit_status`` (see the tree above); the CLI
    reads only that attribute. docs/errors.md has the same table, with the classes.
    """

    OK = 0
    ERROR = 1
    USAGE = 2
    CAPTURE_FAILED = 3
    ACTIVATION_FAILED = 4
    VERIFY_FAILED = 5
    CONFLICT = 6
    UNAVAILABLE = 7
    INTERRUPTED = 130


class SnapctlError(Exception):
    """Base of every deliberate snapctl error.

    ``log_tail`` may be attached after the fact by a caller that owns the relevant log (for
    example when a waited-on child died); it is appended to the message. ``exit_status`` is
    the CLI's exit code for the error: each subclass declares its own kind.
    """

    exit_status: ExitStatus = ExitStatus.ERROR

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

    @property
    def excerpt(self) -> str | None:
        """The log lines that explain the error: ``log_tail``, or a subclass's own (CRIU's)."""
        return self.log_tail

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

    exit_status = ExitStatus.VERIFY_FAILED


class NoSpaceError(SnapctlError):
    """A disk filled up (ENOSPC) while snapctl wrote to it; says where and how much is free."""

    exit_status = ExitStatus.UNAVAILABLE

    @classmethod
    def at(cls, path: Path, what: str, *, phase: str | None = None) -> NoSpaceError:
        """``what`` failed for lack of space on the filesystem holding ``path``."""
        return cls(no_space_message(path, what), phase=phase, path=path)


def no_space_message(path: Path, what: str) -> str:
    """``what`` failed: no space (ENOSPC) at ``path``, with the space free there."""
    return (
        f"{what}: no space left on device (ENOSPC) at {path}, {free_space(path)} "
        "(free space there, or choose another directory)"
    )


# CRIU and other tools say ENOSPC in their logs this way (strerror), not by errno.
_NO_SPACE_TEXT = "No space left on device"


def is_no_space(error: BaseException) -> bool:
    """True if ``error`` or anything it was raised from ran out of disk space."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, NoSpaceError):
            return True
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(seen, SnapctlError) and _NO_SPACE_TEXT in f"{seen.message}{seen.excerpt}":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def free_space(path: Path) -> str:
    """``"N MiB free"`` on the filesystem of ``path`` (or of its nearest existing parent)."""
    for where in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(where).free >> 20} MiB free"
        except OSError:
            continue
    return "free space unknown"
