"""The old import path of :mod:`snapctl.pool.supervisor.jobs` (a supervisor's jobs), kept for
importers outside the pool; the pool itself imports the supervisor side from there."""

from __future__ import annotations

from snapctl.pool.supervisor.jobs import *  # noqa: F403
from snapctl.pool.supervisor.jobs import __all__ as __all__
