"""Test factories for control-file payloads: ``x_fields(**changes)`` dicts and ``make_x`` models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import (
    Activation,
    CaptureReady,
    Challenge,
    ErrorReport,
    Oracle,
    Release,
    Status,
)

CAPTURE_ID = "0123456789abcdef0123456789abcdef"
OTHER_CAPTURE_ID = "fedcba9876543210fedcba9876543210"
NONCE = "00112233445566778899aabbccddeeff"
ACTIVATION_ID = "copy-1.a_b"


def oracle_fields(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"token_ids": [791], "text": " The", "sampled_token_logprob": -0.25}
    return fields | changes


def ready_fields(**changes: Any) -> dict[str, Any]:
    fields = {"version": 1, "capture_id": CAPTURE_ID, "pid": 4242, "oracle": oracle_fields()}
    return fields | changes


def activation_fields(**changes: Any) -> dict[str, Any]:
    fields = {
        "version": 1,
        "capture_id": CAPTURE_ID,
        "activation_id": ACTIVATION_ID,
        "kind": "copy",
        "native_complete": True,
        "host": "127.0.0.1",
        "port": 8000,
    }
    return fields | changes


def challenge_fields(**changes: Any) -> dict[str, Any]:
    fields = {
        "version": 1,
        "capture_id": CAPTURE_ID,
        "activation_id": ACTIVATION_ID,
        "nonce": NONCE,
    }
    return fields | changes


def status_fields(**changes: Any) -> dict[str, Any]:
    fields = {"capture_id": CAPTURE_ID, "activation_id": ACTIVATION_ID, "phase": "recovering"}
    return fields | changes


def error_fields(**changes: Any) -> dict[str, Any]:
    fields = {
        "capture_id": CAPTURE_ID,
        "activation_id": None,
        "phase": "capture barrier",
        "error_type": "ProtocolError",
        "error": "stale activation control: status.json already present",
    }
    return fields | changes


def make_oracle(**changes: Any) -> Oracle:
    return Oracle.model_validate(oracle_fields(**changes))


def make_ready(**changes: Any) -> CaptureReady:
    return CaptureReady.model_validate(ready_fields(**changes))


def make_activation(**changes: Any) -> Activation:
    return Activation.model_validate(activation_fields(**changes))


def make_challenge(**changes: Any) -> Challenge:
    return Challenge.model_validate(challenge_fields(**changes))


def make_release(**changes: Any) -> Release:
    return Release.model_validate(challenge_fields(**changes))


def make_status(**changes: Any) -> Status:
    return Status.model_validate(status_fields(**changes))


def make_error(**changes: Any) -> ErrorReport:
    return ErrorReport.model_validate(error_fields(**changes))


def make_control_dir(parent: Path, name: str = "control") -> ControlDir:
    """A fresh 0700 control directory (pytest's tmp_path ancestors pass the checks)."""
    path = parent / name
    path.mkdir()
    os.chmod(path, 0o700)
    return ControlDir(path)
