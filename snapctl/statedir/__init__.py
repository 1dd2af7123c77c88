"""snapctl's host state directory, visible to every package without importing supervision
(light imports: no psutil): its layout (:class:`StateDir`), the activation records in it, and
activation names, which become file names there and are reserved by a lock beside the record.

The names below load their module on first use, so that ``snapctl.statedir.names`` (the CLI
checks ``--name`` with it) imports no pydantic on the agent's thin-client path.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing's: see snapctl.errors
if TYPE_CHECKING:
    from typing import Any

    from snapctl.statedir.layout import (
        DEFAULT_STATE_DIR,
        NoServerLogError,
        StateDir,
        UnknownActivationError,
        state_dir,
    )
    from snapctl.statedir.records import ActivationRecord, StopOutcome

_MODULES = {
    "DEFAULT_STATE_DIR": "layout",
    "StateDir": "layout",
    "NoServerLogError": "layout",
    "state_dir": "layout",
    "UnknownActivationError": "layout",
    "ActivationRecord": "records",
    "StopOutcome": "records",
}

# In an activation's kept logs (``logs/ID/``): how it ended (a StopOutcome), written before
# its record is dropped. Here, not in records: the thin client reads it without pydantic.
STOPPED_FILE = "stopped.json"

__all__ = [
    "DEFAULT_STATE_DIR",
    "STOPPED_FILE",
    "ActivationRecord",
    "NoServerLogError",
    "StateDir",
    "StopOutcome",
    "UnknownActivationError",
    "state_dir",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"snapctl.statedir.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
