"""The fixed requests a qualification sends to a serving activation, and what it records.

Every serving run (the ordinary reference, the donor, each copy) gets exactly the same
workload, so the checks can compare them request by request: five one-token prompts, a longer
greedy completion, 16-token completions at concurrency four, a 16-token stream and eight
32-token completions at concurrency two, plus the API-key probes and the named-parameter
digests read before and after. Requests are greedy with ``ignore_eos`` so every completion has
its full length, and ask for ``token_ids`` (vLLM's ``return_token_ids``; the fixture always
sends them). After the workload (for a lazy copy: once its pages are complete) the digest of
the server's retained memory is read, where the server has that endpoint.
"""

from __future__ import annotations

import http.client
import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from snapctl.models import StrictModel

Group = Literal["prompts", "concurrency"]

ONE_TOKEN_PROMPTS = (
    "The capital of",
    "Once upon a time",
    "2 + 2 =",
    "def main(",
    "Hello, my name is",
)
GREEDY_PROMPT = "In the beginning the engine was cold, and then"
DIGESTS_PATH = "/v1/debug/param-digests"
RETAINED_PATH = "/v1/debug/retained-digest"


class Completion(StrictModel):
    """One completion as the server returned it (``error`` set when the request failed)."""

    label: str
    group: Group
    prompt: str
    max_tokens: int
    stream: bool = False
    token_ids: list[int] | None = None  # None: the server does not return token ids
    text: str = ""
    logprobs: list[float] = []
    error: str | None = None


class DigestRead(StrictModel):
    """One read of the named-parameter digests endpoint."""

    status: int  # HTTP status; 0 when the request itself failed
    digests: dict[str, str] | None = None
    error: str | None = None


class RetainedRead(StrictModel):
    """One read of the retained-memory digest (the fixture's engine memory kept across capture)."""

    status: int  # HTTP status; 0 when the request itself failed
    sha256: str | None = None
    mb: float | None = None
    device: str | None = None  # where the server holds it ("cuda": GPU memory), when it says
    error: str | None = None


class ServingObservation(StrictModel):
    """Everything one serving run saw: auth statuses, digests and every completion."""

    model: str
    auth: dict[str, int]  # "missing", "wrong", "right" -> HTTP status of GET /v1/models
    digests: list[DigestRead]
    completions: dict[str, Completion]
    retained: RetainedRead | None = None  # read after the workload (None: not read)


@dataclass(frozen=True)
class Request:
    label: str
    group: Group
    prompt: str
    max_tokens: int
    stream: bool = False


@dataclass(frozen=True)
class Batch:
    """Requests sent together, ``concurrency`` at a time."""

    requests: tuple[Request, ...]
    concurrency: int


WORKLOAD: tuple[Batch, ...] = (
    Batch(
        tuple(Request(f"one-token-{i}", "prompts", p, 1) for i, p in enumerate(ONE_TOKEN_PROMPTS)),
        1,
    ),
    Batch((Request("greedy-64", "prompts", GREEDY_PROMPT, 64),), 1),
    Batch(
        tuple(
            Request(f"concurrent-{i}", "concurrency", f"Request {i} of four asks", 16)
            for i in range(4)
        ),
        4,
    ),
    Batch((Request("stream-16", "concurrency", "A streamed answer:", 16, stream=True),), 1),
    Batch(
        tuple(Request(f"pair-{i}", "concurrency", f"Pair request {i} says", 32) for i in range(8)),
        2,
    ),
)


class Client:
    """Plain HTTP/1.1 to one ``host:port`` (a published activation), one connection per call."""

    def __init__(self, address: str, api_key: str | None, timeout_s: float = 60.0) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _headers(self, key: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, key: str | None = ""
    ) -> tuple[int, bytes]:
        """One request; ``key=""`` means this client's key, ``None`` no Authorization header."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = self._headers(self.api_key if key == "" else key)
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """POST with ``stream: true``; the server-sent events' JSON objects, in order."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            connection.request(
                "POST", path, body=json.dumps(body).encode(), headers=self._headers(self.api_key)
            )
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
            events = []
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
            return events
        finally:
            connection.close()


def _completion_body(model: str, request: Request) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": request.stream,
    }


def _choice_fields(choice: dict[str, Any]) -> tuple[list[int] | None, str, list[float]]:
    logprobs = choice.get("logprobs") or {}
    values = [float(x) for x in logprobs.get("token_logprobs") or [] if x is not None]
    ids = choice.get("token_ids")
    return (None if ids is None else [int(t) for t in ids]), str(choice.get("text", "")), values


def _completion(
    request: Request,
    *,
    token_ids: list[int] | None = None,
    text: str = "",
    logprobs: list[float] | None = None,
    error: str | None = None,
) -> Completion:
    return Completion(
        label=request.label,
        group=request.group,
        prompt=request.prompt,
        max_tokens=request.max_tokens,
        stream=request.stream,
        token_ids=token_ids,
        text=text,
        logprobs=logprobs or [],
        error=error,
    )


def complete(client: Client, model: str, request: Request) -> Completion:
    """Send one request; a failure is recorded in the completion, never raised."""
    body = _completion_body(model, request)
    try:
        if request.stream:
            ids: list[int] | None = []
            text, logprobs = "", []
            for event in client.stream("/v1/completions", body):
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                for choice in event.get("choices", []):
                    chunk_ids, chunk_text, chunk_logprobs = _choice_fields(choice)
                    ids = None if ids is None or chunk_ids is None else ids + chunk_ids
                    text += chunk_text
                    logprobs += chunk_logprobs
            return _completion(request, token_ids=ids, text=text, logprobs=logprobs)
        status, raw = client.call("POST", "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
        ids, text, logprobs = _choice_fields(json.loads(raw)["choices"][0])
        return _completion(request, token_ids=ids, text=text, logprobs=logprobs)
    except Exception as error:
        return _completion(request, error=f"{type(error).__name__}: {error}")


def read_digests(client: Client) -> DigestRead:
    try:
        status, raw = client.call("GET", DIGESTS_PATH)
    except Exception as error:
        return DigestRead(status=0, error=f"{type(error).__name__}: {error}")
    if status != 200:
        return DigestRead(status=status, error=raw[:200].decode(errors="replace"))
    payload = json.loads(raw)
    return DigestRead(status=status, digests={str(k): str(v) for k, v in payload.items()})


def read_retained(address: str, api_key: str | None, timeout_s: float = 120.0) -> RetainedRead:
    """Read the retained-memory digest; a failure is recorded, never raised."""
    try:
        status, raw = Client(address, api_key, timeout_s).call("GET", RETAINED_PATH)
        if status != 200:
            return RetainedRead(status=status, error=raw[:200].decode(errors="replace"))
        payload = json.loads(raw)
        device = payload.get("device")
        return RetainedRead(
            status=status,
            sha256=str(payload["sha256"]),
            mb=float(payload["mb"]),
            device=None if device is None else str(device),
        )
    except Exception as error:
        return RetainedRead(status=0, error=f"{type(error).__name__}: {error}")


def probe_auth(client: Client) -> dict[str, int]:
    """GET /v1/models without a key, with a wrong one and with the right one."""
    wrong = "wrong-" + secrets.token_hex(8)
    statuses = {}
    for label, key in (("missing", None), ("wrong", wrong), ("right", "")):
        try:
            statuses[label] = client.call("GET", "/v1/models", key=key)[0]
        except Exception:
            statuses[label] = 0
    return statuses


def served_model(client: Client) -> str:
    status, raw = client.call("GET", "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {status}")
    return str(json.loads(raw)["data"][0]["id"])


def observe_serving(
    address: str, api_key: str | None, timeout_s: float = 60.0
) -> ServingObservation:
    """Run the whole workload against ``address`` and record every answer."""
    client = Client(address, api_key, timeout_s)
    auth = probe_auth(client)
    model = served_model(client)
    digests = [read_digests(client)]
    completions: dict[str, Completion] = {}
    for batch in WORKLOAD:
        with ThreadPoolExecutor(max_workers=batch.concurrency) as pool:
            for result in pool.map(lambda r: complete(client, model, r), batch.requests):
                completions[result.label] = result
    digests.append(read_digests(client))
    return ServingObservation(model=model, auth=auth, digests=digests, completions=completions)
