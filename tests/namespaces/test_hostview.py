"""Which host mounts a sandbox hides and which host paths it binds in (no root needed)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.criu.external import host_key, undumpable
from snapctl.namespaces.hostview import (
    HostMount,
    PrivatePathError,
    hidden_mounts,
    host_binds,
    is_within,
    mounts_to_detach,
    server_paths,
    venv_root,
)

# What `ip netns add x` (and a deleted one) leaves on a host whose /run is not a tmpfs, beside
# an ordinary Debian host's mounts, a GPU driver tree, a data disk and snapctl's own tmpfs.
HOST = [
    HostMount("/", "ext4", "/dev/vda"),
    HostMount("/proc", "proc", "proc"),
    HostMount("/sys", "sysfs", "sysfs"),
    HostMount("/sys/fs/cgroup", "cgroup2", "cgroup2"),
    HostMount("/dev", "devtmpfs", "devtmpfs"),
    HostMount("/dev/shm", "tmpfs", "tmpfs"),
    HostMount("/dev/pts", "devpts", "devpts"),
    HostMount("/usr/local/nvidia", "squashfs", "/dev/loop0"),
    HostMount("/data", "xfs", "/dev/vdb"),
    HostMount("/run/netns", "ext4", "/dev/vda[/run/netns]"),
    HostMount("/run/netns/cni-1234", "nsfs", "nsfs[net:[4026532999]]"),
    HostMount("/run/user/0", "tmpfs", "tmpfs"),
    HostMount("/tmp", "tmpfs", "tmpfs"),
    HostMount("/var/lib/kubelet/pods/p/volumes/models", "nfs", "server:/models"),
    HostMount("/var/lib/kubelet/pods/p/volumes/secret", "tmpfs", "tmpfs"),
    HostMount("/var/lib/docker/netns/abc", "nsfs", "nsfs[net:[4026533000]]"),
    HostMount("/srv/ns/bound", "nsfs", "nsfs[net:[4026533001]]"),
    HostMount("/var/lib/snapctl/activations/copy-1/shm", "tmpfs", "snapctl-copy-1"),
]


def test_a_sandbox_detaches_runtime_mounts_nsfs_and_foreign_tmpfs_children_first() -> None:
    detached = mounts_to_detach(HOST, needed=["/work/server", "/usr/bin/python3"])
    assert detached == [
        "/var/lib/snapctl/activations/copy-1/shm",
        "/srv/ns/bound",
        "/var/lib/docker/netns/abc",
        "/var/lib/kubelet/pods/p/volumes/secret",
        "/var/lib/kubelet/pods/p/volumes/models",
        "/tmp",
        "/run/user/0",
        "/run/netns/cni-1234",
        "/run/netns",
        "/dev/pts",
        "/dev/shm",
        "/dev",
    ]
    # What stays: the root, the pseudo filesystems, a driver tree and a data disk (/dev goes
    # whole: each sandbox builds its own).
    kept = {m.point for m in HOST} - set(detached)
    assert kept == {"/", "/proc", "/sys", "/sys/fs/cgroup", "/usr/local/nvidia", "/data"}


def test_a_containers_dev_goes_whole_like_a_hosts() -> None:
    container = [
        HostMount("/", "overlay", "overlay"),
        HostMount("/dev", "tmpfs", "tmpfs"),
        HostMount("/dev/pts", "devpts", "devpts"),
        HostMount("/dev/mqueue", "mqueue", "mqueue"),
        HostMount("/dev/shm", "tmpfs", "shm"),
        HostMount("/etc/hosts", "ext4", "/dev/vda"),
    ]
    needed = ["/dev/nvidia0"]  # even a path the server names there: binds bring it back
    assert mounts_to_detach(container, needed) == ["/dev/shm", "/dev/mqueue", "/dev/pts", "/dev"]
    # Rebuilt, not missed: doctor does not list them.
    assert hidden_mounts(container) == []


def test_a_transient_mount_the_server_needs_stays_but_private_roots_never_do() -> None:
    needed = ["/var/lib/kubelet/pods/p/volumes/models/llama", "/tmp/model", "/run/user/0/x"]
    detached = mounts_to_detach(HOST, needed)
    assert "/var/lib/kubelet/pods/p/volumes/models" not in detached
    # Under /run and /tmp everything goes: what the server needs there is bound in instead.
    assert {"/tmp", "/run/user/0", "/run/netns"} <= set(detached)


def test_a_path_that_only_shares_a_prefix_is_not_held() -> None:
    mounts = [HostMount("/", "ext4"), HostMount("/var/lib/docker", "xfs")]
    assert mounts_to_detach(mounts, needed=["/var/lib/dockerfile/x"]) == ["/var/lib/docker"]
    assert mounts_to_detach(mounts, needed=["/var/lib/docker/x"]) == []


def test_doctor_reports_runtime_and_nsfs_mounts_but_not_snapctls_own() -> None:
    assert [m.point for m in hidden_mounts(HOST)] == [
        "/run/netns",
        "/run/netns/cni-1234",
        "/run/user/0",
        "/var/lib/kubelet/pods/p/volumes/models",
        "/var/lib/kubelet/pods/p/volumes/secret",
        "/var/lib/docker/netns/abc",
        "/srv/ns/bound",
    ]


def test_hidden_mounts_never_become_external_host_mounts() -> None:
    entries = [(m.point, m.fstype) for m in HOST]
    assert undumpable(entries) == {
        host_key("/usr/local/nvidia"): "/usr/local/nvidia",
        host_key("/data"): "/data",
        # Kept only where the server needs it, then bound back like any undumpable mount.
        host_key(
            "/var/lib/kubelet/pods/p/volumes/models"
        ): "/var/lib/kubelet/pods/p/volumes/models",
    }


def test_server_paths_are_the_cwd_and_existing_absolute_arguments(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    link = tmp_path / "link"
    link.symlink_to(model)
    argv = ["/usr/bin/env", "serve", f"--model={link}", str(tmp_path / "absent"), "relative"]
    assert server_paths(argv, "/work") == sorted(
        {"/usr/bin/env", "/work", str(link), str(model.resolve())}
    )


def test_host_binds_are_the_outermost_server_paths_under_tmp(tmp_path: Path) -> None:
    assert str(tmp_path).startswith("/tmp/")
    model = tmp_path / "state" / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    other = Path("/tmp") / (tmp_path.name + "-sibling")
    other.mkdir()
    try:
        argv = ["/usr/bin/python3", "-m", "serve", "--model", str(model), "--config",
                str(model / "config.json"), "--ipc", "/tmp", "--sibling", str(other)]  # fmt: skip
        assert host_binds(argv, cwd=str(tmp_path / "state")) == [
            str(tmp_path / "state"),
            str(other),
        ]
        assert host_binds(argv[:3], cwd="/work") == []
    finally:
        other.rmdir()


def test_a_working_directory_that_is_a_private_root_is_refused() -> None:
    with pytest.raises(PrivatePathError, match="/tmp is private to each sandbox"):
        host_binds(["/usr/bin/python3"], cwd="/tmp")


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory directly in /tmp (where any user may plant a symlink), removed after."""
    top = Path(tempfile.mkdtemp(prefix="snapctl-hostview-", dir="/tmp"))
    try:
        yield top
    finally:
        shutil.rmtree(top)


def test_a_symlink_planted_in_tmp_is_refused_not_bound_through(
    in_tmp: Path, tmp_path: Path
) -> None:
    elsewhere = Path(tempfile.mkdtemp(prefix="snapctl-hostview-secret-", dir="/var/tmp"))
    try:
        planted = Path("/tmp") / f"{in_tmp.name}-models"
        planted.symlink_to(elsewhere)
        try:
            why = rf"names {planted}, which reaches {elsewhere} through a symlink under /tmp"
            with pytest.raises(PrivatePathError, match=rf"{why}.*name {elsewhere} instead"):
                host_binds(["/usr/bin/python3", "--model", str(planted)], cwd="/")
        finally:
            planted.unlink()
    finally:
        elsewhere.rmdir()


def test_only_resolved_paths_are_bound_and_links_inside_a_bind_are_kept(in_tmp: Path) -> None:
    work, target = in_tmp / "work", in_tmp / "v2"
    (work / "models").mkdir(parents=True)
    target.mkdir()
    (work / "current").symlink_to(target)  # inside the bound work dir: the sandbox has it
    (work / "etc").symlink_to("/etc")
    argv = ["/usr/bin/python3", "--model", str(work / "current"), "--conf", str(work / "etc")]
    binds = host_binds(argv, cwd=str(work))
    assert binds == [str(target), str(work)]
    assert all(os.path.realpath(path) == path for path in binds)


def test_a_venv_under_tmp_run_from_elsewhere_is_bound_whole(in_tmp: Path) -> None:
    venv = in_tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / "bin" / "serve").write_text(f"#!{venv / 'bin' / 'python'}\n")
    for program in ("python", "serve"):
        assert venv_root(str(venv / "bin" / program)) == str(venv)
        assert host_binds([str(venv / "bin" / program), "-m", "x"], cwd="/") == [str(venv)]
    assert venv_root("/usr/bin/python3") is None or not is_within(
        str(venv_root("/usr/bin/python3")), "/tmp"
    )


def test_a_program_linked_out_of_tmp_without_a_venv_is_refused(in_tmp: Path) -> None:
    (in_tmp / "bin").mkdir()
    (in_tmp / "bin" / "tool").symlink_to(os.path.realpath(sys.executable))
    with pytest.raises(PrivatePathError, match="through a symlink under /tmp"):
        host_binds([str(in_tmp / "bin" / "tool")], cwd="/")
