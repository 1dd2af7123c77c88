"""A donor whose tree holds what CRIU cannot dump is refused before CRIU runs, with real CRIU
and a real sandboxed server: the error names PID, process, fd and fix, no dump was started,
nothing is published, a native step's checkpoint is undone, and nothing is left behind."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from snapctl.activation.donor import CaptureError
from snapctl.activation.native import NoNativeStep
from snapctl.criu import CriuBinary
from snapctl.criu.inventory import FIX_IO_URING, UndumpableError
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import launch_donor, leftovers

HOLDER = Path(__file__).parent.parent / "criu" / "undumpable_holder.py"

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]


class RecordingNative(NoNativeStep):
    """A device step that records its calls (the inventory runs after its checkpoint)."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_dump(self, pids: object, timeout_s: float) -> None:
        self.calls.append("before_dump")

    def after_dump(self, pids: object, timeout_s: float) -> None:
        self.calls.append("after_dump")


def test_a_tree_criu_cannot_dump_is_refused_before_the_dump(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    image = tmp_path / "image"
    native = RecordingNative()
    started = time.monotonic()
    with pytest.raises(CaptureError, match="it was not frozen") as info:
        launch_donor(
            image, state, criu_binary, native=native, server_argv=[sys.executable, str(HOLDER)]
        )
    refused_s = time.monotonic() - started
    undumpable = info.value.__cause__
    assert isinstance(undumpable, UndumpableError)
    (server_log,) = state.logs.glob("*/server.log")
    held = json.loads(server_log.read_text().splitlines()[0])
    message = str(info.value)
    assert f"fd {held['userfaultfd']}: anon_inode:[userfaultfd]" in message
    if held["io_uring"] is not None:  # allowed in this sandbox: the ring must be named
        assert f"fd {held['io_uring']}: anon_inode:[io_uring]" in message
        assert FIX_IO_URING in message
    assert undumpable.pid is not None and f"pid {undumpable.pid} (" in message
    assert info.value.phase == "capture" and "no image published" in message
    # CRIU never ran (its log would be in the activation's logs), so nothing was frozen.
    assert list(state.logs.glob("*/dump.log")) == []
    assert native.calls == ["before_dump", "after_dump"]  # the device step was undone
    assert not image.exists()
    assert leftovers(state) == []
    print(f"refused {refused_s:.2f} s after launch")
