"""What the tests' small startup-capture servers share: hooks with a fixed canary and nothing to
release, the PID-1 SIGTERM handler, and serving 200 to every GET once ``validated``."""

from __future__ import annotations

import http.server
import os
import signal
from collections.abc import Callable

from snapctl.launcher import BindTarget, run_startup_capture
from snapctl.protocol.facts import CaptureFacts
from snapctl.protocol.models import Oracle, SnapshotConfig


class StubHooks:
    """Startup-capture hooks: the canary is ``token_ids()`` (fixed unless given), with no
    memory to release or restore."""

    def __init__(self, text: str, token_ids: Callable[[], list[int]] = lambda: [1]) -> None:
        self.text = text
        self.token_ids = token_ids

    def canary(self) -> Oracle:
        return Oracle(token_ids=self.token_ids(), text=self.text, sampled_token_logprob=-0.5)

    def release_memory(self) -> None:
        pass

    def restore_memory(self) -> None:
        pass

    def capture_facts(self) -> CaptureFacts:
        return CaptureFacts(memory_policy="in-image")


class OkHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


def exit_on_sigterm() -> None:
    # PID 1 of its namespace ignores SIGTERM without a handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))


def capture(raw_config: str, hooks: StubHooks) -> BindTarget:
    """Run the startup-capture protocol (``raw_config``: ``--snapshot-config``'s JSON)."""
    return run_startup_capture(SnapshotConfig.model_validate_json(raw_config), hooks)


def capture_then_serve(raw_config: str, hooks: StubHooks) -> None:
    """Capture, then answer every GET with 200 for ever."""
    target = capture(raw_config, hooks)
    http.server.HTTPServer((target.host or "127.0.0.1", target.port), OkHandler).serve_forever()
