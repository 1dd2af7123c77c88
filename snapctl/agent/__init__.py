"""The resident node agent (``snapctl agent``): one process owning the state directory that
serves the CLI's operations over a versioned HTTP/JSON API on a unix socket, with a warm pool
of parked copies (:mod:`snapctl.pool`) and Prometheus metrics.

``server`` owns the listeners and routing, ``service`` the operations behind them, ``api`` the
request and response models, ``metrics`` the Prometheus registry, ``client`` the thin client the
CLI uses when an agent answers (stdlib only: the CLI's fast path imports nothing heavy), and
``render`` the plain-text tables both paths print. docs/agent.md documents the API.

This module itself imports only the standard library: the CLI reads the socket's path from it.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: the thin client imports this module (see snapctl.errors)
if TYPE_CHECKING:
    from pathlib import Path

# The API's version: every path starts with /v1. A change that breaks a client gets /v2.
API_VERSION = 1
API_PREFIX = f"/v{API_VERSION}"
SOCKET_NAME = "agent.sock"
# Set in the environment to keep every CLI command in-process (like --no-agent).
NO_AGENT_ENV = "SNAPCTL_NO_AGENT"
# Set to use another socket than STATE/agent.sock (the agent's --socket, for the client).
SOCKET_ENV = "SNAPCTL_AGENT_SOCKET"


def default_socket() -> str:
    """``$SNAPCTL_AGENT_SOCKET``, else ``STATE/agent.sock``, STATE as
    :func:`snapctl.statedir.state_dir` finds it (read here without importing it: that module
    imports pydantic), as an absolute path (a string: the thin client imports no pathlib)."""
    if os.environ.get(SOCKET_ENV):
        return absolute(os.environ[SOCKET_ENV])
    root = absolute(os.environ.get("SNAPCTL_STATE_DIR", "/var/lib/snapctl"))
    return os.path.join(root, SOCKET_NAME)


def absolute(path: str) -> str:
    """``path`` made absolute against the working directory as :meth:`pathlib.Path.absolute`
    writes it: ``.`` segments, repeated and trailing slashes dropped, ``..`` left for the
    kernel to resolve (through symlinks). Requests compare image paths as these strings."""
    joined = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return "/" + "/".join(part for part in joined.split("/") if part not in ("", "."))


def default_socket_path() -> Path:
    """:func:`default_socket` as a path."""
    from pathlib import Path

    return Path(default_socket())


__all__ = [
    "API_PREFIX",
    "API_VERSION",
    "NO_AGENT_ENV",
    "SOCKET_ENV",
    "SOCKET_NAME",
    "absolute",
    "default_socket",
    "default_socket_path",
]
