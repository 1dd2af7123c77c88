"""The eager/lazy view of an image: pagemaps of small processes lose PE_LAZY, the rest is linked."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from snapctl.criu.pagemap import (
    PAGE_SIZE,
    PE_LAZY,
    PagemapError,
    eager_small_view,
    lazy_bytes,
    without_lazy,
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
SMALL = pagemap((0x1000, 1, PE_PRESENT), (0x7F0000000000, 256, LAZY), (0x7F0000100000, 10, LAZY))
BIG = pagemap((0x1000, 1, PE_PRESENT), *((0x7E0000000000 + i * 2**20, 256, LAZY) for i in range(3)))


def test_lazy_bytes_counts_only_lazy_entries(tmp_path: Path) -> None:
    (tmp_path / "pagemap-1.img").write_bytes(SMALL)
    assert lazy_bytes(tmp_path / "pagemap-1.img") == 266 * PAGE_SIZE


def test_without_lazy_clears_the_flag_and_keeps_everything_else(tmp_path: Path) -> None:
    (tmp_path / "pagemap-1.img").write_bytes(SMALL)
    eager = without_lazy(tmp_path / "pagemap-1.img")
    expected = pagemap(
        (0x1000, 1, PE_PRESENT), (0x7F0000000000, 256, PE_PRESENT), (0x7F0000100000, 10, PE_PRESENT)
    )
    assert eager == expected
    (tmp_path / "eager.img").write_bytes(eager)
    assert lazy_bytes(tmp_path / "eager.img") == 0


def test_view_makes_small_processes_eager_and_links_the_rest(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    (image / "pagemap-1.img").write_bytes(SMALL)
    (image / "pagemap-4.img").write_bytes(BIG)
    (image / "pages-1.img").write_bytes(b"\0" * PAGE_SIZE)
    (image / "core-1.img").write_bytes(b"core")
    view = tmp_path / "view"
    assert eager_small_view(image, view, eager_below=300 * PAGE_SIZE) == 266 * PAGE_SIZE
    assert sorted(p.name for p in view.iterdir()) == sorted(p.name for p in image.iterdir())
    assert not (view / "pagemap-1.img").is_symlink()
    assert lazy_bytes(view / "pagemap-1.img") == 0
    for name in ("pagemap-4.img", "pages-1.img", "core-1.img"):
        assert (view / name).readlink() == image / name
    # The image itself is untouched.
    assert (image / "pagemap-1.img").read_bytes() == SMALL


def test_a_pagemap_it_cannot_read_fails_the_view(tmp_path: Path) -> None:
    image = tmp_path / "criu"
    image.mkdir()
    (image / "pagemap-1.img").write_bytes(SMALL[:-3])
    with pytest.raises(PagemapError, match=r"pagemap-1\.img: truncated entry"):
        eager_small_view(image, tmp_path / "view")
    (image / "pagemap-1.img").write_bytes(b"\x01\x02\x03\x04" + SMALL[4:])
    with pytest.raises(PagemapError, match="not a CRIU pagemap image"):
        lazy_bytes(image / "pagemap-1.img")


def test_view_of_a_relative_image_path_links_to_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "criu").mkdir()
    (tmp_path / "criu" / "core-1.img").write_bytes(b"core")
    monkeypatch.chdir(tmp_path)
    eager_small_view(Path("criu"), tmp_path / "view")
    assert (tmp_path / "view" / "core-1.img").read_bytes() == b"core"
