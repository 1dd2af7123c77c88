"""Owning processes safely: pin by pidfd and start time, stop TERM → wait → KILL, verify gone.

Never signal a process only because its PID appears somewhere: :class:`PinnedProcess` opens a
pidfd and checks the start time recorded with the PID, so a reused PID is refused.

The names below are loaded on first use: ``snapctl.supervision.names`` (the CLI checks
``--name`` with it) must not import psutil through this package on the agent's client path.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PinnedProcess", "ProcessGoneError", "become_subreaper"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from snapctl.supervision import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
