"""A minimal startup-capture server for the sandbox's private /tmp: ``tmp_server.py
--snapshot-config JSON`` writes ``/tmp/written-before-capture`` and binds a listening unix
socket at ``/tmp/snapctl-test.sock`` (as vLLM binds its ``ipc://`` endpoints under /tmp), keeps
both across capture, and answers each connection there with its PID, the names in its /tmp
and its ``sys.prefix``.
After ``validated`` it answers every GET with 200.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

from capture_stub import StubHooks, capture_then_serve, exit_on_sigterm

SOCKET_PATH = "/tmp/snapctl-test.sock"
WRITTEN = "/tmp/written-before-capture"


def answer(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        with connection:
            reply = {"pid": os.getpid(), "tmp": sorted(os.listdir("/tmp")), "prefix": sys.prefix}
            connection.sendall(json.dumps(reply).encode())


def main() -> None:
    exit_on_sigterm()
    flag, raw_config = sys.argv[1:3]
    assert flag == "--snapshot-config"
    with open(WRITTEN, "w") as handle:
        handle.write("before capture\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(SOCKET_PATH)
    listener.listen(8)
    threading.Thread(target=answer, args=(listener,), daemon=True).start()
    capture_then_serve(raw_config, StubHooks(text="t"))


if __name__ == "__main__":
    main()
