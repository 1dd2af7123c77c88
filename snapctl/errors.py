"""The snapctl exception tree and the process exit codes.

Every error snapctl raises on purpose derives from :class:`SnapctlError` and may carry where it
happened as structured attributes (``phase``, ``path``, ``pid``, ``log_tail``), so callers and
the CLI can report it without parsing messages. The whole tree, with each class's exit status
(:class:`ExitStatus`) and the module that defines it (tests/test_errors.py checks that this
drawing lists every class, under its base, with its code)::

    SnapctlError                       1  errors: base; phase, path, pid, log_tail
    ├── ProtocolError                  1  errors: a control file broke the v1 protocol
    │   └── ControlDirError            1  errors: the control directory is unsafe
    ├── WaitTimeoutError               1  errors: a bounded wait expired (a TimeoutError too)
    ├── ProcessExitedError             1  errors: the process waited on is gone
    ├── CanaryMismatchError            5  errors: a canary result differs from its oracle
    ├── NoSpaceError                   7  errors: a disk filled up, or would: where, how much free
    ├── ProcessGoneError               1  supervision.process: a recorded PID is gone or reused
    ├── InvalidNameError               2  statedir.names: a --name outside the pattern
    ├── NameInUseError                 6  statedir.names: another activation has the name
    ├── UnknownActivationError         1  statedir.layout: no activation has the name or id
    ├── NoServerLogError               1  statedir.layout: an activation's server wrote no log yet
    ├── PublishError                   2  namespaces.publish: a --publish address refused
    ├── PublishAddressMissing          7  namespaces.publish: the address is not on this host
    ├── PortInUseError                 6  namespaces.publish: the port is taken
    ├── DevLayoutError                 7  namespaces.devices: an image kept the host's /dev
    ├── LaunchError                    3  activation.launch: the server failed before capture
    ├── NativeStepError                1  activation.native: cuda-checkpoint failed
    ├── ActivationError                4  activation.handshake: the server refused or failed
    ├── CaptureError                   3  activation.donor: no image was published
    ├── RestoreError                   4  activation.copy: CRIU could not restore the copy
    ├── CopyUsageError                 2  activation.precheck: a copy option refused up front
    ├── ContainerError                 7  activation.container: it cannot host the copy
    │   └── ContainerReferenceError    2  activation.container: no container name, ID or PID
    ├── RelayedError             relayed  errors: another process's error, with its code
    │   ├── DetachedStartError   relayed  activation.supervise: the supervisor's error
    │   ├── SupervisorError      relayed  pool.serve: an agent's copy supervisor failed the start
    │   └── AgentError           relayed  agent.errors: the agent refused or failed a request
    ├── ParkedCopyUnusableError        4  pool.serve: a parked copy refused before activating
    ├── PoolError                      2  pool.warm: a pool request that cannot be done
    ├── PoolTargetsError               1  pool.warm: the kept pool targets cannot be read
    ├── AgentUnavailableError          7  agent.errors: no agent answers, or it stopped
    ├── AgentRunningError              6  agent.daemon: another agent owns the state directory
    ├── ListenError                    7  agent.daemon: cannot listen where asked
    ├── TokenFileError                 2  agent.daemon: the --token-file is unusable or unsafe
    ├── BadRequestError                2  agent.service: a request refused before it started
    ├── NotFoundError                  1  agent.service: the activation named is unknown
    ├── CriuError              by action  criu.run: dump/pre-dump 3, restore/lazy-pages 4, else 1
    ├── CriuNotFound                   7  criu.locate: no usable CRIU binary
    ├── UndumpableError                3  criu.inventory: the tree holds what CRIU cannot dump
    ├── HostMountMissing               7  criu.external: a host mount the image needs is absent
    ├── CgroupError                    7  cgroups.group: an activation's cgroup cannot be made
    ├── PagemapError                   1  criu.pagemap: a pagemap image cannot be read
    ├── StatsFormatError               1  criu.stats: a CRIU stats image cannot be decoded
    ├── ImageError                     5  images.store: an image is missing or fails a check
    │   ├── ImageExistsError           6  images.store: the image directory already exists
    │   ├── ImageWriteError            1  images.store: staging or publishing failed on disk
    │   └── ArchiveError               5  images.archive: an archive is malformed or hostile
    ├── ImageBusyError                 6  images.lock: a copy holds the image, or it changes
    ├── IdentityMismatchError          5  images.identity.compare: this host differs, not waived
    ├── RegistryError                  1  registry.client: refused, or outside the API
    │   ├── RegistryUnreachableError   7  registry.client: the registry cannot be reached
    │   └── BlobMismatchError          5  registry.client: a blob does not match its digest
    ├── SigningKeyError                2  trust.errors: a key file unusable, or a wrong passphrase
    │   └── KeyExistsError             6  trust.errors: image keygen would overwrite a key
    ├── PolicyFormatError              2  trust.errors: a trust policy is not containers-policy.json
    ├── PolicyRefusedError             5  trust.errors: the trust policy refused an image
    ├── SignatureStoreError            1  trust.errors: no image to sign, or a .sig not cosign's
    ├── QualificationError             1  qualification.suite: cannot be set up
    ├── QualificationFailed            5  qualification.suite: a qualification check failed
    ├── StartupCaptureError            1  launcher: in the server, error.json written
    ├── UsageError                     2  launcher.vllm.usage: in the server, a bad command line
    └── CanaryError                    1  launcher.vllm.hooks: in the server, a bad canary

The last three are raised inside the server (by :mod:`snapctl.launcher`, which the server
runs): the host never catches them, it reads the ``error.json`` they leave (its phase is a
:class:`~snapctl.protocol.models.Phase`) and raises its own ``LaunchError`` or
``ActivationError``. docs/errors.md has the same tree as a table, with what each class means.

``phase`` is a :class:`~snapctl.phases.HostPhase` (what snapctl was doing) or, for an error
met while waiting on the server, the server's :class:`~snapctl.protocol.models.Phase`.
Messages are lowercase, name the field or path that failed, and never include secret values.
Lower-layer errors are translated at module boundaries and chained with ``from``.
"""

from __future__ import annotations

import errno
from enum import IntEnum

from snapctl.phases import HostPhase, Phase, phase_named

# Not typing's: the agent's thin client imports this module once a request failed, and typing
# or pathlib would be a tenth of its wall time (mypy reads any TYPE_CHECKING as true).
# pydantic only when it fails.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from pathlib import Path
    from typing import Any, Self


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
                              address, a host mount, a registry it can reach
    130   INTERRUPTED         stopped by SIGINT or SIGTERM (128 + SIGINT, as shells report
                              Ctrl-C); whatever was started was stopped
    ====  ==================  ==================================================================

    Every error class declares its code as ``exit_status`` (see the tree in the module's
    docstring); the CLI reads only that attribute. docs/errors.md has the same table, with
    the classes.
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
        phase: HostPhase | Phase | None = None,
        path: str | Path | None = None,
        pid: int | None = None,
        log_tail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.phase = phase
        self.path = None if path is None else _as_path(path)
        self.pid = pid
        self.log_tail = log_tail

    def __str__(self) -> str:
        if not self.log_tail:
            return self.message
        return f"{self.message}\n--- log tail ---\n{self.log_tail.rstrip()}"

    def to_wire(self) -> dict[str, Any]:
        """This error as it crosses a process boundary (a supervisor's report pipe, the agent's
        answers): the fields of ``snapctl.agent.api.ErrorBody``, read back by
        :meth:`RelayedError.from_wire`."""
        return {
            "error": self.message,
            "status": int(self.exit_status),
            "phase": None if self.phase is None else str(self.phase),
            "path": None if self.path is None else str(self.path),
            "log_tail": self.log_tail,
        }


def _as_path(path: str | Path) -> Path:
    from pathlib import Path  # when an error names a path, not on every CLI start

    return Path(path)


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
        phase: HostPhase | Phase | None = None,
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


class RelayedError(SnapctlError):
    """Another snapctl process's error (a supervisor's, the agent's), relayed here with the
    exit status it had there; a status this version does not know exits 1."""

    def __init__(self, message: str, *, exit_status: int = 1, **fields: Any) -> None:
        super().__init__(message, **fields)
        try:
            self.exit_status = ExitStatus(exit_status)
        except ValueError:
            self.exit_status = ExitStatus.ERROR

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], **fields: Any) -> Self:
        """The error that :meth:`SnapctlError.to_wire` wrote (another process's), tolerant of
        what a peer of another version may leave out or get wrong."""
        message, status, path, log_tail = (body.get(key) for key in _WIRE_FIELDS)
        return cls(
            message if isinstance(message, str) and message else "failed without saying why",
            exit_status=status if type(status) is int else ExitStatus.ERROR,
            phase=phase_named(body.get("phase")),
            path=path if isinstance(path, str) and path else None,
            log_tail=log_tail if isinstance(log_tail, str) else None,
            **fields,
        )


_WIRE_FIELDS = ("error", "status", "path", "log_tail")
INTERRUPTED_MESSAGE = "interrupted while starting (SIGINT/SIGTERM); what had started was stopped"


def wire_outcome(error: BaseException) -> dict[str, Any]:
    """What a supervisor reports when its start ended in ``error``: the error's wire, an
    interrupt, or a bug said as one (its traceback is the supervisor's log's)."""
    if isinstance(error, SnapctlError):
        return error.to_wire()
    if isinstance(error, KeyboardInterrupt):
        return RelayedError(INTERRUPTED_MESSAGE, exit_status=ExitStatus.INTERRUPTED).to_wire()
    return SnapctlError(f"unexpected {type(error).__name__} in the supervisor: {error}").to_wire()


class NoSpaceError(SnapctlError):
    """A disk filled up (ENOSPC) while snapctl wrote to it, or what an import or a pull would
    write does not fit; says where and how much is free."""

    exit_status = ExitStatus.UNAVAILABLE

    @classmethod
    def at(cls, path: Path, what: str, *, phase: HostPhase | Phase | None = None) -> NoSpaceError:
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
        if isinstance(seen, SnapctlError) and _NO_SPACE_TEXT in f"{seen.message}{seen.log_tail}":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def free_space(path: Path) -> str:
    """``"N MiB free"`` on the filesystem of ``path`` (or of its nearest existing parent)."""
    import shutil  # here, not at import: every CLI start imports this module

    for where in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(where).free >> 20} MiB free"
        except OSError:
            continue
    return "free space unknown"
