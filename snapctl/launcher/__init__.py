"""The server side of the v1 startup-capture protocol, as a library any Python server can call.

A server in startup mode builds its engine, then hands control to :func:`run_startup_capture`
with an object implementing :class:`StartupHooks`. The function prepares (canary, release,
rehearsal, release), publishes ``capture-ready.json``, waits for an activation, runs the
challenge/release handshake, recovers, checks the canary against the oracle and returns the
host and port the server may now bind. Any failure writes ``error.json`` and raises
:class:`StartupCaptureError`; the server must then exit without binding.

(Interface fixed here; implementation in progress.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from snapctl.protocol.models import Oracle, SnapshotConfig


class StartupHooks(Protocol):
    """What the server provides. Each hook runs in the server's main thread."""

    def canary(self) -> Oracle:
        """Run the fixed private canary (greedy, one token) and return its result."""

    def release_memory(self) -> None:
        """Drop reloadable memory (weights, KV cache) before capture."""

    def restore_memory(self) -> None:
        """Reload what release_memory dropped (weights from their files, caches reallocated)."""


@dataclass(frozen=True)
class BindTarget:
    """Where the activated server binds its public socket."""

    host: str | None
    port: int
    activation_id: str
    kind: str


class StartupCaptureError(RuntimeError):
    """The startup capture failed; ``error.json`` was written (when possible)."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase


def run_startup_capture(config: SnapshotConfig, hooks: StartupHooks) -> BindTarget:
    """Run prepare → capture-ready → activation → challenge/release → recover → validated."""
    raise NotImplementedError
