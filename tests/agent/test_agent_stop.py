"""A stopping agent ends ``logs -f`` streams at once (their clients fail with a clear error,
exit 7) instead of waiting for them as for a copy request, which it still drains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.agent.client import AgentClient, connect
from snapctl.errors import ExitStatus
from snapctl.statedir import StateDir
from tests.agent.conftest import RunningAgent, make_report
from tests.agent.test_parity import save_record

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], StateDir]]:
    """``snapctl agent`` in its own process, on a state directory in tmp_path."""
    state = StateDir(tmp_path / "state")
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state.root)}
    env.pop("SNAPCTL_AGENT_SOCKET", None)
    log = (tmp_path / "agent.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "snapctl", "agent", "--no-share-memory"],
                               env=env, stdout=log, stderr=log)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while connect(state.root / "agent.sock") is None:
            assert process.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "the agent did not answer"
            time.sleep(0.05)
        yield process, state
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


def test_sigterm_to_the_agent_ends_a_logs_follow_at_once(
    agent_process: tuple[subprocess.Popen[bytes], StateDir], tmp_path: Path
) -> None:
    process, state = agent_process
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "server.log").write_text("first line\n")
    save_record(state, "quiet", logs_dir=str(logs))  # recorded: the follow would never end
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state.root)}
    env.pop("SNAPCTL_NO_AGENT", None)
    follower = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "logs", "-f", "quiet"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline() == "first line\n"  # following, through the agent
        started = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(60) == 0
        stopped_s = time.monotonic() - started
        out, err = follower.communicate(timeout=10)
        assert out == ""  # nothing more was written
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)
    assert stopped_s < 30, stopped_s  # not the 60 s drain a copy request gets
    assert follower.returncode == ExitStatus.UNAVAILABLE, err
    assert err.strip() == (
        "error: the agent is stopping, so it stopped following quiet, which still runs: run "
        "snapctl logs -f quiet again"
    )


def test_a_stopping_agent_waits_for_a_copy_request_but_not_for_a_follower(
    running_agent: RunningAgent, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "server.log").write_text("hello\n")
    save_record(running_agent.state, "quiet", logs_dir=str(logs))
    image = tmp_path / "image"
    image.mkdir()
    release = running_agent.spawner.release = threading.Event()
    followed: list[Any] = []
    copy_report: list[Any] = []

    def follow() -> None:
        followed.extend(AgentClient(running_agent.socket).stream(
            "GET", "/activations/quiet/logs?follow=1", read_timeout_s=None))  # fmt: skip

    def copy() -> None:
        body = {"image": str(image), "lazy": False, "detach": True}
        copy_report.extend(AgentClient(running_agent.socket).stream("POST", "/copies", body))

    threads = [threading.Thread(target=follow), threading.Thread(target=copy)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while not (running_agent.spawner.jobs and followed) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert followed == [{"text": "hello\n"}]  # both in flight
    started = time.monotonic()
    ends = threading.Timer(1.0, release.set)  # the copy's start ends 1 s into the stop
    ends.start()
    running_agent.agent.stop()
    stopped_s = time.monotonic() - started
    ends.join()
    for thread in threads:
        thread.join(10)
    assert 1.0 <= stopped_s < 30, stopped_s  # the copy's start drained, not the 60 s wait
    assert copy_report[-1] == {"report": make_report()}
    _, last = followed
    assert "the agent is stopping, so it stopped following quiet" in last["error"]
    assert last["status"] == ExitStatus.UNAVAILABLE
