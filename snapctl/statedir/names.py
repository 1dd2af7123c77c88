"""Activation names: the one pattern every command and the state directory accept, and the
reservation that keeps a name unique from before an activation starts until it is stopped.

A name becomes a file name (``records/NAME.json``), so it is checked before anything uses it.
A reservation is an exclusive ``flock`` on ``records/NAME.lock``, held by the process that
supervises the activation: the kernel drops it when that process dies, however it dies, so a
crash never leaves a name reserved. The record outlives a killed supervisor, though (its copy
may still run, unsupervised), so a name is also in use while its record exists, until
``snapctl gc`` removes it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase

TYPE_CHECKING = False  # not typing's, nor pathlib: see snapctl.errors
if TYPE_CHECKING:
    from pathlib import Path

# The one spelling of the rule: the agent's routes and request models are built from it, and
# snapctl.thin.is_activation_name checks it without re (tests/agent/test_thin.py compares).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
LOCK_SUFFIX = ".lock"


class InvalidNameError(SnapctlError):
    """An activation name that is not :data:`NAME_PATTERN` (it would escape or break a path)."""

    exit_status = ExitStatus.USAGE


class NameInUseError(SnapctlError):
    """Another activation (running, starting, or left unsupervised) already has this name."""

    exit_status = ExitStatus.CONFLICT


def check_name(name: str) -> str:
    """``name`` if it is a valid activation name, else :class:`InvalidNameError`."""
    if not NAME_PATTERN.fullmatch(name):
        shown = name if len(name) <= 70 else name[:67] + "..."
        raise InvalidNameError(f"invalid name {shown!r}: use {NAME_RULE}", phase=HostPhase.NAME)
    return name


def numbered_names(name: str, count: int) -> list[str]:
    """The names of ``copy --name NAME --count N``: ``NAME-1`` .. ``NAME-N``, each checked."""
    return [check_name(f"{check_name(name)}-{index}") for index in range(1, count + 1)]


class NameReservation:
    """An exclusive hold on one name; ``release`` (idempotent) frees it."""

    def __init__(self, name: str, lock_path: Path, fd: int) -> None:
        self.name = name
        self.lock_path = lock_path
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlinked while still locked: whoever opens the name next gets a fresh inode and
        # checks it (see lock_name), so no one ever holds a lock on a file that is gone.
        try:
            if _same_file(self._fd, self.lock_path):
                self.lock_path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def lock_name(records: Path, name: str) -> NameReservation | None:
    """Take ``name``'s lock without waiting; None while another process holds it.

    Only the lock: whether a record still uses the name is for :func:`reserve_name`.
    """
    path = records / f"{check_name(name)}{LOCK_SUFFIX}"
    while True:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        if _same_file(fd, path):
            return NameReservation(name, path, fd)
        os.close(fd)  # released and unlinked between our open and our lock: open it again


def reserve_name(records: Path, name: str) -> NameReservation:
    """Reserve ``name`` for a new activation, race-free, or raise :class:`NameInUseError`."""
    records.mkdir(parents=True, mode=0o700, exist_ok=True)
    try:
        reservation = lock_name(records, name)
    except OSError as error:
        raise SnapctlError(
            f"cannot reserve the name {name!r}: {error.strerror}",
            phase=HostPhase.NAME,
            path=records,
        ) from error
    if reservation is None:
        raise NameInUseError(
            f"the name {name!r} is in use by another activation (see snapctl ps)",
            phase=HostPhase.NAME,
        )
    if (records / f"{name}.json").exists():
        reservation.release()
        raise NameInUseError(
            f"the name {name!r} is in use by an activation whose supervisor is gone "
            "(snapctl gc cleans it up; snapctl ps lists it)",
            phase=HostPhase.NAME,
        )
    return reservation
