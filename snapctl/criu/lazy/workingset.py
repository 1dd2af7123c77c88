"""The pages a lazy copy touches on its way to ready, learned from the copies of the same image
before it, so that the next copy restores exactly those eagerly and leaves all else lazy.

Why: a restored server's recovery and first requests touch a small part of its small memory,
scattered (a real vLLM's three processes: the interpreters' heaps and arenas, thread
stacks), and CRIU 4.2.1's daemon serves each such touch as one page fault, a round trip through
one single-threaded process (on a busy host, a scheduling delay each). Restoring all the small
memory eagerly instead (:mod:`.pagemap`'s rule without a working set) costs a restore in
proportion to it, most of which a real vLLM's copy never touches (docs/lazy.md, step 2). The
addresses a copy touches are the same from copy to copy (CRIU restores the same layout, and
the recovery runs the same code on the same heap), so what one copy faulted in, the next gets
eagerly.

How: the daemon's log (info level) has a line ``prPID-N Read ADDR 1 pages`` for each page
fault it served, with its time since the daemon started; the background transfer reads runs of
pages, and a run of one page at most marks one page too many. When a copy's pages are complete
(:class:`~snapctl.criu.lazy.transfer.LazyTransfer`), the pages faulted until its transfer was
released (the copy was ready and had a head start for its first request,
:data:`~snapctl.criu.lazy.tuning.TRANSFER_AFTER_READY_S`) are added to its processes' working
sets, kept beside the view cache under the sha256 of each process's pagemap: a different image,
or a changed process, has a different key, so a set never applies to memory it was not learned
on. The first copy of a process learns its whole set alone: with no set known, its view leaves
the process all lazy (:mod:`.pagemap`), so every page it touches is a fault; a process whose
copies touch too scattered a set is marked ``<key>.scattered``, and its next copies get the
short-run rule again. Nothing here is needed for correctness: a page missing from the set is
a fault, a page in it that the copy does not touch is a page restored early.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import NonNegativeInt, PositiveInt, ValidationError

from snapctl.criu.lazy.tuning import WORKING_SET_MAX_RUNS, WORKING_SET_MIN_GROWTH
from snapctl.models import StrictModel
from snapctl.protocol.atomic import replace_file

PAGE_SHIFT = 12
_FAULT = re.compile(rb"^\((\d+)\.(\d+)\) pr(\d+)-\d+ Read ([0-9a-f]+) 1 pages$", re.MULTILINE)


# A run of pages: the first (address / page size) and how many.
PageRun = tuple[int, int]


class WorkingSet(StrictModel):
    """``STATE/views/<pagemap sha256>.touched-runs.json``: the pages that copies of one process
    touched before they were ready, as runs, sorted and apart (a model's weights are a few
    long runs, an interpreter's heap many short ones)."""

    version: Literal[2] = 2
    runs: list[tuple[NonNegativeInt, PositiveInt]]

    @classmethod
    def of_pages(cls, pages: Iterable[int]) -> WorkingSet:
        return cls(runs=page_runs(pages))

    @property
    def page_count(self) -> int:
        return sum(count for _, count in self.runs)


def page_runs(pages: Iterable[int]) -> list[PageRun]:
    """``pages`` (any order, repeats allowed) as sorted runs, each apart from the next."""
    runs: list[PageRun] = []
    for page in sorted(set(pages)):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def union_runs(first: list[PageRun], second: list[PageRun]) -> list[PageRun]:
    """The pages of two lists of runs (each sorted), as runs again."""
    merged: list[PageRun] = []
    for start, count in sorted(first + second):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            last_start, last_count = merged[-1]
            merged[-1] = (last_start, max(last_count, start + count - last_start))
        else:
            merged.append((start, count))
    return merged


def working_set_path(cache_dir: Path, pagemap_key: str) -> Path:
    # Named for its format: sets and marks kept by earlier versions (page lists, and marks
    # of sets too big to learn) are never read as today's.
    return cache_dir / f"{pagemap_key}.touched-runs.json"


def unlearnable_path(cache_dir: Path, pagemap_key: str) -> Path:
    return cache_dir / f"{pagemap_key}.scattered"


def learnable(cache_dir: Path, key: str) -> bool:
    """Whether a copy of the process whose pagemap has ``key`` may learn its working set: not
    when one of its copies touched too much for a set (:func:`add_pages`)."""
    return not unlearnable_path(cache_dir, key).exists()


def pagemap_key(data: bytes) -> str:
    """A process's pagemap as the view cache and the working sets know it."""
    return hashlib.sha256(data).hexdigest()


def read_working_set(cache_dir: Path, key: str) -> frozenset[int] | None:
    """The learned pages of the process whose pagemap has ``key``; None if none (or unreadable:
    a cache)."""
    found = read_runs(cache_dir, key)
    if found is None:
        return None
    return frozenset(page for start, count in found.runs for page in range(start, start + count))


def read_runs(cache_dir: Path, key: str) -> WorkingSet | None:
    """The learned set of the process whose pagemap has ``key``, as runs; None if none."""
    try:
        return WorkingSet.model_validate_json(working_set_path(cache_dir, key).read_bytes())
    except (OSError, ValidationError):
        return None  # none, or one written in an earlier format: learned again


def faulted_pages(log: bytes, until_s: float) -> dict[int, set[int]]:
    """From a lazy-pages daemon's log: the pages each process (by its PID in the image) faulted
    in the daemon's first ``until_s`` seconds."""
    pages: dict[int, set[int]] = {}
    for match in _FAULT.finditer(log):
        seconds, fraction, pid, address = match.groups()
        if float(seconds + b"." + fraction) > until_s:
            break  # the log is in time order
        pages.setdefault(int(pid), set()).add(int(address, 16) >> PAGE_SHIFT)
    return pages


def record_working_sets(images_dir: Path, cache_dir: Path, log_path: Path, until_s: float) -> int:
    """Add what the daemon logged at ``log_path`` until ``until_s`` to the working sets of the
    image's processes in ``cache_dir``; the number of pages new to them. Best effort (a cache):
    an unreadable log or image learns nothing, a concurrent copy's addition may be lost."""
    try:
        faulted = faulted_pages(log_path.read_bytes(), until_s)
    except OSError:
        return 0
    added = 0
    for pid, pages in faulted.items():
        with contextlib.suppress(OSError):
            key = pagemap_key((images_dir / f"pagemap-{pid}.img").read_bytes())
            added += add_pages(cache_dir, key, pages)
    return added


def add_pages(cache_dir: Path, key: str, pages: Iterable[int]) -> int:
    """Add ``pages`` to the working set of the process whose pagemap has ``key``; the number
    new to it (0 when too few to be worth a new view, or too many to be a working set)."""
    known = read_runs(cache_dir, key) or WorkingSet(runs=[])
    union = WorkingSet(runs=union_runs(known.runs, page_runs(pages)))
    new = union.page_count - known.page_count
    if new <= known.page_count * WORKING_SET_MIN_GROWTH:
        # Nothing new, or too little to be worth a new view (each set has its own cached
        # pagemap, made once): the few pages a copy misses stay page faults.
        return 0
    cache_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    if len(union.runs) > WORKING_SET_MAX_RUNS:
        # Touches too scattered to be worth a view of their own: keep what was learned, or,
        # with nothing learned yet, stop the next copies learning (each would fault all of
        # it in a page at a time).
        if not known.runs:
            replace_file(unlearnable_path(cache_dir, key), b"", mode=0o600)
        return 0
    replace_file(working_set_path(cache_dir, key), union.model_dump_json().encode(), mode=0o600)
    return new
