"""The agent's listeners against clients that misbehave: idle or too many connections, clients
without the token, odd headers, requests the HTTP parser refuses, and ``logs -f`` clients that
leave; and the framing the thin client reads."""

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
    MAX_LINE_BYTES,
    SOCKET_TIMEOUT_S,
    HTTPListener,
    PeerWatch,
    TCPHTTPServer,
)
from snapctl.errors import ExitStatus
from snapctl.statedir import StateDir
from tests.agent.conftest import FakePool, FakeSpawner, RunningAgent, make_report
from tests.agent.test_server import raw, run_cli
from tests.conftest import skip_or_fail
from tests.statedir.test_lookup import save

TOKEN = "t" * 32
VERSION_AUTHORIZED = (f"GET /v1/version HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                      "\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
# linux/tcp.h: a socket in repair mode closes without a word to its peer (as CRIU uses it).
TCP_REPAIR = 19
LOGS_OF_ONE = b"GET /v1/activations/one/logs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


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
    monkeypatch.setattr(HTTPListener, "timeout", 0.5)
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
    assert HTTPListener.timeout == SOCKET_TIMEOUT_S
    monkeypatch.setattr(HTTPListener, "timeout", 0.3)
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
            metrics = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            scraped = raw(agent.socket_path, metrics)[1].decode()
            assert "snapctl_agent_tcp_refused_total{" + refused in scraped
            # The other limits' series are there too, from 0.
            assert (
                len(re.findall(r'snapctl_agent_tcp_refused_total\{.*listener="api"', scraped)) == 3
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
    "lengths",
    [["+1_0"], ["-1"], ["٣"], ["2", "3"], ["2", "2"], ["99999999999999999999"]],
)  # "٣" is a digit to str.isdigit, not to HTTP; two equal values are refused as well
def test_content_length_is_taken_strictly(running_agent: RunningAgent, lengths: list[str]) -> None:
    """Strictly digits, and once: two readings of one request must never differ."""
    headers = "".join(f"Content-Length: {length}\r\n" for length in lengths)
    request = f"POST /v1/gc HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n{{}}"
    got, headers_of, body = unix_request(running_agent.socket, request.encode())
    refusal = json.loads(body)
    assert got == 400 and headers_of["Content-Type"] == "application/json"
    assert "malformed request" in refusal["error"] and "Content-Length" in refusal["error"]
    assert refusal["status"] == ExitStatus.USAGE


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (b"GET /v1/version HTTP/9.9\r\nHost: x\r\n\r\n", "HTTP version"),
        (b"GET /" + b"a" * (MAX_LINE_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
         f"over {MAX_LINE_BYTES} bytes"),
        (b"GET /v1/version HTTP/1.1\r\nHost: x\r\nX: " + b"y" * (MAX_LINE_BYTES + 10)
         + b"\r\n\r\n", f"over {MAX_LINE_BYTES} bytes"),
        (b"nonsense\r\n\r\n", "malformed request"),
        (b"GET /v1/version HTTP/1.1\r\n\r\n", "Host"),  # HTTP/1.1 requires it
    ],
)  # fmt: skip
def test_what_the_http_parser_refuses_is_an_error_body_too(
    running_agent: RunningAgent, request_bytes: bytes, reason: str
) -> None:
    got, headers, body = unix_request(running_agent.socket, request_bytes)
    assert got == 400 and headers["Content-Type"] == "application/json"
    refusal = json.loads(body)
    assert reason in refusal["error"] and refusal["error"].startswith("malformed request: ")
    assert refusal["status"] == ExitStatus.USAGE
    assert "yyyy" not in refusal["error"]  # what it quotes of the request is not echoed


@pytest.mark.parametrize(
    ("method", "target", "allow"),
    [("POST", "/v1/activations", "GET"), ("POST", "/metrics", "GET"),
     ("DELETE", "/v1/metrics", "GET"), ("GET", "/v1/pool/set", "POST"),
     ("PATCH", "/v1/version", "GET"), ("HEAD", "/v1/activations", "GET")],
)  # fmt: skip
def test_a_wrong_method_is_405_with_the_allowed_ones(
    running_agent: RunningAgent, method: str, target: str, allow: str
) -> None:
    request = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = unix_request(running_agent.socket, request)
    assert status == 405 and headers["Allow"] == allow
    if method != "HEAD":  # an answer to HEAD has no body
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
    monkeypatch.setattr(HTTPListener, "timeout", 0.3)
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
    sock.sendall(f"GET /v1/activations/one/logs?follow=1 HTTP/1.1\r\nHost: x\r\n{authorization}"
                 "\r\n".encode())  # fmt: skip
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


def _copy_request(authorization: str = "") -> bytes:
    body = json.dumps({"image": "/images/x", "lazy": False, "detach": True})
    return (f"POST /v1/copies HTTP/1.1\r\nHost: x\r\n{authorization}Content-Length: "
            f"{len(body)}\r\n\r\n{body}").encode()  # fmt: skip


def test_a_client_with_the_token_is_not_held_to_one_address_share(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An autoscaler asks for many copies at once from one address."""
    monkeypatch.setattr(TCPHTTPServer, "max_per_address", 2)
    _agent, port = tcp_agent
    release = threading.Event()
    monkeypatch.setattr("snapctl.agent.service.AgentService.copy",
                        lambda self, request, emit: release.wait(10) and {})  # fmt: skip
    long_requests: list[socket.socket] = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            long_requests.append(sock)
            sock.sendall(_copy_request(f"Authorization: Bearer {TOKEN}\r\n"))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        # Without the token, the address's share still holds.
        unproven = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        time.sleep(0.2)  # both accepted and holding their slots
        status, _, body = tcp_request(port, b"GET /v1/version HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and b"from one address" in body
        long_requests += unproven
    finally:
        release.set()
        for sock in long_requests:
            sock.close()


def test_clients_without_the_token_hold_only_their_share_of_the_slots(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that never send the token (from as many addresses as they like) hold at
    most max_unproven slots, the rest staying for clients that have it."""
    monkeypatch.setattr(TCPHTTPServer, "max_unproven", 2)
    agent, port = tcp_agent
    proven = socket.create_connection(("127.0.0.1", port), timeout=10)
    idle: list[socket.socket] = []
    try:
        proven.sendall(VERSION_AUTHORIZED.replace(b"close", b"keep-alive"))
        assert _keep_alive_answer(proven)[0] == 200  # it showed the token: out of their share
        for source in ("127.0.0.2", "127.0.0.3"):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10,
                                                 source_address=(source, 0)))  # fmt: skip
        time.sleep(0.2)  # the idle ones accepted
        status, _, body = tcp_request(port, VERSION_AUTHORIZED, source="127.0.0.4")
        assert status == 503 and b"not sent the token yet" in body
        metrics = raw(agent.socket_path, b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                      b"Connection: close\r\n\r\n")[1]  # fmt: skip
        assert b'limit="unproven",listener="api"} 1.0' in metrics
        proven.sendall(VERSION_AUTHORIZED.replace(b"close", b"keep-alive"))
        assert _keep_alive_answer(proven)[0] == 200  # its slot stays its own
    finally:
        for sock in (proven, *idle):
            sock.close()


def test_a_client_without_the_token_must_send_it_soon(
    tcp_agent: tuple[Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that shows no token within proof_timeout_s is closed; one that showed it
    idles as long as any."""
    monkeypatch.setattr(TCPHTTPServer, "proof_timeout_s", 0.5)
    _agent, port = tcp_agent
    with socket.create_connection(("127.0.0.1", port), timeout=10) as proven:
        proven.sendall(VERSION_AUTHORIZED.replace(b"close", b"keep-alive"))
        assert _keep_alive_answer(proven)[0] == 200
        with socket.create_connection(("127.0.0.1", port), timeout=10) as unproven:
            started = time.monotonic()
            assert unproven.recv(65536) == b""  # closed by the agent, not this timeout
            assert time.monotonic() - started < 5
        # The proven one, connected first, idled longer than that, and is served still.
        proven.sendall(VERSION_AUTHORIZED)
        assert answer_of(proven)[0] == 200


def _keep_alive_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one whole answer (Content-Length) from a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["Content-Length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_a_token_that_is_not_ascii_is_401_not_a_failure(tcp_agent: tuple[Agent, int]) -> None:
    _agent, port = tcp_agent
    request = b"GET /v1/version HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xfc\xff\r\n\r\n"
    status, headers, body = tcp_request(port, request)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(body)["status"] == ExitStatus.USAGE


def test_a_client_that_stops_reading_does_not_stall_what_it_asked_for(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's messages come from the operation's worker (a copy's progress): a client that
    never reads must cost it at most the socket timeout, not the operation."""
    monkeypatch.setattr(HTTPListener, "timeout", 0.3)
    finished = threading.Event()

    def flood(self: Any, request: Any, emit: Any) -> dict[str, Any]:
        for _ in range(20000):  # far more than the socket's buffers hold
            emit({"note": "x" * 1000})
        finished.set()
        return {}

    monkeypatch.setattr("snapctl.agent.service.AgentService.copy", flood)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(running_agent.socket))
        sock.sendall(_copy_request())  # and never reads the answer
        assert finished.wait(10)


def test_answers_are_framed_as_the_thin_client_reads_them(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole answer has its Content-Length; a stream is chunked, one NDJSON message a
    chunk, and ends its connection (snapctl.agent.client reads both)."""

    def copy(self: Any, request: Any, emit: Any) -> dict[str, Any]:
        emit({"lane": "", "progress": "restoring with CRIU"})
        return make_report()

    monkeypatch.setattr("snapctl.agent.service.AgentService.copy", copy)
    status, headers, body = unix_request(
        running_agent.socket, b"GET /v1/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(body) and body.endswith(b"}\n")
    assert json.loads(body)["api"] == 1
    status, headers, body = unix_request(running_agent.socket, _copy_request())
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    assert headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in headers
    framing = body.split(b"\r\n")
    sizes, chunks = framing[0::2], framing[1::2]
    assert sizes[-2:] == [b"0", b""] and chunks[-1] == b""  # the last chunk, then the end
    messages = [json.loads(chunk) for chunk in chunks[:-1]]
    assert all(int(size, 16) == len(chunk) and chunk.count(b"\n") == 1 and chunk.endswith(b"\n")
               for size, chunk in zip(sizes, chunks[:-1], strict=False))  # fmt: skip
    assert messages == [{"lane": "", "progress": "restoring with CRIU"}, {"report": make_report()}]
