"""A minimal startup-capture server for the sandbox's private /tmp: ``tmp_server.py
--snapshot-config JSON`` writes ``/tmp/written-before-capture`` and binds a listening unix
socket at ``/tmp/snapctl-test.sock`` (as vLLM binds its ``ipc://`` endpoints under /tmp), keeps
both across capture, and answers each connection there with its PID, the names in its /tmp
and its ``sys.prefix``.
After ``validated`` it answers every GET with 200.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import sys
import threading

from snapctl.launcher import run_startup_capture
from snapctl.protocol.models import Oracle, SnapshotConfig

SOCKET_PATH = "/tmp/snapctl-test.sock"
WRITTEN = "/tmp/written-before-capture"


class Hooks:
    def canary(self) -> Oracle:
        return Oracle(token_ids=[1], text="t", sampled_token_logprob=-0.5)

    def release_memory(self) -> None:
        pass

    def restore_memory(self) -> None:
        pass


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


def answer(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        with connection:
            reply = {"pid": os.getpid(), "tmp": sorted(os.listdir("/tmp")), "prefix": sys.prefix}
            connection.sendall(json.dumps(reply).encode())


def main() -> None:
    # PID 1 of its namespace ignores SIGTERM without a handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    flag, raw_config = sys.argv[1:3]
    assert flag == "--snapshot-config"
    with open(WRITTEN, "w") as handle:
        handle.write("before capture\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(SOCKET_PATH)
    listener.listen(8)
    threading.Thread(target=answer, args=(listener,), daemon=True).start()
    target = run_startup_capture(SnapshotConfig.model_validate_json(raw_config), Hooks())
    server = http.server.HTTPServer((target.host or "127.0.0.1", target.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
