"""The agent's API models (v1): request bodies, and the answers that are not another
package's own records. Copy requests and the pool's rows are :mod:`snapctl.pool`'s models;
activation reports are :class:`snapctl.activation.donor.ActivationReport` as JSON. Requests
are strict (unknown fields, wrong types and out-of-range values are refused with the reason).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from snapctl.activation.timeouts import positive_seconds
from snapctl.statedir import ActivationRecord


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VersionInfo(_Answer):
    """``GET /v1/version``: which API and snapctl answer."""

    api: Literal[1] = 1
    snapctl: str
    pid: int
    state_dir: str


class ErrorBody(_Answer):
    """Every 4xx/5xx answer (and the last message of a failed stream): the error's message,
    its exit status for the CLI, and where it happened. ``usage`` is set for a bad option the
    CLI reports as a usage error: the option's name ("" for the command as a whole)."""

    error: str
    status: int
    phase: str | None = None
    path: str | None = None
    log_tail: str | None = None
    usage: str | None = None


class StopRequest(_Request):
    """``POST /v1/activations/{name}/stop``."""

    timeout_s: float = 10.0

    _check = field_validator("timeout_s")(positive_seconds)


class StopAnswer(_Answer):
    """How it stopped and what its cleanup left (``snapctl stop --json``)."""

    name: str
    stopped: str
    audit: dict[str, list[int] | list[str]]


class GcRequest(_Request):
    """``POST /v1/gc``."""

    timeout_s: float = 10.0

    _check = field_validator("timeout_s")(positive_seconds)


class PoolRemoveRequest(_Request):
    """``POST /v1/pool/rm``: the image whose target and parked copies go."""

    image: str = Field(min_length=1, pattern=r"^/")


class ActivationRow(ActivationRecord):
    """One row of ``GET /v1/activations`` (``snapctl ps --json``): the record, whether its
    tree and its supervisor still run, and its tree's PSS (None once gone)."""

    running: bool
    supervised: bool
    memory_bytes: int | None = None


class LogChunk(_Answer):
    """``GET /v1/activations/{name}/logs``: the server log's text (``?follow=1``: one message
    per chunk as the server writes it, until the activation stops)."""

    text: str


__all__ = [
    "ActivationRow",
    "ErrorBody",
    "GcRequest",
    "LogChunk",
    "PoolRemoveRequest",
    "StopAnswer",
    "StopRequest",
    "VersionInfo",
]
