"""The pool's wire and file formats: the rows of ``pool ls``, its targets, a parked copy's record
and order, and what adoption found (the requests they carry are
:mod:`snapctl.activation.requests`'). Pydantic only: the agent types its API with these, and
nothing here starts anything."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from snapctl.activation.requests import CopyRequest
from snapctl.cgroups.limits import MIN_MEMORY_BYTES
from snapctl.models import StrictModel
from snapctl.supervision.memory import KsmStatus

PARKED_ID_PATTERN = r"^pool-[0-9a-f]{12}$"
ParkedState = Literal["restoring", "parked"]
DiscardReason = Literal[
    "removed", "replaced", "verification", "memory", "target", "closing", "unvouched", "died"
]


class ParkedCopyRow(StrictModel):
    """One parked copy in ``pool ls``."""

    id: str = Field(pattern=PARKED_ID_PATTERN)
    state: ParkedState
    age_s: float
    memory_bytes: int | None  # PSS of its whole tree (RSS where PSS is unreadable); None: gone
    supervisor_pid: int
    root_pid: int | None
    # Its own cgroup, as ps shows an activation's (None while it restores, once gone, or where
    # it has none): the path as /proc/PID/cgroup names it, what the cgroup is charged (every
    # page of the tree, shared ones included) and its memory limit (None: unlimited).
    cgroup: str | None = None
    cgroup_memory_bytes: int | None = None
    memory_limit_bytes: int | None = None


class PoolTarget(StrictModel):
    """What the pool keeps for one image: ``size`` parked copies, restored lazily or not,
    within ``max_memory`` bytes (None: no budget) for all of this image's parked copies, each
    in its own cgroup limited to ``memory_bytes`` and ``cpus`` (None: no limit)."""

    image: str = Field(min_length=1, pattern=r"^/")
    size: int = Field(ge=0, le=64)
    lazy: bool | None = None
    max_memory: int | None = Field(default=None, ge=1)
    memory_bytes: int | None = Field(default=None, ge=MIN_MEMORY_BYTES)
    cpus: float | None = Field(default=None, ge=0.01)


class PoolTargets(StrictModel):
    """``STATE/pool/targets.json``: the pool's targets, kept for the next agent."""

    version: Literal[1] = 1
    targets: tuple[PoolTarget, ...] = ()


class PoolEntry(StrictModel):
    """One image's row in ``pool ls``: its target and the copies parked for it now."""

    target: PoolTarget
    image_id: str | None  # None: the image is not (or no longer) published
    memory_bytes: int
    parked: tuple[ParkedCopyRow, ...]
    last_failure: str | None = None  # the last restore that failed, and why (refill backs off)


class PoolListing(StrictModel):
    """``pool ls --json``."""

    version: Literal[1] = 1
    entries: tuple[PoolEntry, ...]
    memory_bytes: int
    # The host's same-page merging: what copies sharing their pages save (None: no KSM).
    ksm: KsmStatus | None = None


class ParkedRecord(StrictModel):
    """``STATE/pool/<id>/parked.json``: a parked copy's supervisor and tree, so that a new
    agent (or ``gc``) finds it; written by the parked supervisor, dropped when it ends."""

    version: Literal[1] = 1
    id: str = Field(pattern=PARKED_ID_PATTERN)
    state: ParkedState
    image: str
    image_id: str | None  # None until restored (then: what it was restored from)
    manifest_digest: str | None
    lazy: bool
    activation_id: str | None
    supervisor_pid: int
    supervisor_start_time: float
    root_pid: int | None
    root_start_time: float | None
    lazy_pages_pid: int | None = None
    lazy_pages_start_time: float | None = None
    owner_pid: int  # the agent it was parked for: without it, the parked copy discards itself
    owner_start_time: float
    socket: str
    created: str  # ISO 8601, UTC


class DiscardedCopy(StrictModel):
    id: str
    reason: DiscardReason
    processes_ended: tuple[int, ...] = ()


class AdoptionReport(StrictModel):
    """What :meth:`WarmPool.adopt` found at start: the parked copies it discarded (a new agent
    cannot vouch for what an earlier one parked) and what it removed besides."""

    version: Literal[1] = 1
    discarded: tuple[DiscardedCopy, ...]
    removed: tuple[str, ...]


class ActivationOrder(StrictModel):
    """What a parked copy's socket takes, once: activate it for ``request``, or discard it."""

    version: Literal[1] = 1
    action: Literal["activate", "discard"]
    request: CopyRequest | None = None
