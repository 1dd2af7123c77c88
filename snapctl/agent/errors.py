"""The errors the thin client raises: the agent's refusal or failure, relayed, and an agent that
stopped answering. A module of their own, which :mod:`snapctl.agent.client` imports only once
something fails: :mod:`snapctl.errors` imports ``enum``, a few milliseconds that a command the
agent answered need not pay (see :mod:`snapctl.wire`)."""

from __future__ import annotations

from snapctl.errors import ExitStatus, RelayedError, SnapctlError

TYPE_CHECKING = False  # not typing's: see snapctl.errors
if TYPE_CHECKING:
    from typing import Any


class AgentError(RelayedError):
    """The agent refused or failed a request: its error, relayed with its own exit status."""

    def __init__(
        self, message: str, *, exit_status: int = 1, usage: str | None = None, **fields: Any
    ) -> None:
        super().__init__(message, exit_status=exit_status, **fields)
        # A refused option: its name ("" for the command as a whole), as the CLI reports it.
        self.usage = usage
        # The answer's HTTP status (404: no such activation), when it came as one.
        self.http_status: int | None = None


class AgentUnavailableError(SnapctlError):
    """The agent stopped answering in the middle of a request (it was stopped or killed)."""

    exit_status = ExitStatus.UNAVAILABLE


def error_from(body: dict[str, Any]) -> AgentError:
    """The :class:`AgentError` an error body (see ``snapctl.agent.api.ErrorBody``) describes."""
    usage = body.get("usage")
    return AgentError.from_wire(body, usage=usage if isinstance(usage, str) else None)


__all__ = ["AgentError", "AgentUnavailableError", "error_from"]
