"""The warm pool: copies restored ahead of time and parked at the activation barrier, each in
its own supervisor process, and the two ways the agent serves a copy request (a parked copy,
or a restore in a fresh supervisor).

This module is the seam the agent codes against: the models (:mod:`snapctl.pool.models`; the
requests are :mod:`snapctl.activation.requests`'),
:class:`WarmPool`, :func:`activate_taken`, :func:`copy_via_supervisor`, :class:`Spawner`
and :class:`PoolEvents`. Process model: every supervisor (a parked copy's, or a fresh copy's)
is forked by the :class:`Spawner`, a single-threaded child the agent starts before any thread,
so that no supervisor is forked from a threaded process; supervisors outlive the agent.
"""

from __future__ import annotations

from snapctl.pool.events import NoEvents, PoolEvents
from snapctl.pool.models import (
    AdoptionReport,
    DiscardedCopy,
    ParkedCopyRow,
    ParkedRecord,
    PoolEntry,
    PoolListing,
    PoolTarget,
)
from snapctl.pool.serve import ParkedHandle, activate_taken, copy_via_supervisor
from snapctl.pool.spawner import Spawner
from snapctl.pool.warm import WarmPool

__all__ = [
    "AdoptionReport",
    "DiscardedCopy",
    "NoEvents",
    "ParkedCopyRow",
    "ParkedHandle",
    "ParkedRecord",
    "PoolEntry",
    "PoolEvents",
    "PoolListing",
    "PoolTarget",
    "Spawner",
    "WarmPool",
    "activate_taken",
    "copy_via_supervisor",
]
