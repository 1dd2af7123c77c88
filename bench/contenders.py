"""The ways to get a serving fixture, each timed from "go" to its first correct completion.

A contender is one object with a ``name`` and ``run(image, reference) -> Sample``. Adding one
(say snapctl's lazy restore: ``SnapctlCopy(lazy=True)`` once ``start_copy`` takes ``lazy``) is
one more class or instance in :func:`default_contenders`; the runner, the JSON and the docs
pick it up by name.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench import bare
from bench.workload import (
    Answer,
    ColdServer,
    first_correct,
    host_connect,
    in_netns,
    launch_options,
)
from snapctl.activation.copy import start_copy
from snapctl.activation.native import NoNativeStep
from snapctl.criu import CriuBinary, read_restore_stats
from snapctl.statedir import StateDir


@dataclass(frozen=True)
class Image:
    """A published snapctl image of the fixture with ``size_mb`` of retained memory."""

    size_mb: int
    path: Path
    criu_bytes: int


@dataclass
class Sample:
    """One run of one contender. Times in seconds from the contender's own "go"."""

    ready_s: float  # first correct completion
    validated_s: float | None = None  # status.json said validated (restores only)
    phases: dict[str, float] = field(default_factory=dict)  # where validated_s went
    criu_restore_s: float | None = None  # CRIU's own restore_time from stats-restore
    handshake_s: float | None = None  # activation written -> validated
    recovery_s: float | None = None  # of which the server's recovery (recovering -> validated)
    # After validated, up to the first correct completion (where the contender spends it).
    after: dict[str, float] = field(default_factory=dict)
    # A lazy restore returns before its memory is in: then "criu" is no measure of throughput,
    # and pages_complete_s says when the last page arrived.
    all_pages_restored: bool = True
    pages_complete_s: float | None = None
    # snapctl only: when every page of the copy was in place (plain: criu restore returned).
    pages_present_s: float | None = None
    # Lazy only: from the start of the restore until its daemon listened (the two overlap).
    daemon_ready_s: float | None = None


@dataclass
class Context:
    """What every contender needs: the state dir, CRIU, a scratch dir, a bounded wait."""

    state: StateDir
    criu: CriuBinary
    scratch: Path
    timeout_s: float = 300.0


class Contender(Protocol):
    name: str

    def run(self, ctx: Context, image: Image, reference: Answer | None) -> Sample: ...


class ColdStart:
    """``python -m fixtures serve`` without ``--snapshot-config``: load, fill, bind, serve."""

    name = "cold start"

    def run(self, ctx: Context, image: Image, reference: Answer | None) -> Sample:
        log = ctx.scratch / f"cold-{uuid.uuid4().hex[:8]}.log"
        started = time.monotonic()
        server = ColdServer(ctx.state, image.size_mb, log)
        try:
            first_correct(host_connect(server.port), reference, ctx.timeout_s, server.alive)
            return Sample(ready_s=time.monotonic() - started)
        finally:
            server.stop()
            log.unlink(missing_ok=True)


class BareCriu:
    """Raw ``criu restore`` of the same image plus the minimal handshake (see :mod:`bare`)."""

    name = "bare CRIU"

    def run(self, ctx: Context, image: Image, reference: Answer | None) -> Sample:
        started = time.monotonic()
        copy = bare.restore(ctx.criu.path, image.path, ctx.scratch / f"bare-{uuid.uuid4().hex}")
        try:
            validated = time.monotonic() - started
            in_netns(
                copy.pid,
                lambda: first_correct(
                    host_connect(bare.INNER_PORT, bare.INNER_HOST), reference, ctx.timeout_s
                ),
            )
            ready = time.monotonic() - started
            stats = read_restore_stats(copy.root / "work")
            return Sample(
                ready_s=ready,
                validated_s=validated,
                phases=dict(copy.timings),
                criu_restore_s=stats.restore_time_us / 1e6,
                handshake_s=copy.timings["handshake"],
                recovery_s=copy.recovery_s,
                after={"first completion": ready - validated},
            )
        finally:
            copy.stop()


class SnapctlCopy:
    """``start_copy`` (what ``snapctl copy`` runs), published on a host port."""

    def __init__(self, **copy_kwargs: Any) -> None:
        # Extra keyword arguments for start_copy (lazy=True) make a variant, named like the
        # CLI flag that selects it.
        self.copy_kwargs = copy_kwargs
        flags = "".join(
            f" --{k}" if v is True else f" --{k}={v}" for k, v in sorted(copy_kwargs.items())
        )
        self.name = f"snapctl copy{flags}"

    def run(self, ctx: Context, image: Image, reference: Answer | None) -> Sample:
        marks: list[tuple[str, float]] = []
        started = time.monotonic()
        session, report = start_copy(
            image.path, launch_options(image.size_mb, ctx.timeout_s), criu=ctx.criu,
            native=NoNativeStep(), publish=("127.0.0.1", 0), state=ctx.state,
            progress=lambda step: marks.append((step, time.monotonic())), **self.copy_kwargs,
        )  # fmt: skip
        try:
            assert report.published is not None
            port = int(report.published.rsplit(":", 1)[1])
            returned = time.monotonic() - started
            first_correct(host_connect(port), reference, ctx.timeout_s)
            ready = time.monotonic() - started
            pages_complete = None
            restoring = dict(marks)["restoring with CRIU"] - started
            pages_present = restoring + report.timings_s["restore"]
            if session.lazy is not None:
                # Let the transfer finish before the next contender runs (and time it).
                status = session.lazy.wait(ctx.timeout_s)
                if status.state != "complete" or status.complete_s is None:
                    raise RuntimeError(f"lazy copy's pages did not complete: {status}")
                pages_complete = pages_present = restoring + status.complete_s
        finally:
            _, audit = session.stop()
        if not audit.clean:
            raise RuntimeError(f"snapctl copy left things behind: {audit.describe()}")
        timings = report.timings_s
        phases = copy_phases(started, marks, timings)
        stats = report.restore_stats or {}
        validated = sum(phases.values())
        return Sample(
            ready_s=ready,
            validated_s=validated,
            phases=phases,
            criu_restore_s=stats.get("restore_time_us", 0) / 1e6 or None,
            handshake_s=timings["handshake"],
            after={
                "HTTP probe": timings["validated_to_http_200"],
                "rest of start_copy": returned - validated - timings["validated_to_http_200"],
                "first completion": ready - returned,
            },
            all_pages_restored=pages_complete is None,
            pages_complete_s=pages_complete,
            pages_present_s=pages_present,
            daemon_ready_s=timings.get("lazy_pages_start"),
        )


def copy_phases(
    started: float, marks: list[tuple[str, float]], timings: dict[str, float]
) -> dict[str, float]:
    """start_copy's wall time up to validated, split into its phases.

    ``timings_s`` times verify, the identity check, stage, the lazy view of the image (lazy
    only), restore and handshake; the progress marks place them on one clock, so the untimed
    work between them (image hold, directories and tmpfs, pinning and inspecting the restored
    tree) shows up too instead of vanishing from the sum. A lazy copy's daemon starts together
    with its restore, so its start is within ``criu`` (``Sample.daemon_ready_s``).
    """
    at = {step: when for step, when in marks}
    staging = at["staging the copy's directories"]
    restoring = at["restoring with CRIU"]
    activating = at["activating the copy"]
    checks = timings["verify"] + timings.get("identity", 0.0)
    view = timings.get("lazy_view")
    phases = {
        "verify": timings["verify"],
        "identity": timings.get("identity", 0.0),
        "setup": staging - started - checks,
        "stage": restoring - staging,
    }
    if view is not None:
        phases["lazy view"] = view
    phases["criu"] = timings["restore"]
    phases["after restore"] = activating - restoring - (view or 0.0) - timings["restore"]
    phases["handshake"] = timings["handshake"]
    return phases


def default_contenders() -> list[Contender]:
    return [ColdStart(), BareCriu(), SnapctlCopy(), SnapctlCopy(lazy=True)]
