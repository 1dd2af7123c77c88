"""The workload client against a small stub server: every request is sent with the agreed
parameters, streams are reassembled, auth statuses and an absent digest endpoint recorded,
and a failing request is recorded in its completion rather than raised."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from snapctl.qualification.checks import check_outputs
from snapctl.qualification.workload import WORKLOAD, observe_serving

KEY = "stub-key"


class _Stub(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]]
    fail_prompt: str | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {KEY}"

    def do_GET(self) -> None:
        if not self._authorized():
            self._json(401, {"error": "no"})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "stub-model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if not self._authorized():
            self._json(401, {"error": "no"})
            return
        if body["prompt"] == type(self).fail_prompt:
            self._json(500, {"error": "boom"})
            return
        n = body["max_tokens"]
        ids = [len(body["prompt"]) + i for i in range(n)]
        if not body["stream"]:
            choice = {"text": "t" * n, "token_ids": ids,
                      "logprobs": {"token_logprobs": [-0.25] * n}}  # fmt: skip
            self._json(200, {"choices": [choice]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for token in ids:
            chunk = {"choices": [{"text": "t", "token_ids": [token],
                                  "logprobs": {"token_logprobs": [-0.25]}}]}  # fmt: skip
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub() -> Iterator[tuple[str, type[_Stub]]]:
    handler = type("Handler", (_Stub,), {"bodies": [], "fail_prompt": None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "127.0.0.1:{}".format(*server.server_address[1:]), handler
    server.shutdown()
    server.server_close()


def test_observe_serving_sends_the_whole_workload(stub: tuple[str, type[_Stub]]) -> None:
    address, handler = stub

    observation = observe_serving(address, KEY)

    assert observation.model == "stub-model"
    assert observation.auth == {"missing": 401, "wrong": 401, "right": 200}
    assert [read.status for read in observation.digests] == [404, 404]
    labels = [r.label for batch in WORKLOAD for r in batch.requests]
    assert sorted(observation.completions) == sorted(labels) and len(labels) == 19
    assert len(handler.bodies) == 19
    for body in handler.bodies:
        assert body["temperature"] == 0 and body["ignore_eos"] is True
        assert body["return_token_ids"] is True and body["model"] == "stub-model"
    stream = observation.completions["stream-16"]
    assert stream.stream and stream.error is None
    assert stream.token_ids == [len(stream.prompt) + i for i in range(16)]
    assert stream.text == "t" * 16 and stream.logprobs == [-0.25] * 16
    assert all(len(c.logprobs) == c.max_tokens for c in observation.completions.values())
    assert check_outputs("concurrency", observation, observe_serving(address, KEY)).status == (
        "passed"
    )


def test_a_failing_request_is_recorded_and_then_fails_its_check(
    stub: tuple[str, type[_Stub]],
) -> None:
    address, handler = stub
    reference = observe_serving(address, KEY)
    handler.fail_prompt = "Pair request 5 says"

    observation = observe_serving(address, KEY)

    failure = observation.completions["pair-5"]
    assert failure.error is not None and failure.error.startswith("RuntimeError: HTTP 500")
    check = check_outputs("concurrency", reference, observation)
    assert check.status == "failed" and check.evidence.startswith("pair-5: request failed")


def test_a_wrong_key_is_seen_as_auth_failure(stub: tuple[str, type[_Stub]]) -> None:
    address, _ = stub
    from snapctl.qualification.workload import Client, probe_auth

    assert probe_auth(Client(address, "not-the-key"))["right"] == 401
