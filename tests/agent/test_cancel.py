"""A request whose client leaves, without root: an interrupted ``snapctl donor``/``bake``
hangs up, and the agent SIGTERMs the supervisor serving it (pinned by its pidfd), which stops
within seconds (here: a real child process standing in for the supervisor, as
:class:`~snapctl.supervision.signals.StopSignals` make it report); a foreground copy or donor
whose client is gone by its report is stopped; the TCP listener refuses captures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.agent.daemon import Agent, AgentOptions
from snapctl.errors import INTERRUPTED_MESSAGE, ExitStatus
from snapctl.pool.spawner import SpawnedJob
from snapctl.statedir import StateDir
from tests.agent.conftest import FakePool, FakeSpawner, RunningAgent, make_report

pytestmark = pytest.mark.timeout(60)

# A supervisor that takes a minute to capture: on SIGTERM it reports the interrupted start,
# as run_capture's StopSignals make the real one do, and exits.
_SUPERVISOR = textwrap.dedent("""
    import json, os, signal, sys, time
    out = os.fdopen(int(sys.argv[1]), "w")
    marks = sys.argv[2]
    def interrupted(signum, frame):
        open(marks + ".sigterm", "w").close()
        out.write(json.dumps({"error": sys.argv[3], "status": 130, "phase": None,
                              "path": None, "log_tail": None}) + "\\n")
        out.flush()
        os._exit(130)
    signal.signal(signal.SIGTERM, interrupted)
    out.write(json.dumps({"lane": "", "progress": "capturing"}) + "\\n")
    out.flush()
    open(marks + ".started", "w").close()
    time.sleep(60)
    out.write(json.dumps({"report": json.loads(sys.argv[4])}) + "\\n")
""")


class ChildSpawner(FakeSpawner):
    """Each job runs in a real child process (:data:`_SUPERVISOR`), pinned by a pidfd."""

    def __init__(self, marks: Path, report: dict[str, Any]) -> None:
        super().__init__()
        self.marks = marks
        self.report = report
        self.children: list[subprocess.Popen[bytes]] = []

    def launch(self, job: dict[str, Any]) -> SpawnedJob:
        self.jobs.append(job)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        child = subprocess.Popen(
            [sys.executable, "-c", _SUPERVISOR, str(write_fd), str(self.marks),
             INTERRUPTED_MESSAGE, json.dumps(self.report)],
            pass_fds=(write_fd,),
        )  # fmt: skip
        os.close(write_fd)
        self.children.append(child)
        return SpawnedJob(read_fd, os.pidfd_open(child.pid))

    def wait_started(self) -> None:
        deadline = time.monotonic() + 20
        while not Path(f"{self.marks}.started").exists():
            assert time.monotonic() < deadline, "the supervisor never started"
            time.sleep(0.02)

    @property
    def terminated(self) -> bool:
        return Path(f"{self.marks}.sigterm").exists()

    def end(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait(10)


@pytest.fixture
def child_spawner(running_agent: RunningAgent, tmp_path: Path) -> Iterator[ChildSpawner]:
    spawner = ChildSpawner(tmp_path / "supervisor", make_report(kind="donor", name="d"))
    running_agent.agent._router.service.spawner = spawner  # type: ignore[union-attr]
    try:
        yield spawner
    finally:
        spawner.end()


def _start_stream(path: Path, target: str, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(15)
    sock.connect(str(path))
    sock.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)  # fmt: skip
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("target", ["/v1/bakes", "/v1/donors"])
def test_a_capture_whose_client_hangs_up_is_interrupted_in_its_supervisor(
    running_agent: RunningAgent, child_spawner: ChildSpawner, tmp_path: Path, target: str
) -> None:
    sock = _start_stream(running_agent.socket, target,
                         {"image": "/images/x", "cwd": str(tmp_path), "environ": {}})  # fmt: skip
    with sock:
        child_spawner.wait_started()
        started = time.monotonic()
        sock.shutdown(socket.SHUT_WR)  # what an interrupted client does
        answer = _read_all(sock)  # within the socket's timeout, not the capture's minute
    assert time.monotonic() - started < 10
    assert child_spawner.terminated
    assert INTERRUPTED_MESSAGE.encode() in answer and b'"status":130' in answer
    assert child_spawner.children[0].wait(10) == 130


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bake", "--image", "img"], ""),
        (["donor", "--image", "img"], ""),
        (["donor", "--image", "img", "--detach"], f"error: {INTERRUPTED_MESSAGE}"),
    ],
)
def test_ctrl_c_interrupts_a_capture_through_the_agent_as_in_process(
    running_agent: RunningAgent, child_spawner: ChildSpawner, tmp_path: Path,
    argv: list[str], message: str,
) -> None:  # fmt: skip
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root)}
    command = subprocess.Popen(
        [sys.executable, "-m", "snapctl", *argv], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        child_spawner.wait_started()
        started = time.monotonic()
        command.send_signal(signal.SIGINT)
        out, err = command.communicate(timeout=15)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
    assert time.monotonic() - started < 10
    assert command.returncode == ExitStatus.INTERRUPTED, err
    assert child_spawner.terminated and out == ""
    assert err.strip() == message


@pytest.fixture
def stopped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The activations the agent stops (its copy checks and stops stood in for)."""
    names: list[str] = []
    monkeypatch.setattr("snapctl.agent.service.AgentService.check_copy",
                        lambda self, request, emit: None)  # fmt: skip
    monkeypatch.setattr(
        "snapctl.agent.service.AgentService.stop",
        lambda self, name, timeout_s: names.append(name) or {"name": name},
    )
    return names


def test_a_foreground_copy_whose_client_left_is_stopped_by_the_agent(
    running_agent: RunningAgent, stopped: list[str]
) -> None:
    release = running_agent.spawner.release = threading.Event()
    for detach in (True, False):
        sock = _start_stream(running_agent.socket, "/v1/copies",
                             {"image": "/images/x", "lazy": False, "detach": detach})  # fmt: skip
        with sock:
            data = b""
            while b"restoring with CRIU" not in data:  # its start has begun
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
        # Closed: SIGKILLed, say, while its copy started.
    release.set()  # both starts end only now, after their clients left
    deadline = time.monotonic() + 10
    while len(running_agent.spawner.jobs) < 2 or not stopped:
        assert time.monotonic() < deadline, stopped
        time.sleep(0.05)
    time.sleep(1.0)  # the detached one's report came too, and was not stopped
    assert stopped == ["copy-1"]


def test_a_foreground_copy_whose_client_only_half_closed_is_served_and_kept(
    running_agent: RunningAgent, stopped: list[str]
) -> None:
    """An HTTP client may shut its sending side once its request is out: it still reads the
    answer, and its copy is not an orphan (only captures are cancelled by a half-close)."""
    running_agent.spawner.delay_s = 0.5
    sock = _start_stream(running_agent.socket, "/v1/copies",
                         {"image": "/images/x", "lazy": False, "detach": False})  # fmt: skip
    with sock:
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
    assert b'"report"' in answer
    time.sleep(0.5)
    assert stopped == []


def test_the_tcp_listener_refuses_captures(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    spawner = FakeSpawner()
    options = AgentOptions(socket=tmp_path / "agent.sock", listen=("127.0.0.1", 0),
                           token_file=token)  # fmt: skip
    agent = Agent(StateDir(tmp_path / "state"), options, spawner_factory=lambda: spawner,  # type: ignore[arg-type,return-value]
                  pool_factory=FakePool)  # fmt: skip
    agent.start()
    try:
        port = next(a for a in agent.addresses if isinstance(a, tuple))[1]
        body = json.dumps({"image": "/i", "cwd": str(tmp_path), "environ": {}}).encode()
        for target in ("/v1/donors", "/v1/bakes"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"POST {target} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
                             f"Authorization: Bearer {'t' * 32}\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n"
                             .encode() + body)  # fmt: skip
                head, _, answer = _read_all(sock).partition(b"\r\n\r\n")
            assert int(head.split()[1]) == 403, answer
            assert "only on its unix socket" in json.loads(answer)["error"]
        assert spawner.jobs == []
    finally:
        agent.stop()
