"""What CRIU cannot dump, found before a dump starts.

CRIU learns that a tree holds something it cannot dump only after it has frozen the tree, and
then says so in its own words (``Unknown shit 600 (anon_inode:[io_uring])`` for the io_uring
rings libuv maps). :func:`require_dumpable` reads every open descriptor (``/proc/PID/fd``
links, their ``stat`` and ``/proc/PID/fdinfo``) and every device mapping (``/proc/PID/maps``)
of every process of a tree while it waits at its barrier, right before the dump (after the
native step, which releases the GPU: it judges what CRIU would see), and refuses before
anything is frozen, naming the PID, process, descriptor, what it is and the fix.

What counts as undumpable is what CRIU 4.2 refuses (``criu/files.c`` ``dump_one_file``,
``dump_chrdev``; ``criu/proc_parse.c`` ``handle_vma``; ``criu/tty.c`` ``get_tty_driver``) on
a build without plugins, as snapctl's is: anonymous inodes other than the kinds CRIU dumps,
character devices other than memory devices, terminals, tun and autofs, block devices, and
mappings of character devices other than ``/dev/zero``. Sockets and regular files are left to
CRIU: it dumps the kinds servers hold, and refuses the rest with clear messages of its own.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase

ANON_PREFIX = "anon_inode:"
# The anonymous inodes CRIU 4.2 dumps (its is_*_link checks), by the name /proc links show.
# bpf-map is dumped only by CRIU built with libbpf; it is left to CRIU to judge.
DUMPABLE_ANON = frozenset(
    {
        "[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]",
        "[pidfd]", "bpf-map",
    }
)  # fmt: skip
IO_URING = "[io_uring]"
# Keys only an io_uring's fdinfo has: a ring is recognized even under another link name.
IO_URING_FDINFO_KEYS = ("SqMask", "CqMask")

MEM_MAJOR = 1
TTY_MAJOR = 4
TTYAUX_MAJOR = 5
MISC_MAJOR = 10
TUN_MINOR = 200
AUTOFS_MINOR = 235
PTY_MASTER_MAJORS = range(128, 136)
PTY_SLAVE_MAJOR = 136
SERIAL_MAJORS = (188, 204)  # USB serial, low-density serial
DEV_ZERO = os.makedev(MEM_MAJOR, 5)

FIX_IO_URING = (
    "io_uring must be unavailable to the server, so that its libraries (libuv, uvloop) fall "
    "back to epoll: snapctl's sandbox refuses io_uring_setup by seccomp; where that filter is "
    "not in place, set sysctl kernel.io_uring_disabled=2 on the host"
)
FIX_INFINIBAND = (
    "capture the server without RDMA: open no /dev/infiniband device before capture-ready "
    "(for NCCL, NCCL_IB_DISABLE=1)"
)
FIX_NVIDIA = (
    "capture with --native cuda-checkpoint, which releases the GPU before the dump (with it, "
    "a device still held means cuda-checkpoint did not checkpoint that process)"
)
FIX_OTHER = "close it before the server writes capture-ready.json (CRIU cannot dump it)"


class UndumpableError(SnapctlError):
    """The tree holds descriptors or mappings CRIU cannot dump; nothing was frozen."""

    exit_status = ExitStatus.CAPTURE_FAILED

    def __init__(self, findings: Sequence[Undumpable]) -> None:
        lines = "\n".join(f"  - {finding.describe()}" for finding in findings)
        super().__init__(
            f"the tree holds {len(findings)} thing(s) CRIU cannot dump; it was not frozen:\n"
            f"{lines}",
            phase=HostPhase.INVENTORY,
            pid=findings[0].pid if findings else None,
        )
        self.findings = tuple(findings)


@dataclass(frozen=True)
class OpenFile:
    """One descriptor of a process, as /proc shows it."""

    fd: int
    target: str  # the fd link: a path, "anon_inode:[eventfd]", "socket:[123]", ...
    mode: int | None = None  # st_mode of the open file (None: it could not be read)
    rdev: int = 0
    fdinfo: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MappedFile:
    """One file-backed mapping of a process (``/proc/PID/maps``), with what it maps."""

    span: str  # "start-end", as maps and map_files name it
    path: str
    mode: int | None = None
    rdev: int = 0


@dataclass(frozen=True)
class Undumpable:
    """One thing of one process that CRIU cannot dump, and what to do about it."""

    pid: int
    name: str
    where: str  # "fd 4", "mapping 7f00-7f10"
    what: str  # the fd link or mapped path
    why: str
    fix: str

    def describe(self) -> str:
        where = f"pid {self.pid} ({self.name}) {self.where}"
        return f"{where}: {self.what}: {self.why}; fix: {self.fix}"


class ProcessView(Protocol):
    """Where the inventory reads a process (``/proc`` by default; a fake in tests)."""

    def name(self, pid: int) -> str: ...

    def open_files(self, pid: int) -> list[OpenFile]: ...

    def mapped_files(self, pid: int) -> list[MappedFile]: ...


class ProcFs:
    """:class:`ProcessView` over the real ``/proc``. A process or descriptor that vanishes
    while it is read is skipped: a tree at its barrier opens and closes nothing, and one that
    exits fails its capture anyway."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def name(self, pid: int) -> str:
        try:
            return (self.root / str(pid) / "comm").read_text().strip()
        except OSError:
            return "?"

    def open_files(self, pid: int) -> list[OpenFile]:
        fd_dir = self.root / str(pid) / "fd"
        try:
            names = os.listdir(fd_dir)
        except (FileNotFoundError, ProcessLookupError):
            return []
        found = []
        for entry in sorted(names, key=int):
            try:
                target = os.readlink(fd_dir / entry)
            except OSError:
                continue  # closed since the listing
            mode, rdev = _stat(fd_dir / entry)
            found.append(
                OpenFile(
                    fd=int(entry),
                    target=target,
                    mode=mode,
                    rdev=rdev,
                    fdinfo=_fdinfo(self.root / str(pid) / "fdinfo" / entry),
                )
            )
        return found

    def mapped_files(self, pid: int) -> list[MappedFile]:
        try:
            lines = (self.root / str(pid) / "maps").read_text().splitlines()
        except OSError:
            return []
        found = []
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not _may_be_undumpable_mapping(parts[5]):
                continue
            span, path = parts[0], parts[5]
            mode, rdev = _stat(self.root / str(pid) / "map_files" / span)
            found.append(MappedFile(span=span, path=path, mode=mode, rdev=rdev))
        return found


def _stat(path: Path) -> tuple[int | None, int]:
    try:
        result = os.stat(path)
    except OSError:
        return None, 0
    return result.st_mode, result.st_rdev


def _fdinfo(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _may_be_undumpable_mapping(path: str) -> bool:
    """Mappings worth a stat: anonymous inodes and device files (not /dev/shm's tmpfs)."""
    return path.startswith(ANON_PREFIX) or (
        path.startswith("/dev/") and not path.startswith("/dev/shm/")
    )


def _device_dumpable(rdev: int) -> bool:
    """Whether CRIU 4.2 dumps an open character device (``dump_chrdev``, ``get_tty_driver``)."""
    major, minor = os.major(rdev), os.minor(rdev)
    if major == MEM_MAJOR:
        return True
    if major == MISC_MAJOR:
        return minor in (TUN_MINOR, AUTOFS_MINOR)
    if major == TTYAUX_MAJOR:
        return minor in (0, 1, 2)
    if major == TTY_MAJOR:
        return 1 <= minor <= 63
    return major in PTY_MASTER_MAJORS or major == PTY_SLAVE_MAJOR or major in SERIAL_MAJORS


def _device_fix(path: str) -> tuple[str, str]:
    if path.startswith("/dev/infiniband/"):
        return "an RDMA (InfiniBand verbs) device, which CRIU 4.2 cannot dump", FIX_INFINIBAND
    if path.startswith("/dev/nvidia"):
        return "an NVIDIA device, which CRIU cannot dump while CUDA holds it", FIX_NVIDIA
    return "a device CRIU 4.2 cannot dump", FIX_OTHER


def classify_open_file(entry: OpenFile) -> tuple[str, str] | None:
    """(why, fix) when CRIU cannot dump ``entry``; None when it can or it is CRIU's to judge."""
    if entry.target.startswith(ANON_PREFIX):
        kind = entry.target[len(ANON_PREFIX) :]
        if kind == IO_URING or any(key in entry.fdinfo for key in IO_URING_FDINFO_KEYS):
            return "an io_uring instance, which CRIU 4.2 cannot dump", FIX_IO_URING
        if kind in DUMPABLE_ANON:
            return None
        return f"an anonymous inode of a kind CRIU 4.2 cannot dump ({kind})", FIX_OTHER
    if entry.mode is None:
        return None
    if stat.S_ISCHR(entry.mode) and not _device_dumpable(entry.rdev):
        why, fix = _device_fix(entry.target)
        return f"{why} (character device {os.major(entry.rdev)}:{os.minor(entry.rdev)})", fix
    if stat.S_ISBLK(entry.mode):
        return "a block device, which CRIU cannot dump", FIX_OTHER
    return None


def classify_mapping(mapping: MappedFile) -> tuple[str, str] | None:
    """(why, fix) when CRIU cannot dump ``mapping`` (``handle_vma``: io_uring rings, device
    mappings other than /dev/zero); None otherwise."""
    if mapping.path == ANON_PREFIX + IO_URING:
        return "an io_uring ring mapped into memory, which CRIU 4.2 cannot dump", FIX_IO_URING
    if mapping.mode is None:
        return None
    if stat.S_ISCHR(mapping.mode) and mapping.rdev != DEV_ZERO:
        why, fix = _device_fix(mapping.path)
        return f"a mapping of {why}", fix
    return None


def inventory(pids: Iterable[int], *, view: ProcessView | None = None) -> list[Undumpable]:
    """Everything of the processes ``pids`` that CRIU cannot dump, in their order, then by fd.

    A mapping of what a descriptor of the same process already names is not named again
    (libuv keeps its io_uring open and mapped: one finding, the descriptor)."""
    view = view or ProcFs()
    findings: list[Undumpable] = []
    for pid in pids:
        name: str | None = None
        named: set[str] = set()
        for entry in view.open_files(pid):
            verdict = classify_open_file(entry)
            if verdict is None:
                continue
            name = name or view.name(pid)
            named.add(entry.target)
            findings.append(Undumpable(pid, name, f"fd {entry.fd}", entry.target, *verdict))
        for mapping in view.mapped_files(pid):
            verdict = classify_mapping(mapping)
            if verdict is None or mapping.path in named:
                continue
            name = name or view.name(pid)
            named.add(mapping.path)
            findings.append(
                Undumpable(pid, name, f"mapping {mapping.span}", mapping.path, *verdict)
            )
    return findings


def require_dumpable(pids: Iterable[int], *, view: ProcessView | None = None) -> None:
    """Raise :class:`UndumpableError` naming everything of ``pids`` CRIU cannot dump."""
    findings = inventory(pids, view=view)
    if findings:
        raise UndumpableError(findings)
