"""The old import path of :mod:`snapctl.pool.supervisor.parked` (a parked copy's supervisor),
kept for importers outside the pool; the pool itself imports it from there."""

from __future__ import annotations

from snapctl.pool.supervisor.parked import PARK_NICENESS, run_parked

__all__ = ["PARK_NICENESS", "run_parked"]
