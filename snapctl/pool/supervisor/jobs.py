"""What a supervisor forked by the spawner runs (:func:`run_job`, the spawner's job runner):
a fresh copy (``copy``), a parked one (``park``, see :mod:`snapctl.pool.supervisor.parked`),
a donor (``donor``: captures, then serves and is supervised like a detached donor) or a bake
(``bake``: captures, publishes, stops, exits). Runs in a supervisor process; imported by the
agent before it forks the spawner, with everything a supervisor needs, so that a supervisor
starts without importing anything."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Imported here, before the spawner forks: a supervisor's start imports nothing more.
import snapctl.activation.bake
import snapctl.activation.copy
import snapctl.activation.donor
import snapctl.activation.precheck
import snapctl.activation.start
import snapctl.activation.supervise
import snapctl.images.ownership  # the pre-start checks' image owner rule
import snapctl.registry.source  # the pre-start checks' image lookup
from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest, publish_pair
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool.supervisor.common import (
    PROBE_KEY_ENV,
    abandon_undelivered,
    check_request,
    detach_stdio,
    launch_options,
)
from snapctl.pool.supervisor.parked import run_parked
from snapctl.pool.wire import Reporter
from snapctl.statedir import StateDir

if TYPE_CHECKING:
    from snapctl.supervision.signals import StopSignals

assert snapctl.activation.copy and snapctl.activation.supervise and snapctl.activation.start
assert snapctl.activation.donor and snapctl.activation.bake
assert snapctl.activation.precheck and snapctl.registry.source
assert snapctl.images.ownership

__all__ = [
    "PROBE_KEY_ENV",
    "JobStart",
    "Reporter",
    "abandon_undelivered",
    "adopt_client_context",
    "check_request",
    "detach_stdio",
    "launch_options",
    "report_then_supervise",
    "run_capture",
    "run_copy",
    "run_job",
    "starting",
]


def report_then_supervise(
    reporter: Reporter, report: dict[str, Any], sessions: list[Any], signals: Any, *,
    detach: bool,
) -> int:  # fmt: skip
    """The end of a job that serves: send its report, then supervise its sessions until
    they are stopped (or, a foreground start whose report reached no one, stop them now:
    :func:`abandon_undelivered`); the supervisor's exit status."""
    from snapctl.activation.supervise import run_all_until_stopped
    from snapctl.supervision.signals import stop_all_tracked

    delivered = reporter.send({"report": report})
    reporter.close()
    if abandon_undelivered(delivered, detach):
        return int(ExitStatus.ERROR)
    detach_stdio()
    try:
        run_all_until_stopped(sessions, stop=signals.requested)
    finally:
        stop_all_tracked()
    return 0


def run_job(job: dict[str, Any], pipe_fd: int) -> None:
    """Run ``job`` in this (freshly forked) supervisor, reporting on ``pipe_fd``; exits."""
    kind = job.get("kind")
    if kind == "copy":
        os._exit(run_copy(job, Reporter(pipe_fd)))
    if kind == "park":
        os._exit(run_parked(job, Reporter(pipe_fd)))
    if kind in ("donor", "bake"):
        os._exit(run_capture(job, Reporter(pipe_fd)))
    Reporter(pipe_fd).send(SnapctlError(f"unknown job {kind!r}").to_wire())
    os._exit(1)


@dataclass
class JobStart:
    """A job's start as :func:`starting` ran it: its stop signals, and the exit status of its
    failure once reported (None: it started)."""

    signals: StopSignals
    failed: int | None = None


@contextlib.contextmanager
def starting(reporter: Reporter) -> Iterator[JobStart]:
    """Run a job's start: the stop signals held from before it, and once it ended the signals
    ask the supervising loop to stop; on any failure (an interrupt included) what it had
    started is stopped and the failure reported, not raised (see ``JobStart.failed``)."""
    from snapctl.supervision.signals import StopSignals, stop_all_tracked

    start = JobStart(StopSignals().install())
    try:
        try:
            yield start
            start.signals.started()
        except BaseException:
            stop_all_tracked()  # what a start interrupted at any point had started
            raise
    except BaseException as error:
        start.failed = reporter.error(error)


def run_copy(job: dict[str, Any], reporter: Reporter) -> int:
    """A fresh copy (or ``count`` of them): restore, activate, report, then supervise."""
    from snapctl.activation.start import prepare_copies

    with starting(reporter) as start:
        state = StateDir(Path(job["state"]))
        request = CopyRequest.model_validate_json(json.dumps(job["request"]))
        check_request(request, state)
        # No note: the agent decided (and noted) whether it restores lazily first.
        copies = prepare_copies(request, state, options=launch_options(request))
        sessions, copied = copies(lambda lane: lambda step: reporter.progress(lane, step))
        report = copied.model_dump(mode="json")
    if start.failed is not None:
        return start.failed
    return report_then_supervise(reporter, report, sessions, start.signals, detach=request.detach)


def adopt_client_context(request: BakeRequest) -> None:
    """Become the client's process for the capture: its working directory and its whole
    environment (this supervisor's own is the agent's), so that the server command, its
    relative paths and the identity's env record are what the CLI in-process would give."""
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update({name: value.get_secret_value() for name, value in
                       request.environ.items()})  # fmt: skip


def run_capture(
    job: dict[str, Any], reporter: Reporter, *,
    adopt: Callable[[BakeRequest], None] = adopt_client_context,
) -> int:  # fmt: skip
    """A donor or a bake, in the client's directory and environment: capture (and for a donor
    activate), report, then (a donor) supervise it like a detached donor until stopped.
    ``adopt`` is the seam that makes this process the client's (tests: a fake)."""
    from snapctl.activation.bake import bake_image
    from snapctl.activation.donor import start_donor
    from snapctl.activation.native import native_step
    from snapctl.criu import find_criu

    session = None
    with starting(reporter) as start:
        state = StateDir(Path(job["state"]))
        model = DonorRequest if job["kind"] == "donor" else BakeRequest
        request = model.model_validate_json(json.dumps(job["request"]))
        adopt(request)
        options = request.launch_options()
        criu = find_criu(request.criu_path)
        native = native_step(request.native)

        def progress(step: str) -> None:
            reporter.progress("", step)

        if isinstance(request, DonorRequest):
            publish = publish_pair(request.publish)
            session, donor = start_donor(
                options, image=Path(request.image), force=request.force, criu=criu,
                native=native, publish=publish, state=state, progress=progress,
            )  # fmt: skip
            report = donor.model_dump(mode="json")
        else:
            baked = bake_image(
                options, image=Path(request.image), force=request.force, criu=criu,
                native=native, state=state, progress=progress,
            )  # fmt: skip
            report = baked.model_dump(mode="json")
    if start.failed is not None:
        return start.failed
    if session is None:  # a bake: its original was stopped, its image published
        reporter.send({"report": report})
        reporter.close()
        return 0
    detach = isinstance(request, DonorRequest) and request.detach
    return report_then_supervise(reporter, report, [session], start.signals, detach=detach)
