"""The capturer's handshake against a control directory whose server side the test writes."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation import handshake
from snapctl.activation.handshake import ActivationError, activate, probe_http_ready
from snapctl.errors import WaitTimeoutError
from snapctl.namespaces.netns import NetnsConnector
from tests.protocol.factories import (
    ACTIVATION_ID,
    CAPTURE_ID,
    make_challenge,
    make_control_dir,
    make_status,
)


def test_a_server_stuck_recovering_times_out_as_a_wait_timeout(tmp_path: Path) -> None:
    control = make_control_dir(tmp_path)
    # The server's side, already written: it answered and then never left "recovering".
    control.write(make_challenge())
    control.write(make_status(phase="recovering"))
    with pytest.raises(WaitTimeoutError):
        activate(
            control, capture_id=CAPTURE_ID, activation_id=ACTIVATION_ID, kind="copy",
            host="127.0.0.1", port=8000, timeout_s=0.2,
        )  # fmt: skip


class _Models(http.server.BaseHTTPRequestHandler):
    status = 200

    def status_for(self, path: str, authorization: str | None) -> int:
        return self.status

    def do_GET(self) -> None:
        self.send_response(self.status_for(self.path, self.headers.get("Authorization")))
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """An HTTP server on a loopback port (yielded) in a thread, for the time of the block."""
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def connector() -> Iterator[NetnsConnector]:
    # Our own network namespace: the probe's path through a namespace, on loopback.
    with NetnsConnector(os.getpid()) as connector:
        yield connector


def test_the_probe_retries_soon_then_backs_off_until_the_port_answers(
    connector: NetnsConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    reserved = socket.create_server(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
    reserved.close()  # refused until the "server" binds it, after five waits
    waits: list[float] = []
    servers: list[http.server.HTTPServer] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 5:
            server = http.server.HTTPServer(("127.0.0.1", port), _Models)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)

    monkeypatch.setattr(handshake.time, "sleep", sleep)
    try:
        probe_http_ready(connector, "127.0.0.1", port, api_key=None, timeout_s=10)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert waits == [0.001, 0.002, 0.004, 0.005, 0.005]


def test_the_probe_gives_up_at_once_on_a_refused_key(connector: NetnsConnector) -> None:
    class Refusing(_Models):
        status = 401

    with _serving(Refusing) as port, pytest.raises(ActivationError, match="HTTP 401: the API key"):
        probe_http_ready(connector, "127.0.0.1", port, api_key="k", timeout_s=10)


class _VllmLike(_Models):
    """/health open, /v1/* only with the key (as vLLM with --api-key, and the fixture)."""

    seen: list[tuple[str, str | None]] = []

    def status_for(self, path: str, authorization: str | None) -> int:
        type(self).seen.append((path, authorization))
        return 200 if path == "/health" or authorization == "Bearer k" else 401


@pytest.fixture
def vllm_like() -> Iterator[tuple[int, list[tuple[str, str | None]]]]:
    seen: list[tuple[str, str | None]] = []
    with _serving(type("Handler", (_VllmLike,), {"seen": seen})) as port:
        yield port, seen


def test_without_a_key_readiness_is_an_open_health_check(
    connector: NetnsConnector, vllm_like: tuple[int, list[tuple[str, str | None]]]
) -> None:
    port, seen = vllm_like
    probe_http_ready(connector, "127.0.0.1", port, api_key=None, timeout_s=10)
    assert seen == [("/health", None)]  # /v1/* would refuse: never asked without a key


def test_with_a_key_the_authenticated_check_runs_as_well(
    connector: NetnsConnector, vllm_like: tuple[int, list[tuple[str, str | None]]]
) -> None:
    port, seen = vllm_like
    probe_http_ready(connector, "127.0.0.1", port, api_key="k", timeout_s=10)
    assert seen == [("/health", "Bearer k"), ("/v1/models", "Bearer k")]
    with pytest.raises(ActivationError, match=r"/v1/models with HTTP 401: the API key is wrong"):
        probe_http_ready(connector, "127.0.0.1", port, api_key="wrong", timeout_s=10)


def test_a_probe_timeout_names_the_check_and_the_option_to_raise(
    connector: NetnsConnector,
) -> None:
    class Starting(_Models):
        status = 503  # vLLM's /health while its engine is not up

    with _serving(Starting) as port, pytest.raises(ActivationError) as info:
        probe_http_ready(
            connector, "127.0.0.1", port, api_key=None, timeout_s=0.3,
            timeout_hint=" (raise --ready-timeout)",
        )  # fmt: skip
    assert "never answered /health with 200 within 0.3 s (raise --ready-timeout)" in str(info.value)
    assert "(last: /health: HTTP 503" in str(info.value)


def test_the_servers_own_timeout_at_the_barrier_names_server_timeout(tmp_path: Path) -> None:
    from tests.protocol.factories import make_error

    control = make_control_dir(tmp_path)
    control.write(
        make_error(error_type="WaitTimeoutError", error="timed out after 900 s waiting for x")
    )
    with pytest.raises(ActivationError, match=r"the server's own limit ran out: raise --server"):
        activate(
            control, capture_id=CAPTURE_ID, activation_id=ACTIVATION_ID, kind="copy",
            host="127.0.0.1", port=8000, timeout_s=5,
        )  # fmt: skip
