"""Reading a process tree's files: every regular file its processes have mapped or open (as host
paths), and their sizes and content digests, cached by stat (:mod:`snapctl.images.filecache`)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import posixpath
import stat
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from snapctl.images.filecache import FileCache, stat_key
from snapctl.images.identity.models import FileRecord

CHUNK = 4 << 20

# Paths whose contents are the activation's own (bind-mounted per activation, a private tmpfs
# in the sandbox) or not files at all.
EXCLUDED_PREFIXES = ("/run/", "/dev/", "/proc/", "/sys/", "/memfd:")


def _candidate(path: str) -> bool:
    return (
        path.startswith("/")
        and not path.endswith(" (deleted)")
        and not path.startswith(EXCLUDED_PREFIXES)
        and posixpath.normpath(path) == path
    )


def _same_file_on_host(pid: int, path: str) -> bool:
    """True when ``path`` names the same regular file inside the tree's mount namespace as on
    the host: the sandbox shares the host's root, except for its own mounts."""
    try:
        inside = os.stat(f"/proc/{pid}/root{path}")
        outside = os.stat(path)
    except OSError:
        return False
    same = (inside.st_dev, inside.st_ino) == (outside.st_dev, outside.st_ino)
    return same and stat.S_ISREG(outside.st_mode)


def tree_files(pids: Iterable[int]) -> list[str]:
    """Host paths of every regular file the processes have mapped or open (sorted, unique).

    Read from ``/proc/PID/maps`` and ``/proc/PID/fd``; sockets, pipes, anonymous and deleted
    files, the activation's own directories and anything private to the sandbox are left out.
    """
    found: set[str] = set()
    for pid in pids:
        candidates: set[str] = set()
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0":
                    candidates.add(fields[5])
        except OSError:
            continue  # exited: its files went with it
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            descriptors = []
        for fd in descriptors:
            try:
                candidates.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        found.update(p for p in candidates if _candidate(p) and _same_file_on_host(pid, p))
    return sorted(found)


# openat2(2): its number (the same on every architecture) and the flags that keep a lookup
# inside a directory taken as the root, as a process whose root it is sees it.
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_libc = ctypes.CDLL(None, use_errno=True)


def open_in_root(root_fd: int, path: str) -> int:
    """An ``O_PATH`` descriptor of ``path`` as a process whose root is the directory
    ``root_fd`` finds it: every symbolic link on the way, absolute or with ``..``, resolved
    inside that root (``RESOLVE_IN_ROOT``), in one lookup that a rename meanwhile cannot lead
    out. A container's files read from the host are the container's, never the host's a link
    in the container names."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    name = path.lstrip("/").encode() or b"."
    fd = int(_libc.syscall(SYS_OPENAT2, root_fd, name, ctypes.byref(how), ctypes.sizeof(how)))
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    return fd


@dataclass(frozen=True)
class FileView:
    """Where a copy's files are read instead of this host's ``/``: below ``root`` (a
    container's root filesystem as this host mounts it), except each path of ``mounts``, read
    from the directory or file given there (a volume of the container, as this host mounts
    it): what the copy's tree will see."""

    root: Path
    mounts: Mapping[str, Path] = field(default_factory=dict)


class _Files:
    """Where the paths are read: on this host, or (``root_fd``) inside a container's root and
    (``mount_fds``: its mount point, deepest first, and a descriptor) its volumes. Only
    regular files are read: a FIFO or a device at a recorded path is found with ``O_PATH``
    (which opens nothing) and left out, never opened (a FIFO's open would wait for a writer
    for ever)."""

    def __init__(
        self, root_fd: int | None = None, mount_fds: Sequence[tuple[str, int]] = ()
    ) -> None:
        self.root_fd = root_fd
        self.mount_fds = mount_fds

    def entry(self, path: str) -> str:
        """The name of ``path``'s entry in the hash cache: a container's files (on a file
        system of their own) have one beside this host's, so that copies on the host and in
        containers taking turns do not each evict the other's and hash the file again."""
        return path if self.root_fd is None else f"{path} (in a container)"

    def _find(self, path: str) -> int:
        for point, fd in self.mount_fds:
            if path == point:
                return os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
            if path.startswith(point.rstrip("/") + "/"):
                return open_in_root(fd, path[len(point.rstrip("/")) :])
        if self.root_fd is None:
            return os.open(path, os.O_PATH | os.O_CLOEXEC)
        return open_in_root(self.root_fd, path)

    def open(self, path: str) -> int:
        found = self._find(path)
        try:
            if not stat.S_ISREG(os.fstat(found).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            return os.open(f"/proc/self/fd/{found}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(found)

    def stat(self, path: str) -> os.stat_result:
        if self.root_fd is None:
            return os.stat(path)  # one call: every copy's identity check stats every file
        found = self._find(path)
        try:
            return os.fstat(found)
        finally:
            os.close(found)


def _cached(path: str, cache: FileCache | None, files: _Files) -> FileRecord | None:
    """The cached record of ``path`` if the file is unchanged since it was hashed, else None."""
    if cache is None:
        return None
    try:
        st = files.stat(path)
    except OSError:
        return None  # missing: hashing leaves it out
    sha256 = cache.lookup(files.entry(path), {path: stat_key(st)})
    if sha256 is None:
        return None
    try:
        return FileRecord(path=path, size=st.st_size, sha256=sha256)
    except ValueError:
        return None  # a damaged entry only costs a re-hash


def _hash_one(path: str, cache: FileCache | None, files: _Files) -> FileRecord | None:
    digest = hashlib.sha256()
    try:
        with os.fdopen(files.open(path), "rb") as handle:
            key = stat_key(os.fstat(handle.fileno()))
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
            after = os.fstat(handle.fileno())
    except OSError:
        return None
    record = FileRecord(path=path, size=after.st_size, sha256=digest.hexdigest())
    if cache is not None and stat_key(after) == key:  # not written to while we read it
        cache.remember(files.entry(path), {path: key}, record.sha256)
    return record


def hash_files(
    paths: list[str], cache_dir: Path | None, *, view: FileView | None = None
) -> list[FileRecord]:
    """Size and sha256 of each path that exists (missing ones are left out), in parallel;
    cached in ``cache_dir`` by path and stat key (see :mod:`snapctl.images.filecache`).
    ``view``: each path is read there (a container's files: :func:`open_in_root` below its
    root or volume), and recorded as given."""
    if view is None:
        return _hash_files(paths, cache_dir, _Files())
    opened: list[int] = []
    try:
        for where in (view.root, *view.mounts.values()):
            try:
                opened.append(os.open(where, os.O_PATH | os.O_CLOEXEC))
            except OSError:
                return []  # no root or volume: every file missing
        points = list(view.mounts)
        deepest = sorted(zip(points, opened[1:], strict=True), key=lambda e: -len(e[0]))
        return _hash_files(paths, cache_dir, _Files(opened[0], deepest))
    finally:
        for fd in opened:
            os.close(fd)


def _hash_files(paths: list[str], cache_dir: Path | None, files: _Files) -> list[FileRecord]:
    cache = FileCache(cache_dir) if cache_dir is not None else None
    # Cache hits first, one by one: a stat and a small read each, cheaper than handing them to
    # threads on a busy host, and every copy's identity check pays it (docs/images.md).
    found = {path: _cached(path, cache, files) for path in paths}
    misses = [path for path, record in found.items() if record is None]
    if misses:
        # hashlib releases the GIL: a few threads keep every core and the disk busy.
        with ThreadPoolExecutor(max_workers=min(8, len(misses))) as pool:
            hashed = pool.map(lambda p: _hash_one(p, cache, files), misses)
            found.update(zip(misses, hashed, strict=True))
    return [record for path in paths if (record := found[path]) is not None]
