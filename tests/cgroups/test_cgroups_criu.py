"""Cgroups per activation with real CRIU and the bundled fixture: a donor and its copies (plain
and lazy) each in their own cgroup with their limits, a copy killed by its memory limit
reported as such with nothing left, and gc removing a cgroup a killed snapctl left."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from snapctl.activation.native import tree_pids
from snapctl.activation.session import Session
from snapctl.cgroups import Limits, create_cgroup, parse_size, sweep_cgroups
from snapctl.cgroups.group import own_pid_cgroup
from snapctl.criu import CriuBinary
from snapctl.gc import collect_garbage
from snapctl.statedir import StateDir
from snapctl.supervision.listing import activation_rows
from snapctl.supervision.process import PinnedProcess
from tests.activation.criu_helpers import launch_donor, leftovers, restore_copy, stop_clean

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def _in_cgroup(pid: int, path: str) -> bool:
    """Whether ``pid`` is in ``path`` in its memory hierarchy (v1) or the unified one (v2)."""
    for line in own_pid_cgroup(pid).splitlines():
        _, controllers, where = line.split(":", 2)
        if ("memory" in controllers.split(",") or controllers == "") and where == path:
            return True
    return False


def test_donor_and_copy_each_in_own_cgroup_with_limits(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    image = tmp_path / "image"
    limits = Limits(memory_bytes=parse_size("1g"), cpus=1.5)
    donor, report = launch_donor(image, state, criu_binary, limits=limits)
    running.append(donor)
    assert donor.cgroup is not None
    assert all(_in_cgroup(pid, donor.cgroup.path) for pid in report.pids), report.pids
    copy, copy_report = restore_copy(image, state, criu_binary, limits=limits)
    running.append(copy)
    group = copy.cgroup
    assert group is not None and group.path != donor.cgroup.path
    pids = tree_pids(copy_report.root_pid)
    assert pids and all(_in_cgroup(pid, group.path) for pid in pids), (pids, group.path)
    assert set(pids) <= set(group.pids())
    usage = group.usage()
    assert usage.memory_limit_bytes == parse_size("1g") and usage.cpus == 1.5
    assert usage.memory_bytes and usage.memory_bytes > 0
    if group.version == 1:
        assert (group.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "150000"
    else:
        assert (group.dirs["unified"] / "cpu.max").read_text().split() == ["150000", "100000"]
    row = next(r for r in activation_rows(state) if r["name"] == copy.name)
    assert row["cgroup"] == group.path and row["memory_limit_bytes"] == parse_size("1g")
    assert row["cgroup_memory_bytes"] and row["cgroup_memory_bytes"] > 0
    # A lazy copy too: its tree is restored into its own cgroup, its pages charged there.
    lazy, lazy_report = restore_copy(image, state, criu_binary, limits=limits, lazy=True)
    running.append(lazy)
    assert lazy_report.lazy and lazy.cgroup is not None
    lazy_pids = tree_pids(lazy_report.root_pid)
    assert lazy_pids and all(_in_cgroup(pid, lazy.cgroup.path) for pid in lazy_pids)
    lazy_usage = lazy.cgroup.usage()
    assert lazy_usage.memory_limit_bytes == parse_size("1g") and lazy_usage.cpus == 1.5
    assert lazy_usage.memory_bytes and lazy_usage.memory_bytes > 0
    stop_clean(lazy)
    stop_clean(copy)
    stop_clean(donor)
    assert not any(d.exists() for d in group.dirs.values())
    assert not any(d.exists() for d in donor.cgroup.dirs.values())


def test_copy_past_its_memory_limit_is_killed_and_reported(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    image = tmp_path / "image"
    # The fixture releases its retained memory before the capture and fills it again when
    # activated: a limit the parked copy fits in, but not the filled one.
    donor, _ = launch_donor(image, state, criu_binary, fixture_retained_mb=512)
    running.append(donor)
    stop_clean(donor)
    with pytest.raises(Exception) as raised:
        copy, _ = restore_copy(
            image, state, criu_binary, limits=Limits(memory_bytes=parse_size("384m"))
        )
        running.append(copy)
    assert "killed by its memory limit (--memory 384m)" in str(raised.value)
    assert leftovers(state) == []
    leftover_cgroups = [
        child
        for parent in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))
        for child in parent.glob("**/snapctl/copy-*")
        if child.name in str(raised.value)
    ]
    assert leftover_cgroups == []


def test_gc_removes_a_cgroup_a_killed_snapctl_left(state: StateDir) -> None:
    name = f"{state.cgroup_prefix}copy-gc{uuid.uuid4().hex[:12]}"
    group = create_cgroup(name, Limits(memory_bytes=parse_size("64m")))
    assert group is not None
    sleeper = subprocess.Popen(group.enter_argv(["sleep", "30"]))
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in group.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sleeper.pid in group.pids()
        # Not empty: left alone.
        assert f"cgroup {group.path}" not in sweep_cgroups(set(), grace_s=0.0)
    finally:
        with PinnedProcess(sleeper.pid) as pinned:
            pinned.signal(signal.SIGKILL)
        sleeper.wait()
    report = collect_garbage(state, cgroup_grace_s=0.0)
    assert f"cgroup {group.path}" in report.removed
    assert not any(d.exists() for d in group.dirs.values())
