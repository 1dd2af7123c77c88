"""JSON and the unix socket for the CLI's fast path, straight from the C modules that the
standard library's ``json`` and ``socket`` wrap (``_json``, ``_socket``).

Those wrappers import ``re`` and ``enum``, a large share of every command answered through the
agent (docs/agent.md, "Why the client imports so little"). The C codec is the one ``json``
itself runs, with the arguments ``json.dumps`` and ``json.loads`` give it, so the text is the
same (tests/test_wire.py compares them; bytes are read as UTF-8 only, which is
what the agent sends); where ``_json`` lacks it (another Python implementation) the standard
library's functions serve instead.
"""

from __future__ import annotations

import io
import sys
from _socket import AF_UNIX, SHUT_WR, SO_PEERCRED, SOCK_STREAM, SOL_SOCKET
from _socket import socket as Socket

TYPE_CHECKING = False  # not typing's: see snapctl.errors
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["SHUT_WR", "Socket", "dumps", "loads", "peer_credentials", "reader", "unix_socket"]

_WHITESPACE = " \t\n\r"  # JSON's own, as json.decoder skips it


def unix_socket() -> Socket:
    """A new unix stream socket (close-on-exec, as ``socket.socket`` makes it)."""
    return Socket(AF_UNIX, SOCK_STREAM)


def peer_credentials(sock: Socket) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process that made the other end of the connected unix
    socket ``sock`` (for a listening server: whoever called ``listen``), as the kernel
    recorded them (``SO_PEERCRED``: a ``struct ucred`` of three native 32-bit integers, read
    without ``struct``)."""
    raw = sock.getsockopt(SOL_SOCKET, SO_PEERCRED, 12)
    if len(raw) != 12:
        raise OSError(f"SO_PEERCRED gave {len(raw)} bytes, not a struct ucred")
    pid, uid, gid = (raw[at : at + 4] for at in (0, 4, 8))
    return (int.from_bytes(pid, sys.byteorder, signed=True),
            int.from_bytes(uid, sys.byteorder), int.from_bytes(gid, sys.byteorder))  # fmt: skip


class _SocketStream(io.RawIOBase):
    """The raw stream under :func:`reader` (what ``socket.SocketIO`` is to ``makefile``)."""

    def __init__(self, sock: Socket) -> None:
        super().__init__()
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)


def reader(sock: Socket) -> io.BufferedReader:
    """``sock.makefile("rb")`` of a ``socket.socket``: buffered reads of what it receives
    (closing the reader leaves the socket open)."""
    return io.BufferedReader(_SocketStream(sock))


def _refuse(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Parsing:
    """The scanner's settings, as ``json.JSONDecoder()`` gives them."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    array_hook = None  # read from Python 3.15 on
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"),
                      "NaN": float("nan")}.__getitem__  # fmt: skip


def _c_codec() -> tuple[Callable[..., str], Callable[[str | bytes], Any]] | None:
    try:
        from _json import encode_basestring, encode_basestring_ascii, make_encoder, make_scanner

        scan = make_scanner(_Parsing())  # type: ignore[arg-type]  # a duck-typed context

        def c_dumps(value: Any, *, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
            escape = encode_basestring_ascii if ensure_ascii else encode_basestring
            encode = make_encoder({}, _refuse, escape, None, ":", ",", sort_keys, False, True)
            return "".join(encode(value, 0))

        # Once here, so that an encoder whose arguments changed is found now, not at a send.
        if c_dumps({"": [0.5, None]}, sort_keys=True) != '{"":[0.5,null]}':
            return None
    except (ImportError, AttributeError, TypeError):  # absent, or changed in another Python
        return None

    def c_loads(data: str | bytes) -> Any:
        # As json.loads decodes UTF-8 (the agent sends ASCII; no UTF-16 or BOM sniffing).
        text = data.decode("utf-8", "surrogatepass") if isinstance(data, bytes) else data
        start = len(text) - len(text.lstrip(_WHITESPACE))
        try:
            value, end = scan(text, start)
        except StopIteration as stop:
            raise ValueError(f"not JSON: expecting a value at character {stop.value}") from None
        if text[end:].strip(_WHITESPACE):
            raise ValueError(f"not JSON: extra data at character {end}")
        return value

    return c_dumps, c_loads


def _stdlib_codec() -> tuple[Callable[..., str], Callable[[str | bytes], Any]]:
    import json

    def std_dumps(value: Any, *, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
        return json.dumps(value, sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                          separators=(",", ":"))  # fmt: skip

    return std_dumps, json.loads


_dumps, _loads = _c_codec() or _stdlib_codec()


def dumps(value: Any, *, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
    """``json.dumps(value, separators=(",", ":"), sort_keys=..., ensure_ascii=...)``."""
    return _dumps(value, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def loads(data: str | bytes) -> Any:
    """``json.loads(data)`` of a ``str`` or of UTF-8 bytes: a ValueError (``json.JSONDecodeError``
    and ``UnicodeDecodeError`` are ones) when it is not JSON."""
    return _loads(data)
