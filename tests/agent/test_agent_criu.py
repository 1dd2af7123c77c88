"""The real agent (``snapctl agent`` in its own process) with real CRIU, driven by the real
CLI: the same JSON with and without the agent, a copy from the pool, a foreground copy
stopped by Ctrl-C, and the agent killed while a copy serves (the copy keeps serving, a new
agent lists it, parked copies are discarded, nothing is left at the end)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from snapctl.agent.client import connect
from snapctl.criu import CriuBinary
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool.records import load_parked_records
from snapctl.statedir import STOPPED_FILE, StateDir
from snapctl.supervision.process import PinnedProcess
from tests.activation.criu_helpers import API_KEY_ENV, complete, launch_donor, leftovers
from tests.agent.helpers import (
    AgentProcess,
    Started,
    cli,
    env_for,
    fill_pool,
    gone,
    parked_rows,
    until,
    wait_parked,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

# Fields whose values differ between any two copies (ids, pids, times, ports).
VARYING = {"name", "activation_id", "root_pid", "pids", "published", "logs", "timings_s",
           "restore_stats", "lazy_pages_pid", "pages_complete_s", "pages_complete_at",
           "pages_complete"}  # fmt: skip


@pytest.fixture
def state(agent_state: StateDir) -> StateDir:
    return agent_state


@pytest.fixture
def agents(state: StateDir) -> Iterator[Started[AgentProcess]]:
    """Agents on ``state``; each still running at the end is stopped."""
    agents = Started(lambda: AgentProcess(state))
    yield agents
    for agent in agents.started:
        agent.kill(signal.SIGTERM)


def copy_args(image: Path, name: str, *extra: str) -> list[str]:
    return ["copy", "--image", str(image), "--publish", "127.0.0.1:0", "--name", name,
            "--api-key-env", API_KEY_ENV, "--timeout", "60", "--json", *extra]  # fmt: skip


def stable(report: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in report.items() if key not in VARYING}


def test_the_same_json_with_and_without_the_agent_and_a_copy_from_the_pool(
    state: StateDir, donor_image: tuple[Path, Any], agents: Started[AgentProcess]
) -> None:
    image, expected = donor_image
    local = json.loads(cli(state, "--no-agent", *copy_args(image, "local", "--detach")).stdout)
    agent = agents.start()
    through = json.loads(cli(state, *copy_args(image, "through", "--detach")).stdout)
    assert sorted(through) == sorted(local)
    assert stable(through) == stable(local)
    assert through["from_pool"] is False and through["name"] == "through"
    assert complete(through["published"]) == complete(local["published"]) == expected

    ps_local = json.loads(cli(state, "--no-agent", "ps", "--json").stdout)
    ps_through = json.loads(cli(state, "ps", "--json").stdout)
    # Each tree's PSS and its cgroup's charge, read twice from live processes, may differ by a
    # page or two.
    memory = [row.pop("memory_bytes") for row in (*ps_local, *ps_through)]
    charged = [row.pop("cgroup_memory_bytes") for row in (*ps_local, *ps_through)]
    assert all(value > 0 for value in memory) and all(value > 0 for value in charged)
    assert ps_through == ps_local and [row["name"] for row in ps_through] == ["local", "through"]

    fill_pool(state, image)
    pooled = json.loads(cli(state, *copy_args(image, "pooled", "--detach", "--no-lazy")).stdout)
    assert pooled["from_pool"] is True and pooled["name"] == "pooled"
    assert sorted(pooled) == sorted(local)
    assert complete(pooled["published"]) == expected
    metrics = cli(state, "--no-agent", "ps").stdout  # in-process still works beside the agent
    assert "pooled" in metrics
    wait_parked(state)  # refilled

    for name in ("local", "through", "pooled"):
        stopped = json.loads(cli(state, "stop", name, "--json").stdout)
        assert stopped["name"] == name and not any(stopped["audit"].values())
    cli(state, "pool", "rm", "--image", str(image))
    agent.kill(signal.SIGTERM)
    assert agent.process.returncode == 0, agent.log.read_text()
    assert state.load_records() == [] and leftovers(state) == []
    assert not (state.root / "agent.sock").exists()


def test_a_foreground_copy_through_the_agent_stops_on_ctrl_c(
    state: StateDir, donor_image: tuple[Path, Any], agents: Started[AgentProcess]
) -> None:
    image, expected = donor_image
    agents.start()
    process = subprocess.Popen(
        [sys.executable, "-m", "snapctl", *copy_args(image, "fg")], env=env_for(state),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    report = json.loads(process.stdout.readline())
    assert report["name"] == "fg" and complete(report["published"]) == expected
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0, process.stderr.read() if process.stderr else ""
    assert state.load_records() == [] and leftovers(state) == []


def test_a_foreground_copy_through_the_agent_whose_tree_exits_ends_as_in_process(
    state: StateDir, donor_image: tuple[Path, Any], agents: Started[AgentProcess]
) -> None:
    image, _ = donor_image
    agents.start()
    args = [a for a in copy_args(image, "gone") if a != "--json"]
    process = subprocess.Popen(
        [sys.executable, "-m", "snapctl", *args], env=env_for(state),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    until(lambda: [r.name for r in state.load_records()] == ["gone"] or process.poll() is not None)
    (record,) = state.load_records()
    os.kill(record.root_pid, signal.SIGKILL)  # its supervisor sees it exit and cleans up
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "copy gone" in out  # its report, drawn as in-process
    # As in-process: the supervisor's stop, from what it kept in the copy's logs.
    assert err.splitlines()[-2:] == [
        "serving; press Ctrl-C to stop", "gone: stopped (exited); cleanup: clean"
    ]  # fmt: skip
    kept = json.loads((Path(record.logs_dir) / STOPPED_FILE).read_text())
    assert kept["stopped"] == "exited" and kept["failure"] is None
    assert state.load_records() == [] and leftovers(state) == []


def test_a_foreground_lazy_copy_whose_transfer_fails_fails_as_in_process(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    image = tmp_path / "image"
    session, _ = launch_donor(image, state, criu_binary, fixture_retained_mb=256)
    session.stop()
    # Held: its pages are still missing when the client has the report, however fast.
    agent = AgentProcess(state, held_transfers=True)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "snapctl", *copy_args(image, "lazy", "--lazy")],
            env=env_for(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        report = json.loads(process.stdout.readline())
        assert report["pages_complete"] is False
        (record,) = state.load_records()
        assert record.lazy_pages_pid == report["lazy_pages_pid"]
        time.sleep(1.0)  # as on a loaded machine: unheld, every page would be in by now
        with PinnedProcess(report["lazy_pages_pid"], record.lazy_pages_start_time) as daemon:
            daemon.signal(signal.SIGKILL)  # the copy's memory is incomplete now
        _, err = process.communicate(timeout=60)
    finally:
        agent.kill(signal.SIGTERM)
    assert process.returncode == ExitStatus.ERROR, err
    (line,) = err.splitlines()  # --json: the error line only
    assert line.startswith("error: lazy: ") and line.endswith(" [phase: lazy-pages]")
    assert "before every page was copied" in line
    assert state.load_records() == [] and leftovers(state) == []


def test_the_agent_killed_a_copy_keeps_serving_and_a_new_agent_lists_it(
    state: StateDir, donor_image: tuple[Path, Any], agents: Started[AgentProcess]
) -> None:
    image, expected = donor_image
    first = agents.start()
    report = json.loads(cli(state, *copy_args(image, "survivor", "--detach")).stdout)
    fill_pool(state, image)
    (old,) = parked_rows(state)
    (supervisor,) = [
        (parked.supervisor_pid, parked.supervisor_start_time)
        for _, parked in load_parked_records(state) if parked is not None and parked.id == old["id"]
    ]  # fmt: skip
    first.kill(signal.SIGKILL)
    assert complete(report["published"]) == expected  # still serving, agent gone
    (row,) = json.loads(cli(state, "ps", "--json").stdout)  # in-process: no agent answers
    assert row["name"] == "survivor" and row["running"] and row["supervised"]
    # Its tree's PSS and its cgroup's charge, which move a page or two between reads.
    assert row.pop("memory_bytes") > 0 and row.pop("cgroup_memory_bytes") > 0

    second = agents.start()
    (listed,) = json.loads(cli(state, "ps", "--json").stdout)
    assert listed.pop("memory_bytes") > 0 and listed.pop("cgroup_memory_bytes") > 0
    assert listed == row
    # The parked copy it could not vouch for is gone (the pool may park a fresh one).
    until(lambda: old["id"] not in {row["id"] for row in parked_rows(state, "any")})
    until(lambda: gone(*supervisor))
    assert complete(report["published"]) == expected
    stopped = json.loads(cli(state, "stop", "survivor", "--json").stdout)
    assert not any(stopped["audit"].values())
    second.kill(signal.SIGTERM)
    assert leftovers(state) == []


def capture_args(command: str, image: Path, *extra: str) -> list[str]:
    return [command, "--image", str(image), "--api-key-env", API_KEY_ENV, "--timeout", "60",
            "--json", *extra]  # fmt: skip


def test_a_donor_through_the_agent_gives_the_same_json_and_outlives_the_agent(
    tmp_path: Path, state: StateDir, agents: Started[AgentProcess]
) -> None:
    donor = ("--publish", "127.0.0.1:0", "--detach")
    local = json.loads(cli(state, "--no-agent", *capture_args(
        "donor", tmp_path / "local", "--name", "local", *donor)).stdout)  # fmt: skip
    agent = agents.start()
    through = json.loads(cli(state, *capture_args(
        "donor", tmp_path / "through", "--name", "through", *donor)).stdout)  # fmt: skip
    assert sorted(through) == sorted(local)
    assert through["kind"] == local["kind"] == "donor" and through["name"] == "through"
    assert through["image"] == str(tmp_path / "through")
    expected = complete(local["published"])
    assert complete(through["published"]) == expected
    rows = json.loads(cli(state, "ps", "--json").stdout)
    assert [(row["name"], row["running"]) for row in rows] == [("local", True), ("through", True)]

    # The donor lives in the supervisor the agent's spawner forked, not in the agent.
    agent.kill(signal.SIGKILL)
    assert complete(through["published"]) == expected
    row = next(row for row in json.loads(cli(state, "ps", "--json").stdout)
               if row["name"] == "through")  # fmt: skip
    assert row["running"] and row["supervised"] and row["supervisor_pid"] != agent.process.pid
    # Its image is as good as an in-process donor's: a copy of it answers the same.
    copy = json.loads(cli(state, *copy_args(tmp_path / "through", "from-through",
                                            "--detach")).stdout)  # fmt: skip
    assert complete(copy["published"]) == expected
    for name in ("local", "through", "from-through"):
        stopped = json.loads(cli(state, "stop", name, "--json").stdout)
        assert not any(stopped["audit"].values()), stopped
    assert state.load_records() == [] and leftovers(state) == []


def test_a_bake_through_the_agent_publishes_a_verified_image_in_the_client_s_environment(
    tmp_path: Path, state: StateDir, agents: Started[AgentProcess]
) -> None:
    from snapctl.images import load_manifest

    local = json.loads(cli(state, "--no-agent", *capture_args("bake", tmp_path / "local")).stdout)
    agents.start()  # its environment has no VLLM_CPU_KVCACHE_SPACE
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "snapctl", *capture_args("bake", Path("baked"))],
        env=env_for(state, VLLM_CPU_KVCACHE_SPACE="1"), cwd=work, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    through = json.loads(done.stdout)
    assert list(through) == list(local) and through["clean"] is True
    assert through["image"] == str(work / "baked")  # relative to the client's directory
    inspected = json.loads(cli(state, "inspect", "--verify", "--json", str(work / "baked")).stdout)
    assert inspected["verified"] is True
    # The identity records the client's environment, not the agent's.
    baked = load_manifest(work / "baked").identity
    unmarked = load_manifest(tmp_path / "local").identity
    assert baked is not None and "VLLM_CPU_KVCACHE_SPACE" in baked.env
    assert unmarked is not None and "VLLM_CPU_KVCACHE_SPACE" not in unmarked.env
    copy = json.loads(cli(state, *copy_args(work / "baked", "from-bake", "--detach")).stdout)
    assert copy["from_pool"] is False and complete(copy["published"])
    cli(state, "stop", "from-bake")

    # A bad request is refused before anything starts, with its reason.
    client = connect(state.root / "agent.sock")
    assert client is not None
    with pytest.raises(SnapctlError, match="image: String should match"):
        client.call("POST", "/bakes", {"image": "relative", "cwd": "/", "environ": {}})
    assert leftovers(state) == []


def test_a_foreground_donor_through_the_agent_stops_on_ctrl_c(
    tmp_path: Path, state: StateDir, agents: Started[AgentProcess]
) -> None:
    def foreground(*args: str, image: str, name: str) -> dict[str, Any]:
        process = subprocess.Popen(
            [sys.executable, "-m", "snapctl", *args, *capture_args(
                "donor", tmp_path / image, "--name", name, "--publish", "127.0.0.1:0")],
            env=env_for(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        report: dict[str, Any] = json.loads(process.stdout.readline())
        assert report["name"] == name and report["kind"] == "donor"
        assert complete(report["published"])
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0, process.stderr.read() if process.stderr else ""
        assert state.load_records() == [] and leftovers(state) == []
        return report

    local = foreground("--no-agent", image="local", name="local")
    agents.start()
    through = foreground(image="through", name="fg")
    assert list(through) == list(local)  # the report model's field order, as in-process


@pytest.mark.parametrize("command", ["bake", "donor"])
def test_ctrl_c_interrupts_a_capture_through_the_agent_and_leaves_nothing(
    tmp_path: Path, state: StateDir, agents: Started[AgentProcess], command: str
) -> None:
    """The signal reaches the capture in the agent's supervisor, as it does in-process: the
    command ends within seconds (not when the capture would have), exit 130 and no message,
    no image published, the server's tree stopped."""
    agents.start()
    image = tmp_path / "captured"
    marker = f"never-ready-{tmp_path.name}"
    server = [sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "snapctl", command, "--image", str(image), "--ready-timeout",
         "120", "--", *server],
        env=env_for(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def servers() -> list[psutil.Process]:  # observed only: never signalled by name
        # The server itself: the command's own argv holds the marker too.
        return [found for found in psutil.process_iter(["cmdline"])
                if (found.info["cmdline"] or [])[: len(server)] == server]  # fmt: skip

    try:
        until(lambda: bool(servers()), timeout_s=60)  # launched: the capture waits on it
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == ExitStatus.INTERRUPTED, err
    assert time.monotonic() - started < 30 and out == "" and err.strip() == ""
    assert not (image / "manifest.json").exists()
    until(lambda: not servers(), timeout_s=30)
    assert state.load_records() == [] and leftovers(state) == []
