"""The warm pool: per image, keep ``size`` copies restored and parked, refill in the
background, bound their memory, and discard the ones that can no longer be vouched for."""

from __future__ import annotations

from pathlib import Path

from snapctl.pool.events import NoEvents, PoolEvents
from snapctl.pool.models import AdoptionReport, CopyRequest, PoolListing, PoolTarget
from snapctl.pool.serve import ParkedHandle
from snapctl.pool.spawner import Spawner
from snapctl.supervision.state import StateDir


class WarmPool:
    """The agent's pool: targets by image, their parked copies, and the refill thread.

    Thread-safe. ``adopt`` first (it discards what an earlier agent parked), then ``set``,
    ``take`` and ``listing`` from any thread; ``close`` discards every parked copy.
    """

    def __init__(
        self, state: StateDir, *, spawner: Spawner, events: PoolEvents | None = None
    ) -> None:
        self.state = state
        self.spawner = spawner
        self.events: PoolEvents = events or NoEvents()

    def set(
        self, image: Path, size: int, *, lazy: bool | None = None, max_memory: int | None = None
    ) -> PoolTarget:
        """Keep ``size`` parked copies of ``image`` (0 keeps the target, parks nothing)."""
        raise NotImplementedError

    def remove(self, image: Path) -> PoolTarget:
        """Forget ``image``'s target and discard its parked copies."""
        raise NotImplementedError

    def listing(self) -> PoolListing:
        raise NotImplementedError

    def take(self, image: Path, request: CopyRequest | None = None) -> ParkedHandle | None:
        """A parked copy of ``image``, now the caller's to activate; None if none is ready
        (never waits). With ``request``: only one whose restore fits it (the same host, port,
        server command, waivers, native step and CRIU; ``lazy`` if the request says)."""
        raise NotImplementedError

    def adopt(self) -> AdoptionReport:
        """At start: discard every parked copy an earlier agent left."""
        raise NotImplementedError

    def close(self) -> None:
        """The agent stops: discard every parked copy, stop refilling."""
        raise NotImplementedError
