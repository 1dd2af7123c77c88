"""The v1 startup-capture control protocol: its files, their directory, and waiting for them.

This package owns everything that touches a control directory: the strict models of the six
files (:mod:`.models`), the one atomic writer and bounded reader (:mod:`.atomic`), the directory
safety checks and typed file access (:mod:`.controldir`), the pooled inotify watch
(:mod:`.inotify`) and the capturer's event-driven waits (:mod:`.waiter`). The waiter is loaded
lazily, so a server importing this package (through :mod:`snapctl.launcher`) never loads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from snapctl.protocol.atomic import (
    MAX_JSON_BYTES,
    read_json_bounded,
    read_model,
    write_json_atomic,
)
from snapctl.protocol.controldir import (
    OVERWRITABLE,
    ControlDir,
    ControlModel,
    create_control_dir,
)
from snapctl.protocol.models import (
    Activation,
    CaptureReady,
    Challenge,
    ControlFile,
    ErrorReport,
    Oracle,
    Phase,
    Release,
    SnapshotConfig,
    Status,
)

if TYPE_CHECKING:
    from snapctl.protocol.waiter import Arrival, ControlDirWatcher, wait_for

_LAZY = {"Arrival", "ControlDirWatcher", "wait_for"}

__all__ = [
    "MAX_JSON_BYTES",
    "OVERWRITABLE",
    "Activation",
    "Arrival",
    "CaptureReady",
    "Challenge",
    "ControlDir",
    "ControlDirWatcher",
    "ControlFile",
    "ControlModel",
    "ErrorReport",
    "Oracle",
    "Phase",
    "Release",
    "SnapshotConfig",
    "Status",
    "create_control_dir",
    "read_json_bounded",
    "read_model",
    "wait_for",
    "write_json_atomic",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("snapctl.protocol.waiter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
