"""The thin client's JSON and socket (:mod:`snapctl.wire`): the same text as ``json``
gives, the same values back, the same refusals, with the C codec and with the standard library
serving instead (the fallback where ``_json`` is absent)."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from snapctl import wire

Codec = tuple[Callable[..., str], Callable[[str | bytes], Any]]
CODECS: dict[str, Codec] = {"stdlib": wire._stdlib_codec()}
if (c_codec := wire._c_codec()) is not None:
    CODECS["c"] = c_codec

VALUES: list[Any] = [
    {"b": 1, "a": [1.5, None, True, False], "c": {"z": {}, "y": []}},
    {"text": 'quote " backslash \\ newline \n tab \t nul \x00 bell \x07'},
    {"unicode": "é ü 日本 \u2028 \U0001f600", "é": "key not ASCII"},
    [0, -0.0, 1e100, 1e-300, 2.5e-7, 12345678901234567890, -(2**70), 0.1 + 0.2],
    [float("inf"), float("-inf"), float("nan")],
    ["lone surrogate \ud800", {"\udfff": "as a key"}],
    "a plain string",
    42,
    None,
    [],
    {},
    {
        "copies": [
            {"name": f"c-{n}", "pid": 1000 + n, "timings_s": {"handshake": n / 7}}
            for n in range(50)
        ]
    },
]


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("sort_keys", [False, True])
@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_dumps_writes_what_json_dumps_writes(
    codec: str, sort_keys: bool, ensure_ascii: bool
) -> None:
    dumps, _ = CODECS[codec]
    for value in VALUES:
        expected = json.dumps(
            value, sort_keys=sort_keys, ensure_ascii=ensure_ascii, separators=(",", ":")
        )
        assert dumps(value, sort_keys=sort_keys, ensure_ascii=ensure_ascii) == expected


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_dumps_refuses_what_json_refuses(codec: str) -> None:
    dumps, _ = CODECS[codec]
    for value in ({"path": Path("/x")}, {"set": {1}}, {(1, 2): "tuple key"}, b"bytes"):
        with pytest.raises(TypeError):
            json.dumps(value)
        with pytest.raises(TypeError):
            dumps(value)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_loads_reads_what_json_reads(codec: str) -> None:
    _, loads = CODECS[codec]
    for value in VALUES:
        spaced = f" \n\t{json.dumps(value)}\r\n"
        raw = json.dumps(value, ensure_ascii=False)  # UTF-8 bytes below, surrogates kept
        for text in (json.dumps(value), json.dumps(value, indent=2), spaced, raw):
            assert repr(loads(text)) == repr(json.loads(text))  # repr: NaN is not NaN
            utf8 = text.encode("utf-8", "surrogatepass")
            assert repr(loads(utf8)) == repr(json.loads(utf8))
    assert math.isnan(loads('{"x": NaN}')["x"])
    assert loads("[Infinity, -Infinity]") == [math.inf, -math.inf]
    assert loads('"\\ud83d\\ude00"') == "\U0001f600"


BAD = ["", " ", "{", "[1,]", '{"a" 1}', "{} x", "[1] [2]", "nul", "'single'", '"\x01"', "01",
       "[1, 2", '{"a": }', "\ufeff{}"]  # fmt: skip


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_loads_refuses_what_json_refuses_with_a_value_error(codec: str) -> None:
    _, loads = CODECS[codec]
    for text in BAD:
        with pytest.raises(ValueError):
            json.loads(text)
        with pytest.raises(ValueError):
            loads(text)
    with pytest.raises(ValueError):
        loads(b"\xff\xfe not UTF-8")


def test_the_c_codec_serves_on_cpython() -> None:
    assert "c" in CODECS and wire._dumps.__name__ == "c_dumps"


def test_a_c_scanner_that_wants_another_context_gives_way_to_the_standard_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import _json

    def wants_more(context: object) -> None:
        raise AttributeError("'_Parsing' object has no attribute 'a_new_hook'")

    monkeypatch.setattr(_json, "make_scanner", wants_more)
    assert wire._c_codec() is None


def test_a_c_encoder_that_wants_other_arguments_gives_way_to_the_standard_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import _json

    def wants_more(*arguments: object) -> None:
        raise TypeError(f"make_encoder() takes 10 arguments ({len(arguments)} given)")

    monkeypatch.setattr(_json, "make_encoder", wants_more)
    assert wire._c_codec() is None


def test_a_c_encoder_that_reads_its_arguments_otherwise_gives_way_to_the_standard_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import _json

    make_encoder = _json.make_encoder

    def separators_swapped(*arguments: Any) -> Any:
        changed = list(arguments)
        changed[4], changed[5] = arguments[5], arguments[4]
        return make_encoder(*changed)

    monkeypatch.setattr(_json, "make_encoder", separators_swapped)
    assert wire._c_codec() is None


def test_without_the_c_codec_the_standard_library_serves() -> None:
    script = (
        "import sys; sys.modules['_json'] = None\n"  # import _json raises ImportError
        "from snapctl import wire\n"
        "assert wire._dumps.__name__ == 'std_dumps', wire._dumps\n"
        "print(wire.dumps({'b': [1, 'é'], 'a': None}, sort_keys=True), wire.loads('[1, 2.5]'))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"a":null,"b":[1,"\\u00e9"]} [1, 2.5]\n'


def test_reader_reads_lines_and_sizes_as_makefile_does(tmp_path: Path) -> None:
    path = os.fspath(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the agent's side
    listener.settimeout(10)
    listener.bind(path)
    listener.listen(1)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + b"x" * 100_000

    def serve() -> None:
        peer, _ = listener.accept()
        peer.recv(100)
        for start in range(0, len(answer), 7_000):  # in pieces, as a socket may deliver it
            peer.sendall(answer[start : start + 7_000])
        peer.close()

    server = threading.Thread(target=serve)
    server.start()
    try:
        sock = wire.unix_socket()
        sock.settimeout(10)
        sock.connect(path)
        assert not os.get_inheritable(sock.fileno())
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reader = wire.reader(sock)
        assert reader.readline(1024) == b"HTTP/1.1 200 OK\r\n"
        assert reader.readline(1024) == b"Content-Length: 5\r\n"
        assert reader.readline(1024) == b"\r\n"
        assert reader.read(5) == b"hello"
        assert reader.read() == b"x" * 100_000
        assert reader.read(1) == b""
        reader.close()
        assert sock.fileno() != -1  # closing the reader left the socket open
        sock.close()
    finally:
        server.join(10)
        listener.close()


def test_peer_credentials_are_the_peer_s_pid_uid_and_gid() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock = wire.Socket(fileno=ours.detach())
        try:
            got = wire.peer_credentials(sock)
            assert got == (os.getpid(), os.getuid(), os.getgid())
            # As the struct module reads the same struct ucred.
            raw = theirs.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            assert got == struct.unpack("3i", raw)
        finally:
            sock.close()
    finally:
        theirs.close()
