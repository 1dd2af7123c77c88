"""The states of one slot of the warm pool (a parked copy, from its restore on) and the
transitions between them; imports nothing.

A slot is restoring until its supervisor reports it parked; a parked slot is taken (then it
is its taker's, and the pool never touches it again), discarded (ordered to discard itself,
then gone), or found gone by itself. A restore that fails is gone; one whose target went
meanwhile is discarding, and its parking thread ends it once it parked.
"""

from __future__ import annotations

from enum import StrEnum


class SlotState(StrEnum):
    RESTORING = "restoring"  # its supervisor restores it; no record yet
    PARKED = "parked"  # at the activation barrier, ready to be taken
    TAKEN = "taken"  # handed out by take(): its taker's, never discarded by the pool
    DISCARDING = "discarding"  # ordered to discard itself (or to be, once parked)
    GONE = "gone"  # discarded, dead, or its restore failed: out of the pool


TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.RESTORING: frozenset({SlotState.PARKED, SlotState.DISCARDING, SlotState.GONE}),
    SlotState.PARKED: frozenset({SlotState.TAKEN, SlotState.DISCARDING, SlotState.GONE}),
    SlotState.TAKEN: frozenset(),
    SlotState.DISCARDING: frozenset({SlotState.GONE}),
    SlotState.GONE: frozenset(),
}


class SlotTransitionError(RuntimeError):
    """A bug: the pool asked a slot for a state change its lifecycle does not allow."""


def check_slot_transition(current: SlotState, target: SlotState) -> None:
    if target not in TRANSITIONS[current]:
        raise SlotTransitionError(f"a pool slot cannot go from {current} to {target}")
