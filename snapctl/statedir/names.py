"""Activation names: the one pattern every command and the state directory accept, and the
reservation that keeps a name unique from before an activation starts until it is stopped.

A name becomes a file name (``records/NAME.json``), so it is checked before anything uses it.
A reservation is an exclusive ``flock`` on ``records/NAME.lock``, held by the process that
supervises the activation: the kernel drops it when that process dies, however it dies, so a
crash never leaves a name reserved. The record outlives a killed supervisor, though (its copy
may still run, unsupervised), so a name is also in use while its record exists, until
``snapctl gc`` removes it.

The reserving process writes who it is into the lock file (:class:`ReservationHolder`), so
that ``snapctl stop NAME`` finds an activation that is still starting, before it has a record.
A look that only checks a name (:func:`check_name_free`) writes nothing: it is no start.
"""

from __future__ import annotations

import os
import re

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase
from snapctl.statedir.flock import try_lock

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


BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_HOLDER_BYTES = 256


class ReservationHolder:
    """The process that reserved a name, as it wrote itself into the name's lock file: its
    PID, its start in clock ticks since boot (``/proc/PID/stat``) and the boot's id, so that
    a PID given out again (later, or in another boot) is never taken for it."""

    __slots__ = ("boot_id", "pid", "start_ticks")

    def __init__(self, pid: int, start_ticks: int, boot_id: str) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.boot_id = boot_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReservationHolder) and self.line() == other.line()

    def __hash__(self) -> int:
        return hash(self.line())

    def __repr__(self) -> str:
        return f"ReservationHolder({self.pid}, {self.start_ticks}, {self.boot_id!r})"

    @classmethod
    def current(cls) -> ReservationHolder:
        pid = os.getpid()
        return cls(pid, start_ticks(pid), boot_id())

    def line(self) -> str:
        return f"{self.pid} {self.start_ticks} {self.boot_id}\n"

    @classmethod
    def parse(cls, text: str) -> ReservationHolder | None:
        """The holder a lock file names; None for an empty or torn one."""
        parts = text.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2])


def start_ticks(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat``, field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        raw = stat.read()
    # The fields after the command name, which may itself hold spaces and parentheses.
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def boot_id() -> str:
    with open(BOOT_ID) as source:
        return source.read().strip()


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

    def record_holder(self) -> None:
        """Write this process into the lock file as the name's holder (see
        :func:`read_holder`): only a start does, never a look that releases at once."""
        if self._fd is None:
            return
        line = ReservationHolder.current().line().encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, line, 0)


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
        fd = try_lock(path)
        if fd is None:
            return None
        if _same_file(fd, path):
            return NameReservation(name, path, fd)
        os.close(fd)  # released and unlinked between our open and our lock: open it again


def reserve_name(records: Path, name: str) -> NameReservation:
    """Reserve ``name`` for a new activation, race-free, or raise :class:`NameInUseError`;
    the reservation names this process as its holder (see :func:`read_holder`)."""
    reservation = _take_name(records, name)
    try:
        reservation.record_holder()
    except OSError as error:
        reservation.release()
        raise SnapctlError(
            f"cannot reserve the name {name!r}: {error.strerror}",
            phase=HostPhase.NAME,
            path=reservation.lock_path,
        ) from error
    return reservation


def check_name_free(records: Path, name: str) -> None:
    """Raise :class:`NameInUseError` as :func:`reserve_name` would, without reserving: the
    name is taken and let go at once, and no holder is written (a look is no start, and
    ``snapctl stop`` must never signal the process that only looked)."""
    _take_name(records, name).release()


def read_holder(records: Path, name: str) -> ReservationHolder | None:
    """The process that wrote itself into ``name``'s lock file as its holder, or None (no
    lock file, or none written yet). Whether it still runs, and so still holds the name
    (a holder's release removes the file, a dead one's lock is gone), is the caller's to
    check, by PID and start ticks."""
    path = records / f"{check_name(name)}{LOCK_SUFFIX}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        text = os.pread(fd, MAX_HOLDER_BYTES, 0).decode(errors="replace")
    finally:
        os.close(fd)
    return ReservationHolder.parse(text)


def _take_name(records: Path, name: str) -> NameReservation:
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
