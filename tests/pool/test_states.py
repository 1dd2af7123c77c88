"""A pool slot's lifecycle: the edges the pool may take, and a bug refused."""

from __future__ import annotations

import pytest

from snapctl.pool.states import TRANSITIONS, SlotState, SlotTransitionError, check_slot_transition


def test_a_taken_slot_is_never_discarded_nor_parked_again() -> None:
    for target in SlotState:
        with pytest.raises(SlotTransitionError, match="from taken"):
            check_slot_transition(SlotState.TAKEN, target)


def test_only_a_parked_slot_is_taken_and_every_slot_ends_gone() -> None:
    assert [s for s in SlotState if SlotState.TAKEN in TRANSITIONS[s]] == [SlotState.PARKED]
    for state in (SlotState.RESTORING, SlotState.PARKED, SlotState.DISCARDING):
        check_slot_transition(state, SlotState.GONE)
    with pytest.raises(SlotTransitionError):
        check_slot_transition(SlotState.DISCARDING, SlotState.PARKED)
