"""Whole-file advisory locks (``flock``) taken without waiting: one holder of a thing at a time
(an activation's name, the agent of a state directory, the copy a container hosts)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


def try_lock(path: Path) -> int | None:
    """An open descriptor of ``path`` (made, mode 0600, where missing; never through a link)
    holding its exclusive lock; None while another open file of it holds the lock. Closing the
    descriptor (its last copy, in a child too) releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd
