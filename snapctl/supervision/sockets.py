"""Unix sockets only their owner can reach, from the moment their file exists."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def bind_private(sock: socket.socket, path: str | Path) -> None:
    """Bind the unix socket ``sock`` at ``path`` as mode 0600 from its creation.

    Linux creates a socket's file with its inode's mode less the umask, and ``fchmod`` on the
    socket sets that mode before the bind: no window in which another user could connect,
    and no ``umask()`` call, which would change the mode of whatever another thread of the
    process creates meanwhile.
    """
    os.fchmod(sock.fileno(), 0o600)
    sock.bind(os.fspath(path))
    os.chmod(path, 0o600)  # a umask can only take bits away; this makes the mode exact
