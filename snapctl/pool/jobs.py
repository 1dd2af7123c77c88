"""What a supervisor forked by the spawner runs: a fresh copy, or a parked one."""

from __future__ import annotations

from typing import Any


def run_job(job: dict[str, Any], pipe_fd: int) -> None:
    """Run ``job`` in this (freshly forked) supervisor, reporting on ``pipe_fd``."""
    raise NotImplementedError
