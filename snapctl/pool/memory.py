"""What parked copies hold in memory, as the agent's pool accounts it: each copy's PSS (its
whole tree and lazy-pages daemon), read again only when its resident counters moved, when
it is old, or when a sibling that shared its pages went. Runs in the agent (the refill
tick and the parking threads)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import psutil

from snapctl.cgroups.lookup import cgroup_named
from snapctl.pool.models import ParkedRecord
from snapctl.supervision.memory import members_memory, tree_members
from snapctl.supervision.process import is_same_process

# The memory of parked copies is looked at this often: the resident counters of each tree's
# processes (statm), and its PSS (smaps_rollup: a walk of every page table entry, its time
# in proportion to the memory mapped) only where those moved by more than RESIDENT_SLACK
# since the last PSS, where a copy of the same image was discarded or died since (its share
# of the pages they both mapped is the others' now), or where it is PSS_MAX_AGE_S old (a
# copy taken from the pool and stopped later does the same). docs/pool.md has what it cost.
MEMORY_EVERY_S = 2.0
RESIDENT_SLACK = 0.01
PSS_MAX_AGE_S = 30.0


def members_resident(members: list[psutil.Process]) -> tuple[tuple[int, int], ...]:
    """Each member's resident bytes, by PID (statm: no walk of its memory, unlike PSS)."""
    readings = []
    for member in members:
        with contextlib.suppress(psutil.Error):
            readings.append((member.pid, int(member.memory_info().rss)))
    return tuple(readings)


def record_members(record: ParkedRecord) -> list[psutil.Process]:
    """A parked copy's tree and its lazy-pages daemon."""
    pids: list[tuple[int, float | None]] = []
    if record.root_pid is not None:
        pids.append((record.root_pid, record.root_start_time))
    if record.lazy_pages_pid is not None:
        pids.append((record.lazy_pages_pid, record.lazy_pages_start_time))
    return tree_members(pids)


def memory_moved(before: tuple[tuple[int, int], ...], now: tuple[tuple[int, int], ...]) -> bool:
    """Whether the tree's resident memory changed enough to read its PSS again: another set
    of processes, or a total that moved by more than :data:`RESIDENT_SLACK` of it."""
    if {pid for pid, _ in before} != {pid for pid, _ in now}:
        return True
    old, new = sum(rss for _, rss in before), sum(rss for _, rss in now)
    return abs(new - old) > RESIDENT_SLACK * max(old, new)


@dataclass
class CopyMemory:
    """One parked copy's last memory reading: its PSS in bytes (None: not read yet), the
    tree's resident bytes by PID it was read against, and when."""

    bytes: int | None = None
    basis: tuple[tuple[int, int], ...] = ()
    at: float = -math.inf

    def measure(self, record: ParkedRecord, now: float) -> int | None:
        """Read the copy's PSS again if it may have changed (a read that fails, a process
        between states, keeps the last one); return what it holds now."""
        members = record_members(record)
        basis = members_resident(members)
        if self.bytes is None or now - self.at >= PSS_MAX_AGE_S or memory_moved(self.basis, basis):
            memory = members_memory(members)
            if memory is not None:
                self.bytes, self.basis, self.at = memory, basis, now
        return self.bytes

    def shares_changed(self) -> None:
        """A sibling that shared pages with this copy went: read its PSS at the next tick."""
        self.at = -math.inf


def cgroup_columns(record: ParkedRecord | None, prefix: str) -> dict[str, Any]:
    """A parked copy's cgroup columns of ``pool ls`` (:class:`ParkedCopyRow`'s ``cgroup``,
    ``cgroup_memory_bytes``, ``memory_limit_bytes``), read now; none while it restores, once
    its tree is gone, or where it runs in no cgroup of its own. ``prefix``: its state
    directory's cgroup names' (``StateDir.cgroup_prefix``)."""
    if record is None or record.activation_id is None:
        return {}
    pid, started = record.root_pid, record.root_start_time
    if pid is None or started is None:
        return {}
    group = cgroup_named(prefix + record.activation_id, pid)
    # Checked after the read: a PID reused since would otherwise lend its cgroup to the copy.
    if group is None or not is_same_process(pid, started):
        return {}
    usage = group.usage()
    return {
        "cgroup": usage.cgroup,
        "cgroup_memory_bytes": usage.memory_bytes,
        "memory_limit_bytes": usage.memory_limit_bytes,
    }
