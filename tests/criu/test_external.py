"""Which mounts are dumped as external host mounts, and where a restore binds them from."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.criu import external
from snapctl.criu.external import HostMountMissing, host_key, host_mount_sources

TABLE = [
    ("/", "ext4"),
    ("/proc", "proc"),
    ("/dev/shm", "tmpfs"),
    ("/usr/local/nvidia", "squashfs"),
    ("/data", "ext4"),
    ("/run/snapctl/control", "tmpfs"),
    ("/mnt/models", "nfs4"),
    ("/sys/fs/cgroup", "cgroup2"),
]


def test_undumpable_mounts_are_those_criu_refuses_but_the_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(external, "mountinfo", lambda pid: TABLE)
    assert external.undumpable_mounts(42, skip=["/mnt/models"]) == {
        "host:/usr/local/nvidia": "/usr/local/nvidia",
        "host:/data": "/data",
    }


def test_host_mount_sources_bind_the_same_path_and_ignore_snapctl_keys(tmp_path: Path) -> None:
    recorded = {"shm": "/dev/shm", host_key(str(tmp_path)): str(tmp_path)}
    assert host_mount_sources(recorded) == {host_key(str(tmp_path)): tmp_path}


def test_a_missing_host_mount_is_named(tmp_path: Path) -> None:
    gone = tmp_path / "usr-local-nvidia"
    with pytest.raises(HostMountMissing, match="does not have") as info:
        host_mount_sources({host_key(str(gone)): str(gone)})
    assert info.value.path == gone


def test_a_host_mount_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    planted = tmp_path / "models"
    planted.symlink_to(tmp_path / "real")
    with pytest.raises(HostMountMissing, match="through a symlink") as info:
        host_mount_sources({host_key(str(planted)): str(planted)})
    assert info.value.path == planted
