"""Telling a recorded process from a later one that reuses its PID."""

from __future__ import annotations

import os
import subprocess

from snapctl.supervision.process import is_same_process, start_time


def test_same_process_only_with_its_own_start_time() -> None:
    me = os.getpid()
    assert is_same_process(me, start_time(me))
    assert not is_same_process(me, start_time(me) - 1.0)  # another process, same PID


def test_a_process_that_is_gone_is_not_the_same() -> None:
    gone = subprocess.Popen(["true"])
    started = start_time(gone.pid)
    gone.wait()
    assert not is_same_process(gone.pid, started)
