"""A taken copy's hold on the pool's refills (snapctl.pool.holds), on a fake CPU reader."""

from __future__ import annotations

import os

import pytest

from snapctl.pool.holds import QUIET_SAMPLE_S, REFILL_HOLD_S, RefillHold, tree_cpu_seconds
from snapctl.supervision.process import start_time


class Tree:
    """A fake tree's CPU seconds, None once it is gone."""

    def __init__(self) -> None:
        self.used: float | None = 0.0
        self.asked: list[tuple[int, float | None]] = []

    def __call__(self, pid: int, start: float | None) -> float | None:
        self.asked.append((pid, start))
        return self.used


def test_an_activating_copy_holds_until_settled_or_its_time_is_up() -> None:
    tree = Tree()
    hold = RefillHold((42, 1.5), until=REFILL_HOLD_S)
    assert hold.holds(0.0, tree) and hold.holds(REFILL_HOLD_S - 0.01, tree)
    assert not hold.holds(REFILL_HOLD_S, tree)
    assert tree.asked == []  # no CPU read before it settles


def test_a_settled_copy_holds_while_busy_and_ends_once_quiet() -> None:
    tree = Tree()
    hold = RefillHold((42, 1.5), until=100.0, settled_at=0.0)
    assert hold.holds(0.0, tree)  # the first sample
    assert tree.used is not None
    tree.used += 1.0
    assert hold.holds(0.5, tree)  # two cores
    tree.used += 0.05
    assert hold.holds(0.5 + QUIET_SAMPLE_S / 2, tree)  # too short a window to tell
    assert not hold.holds(1.0, tree)  # a tenth of a core
    assert tree.asked and all(asked == (42, 1.5) for asked in tree.asked)


def test_a_copy_that_ended_or_has_no_known_root_holds_no_more() -> None:
    tree = Tree()
    tree.used = None
    assert not RefillHold((42, None), until=100.0, settled_at=0.0).holds(0.0, tree)
    assert not RefillHold(None, until=100.0, settled_at=0.0).holds(0.0, Tree())


def test_tree_cpu_seconds_reads_a_live_tree_and_not_a_gone_one() -> None:
    me = os.getpid()
    used = tree_cpu_seconds(me, start_time(me))
    assert used is not None and used > 0
    assert tree_cpu_seconds(me, start_time(me) - 1000.0) is None  # another process's start


@pytest.mark.parametrize("busy", [True, False])
def test_the_rate_is_taken_over_the_window_between_samples(busy: bool) -> None:
    tree = Tree()
    hold = RefillHold((1, None), until=100.0, settled_at=0.0)
    assert hold.holds(0.0, tree)
    tree.used = 10 * QUIET_SAMPLE_S * (0.5 if busy else 0.02)
    assert hold.holds(10 * QUIET_SAMPLE_S, tree) is busy
