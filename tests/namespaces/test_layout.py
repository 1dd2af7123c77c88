"""An activation's directories: two tmpfs of its own, mounted and unmounted as a unit.

The control directory is a small tmpfs (the protocol's fsyncs then cost nothing) with a source
name distinct from the shm tmpfs, whose name alone identifies the activation's processes.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.namespaces import mounts
from snapctl.namespaces.layout import ActivationDirs
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import ControlFile
from tests.conftest import in_ci
from tests.protocol.factories import make_status

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not in_ci(), reason="needs root (mount)")


def mount_sources(dirs: ActivationDirs) -> dict[str, tuple[str, str]]:
    """(source, fstype) of each mount under the activation's root, by mount point."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")
        if point.startswith(str(dirs.root.resolve()) + "/"):
            separator = fields.index("-")
            found[point] = (fields[separator + 2], fields[separator + 1])
    return found


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[ActivationDirs]:
    base = tmp_path / "state"
    base.mkdir(mode=0o700)
    made = ActivationDirs(root=base / "activations" / "copy-0123abcd", logs=base / "logs" / "x")
    yield made
    for point in (made.control, made.shm):
        if point.exists() and mounts.is_mountpoint(point):
            mounts.umount(point, detach=True)


def test_control_is_a_private_tmpfs_that_passes_the_protocol_checks(dirs: ActivationDirs) -> None:
    dirs.create()
    assert mount_sources(dirs) == {
        str(dirs.control.resolve()): (dirs.control_source, "tmpfs"),
        str(dirs.shm.resolve()): (dirs.mount_source, "tmpfs"),
    }
    assert dirs.control_source != dirs.mount_source
    info = os.lstat(dirs.control)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()
    control = ControlDir(dirs.control)
    control.validate(require_empty=True)
    control.write(make_status())
    assert control.read(ControlFile.STATUS) == make_status()


def test_remove_unmounts_both_and_deletes_the_root(dirs: ActivationDirs) -> None:
    dirs.create()
    ControlDir(dirs.control).write(make_status())
    dirs.remove()
    assert not dirs.root.exists()
    assert mount_sources(dirs) == {}
    assert dirs.logs.is_dir()  # the logs outlive the activation


def test_a_failed_create_leaves_nothing_mounted(dirs: ActivationDirs) -> None:
    # The control tmpfs is mounted by then; the shm tmpfs refuses the size.
    with pytest.raises(OSError, match="mount"):
        dirs.create(shm_size="not-a-size")
    assert mount_sources(dirs) == {}
    assert not dirs.root.exists()


def test_remove_tries_every_unmount_and_keeps_what_stays_mounted(dirs: ActivationDirs) -> None:
    dirs.create()
    busy = os.open(dirs.control, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError, match="umount"):
            dirs.remove(busy_wait_s=0.1)
        # The shm tmpfs came off all the same; the root stays, holding the busy mount.
        assert list(mount_sources(dirs).values()) == [(dirs.control_source, "tmpfs")]
        assert dirs.root.is_dir()
    finally:
        os.close(busy)
    dirs.remove()
    assert not dirs.root.exists()
    assert mount_sources(dirs) == {}


def test_remove_waits_for_a_mount_that_is_busy_a_moment_longer(dirs: ActivationDirs) -> None:
    # As a killed process's files can be released a moment after it is gone.
    dirs.create()
    busy = os.open(dirs.shm, os.O_RDONLY | os.O_DIRECTORY)
    releaser = threading.Timer(0.2, os.close, (busy,))
    releaser.start()
    try:
        dirs.remove(busy_wait_s=10)
    finally:
        releaser.join()
    assert not dirs.root.exists()
    assert mount_sources(dirs) == {}
