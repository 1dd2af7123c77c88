"""The lazy view of an image: small processes and short runs lose PE_LAZY, the rest is linked."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from snapctl.activation.restore import learn_working_sets
from snapctl.criu.lazy import pagemap as pagemap_module
from snapctl.criu.lazy.pagemap import (
    PAGE_SIZE,
    PE_LAZY,
    PagemapError,
    ViewSummary,
    eager_entries,
    lazy_view,
    read_pagemap,
)
from snapctl.criu.lazy.workingset import (
    WorkingSet,
    pagemap_key,
    unlearnable_path,
    working_set_path,
)

PE_PRESENT = 1 << 2
MAGICS = struct.pack("<II", 0x54564319, 0x56084025)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def message(*fields: tuple[int, int]) -> bytes:
    body = b"".join(varint(number << 3) + varint(value) for number, value in fields)
    return struct.pack("<I", len(body)) + body


def pagemap(*entries: tuple[int, int, int]) -> bytes:
    """A pagemap image as CRIU 4.2 writes it: head, then (vaddr, nr_pages, flags) entries with
    compat_nr_pages 0 and the count in nr_pages."""
    head = message((1, 3))
    return MAGICS + head + b"".join(message((1, v), (2, 0), (4, f), (5, n)) for v, n, f in entries)


LAZY = PE_LAZY | PE_PRESENT
MIB_PAGES = 256
# A small process: 266 lazy pages in two contiguous entries.
SMALL = pagemap((0x1000, 1, PE_PRESENT), (0x7F0000000000, 256, LAZY), (0x7F0000100000, 10, LAZY))
# A big process: a 3-entry run of 3 MiB (a buffer), a 2-page run (heap), and a non-lazy entry.
BIG_RUN = [(0x7E0000000000 + i * 2**20, MIB_PAGES, LAZY) for i in range(3)]
BIG = pagemap((0x1000, 1, PE_PRESENT), (0x2000, 2, LAZY), *BIG_RUN)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def test_read_pagemap_reads_every_entry_but_the_head(tmp_path: Path) -> None:
    entries = read_pagemap(write(tmp_path, "pagemap-1.img", BIG)).entries
    assert [(e.vaddr, e.nr_pages, e.flags) for e in entries] == [
        (0x1000, 1, PE_PRESENT), (0x2000, 2, LAZY), *BIG_RUN,
    ]  # fmt: skip
    assert BIG[entries[1].flags_at] == LAZY


def test_compat_nr_pages_counts_when_nr_pages_is_absent(tmp_path: Path) -> None:
    old = MAGICS + message((1, 3)) + message((1, 0x1000), (2, 7), (4, LAZY))
    assert read_pagemap(write(tmp_path, "pagemap-1.img", old)).lazy_bytes == 7 * PAGE_SIZE


def test_lazy_runs_split_where_addresses_are_not_contiguous(tmp_path: Path) -> None:
    pagemap_ = read_pagemap(write(tmp_path, "pagemap-1.img", BIG))
    assert [[e.vaddr for e in run] for run in pagemap_.lazy_runs()] == [
        [0x2000], [v for v, _, _ in BIG_RUN],
    ]  # fmt: skip
    assert pagemap_.lazy_bytes == (2 + 3 * MIB_PAGES) * PAGE_SIZE


def test_a_small_process_is_eager_whole(tmp_path: Path) -> None:
    pagemap_ = read_pagemap(write(tmp_path, "pagemap-1.img", SMALL))
    eager = eager_entries(pagemap_, process_below=300 * PAGE_SIZE, run_below=PAGE_SIZE)
    assert [e.vaddr for e in eager] == [0x7F0000000000, 0x7F0000100000]


def test_a_big_process_keeps_only_its_long_runs_lazy(tmp_path: Path) -> None:
    pagemap_ = read_pagemap(write(tmp_path, "pagemap-4.img", BIG))
    # The 3 MiB run is one run although each of its entries is only 1 MiB.
    eager = eager_entries(pagemap_, process_below=PAGE_SIZE, run_below=2 * 2**20)
    assert [e.vaddr for e in eager] == [0x2000]
    assert eager_entries(pagemap_, process_below=PAGE_SIZE, run_below=4 * 2**20) == [
        e for e in pagemap_.entries if e.lazy
    ]


def test_with_eager_clears_the_flag_and_keeps_everything_else(tmp_path: Path) -> None:
    pagemap_ = read_pagemap(write(tmp_path, "pagemap-1.img", SMALL))
    eager = pagemap_.with_eager(pagemap_.entries[1:2])
    expected = pagemap(
        (0x1000, 1, PE_PRESENT), (0x7F0000000000, 256, PE_PRESENT), (0x7F0000100000, 10, LAZY)
    )
    assert eager == expected
    assert read_pagemap(write(tmp_path, "eager.img", eager)).lazy_bytes == 10 * PAGE_SIZE


def test_view_rewrites_what_it_makes_eager_and_links_the_rest(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    write(image, "pagemap-1.img", SMALL)
    write(image, "pagemap-4.img", BIG)
    write(image, "pagemap-5.img", pagemap((0x1000, 1, PE_PRESENT)))
    write(image, "pages-1.img", b"\0" * PAGE_SIZE)
    write(image, "core-1.img", b"core")
    view = tmp_path / "view"
    summary = lazy_view(image, view, process_below=300 * PAGE_SIZE, run_below=2 * 2**20)
    assert summary == ViewSummary(eager_bytes=268 * PAGE_SIZE, lazy_bytes=3 * 2**20)
    assert sorted(p.name for p in view.iterdir()) == sorted(p.name for p in image.iterdir())
    assert read_pagemap(view / "pagemap-1.img").lazy_bytes == 0
    assert read_pagemap(view / "pagemap-4.img").lazy_bytes == 3 * 2**20
    for name in ("pagemap-5.img", "pages-1.img", "core-1.img"):
        # Relative, so that it resolves through the host's mounts from inside a copy too.
        assert (view / name).readlink() == Path("..") / "criu" / name
        assert (view / name).resolve() == (image / name).resolve()
    for name in ("pagemap-1.img", "pagemap-4.img"):
        assert not (view / name).is_symlink()
    # The image itself is untouched.
    assert (image / "pagemap-1.img").read_bytes() == SMALL
    assert (image / "pagemap-4.img").read_bytes() == BIG


def test_a_pagemap_it_cannot_read_fails_the_view(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    write(image, "pagemap-1.img", SMALL[:-3])
    with pytest.raises(PagemapError, match=r"pagemap-1\.img: truncated entry"):
        lazy_view(image, tmp_path / "view")
    write(image, "pagemap-1.img", b"\x01\x02\x03\x04" + SMALL[4:])
    with pytest.raises(PagemapError, match="not a CRIU pagemap image"):
        read_pagemap(image / "pagemap-1.img")
    write(image, "pagemap-1.img", MAGICS + message((1, 3)) + struct.pack("<I", 2) + b"\x0a\x00")
    with pytest.raises(PagemapError, match="field 1 is not a varint"):
        read_pagemap(image / "pagemap-1.img")
    write(image, "pagemap-1.img", MAGICS + message((1, 3)) + struct.pack("<I", 2) + b"\x08\x80")
    with pytest.raises(PagemapError, match="truncated varint"):
        read_pagemap(image / "pagemap-1.img")


def test_view_of_a_relative_image_path_links_to_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "criu").mkdir()
    (tmp_path / "criu" / "core-1.img").write_bytes(b"core")
    monkeypatch.chdir(tmp_path)
    lazy_view(Path("criu"), tmp_path / "view")
    assert (tmp_path / "view" / "core-1.img").read_bytes() == b"core"


def test_a_cached_view_is_the_same_without_parsing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    write(image, "pagemap-1.img", SMALL)
    write(image, "pagemap-4.img", BIG)
    write(image, "pagemap-5.img", pagemap((0x1000, 1, PE_PRESENT)))
    cache = tmp_path / "cache"
    first = lazy_view(image, tmp_path / "view-1", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)

    def no_parsing(data: bytes) -> None:
        raise AssertionError("parsed a pagemap whose view is cached")

    monkeypatch.setattr(pagemap_module, "_entries", no_parsing)
    second = lazy_view(image, tmp_path / "view-2", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    assert second == first
    for name in ("pagemap-1.img", "pagemap-4.img", "pagemap-5.img"):
        one, two = tmp_path / "view-1" / name, tmp_path / "view-2" / name
        assert one.is_symlink() == two.is_symlink() and one.read_bytes() == two.read_bytes()
    # Other thresholds are another view; a broken cache entry is not one.
    with pytest.raises(AssertionError, match="parsed"):
        lazy_view(image, tmp_path / "view-3", 300 * PAGE_SIZE, 4 * 2**20, cache_dir=cache)
    for entry in cache.glob("*.json"):
        entry.write_text("{")
    with pytest.raises(AssertionError, match="parsed"):
        lazy_view(image, tmp_path / "view-4", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)


def test_a_learned_working_set_makes_exactly_its_pages_eager(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    write(image, "pagemap-1.img", SMALL)
    write(image, "pagemap-4.img", BIG)
    cache = tmp_path / "cache"
    cache.mkdir()
    buffer = 0x7E0000000000 // PAGE_SIZE
    # Pages 1-2 and 300 of the 3 MiB run, the heap's second page, a page not in any entry.
    touched = [0x2000 // PAGE_SIZE + 1, buffer + 1, buffer + 2, buffer + 300, 0x9999]
    for name, pages in (("pagemap-4.img", touched), ("pagemap-1.img", [0x7F0000000000 >> 12])):
        key = pagemap_key((image / name).read_bytes())
        working_set_path(cache, key).write_text(WorkingSet.of_pages(pages).model_dump_json())
    summary = lazy_view(image, tmp_path / "view", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    # The small process is still restored whole: its set does not apply.
    assert summary == ViewSummary(
        eager_bytes=(266 + 4) * PAGE_SIZE,
        lazy_bytes=(2 + 3 * MIB_PAGES - 4) * PAGE_SIZE,
        learned_processes=1,
    )
    assert summary.holds_transfer
    rewritten = read_pagemap(tmp_path / "view" / "pagemap-4.img")
    pieces = [(e.vaddr, e.nr_pages, e.flags) for e in rewritten.entries]
    base = 0x7E0000000000
    assert pieces == [
        (0x1000, 1, PE_PRESENT),
        (0x2000, 1, LAZY), (0x3000, 1, PE_PRESENT),
        (base, 1, LAZY), (base + PAGE_SIZE, 2, PE_PRESENT), (base + 3 * PAGE_SIZE, 253, LAZY),
        (base + 2**20, 44, LAZY), (base + 2**20 + 44 * PAGE_SIZE, 1, PE_PRESENT),
        (base + 2**20 + 45 * PAGE_SIZE, 211, LAZY),
        (base + 2 * 2**20, MIB_PAGES, LAZY),
    ]  # fmt: skip
    # Every page keeps its place in the pages image: the same pages, in the same order.
    assert sum(n for _, n, _ in pieces) == sum(
        e.nr_pages for e in read_pagemap(image / "pagemap-4.img").entries
    )
    # A changed set is another view; an unreadable one is ignored.
    working_set_path(cache, pagemap_key(BIG)).write_text("{")
    again = lazy_view(image, tmp_path / "view-2", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    assert again == ViewSummary(eager_bytes=268 * PAGE_SIZE, lazy_bytes=3 * 2**20)
    assert not again.holds_transfer


def test_touched_runs_map_to_ranges_within_each_entry_they_cross(tmp_path: Path) -> None:
    big = read_pagemap(write(tmp_path, "pagemap-4.img", BIG))
    buffer = 0x7E0000000000 // PAGE_SIZE
    # A run from the heap's second page into the buffer's start would cross the gap; one
    # across the buffer's first two entries; one page past every entry.
    touched = [(0x2000 // PAGE_SIZE + 1, 1), (buffer + 250, 10), (buffer + 3 * MIB_PAGES, 1)]
    assert pagemap_module.touched_ranges(big, touched) == {
        1: [(1, 1)], 2: [(250, 6)], 3: [(0, 4)],
    }  # fmt: skip
    whole = [(buffer, 3 * MIB_PAGES)]  # a model's weights, read whole by its recovery
    assert pagemap_module.touched_ranges(big, whole) == {i: [(0, MIB_PAGES)] for i in (2, 3, 4)}
    assert pagemap_module.touched_ranges(big, []) == {}


def test_a_process_with_no_set_yet_is_left_all_lazy_for_its_copy_to_learn(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    write(image, "pagemap-1.img", SMALL)
    write(image, "pagemap-4.img", BIG)
    cache = tmp_path / "cache"
    summary = lazy_view(image, tmp_path / "view", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    # The small process is restored whole as ever; the big one's heap stays lazy too, so that
    # its touches are faults, which the daemon serves at once: the transfer is held.
    assert summary == ViewSummary(
        eager_bytes=266 * PAGE_SIZE,
        lazy_bytes=(2 + 3 * MIB_PAGES) * PAGE_SIZE,
        learning_processes=1,
    )
    assert summary.holds_transfer
    assert (tmp_path / "view" / "pagemap-4.img").is_symlink()
    # Once its set is known, the copies restore that; without a cache there is nothing to
    # learn into, and a process marked unlearnable gets the short-run rule.
    key = pagemap_key(BIG)
    working_set_path(cache, key).write_text(WorkingSet.of_pages([0x2000 >> 12]).model_dump_json())
    learned = lazy_view(image, tmp_path / "view-2", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    assert (learned.learned_processes, learned.learning_processes) == (1, 0)
    short_runs = ViewSummary(eager_bytes=268 * PAGE_SIZE, lazy_bytes=3 * 2**20)
    assert lazy_view(image, tmp_path / "view-3", 300 * PAGE_SIZE, 2 * 2**20) == short_runs
    working_set_path(cache, key).unlink()
    unlearnable_path(cache, key).write_bytes(b"")
    marked = lazy_view(image, tmp_path / "view-4", 300 * PAGE_SIZE, 2 * 2**20, cache_dir=cache)
    assert marked == short_runs
    assert not marked.holds_transfer


def test_a_copy_that_changed_a_working_set_leaves_the_next_copy_its_view_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    # Big enough for the default thresholds, which copies use: a heap page run and 65 MiB.
    buffer = [(0x7E0000000000 + i * 2**20, MIB_PAGES, LAZY) for i in range(65)]
    big = pagemap((0x2000, 2, LAZY), *buffer)
    write(image, "pagemap-4.img", big)
    cache = tmp_path / "cache"
    log = tmp_path / "lazy-pages.log"
    # What the daemon served as faults: a heap page, then (too late to count) a buffer page.
    log.write_bytes(
        b"(0.100000) pr4-1 Read 2000 1 pages\n(0.200000) pr4-1 Read 7e0000000000 1 pages\n"
    )
    learn_working_sets(image, cache, log, 0.15)
    assert working_set_path(cache, pagemap_key(big)).exists()

    def not_again(*args: object) -> None:
        raise AssertionError("the view was rewritten, not taken from the cache")

    monkeypatch.setattr(pagemap_module, "_viewed", not_again)
    summary = lazy_view(image, tmp_path / "view", cache_dir=cache)
    assert summary == ViewSummary(
        eager_bytes=PAGE_SIZE, lazy_bytes=(1 + 65 * MIB_PAGES) * PAGE_SIZE, learned_processes=1
    )
    # Nothing learned (the faults came later), nothing made.
    learn_working_sets(image, tmp_path / "cache-2", log, 0.05)
    assert not (tmp_path / "cache-2").exists()
