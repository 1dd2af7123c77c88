"""The agent's HTTP API on aiohttp: its listeners (the unix socket, always; a TCP listener that
requires a bearer token; a metrics-only TCP listener) and the routing of each request to the
:class:`~snapctl.agent.service.AgentService` call that answers it.

This module owns what happens between a socket and the service: who may ask (the unix socket's
peer uid, the TCP listener's token and connection caps), how long a client may take (to send a
request, to take an answer), the refusals (an unknown path is 404, a wrong method 405, a body
that is not JSON 400, one its model refuses 422, a missing or wrong token 401; each an
:class:`~snapctl.agent.api.ErrorBody`, never a traceback, never a request's body in a log) and
the answers: whole JSON, or NDJSON in chunks for long operations, whose client hanging up
cancels or orphans what it asked for (see :class:`Stream`). The operations themselves (paths,
methods, models) are :data:`snapctl.agent.api.OPERATIONS`.

Each listener runs an asyncio loop of its own in the thread that calls ``serve_forever``
(aiohttp parses, keeps connections alive and writes). The service's calls block (a copy takes
seconds, a capture minutes, a followed log as long as it is read), so they run in the router's
:class:`WorkerPool`, and a stream's messages go from that worker to the loop one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import select
import socket
import struct
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import CancelledError as FutureCancelledError
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import pydantic_core
from aiohttp import StreamReader, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from pydantic import BaseModel, ValidationError

from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest
from snapctl.agent import API_PREFIX
from snapctl.agent.api import (
    OPERATIONS,
    ErrorBody,
    GcRequest,
    Operation,
    PoolRemoveRequest,
    StopRequest,
)
from snapctl.agent.errors import AgentUnavailableError
from snapctl.agent.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from snapctl.agent.service import AgentService, BadRequestError, Emit, NotFoundError
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool import PoolTarget
from snapctl.pool.cancel import Cancel
from snapctl.statedir.names import NAME_PATTERN
from snapctl.supervision.sockets import bind_private

MAX_BODY_BYTES = 1 << 20
# A request line, or one header line, at most; the parser refuses a longer one (400).
MAX_LINE_BYTES = 64 * 1024
# A client has this long to send each request (line, headers and body together) and to take
# each part of an answer, and a kept-alive connection may idle this long: an idle or stalled
# client never holds a connection (nor, stalling a copy's stream, the copy) for good. A log's
# reader is the exception: it may pause (a pager).
SOCKET_TIMEOUT_S = 60.0
# Connections a TCP listener serves at once, and from one address until they show the token;
# one more is answered 503.
MAX_TCP_CONNECTIONS = 32
MAX_TCP_CONNECTIONS_PER_ADDRESS = 8
# A token listener's connections that have not shown the token yet, from all addresses
# together: the other slots stay for clients that have it. Each has PROOF_TIMEOUT_S to send
# its first request whole.
MAX_TCP_UNPROVEN = 16
PROOF_TIMEOUT_S = 10.0
# Service calls at once (a followed log holds one as long as it is read); more wait their turn.
MAX_WORKERS = 1024
# How long a stopping listener lets the answers in progress end before it cancels them: past
# the agent's own wait for them (snapctl.agent.daemon.IN_FLIGHT_WAIT_S), which decides.
DRAIN_S = 90.0
BusyLimit = Literal["listener", "address", "unproven"]  # which limit refused a TCP connection
NDJSON = "application/x-ndjson"
_SERVER = "snapctl-agent"


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


def _unexpected(error: Exception) -> ErrorBody:
    """A bug's answer (its traceback goes to the agent's log, never to the client), saying no
    input value of a validation (:func:`_safe_text`)."""
    log(f"unexpected error: {_safe_traceback(error)}")
    return ErrorBody(error=f"unexpected {type(error).__name__} in the agent: "
                     f"{_safe_text(error)}", status=int(ExitStatus.ERROR))  # fmt: skip


def _reasons(error: ValidationError, top: str) -> str:
    """Where and why ``error``'s validation failed (``top``: the name of the whole value),
    never with the value: it may be a secret a request carried (an API key)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or top}: {item['msg']}"
        for item in error.errors(include_input=False, include_url=False)
    )


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, then what it was raised from or while handling, as a traceback shows them."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return chain


def _safe_text(error: BaseException) -> str:
    """What ``error`` may say outside the agent: its text, unless it is a ValidationError (its
    text quotes the input) or came from one (its text may repeat that one's)."""
    if isinstance(error, ValidationError):
        return f"{error.title}: {_reasons(error, 'value')}"
    if any(isinstance(link, ValidationError) for link in _chain(error)):
        return "(its text is not shown: it came from a validation, whose input it may hold)"
    return str(error)


def _safe_traceback(error: BaseException) -> str:
    """``error``'s traceback as the log takes it: every frame, each message by
    :func:`_safe_text`."""
    return "\nwhich led to:\n".join(
        "".join(traceback.format_tb(link.__traceback__))
        + f"{type(link).__qualname__}: {_safe_text(link)}"
        for link in reversed(_chain(error))
    )


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
            # Nested past the JSON parser's depth limit reads as this too.
            raise _Refused(_refusal(400, "the request body is not a JSON object")) from error
        reasons = _reasons(error, "body")
        raise _Refused(_refusal(422, f"invalid {model.__name__}: {reasons}")) from error


def _refuse_nul(model: type[BaseModel], body: bytes) -> None:
    """Refuse a string holding NUL anywhere in ``body``: no path, argument, name or secret can
    (the kernel and ``os.environ`` refuse it, later, once something started)."""
    try:
        data = pydantic_core.from_json(body)  # depth-limited, as model_validate_json is
    except ValueError:
        return  # model_validate_json refuses it as not JSON
    where = _holding_nul(data)
    if where is not None:  # the field's name only: its value may be a secret
        raise _Refused(_refusal(422, f"invalid {model.__name__}: {where or 'body'}: holds NUL"))


def _holding_nul(data: Any) -> str | None:
    """Where in ``data`` (a dotted path, "" for the top) the first string holding NUL is, key
    or value, depth first; None if nowhere. Iterative: however deep the body, no recursion."""
    # (value, where it is, whether its key holds NUL, where its container is)
    pending: list[tuple[Any, str, bool, str]] = [(data, "", False, "")]
    while pending:
        value, where, bad_key, parent = pending.pop()
        if bad_key:
            return parent
        if isinstance(value, str):
            if "\0" in value:
                return where
            continue
        if isinstance(value, dict):
            items: list[tuple[Any, Any]] = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        pending.extend(
            (item, f"{where}.{key}" if where else str(key),
             isinstance(key, str) and "\0" in key, where)
            for key, item in reversed(items)
        )  # fmt: skip
    return None


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


class WorkerPool(Executor):
    """Threads for the service's blocking calls: one started when none is idle, up to
    ``max_workers``, then kept for the next call. Daemon threads, unlike
    ``ThreadPoolExecutor``'s: a stopping agent waits for what it drains (see
    :class:`InFlight`), never for a call it gave up on, and the interpreter does not either."""

    def __init__(self, max_workers: int) -> None:
        self._max_workers = max_workers
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._started = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._work.put((future, lambda: fn(*args, **kwargs)))
        if not self._idle.acquire(blocking=False):  # none idle: one more, if allowed
            with self._lock:
                if self._started < self._max_workers:
                    self._started += 1
                    threading.Thread(target=self._serve, name=f"agent-worker-{self._started}",
                                     daemon=True).start()  # fmt: skip
        return future

    def _serve(self) -> None:
        while True:
            future, call = self._work.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as error:
                    future.set_exception(error)
            del future, call  # nothing of a finished call held while idle
            self._idle.release()


Call = Callable[[Mapping[str, str], Mapping[str, str], Any], Result]


@dataclass(frozen=True)
class Route:
    """An operation and the call that answers it: ``call(path parameters, query, body)``,
    the body parsed into the operation's model (None without one)."""

    operation: Operation
    call: Call


class Router:
    """Each operation of :data:`~snapctl.agent.api.OPERATIONS` → the service call that
    answers it; the requests in flight; the workers the calls run in."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.in_flight = InFlight()
        self.workers = WorkerPool(MAX_WORKERS)
        # Set when the agent stops: ``logs -f`` streams end (see stop_following).
        self.stopping = threading.Event()
        s = service
        calls: dict[str, Call] = {
            "version": lambda p, q, b: Answer(200, s.version()),
            "activations": lambda p, q, b: Answer(200, s.activations()),
            "stop": self._stop,
            "logs": self._logs,
            "copy": self._copy,
            "donor": self._donor,
            "bake": self._bake,
            "images": lambda p, q, b: Answer(200, s.images(q.get("root"), q.get("default_root"))),
            "inspect": self._inspect,
            "pool": lambda p, q, b: Answer(200, s.pool_listing()),
            "pool_set": self._pool_set,
            "pool_rm": self._pool_rm,
            "gc": self._gc,
            "metrics": self._metrics,
            "metrics_v1": self._metrics,
        }
        self.routes = tuple(Route(op, calls[op.name]) for op in OPERATIONS)

    def call(
        self, route: Route, params: Mapping[str, str], query: Mapping[str, str], body: bytes | None
    ) -> Result:
        """Answer one request for ``route`` (in a worker: it blocks): its body parsed, then its
        call; a refusal or an error as the answer."""
        try:
            model = route.operation.body
            return route.call(params, query, None if model is None else _parse(model, body))
        except _Refused as refused:
            return refused.answer
        except SnapctlError as error:
            return Answer(http_status(error), error_body(error))
        except Exception as error:
            return Answer(500, _unexpected(error))

    def _stop(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        request = cast(StopRequest, body)
        return Answer(200, self.service.stop(params["name"], request.timeout_s))

    def _logs(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        name = params["name"]
        log, record = self.service.log_path(name)
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
                    f"the agent is stopping, so it stopped following {name}, which still "
                    f"runs: run snapctl logs -f {name} again"
                )

        return Stream(send, drains=not following, hung_up=hung_up)

    def stop_following(self) -> None:
        """The agent is stopping: end every ``logs -f`` stream (within a second; its client
        fails with ``AgentUnavailableError``, exit 7), so that none holds up the stop."""
        self.stopping.set()

    def _copy(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        request = cast(CopyRequest, body)
        return Stream(lambda emit: {"report": self.service.copy(request, emit)},
                      orphaned=None if request.detach else self._stop_orphaned)  # fmt: skip

    def _donor(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        request = cast(DonorRequest, body)
        self.service.check_capture(request)  # refused: a 4xx, before the stream's 200
        cancel = Cancel()
        return Stream(lambda emit: {"report": self.service.donor(request, emit, cancel)},
                      cancel=cancel,
                      orphaned=None if request.detach else self._stop_orphaned)  # fmt: skip

    def _bake(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        request = cast(BakeRequest, body)
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

    def _inspect(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        if "image" not in query:
            return _refusal(422, "give the image directory: ?image=/ABSOLUTE/PATH")
        verify = query.get("verify") in ("1", "true")
        return Answer(200, self.service.inspect(query["image"], verify))

    def _pool_set(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        return Answer(200, self.service.pool_set(cast(PoolTarget, body)))

    def _pool_rm(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        return Answer(200, self.service.pool_remove(cast(PoolRemoveRequest, body).image))

    def _gc(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        return Answer(200, self.service.gc(cast(GcRequest, body).timeout_s))

    def _metrics(self, params: Mapping[str, str], query: Mapping[str, str], body: Any) -> Result:
        return Text(200, self.service.metrics.render(), METRICS_CONTENT_TYPE)


LOGGER = logging.getLogger("snapctl.agent")


def log(message: str) -> None:
    """One line in the agent's log (``snapctl agent`` sends it to stderr, which journald
    keeps under the unit). Never a request's body: it may hold an API key."""
    LOGGER.info(message)


@dataclass(frozen=True)
class Handler:
    """How one listener answers: its router, and who may ask (``token``: the bearer token its
    requests need; ``allowed_uids``: the unix socket peers it serves; ``metrics_only``: it
    serves ``GET /metrics`` and nothing else)."""

    router: Router
    token: bytes | None = None
    metrics_only: bool = False
    allowed_uids: frozenset[int] | None = None


def handler_for(
    router: Router, *, token: bytes | None = None, metrics_only: bool = False,
    allowed_uids: frozenset[int] | None = None,
) -> Handler:  # fmt: skip
    """The handler of one listener."""
    return Handler(router, token, metrics_only, allowed_uids)


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

    def apply(self, connection: Any) -> None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.idle_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.interval_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.probes)


class _Exchange:
    """One request on a connection, from its head's arrival to its answer's end: its body as
    it arrives, and what its client did meanwhile (shut its sending side, or went: closed,
    broken, or too slow to take the answer), told to the stream that answers it."""

    def __init__(self, payload: StreamReader) -> None:
        self.payload = payload
        self.half_closed = False
        self.gone = False
        self._watch: _StreamWatch | None = None

    @property
    def arrived(self) -> bool:
        """The request is here whole (its body too)."""
        return self.payload.is_eof()

    def watch(self, watch: _StreamWatch) -> None:
        self._watch = watch
        if self.gone or self.half_closed:
            watch.told(gone=self.gone)

    def hang_up(self, *, gone: bool) -> None:
        if gone:
            self.gone = True
        else:
            self.half_closed = True
        if self._watch is not None:
            self.watch(self._watch)


class _StreamWatch:
    """A stream's answer: its operation's run in a worker, each message written to the client
    before the operation goes on (a slow reader slows a log's reading, rather than filling the
    agent's memory), and the client's leaving told to the operation (see :class:`Stream`)."""

    def __init__(
        self, stream: Stream, response: web.StreamResponse, connection: _Connection,
        write_timeout_s: float | None,
    ) -> None:  # fmt: skip
        self._stream = stream
        self._response = response
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self._write_timeout_s = write_timeout_s
        self._left = threading.Event()  # hung up, or gone: what it asked for is told
        self._gone = threading.Event()  # nothing more reaches it
        self._lock = threading.Lock()
        # Until the operation returns: a client that leaves after that left with its report,
        # unless the report's write fails.
        self._watching = True

    def run(self) -> int:
        """In a worker: the operation, then its last message; the status to log."""
        stream = self._stream
        status = 200
        try:
            last = stream.run(self.emit)
        except SnapctlError as error:
            status, last = http_status(error), error_body(error)
        except Exception as error:
            status, last = 500, _unexpected(error)
        self._watching = False
        if last is not None:
            self.emit(last)
        report = last.get("report") if isinstance(last, dict) else None
        if self._left.is_set() and stream.orphaned is not None and isinstance(report, dict):
            stream.orphaned(report)
        return status

    def emit(self, message: Any) -> None:
        """In the worker: write ``message``, once what came before is written."""
        if self._gone.is_set():
            return  # the operation still finishes, or is cancelled
        try:
            written = asyncio.run_coroutine_threadsafe(self._write(_json_line(message)),
                                                       self._loop)  # fmt: skip
        except RuntimeError:  # the listener's loop is closed: nobody is left to read it
            self.client_gone()
            return
        while True:
            try:
                written.result(timeout=1.0)
                return
            except TimeoutError:  # a slow reader, or a loop that stopped with it pending
                if self._loop.is_closed():
                    self.client_gone()
                    return
            except FutureCancelledError:
                self.client_gone()
                return

    async def _write(self, data: bytes) -> None:
        if self._gone.is_set():
            return
        try:
            async with asyncio.timeout(self._write_timeout_s):
                await self._response.write(data)
        except (ConnectionError, TimeoutError):
            self._connection.drop()  # gone, or too slow: the operation goes on without it
            self.client_gone()
            return
        if self._connection.closing:  # the write found it gone (a unix socket's EPIPE)
            self.client_gone()

    def told(self, *, gone: bool) -> None:
        """The connection saw its client close (``gone``) or shut its sending side: a capture
        asked to cancel, a log's reader left; another operation is still read (some HTTP
        clients shut their side once the request is out)."""
        if not self._watching:
            return
        if gone:
            self.client_gone()
        elif self._stream.cancel is not None or self._stream.hung_up is not None:
            self.client_left()

    def client_gone(self) -> None:
        self._gone.set()
        self.client_left()

    def client_left(self) -> None:
        with self._lock:
            if self._left.is_set():
                return
            self._left.set()
        if self._stream.cancel is not None:
            self._stream.cancel.request()
        if self._stream.hung_up is not None:
            self._stream.hung_up.set()


class _Connection(web.RequestHandler):
    """aiohttp's connection, and what the agent adds to it: the listener's admission (a TCP
    slot, or a 503), a deadline for each request to arrive whole, the client's hang-up told to
    the request in progress, and refusals of malformed requests as an ErrorBody."""

    def __init__(
        self, manager: web.Server, listener: HTTPListener, *,
        loop: asyncio.AbstractEventLoop, **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(manager, loop=loop, **options)
        self.listener = listener
        self.exchange: _Exchange | None = None
        self.eof = False
        self.refused = False
        # The unix socket's peer, read once while the connection is surely there (None: not a
        # unix socket, or unreadable: refused where the listener checks peers).
        self.peer_uid: int | None = None
        self._event_loop = loop
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.peer_uid = _peer_uid(transport)
        busy = self.listener.admit(self, cast(asyncio.Transport, transport))
        if busy is not None:
            self.refused = True
            _answer_busy(cast(asyncio.Transport, transport), busy, self._event_loop)
            return
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if not self.refused:  # a refused client's request is read and dropped
            super().data_received(data)

    # asyncio's protocol returns whether the transport stays open; aiohttp's says never.
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """Its client shut its sending side, or closed. Kept open only while a request that
        arrived whole is answered: it may still read the answer; else closed."""
        if self.refused or self.exchange is None or not self.exchange.arrived:
            return None
        self.eof = True
        self.exchange.hang_up(gone=_peer_closed(self.transport))
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self.refused:
            return
        self.listener.release(self)
        if self.exchange is not None:
            self.exchange.hang_up(gone=True)
        super().connection_lost(exc)

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def drop(self) -> None:
        """End the connection now, unsent answer and all."""
        if self.transport is not None:
            self.transport.abort()

    def begin(self, payload: StreamReader) -> None:
        """A request's head arrived (the parser's request factory): its exchange starts."""
        self.exchange = _Exchange(payload)

    def end(self) -> None:
        """Its answer is out: the connection waits for the next request, if any may come."""
        self.exchange = None
        if self.eof:
            self.close()  # closed once this answer is written
        else:
            self.arm()

    def arm(self) -> None:
        """The next request must arrive whole within the listener's time for it."""
        self._disarm()
        timeout_s = self.listener.request_timeout(self)
        self._deadline = self._event_loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.exchange is None or not self.exchange.arrived:
            self.force_close()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        """A request the parser refused (or a bug's escape) as an ErrorBody, not aiohttp's text
        page; the connection closes after it."""
        self.exchange = None
        if isinstance(exc, ConnectionError) or request.writer.output_size > 0:
            raise ConnectionError("the answer was cut off: no other can follow")
        if isinstance(exc, HttpProcessingError):
            reason = _malformed(exc)
            log(f"refused before routing: {status} {type(exc).__name__}")
            answer = _refusal(status, f"malformed request: {reason}")
        else:
            error = exc if isinstance(exc, Exception) else RuntimeError(message or "")
            answer = Answer(500, _unexpected(error))
        response = _json_response(answer)
        response.force_close()
        return response


def _malformed(error: HttpProcessingError) -> str:
    """Why the parser refused a request, without the text it quotes (a header's value)."""
    if isinstance(error, LineTooLong):
        return f"a request line or header line over {MAX_LINE_BYTES} bytes"
    reason = []
    for line in (error.message or "bad request").splitlines():
        if not line.strip():
            break
        reason.append(line.strip().rstrip(":"))
    return ": ".join(reason)


def _peer_closed(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer closed (both ways), rather than only shut its sending side."""
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), 0)  # POLLHUP and POLLERR come unasked
    return any(mask & (select.POLLHUP | select.POLLERR) for _fd, mask in poller.poll(0))


def _peer_uid(transport: asyncio.BaseTransport | None) -> int | None:
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _answer_busy(transport: asyncio.Transport, why: str, loop: asyncio.AbstractEventLoop) -> None:
    """503 and close: the listener serves no more connections (or none more from there)."""
    payload = _json_line(ErrorBody(error=why, status=int(ExitStatus.UNAVAILABLE)))
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nRetry-After: 1\r\n"
            "Connection: close\r\n\r\n")  # fmt: skip
    transport.write(head.encode() + payload)
    # Shut our side and read what it sends until it closes (or a second passed): closing on
    # unread bytes would answer with a reset, which may reach it before the 503 does.
    if transport.can_write_eof():
        transport.write_eof()
    loop.call_later(1.0, transport.close)


def _json_response(answer: Answer) -> web.Response:
    headers = {"Content-Type": "application/json", "Server": _SERVER, **dict(answer.headers)}
    if answer.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.Response(status=answer.status, body=_json_line(answer.body), headers=headers)


class _Server(web.Server):
    """aiohttp's low-level server, whose connections are :class:`_Connection` and whose
    requests start an exchange on theirs."""

    def __init__(
        self, handler: Callable[[web.BaseRequest], Any], *, listener: HTTPListener,
        loop: asyncio.AbstractEventLoop, **options: Any,
    ) -> None:  # fmt: skip
        # A client's leaving never cancels its handler: the handler decides what it means (a
        # capture cancelled, a foreground copy stopped, a copy's report still sent).
        super().__init__(handler, request_factory=self._new_request, handler_cancellation=False,
                         loop=loop, **options)  # fmt: skip
        self._listener = listener
        self._event_loop = loop
        self._options = options

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, self._listener, loop=self._event_loop, **self._options)

    def _new_request(
        self, message: RawRequestMessage, payload: StreamReader, protocol: web.RequestHandler,
        writer: AbstractStreamWriter, task: asyncio.Task[None],
    ) -> web.BaseRequest:  # fmt: skip
        cast(_Connection, protocol).begin(payload)
        return web.Request(message, payload, protocol, writer, task, self._event_loop,
                           client_max_size=MAX_BODY_BYTES)  # fmt: skip


async def _routed(request: web.Request) -> web.StreamResponse:
    """What the dispatcher's routes point at: the listener answers each itself."""
    raise AssertionError("routes are answered by HTTPListener._dispatch")


class HTTPListener:
    """One listening socket served by aiohttp, on an event loop of its own that runs in the
    thread calling :meth:`serve_forever` until :meth:`shutdown`."""

    timeout: ClassVar[float] = SOCKET_TIMEOUT_S

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        self.handler = handler
        self.server_address: Any = sock.getsockname()
        self.unix = sock.family == socket.AF_UNIX
        self._lock = threading.Lock()
        self._serving = False
        self._shut = False
        self._stopped_accepting = threading.Event()
        self._dispatcher = web.UrlDispatcher()
        self._routes: dict[web.AbstractRoute, Route] = {}
        name = f"{{name:{NAME_PATTERN.pattern}}}"
        for route in handler.router.routes:
            operation = route.operation
            path = operation.path.replace("{name}", name)
            self._routes[self._dispatcher.add_route(operation.method, path, _routed)] = route
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._start(sock))
        except BaseException:
            sock.close()
            self._loop.close()
            raise

    async def _start(self, sock: socket.socket) -> None:
        self._stop = asyncio.Event()
        server = _Server(
            self._dispatch, listener=self, loop=asyncio.get_running_loop(), access_log=None,
            keepalive_timeout=self.timeout, tcp_keepalive=False, max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
        )  # fmt: skip
        self._runner = web.ServerRunner(server, shutdown_timeout=DRAIN_S)
        await self._runner.setup()
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown`, then until the answers in progress ended (at most
        :data:`DRAIN_S`)."""
        with self._lock:
            if self._shut:
                return
            self._serving = True
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._stopped_accepting.set()
            _close_loop(self._loop)

    async def _serve(self) -> None:
        await self._stop.wait()
        await self._site.stop()
        self._stopped_accepting.set()
        # Idle connections close now; answers in progress go on (a copy's report, a log's
        # last message) until they end or DRAIN_S passed.
        await self._runner.cleanup()

    def shutdown(self) -> None:
        """Accept no more connections (once this returns); what is being answered goes on."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            serving = self._serving
        if serving:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped_accepting.wait()
        else:
            self._loop.run_until_complete(self._runner.cleanup())
            _close_loop(self._loop)

    def server_close(self) -> None:
        self.shutdown()

    # What a listener decides for its connections (a TCP listener decides more) ---------------

    def admit(self, connection: _Connection, transport: asyncio.Transport) -> str | None:
        """None to serve ``connection``, else why it is refused (answered 503)."""
        return None

    def release(self, connection: _Connection) -> None:
        """``connection`` closed, or no longer counts (a follower)."""

    def proven(self, connection: _Connection) -> None:
        """``connection`` showed the token."""

    def request_timeout(self, connection: _Connection) -> float:
        """How long ``connection`` has to send its next request whole."""
        return self.timeout

    # Requests -----------------------------------------------------------------------------

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = cast(_Connection, request.protocol)
        started = time.monotonic()
        status = 500
        try:
            with self.handler.router.in_flight.request() as follower:
                response, status = await self._serve_request(request, connection, follower)
            return response
        except ConnectionError:
            status = 499  # the client went away; what it asked for goes on without it
            raise
        finally:
            path = request.rel_url.raw_path  # never the query (a secret may travel in one)
            log(f"{request.method} {path} {status} {time.monotonic() - started:.3f} s")
            connection.end()

    async def _serve_request(
        self, request: web.BaseRequest, connection: _Connection, follower: Callable[[], None]
    ) -> tuple[web.StreamResponse, int]:
        admitted = await self._admit_request(request, connection)
        if isinstance(admitted, Answer):
            # Its body is left unread: the connection must not read it as the next request.
            return await self._answer(request, connection, admitted, close=True)
        route, params = admitted
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await request.read() if request.body_exists else b""
        query = {key: value for key, value in request.query.items() if value}  # the last
        loop = asyncio.get_running_loop()
        router = self.handler.router
        result = await loop.run_in_executor(router.workers, router.call, route, params, query,
                                            body or None)  # fmt: skip
        if isinstance(result, Stream):
            if not result.drains:
                follower()  # a stopping agent ends it rather than waits for it
                # Authorized and never ending by itself: it holds no TCP slot (a log shipper
                # may follow every copy from one address).
                self.release(connection)
            return await self._stream(request, connection, result)
        return await self._answer(request, connection, result)

    async def _admit_request(
        self, request: web.BaseRequest, connection: _Connection
    ) -> tuple[Route, dict[str, str]] | Answer:
        """The route ``request`` asks for and its path parameters, or why it is refused before
        its body is read."""
        refusal = self._refuse_peer(request, connection)
        if refusal is not None:
            return refusal
        if self.handler.metrics_only and request.path != "/metrics":
            return _refusal(404, "this listener serves only GET /metrics")
        match = await self._dispatcher.resolve(cast(web.Request, request))
        path = request.rel_url.raw_path
        refused = match.http_exception
        if isinstance(refused, web.HTTPMethodNotAllowed):
            return _not_allowed(request.method, path, refused.allowed_methods)
        if refused is not None:
            if not path.startswith(API_PREFIX + "/"):
                return _refusal(404, f"no such path {path!r}: the API is under {API_PREFIX}/")
            return _refusal(404, f"no such path {path!r} (see docs/agent.md)")
        route = self._routes[match.route]
        if route.operation.unix_only and not self.unix:
            # It runs the server command in the environment and directory the client sends:
            # only a local root client (the socket's peer check) may ask for that.
            return _refusal(
                403,
                f"{path} runs the server command in the environment and working directory "
                "the request carries: the agent takes it only on its unix socket (run snapctl "
                "on the agent's host), never over TCP",
            )
        if request.headers.get("Transfer-Encoding"):
            return _refusal(411, "send the body with a Content-Length (not chunked)")
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return _refusal(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        return route, dict(match)

    def _refuse_peer(self, request: web.BaseRequest, connection: _Connection) -> Answer | None:
        token = self.handler.token
        if token is not None:
            scheme, _, value = request.headers.get("Authorization", "").partition(" ")
            given = value.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, token):
                return _refusal(401, "this listener needs Authorization: Bearer TOKEN (the "
                                     "agent's --token-file)")  # fmt: skip
            self.proven(connection)
        allowed = self.handler.allowed_uids
        if allowed is not None:
            uid = connection.peer_uid
            if uid is None:
                return _refusal(403, "the agent could not read this connection's peer: refused")
            if uid not in allowed:
                return _refusal(403, f"uid {uid} may not use the agent (root only)")
        return None

    async def _answer(
        self, request: web.BaseRequest, connection: _Connection, result: Answer | Text,
        close: bool = False,
    ) -> tuple[web.StreamResponse, int]:  # fmt: skip
        if isinstance(result, Text):
            response: web.StreamResponse = web.Response(
                status=result.status, body=result.body,
                headers={"Content-Type": result.content_type, "Server": _SERVER},
            )  # fmt: skip
        else:
            response = _json_response(result)
        if close or connection.eof:
            response.force_close()
        await self._sent(response.prepare(request), connection)
        await self._sent(response.write_eof(), connection)
        if close:  # now: a body left unread is never waited for, nor read as a request
            connection.force_close()
        return response, result.status

    async def _stream(
        self, request: web.BaseRequest, connection: _Connection, stream: Stream
    ) -> tuple[web.StreamResponse, int]:
        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Server": _SERVER})
        response.force_close()  # chunked (HTTP/1.1), one message a chunk; then it closes
        await self._sent(response.prepare(request), connection)
        # A log's reader may pause for as long as it likes (a pager); others have the timeout.
        write_timeout_s = None if stream.hung_up is not None else self.timeout
        watch = _StreamWatch(stream, response, connection, write_timeout_s)
        if connection.exchange is not None:
            connection.exchange.watch(watch)
        router = self.handler.router
        status = await asyncio.get_running_loop().run_in_executor(router.workers, watch.run)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response, status

    async def _sent(self, writing: Awaitable[Any], connection: _Connection) -> None:
        """``writing`` done within the timeout, else the connection dropped (the client took
        too long to take its answer) and ConnectionError raised."""
        try:
            async with asyncio.timeout(self.timeout):
                await writing
        except TimeoutError as error:
            connection.drop()
            raise ConnectionResetError("the client did not take its answer in time") from error


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """End what still runs on ``loop`` (cancelled), then close it, as ``asyncio.run`` does."""
    if loop.is_closed():
        return
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class UnixHTTPServer(HTTPListener):
    """The agent's socket: created 0600 (see :func:`bind_private`); every request's peer is
    checked against the handler's ``allowed_uids``."""

    def __init__(self, path: str, handler: Handler) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            bind_private(sock, path)
        except BaseException:
            sock.close()
            raise
        super().__init__(sock, handler)


class TCPHTTPServer(HTTPListener):
    """A TCP listener serving at most ``max_connections`` at once; of them at most
    ``max_per_address`` from one client address, and (with a token) ``max_unproven`` from
    all, until they show the token, which they must do within ``proof_timeout_s``. Past any,
    a connection is answered 503 and closed, so that clients that never finish cannot take
    every slot, nor clients without the token all of them (a controller with it may ask for
    many copies at once). A ``logs -f`` gives its slot back once it follows. Each connection
    is watched for a peer that vanished (:class:`PeerWatch`)."""

    max_connections: ClassVar[int] = MAX_TCP_CONNECTIONS
    max_per_address: ClassVar[int] = MAX_TCP_CONNECTIONS_PER_ADDRESS
    max_unproven: ClassVar[int] = MAX_TCP_UNPROVEN
    proof_timeout_s: ClassVar[float] = PROOF_TIMEOUT_S
    peer_watch: ClassVar[PeerWatch] = PeerWatch()

    def __init__(
        self, address: tuple[str, int], handler: Handler,
        on_refused: Callable[[BusyLimit], None] = lambda limit: None,
    ) -> None:  # fmt: skip
        self.on_refused = on_refused  # a metric: how often, and which limit
        # All on the listener's loop: no lock.
        self._per_address: dict[str, int] = {}
        self._holders: set[_Connection] = set()  # connections holding a slot
        self._unproven: dict[_Connection, str] = {}  # and their address, until the token
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(socket.create_server(address, family=family), handler)

    def admit(self, connection: _Connection, transport: asyncio.Transport) -> str | None:
        limit = self._take_slot(connection, transport.get_extra_info("peername")[0])
        if limit is not None:
            self.on_refused(limit)
            return self._busy_reason(limit)
        self.peer_watch.apply(transport.get_extra_info("socket"))
        return None

    def _take_slot(self, connection: _Connection, address: str) -> BusyLimit | None:
        """A slot for ``connection`` from ``address``; else the limit that refuses it."""
        if self._per_address.get(address, 0) >= self.max_per_address:
            return "address"
        if self.handler.token is not None and len(self._unproven) >= self.max_unproven:
            return "unproven"
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
        if limit == "unproven":
            return (f"the agent serves {self.max_unproven} TCP connections at once that have "
                    "not sent the token yet: try again")  # fmt: skip
        return f"the agent serves {self.max_connections} TCP connections at once: try again"

    def proven(self, connection: _Connection) -> None:
        """``connection`` sent the token: it no longer counts against its address's share."""
        self._leave_share(connection)

    def release(self, connection: _Connection) -> None:
        """The slot ``connection`` holds, if it still holds one."""
        self._leave_share(connection)
        self._holders.discard(connection)

    def request_timeout(self, connection: _Connection) -> float:
        if self.handler.token is not None and connection in self._unproven:
            return min(self.proof_timeout_s, self.timeout)
        return self.timeout

    def _leave_share(self, connection: _Connection) -> None:
        address = self._unproven.pop(connection, None)
        if address is not None:
            left = self._per_address.pop(address, 1) - 1
            if left:
                self._per_address[address] = left
