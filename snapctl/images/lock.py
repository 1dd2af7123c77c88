"""Image holds: a shared ``flock`` on the image directory while something reads it, an
exclusive one while something removes or replaces it.

A lazy copy keeps reading pages from its image long after it serves, so the image must not
change or vanish under it. Locking the directory itself (not a file beside or inside it) keeps
the image's file list, and so its hashes, untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase


class ImageBusyError(SnapctlError):
    """Someone else holds the image in a way that conflicts with what was asked."""

    exit_status = ExitStatus.CONFLICT


class ImageHold:
    """An open descriptor on the image directory carrying a ``flock``; ``release`` (or leaving
    a ``with`` block) drops it."""

    def __init__(self, image: Path, fd: int, exclusive: bool) -> None:
        self.image = image
        self.exclusive = exclusive
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> ImageHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_image(image: Path, *, exclusive: bool = False, wait: bool = False) -> ImageHold:
    """Take a shared (readers) or exclusive (rm, replace) hold on ``image``.

    Without ``wait`` a conflicting hold raises :class:`ImageBusyError` at once. A missing
    ``image`` raises ``FileNotFoundError`` (``NotADirectoryError``), for the caller to name.
    """
    fd = os.open(image, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    operation = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        fcntl.flock(fd, operation if wait else operation | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            what = "in use (a running copy may still read it)" if exclusive else "being changed"
            raise ImageBusyError(
                f"image {image} is {what}", phase=HostPhase.IMAGE, path=image
            ) from error
        raise
    return ImageHold(image, fd, exclusive)
