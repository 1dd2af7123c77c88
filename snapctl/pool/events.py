"""What the pool tells its owner as it works (the agent turns these into metrics)."""

from __future__ import annotations

from typing import Protocol

from snapctl.pool.models import DiscardReason


class PoolEvents(Protocol):
    """Callbacks from the pool's threads; each must return fast and never raise."""

    def parked(self, image: str, seconds: float) -> None:
        """A copy of ``image`` is parked, ``seconds`` after its restore began."""

    def taken(self, image: str) -> None:
        """A parked copy of ``image`` was taken for a request."""

    def discarded(self, image: str, reason: DiscardReason) -> None:
        """A parked copy of ``image`` was discarded, and why."""

    def failed(self, image: str, phase: str) -> None:
        """Parking a copy of ``image`` failed in ``phase`` (restore, verify, ...)."""


class NoEvents:
    """The pool's events, ignored."""

    def parked(self, image: str, seconds: float) -> None:
        pass

    def taken(self, image: str) -> None:
        pass

    def discarded(self, image: str, reason: DiscardReason) -> None:
        pass

    def failed(self, image: str, phase: str) -> None:
        pass
