"""The sandbox's own /dev: what the builder makes (on fakes), which host nodes are bound in,
and which images a machine refuses for their /dev."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from snapctl.namespaces import devices
from snapctl.namespaces.devices import (
    DEV_TMPFS_FLAGS,
    STANDARD_LINKS,
    DevBuildError,
    DeviceNode,
    DevLayoutError,
    build_dev,
    dev_fstype,
    host_device_nodes,
    require_restorable_dev,
)
from snapctl.namespaces.mounts import MS_NODEV


class FakeDevOps:
    """Records what building /dev does; ``refuse_mknod`` makes mknod fail as a device cgroup
    that refuses it does."""

    def __init__(self, *, refuse_mknod: bool = False) -> None:
        self.events: list[str] = []
        self.refuse_mknod = refuse_mknod

    def mount_tmpfs(self, target: str, options: str, flags: int) -> None:
        self.events.append(f"tmpfs {target} {options} nodev={bool(flags & MS_NODEV)}")

    def mknod(self, path: str, mode: int, device: int) -> None:
        if self.refuse_mknod:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        kind = "c" if stat.S_ISCHR(mode) else "?"
        mode_bits = oct(stat.S_IMODE(mode))
        self.events.append(f"mknod {path} {kind} {os.major(device)}:{os.minor(device)} {mode_bits}")

    def symlink(self, target: str, path: str) -> None:
        self.events.append(f"symlink {path} -> {target}")

    def mkdir(self, path: str, mode: int) -> None:
        self.events.append(f"mkdir {path} {oct(mode)}")


def test_build_dev_mounts_a_tmpfs_first_then_the_standard_nodes_and_links() -> None:
    ops = FakeDevOps()

    build_dev("/sandbox/dev", ops=ops)

    assert ops.events[0] == f"tmpfs /sandbox/dev {devices.DEV_TMPFS_OPTIONS} nodev=False"
    assert ops.events[1:7] == [
        "mknod /sandbox/dev/null c 1:3 0o666",
        "mknod /sandbox/dev/zero c 1:5 0o666",
        "mknod /sandbox/dev/full c 1:7 0o666",
        "mknod /sandbox/dev/random c 1:8 0o666",
        "mknod /sandbox/dev/urandom c 1:9 0o666",
        "mknod /sandbox/dev/tty c 5:0 0o666",
    ]
    assert ops.events[7:] == [f"symlink /sandbox/dev/{n} -> {t}" for n, t in STANDARD_LINKS.items()]
    # Nothing of the host's /dev is consulted: the tree is the same wherever it is built.
    assert not DEV_TMPFS_FLAGS & MS_NODEV


def test_build_dev_takes_other_nodes_and_links() -> None:
    ops = FakeDevOps()

    build_dev("/d", nodes=[DeviceNode("null", 1, 3, 0o600)], links={}, ops=ops)

    assert ops.events[1:] == ["mknod /d/null c 1:3 0o600"]


def test_a_refused_mknod_names_the_privileged_fix() -> None:
    with pytest.raises(DevBuildError) as raised:
        build_dev("/d", ops=FakeDevOps(refuse_mknod=True))

    assert raised.value.errno == errno.EPERM
    assert "/d/null" in str(raised.value) and "--privileged" in str(raised.value)


def test_host_device_nodes_are_gpu_character_devices_only(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in ("nvidia0", "nvidiactl", "nvidia-caps/nvidia-cap1", "null"):
        os.mknod(dev / name, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    (dev / "nvidia-notes").write_text("a regular file, not a device\n")
    (dev / "nvidia-link").symlink_to(dev / "nvidia0")

    assert host_device_nodes(dev) == [
        str(dev / "nvidia-caps" / "nvidia-cap1"),
        str(dev / "nvidia0"),
        str(dev / "nvidiactl"),
    ]


def test_no_gpu_means_no_host_nodes(tmp_path: Path) -> None:
    assert host_device_nodes(tmp_path / "missing") == []
    assert host_device_nodes(tmp_path) == []


def test_an_image_that_kept_the_hosts_dev_restores_only_on_a_devtmpfs() -> None:
    require_restorable_dev("host", "devtmpfs")
    require_restorable_dev("own", "tmpfs")
    require_restorable_dev("own", None)
    for here in ("tmpfs", None):
        with pytest.raises(DevLayoutError) as raised:
            require_restorable_dev("host", here)
        assert "bake the image again" in raised.value.message


def test_dev_fstype_reads_the_topmost_mount_at_dev() -> None:
    text = "udev /dev devtmpfs rw 0 0\ntmpfs /dev tmpfs rw 0 0\nshm /dev/shm tmpfs rw 0 0\n"
    assert dev_fstype(text) == "tmpfs"
    assert dev_fstype("proc /proc proc rw 0 0\n") is None
