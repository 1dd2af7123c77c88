"""The real agent (``snapctl agent`` in its own process) with real CRIU, driven by the real
CLI: the same JSON with and without the agent, a copy from the pool, a foreground copy
stopped by Ctrl-C, and the agent killed while a copy serves (the copy keeps serving, a new
agent lists it, parked copies are discarded, nothing is left at the end)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY_ENV, complete, leftovers
from tests.agent.helpers import (
    AgentProcess,
    Started,
    cli,
    env_for,
    fill_pool,
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


def test_the_agent_killed_a_copy_keeps_serving_and_a_new_agent_lists_it(
    state: StateDir, donor_image: tuple[Path, Any], agents: Started[AgentProcess]
) -> None:
    image, expected = donor_image
    first = agents.start()
    report = json.loads(cli(state, *copy_args(image, "survivor", "--detach")).stdout)
    fill_pool(state, image)
    (old,) = parked_rows(state)
    first.kill(signal.SIGKILL)
    assert complete(report["published"]) == expected  # still serving, agent gone
    (row,) = json.loads(cli(state, "ps", "--json").stdout)  # in-process: no agent answers
    assert row["name"] == "survivor" and row["running"] and row["supervised"]

    second = agents.start()
    assert json.loads(cli(state, "ps", "--json").stdout) == [row]
    # The parked copy it could not vouch for is gone (the pool may park a fresh one).
    until(lambda: old["id"] not in {row["id"] for row in parked_rows(state, "any")})
    until(lambda: not psutil.pid_exists(old["supervisor_pid"]) or psutil.Process(
        old["supervisor_pid"]).status() == psutil.STATUS_ZOMBIE)  # fmt: skip
    assert complete(report["published"]) == expected
    stopped = json.loads(cli(state, "stop", "survivor", "--json").stdout)
    assert not any(stopped["audit"].values())
    second.kill(signal.SIGTERM)
    assert leftovers(state) == []
