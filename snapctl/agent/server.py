"""The agent's HTTP/1.1 listeners and routing: the unix socket (always), an optional TCP
listener that requires a bearer token, and an optional metrics-only listener.

Every request is validated strictly before anything runs: an unknown path is 404, a wrong method
405, a body that is not JSON 400, a body its model refuses 422, a missing or wrong token 401;
each with an :class:`~snapctl.agent.api.ErrorBody` saying why (never a traceback; never a
request's body in a log). Long operations answer NDJSON in chunks (see ``snapctl.agent.client``).
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import os
import re
import select
import socket
import socketserver
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ValidationError

from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest
from snapctl.agent import API_PREFIX
from snapctl.agent.api import ErrorBody, GcRequest, PoolRemoveRequest, StopRequest
from snapctl.agent.errors import AgentUnavailableError
from snapctl.agent.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from snapctl.agent.service import AgentService, BadRequestError, Emit, NotFoundError
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool import PoolTarget
from snapctl.pool.cancel import Cancel
from snapctl.statedir.names import NAME_PATTERN
from snapctl.supervision.sockets import bind_private

MAX_BODY_BYTES = 1 << 20
# A client has this long to send each request (line, headers and body together), and to take
# each part of an answer: an idle or stalled client never holds a thread (nor, stalling a
# copy's stream, the copy) for good. A log's reader is the exception: it may pause (a pager).
SOCKET_TIMEOUT_S = 60.0
# Connections a TCP listener serves at once, and from one address; one more is answered 503.
MAX_TCP_CONNECTIONS = 32
MAX_TCP_CONNECTIONS_PER_ADDRESS = 8
BusyLimit = Literal["listener", "address"]  # which of the two refused a TCP connection
_NAME = f"(?P<name>{NAME_PATTERN.pattern})"
# They run the server command in the environment and directory the client sends: only a
# local root client (the unix socket's peer check) may ask for that, never the TCP listener.
_UNIX_SOCKET_ONLY = frozenset({f"{API_PREFIX}/donors", f"{API_PREFIX}/bakes"})
METRICS_PATHS = ("/metrics", f"{API_PREFIX}/metrics")


@dataclass(frozen=True)
class Answer:
    """A whole JSON answer."""

    status: int
    body: Any
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Stream:
    """A streamed NDJSON answer: ``run(emit)`` emits messages; what it returns (or the error
    it raises) is the last message. ``drains``: a stopping agent waits for it to end (a copy's
    report); False for one that would never end by itself (``logs -f``), which the agent ends
    instead when it stops (see :meth:`Router.stop_following`)."""

    run: Callable[[Emit], Any]
    drains: bool = True
    # Its client hanging up, or gone, cancels it (a capture: see snapctl.pool.cancel).
    cancel: Cancel | None = None
    # Called with the report when its client is gone by the time it came: what started has
    # no owner (a foreground copy or donor, which its client would have stopped).
    orphaned: Callable[[dict[str, Any]], None] | None = None
    # Set once its client is gone (closed, or shut its sending side): a log's reading ends
    # then. Such a stream has no write timeout: its reader may pause (a pager).
    hung_up: threading.Event | None = None


@dataclass(frozen=True)
class Text:
    status: int
    body: bytes
    content_type: str


Result = Answer | Stream | Text


def _json_ready(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _json_line(value: Any) -> bytes:
    return json.dumps(_json_ready(value), separators=(",", ":")).encode() + b"\n"


def error_body(error: SnapctlError) -> ErrorBody:
    usage = error.usage if isinstance(error, BadRequestError) else None
    return ErrorBody(**error.to_wire(), usage=usage)


def http_status(error: SnapctlError) -> int:
    if isinstance(error, NotFoundError):
        return 404
    return {
        ExitStatus.USAGE: 400,
        ExitStatus.CONFLICT: 409,
        ExitStatus.VERIFY_FAILED: 422,
        ExitStatus.UNAVAILABLE: 503,
    }.get(ExitStatus(error.exit_status), 500)


def _refusal(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    return Answer(status, ErrorBody(error=message, status=int(ExitStatus.USAGE)), headers)


def _not_allowed(method: str, path: str, allowed: set[str]) -> Answer:
    methods = ", ".join(sorted(allowed))
    return _refusal(405, f"{method} is not allowed on {path} (allowed: {methods})",
                    (("Allow", methods),))  # fmt: skip


def _parse(model: type[BaseModel], body: bytes | None) -> Any:
    """``body`` as ``model`` (an empty body: the model's defaults), or a refusal to raise."""
    if body and b"\\u0000" in body:
        _refuse_nul(model, body)
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as error:
        if any(item["type"] == "json_invalid" for item in error.errors()):
            raise _Refused(_refusal(400, "the request body is not a JSON object")) from error
        # Never echo the input: a refused body may hold a secret (an API key).
        reasons = "; ".join(
            f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
            for item in error.errors(include_input=False, include_url=False)
        )
        raise _Refused(_refusal(422, f"invalid {model.__name__}: {reasons}")) from error


def _refuse_nul(model: type[BaseModel], body: bytes) -> None:
    """Refuse a string holding NUL anywhere in ``body``: no path, argument, name or secret can
    (the kernel and ``os.environ`` refuse it, later, once something started)."""
    try:
        data = json.loads(body)
    except ValueError:
        return  # model_validate_json refuses it as not JSON

    def walk(value: Any, where: str) -> str | None:
        if isinstance(value, str):
            return where if "\0" in value else None
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            return None
        for key, item in items:
            if isinstance(key, str) and "\0" in key:
                return where or "body"
            found = walk(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None

    where = walk(data, "")
    if where is not None:  # the field's name only: its value may be a secret
        raise _Refused(_refusal(422, f"invalid {model.__name__}: {where or 'body'}: holds NUL"))


class _Refused(Exception):
    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.body.error)
        self.answer = answer


class InFlight:
    """The requests being answered, so that a stopping agent lets them finish (a copy's
    report reaches its client) before it discards the pool; and the ``logs -f`` streams,
    which it ends instead, and waits for only until their clients were told."""

    def __init__(self) -> None:
        self._draining = 0
        self._following = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def request(self) -> Iterator[Callable[[], None]]:
        """Count one request while the block runs; it calls what it is given once it turns
        out to be a follower (see :attr:`Stream.drains`)."""
        with self._idle:
            self._draining += 1
        following = False

        def follower() -> None:
            nonlocal following
            with self._idle:
                if not following:
                    following = True
                    self._draining -= 1
                    self._following += 1
                    self._idle.notify_all()

        try:
            yield follower
        finally:
            with self._idle:
                if following:
                    self._following -= 1
                else:
                    self._draining -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float, *, followers: bool = False) -> bool:
        """Wait until no request is being answered (``followers``: no follower either)."""
        with self._idle:
            return self._idle.wait_for(
                lambda: self._draining == 0 and (not followers or self._following == 0),
                timeout_s,
            )


class Router:
    """Method and path → the service call, with the body parsed into its model."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.in_flight = InFlight()
        # Set when the agent stops: ``logs -f`` streams end (see stop_following).
        self.stopping = threading.Event()
        s = service
        self.routes: list[tuple[str, re.Pattern[str], Callable[..., Result]]] = [
            ("GET", re.compile(r"/version"), lambda m, q, b: Answer(200, s.version())),
            ("GET", re.compile(r"/activations"), lambda m, q, b: Answer(200, s.activations())),
            ("POST", re.compile(rf"/activations/{_NAME}/stop"), self._stop),
            ("GET", re.compile(rf"/activations/{_NAME}/logs"), self._logs),
            ("POST", re.compile(r"/copies"), self._copy),
            ("POST", re.compile(r"/donors"), self._donor),
            ("POST", re.compile(r"/bakes"), self._bake),
            ("GET", re.compile(r"/images"), self._images),
            ("GET", re.compile(r"/images/inspect"), self._inspect),
            ("GET", re.compile(r"/pool"), lambda m, q, b: Answer(200, s.pool_listing())),
            ("POST", re.compile(r"/pool/set"), self._pool_set),
            ("POST", re.compile(r"/pool/rm"), self._pool_rm),
            ("POST", re.compile(r"/gc"), self._gc),
        ]

    def route(self, method: str, target: str, body: bytes | None) -> Result:
        url = urlsplit(target)
        if url.path in METRICS_PATHS:
            if method != "GET":
                return _not_allowed(method, url.path, {"GET"})
            return Text(200, self.service.metrics.render(), METRICS_CONTENT_TYPE)
        if not url.path.startswith(API_PREFIX + "/"):
            return _refusal(404, f"no such path {url.path!r}: the API is under {API_PREFIX}/")
        path = url.path[len(API_PREFIX) :]
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        allowed = set()
        for route_method, pattern, handler in self.routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if route_method != method:
                allowed.add(route_method)
                continue
            try:
                return handler(match, query, body)
            except _Refused as refused:
                return refused.answer
        if allowed:
            return _not_allowed(method, url.path, allowed)
        return _refusal(404, f"no such path {url.path!r} (see docs/agent.md)")

    def _stop(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        request = _parse(StopRequest, body)
        return Answer(200, self.service.stop(match["name"], request.timeout_s))

    def _logs(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        log, record = self.service.log_path(match["name"])
        following = query.get("follow") in ("1", "true") and record is not None
        hung_up = threading.Event()

        def ended() -> bool:
            return self.stopping.is_set() or hung_up.is_set()

        def send(emit: Emit) -> None:
            # In chunks, however long the log: never all of it in the agent's memory.
            self.service.pass_log(log, lambda part: emit({"text": part}),
                                  record=record if following else None,
                                  until=ended if following else hung_up.is_set)  # fmt: skip
            if following and self.stopping.is_set() and record is not None and record.exists():
                raise AgentUnavailableError(
                    f"the agent is stopping, so it stopped following {match['name']}, which "
                    f"still runs: run snapctl logs -f {match['name']} again"
                )

        return Stream(send, drains=not following, hung_up=hung_up)

    def stop_following(self) -> None:
        """The agent is stopping: end every ``logs -f`` stream (within a second; its client
        fails with ``AgentUnavailableError``, exit 7), so that none holds up the stop."""
        self.stopping.set()

    def _copy(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        request = _parse(CopyRequest, body)
        return Stream(lambda emit: {"report": self.service.copy(request, emit)},
                      orphaned=None if request.detach else self._stop_orphaned)  # fmt: skip

    def _donor(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        request = _parse(DonorRequest, body)
        self.service.check_capture(request)  # refused: a 4xx, before the stream's 200
        cancel = Cancel()
        return Stream(lambda emit: {"report": self.service.donor(request, emit, cancel)},
                      cancel=cancel,
                      orphaned=None if request.detach else self._stop_orphaned)  # fmt: skip

    def _bake(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        request = _parse(BakeRequest, body)
        self.service.check_capture(request)
        cancel = Cancel()
        return Stream(lambda emit: {"report": self.service.bake(request, emit, cancel)},
                      cancel=cancel)  # fmt: skip

    def _stop_orphaned(self, report: dict[str, Any]) -> None:
        """A foreground start whose client left before its report: stop what started, as its
        client would have when it ended."""
        for started in report.get("copies", [report]):
            name = started.get("name")
            try:
                self.service.stop(name, StopRequest().timeout_s)
                log(f"stopped {name}: its client left before its report")
            except Exception as error:  # stopped meanwhile (its supervisor saw the signal)
                log(f"stopping {name}, whose client left: {type(error).__name__}: {error}")

    def _images(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        return Answer(200, self.service.images(query.get("root"), query.get("default_root")))

    def _inspect(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        if "image" not in query:
            return _refusal(422, "give the image directory: ?image=/ABSOLUTE/PATH")
        verify = query.get("verify") in ("1", "true")
        return Answer(200, self.service.inspect(query["image"], verify))

    def _pool_set(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        return Answer(200, self.service.pool_set(_parse(PoolTarget, body)))

    def _pool_rm(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        return Answer(200, self.service.pool_remove(_parse(PoolRemoveRequest, body).image))

    def _gc(self, match: re.Match[str], query: dict[str, str], body: bytes | None) -> Result:
        return Answer(200, self.service.gc(_parse(GcRequest, body).timeout_s))


LOGGER = logging.getLogger("snapctl.agent")


def log(message: str) -> None:
    """One line in the agent's log (``snapctl agent`` sends it to stderr, which journald
    keeps under the unit). Never a request's body: it may hold an API key."""
    LOGGER.info(message)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "snapctl-agent"
    # Set per listener (see Listener): the router, the bearer token (TCP), metrics only.
    router: ClassVar[Router]
    token: ClassVar[bytes | None] = None
    metrics_only: ClassVar[bool] = False
    allowed_uids: ClassVar[frozenset[int] | None] = None
    timeout = SOCKET_TIMEOUT_S  # socketserver sets it on the connection
    _body_length = 0

    def setup(self) -> None:
        super().setup()
        self._requests = _RequestReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._requests)

    def handle_one_request(self) -> None:
        self._requests.start()
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # our own line per request, without the client's address or the query

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        started = time.monotonic()
        status = 500
        try:
            with self.router.in_flight.request() as follower:
                result = self._result(method)
                if isinstance(result, Stream) and not result.drains:
                    follower()  # a stopping agent ends it rather than waits for it
                    # Authorized and never ending by itself: it must not hold a TCP slot
                    # (a log shipper may follow every copy from one address).
                    if isinstance(self.server, TCPHTTPServer):
                        self.server.give_back(self.connection)
                status = self._answer(result)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            status = 499  # the client went away; what it asked for goes on without it
            self.close_connection = True
        finally:
            path = urlsplit(self.path).path
            log(f"{method} {path} {status} {time.monotonic() - started:.3f} s")

    def _result(self, method: str) -> Result:
        refusal = self._refuse_before_body()
        if refusal is not None:
            # Its body is left unread: the connection must not read it as the next request.
            self.close_connection = True
            return refusal
        body = self.rfile.read(self._body_length) if self._body_length else None
        if self.metrics_only and urlsplit(self.path).path != "/metrics":
            return _refusal(404, "this listener serves only GET /metrics")
        try:
            return self.router.route(method, self.path, body)
        except SnapctlError as error:
            return Answer(http_status(error), error_body(error))
        except Exception as error:
            log(f"unexpected error: {traceback.format_exc()}")
            return Answer(500, ErrorBody(error=f"unexpected {type(error).__name__} in the agent: "
                                         f"{error}", status=int(ExitStatus.ERROR)))  # fmt: skip

    def _refuse_before_body(self) -> Answer | None:
        refusal = self._refuse_peer() or self._refuse_remote_capture()
        if refusal is not None:
            return refusal
        if self.headers.get("Transfer-Encoding"):
            return _refusal(411, "send the body with a Content-Length (not chunked)")
        # Strictly digits, and one value: two readings of one request must never differ.
        lengths = {value.strip() for value in self.headers.get_all("Content-Length") or ()}
        if len(lengths) > 1:
            return _refusal(400, "the request has conflicting Content-Length headers")
        length = lengths.pop() if lengths else "0"
        if not length.isascii() or not length.isdigit():
            return _refusal(400, f"Content-Length must be a number of bytes, not {length!r}")
        if len(length) > 10 or int(length) > MAX_BODY_BYTES:
            return _refusal(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        self._body_length = int(length)
        return None

    def _refuse_peer(self) -> Answer | None:
        if self.token is not None:
            given = self.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode(), self.token
            ):
                return _refusal(401, "this listener needs Authorization: Bearer TOKEN (the "
                                     "agent's --token-file)")  # fmt: skip
            if isinstance(self.server, TCPHTTPServer):
                self.server.proven(self.connection)
        if self.allowed_uids is not None:
            uid = _peer_uid(self.connection)
            if uid is not None and uid not in self.allowed_uids:
                return _refusal(403, f"uid {uid} may not use the agent (root only)")
        return None

    def _refuse_remote_capture(self) -> Answer | None:
        if self.connection.family == socket.AF_UNIX or self.metrics_only:
            return None
        path = urlsplit(self.path).path
        if path not in _UNIX_SOCKET_ONLY:
            return None
        return _refusal(
            403,
            f"{path} runs the server command in the environment and working directory the "
            "request carries: the agent takes it only on its unix socket (run snapctl on the "
            "agent's host), never over TCP",
        )

    def _answer(self, result: Result) -> int:
        if isinstance(result, Text):
            self._whole(result.status, result.body, result.content_type)
            return result.status
        if isinstance(result, Answer):
            self._whole(result.status, _json_line(result.body), "application/json", result.headers)
            return result.status
        return self._stream(result)

    def _whole(
        self, status: int, payload: bytes, content_type: str,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, a too long target or header,
        an unknown method) as an ErrorBody like every other answer, not its HTML page."""
        reason = message or self.responses.get(code, ("refused",))[0]
        text = f"{reason}: {explain}" if explain else reason
        log(f"refused before routing: {code} {reason}")
        self.close_connection = True
        # Left at http.server's default when the request line did not parse: it would answer
        # HTTP/0.9 style, a bare body no client today reads as an answer.
        self.request_version = self.protocol_version
        self._answer(_refusal(code, f"malformed request: {text}"))

    def _stream(self, stream: Stream) -> int:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        lock = threading.Lock()
        gone = threading.Event()
        left = threading.Event()

        def client_left() -> None:
            left.set()
            if stream.cancel is not None:
                stream.cancel.request()
            if stream.hung_up is not None:
                stream.hung_up.set()

        def emit(message: Any) -> None:
            data = _json_line(message)
            with lock:
                if gone.is_set():
                    return
                try:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                except OSError:
                    gone.set()  # the client left: the operation still finishes, or is cancelled
                    client_left()

        status = 200
        if stream.hung_up is not None:
            self.connection.settimeout(None)  # a paused reader of a log is still there
        hooks = (stream.cancel, stream.orphaned, stream.hung_up)
        watching = any(hook is not None for hook in hooks)
        watch = None
        if watching:
            # A half-close asks to cancel where there is something to cancel. A log's reading
            # ends on it too: over TCP a closed client shows only as one (no POLLHUP before
            # a write fails, and a quiet log is never written).
            half_close = stream.cancel is not None or stream.hung_up is not None
            watch = HangupWatch(self.connection, client_left, half_close=half_close)
        try:
            with watch or contextlib.nullcontext():
                last = stream.run(emit)
        except SnapctlError as error:
            status = http_status(error)
            last = error_body(error)
        except Exception as error:
            log(f"unexpected error: {traceback.format_exc()}")
            status = 500
            last = ErrorBody(error=f"unexpected {type(error).__name__} in the agent: {error}",
                             status=int(ExitStatus.ERROR))  # fmt: skip
        if last is not None:
            emit(last)
        report = last.get("report") if isinstance(last, dict) else None
        if left.is_set() and stream.orphaned is not None and isinstance(report, dict):
            stream.orphaned(report)
        with lock, contextlib.suppress(OSError):
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        self.close_connection = True
        return status


class _RequestReader(io.RawIOBase):
    """What a handler reads its requests from: each request must arrive whole within
    ``timeout_s`` of :meth:`start` (a timeout per read alone would let a client that sends a
    byte a minute hold its connection, and a TCP listener's slot, for good)."""

    def __init__(self, connection: socket.socket, timeout_s: float | None) -> None:
        self._connection = connection
        self._timeout_s = timeout_s
        self._deadline = float("inf")

    def readable(self) -> bool:
        return True

    def start(self) -> None:
        if self._timeout_s is not None:
            self._deadline = time.monotonic() + self._timeout_s

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._connection.settimeout(min(remaining, self._timeout_s or remaining))
        try:
            return self._connection.recv_into(buffer)
        finally:  # writes keep the whole timeout
            self._connection.settimeout(self._timeout_s)


class HangupWatch:
    """While the body runs, a thread watches ``connection`` and calls ``on_hangup`` once the
    connection broke, or (``half_close``) once its client shut its sending side: an
    interrupted ``snapctl donor``/``bake`` hangs up that way on purpose. Without
    ``half_close`` a client that shuts its side after its request (some HTTP clients do)
    is still there to read the answer."""

    def __init__(
        self, connection: socket.socket, on_hangup: Callable[[], None], *, half_close: bool
    ) -> None:
        self._fd = connection.fileno()
        self._on_hangup = on_hangup
        self._events = select.POLLRDHUP if half_close else 0
        self._wake = os.eventfd(0, os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._watch, name="hangup-watch", daemon=True)

    def __enter__(self) -> HangupWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        os.close(self._wake)

    def _watch(self) -> None:
        poller = select.poll()
        # POLLHUP and POLLERR come whatever is asked for.
        poller.register(self._fd, self._events)
        poller.register(self._wake, select.POLLIN)
        while True:
            for fd, mask in poller.poll():
                if fd == self._wake or mask & select.POLLNVAL:
                    return
                if mask & (self._events | select.POLLHUP | select.POLLERR):
                    self._on_hangup()
                    return


def _peer_uid(connection: socket.socket) -> int | None:
    if connection.family != socket.AF_UNIX:
        return None
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def server_bind(self) -> None:
        bind_private(self.socket, str(self.server_address))
        self.server_address = self.socket.getsockname()


@dataclass(frozen=True)
class PeerWatch:
    """How a TCP listener finds a client that vanished without closing (a partition, a host
    that rebooted): keepalive probes after ``idle_s`` without traffic, ``probes`` of them
    ``interval_s`` apart. A log's follower needs it: it is never read from, and a quiet log
    is never written to. No TCP_USER_TIMEOUT: since Linux 5.11 it also ends a connection
    whose reader, still acknowledging, keeps its window shut (a paused pager); a vanished
    reader of unacknowledged data fails by the kernel's retransmission limit."""

    idle_s: int = 60
    interval_s: int = 10
    probes: int = 6

    def apply(self, connection: socket.socket) -> None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.idle_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.interval_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.probes)


class TCPHTTPServer(ThreadingHTTPServer):
    """A TCP listener serving at most ``max_connections`` at once, and ``max_per_address``
    from one client address until they prove the token: past either, a connection is
    answered 503 and closed, so that clients that never finish cannot take every thread, nor
    one client without the token every slot (a controller with it may ask for many copies at
    once). A ``logs -f`` gives its slot back once it follows. Each connection is watched for
    a peer that vanished (:class:`PeerWatch`)."""

    daemon_threads = True
    block_on_close = False
    max_connections: ClassVar[int] = MAX_TCP_CONNECTIONS
    max_per_address: ClassVar[int] = MAX_TCP_CONNECTIONS_PER_ADDRESS
    peer_watch: ClassVar[PeerWatch] = PeerWatch()

    def __init__(
        self, address: tuple[str, int], handler: type[Handler],
        on_refused: Callable[[BusyLimit], None] = lambda limit: None,
    ) -> None:  # fmt: skip
        super().__init__(address, handler)
        self.on_refused = on_refused  # a metric: how often, and which limit
        self._per_address: dict[str, int] = {}
        self._holders: set[socket.socket] = set()  # connections holding a slot
        self._unproven: dict[socket.socket, str] = {}  # and their address, until the token
        self._lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        limit = self._take_slot(request, client_address[0])
        if limit is not None:
            self.on_refused(limit)
            _answer_busy(request, self._busy_reason(limit))
            self.shutdown_request(request)
            return
        try:
            self.peer_watch.apply(request)
            super().process_request(request, client_address)
        except BaseException:
            self.give_back(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.give_back(request)

    def _take_slot(self, connection: socket.socket, address: str) -> BusyLimit | None:
        """A slot for ``connection`` from ``address``; else the limit that refuses it."""
        with self._lock:
            if self._per_address.get(address, 0) >= self.max_per_address:
                return "address"
            if len(self._holders) >= self.max_connections:
                return "listener"
            self._per_address[address] = self._per_address.get(address, 0) + 1
            self._holders.add(connection)
            self._unproven[connection] = address
        return None

    def _busy_reason(self, limit: BusyLimit) -> str:
        if limit == "address":
            return (f"the agent serves {self.max_per_address} TCP connections at once from one "
                    "address: try again")  # fmt: skip
        return f"the agent serves {self.max_connections} TCP connections at once: try again"

    def proven(self, connection: socket.socket) -> None:
        """``connection`` sent the token: it no longer counts against its address's share."""
        with self._lock:
            self._leave_share(connection)

    def give_back(self, connection: socket.socket) -> None:
        """The slot ``connection`` holds, if it still holds one."""
        with self._lock:
            self._leave_share(connection)
            self._holders.discard(connection)

    def _leave_share(self, connection: socket.socket) -> None:
        address = self._unproven.pop(connection, None)
        if address is not None:
            left = self._per_address.pop(address, 1) - 1
            if left:
                self._per_address[address] = left


def _answer_busy(connection: socket.socket, why: str) -> None:
    body = ErrorBody(error=why, status=int(ExitStatus.UNAVAILABLE))
    payload = _json_line(body)
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nRetry-After: 1\r\n"
            "Connection: close\r\n\r\n")  # fmt: skip
    with contextlib.suppress(OSError):
        connection.settimeout(1.0)  # the accepting thread never waits on a slow client
        connection.sendall(head.encode() + payload)
        connection.shutdown(socket.SHUT_WR)
        # Read what it sent already: closing on unread bytes would answer with a reset,
        # which may reach the client before the 503 does.
        connection.setblocking(False)
        connection.recv(65536)  # once: the accepting thread never loops on a client


def handler_for(
    router: Router, *, token: bytes | None = None, metrics_only: bool = False,
    allowed_uids: frozenset[int] | None = None,
) -> type[Handler]:  # fmt: skip
    """A handler class for one listener."""
    return type(
        "ListenerHandler",
        (Handler,),
        {"router": router, "token": token, "metrics_only": metrics_only,
         "allowed_uids": allowed_uids},
    )  # fmt: skip
