"""How the fault run breaks a copy's weights (dependency-free: the CLI's choices come from here).

``auto`` chooses by the image's memory policy (:func:`snapctl.qualification.faults.fault_mode_for`);
``changed`` flips a byte of the weights file and ``unreadable`` hides it behind /dev/null, in the
copy's mount namespace only; ``memory`` overwrites weights in the copy's memory
(:mod:`snapctl.qualification.memfault`).
"""

from __future__ import annotations

from typing import Literal

FaultMode = Literal["auto", "changed", "unreadable", "memory"]
FAULT_MODES: tuple[FaultMode, ...] = ("auto", "changed", "unreadable", "memory")
