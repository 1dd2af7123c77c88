"""When a copy taken from the pool stops holding the refill back.

A refill is a whole CRIU restore of the next parked copy: on a small host it takes the CPU
and the memory bandwidth that the taken copy needs for its activation and for the request that
asked for it (a real model's first completion runs every core). So a taken copy holds refills
back while it activates, and after that while its tree is busy (the first requests), until it
has been quiet for a sample or :data:`REFILL_HOLD_S` has passed since the take, whichever comes
first: a copy under steady load must not leave the pool empty for long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil

from snapctl.pool.models import ParkedRecord
from snapctl.supervision.memory import tree_members

# A taken copy holds refills back at most this long after the take.
REFILL_HOLD_S = 5.0
# A settled copy's tree counts as quiet when it used less than this many cores between two
# samples at least QUIET_SAMPLE_S apart (an idle server's event loops use a few percent).
QUIET_CORES = 0.25
QUIET_SAMPLE_S = 0.4

# The CPU seconds a tree used so far (its root's PID and start time), None once it is gone.
TreeCpu = Callable[[int, float | None], float | None]


def tree_cpu_seconds(pid: int, start_time: float | None) -> float | None:
    """User and system CPU seconds of the tree rooted at ``pid`` (its members alive now);
    None when that process is gone."""
    members = tree_members([(pid, start_time)])
    if not members:
        return None
    total = 0.0
    for member in members:
        try:
            times = member.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system
    return total


@dataclass
class RefillHold:
    """One taken copy's hold on refills: its tree's root (None: not known, so the hold ends
    when it settles), until when at most, when its taker settled (None: still activating),
    and the last sample of its tree's CPU seconds (monotonic time, seconds)."""

    root: tuple[int, float | None] | None
    until: float
    settled_at: float | None = None
    sample: tuple[float, float] | None = None

    @classmethod
    def of_taken(cls, record: ParkedRecord, now: float) -> RefillHold:
        """The hold of the copy of ``record``, taken at ``now``."""
        root = None if record.root_pid is None else (record.root_pid, record.root_start_time)
        return cls(root, now + REFILL_HOLD_S)

    def holds(self, now: float, tree_cpu: TreeCpu) -> bool:
        """Whether it still holds refills back at ``now``; takes a CPU sample when settled."""
        if now >= self.until:
            return False
        if self.settled_at is None:
            return True
        if self.root is None:
            return False
        used = tree_cpu(*self.root)
        if used is None:
            return False  # the copy ended
        if self.sample is None:
            self.sample = (now, used)
            return True
        sampled_at, used_then = self.sample
        if now - sampled_at < QUIET_SAMPLE_S:
            return True  # too short a window to tell
        self.sample = (now, used)
        return (used - used_then) / (now - sampled_at) >= QUIET_CORES
