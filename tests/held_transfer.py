"""``python -m tests.held_transfer ARGS``: snapctl's CLI (and the agent, and every supervisor
either forks) with each lazy copy's background transfer held for a minute, whatever its size:
the daemon serves page faults only. A test that must act while pages are still missing uses it
instead of racing a transfer that a fast or idle machine finishes first."""

from __future__ import annotations

import sys

from snapctl.criu.lazy import tuning

HELD_S = 60.0


def hold_every_transfer() -> None:
    tuning.HOLD_TRANSFER_MIN_BYTES = 0
    tuning.TRANSFER_AFTER_READY_S = HELD_S
    tuning.TRANSFER_HOLD_MAX_S = HELD_S


if __name__ == "__main__":
    hold_every_transfer()
    from snapctl.entry import main

    sys.exit(main())
