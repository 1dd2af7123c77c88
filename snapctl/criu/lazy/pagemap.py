"""Which memory a lazy restore leaves to the lazy-pages daemon: a per-copy view of an image in
which only big runs of memory stay lazy and everything else is restored eagerly.

Why: CRIU 4.2.1's lazy-pages daemon is one loop that serves page faults between the chunks of
its background transfer (up to 1 MiB each), and a chunk shrinks only after a fault of the process
being streamed. So every page fault of a restored server waits for a chunk: the faults of the
handshake and the first request (interpreter heap, arenas, stacks: a few MB) add tens of
milliseconds, and far more when the frontend's faults queue behind the engine's stream
(docs/lazy.md, step 2). What a restored server touches first is its small memory: the heap, the
interpreter's arenas, thread stacks. What makes a restore slow is its big memory: model weights,
KV or pinned buffers, device memory saved by cuda-checkpoint, each one long contiguous run. So:

- a process with less than ``EAGER_PROCESS_BELOW`` (:mod:`.tuning`) of lazy memory is restored
  whole (the frontend and helpers: nothing to gain, and each of their faults would wait for a
  chunk);
- in the others, every run of contiguous lazy pages shorter than ``EAGER_RUN_BELOW`` is
  restored eagerly too, so only the big runs are left to the daemon;
- but where copies of the process learned its working set (:mod:`.workingset`), exactly
  that is restored eagerly, and where the copy is to learn it, nothing.

How: ``pagemap-PID.img`` flags each entry (at most 1 MiB of pages) ``PE_LAZY``; without that flag
``criu restore --lazy-pages`` reads the pages itself and the daemon skips them. The view is a
directory of relative symbolic links to the (verified) image's files plus rewritten pagemap
files; the image itself is never changed. The format is CRIU's image format: two 32-bit magics, then
entries framed by a 32-bit little-endian length, each a proto2 message from
``images/pagemap.proto`` with varint fields only (a ``pagemap_head``, then ``pagemap_entry``:
vaddr 1, compat_nr_pages 2, in_parent 3, flags 4, nr_pages 5).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import os
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.tuning import EAGER_PROCESS_BELOW, EAGER_RUN_BELOW
from snapctl.criu.lazy.workingset import (
    PageRun,
    WorkingSet,
    learnable,
    pagemap_key,
    working_set_path,
)
from snapctl.criu.wire import encode_varint, read_varint
from snapctl.errors import SnapctlError
from snapctl.models import StrictModel
from snapctl.protocol.atomic import replace_file

PAGE_SIZE = 4096
_MAGICS = (0x54564319, 0x56084025)  # IMG_COMMON_MAGIC, PAGEMAP_MAGIC
_VADDR, _COMPAT_NR_PAGES, _FLAGS, _NR_PAGES = 1, 2, 4, 5
PE_LAZY = 1 << 1


class PagemapError(SnapctlError):
    """A pagemap image this module cannot read (not CRIU's pagemap format as it knows it)."""


@dataclass(frozen=True)
class Entry:
    """One ``pagemap_entry``: ``nr_pages`` pages from ``vaddr``; ``flags_at`` is the offset of
    its flags' (one-byte) value in the file, -1 when it has no flags field; ``start`` and
    ``stop`` the file offsets of its message (after its length)."""

    vaddr: int
    nr_pages: int
    flags: int
    flags_at: int
    start: int = -1
    stop: int = -1

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


@dataclass(frozen=True)
class Pagemap:
    """One process's pagemap image: its bytes and its entries."""

    data: bytes
    entries: list[Entry]

    @property
    def lazy_bytes(self) -> int:
        """How much of the process's memory is left to the lazy-pages daemon."""
        return sum(e.nr_pages for e in self.entries if e.lazy) * PAGE_SIZE

    def lazy_runs(self) -> list[list[Entry]]:
        """The lazy entries grouped into runs of contiguous addresses."""
        runs: list[list[Entry]] = []
        for entry in self.entries:
            if not entry.lazy:
                continue
            if runs and runs[-1][-1].end == entry.vaddr:
                runs[-1].append(entry)
            else:
                runs.append([entry])
        return runs

    def with_eager(self, entries: list[Entry]) -> bytes:
        """These bytes with ``PE_LAZY`` cleared on ``entries`` (in place: flags are a one-byte
        varint, so no length changes)."""
        out = bytearray(self.data)
        for entry in entries:
            if entry.flags_at < 0 or out[entry.flags_at] != entry.flags or entry.flags >= 0x80:
                raise PagemapError(f"entry at {entry.vaddr:#x} has no one-byte flags")
            out[entry.flags_at] = entry.flags & ~PE_LAZY
        return bytes(out)

    def with_eager_pages(self, eager: dict[int, list[tuple[int, int]]]) -> bytes:
        """These bytes with ``PE_LAZY`` cleared on some pages only: ``eager`` maps an entry's
        index to the ``(first page, count)`` ranges within it (sorted, disjoint) to restore
        eagerly. Such an entry becomes several consecutive ones, eager and lazy pieces in
        address order with the same pages in total, so every later entry's pages stay where
        they are in the pages image (CRIU reads them at the running sum of ``nr_pages``)."""
        out = bytearray(self.data[: self.entries[0].start - 4] if self.entries else self.data)
        for index, entry in enumerate(self.entries):
            ranges = eager.get(index)
            if not ranges:
                out += self.data[entry.start - 4 : entry.stop]
                continue
            fields = _fields(self.data[entry.start : entry.stop])
            at = 0
            for first, count in ranges:
                if first > at:
                    out += _piece(fields, entry, at, first - at, lazy=True)
                out += _piece(fields, entry, first, count, lazy=False)
                at = first + count
            if at < entry.nr_pages:
                out += _piece(fields, entry, at, entry.nr_pages - at, lazy=True)
        return bytes(out)


def _fields(message: bytes) -> list[tuple[int, int]]:
    """A message of varint fields as (field number, value) in file order (the slow, general
    decoder: only for the few entries split)."""
    fields: list[tuple[int, int]] = []
    at = 0
    while at < len(message):
        key, at = read_varint(message, at)
        if key & 7:
            raise PagemapError(f"field {key >> 3} is not a varint")
        value, at = read_varint(message, at)
        fields.append((key >> 3, value))
    return fields


def _piece(
    fields: list[tuple[int, int]], entry: Entry, first: int, count: int, *, lazy: bool
) -> bytes:
    """Entry ``entry`` cut to ``count`` pages from its page ``first``, framed, with every other
    field as it was."""
    flags = entry.flags | PE_LAZY if lazy else entry.flags & ~PE_LAZY
    # The count is in nr_pages, or in compat_nr_pages in images without it.
    count_field = _NR_PAGES if any(f == _NR_PAGES and v for f, v in fields) else _COMPAT_NR_PAGES
    body = bytearray()
    for number, value in fields:
        if number == _VADDR:
            value = entry.vaddr + first * PAGE_SIZE
        elif number == _FLAGS:
            value = flags
        elif number == count_field:
            value = count
        body += encode_varint(number << 3)
        body += encode_varint(value)
    return struct.pack("<I", len(body)) + bytes(body)


def read_pagemap(path: Path, data: bytes | None = None) -> Pagemap:
    """Parse ``path`` (whose bytes are ``data`` when already read); :class:`PagemapError` if it
    is not a pagemap image as CRIU 4.2 writes it."""
    data = path.read_bytes() if data is None else data
    try:
        return Pagemap(data, _entries(data))
    except (ValueError, IndexError) as error:
        reason = "truncated varint" if isinstance(error, IndexError) else str(error)
        raise PagemapError(f"cannot read {path.name}: {reason}", path=path) from error


def _entries(data: bytes) -> list[Entry]:
    # Hand-inlined varints: a big process has one entry per MiB, and this runs on the path to a
    # lazy copy's first response (the generic decoder took twice as long; docs/lazy.md, step 2).
    if len(data) < 8 or struct.unpack_from("<II", data) != _MAGICS:
        raise ValueError("not a CRIU pagemap image")
    entries: list[Entry] = []
    size_of = struct.Struct("<I").unpack_from
    at, total, first = 8, len(data), True
    while at < total:
        if at + 4 > total:
            raise ValueError("truncated entry length")
        end = at + 4 + size_of(data, at)[0]
        at += 4
        start = at
        if end > total:
            raise ValueError("truncated entry")
        vaddr = nr_pages = compat = flags = 0
        flags_at = -1
        while at < end:
            key = data[at]
            if key & 7 or key >= 0x80:
                raise ValueError(f"field {key >> 3} is not a varint")
            at += 1
            value = shift = 0
            while True:
                if at >= end:
                    raise ValueError("truncated varint")
                byte = data[at]
                at += 1
                value |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                shift += 7
            field = key >> 3
            if field == _VADDR:
                vaddr = value
            elif field == _FLAGS:
                flags, flags_at = value, at - 1
            elif field == _NR_PAGES:
                nr_pages = value
            elif field == _COMPAT_NR_PAGES:
                compat = value
        if not first:
            entries.append(Entry(vaddr, nr_pages or compat, flags, flags_at, start, end))
        first = False
    return entries


def eager_entries(
    pagemap: Pagemap,
    process_below: int = EAGER_PROCESS_BELOW,
    run_below: int = EAGER_RUN_BELOW,
) -> list[Entry]:
    """The lazy entries this module restores eagerly: all of a process with less than
    ``process_below`` lazy bytes, else those in runs shorter than ``run_below``."""
    runs = pagemap.lazy_runs()
    if pagemap.lazy_bytes < process_below:
        return [entry for run in runs for entry in run]
    short = (run for run in runs if sum(e.nr_pages for e in run) * PAGE_SIZE < run_below)
    return [entry for run in short for entry in run]


def touched_ranges(
    pagemap: Pagemap, touched: Sequence[PageRun]
) -> dict[int, list[tuple[int, int]]]:
    """For :meth:`Pagemap.with_eager_pages`: the pages of ``touched`` (runs, sorted and apart,
    as :class:`WorkingSet` keeps them) that are in lazy entries, as ranges within each entry,
    by entry index."""
    starts = [start for start, _ in touched]
    ranges: dict[int, list[tuple[int, int]]] = {}
    for index, entry in enumerate(pagemap.entries):
        if not entry.lazy or entry.flags_at < 0:
            continue
        first = entry.vaddr // PAGE_SIZE
        end = first + entry.nr_pages
        at = max(bisect.bisect_right(starts, first) - 1, 0)
        pieces: list[tuple[int, int]] = []
        while at < len(touched) and touched[at][0] < end:
            start, count = touched[at]
            low, high = max(start, first), min(start + count, end)
            if low < high:
                pieces.append((low - first, high - low))
            at += 1
        if pieces:
            ranges[index] = pieces
    return ranges


class ViewSummary(StrictModel):
    """What a view left lazy and what it made eager, in bytes (of one process or of all), in
    how many processes the eager pages were a learned working set, and in how many all was
    left lazy for the copy to learn one."""

    eager_bytes: int = 0
    lazy_bytes: int = 0
    learned_processes: int = 0
    learning_processes: int = 0

    @property
    def holds_transfer(self) -> bool:
        """Whether the background transfer waits until the copy is ready: with much memory
        left lazy, or where a working set was learned or is being learned (what the copy
        touches is then page faults, which must not wait behind the transfer's chunks)."""
        return (
            self.lazy_bytes >= tuning.HOLD_TRANSFER_MIN_BYTES
            or self.learned_processes > 0
            or self.learning_processes > 0
        )

    def __add__(self, other: ViewSummary) -> ViewSummary:
        return ViewSummary(
            eager_bytes=self.eager_bytes + other.eager_bytes,
            lazy_bytes=self.lazy_bytes + other.lazy_bytes,
            learned_processes=self.learned_processes + other.learned_processes,
            learning_processes=self.learning_processes + other.learning_processes,
        )


def lazy_view(
    images_dir: Path,
    target: Path,
    process_below: int = EAGER_PROCESS_BELOW,
    run_below: int = EAGER_RUN_BELOW,
    cache_dir: Path | None = None,
    omit: Collection[str] = (),
) -> ViewSummary:
    """Create ``target``: ``images_dir`` seen through symbolic links, except for the pagemaps
    that :func:`eager_entries` changes, which are rewritten copies, and the files named in
    ``omit``, which CRIU then finds missing (for :mod:`snapctl.criu.lazy.netdumps`).

    With ``cache_dir``, a pagemap is parsed only the first time its content is seen: the
    outcome is kept there under the sha256 of that content (and the thresholds), so later
    views of the same image cost a hash per pagemap (a big process has one entry per MiB to
    parse). Where ``cache_dir`` also holds a working set learned for the process
    (:mod:`snapctl.criu.lazy.workingset`), a process not restored whole gets exactly those
    pages eagerly, instead of its short runs; where it holds none yet, the process is left
    all lazy, so that this copy's faults are the whole set (its short runs, restored eagerly,
    would hide their touches, and the set would take a second copy to learn).
    """
    target.mkdir(mode=0o700)
    summary = ViewSummary()
    relative_dir = relative_dir_of(images_dir, target)
    for path in sorted(images_dir.resolve().iterdir()):
        if path.name in omit:
            continue
        link = target / path.name
        if _is_pagemap(path):
            process, rewritten = _process_view(path, process_below, run_below, cache_dir)
            summary += process
            if rewritten is not None:
                _write_new(link, rewritten)
                continue
        link_relative(path, link, relative_dir)
    return summary


def cache_views(
    images_dir: Path,
    cache_dir: Path,
    process_below: int = EAGER_PROCESS_BELOW,
    run_below: int = EAGER_RUN_BELOW,
) -> None:
    """Put what :func:`lazy_view` would make of each pagemap into ``cache_dir`` now: done when a
    copy's working sets changed, off any copy's way, so the next copy's view is a cache hit
    (rewriting a real vLLM's pagemaps for a new set is not free: docs/lazy.md)."""
    for path in sorted(images_dir.resolve().iterdir()):
        if _is_pagemap(path):
            _process_view(path, process_below, run_below, cache_dir)


def _is_pagemap(path: Path) -> bool:
    return path.name.startswith("pagemap-") and path.name.endswith(".img")


def _process_view(
    path: Path, process_below: int, run_below: int, cache_dir: Path | None
) -> tuple[ViewSummary, bytes | None]:
    """One process's part of a view (:func:`_viewed`), from ``cache_dir`` when it is there."""
    data = path.read_bytes()
    content = pagemap_key(data)
    learned = _learned(cache_dir, content) if cache_dir is not None else None
    learning = learned is None and cache_dir is not None and learnable(cache_dir, content)
    key = f"{content}-{process_below}-{run_below}"
    if learned is not None:
        key += f"-learned-{hashlib.sha256(learned).hexdigest()[:32]}"
    if learning:
        key += "-learning"
    found = _cached(cache_dir, key) if cache_dir is not None else None
    if found is None:
        found = _viewed(path, data, process_below, run_below, learned, learning)
        if cache_dir is not None:
            _cache(cache_dir, key, found)
    return found


def link_relative(path: Path, link: Path, relative_dir: str | None = None) -> None:
    """Make ``link`` a symbolic link to ``path`` by a relative target.

    A restored task opens some image files (its pagemap, its pages) after it entered the copy's
    mount namespace, through CRIU's descriptor on the images directory. A relative link
    resolves from there up the host's own mounts, so it reaches the image even where the
    sandbox hides its path (an image under /tmp); an absolute one resolves inside the copy.
    ``relative_dir``: :func:`relative_dir_of` the two directories, when already known (a view
    links a hundred files from one directory into another).
    """
    if relative_dir is None:
        relative_dir = relative_dir_of(path.parent, link.parent)
    os.symlink(os.path.join(relative_dir, path.name), link)


def relative_dir_of(directory: Path, link_dir: Path) -> str:
    """The relative path from ``link_dir`` to ``directory``, for :func:`link_relative`."""
    # The directories resolved, the entry itself not: a link to a link stays one.
    return os.path.relpath(directory.resolve(), link_dir.resolve())


def _learned(cache_dir: Path, key: str) -> bytes | None:
    try:
        return working_set_path(cache_dir, key).read_bytes()
    except OSError:
        return None


def _viewed(
    path: Path, data: bytes, process_below: int, run_below: int,
    learned: bytes | None = None, learning: bool = False,
) -> tuple[ViewSummary, bytes | None]:  # fmt: skip
    """What one pagemap leaves lazy and makes eager, and its rewritten bytes (None: as is);
    ``learned``: the process's working set file, if any; ``learning``: none is known and this
    copy is to learn one, so a process not restored whole is left all lazy."""
    pagemap = read_pagemap(path, data)
    touched = None
    if learned is not None and pagemap.lazy_bytes >= process_below:
        with contextlib.suppress(ValidationError):
            touched = WorkingSet.model_validate_json(learned).runs
    if touched is not None:
        ranges = touched_ranges(pagemap, touched)
        eager = sum(count for pieces in ranges.values() for _, count in pieces) * PAGE_SIZE
        summary = ViewSummary(
            eager_bytes=eager, lazy_bytes=pagemap.lazy_bytes - eager, learned_processes=1
        )
        return summary, pagemap.with_eager_pages(ranges) if ranges else None
    if learning and pagemap.lazy_bytes >= process_below:
        return ViewSummary(lazy_bytes=pagemap.lazy_bytes, learning_processes=1), None
    made_eager = eager_entries(pagemap, process_below, run_below)
    eager = sum(e.nr_pages for e in made_eager) * PAGE_SIZE
    summary = ViewSummary(eager_bytes=eager, lazy_bytes=pagemap.lazy_bytes - eager)
    return summary, pagemap.with_eager(made_eager) if made_eager else None


def _cached(cache_dir: Path, key: str) -> tuple[ViewSummary, bytes | None] | None:
    try:
        summary = ViewSummary.model_validate_json((cache_dir / f"{key}.json").read_bytes())
        rewritten = cache_dir / f"{key}.img"
        return summary, rewritten.read_bytes() if rewritten.exists() else None
    except (OSError, ValidationError):
        return None


def _cache(cache_dir: Path, key: str, found: tuple[ViewSummary, bytes | None]) -> None:
    # Best effort (a cache), atomic (concurrent copies): the rewritten pagemap first, then the
    # summary that makes the entry count.
    summary, rewritten = found
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
        if rewritten is not None:
            replace_file(cache_dir / f"{key}.img", rewritten, mode=0o600)
        replace_file(cache_dir / f"{key}.json", summary.model_dump_json().encode(), mode=0o600)


def _write_new(path: Path, data: bytes) -> None:
    # A new file only: an existing name (a link into the image) fails instead of being written
    # through, so the view can never change the image it points at.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
