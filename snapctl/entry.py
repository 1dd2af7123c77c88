"""The ``snapctl`` entry point: a fast path for ``snapctl ps [--json]`` through the agent, taken
before click is imported; everything else is :func:`snapctl.cli.main`.

``ps`` is what scripts, hooks and people poll; through the agent its answer costs a few
milliseconds, so the interpreter's start and click's import (tens of milliseconds) would be
most of its wall time. Only the exact argument lists below take this path, and only when an
agent answers; anything else, or any failure on the way, runs the full CLI, which gives the
same output (both draw with :mod:`snapctl.plain`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

_FAST = (["ps"], ["ps", "--json"])


def fast_ps(args: list[str]) -> int | None:
    """``snapctl ps [--json]`` answered by the agent, or None to take the full CLI's path."""
    if args not in _FAST or os.environ.get("SNAPCTL_NO_AGENT"):
        return None
    from snapctl.agent.client import connect

    client = connect()
    if client is None:
        return None
    try:
        rows = client.call("GET", "/activations")
    except Exception:  # the full CLI asks again, and reports a failure its usual way
        return None
    from snapctl.plain import PS_COLUMNS, emit_json, print_table, ps_rows

    if args == ["ps", "--json"]:
        emit_json(rows)
    else:
        print_table(PS_COLUMNS, ps_rows(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    status = fast_ps(args)
    if status is not None:
        return status
    from snapctl.cli import main as full

    return full(args)
