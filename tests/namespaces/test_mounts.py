"""Finding an activation's processes by its tmpfs: members are found, bystanders never."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.namespaces import mounts
from tests.conftest import in_ci

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not in_ci(), reason="mounting needs root")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    source = f"snapctl-test-{os.getpid()}-{time.monotonic_ns()}"
    target = tmp_path / "shm"
    target.mkdir()
    mounts.mount_tmpfs(target, "size=1m", source=source)
    try:
        yield source, target
    finally:
        mounts.umount(target, detach=True)


def start_in_new_mount_namespace(script: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{script}; exec sleep 30"]
    )
    time.sleep(0.3)  # let it set up its mounts
    return process


def test_member_is_found_and_bystander_with_a_copied_table_is_not(
    tmpfs: tuple[str, Path],
) -> None:
    source, host_path = tmpfs
    bystander = start_in_new_mount_namespace("true")  # sees the tmpfs at its host path only
    member = start_in_new_mount_namespace(f"mount --bind {host_path} /dev/shm")
    try:
        assert mounts.processes_with_mount(source, "/dev/shm") == [member.pid]
        assert mounts.processes_with_mount(source, str(host_path)) == sorted(
            [bystander.pid, member.pid]
        )
    finally:
        for process in (bystander, member):
            process.kill()
            process.wait()
    assert mounts.processes_with_mount(source, "/dev/shm") == []
