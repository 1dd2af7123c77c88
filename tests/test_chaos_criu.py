"""Chaos in CI: SIGKILL of snapctl and/or its detached supervisor at random (seeded) instants
of donor, bake, copy, copy --lazy and image import, then one gc: nothing may be left, no image
corrupt or half-published, and the next copy must serve; and a detached start's command killed
at a random instant, then ``stop NAME`` right after and one gc: nothing may be left either
(the driver is ``tests.chaos``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import Driver

pytestmark = [pytest.mark.criu, pytest.mark.timeout(420)]

KILLS = 30  # about 2 s each here: bounded well under the suite's budget
STOPS = 8  # longer than a kill: a tree stopped while it launches waits out its SIGTERM
SEED = 21


def test_one_gc_after_any_kill_leaves_nothing(tmp_path: Path, criu_binary: object) -> None:
    result = Driver(tmp_path, SEED, next_copy_every=5).run_round(KILLS, stops=STOPS)
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
    # stop NAME right after a detached start's command was killed: it stopped the start
    # wherever it was (or found nothing, when the kill came before anything started).
    stops = [k["stop"] for k in kills if k["stop"] is not None]
    assert len(stops) == STOPS and summary["stop_failures"] == 0, stops
    assert summary["stops"].get("interrupted while starting", 0) >= 1, stops
