"""Thin wrappers over mount(2)/umount2(2), open_tree(2)/move_mount(2) (Python has none) and a
mount-table reader."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
CLONE_NEWNS = 0x00020000
MNT_DETACH = 2
# open_tree(2) and move_mount(2) (x86_64 and every other architecture since Linux 5.2).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
# openat2(2) (every architecture since Linux 5.6).
SYS_OPENAT2 = 437
# mount_setattr(2) (every architecture since Linux 5.12).
SYS_MOUNT_SETATTR = 442
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4
RESOLVE_NO_SYMLINKS = 0x04


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]  # fmt: skip


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source: str, target: str | Path, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(),
            str(target).encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def make_read_only(target: str | Path) -> None:
    """Make the mount at ``target`` read-only, its other attributes as they are."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, str(target).encode(), 0, ctypes.byref(attr),
                      ctypes.sizeof(attr)),
        f"mount_setattr {target} read-only",
    )  # fmt: skip


def join_mount_namespace(pid: int | str) -> None:
    """Move this process, which must have one thread, into ``pid``'s mount namespace."""
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNS), f"setns into process {pid}'s mount namespace")
    finally:
        os.close(fd)


def umount(target: str | Path, detach: bool = False) -> None:
    _check(_libc.umount2(str(target).encode(), MNT_DETACH if detach else 0), f"umount {target}")


def umount_when_free(target: str | Path, wait_s: float, poll_s: float = 0.02) -> None:
    """:func:`umount`, retried while it is busy (EBUSY) for up to ``wait_s``; then the last
    EBUSY is raised."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            umount(target)
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise
        time.sleep(poll_s)


def mount_tmpfs(target: str | Path, options: str, source: str = "tmpfs", flags: int = 0) -> None:
    mount(source, target, "tmpfs", flags, options)


def open_path_no_symlinks(path: str | Path) -> int:
    """An ``O_PATH`` descriptor of ``path``, refused (ELOOP) if any of its components is a
    symlink: what was resolved earlier cannot be swapped for a link in between."""
    how = _OpenHow(flags=os.O_PATH | os.O_CLOEXEC, mode=0, resolve=RESOLVE_NO_SYMLINKS)
    fd = _libc.syscall(SYS_OPENAT2, AT_FDCWD, str(path).encode(), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))  # fmt: skip
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"openat2 {path} (no symlinks): {os.strerror(errno)}")
    return int(fd)


def clone_tree(source: str | Path, *, no_symlinks: bool = False) -> int:
    """A detached copy of the mount at ``source`` (not of its submounts), as a descriptor that
    :func:`attach_tree` mounts elsewhere: unlike a path it survives ``source`` being unmounted.

    ``no_symlinks``: ``source`` must be fully resolved; a symlink anywhere on it is refused
    rather than followed (ELOOP).
    """
    if no_symlinks:
        path_fd = open_path_no_symlinks(source)
        try:
            fd = _libc.syscall(
                SYS_OPEN_TREE, path_fd, b"",
                OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW,
            )  # fmt: skip
        finally:
            os.close(path_fd)
    else:
        fd = _libc.syscall(
            SYS_OPEN_TREE, AT_FDCWD, str(source).encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
        )
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"open_tree {source}: {os.strerror(errno)}")
    return int(fd)


def attach_tree(tree_fd: int, target: str | Path) -> None:
    """Mount a tree from :func:`clone_tree` at ``target``."""
    _check(
        _libc.syscall(
            SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, str(target).encode(), MOVE_MOUNT_F_EMPTY_PATH
        ),
        f"move_mount onto {target}",
    )


def make_private_recursive(target: str = "/") -> None:
    mount("none", target, None, MS_REC | MS_PRIVATE)


def unescape_mount_field(field: str) -> str:
    """A path field of /proc/*/mounts or mountinfo, which escape space, tab, newline and
    backslash as octal (``\\040``), decoded."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mountinfo_entries(pid: int | str = "self") -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, source) of every mount seen by ``pid``, in table order."""
    entries: list[tuple[str, str, str]] = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")  # optional fields end here; type and source follow
        point = unescape_mount_field(fields[4])
        entries.append((point, fields[separator + 1], fields[separator + 2]))
    return entries


def mountinfo(pid: int | str = "self") -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount seen by ``pid``, in table order."""
    return [(point, fstype) for point, fstype, _ in mountinfo_entries(pid)]


def mount_lines(mounts_text: str) -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, source) of each line of a /proc/*/mounts text, in order."""
    entries = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            entries.append(
                (unescape_mount_field(fields[1]), fields[2], unescape_mount_field(fields[0]))
            )
    return entries


def mount_entries(mounts_text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each line of a /proc/*/mounts text, in order."""
    return [(point, fstype) for point, fstype, _ in mount_lines(mounts_text)]


def mount_type(mounts_text: str, mount_point: str) -> str | None:
    """The filesystem type mounted at ``mount_point`` (the topmost of stacked mounts)."""
    found = None
    for point, fstype in mount_entries(mounts_text):
        if point == mount_point:
            found = fstype
    return found


def _mounts_by_source(pid: int | str) -> set[tuple[str, str]]:
    return {(source, point) for point, _, source in mountinfo_entries(pid)}


def processes_with_mount(source: str, point: str) -> list[int]:
    """PIDs of processes in *other* mount namespaces that have a mount named ``source`` at
    ``point``.

    An activation's tmpfs carries a unique source name and is mounted at a fixed point inside
    its sandbox, whatever the PID namespace or parent of the process: this finds even a tree
    whose root PID was never learnt (a restore interrupted before its pidfile was read).
    The mount point matters: a namespace being set up for *another* activation starts as a
    copy of the host's table, where this tmpfs sits at its host path, not at ``point``.
    """
    own_namespace = os.stat("/proc/self/ns/mnt").st_ino
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/mnt").st_ino == own_namespace:
                continue
            if (source, point) in _mounts_by_source(entry.name):
                found.append(int(entry.name))
        except OSError:
            # Exited while we looked (ENOENT, ESRCH, or EINVAL from a mountinfo read mid-exit),
            # or a kernel thread without a namespace link.
            continue
    return sorted(found)


def is_mountpoint(path: Path) -> bool:
    resolved = str(path.resolve())
    return any(point == resolved for point, _ in mountinfo())


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace (for cleanup audits)."""
    base = str(path.resolve())
    return [p for p, _ in mountinfo() if p == base or p.startswith(base + "/")]
