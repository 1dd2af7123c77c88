"""The agent's listeners against clients that misbehave: idle or too many connections, odd
headers, requests http.server itself refuses, and ``logs -f`` clients that leave."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.agent.daemon import Agent, AgentOptions, TokenFileError, read_token
from snapctl.agent.server import (
    SOCKET_TIMEOUT_S,
    Handler,
    PeerWatch,
    Stream,
    TCPHTTPServer,
    handler_for,
)
from snapctl.errors import ExitStatus
from snapctl.statedir import StateDir
from tests.agent.conftest import FakePool, FakeSpawner, RunningAgent
from tests.agent.test_server import raw, run_cli
from tests.conftest import skip_or_fail
from tests.statedir.test_lookup import save

TOKEN = "t" * 32
VERSION_AUTHORIZED = (f"GET /v1/version HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                      "Connection: close\r\n\r\n").encode()  # fmt: skip
# linux/tcp.h: a socket in repair mode closes without a word to its peer (as CRIU uses it).
TCP_REPAIR = 19
LOGS_OF_ONE = b"GET /v1/activations/one/logs HTTP/1.1\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def started_tcp_agent(tmp_path: Path) -> Iterator[tuple[Agent, int]]:
    """An agent with a TCP listener, on a state directory of its own; its port."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    options = AgentOptions(socket=tmp_path / "tcp-agent.sock", listen=("127.0.0.1", 0),
                           token_file=token)  # fmt: skip
    agent = Agent(StateDir(tmp_path / "tcp-state"), options, spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # type: ignore[arg-type]  # fmt: skip
    agent.start()
    try:
        yield agent, next(a for a in agent.addresses if isinstance(a, tuple))[1]
    finally:
        agent.stop()


@pytest.fixture
def tcp_agent(tmp_path: Path) -> Iterator[tuple[Agent, int]]:
    with started_tcp_agent(tmp_path) as started:
        yield started


def answer_of(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read a whole answer until the agent closes: status, headers, body."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def tcp_request(
    port: int, request: bytes, source: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as sock:  # fmt: skip
        sock.sendall(request)
        return answer_of(sock)


def unix_request(path: Path, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(request)
        return answer_of(sock)


def test_a_request_sent_a_byte_at_a_time_must_still_arrive_within_the_timeout(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout per read alone lets a client that drips bytes hold its connection (and a TCP
    listener's slot) for good."""
    monkeypatch.setattr(Handler, "timeout", 0.5)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(running_agent.socket))
        started = time.monotonic()
        with pytest.raises(OSError):  # the agent closed the connection: EPIPE or a reset
            for byte in b"GET /v1/version HTTP/1.1\r\nX-Slow: " + b"y" * 100:
                sock.send(bytes([byte]))
                time.sleep(0.1)
        assert time.monotonic() - started < 5


def test_an_idle_client_is_closed_after_the_socket_timeout(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert handler_for(running_agent.agent._router).timeout == SOCKET_TIMEOUT_S  # type: ignore[arg-type]
    monkeypatch.setattr(Handler, "timeout", 0.3)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)  # the agent, not this, must end it
        sock.connect(str(running_agent.socket))
        sock.sendall(b"GET /v1/version HTTP/1.1\r\n")  # and the rest never comes
        started = time.monotonic()
        assert sock.recv(65536) == b""
        assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("limit", "reason", "from_another_address", "refused"),
    [
        ("max_connections", "2 TCP connections at once: try again", 503,
         'limit="listener",listener="api"} 2.0'),
        ("max_per_address", "2 TCP connections at once from one address: try again", 200,
         'limit="address",listener="api"} 1.0'),
    ],
)  # fmt: skip
def test_past_its_connection_limits_the_tcp_listener_answers_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, reason: str,
    from_another_address: int, refused: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(TCPHTTPServer, limit, 2)
    with started_tcp_agent(tmp_path) as (agent, port):
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            time.sleep(0.2)  # both accepted and holding their threads
            status, headers, body = tcp_request(port, VERSION_AUTHORIZED)
            assert status == 503 and headers["Retry-After"] == "1"
            refusal = json.loads(body)
            assert reason in refusal["error"]
            assert refusal["status"] == ExitStatus.UNAVAILABLE
            # Another client (all of 127/8 is loopback's) meets only the listener's limit.
            other = tcp_request(port, VERSION_AUTHORIZED, source="127.0.0.2")
            assert other[0] == from_another_address
            metrics = b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"
            scraped = raw(agent.socket_path, metrics)[1].decode()
            assert "snapctl_agent_tcp_refused_total{" + refused in scraped
            # The other limit's series is there too, from 0.
            assert (
                len(re.findall(r'snapctl_agent_tcp_refused_total\{.*listener="api"', scraped)) == 2
            )
        finally:
            for sock in idle:
                sock.close()
        # The slots come back once their clients left.
        deadline = time.monotonic() + 10
        while (status := tcp_request(port, VERSION_AUTHORIZED)[0]) == 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert status == 200


@pytest.mark.parametrize(
    ("lengths", "status", "reason"),
    [
        (["+1_0"], 400, "must be a number of bytes, not '+1_0'"),
        (["-1"], 400, "must be a number of bytes"),
        (["٣"], 400, "must be a number of bytes"),  # a digit to str.isdigit, not to HTTP
        (["2", "3"], 400, "conflicting Content-Length"),
        (["99999999999999999999"], 413, "at most"),
    ],
)
def test_content_length_is_taken_strictly(
    running_agent: RunningAgent, lengths: list[str], status: int, reason: str
) -> None:
    headers = "".join(f"Content-Length: {length}\r\n" for length in lengths)
    request = f"POST /v1/gc HTTP/1.1\r\n{headers}Connection: close\r\n\r\n{{}}".encode()
    got, _, body = unix_request(running_agent.socket, request)
    assert got == status and reason in json.loads(body)["error"]


def test_a_repeated_equal_content_length_is_one(running_agent: RunningAgent) -> None:
    request = b"POST /v1/gc HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n" \
              b"Connection: close\r\n\r\n{}"  # fmt: skip
    assert unix_request(running_agent.socket, request)[0] == 200


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"GET /v1/version HTTP/9.9\r\n\r\n", 505, "Invalid HTTP version"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "Request-URI Too Long"),
        (b"PATCH /v1/version HTTP/1.1\r\n\r\n", 501, "Unsupported method ('PATCH')"),
        (b"GET /v1/version HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", 431, "Line too long"),
        (b"nonsense\r\n\r\n", 400, "Bad request syntax"),
    ],
)
def test_what_http_server_refuses_is_an_error_body_too(
    running_agent: RunningAgent, request_bytes: bytes, status: int, reason: str
) -> None:
    got, headers, body = unix_request(running_agent.socket, request_bytes)
    assert got == status and headers["Content-Type"] == "application/json"
    refusal = json.loads(body)
    assert reason in refusal["error"] and refusal["status"] == ExitStatus.USAGE


@pytest.mark.parametrize(
    ("method", "target", "allow"),
    [("POST", "/v1/activations", "GET"), ("POST", "/metrics", "GET"),
     ("DELETE", "/v1/metrics", "GET"), ("GET", "/v1/pool/set", "POST")],
)  # fmt: skip
def test_a_wrong_method_is_405_with_the_allowed_ones(
    running_agent: RunningAgent, method: str, target: str, allow: str
) -> None:
    request = f"{method} {target} HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = unix_request(running_agent.socket, request)
    assert status == 405 and headers["Allow"] == allow
    assert f"{method} is not allowed" in json.loads(body)["error"]


def test_a_token_that_is_not_printable_ascii_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    for text in ("ü" * 20, "tab\tseparated-token-value"):
        token.write_text(text + "\n")
        token.chmod(0o600)
        with pytest.raises(TokenFileError, match="printable ASCII"):
            read_token(token)


def test_a_token_with_spaces_still_serves(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("correct horse battery staple\n")
    token.chmod(0o600)
    assert read_token(token) == b"correct horse battery staple"


def _logged(state: StateDir, text: bytes) -> Path:
    record = save(state, "one", "copy-1")
    logs = Path(record.logs_dir)
    logs.mkdir(parents=True)
    (logs / "server.log").write_bytes(text)
    return logs / "server.log"


def test_logs_come_in_chunks_and_a_split_character_stays_whole(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    from snapctl.supervision.logs import CHUNK_BYTES

    # "é" is two bytes: its first ends the first chunk, its second begins the next.
    text = ("x" * (CHUNK_BYTES - 1) + "é" + "line\n" * 50000).encode()
    _logged(running_agent.state, text)
    through = run_cli(capsys, "logs", "one")
    assert through == (0, text.decode(), "")
    assert through == run_cli(capsys, "--no-agent", "logs", "one")
    status, body = raw(running_agent.socket, LOGS_OF_ONE)
    assert status == 200 and body.count(b'{"text":') > 2


def test_a_log_ending_in_a_cut_off_character_reads_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    _logged(running_agent.state, "last line é".encode()[:-1])
    through = run_cli(capsys, "logs", "one")
    assert through == run_cli(capsys, "--no-agent", "logs", "one")
    assert through[1] == "last line \ufffd"


def _opened_here(path: Path) -> bool:
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if fd.readlink() == path:
                return True
    return False


def test_a_followed_log_reads_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    """Invalid bytes, a character split between two writes, and one cut off at the end, in
    what is written while the log is followed: as the plain read prints them."""
    start = b"bad \xff byte\nsplit \xc3"
    written = [b"\xa9 joined\n", "last é".encode()[:-1]]
    log = _logged(running_agent.state, start)
    record = running_agent.state.record_path("one")
    record_text = record.read_bytes()

    def server() -> None:
        deadline = time.monotonic() + 10
        while not _opened_here(log):  # the follow began (the agent runs in this process)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for chunk in written:
            with log.open("ab") as file:
                file.write(chunk)
            time.sleep(0.1)
        record.unlink()  # the activation stops

    def follow(*argv: str) -> tuple[int, str, str]:
        log.write_bytes(start)
        record.write_bytes(record_text)
        writer = threading.Thread(target=server)
        writer.start()
        try:
            return run_cli(capsys, *argv, "logs", "-f", "one")
        finally:
            writer.join()

    through = follow()
    assert through == follow("--no-agent")
    assert through == (0, "bad \ufffd byte\nsplit é joined\nlast \ufffd", "")
    record.write_bytes(record_text)
    assert through == run_cli(capsys, "logs", "one") == run_cli(capsys, "--no-agent", "logs", "one")


@pytest.mark.parametrize("through", [[], ["--no-agent"]])
def test_a_log_prints_what_stdout_cannot_encode_as_replacements(
    running_agent: RunningAgent, through: list[str]
) -> None:
    """A log is any bytes; a terminal whose encoding lacks a character still shows the rest."""
    _logged(running_agent.state, b"caf\xc3\xa9 \xff ok\n")  # an invalid byte: U+FFFD
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root),
           "SNAPCTL_AGENT_SOCKET": str(running_agent.socket),
           "PYTHONIOENCODING": "ascii"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "snapctl", *through, "logs", "one"], env=env,
                          capture_output=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, b"caf? ? ok\n"), done.stderr


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_a_reader_of_a_long_log_may_pause(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, listener: str
) -> None:
    """``snapctl logs NAME | less``: the pager stops reading while a page is read (over TCP
    its window stays shut meanwhile: see PeerWatch on TCP_USER_TIMEOUT)."""
    monkeypatch.setattr(Handler, "timeout", 0.3)
    text = b"a line of the server's log\n" * 400000  # far more than the socket's buffers
    if listener == "unix":
        running_agent: RunningAgent = request.getfixturevalue("running_agent")
        _logged(running_agent.state, text)
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(running_agent.socket))
        logs_request = LOGS_OF_ONE
    else:
        agent, port = request.getfixturevalue("tcp_agent")
        _logged(agent.state, text)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window that fills
        sock.connect(("127.0.0.1", port))
        logs_request = LOGS_OF_ONE.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {TOKEN}"
                                      "\r\n\r\n".encode())  # fmt: skip
    with sock:
        sock.settimeout(10)
        sock.sendall(logs_request)
        time.sleep(1.0)  # past the timeout, with the agent's writes blocked
        status, _, body = answer_of(sock)
    assert status == 200
    assert _texts(body).encode() == text


def _texts(body: bytes) -> str:
    """A log answer's text, from its chunked NDJSON ``{"text"}`` messages."""
    chunks = body.split(b"\r\n")[1::2]  # the chunked framing's data lines
    return "".join(json.loads(line)["text"] for chunk in chunks for line in chunk.splitlines()
                   if line)  # fmt: skip


def test_the_log_of_an_activation_that_wrote_none_yet_is_404(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    save(running_agent.state, "one", "copy-1")
    status, body = raw(running_agent.socket, LOGS_OF_ONE)
    assert status == 404 and "has no server log yet" in json.loads(body)["error"]
    assert run_cli(capsys, "logs", "one") == run_cli(capsys, "--no-agent", "logs", "one")
    assert run_cli(capsys, "logs", "one")[0] == ExitStatus.ERROR


def _follow(sock: socket.socket, authorization: str = "") -> Any:
    sock.sendall(f"GET /v1/activations/one/logs?follow=1 HTTP/1.1\r\n{authorization}\r\n"
                 .encode())  # fmt: skip
    data = b""
    while b"first line" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_a_follow_whose_client_left_ends_without_the_activation_stopping(
    running_agent: RunningAgent, tcp_agent: tuple[Agent, int], listener: str
) -> None:
    """Else each left-behind ``logs -f`` holds a thread and an inotify watch until its
    activation stops (about 128 of them and no follow starts any more)."""
    agent = running_agent.agent if listener == "unix" else tcp_agent[0]
    _logged(agent.state, b"first line\n")
    router = agent._router
    assert router is not None
    if listener == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(10)
        sock.connect(str(agent.socket_path))
        _follow(sock)
    else:
        sock = socket.create_connection(("127.0.0.1", tcp_agent[1]), timeout=10)
        _follow(sock, f"Authorization: Bearer {TOKEN}\r\n")
    assert not router.in_flight.wait_idle(0.3, followers=True)  # it follows
    sock.close()
    assert router.in_flight.wait_idle(5, followers=True)
    assert agent.state.record_path("one").exists()  # still running, no longer followed


def test_a_follower_that_vanished_without_closing_is_found_by_keepalive(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone without a FIN (a partition, a rebooted host): a quiet log is never
    written, so only the agent's keepalive probe finds out (here it meets a reset)."""
    if os.geteuid() != 0:
        skip_or_fail("root", "needs root (TCP_REPAIR needs CAP_NET_ADMIN)")
    monkeypatch.setattr(TCPHTTPServer, "peer_watch", PeerWatch(idle_s=1, interval_s=1, probes=2))
    agent, port = tcp_agent
    _logged(agent.state, b"first line\n")
    router = agent._router
    assert router is not None
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _follow(sock, f"Authorization: Bearer {TOKEN}\r\n")
    assert not router.in_flight.wait_idle(0.3, followers=True)  # it follows
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    except PermissionError:  # root without CAP_NET_ADMIN (a container's default)
        sock.close()
        skip_or_fail("root", "needs CAP_NET_ADMIN for TCP_REPAIR")
    sock.close()  # silently: the agent's side stays established
    assert router.in_flight.wait_idle(10, followers=True)
    assert agent.state.record_path("one").exists()  # still running, no longer followed


def test_a_follower_gives_its_tcp_slot_back(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log shipper following every copy from one address must not fill the listener."""
    monkeypatch.setattr(TCPHTTPServer, "max_connections", 2)
    monkeypatch.setattr(TCPHTTPServer, "max_per_address", 2)
    agent, port = tcp_agent
    _logged(agent.state, b"first line\n")
    followers: list[socket.socket] = []
    try:
        for _ in range(3):  # each connects once the one before follows
            followers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            _follow(followers[-1], f"Authorization: Bearer {TOKEN}\r\n")
        assert tcp_request(port, VERSION_AUTHORIZED)[0] == 200
    finally:
        for sock in followers:
            sock.close()


def test_a_client_with_the_token_is_not_held_to_one_address_share(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An autoscaler asks for many copies at once from one address."""
    monkeypatch.setattr(TCPHTTPServer, "max_per_address", 2)
    agent, port = tcp_agent
    router = agent._router
    assert router is not None
    release = threading.Event()
    router.routes.append(("GET", re.compile("/long"),
                          lambda m, q, b: Stream(lambda emit: release.wait(10))))  # fmt: skip
    long_requests: list[socket.socket] = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            long_requests.append(sock)
            sock.sendall(f"GET /v1/long HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
                         .encode())  # fmt: skip
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        # Without the token, the address's share still holds.
        unproven = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        time.sleep(0.2)  # both accepted and holding their threads
        status, _, body = tcp_request(port, b"GET /v1/version HTTP/1.1\r\n\r\n")
        assert status == 503 and b"from one address" in body
        long_requests += unproven
    finally:
        release.set()
        for sock in long_requests:
            sock.close()


def test_a_client_that_stops_reading_does_not_stall_what_it_asked_for(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's messages are written from the operation's own thread (a copy's progress):
    a client that never reads must cost it at most the socket timeout, not the operation."""
    monkeypatch.setattr(Handler, "timeout", 0.3)
    router = running_agent.agent._router
    assert router is not None
    finished = threading.Event()

    def flood(emit: Any) -> None:
        for _ in range(20000):  # far more than the socket's buffers hold
            emit({"note": "x" * 1000})
        finished.set()

    router.routes.append(("GET", re.compile("/flood"), lambda m, q, b: Stream(flood)))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(running_agent.socket))
        sock.sendall(b"GET /v1/flood HTTP/1.1\r\n\r\n")  # and never reads the answer
        assert finished.wait(10)
