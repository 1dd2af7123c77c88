"""A parked copy's cgroup columns (pool ls, /metrics) read from a real cgroup: a sleeping
child stands for its tree, in a cgroup made as a copy's restore makes it. Needs root and a
cgroup hierarchy; skips without them."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.cgroups import ActivationCgroup, Limits, create_cgroup
from snapctl.pool.memory import cgroup_columns
from snapctl.pool.models import ParkedRecord
from snapctl.statedir import StateDir
from snapctl.supervision.process import start_time
from tests.pool.test_warm import make_record

pytestmark = pytest.mark.timeout(60)
ACTIVATION = "copy-0123456789ab"


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[StateDir, ActivationCgroup]]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    state = StateDir(tmp_path / "state")
    made = create_cgroup(state.cgroup_prefix + ACTIVATION, Limits(memory_bytes=64 << 20))
    if made is None:
        pytest.skip("no usable cgroup hierarchy")
    yield state, made
    assert made.remove()


def record_of(child: subprocess.Popen[bytes], activation_id: str | None) -> ParkedRecord:
    return make_record("pool-0123456789ab", "/images/one", ("0" * 64, "sha256:x"),
                       os.getpid(), os.getpid(), start_time(os.getpid()),
                       activation_id=activation_id, root_pid=child.pid,
                       root_start_time=start_time(child.pid))  # fmt: skip


def test_a_parked_copy_s_cgroup_its_charge_and_limit(
    group: tuple[StateDir, ActivationCgroup],
) -> None:
    state, made = group
    child = subprocess.Popen(made.enter_argv(["sleep", "30"]))
    try:
        deadline = time.monotonic() + 10.0
        while child.pid not in made.pids():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        record = record_of(child, ACTIVATION)

        columns = cgroup_columns(record, state.cgroup_prefix)

        assert columns["cgroup"] == made.path
        assert columns["memory_limit_bytes"] == 64 << 20
        assert isinstance(columns["cgroup_memory_bytes"], int)
        assert columns["cgroup_memory_bytes"] > 0
        # Not parked yet (no activation), or a tree outside its cgroup: no columns.
        assert cgroup_columns(record_of(child, None), state.cgroup_prefix) == {}
        assert cgroup_columns(record, "other-") == {}
    finally:
        child.kill()
        child.wait()
    # Its tree gone: no columns, though the cgroup is still there.
    assert cgroup_columns(record, state.cgroup_prefix) == {}
