"""The capturer's handshake against a control directory whose server side the test writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.activation.handshake import activate
from snapctl.errors import WaitTimeoutError
from tests.protocol.factories import (
    ACTIVATION_ID,
    CAPTURE_ID,
    make_challenge,
    make_control_dir,
    make_status,
)


def test_a_server_stuck_recovering_times_out_as_a_wait_timeout(tmp_path: Path) -> None:
    control = make_control_dir(tmp_path)
    # The server's side, already written: it answered and then never left "recovering".
    control.write(make_challenge())
    control.write(make_status(phase="recovering"))
    with pytest.raises(WaitTimeoutError):
        activate(
            control, capture_id=CAPTURE_ID, activation_id=ACTIVATION_ID, kind="copy",
            host="127.0.0.1", port=8000, timeout_s=0.2,
        )  # fmt: skip
