"""The spawner: refused once threads run; each job in a supervisor of its own session, with
its report pipe and no stdin; the spawner gone once its agent closes it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import psutil
import pytest

from snapctl.pool.spawner import Spawner

pytestmark = pytest.mark.timeout(60)


def test_refused_once_a_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="before any thread"):
            Spawner.start(lambda job, fd: None)
    finally:
        stop.set()
        thread.join()


def test_jobs_run_in_supervisors_of_their_own() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.pool.spawner_probe"], stdin=subprocess.PIPE,
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    out = json.loads(done.stdout)
    said = out["said"]
    assert [entry["job"] for entry in said] == [{"index": 0}, {"index": 1}]
    for entry in said:
        assert entry["ppid"] == out["spawner"]  # forked by the spawner, not by the agent
        assert entry["sid"] == entry["pid"]  # its own session: the agent's signals are not its
        assert entry["stdin"] == "/dev/null"
    assert len({entry["pid"] for entry in said}) == 2
    # The agent's handle on a supervisor is a pidfd of that very process (a cancel signals it).
    assert out["pinned"] and out["ended"]
    assert not psutil.pid_exists(out["spawner"])  # closed and reaped
