"""Strict pydantic models for every file of the v1 startup-capture control protocol.

One model per file, plus the ``--snapshot-config`` object. Unknown keys and wrong types are
rejected (``extra="forbid"``, ``strict=True``); instances are immutable.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator

from snapctl.models import StrictModel
from snapctl.phases import Phase as Phase  # the server's phases, in error.json

UUID4_HEX = r"^[0-9a-f]{32}$"
ACTIVATION_ID = r"^[\w.-]+$"

CaptureId = Annotated[str, Field(pattern=UUID4_HEX)]
Nonce = Annotated[str, Field(pattern=UUID4_HEX)]
ActivationId = Annotated[str, Field(min_length=1, max_length=128, pattern=ACTIVATION_ID)]
Port = Annotated[int, Field(ge=1, le=65535)]


class ControlFile(StrEnum):
    """The six file names in a control directory."""

    CAPTURE_READY = "capture-ready.json"
    ACTIVATION = "activation.json"
    CHALLENGE = "challenge.json"
    RELEASE = "release.json"
    STATUS = "status.json"
    ERROR = "error.json"


# Files whose presence when an activation arrives means the control is stale.
STALE_ON_ACTIVATION = (
    ControlFile.CHALLENGE,
    ControlFile.RELEASE,
    ControlFile.STATUS,
    ControlFile.ERROR,
)


class _ControlModel(StrictModel):
    """A control file's model: strict, and its ``version`` only the JSON integer 1."""

    @field_validator("version", mode="before", check_fields=False)
    @classmethod
    def _version_is_the_integer_one(cls, value: object) -> object:
        # Even in strict mode Literal[1] accepts True and 1.0 (both compare equal to 1); the
        # wire format means the JSON integer 1 only.
        if type(value) is not int:
            raise ValueError("version must be the integer 1")
        return value


class SnapshotConfig(_ControlModel):
    """The ``--snapshot-config`` JSON object given to the server."""

    mode: Literal["startup"]
    control_dir: str
    timeout_s: float = 900.0

    @field_validator("control_dir")
    @classmethod
    def _absolute_without_dotdot(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("control_dir must be an absolute path")
        if ".." in value.split("/"):
            raise ValueError("control_dir must not contain '..'")
        return value

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _positive_finite(cls, value: object) -> object:
        # JSON has no separate int/float; accept an integer timeout as a float.
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and not (math.isfinite(value) and value > 0):
            raise ValueError("timeout_s must be a positive finite number")
        return value


class Oracle(_ControlModel):
    """The reference canary result: one greedy token with its log probability."""

    token_ids: list[int]
    text: str
    sampled_token_logprob: float

    @field_validator("sampled_token_logprob", mode="before")
    @classmethod
    def _int_is_float(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    def mismatch(self, other: Oracle, logprob_tolerance: float = 1e-3) -> str | None:
        """Describe how ``other`` differs from this oracle, or None when it matches."""
        if other.token_ids != self.token_ids:
            return f"token_ids differ: expected {self.token_ids}, got {other.token_ids}"
        if other.text != self.text:
            return f"text differs: expected {self.text!r}, got {other.text!r}"
        delta = abs(other.sampled_token_logprob - self.sampled_token_logprob)
        if not delta <= logprob_tolerance:
            return f"sampled_token_logprob differs by {delta:.6g} (> {logprob_tolerance})"
        return None


class CaptureReady(_ControlModel):
    """``capture-ready.json``: the server is initialized and waits to be captured."""

    version: Literal[1] = 1
    capture_id: CaptureId
    pid: int = Field(ge=1)
    oracle: Oracle


class Activation(_ControlModel):
    """``activation.json``: the capturer asks the donor or a copy to recover and serve."""

    version: Literal[1] = 1
    capture_id: CaptureId
    activation_id: ActivationId
    kind: Literal["donor", "copy"]
    native_complete: bool
    host: str | None
    port: Port


class Challenge(_ControlModel):
    """``challenge.json``: a fresh nonce drawn after the activation was accepted."""

    version: Literal[1] = 1
    capture_id: CaptureId
    activation_id: ActivationId
    nonce: Nonce


class Release(Challenge):
    """``release.json``: exactly the object found in ``challenge.json``."""

    @classmethod
    def answering(cls, challenge: Challenge) -> Release:
        return cls.model_validate(challenge.model_dump())


class Status(_ControlModel):
    """``status.json``: recovery progress of the activation."""

    capture_id: CaptureId
    activation_id: ActivationId
    phase: Literal["recovering", "validated"]


class ErrorReport(_ControlModel):
    """``error.json``: the phase that failed, the exception type and its message."""

    capture_id: CaptureId
    activation_id: ActivationId | None
    phase: str
    error_type: str
    error: str


CONTROL_MODELS: dict[ControlFile, type[_ControlModel]] = {
    ControlFile.CAPTURE_READY: CaptureReady,
    ControlFile.ACTIVATION: Activation,
    ControlFile.CHALLENGE: Challenge,
    ControlFile.RELEASE: Release,
    ControlFile.STATUS: Status,
    ControlFile.ERROR: ErrorReport,
}
