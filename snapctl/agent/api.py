"""The agent's API (v1): its operations (:data:`OPERATIONS`: method, path, body, answer), its
request bodies, and the answers that are not another package's own records. Copy, donor and
bake requests are :mod:`snapctl.activation.requests`' models, the pool's rows
:mod:`snapctl.pool.models`'; activation reports are
:class:`snapctl.activation.core.ActivationReport` as JSON. Requests are strict (unknown fields,
wrong types and out-of-range values are refused with the reason).

The server routes by :data:`OPERATIONS` (:mod:`snapctl.agent.server`) and the OpenAPI document
is generated from them (:mod:`snapctl.agent.openapi`), so neither can name a path the other
does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest
from snapctl.activation.timeouts import positive_seconds
from snapctl.agent import API_PREFIX
from snapctl.pool.models import PoolListing, PoolTarget
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
    tree and its supervisor still run, its tree's PSS, what KSM saves in it and what its
    cgroup is charged (None once gone, or without a cgroup)."""

    running: bool
    supervised: bool
    memory_bytes: int | None = None
    ksm_saved_bytes: int | None = None
    cgroup_memory_bytes: int | None = None


class LogChunk(_Answer):
    """``GET /v1/activations/{name}/logs``: the server log's text (``?follow=1``: one message
    per chunk as the server writes it, until the activation stops)."""

    text: str


class ProgressMessage(_Answer):
    """A step of a streamed operation as it begins (``lane``: which copy of a ``--count``
    start, "" when there is one)."""

    lane: str
    progress: str


class NoteMessage(_Answer):
    """A note a streamed operation gives on the way (what the CLI prints as a note)."""

    note: str


class ReportMessage(_Answer):
    """The last message of a streamed operation that succeeded: its record, as the CLI's
    ``--json`` prints it (``ActivationReport``, ``CopiesReport`` for ``--count``,
    ``BakeReport``)."""

    report: dict[str, Any]


@dataclass(frozen=True)
class Query:
    """A query parameter of an operation (its last value counts; an empty one is absent)."""

    name: str
    description: str
    required: bool = False


@dataclass(frozen=True)
class Operation:
    """One operation of the API: the request that asks for it and what it answers.

    ``body``: the model of its JSON body (an empty body is the model's defaults), None for
    none. ``answer``: the model of its JSON answer (``listed``: a list of them); None with
    ``answer_text`` for an answer that is another package's record. ``streamed``: NDJSON
    messages instead (progress, notes, then a report or an :class:`ErrorBody`), ``answer``
    being each message of a log's. ``unix_only``: refused on the TCP listener (403).
    """

    name: str
    method: Literal["GET", "POST"]
    path: str  # {name} is an activation's name
    summary: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    listed: bool = False
    answer_text: str = ""
    streamed: bool = False
    query: tuple[Query, ...] = ()
    unix_only: bool = False
    metrics: bool = False  # Prometheus text, not JSON


_METRICS_SUMMARY = "Prometheus metrics (text format; also the metrics listener's one path)"

OPERATIONS: tuple[Operation, ...] = (
    Operation("version", "GET", f"{API_PREFIX}/version", "which API and snapctl answer",
              answer=VersionInfo),
    Operation("activations", "GET", f"{API_PREFIX}/activations",
              "every activation's record, whether it runs and its memory (ps --json)",
              answer=ActivationRow, listed=True),
    Operation("stop", "POST", f"{API_PREFIX}/activations/{{name}}/stop",
              "stop an activation, with its cleanup audit (stop --json)", body=StopRequest,
              answer=StopAnswer),
    Operation("logs", "GET", f"{API_PREFIX}/activations/{{name}}/logs",
              "an activation's server log in chunks (logs [-f])", answer=LogChunk,
              streamed=True,
              query=(Query("follow", "1 or true: then what the log gets until the activation "
                                     "stops or the client leaves"),)),
    Operation("copy", "POST", f"{API_PREFIX}/copies",
              "restore a copy, or activate a parked one (copy)", body=CopyRequest,
              streamed=True),
    Operation("donor", "POST", f"{API_PREFIX}/donors",
              "capture a server and keep it serving (donor); unix socket only",
              body=DonorRequest, streamed=True, unix_only=True),
    Operation("bake", "POST", f"{API_PREFIX}/bakes",
              "capture a server into an image (bake); unix socket only", body=BakeRequest,
              streamed=True, unix_only=True),
    Operation("images", "GET", f"{API_PREFIX}/images", "the images (images --json)",
              listed=True, answer_text="images --json's rows",
              query=(Query("root", "the directory to list (absolute)"),
                     Query("default_root", "the caller's $SNAPCTL_IMAGE_ROOT (absolute)"))),
    Operation("inspect", "GET", f"{API_PREFIX}/images/inspect",
              "an image's record (inspect --json)", answer_text="inspect --json's record",
              query=(Query("image", "the image directory (absolute)", required=True),
                     Query("verify", "1 or true: verify every file's hash"))),
    Operation("pool", "GET", f"{API_PREFIX}/pool", "the warm pool (pool ls --json)",
              answer=PoolListing),
    Operation("pool_set", "POST", f"{API_PREFIX}/pool/set", "set an image's pool target",
              body=PoolTarget, answer=PoolTarget),
    Operation("pool_rm", "POST", f"{API_PREFIX}/pool/rm",
              "remove an image's pool target and parked copies", body=PoolRemoveRequest,
              answer=PoolTarget),
    Operation("gc", "POST", f"{API_PREFIX}/gc",
              "remove what killed snapctl processes left (gc --json)", body=GcRequest,
              answer_text="gc --json's GarbageReport"),
    Operation("metrics", "GET", "/metrics", _METRICS_SUMMARY, metrics=True),
    Operation("metrics_v1", "GET", f"{API_PREFIX}/metrics", _METRICS_SUMMARY, metrics=True),
)  # fmt: skip


__all__ = [
    "OPERATIONS",
    "ActivationRow",
    "ErrorBody",
    "GcRequest",
    "LogChunk",
    "NoteMessage",
    "Operation",
    "PoolRemoveRequest",
    "ProgressMessage",
    "Query",
    "ReportMessage",
    "StopAnswer",
    "StopRequest",
    "VersionInfo",
]
