"""Which memory a lazy restore leaves to the lazy-pages daemon: a per-copy view of an image in
which every process with little lazy memory is restored eagerly by ``criu restore``.

Why: CRIU 4.2.1's lazy-pages daemon is one loop that serves page faults between the chunks of
its background transfer (up to 1 MiB each), and a chunk shrinks only after a fault of the process
being streamed. While it streams a big process (the engine's GiB), each fault of another process
(the frontend's) waits for one chunk: measured at 2 GiB retained, the frontend's ~460 recovery
faults then took ~0.6 s instead of ~30 ms, in about a third of lazy copies (whichever process
CRIU happens to hand over first is streamed first). A process with little memory gains nothing
from a lazy restore, so processes below :data:`EAGER_BELOW_BYTES` are restored whole and the
daemon serves only the big ones, whose own faults shrink their own chunks.

How: ``pagemap-PID.img`` flags each run of pages ``PE_LAZY``; without that flag ``criu restore
--lazy-pages`` reads the pages itself and the daemon skips them. The view is a directory of
symbolic links to the (verified) image's files plus rewritten pagemap files of the small
processes; the image itself is never changed. The format is CRIU's image format: two 32-bit
magics, then entries framed by a 32-bit little-endian length, each a proto2 message from
``images/pagemap.proto`` with varint fields only (a ``pagemap_head``, then ``pagemap_entry``:
vaddr 1, compat_nr_pages 2, in_parent 3, flags 4, nr_pages 5).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

from snapctl.criu.wire import read_varint
from snapctl.errors import SnapctlError

# Below this much lazy memory a process is restored eagerly (about 50 ms of restore on this VM).
EAGER_BELOW_BYTES = 64 * 1024 * 1024
PAGE_SIZE = 4096
_MAGICS = (0x54564319, 0x56084025)  # IMG_COMMON_MAGIC, PAGEMAP_MAGIC
_VADDR, _COMPAT_NR_PAGES, _FLAGS, _NR_PAGES = 1, 2, 4, 5
PE_LAZY = 1 << 1


class PagemapError(SnapctlError):
    """A pagemap image this module cannot read (not CRIU's pagemap format as it knows it)."""


def _entries(data: bytes) -> Iterator[tuple[dict[int, int], int | None]]:
    """Every ``pagemap_entry`` (the head skipped): its fields, and the offset of its flags'
    value byte (None without flags)."""
    if len(data) < 8 or struct.unpack_from("<II", data) != _MAGICS:
        raise ValueError("not a CRIU pagemap image")
    at, first = 8, True
    while at < len(data):
        if at + 4 > len(data):
            raise ValueError("truncated entry length")
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        end = at + size
        if end > len(data):
            raise ValueError("truncated entry")
        fields: dict[int, int] = {}
        flags_at = None
        while at < end:
            key, at = read_varint(data, at, end)
            if key & 7 != 0:
                raise ValueError(f"field {key >> 3} is not a varint")
            if key >> 3 == _FLAGS:
                flags_at = at
            fields[key >> 3], at = read_varint(data, at, end)
        if not first:
            yield fields, flags_at
        first = False


def _read(path: Path) -> tuple[bytes, Iterator[tuple[dict[int, int], int | None]]]:
    data = path.read_bytes()
    return data, _checked(path, _entries(data))


def _checked(
    path: Path, entries: Iterator[tuple[dict[int, int], int | None]]
) -> Iterator[tuple[dict[int, int], int | None]]:
    try:
        yield from entries
    except ValueError as error:
        raise PagemapError(f"cannot read {path.name}: {error}", path=path) from error


def lazy_bytes(path: Path, stop_at: int | None = None) -> int:
    """How much of one process's memory its pagemap leaves to the lazy-pages daemon (counting
    stops once ``stop_at`` is reached: a big process's pagemap need not be read to its end)."""
    _, entries = _read(path)
    total = 0
    for fields, _ in entries:
        if fields.get(_FLAGS, 0) & PE_LAZY:
            total += (fields.get(_NR_PAGES) or fields.get(_COMPAT_NR_PAGES, 0)) * PAGE_SIZE
            if stop_at is not None and total >= stop_at:
                break
    return total


def without_lazy(path: Path) -> bytes:
    """The pagemap at ``path`` with no page left lazy (every entry's ``PE_LAZY`` cleared in
    place: flags are a one-byte varint, so no length changes)."""
    data, entries = _read(path)
    out = bytearray(data)
    for fields, flags_at in entries:
        flags = fields.get(_FLAGS, 0)
        if flags & PE_LAZY:
            assert flags_at is not None and out[flags_at] == flags < 0x80
            out[flags_at] = flags & ~PE_LAZY
    return bytes(out)


def eager_small_view(images_dir: Path, target: Path, eager_below: int = EAGER_BELOW_BYTES) -> int:
    """Create ``target``: ``images_dir`` seen through symbolic links, except that the pagemap of
    every process with less than ``eager_below`` bytes of lazy memory leaves nothing lazy.
    Returns how many bytes were made eager."""
    target.mkdir(mode=0o700)
    eager = 0
    # Absolute targets: a relative link would resolve against ``target``, not the image.
    for path in sorted(images_dir.absolute().iterdir()):
        link = target / path.name
        if path.name.startswith("pagemap-") and path.name.endswith(".img"):
            lazy = lazy_bytes(path, stop_at=eager_below)
            if 0 < lazy < eager_below:
                _write_new(link, without_lazy(path))
                eager += lazy
                continue
        os.symlink(path, link)
    return eager


def _write_new(path: Path, data: bytes) -> None:
    # A new file only: an existing name (a link into the image) fails instead of being written
    # through, so the view can never change the image it points at.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
