"""The warm pool: copies restored ahead of time and parked at the activation barrier, each in
its own supervisor process, and the two ways the agent serves a copy request (a parked copy,
or a restore in a fresh supervisor).

Split by the process a module runs in, each layer importing only the ones below it:

- the agent: :mod:`~snapctl.pool.warm` (the :class:`WarmPool`: targets, take, the refill
  tick) with :mod:`~snapctl.pool.states`, :mod:`~snapctl.pool.memory`,
  :mod:`~snapctl.pool.verify` and :mod:`~snapctl.pool.targets`; :mod:`~snapctl.pool.serve`
  (serving one request) and :mod:`~snapctl.pool.cancel`, :mod:`~snapctl.pool.events`;
- a supervisor: :mod:`snapctl.pool.supervisor` (the jobs the spawner's children run);
- both, below them: :mod:`~snapctl.pool.wire` (the pipe and socket between them, its
  errors), :mod:`~snapctl.pool.spawner` (forks supervisors; their job runner is injected),
  :mod:`~snapctl.pool.models`, :mod:`~snapctl.pool.records`, :mod:`~snapctl.pool.identity`.

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
from snapctl.pool.serve import activate_taken, copy_via_supervisor
from snapctl.pool.supervisor import SupervisorSpawner as Spawner
from snapctl.pool.warm import WarmPool
from snapctl.pool.wire import ParkedHandle

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
