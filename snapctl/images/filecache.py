"""The one stat-keyed file cache: a value remembered for a set of files, trusted while none of
them changed, so an unchanged file is not read and hashed again.

Both users keep their own directory: the content digests of files outside images (one entry
per path, see :mod:`snapctl.images.identity.tree`) and whole-image verifications (one entry per
image and directory, see :mod:`snapctl.images.store`).

Every file is known by :func:`stat_key`: device, inode, size, mtime and ctime (nanoseconds) of
the file a read of its path reaches. Any write changes ctime, which no unprivileged tool can
set back; a file replaced by another (renamed over, restored with its old mtime) has another
inode, and an inode number means something only on its own device. A key match is as good as
a re-read for the question "is this the file that was seen". An entry that is missing,
damaged or cannot be written only costs a re-read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from snapctl.models import StrictModel
from snapctl.protocol.atomic import replace_file

StatKey = list[int]  # [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns]
# An entry names its files and keys and one short value: far below this for any real image.
MAX_ENTRY_BYTES = 16 << 20


def stat_key(st: os.stat_result) -> StatKey:
    """The key of one file (see the module docstring)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def path_key(path: str | Path) -> StatKey:
    """The key of the file ``path`` reaches now (following links, as a read does); raises
    ``OSError`` when it cannot be stat'ed."""
    return stat_key(os.stat(path))


class CacheEntry(StrictModel):
    """One entry on disk: ``value`` holds while every file in ``files`` still has its key."""

    name: str
    files: dict[str, StatKey]
    value: str


class FileCache:
    """Entries under ``directory``, one file each, named by a digest of the entry's name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def entry_path(self, name: str) -> Path:
        digest = hashlib.sha256(name.encode(errors="surrogateescape")).hexdigest()
        return self.directory / f"{digest}.json"

    def lookup(self, name: str, files: Mapping[str, StatKey]) -> str | None:
        """The value remembered under ``name`` for exactly ``files`` with exactly these keys,
        else None (nothing remembered, a file changed, or a damaged entry)."""
        try:
            with self.entry_path(name).open("rb") as handle:
                data = handle.read(MAX_ENTRY_BYTES + 1)
            entry = CacheEntry.model_validate_json(data)
        except (OSError, ValidationError):
            return None
        if entry.name != name or entry.files != dict(files):
            return None
        return entry.value

    def remember(self, name: str, files: Mapping[str, StatKey], value: str) -> None:
        """Remember ``value`` for ``files`` as they are keyed now; best effort: a cache that
        cannot be written only costs a re-read next time."""
        entry = CacheEntry(name=name, files=dict(files), value=value)
        with contextlib.suppress(OSError):
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            replace_file(self.entry_path(name), entry.model_dump_json().encode())
