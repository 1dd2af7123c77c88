"""A minimal startup-capture server for identity tests: ``mapping_server.py FILE
--snapshot-config JSON`` maps FILE read-only, keeps it mapped across capture (as a server keeps
a library or a model mapped), and after ``validated`` answers every GET with 200.

Its canary reports FILE's first byte, so a copy restored over a changed FILE would notice only
if the identity gate had not refused it first.
"""

from __future__ import annotations

import http.server
import mmap
import os
import signal
import sys

from snapctl.launcher import run_startup_capture
from snapctl.protocol.models import Oracle, SnapshotConfig


class Hooks:
    def __init__(self, mapped: mmap.mmap) -> None:
        self.mapped = mapped

    def canary(self) -> Oracle:
        return Oracle(token_ids=[self.mapped[0]], text="m", sampled_token_logprob=-0.5)

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


def main() -> None:
    # PID 1 of its namespace ignores SIGTERM without a handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    path, flag, raw_config = sys.argv[1:4]
    assert flag == "--snapshot-config"
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    target = run_startup_capture(SnapshotConfig.model_validate_json(raw_config), Hooks(mapped))
    server = http.server.HTTPServer((target.host or "127.0.0.1", target.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
