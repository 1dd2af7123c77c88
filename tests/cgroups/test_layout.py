"""Cgroups on fake trees under tmp_path (no root): both layouts, limits, usage, OOM kills,
removal and gc's sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.cgroups import CgroupError, Limits, create_cgroup, detect_layout, sweep_cgroups
from snapctl.cgroups.group import ActivationCgroup
from snapctl.cgroups.limits import format_size, parse_cpus, parse_size

V1_SELF = "9:name=systemd:/\n8:pids:/\n4:memory:/machine/abc\n1:cpu,cpuacct:/\n0::/\n"


def v1_tree(root: Path) -> Path:
    for controller in ("memory", "cpu", "pids"):
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    (root / "unified").mkdir()
    (root / "unified" / "cgroup.controllers").write_text("")
    return root


def v2_tree(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_sizes_and_cpus() -> None:
    assert parse_size("512m") == 512 << 20 and parse_size("4g") == 4 << 30
    assert parse_size("1.5g") == 3 << 29 and parse_size("67108864") == 64 << 20
    assert format_size(512 << 20) == "512m" and format_size(4 << 30) == "4g"
    assert parse_cpus("1.5") == 1.5
    for bad in ("lots", "1m", "-1g"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_cpus("0")
    assert Limits(memory_bytes=512 << 20, cpus=2).describe() == "--memory 512m --cpus 2"


def test_v1_hybrid_layout(tmp_path: Path) -> None:
    layout = detect_layout(v1_tree(tmp_path / "cg"), V1_SELF)
    assert layout is not None and layout.version == 1
    assert layout.parents["memory"] == tmp_path / "cg/memory/machine/abc/snapctl"
    assert layout.parents["cpu"] == tmp_path / "cg/cpu/snapctl"
    group = create_cgroup("copy-1", Limits(memory_bytes=512 << 20, cpus=1.5), layout=layout)
    assert group is not None and group.path == "/machine/abc/snapctl/copy-1"
    memory, cpu = group.dirs["memory"], group.dirs["cpu"]
    assert (memory / "memory.limit_in_bytes").read_text() == f"{512 << 20}\n"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "150000\n"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000\n"
    assert group.memory_limit_bytes() == 512 << 20
    (memory / "memory.usage_in_bytes").write_text("1234\n")
    (memory / "cgroup.procs").write_text("10\n11\n")
    assert group.memory_bytes() == 1234 and group.pids() == [10, 11]
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert group.killed_by_memory_limit() is None
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.killed_by_memory_limit() == "killed by its memory limit (--memory 512m)"
    argv = group.enter_argv(["criu", "restore"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[-2:] == ["criu", "restore"]
    assert str(memory / "cgroup.procs") in argv


def test_v2_layout_enables_controllers(tmp_path: Path) -> None:
    root = v2_tree(tmp_path / "cg")
    layout = detect_layout(root, "0::/system.slice/snapctl-agent.service\n")
    assert layout is not None and layout.version == 2
    assert layout.parents["unified"] == root / "system.slice/snapctl"
    group = create_cgroup("copy-2", Limits(memory_bytes=1 << 30, cpus=0.5), layout=layout)
    assert group is not None and group.path == "/system.slice/snapctl/copy-2"
    assert "+memory" in (root / "cgroup.subtree_control").read_text()
    directory = group.dirs["unified"]
    assert (directory / "memory.max").read_text() == f"{1 << 30}\n"
    assert (directory / "cpu.max").read_text() == "50000 100000\n"
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.usage().oom_kills == 1
    (directory / "memory.max").write_text("max\n")
    assert group.memory_limit_bytes() is None


def test_no_hierarchy(tmp_path: Path) -> None:
    tmp_path.joinpath("empty").mkdir()
    assert detect_layout(tmp_path / "empty", "0::/\n") is None
    assert create_cgroup("copy-3", Limits(), root=tmp_path / "empty") is None
    with pytest.raises(CgroupError):
        create_cgroup("copy-3", Limits(cpus=1), root=tmp_path / "empty")


@pytest.mark.parametrize("limits", [Limits(memory_bytes=512 << 20), Limits()])
def test_a_failed_create_removes_only_what_it_made(tmp_path: Path, limits: Limits) -> None:
    # A name already taken in one hierarchy (the last one made): the directories made before
    # it go, the one that was there stays.
    layout = detect_layout(v1_tree(tmp_path / "cg"), V1_SELF)
    assert layout is not None and list(layout.parents) == ["memory", "cpu", "pids"]
    theirs = layout.parents["pids"] / "copy-1"
    theirs.mkdir(parents=True)
    if limits.any:
        with pytest.raises(CgroupError, match="cannot make the cgroup"):
            create_cgroup("copy-1", limits, layout=layout)
    else:
        assert create_cgroup("copy-1", limits, layout=layout) is None
    assert theirs.is_dir()
    assert not (layout.parents["memory"] / "copy-1").exists()
    assert not (layout.parents["cpu"] / "copy-1").exists()


def test_a_create_whose_name_is_taken_leaves_that_cgroup(tmp_path: Path) -> None:
    root = v2_tree(tmp_path / "cg")
    layout = detect_layout(root, "0::/\n")
    assert layout is not None
    theirs = layout.parents["unified"] / "copy-1"
    theirs.mkdir(parents=True)
    with pytest.raises(CgroupError):
        create_cgroup("copy-1", Limits(cpus=1), layout=layout)
    assert theirs.is_dir()


def test_sweep_keeps_live_and_busy(tmp_path: Path) -> None:
    layout = detect_layout(v1_tree(tmp_path / "cg"), V1_SELF)
    assert layout is not None
    for name in ("copy-live", "copy-busy", "copy-dead"):
        assert create_cgroup(name, Limits(), layout=layout) is not None
    (layout.parents["memory"] / "copy-busy" / "cgroup.procs").write_text("99\n")
    # A fake tree's directories hold files, so rmdir fails there: only what was tried counts.
    removed = sweep_cgroups({"copy-live"}, layout=layout, grace_s=0.0)
    assert all("copy-live" not in r and "copy-busy" not in r for r in removed)
    assert sweep_cgroups(set(), layout=layout) == []  # all made just now


def test_sweep_takes_only_its_own_state_directory_s_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = detect_layout(v1_tree(tmp_path / "cg"), V1_SELF)
    assert layout is not None
    for name in ("aaaa-copy-1", "bbbb-copy-1"):
        assert create_cgroup(name, Limits(), layout=layout) is not None
    tried: list[str] = []

    def remove(self: ActivationCgroup, timeout_s: float) -> bool:
        tried.append(self.path)
        return True

    monkeypatch.setattr(ActivationCgroup, "remove", remove)
    removed = sweep_cgroups(set(), prefix="aaaa-", layout=layout, grace_s=0.0)
    assert tried == [path.removeprefix("cgroup ") for path in removed]
    assert tried and all(path.endswith("/aaaa-copy-1") for path in tried)


# A container's view on v1 (runc, the host's cgroup namespace): every hierarchy is mounted
# from the container's cgroup down, and /proc/self/cgroup names it from the host's root.
CONTAINER = "/libpod_parent/libpod-1234"
CONTAINER_SELF = "".join(
    f"{n}:{c}:{CONTAINER}\n" for n, c in ((8, "pids"), (4, "memory"), (1, "cpu,cpuacct"))
)


def container_mountinfo(root: Path) -> str:
    lines = [f"88 81 0:48 / {root} rw - tmpfs tmpfs rw"]
    for number, name in enumerate(("memory", "cpu,cpuacct", "pids")):
        options = name.replace(",", " ")
        lines.append(f"{90 + number} 88 0:3{number} {CONTAINER} {root / name} rw - cgroup cgroup "
                     f"rw,{options}")  # fmt: skip
    return "\n".join(lines) + "\n"


def test_inside_a_container_its_own_cgroup_is_the_top_of_each_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cg"
    for name in ("memory", "cpu,cpuacct", "pids"):
        (root / name).mkdir(parents=True)
        (root / name / "cgroup.procs").write_text("")
    (root / "cpu").symlink_to(root / "cpu,cpuacct")

    layout = detect_layout(root, CONTAINER_SELF, mountinfo=container_mountinfo(root))

    assert layout is not None and layout.version == 1
    # Below the mount, not below the host's path repeated inside it.
    assert layout.parents["memory"] == root / "memory" / "snapctl"
    assert layout.parents["cpu"] == root / "cpu" / "snapctl"
    group = create_cgroup("copy-1", Limits(memory_bytes=512 << 20), layout=layout)
    assert group is not None
    # As /proc/PID/cgroup names it.
    assert group.path == f"{CONTAINER}/snapctl/copy-1"
    # gc names what it sweeps the same way (a fake tree's directories hold files: no rmdir).
    monkeypatch.setattr(ActivationCgroup, "remove", lambda self, timeout_s: True)
    assert sweep_cgroups(set(), layout=layout, grace_s=0.0) == [
        f"cgroup {CONTAINER}/snapctl/copy-1"
    ]


def test_a_cgroup_namespace_shows_its_root_as_the_mounts_top(tmp_path: Path) -> None:
    root = v2_tree(tmp_path / "cg")
    mountinfo = f"30 25 0:26 / {root} rw - cgroup2 cgroup2 rw\n"

    layout = detect_layout(root, "0::/\n", mountinfo=mountinfo)

    assert layout is not None and layout.parents == {"unified": root / "snapctl"}
    assert layout.roots == {}
