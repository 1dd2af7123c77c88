"""The states of one activation and the transitions between them; imports nothing.

A donor is launched, reaches capture-ready, is captured and waits at the activation barrier
(``parked``); a copy is restored and waits there too. From ``parked`` an activation is
activated (the handshake) and serves. Any state but the last two may go to ``stopping``;
a stop ends in ``stopped``, or in ``failed`` when it cleaned up after a start that failed.
"""

from __future__ import annotations

from enum import StrEnum


class SessionState(StrEnum):
    CREATED = "created"  # directories made, nothing runs yet
    LAUNCHING = "launching"  # donor: the server starts in fresh namespaces
    CAPTURE_READY = "capture-ready"  # donor: the server wrote capture-ready.json
    RESTORING = "restoring"  # copy: CRIU restores the tree
    RESTORED = "restored"  # copy: the tree runs (a lazy copy's memory still arrives)
    PARKED = "parked"  # the server waits for activation.json; nothing was sent to it
    ACTIVATING = "activating"  # the handshake and the readiness probe run
    SERVING = "serving"  # validated, ready on HTTP, published if asked
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # stopped after its start failed


_ENDS = frozenset({SessionState.STOPPED, SessionState.FAILED})

TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.CREATED: frozenset({SessionState.LAUNCHING, SessionState.RESTORING}),
    # Straight to serving: the ordinary start qualification compares against (never captured).
    SessionState.LAUNCHING: frozenset({SessionState.CAPTURE_READY, SessionState.SERVING}),
    SessionState.CAPTURE_READY: frozenset({SessionState.PARKED}),
    SessionState.RESTORING: frozenset({SessionState.RESTORED}),
    SessionState.RESTORED: frozenset({SessionState.PARKED}),
    SessionState.PARKED: frozenset({SessionState.ACTIVATING}),
    SessionState.ACTIVATING: frozenset({SessionState.SERVING}),
    SessionState.SERVING: frozenset(),
    SessionState.STOPPING: _ENDS,
    SessionState.STOPPED: frozenset(),
    SessionState.FAILED: frozenset(),
}
# Every state that is not an end, or stopping itself, may stop.
for _state in SessionState:
    if _state not in _ENDS and _state is not SessionState.STOPPING:
        TRANSITIONS[_state] = TRANSITIONS[_state] | {SessionState.STOPPING}


class TransitionError(RuntimeError):
    """A bug: code asked an activation for a state change its lifecycle does not allow."""


def check_transition(current: SessionState, target: SessionState) -> None:
    if target not in TRANSITIONS[current]:
        raise TransitionError(f"an activation cannot go from {current} to {target}")


def is_running(state: SessionState) -> bool:
    """Whether a tree may be running in this state (it has started and not been stopped)."""
    return state not in {SessionState.CREATED, SessionState.STOPPED, SessionState.FAILED}
