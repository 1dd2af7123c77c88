"""Content-defined chunks of large image files (FastCDC).

A cut point depends only on the bytes around it, so a re-bake whose page file gained, lost or
moved a few pages still cuts the unchanged stretches into the same chunks, which the registry
already holds. Sizes: 256 KiB to 4 MiB, 1 MiB on average: small enough that a change costs
little, large enough that a 2 GiB image is about 2000 blobs.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

MIN_CHUNK = 256 << 10
AVG_CHUNK = 1 << 20
MAX_CHUNK = 4 << 20


def cut(path: Path) -> Iterator[memoryview]:
    """The chunks of ``path`` in order, as views of the mapped file, each valid until the
    next is asked for."""
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
                    yield data
                finally:
                    data.release()
        finally:
            view.release()
    finally:
        mapped.close()
