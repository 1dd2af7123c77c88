"""The thin client: the CLI's side of the agent's API, over its unix socket.

Not ``http.client`` (it imports ``email`` and ``ssl``, tens of milliseconds), nor ``json`` and
``socket`` (:mod:`snapctl.wire` says why), nor :mod:`snapctl.errors` until something
fails: the CLI's fast path (``snapctl ps`` through the agent) must not pay for imports a few
socket writes do not need. One request per connection (``Connection: close``); a response is
JSON (``Content-Length``) or, for long operations, NDJSON in chunks, one message per chunk.
Its errors are in :mod:`snapctl.agent.errors`.
"""

from __future__ import annotations

import io
import os

from snapctl import wire
from snapctl.agent import API_PREFIX, default_socket

TYPE_CHECKING = False  # not typing's, nor pathlib or contextlib: see snapctl.errors
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from snapctl.agent.errors import AgentError

# Long operations stream: a copy's restore may take minutes, each step its own --timeout.
READ_TIMEOUT_S = 3600.0
_MAX_HEADER_BYTES = 64 * 1024


def _unavailable(message: str, **fields: Any) -> Exception:
    from snapctl.agent.errors import AgentUnavailableError

    return AgentUnavailableError(message, **fields)


def _agent_error(body: Any, http_status: int) -> AgentError:
    from snapctl.agent.errors import error_from

    error = error_from(body if isinstance(body, dict) else {})
    error.http_status = http_status
    return error


class Hangup:
    """Hanging up on a streamed request: its request side is shut (the answer still reads to
    its end), which the agent takes as its client leaving and cancels what the request
    started (a capture's supervisor is interrupted; see ``snapctl.pool.cancel``). Safe from a
    signal handler; a hang-up before the request went out happens as soon as it has."""

    def __init__(self) -> None:
        self._sock: wire.Socket | None = None
        self.wanted = False

    def hang_up(self) -> None:
        self.wanted = True
        if self._sock is not None:
            import contextlib  # here: the thin client's copy never hangs up

            with contextlib.suppress(OSError):  # closed already: nothing left to hang up
                self._sock.shutdown(wire.SHUT_WR)

    def attach(self, sock: wire.Socket | None) -> None:
        self._sock = sock
        if sock is not None and self.wanted:
            self.hang_up()


class AgentClient:
    """Requests to the agent listening on ``path``. :func:`connect` makes one only when an agent
    answers there; its first request reuses the connection that found it."""

    def __init__(self, path: str | os.PathLike[str], sock: wire.Socket | None = None) -> None:
        self.path = path
        self._sock = sock

    def _open(self, read_timeout_s: float | None) -> wire.Socket:
        sock, self._sock = self._sock, None
        if sock is None:
            sock = wire.unix_socket()
            try:
                sock.connect(os.fspath(self.path))
            except OSError as error:
                sock.close()
                raise _unavailable(
                    f"the agent does not answer on {self.path} ({error.strerror}); start it "
                    "(snapctl agent) or run in-process (--no-agent)",
                    path=os.fspath(self.path),
                ) from error
            _check_peer(sock, self.path)
        sock.settimeout(read_timeout_s)
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(
        self, method: str, target: str, body: Any, read_timeout_s: float | None
    ) -> tuple[wire.Socket, io.BufferedReader]:
        payload = b"" if body is None else wire.dumps(body).encode()
        head = (
            f"{method} {API_PREFIX}{target} HTTP/1.1\r\nHost: snapctl-agent\r\n"
            f"Connection: close\r\nAccept: application/json, application/x-ndjson\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        sock = self._open(read_timeout_s)
        try:
            sock.sendall(head.encode() + payload)
        except OSError as error:
            sock.close()
            raise _unavailable(f"cannot send to the agent: {error}") from error
        return sock, wire.reader(sock)

    def call(self, method: str, target: str, body: Any = None) -> Any:
        """One request; its JSON answer, or the agent's error raised as :class:`AgentError`."""
        messages = list(self.stream(method, target, body))
        if len(messages) != 1:
            raise _unavailable(f"the agent answered {target} with {len(messages)} records")
        return messages[0]

    def stream(
        self, method: str, target: str, body: Any = None,
        read_timeout_s: float | None = READ_TIMEOUT_S, hangup: Hangup | None = None,
    ) -> Iterator[Any]:  # fmt: skip
        """One request; each JSON message of its answer as it arrives (one for a plain JSON
        answer). An error status raises :class:`AgentError` with the agent's reason.
        ``read_timeout_s`` None: wait as long as it takes (``logs -f`` of a quiet server).
        ``hangup``: how the caller hangs up on it while it streams (see :class:`Hangup`)."""
        sock, reader = self._send(method, target, body, read_timeout_s)
        if hangup is not None:
            hangup.attach(sock)
        try:
            try:
                status, headers = _read_head(reader)
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    chunks: Iterator[bytes] = _chunks(reader)
                else:
                    chunks = iter([reader.read(int(headers.get("content-length", "0")))])
                ndjson = headers.get("content-type", "").startswith("application/x-ndjson")
                for chunk in chunks:
                    lines = chunk.splitlines() if ndjson else [chunk]
                    for line in lines:
                        if not line.strip():
                            continue
                        message = wire.loads(line)
                        if status >= 400:
                            raise _agent_error(message, status)
                        yield message
            except (OSError, ValueError) as error:
                raise _unavailable(
                    f"the agent stopped answering {method} {target}: {error}"
                ) from error
        finally:
            if hangup is not None:
                hangup.attach(None)
            reader.close()
            sock.close()


def _read_head(reader: io.BufferedReader) -> tuple[int, dict[str, str]]:
    status_line = reader.readline(_MAX_HEADER_BYTES)
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = reader.readline(_MAX_HEADER_BYTES)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _chunks(reader: io.BufferedReader) -> Iterator[bytes]:
    while True:
        size_line = reader.readline(_MAX_HEADER_BYTES)
        if not size_line:
            raise ValueError("the chunked answer ended early")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            reader.readline(_MAX_HEADER_BYTES)
            return
        data = reader.read(size)
        reader.readline(_MAX_HEADER_BYTES)
        if len(data) != size:
            raise ValueError("the chunked answer ended in a chunk")
        yield data


def connect(socket_path: str | os.PathLike[str] | None = None) -> AgentClient | None:
    """A client of the agent on ``socket_path`` (default ``STATE/agent.sock``), or None when no
    agent answers there (no socket, or a stale one: the CLI then runs in-process).
    :class:`~snapctl.agent.errors.AgentUnavailableError` when a process of another user than
    root or this one answers (see :func:`_check_peer`)."""
    path = socket_path or default_socket()
    sock = wire.unix_socket()
    try:
        sock.connect(os.fspath(path))
    except OSError:
        sock.close()
        return None
    _check_peer(sock, path)
    return AgentClient(path, sock)


def _check_peer(sock: wire.Socket, path: str | os.PathLike[str]) -> None:
    """Refuse (closing ``sock``) an agent socket served by anyone but root or this user,
    before anything is sent: requests carry secrets (a capture's whole environment, a copy's
    API key) and their answers decide what the CLI does. It fails the command rather than
    running it in-process as when no agent answers: another user's socket where the agent's
    should be is a mistake or an attack, which a quiet fallback would hide."""
    try:
        pid, uid, _ = wire.peer_credentials(sock)
    except OSError as error:
        sock.close()
        raise _unavailable(
            f"cannot tell who serves the agent socket {path} ({error}): nothing was sent; "
            "run in-process (--no-agent)", path=os.fspath(path),
        ) from error  # fmt: skip
    if uid in (0, os.geteuid()):
        return
    sock.close()
    raise _unavailable(
        f"refusing the agent socket {path}: it is served by uid {uid} (pid {pid}), neither "
        f"root nor this user (uid {os.geteuid()}), and nothing was sent to it; remove that "
        "socket or point $SNAPCTL_AGENT_SOCKET/$SNAPCTL_STATE_DIR at the real agent's, or run "
        "in-process (--no-agent)",
        path=os.fspath(path),
    )


__all__ = ["AgentClient", "Hangup", "connect"]
