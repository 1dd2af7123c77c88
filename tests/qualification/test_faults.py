"""The fault run enters a copy's mount namespace only while the pinned root still runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from snapctl.errors import SnapctlError
from snapctl.qualification.faults import _nsenter
from snapctl.supervision.process import PinnedProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="nsenter --mount needs root")


def test_nsenter_runs_in_the_live_roots_mount_namespace() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with PinnedProcess(child.pid) as root:
            proc = _nsenter(root, "readlink", "/proc/self/ns/mnt")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == os.readlink(f"/proc/{child.pid}/ns/mnt")
    finally:
        child.kill()
        child.wait()


def test_nsenter_refuses_a_root_that_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    with PinnedProcess(child.pid) as root:
        child.wait()  # reaped: its PID is free for another process

        with pytest.raises(SnapctlError, match=str(child.pid)):
            _nsenter(root, "true")
