"""Content-defined chunks of large image files (FastCDC).

A cut point depends only on the bytes around it, so a re-bake whose page file gained, lost or
moved a few pages still cuts the unchanged stretches into the same chunks, which the registry
already holds. Sizes: 256 KiB to 4 MiB, 1 MiB on average: small enough that a change costs
little, large enough that a 2 GiB image is about 2000 blobs.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_CHUNK = 256 << 10
AVG_CHUNK = 1 << 20
MAX_CHUNK = 4 << 20


@dataclass(frozen=True)
class Piece:
    """One chunk: its offset and bytes (a view of the mapped file), and its sha256 digest."""

    offset: int
    data: memoryview
    digest: str


def cut(path: Path) -> Iterator[Piece]:
    """The chunks of ``path`` in order; the views are valid until the iterator ends."""
    import fastcdc

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        view = memoryview(mapped)
        try:
            for chunk in fastcdc.fastcdc(view, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK):
                data = view[chunk.offset : chunk.offset + chunk.length]
                try:
                    yield Piece(chunk.offset, data, "sha256:" + hashlib.sha256(data).hexdigest())
                finally:
                    data.release()
        finally:
            view.release()
    finally:
        mapped.close()
