"""The CLI trusts only an agent socket served by root or its own user: one that another user
bound where the agent's is looked for (``$SNAPCTL_AGENT_SOCKET``, ``$SNAPCTL_STATE_DIR``, a
shared directory) is refused before a byte is sent, on the thin path and the full CLI's,
and the command fails naming the socket and who serves it (a fallback in-process would
hide the mistake or the attack)."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapctl.agent.client import AgentClient
from snapctl.agent.errors import AgentUnavailableError
from snapctl.cli import main as full_main
from snapctl.entry import main
from snapctl.errors import ExitStatus

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="serves as another user: needs root")

NOBODY = 65534
COMMAND = Path(__file__).parents[2] / "bin" / "snapctl"


def _serve_as_nobody(path: str, stop_r: int, report_w: int) -> None:
    """The forked squatter: drop to nobody, bind and listen at ``path``, and write on
    ``report_w`` how many bytes each connection sent, until ``stop_r`` ends (or 30 s)."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    os.write(report_w, b"ready\n")
    while True:
        readable, _, _ = select.select([listener, stop_r], [], [], 30)
        if listener in readable:  # before a stop: every connection made is counted
            conn, _ = listener.accept()
            conn.settimeout(2)  # a client that sent and waits for an answer gets none
            received = 0
            try:
                while chunk := conn.recv(65536):
                    received += len(chunk)
            except TimeoutError:
                pass
            conn.close()
            os.write(report_w, f"{received}\n".encode())
        elif not readable or stop_r in readable:
            return


def _read_until(fd: int, done: bytes | None, timeout_s: float) -> str:
    """What ``fd`` gives until ``done`` is in it (None: until it ends), within ``timeout_s``."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while done is None or done not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"the squatter said only {data!r} in {timeout_s} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            if done is not None:
                raise AssertionError(f"the squatter said only {data!r}")
            break
        data += chunk
    return data.decode()


@dataclass
class Squatter:
    """A unix socket served by uid 65534 (nobody) at ``path``, in a directory anyone may
    write."""

    path: Path
    pid: int
    stop_w: int
    report_r: int
    reaped: bool = False

    def received(self) -> list[int]:
        """Stop it; the bytes each connection it accepted sent."""
        os.close(self.stop_w)
        report = _read_until(self.report_r, None, timeout_s=30)
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        assert os.waitstatus_to_exitcode(status) == 0, report
        return [int(line) for line in report.splitlines()]


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    shared = Path(tempfile.mkdtemp(prefix="snapctl-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    path = shared / "agent.sock"
    stop_r, stop_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(stop_w)
            os.close(report_r)
            _serve_as_nobody(str(path), stop_r, report_w)
            code = 0
        except BaseException as error:
            os.write(report_w, f"failed: {error!r}\n".encode())
        finally:
            os._exit(code)
    os.close(stop_r)
    os.close(report_w)
    served = Squatter(path, pid, stop_w, report_r)
    try:
        _read_until(report_r, b"ready\n", timeout_s=10)
        yield served
    finally:
        if not served.reaped:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(stop_w)
        os.close(report_r)
        shutil.rmtree(shared, ignore_errors=True)


def _refused(err: str, squatter: Squatter) -> bool:
    return (f"refusing the agent socket {squatter.path}" in err and f"uid {NOBODY}" in err
            and "--no-agent" in err)  # fmt: skip


@pytest.mark.parametrize("configured", ["SNAPCTL_AGENT_SOCKET", "SNAPCTL_STATE_DIR"])
def test_another_user_s_socket_is_refused_before_anything_is_sent(
    squatter: Squatter, configured: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.delenv("SNAPCTL_NO_AGENT", raising=False)
    monkeypatch.delenv("SNAPCTL_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv(configured, str(squatter.path.parent if "STATE" in configured
                                       else squatter.path))  # fmt: skip
    monkeypatch.setenv("TEST_KEY", "the-api-key-s3cret")
    image = tmp_path / "image"
    image.mkdir()
    copy = ["copy", "--image", str(image), "--detach", "--json", "--api-key-env", "TEST_KEY"]
    donor = ["donor", "--image", str(tmp_path / "captured"), "--detach", "--json", "--", "true"]
    runs = [(main, ["ps", "--json"]), (main, copy), (full_main, ["ps"]), (full_main, donor)]
    for run, args in runs:
        code = run(args)
        captured = capsys.readouterr()
        assert code == ExitStatus.UNAVAILABLE, (args, captured)
        assert _refused(captured.err, squatter) and captured.out == "", (args, captured)
    # Each command connected, and sent nothing: no environment, no API key.
    assert squatter.received() == [0] * len(runs)


def test_a_reconnecting_client_refuses_it_too(squatter: Squatter) -> None:
    with pytest.raises(AgentUnavailableError) as refused:
        AgentClient(squatter.path).call("GET", "/version")
    assert _refused(refused.value.message, squatter)
    assert refused.value.path == squatter.path
    assert squatter.received() == [0]


def test_the_installed_command_refuses_it(squatter: Squatter, tmp_path: Path) -> None:
    env = {**os.environ, "SNAPCTL_AGENT_SOCKET": str(squatter.path),
           "SNAPCTL_STATE_DIR": str(tmp_path / "state"),
           "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    env.pop("SNAPCTL_NO_AGENT", None)
    done = subprocess.run([sys.executable, str(COMMAND), "ps", "--json"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == ExitStatus.UNAVAILABLE and done.stdout == "", done.stderr
    assert _refused(done.stderr, squatter), done.stderr
    assert squatter.received() == [0]


def test_no_agent_runs_in_process_and_leaves_it_alone(
    squatter: Squatter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("SNAPCTL_AGENT_SOCKET", str(squatter.path))
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    assert full_main(["--no-agent", "ps", "--json"]) == 0
    assert capsys.readouterr().out == "[]\n"
    assert squatter.received() == []
