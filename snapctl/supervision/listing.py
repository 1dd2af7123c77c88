"""``snapctl ps``'s rows: each activation record, and whether its tree and its supervisor
still run (the agent answers ``GET /v1/activations`` with the same rows)."""

from __future__ import annotations

from typing import Any

from snapctl.statedir import StateDir
from snapctl.supervision.process import is_same_process


def activation_rows(state: StateDir) -> list[dict[str, Any]]:
    """``ps --json``: the records in ``state`` (by name), each with ``running`` (its tree)
    and ``supervised`` (its supervisor)."""
    return [
        {
            **record.model_dump(mode="json"),
            "running": is_same_process(record.root_pid, record.root_start_time),
            "supervised": is_same_process(record.supervisor_pid, record.supervisor_start_time),
        }
        for record in state.load_records()
    ]
