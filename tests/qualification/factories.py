"""Fabricated observations for qualification tests: ``make_x(**changes)`` factories."""

from __future__ import annotations

from typing import Any

from snapctl.activation.session import CleanupAudit
from snapctl.criu.lazy.transfer import PagesStatus
from snapctl.images.manifest import FileEntry
from snapctl.protocol.models import ErrorReport
from snapctl.qualification.workload import (
    WORKLOAD,
    Completion,
    DigestRead,
    RetainedRead,
    ServingObservation,
)

CAPTURE_ID = "0123456789abcdef0123456789abcdef"
DIGESTS = {"embed.weight": "a" * 64, "lm_head.weight": "b" * 64}
RETAINED = "d" * 64
FAILURE = (
    "lazy-pages daemon killed by SIGKILL before every page was copied; the copy was stopped "
    "(log: /state/logs/copy-1/lazy-pages.log)"
)


def make_completion(label: str, **changes: Any) -> Completion:
    """The completion the reference would record for ``label`` (ids 0..n-1, text 'x'*n)."""
    request = next(r for batch in WORKLOAD for r in batch.requests if r.label == label)
    n = request.max_tokens
    fields: dict[str, Any] = {
        "label": label,
        "group": request.group,
        "prompt": request.prompt,
        "max_tokens": n,
        "stream": request.stream,
        "token_ids": list(range(n)),
        "text": "x" * n,
        "logprobs": [-0.5 - i / 100 for i in range(n)],
    }
    return Completion.model_validate(fields | changes)


def make_observation(
    completions: dict[str, Completion] | None = None, **changes: Any
) -> ServingObservation:
    """A full, well-behaved observation; ``completions`` replaces the named ones."""
    every = {r.label: make_completion(r.label) for batch in WORKLOAD for r in batch.requests}
    every |= completions or {}
    fields: dict[str, Any] = {
        "model": "snapctl-fixture",
        "auth": {"missing": 401, "wrong": 401, "right": 200},
        "digests": [make_digests(), make_digests()],
        "completions": every,
    }
    return ServingObservation.model_validate(fields | changes)


def make_digests(**changes: Any) -> DigestRead:
    return DigestRead.model_validate({"status": 200, "digests": dict(DIGESTS)} | changes)


def make_audit(**changes: Any) -> CleanupAudit:
    fields: dict[str, Any] = {"processes": [], "mounts": [], "directories": [], "listeners": []}
    return CleanupAudit.model_validate(fields | changes)


def make_files() -> dict[str, FileEntry]:
    return {
        "criu/pages-1.img": FileEntry(size=4096, sha256="1" * 64),
        "shm/sem.x": FileEntry(size=32, sha256="2" * 64, link_group=0),
        "shm/link_remap.1": FileEntry(size=32, sha256="2" * 64, link_group=0),
    }


def make_error(**changes: Any) -> ErrorReport:
    fields: dict[str, Any] = {
        "capture_id": CAPTURE_ID,
        "activation_id": "copy-1",
        "phase": "recovery: restore memory",
        "error_type": "EngineError",
        "error": "WeightsError: weights file changed since the initial load",
    }
    return ErrorReport.model_validate(fields | changes)


def make_retained(**changes: Any) -> RetainedRead:
    return RetainedRead.model_validate({"status": 200, "sha256": RETAINED, "mb": 256.0} | changes)


def make_pages(**changes: Any) -> PagesStatus:
    """A transfer that completed (``state="failed"`` etc. through ``changes``)."""
    fields: dict[str, Any] = {
        "state": "complete",
        "complete_s": 0.3,
        "complete_at": "2026-01-01T00:00:00.300+00:00",
    }
    return PagesStatus.model_validate(fields | changes)
