"""Host observation: the listener watch reads real TCP tables; the residue scan finds a
leftover process, activation directory and /dev/shm file of ours, and nothing else."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from snapctl.qualification.watch import (
    HOST_SHM,
    ListenerWatch,
    _listening_ports,
    link_remaps,
    residue,
    take_baseline,
)
from snapctl.statedir import StateDir

TCP_TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0
   1: 0100007F:8D2A 0100007F:1F40 01 00000000:00000000 00:00000000 00000000     0
   2: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0
"""


def test_listening_ports_parses_only_listeners_on_the_port() -> None:
    assert _listening_ports(TCP_TABLE, 8000) == ["0100007F:8000"]
    assert _listening_ports(TCP_TABLE, 8001) == ["00000000:8001"]
    assert _listening_ports(TCP_TABLE, 36138) == []  # an established connection's port


def test_listener_watch_sees_a_real_listener_and_not_a_closed_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        watch = ListenerWatch(os.getpid(), port)
        assert watch.poll_once()
        seen, polls = watch.stop()
    assert seen == [f"0100007F:{port}"] and polls >= 1

    with socket.socket() as bound:  # bound, never listening: not a listener
        bound.bind(("127.0.0.1", 0))
        watch = ListenerWatch(os.getpid(), bound.getsockname()[1])
        assert watch.poll_once()
        assert watch.stop()[0] == []


def test_listener_watch_ends_when_the_process_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    watch = ListenerWatch(child.pid, 1)
    child.kill()
    child.wait()
    assert not watch.poll_once()
    watch.stop()


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return state


def test_residue_is_empty_when_nothing_was_left(state: StateDir) -> None:
    baseline = take_baseline(state)

    assert residue(state, baseline, ["no-such-shm-file"], grace_s=0).clean


def test_residue_finds_a_leftover_process_directory_and_shm_file(state: StateDir) -> None:
    (state.activations / "old").mkdir()
    baseline = take_baseline(state)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    (state.activations / "copy-left").mkdir()
    name = f"snapctl-qualify-test-{uuid.uuid4().hex}"
    (HOST_SHM / name).write_bytes(b"x")
    try:
        found = residue(state, baseline, [name], grace_s=0.1)
    finally:
        (HOST_SHM / name).unlink()
        child.kill()
        child.wait()
    assert found.processes and found.processes[0].startswith(f"{child.pid} ")
    assert found.activation_dirs == [str(state.activations / "copy-left")]
    assert found.shm_files == [name]
    assert "copy-left" in found.describe() and not found.clean


def test_link_remaps_lists_only_remap_files(tmp_path: Path) -> None:
    for name in ("link_remap.1", "sem.snapctl-fixture-sem-1", "link_remap.12"):
        (tmp_path / name).write_bytes(b"")

    assert link_remaps(tmp_path) == ["link_remap.1", "link_remap.12"]
    assert link_remaps(tmp_path / "absent") == []


def test_residue_tells_a_reused_pid_from_the_baseline_process(state: StateDir) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = take_baseline(state)
        # The same PID with another start time: an earlier process whose PID the run reused.
        reused = dataclasses.replace(
            before,
            descendants=frozenset((pid, start - 1.0) for pid, start in before.descendants),
        )

        assert residue(state, before, grace_s=0).clean
        assert residue(state, reused, grace_s=0).processes[0].startswith(f"{child.pid} ")
    finally:
        child.kill()
        child.wait()


def test_listener_watch_does_not_watch_a_pid_whose_pinned_process_is_gone() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        # The PID is ours and listening, but the pinned process it stood for has exited.
        watch = ListenerWatch(os.getpid(), server.getsockname()[1], alive=lambda: False)

        assert not watch.poll_once()
        assert watch.stop() == ([], 0)
