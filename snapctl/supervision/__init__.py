"""Owning processes safely: pin by pidfd and start time, stop TERM → wait → KILL, verify gone.

Never signal a process only because its PID appears somewhere: :class:`PinnedProcess` opens a
pidfd and checks the start time recorded with the PID, so a reused PID is refused.
"""

from snapctl.supervision.process import PinnedProcess, ProcessGoneError, become_subreaper

__all__ = ["PinnedProcess", "ProcessGoneError", "become_subreaper"]
