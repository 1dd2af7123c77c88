"""The defaults of what starts a server (its address and port in its namespace, each step's
limit), the limits on starting one for capture, the CLI options that set them, the hints the
errors of their timeouts give, and what a limit in seconds may be (imports only ``math``, so
``--help`` and the thin client stay light)."""

from __future__ import annotations

import math

# Where the server binds inside its network namespace, and each step's wall-clock limit (dump,
# restore, handshake, probe): the defaults of every request, option and launch.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_TIMEOUT_S = 300.0

# The server's own limit on its prepare stage and on each wait at the barrier (snapshot-config
# ``timeout_s``; vLLM's default), and snapctl's wait for capture-ready: a real model loads,
# compiles and warms up for minutes before it is ready.
SERVER_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 900.0
SERVER_TIMEOUT_OPTION = "--server-timeout"
READY_TIMEOUT_OPTION = "--ready-timeout"


def server_timeout_hint(error_type: str, error: str) -> str:
    """A pointer to ``--server-timeout`` when a server's error is its own limit running out
    (snapctl's launcher reports WaitTimeoutError, vLLM TimeoutError), else ""."""
    text = f"{error_type} {error}".lower()
    if "timeout" in text or "timed out" in text:
        return f" (the server's own limit ran out: raise {SERVER_TIMEOUT_OPTION})"
    return ""


def ready_timeout_hint() -> str:
    return f" (raise {READY_TIMEOUT_OPTION} for a server that takes longer to start)"


# Thirty days. Far beyond any real wait, and select() refuses a timeout past time_t's range
# (about 9.2e9 s): a larger limit would fail the wait itself, after a stop's SIGTERM was sent.
MAX_SECONDS = 30 * 24 * 3600.0
SECONDS_RULE = f"a positive, finite number of seconds, at most {MAX_SECONDS:.0f} (30 days)"


def is_positive_seconds(value: float) -> bool:
    """A usable limit in seconds: positive, finite and at most :data:`MAX_SECONDS` (``inf``,
    ``nan``, 0 and negatives not)."""
    return math.isfinite(value) and 0 < value <= MAX_SECONDS


def positive_seconds(value: float) -> float:
    """``value``, or ValueError unless :func:`is_positive_seconds` (a pydantic validator)."""
    if not is_positive_seconds(value):
        raise ValueError(f"must be {SECONDS_RULE}")
    return value
