"""Chaos in CI: SIGKILL of snapctl and/or its detached supervisor at random (seeded) instants
of donor, bake, copy, copy --lazy and image import, then one gc: nothing may be left, no image
corrupt or half-published, and the next copy must serve (the driver is ``tests.chaos``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import Driver

pytestmark = [pytest.mark.criu, pytest.mark.timeout(420)]

KILLS = 30  # about 2 s each here: bounded well under the suite's budget
SEED = 21


def test_one_gc_after_any_kill_leaves_nothing(tmp_path: Path, criu_binary: object) -> None:
    result = Driver(tmp_path, SEED, next_copy_every=5).run_round(KILLS)
    summary, kills = result["summary"], result["kills"]
    dirty = [(k["command"], k["mode"], k["window"], k["after_gc_detail"]) for k in kills
             if k["after_gc"]]  # fmt: skip
    assert dirty == [], dirty
    assert summary["gc_failures"] == 0 and summary["gc_killed_supervised"] == 0
    assert [k["corrupt_images"] for k in kills if k["corrupt_images"]] == []
    assert summary["next_copies"] >= KILLS // 5 and summary["next_copy_failures"] == 0, [
        k["next_copy"] for k in kills if k["next_copy"] not in (None, "ok")
    ]
    # The round really killed things that needed cleaning up (a test that cannot fail is not
    # one): most kills hit a running command, and gc had leftovers to remove.
    assert summary["kills_that_hit"] >= KILLS // 2
    assert summary["kills_with_leftovers_before_gc"] >= 3
