"""Finding an activation's processes by its tmpfs: only where the activation sees it.

Any process that unshares a mount namespace inherits a copy of every host mount, so seeing an
activation's tmpfs somewhere is no proof of membership; seeing it at /dev/shm is.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.namespaces import mounts
from tests.conftest import in_ci

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not in_ci(), reason="needs root (mount, unshare)"
)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    point = tmp_path / "shm"
    point.mkdir()
    source = f"snapctl-test-{uuid.uuid4().hex[:12]}"
    mounts.mount_tmpfs(point, "size=1m", source=source)
    yield point, source
    mounts.umount(point, detach=True)


def _wait_for_namespace(proc: subprocess.Popen[bytes]) -> None:
    own = os.stat("/proc/self/ns/mnt").st_ino
    deadline = time.monotonic() + 10
    while os.stat(f"/proc/{proc.pid}/ns/mnt").st_ino == own:
        assert time.monotonic() < deadline, "unshare did not enter a new mount namespace"
        time.sleep(0.01)


def test_a_process_that_only_inherited_the_mount_is_not_the_activations(
    tmpfs: tuple[Path, str],
) -> None:
    point, source = tmpfs
    bystander = subprocess.Popen(["unshare", "--mount", "sleep", "30"])
    member = subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", f"mount --bind {point} /dev/shm && exec sleep 30"]
    )
    try:
        _wait_for_namespace(bystander)
        _wait_for_namespace(member)
        deadline = time.monotonic() + 10
        # Exactly the member, once its transient `mount` child (in its namespace) has exited.
        while (found := mounts.processes_with_mount(source, "/dev/shm")) != [member.pid]:
            assert time.monotonic() < deadline, f"not only the member has the tmpfs: {found}"
            time.sleep(0.01)
        assert bystander.pid in mounts.processes_with_mount(source, str(point))
    finally:
        for proc in (bystander, member):
            proc.kill()
            proc.wait()


def test_mountinfo_reads_mount_points_with_spaces_and_non_ascii_names(tmp_path: Path) -> None:
    # The kernel escapes a space as \040 and leaves UTF-8 as it is: both must come back whole.
    point = tmp_path / "a dir é"
    point.mkdir()
    mounts.mount_tmpfs(point, "size=1m", source=f"snapctl-test-{uuid.uuid4().hex[:12]}")
    try:
        assert (str(point), "tmpfs") in mounts.mountinfo()
    finally:
        mounts.umount(point, detach=True)


def test_a_tree_cloned_without_symlinks_refuses_a_link_on_its_path(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "model").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    for path in (tmp_path / "link" / "model", tmp_path / "link"):
        with pytest.raises(OSError) as info:
            mounts.clone_tree(path, no_symlinks=True)
        assert info.value.errno == errno.ELOOP, path
    for path, no_symlinks in ((real / "model", True), (tmp_path / "link" / "model", False)):
        os.close(mounts.clone_tree(path, no_symlinks=no_symlinks))
