"""The serving runs of a qualification (ordinary reference, donor, copies) and what every run
shares: its context, its result model, its timings and the saving of its control files and logs.

A serving run starts one activation, records how its /dev/shm looks while serving, sends the
workload, (for a lazy copy) waits until its pages are complete, reads the retained-memory
digest, saves the activation's control files, stops it, scans the host for leftovers and
judges everything against the ordinary reference. A run never raises for a failed step: the
failure becomes a failed check, so the remaining runs still happen and the report is complete.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from snapctl.activation.copy import start_copy
from snapctl.activation.core import ActivationReport
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep
from snapctl.activation.session import CleanupAudit, Session
from snapctl.criu import CriuBinary
from snapctl.criu.lazy.transfer import PagesStatus
from snapctl.errors import SnapctlError
from snapctl.images import FileEntry, hash_tree, load_manifest
from snapctl.models import StrictModel
from snapctl.progress import Progress
from snapctl.protocol.facts import CaptureFacts
from snapctl.protocol.models import ControlFile
from snapctl.qualification import checks
from snapctl.qualification.checks import Check
from snapctl.qualification.reference import start_reference
from snapctl.qualification.watch import (
    Baseline,
    Residue,
    link_remaps,
    residue,
    take_baseline,
)
from snapctl.qualification.workload import (
    RetainedRead,
    ServingObservation,
    observe_serving,
    read_retained,
)
from snapctl.statedir import StateDir

RunKind = Literal[
    "reference",
    "donor",
    "copy",
    "fault",
    "lazy-fault",
    "stale",
    "criu-dump-fault",
    "criu-restore-fault",
]
PUBLISH_HOST = "127.0.0.1"


class Timings(StrictModel):
    """Seconds spent in each step of a run (None: the step is not part of this run)."""

    launch_to_first_200_s: float | None = None  # the ordinary reference start
    launch_to_capture_ready_s: float | None = None
    dump_s: float | None = None
    dump_frozen_s: float | None = None  # CRIU's own frozen time (stats-dump)
    native_checkpoint_s: float | None = None  # the native step before the dump (cuda lock+ckpt)
    # A lazy copy's daemon, from the start of its restore (they start together) until it listens.
    lazy_pages_start_s: float | None = None
    restore_s: float | None = None
    native_restore_s: float | None = None  # after the dump or restore (cuda restore+unlock)
    handshake_s: float | None = None  # activation.json → validated (or → error.json)
    validated_to_first_200_s: float | None = None
    error_to_exit_s: float | None = None
    kill_to_exit_s: float | None = None  # lazy-pages daemon SIGKILLed → the copy's tree gone
    shutdown_s: float | None = None


class LazyPages(StrictModel):
    """A lazy copy's page transfer as its run saw it."""

    lazy_pages_pid: int
    complete_when_ready: bool  # the transfer had already ended when the copy was ready
    pages_complete: bool  # the daemon exited 0 before the run's shutdown
    pages_complete_s: float | None = None  # from the start of criu restore to that exit
    pages_complete_at: str | None = None  # UTC time of that exit
    failure: str | None = None  # how the transfer ended otherwise (the daemon died)


class RunResult(StrictModel):
    """One run: its checks, figures, cleanup audit and what it observed."""

    name: str
    kind: RunKind
    activation_ids: list[str] = []
    checks: list[Check]
    timings: Timings = Timings()
    lazy: bool = False  # the run's copy was restored with lazy pages
    pages: LazyPages | None = None
    wall_s: float
    cleanup: CleanupAudit | None = None
    residue: Residue | None = None
    observation: ServingObservation | None = None
    artifacts: str | None = None

    @property
    def passed(self) -> bool:
        return not any(check.failed for check in self.checks)


@dataclass
class RunContext:
    """What every run needs, and what earlier runs leave for later ones."""

    options: LaunchOptions
    criu: CriuBinary
    native: NativeStep
    state: StateDir
    image: Path
    work: Path
    progress: Progress
    artifacts: Path | None = None
    reference: ServingObservation | None = None
    model_digests: dict[str, str] | None = None
    # The image's capture facts, read once the image exists (None: none stated).
    image_facts: CaptureFacts | None = None
    image_facts_read: bool = False
    # The copies (copy-1, copy-2) are restored with lazy pages.
    lazy: bool = False
    # What lazy copies' retained memory must hash to: the donor's read, else the reference's.
    retained_baseline: tuple[str, RetainedRead] | None = None
    # The control files of the last activation that served: the stale run replays them.
    previous_control: dict[str, dict[str, object]] = field(default_factory=dict)
    # Whether serving runs check the API key (False: qualified without one, by request), and
    # how to give a server started without one its key (the check's failure says it).
    check_api_key: bool = True
    keyless_hint: str = ""

    def captured_digests(self) -> dict[str, str] | None:
        """The first load's parameter digests the image recorded; None where the server
        stated none (or there is no image yet)."""
        if not self.image_facts_read:
            with contextlib.suppress(SnapctlError):
                self.image_facts = load_manifest(self.image).capture_facts
                self.image_facts_read = True
        if self.image_facts is None or not self.image_facts.parameter_digests:
            return None
        return self.image_facts.parameter_digests

    def run_dir(self, run: str) -> Path | None:
        if self.artifacts is None:
            return None
        path = self.artifacts / run
        path.mkdir(parents=True, exist_ok=True)
        return path


# -- artifacts ------------------------------------------------------------------------------------


def read_control(session: Session) -> dict[str, dict[str, object]]:
    """Every control file of a live activation, unvalidated (for the report and replays)."""
    found: dict[str, dict[str, object]] = {}
    for name in ControlFile:
        with contextlib.suppress(SnapctlError, OSError):
            payload = session.control.read_raw(name)
            if payload is not None:
                found[name.value] = payload
    return found


def save_control(control: dict[str, dict[str, object]], target: Path | None) -> None:
    """Write the control files read by :func:`read_control` into ``target/control``."""
    if target is None:
        return
    (target / "control").mkdir(parents=True, exist_ok=True)
    for name, payload in control.items():
        text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
        (target / "control" / name).write_text(text)


def save_new_logs(ctx: RunContext, baseline: Baseline, run: str) -> list[str]:
    """Copy the logs of every activation a run started (found by their log directories, for
    runs whose activation failed before the caller got a session); return their ids."""
    ids = baseline.new_logs(ctx.state)
    target = ctx.run_dir(run)
    if target is not None:
        for activation_id in ids:
            with contextlib.suppress(OSError):
                shutil.copytree(
                    ctx.state.logs / activation_id, target / activation_id, dirs_exist_ok=True
                )
    return ids


def save_logs(session: Session, target: Path | None) -> None:
    """Copy the activation's logs (they outlive it) and, for a donor, the image's dump log."""
    if target is None:
        return
    if session.dirs.logs.is_dir():
        shutil.copytree(session.dirs.logs, target / "logs", dirs_exist_ok=True)
    if session.kind == "donor" and session.image is not None and (session.image / "logs").is_dir():
        shutil.copytree(session.image / "logs", target / "image-logs", dirs_exist_ok=True)


def image_hashes(image: Path) -> dict[str, FileEntry] | None:
    try:
        return hash_tree(image)
    except OSError:
        return None


# -- serving runs ---------------------------------------------------------------------------------


@dataclass
class _Served:
    """What one serving activation showed, before it is judged."""

    observation: ServingObservation | None = None
    remaps: list[str] = field(default_factory=list)
    pages: PagesStatus | None = None  # a lazy copy's transfer, once waited for
    how: str = ""
    audit: CleanupAudit | None = None
    shutdown_s: float | None = None
    error: str | None = None


def _serve_and_stop(ctx: RunContext, session: Session, published: str, run: str) -> _Served:
    """Observe a serving activation, save its files, stop it and audit the stop."""
    served = _Served()
    target = ctx.run_dir(run)
    try:
        served.remaps = link_remaps(session.dirs.shm)
        ctx.progress(f"{run}: sending the workload")
        observation = observe_serving(published, ctx.options.api_key)
        retained = None
        if session.lazy is not None:
            ctx.progress(f"{run}: waiting until every page is in")
            served.pages = session.lazy.wait(ctx.options.timeout_s)
        if served.pages is None or served.pages.state == "complete":
            # A lazy copy's memory is only worth hashing once the daemon copied all of it.
            retained = read_retained(published, ctx.options.api_key)
        served.observation = observation.model_copy(update={"retained": retained})
    except Exception as error:
        served.error = f"workload failed: {type(error).__name__}: {error}"
    finally:
        control = read_control(session)
        with contextlib.suppress(OSError):
            save_control(control, target)
        started = time.monotonic()
        served.how, served.audit = session.stop()
        served.shutdown_s = time.monotonic() - started
    with contextlib.suppress(OSError):
        save_logs(session, target)
    if session.kind == "copy":
        ctx.previous_control = control
    return served


def _serving_checks(
    ctx: RunContext,
    served: _Served,
    *,
    before: dict[str, FileEntry] | None,
    res: Residue,
    compare: bool = True,
    expect_lazy: bool = False,
    lazy: LazyPages | None = None,
) -> list[Check]:
    """Judge one serving activation. ``compare``: against the reference and the image (every
    run but the reference itself); ``expect_lazy``: the copy was asked for lazy pages, so a
    copy restored without a lazy-pages daemon fails rather than skipping the page checks."""
    found: list[Check] = [checks.check_completed(served.error)]
    observation = served.observation
    if observation is not None:
        if compare:
            if ctx.reference is None:
                found.append(checks.failed("prompts match reference", "no reference was recorded"))
            else:
                found.append(checks.check_outputs("prompts", ctx.reference, observation))
                found.append(checks.check_outputs("concurrency", ctx.reference, observation))
        if ctx.check_api_key:
            found.append(checks.check_auth(observation.auth, keyless_hint=ctx.keyless_hint))
        else:
            found.append(checks.auth_skipped())
        baseline = ctx.reference.digests if (compare and ctx.reference) else []
        found.append(checks.check_digests_stable(observation.digests, baseline))
        found.append(checks.check_digests_match_model(observation.digests, ctx.model_digests))
        if compare:
            found.append(
                checks.check_digests_match_capture(observation.digests, ctx.captured_digests())
            )
    if expect_lazy or lazy is not None:
        found.append(
            checks.check_pages_complete(
                served.pages, daemon_pid=lazy.lazy_pages_pid if lazy else None,
                complete_when_ready=lazy.complete_when_ready if lazy else None,
            )
        )  # fmt: skip
    if observation is not None and (compare or expect_lazy or lazy is not None):
        # Every activation of the image must hold the same retained memory (with --device
        # cuda, GPU memory that went through the native step); skipped without the endpoint.
        source, retained = ctx.retained_baseline or ("donor", None)
        found.append(checks.check_retained_memory(observation.retained, retained, source))
    if compare:
        found.append(checks.check_image_unchanged(before, image_hashes(ctx.image)))
        found.append(checks.check_link_remaps(served.remaps))
    found.append(checks.check_cleanup(served.audit, res, served.how))
    return found


def run_reference(ctx: RunContext, argv: list[str], cwd: Path) -> RunResult:
    """The ordinary start, without capture: its answers become the reference."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    try:
        session, ready_s = start_reference(
            argv, cwd, ctx.options, state=ctx.state, publish=(PUBLISH_HOST, 0),
            progress=ctx.progress,
        )  # fmt: skip
    except SnapctlError as error:
        return _failed_start(ctx, "reference", "reference", error, baseline, started)
    published = session.published
    assert published is not None
    served = _serve_and_stop(ctx, session, published, "reference")
    ctx.reference = served.observation
    if served.observation is not None and served.observation.retained is not None:
        ctx.retained_baseline = ("reference", served.observation.retained)
    res = residue(ctx.state, baseline)
    return RunResult(
        name="reference",
        kind="reference",
        activation_ids=[session.activation_id],
        checks=_serving_checks(ctx, served, before=None, res=res, compare=False),
        timings=Timings(launch_to_first_200_s=ready_s, shutdown_s=served.shutdown_s),
        wall_s=time.monotonic() - started,
        cleanup=served.audit,
        residue=res,
        observation=served.observation,
        artifacts=artifacts_dir(ctx, "reference"),
    )


def _failed_start(
    ctx: RunContext, run: str, kind: RunKind, error: SnapctlError, baseline: Baseline,
    started: float, *, lazy: bool = False,
) -> RunResult:  # fmt: skip
    """The result of a serving run whose activation never started serving."""
    res = residue(ctx.state, baseline)
    return RunResult(
        name=run,
        kind=kind,
        lazy=lazy,
        activation_ids=save_new_logs(ctx, baseline, run),
        checks=[checks.check_completed(error.message), checks.check_cleanup(None, res)],
        wall_s=time.monotonic() - started,
        residue=res,
        artifacts=artifacts_dir(ctx, run),
    )


def artifacts_dir(ctx: RunContext, run: str) -> str | None:
    return None if ctx.artifacts is None else str(ctx.artifacts / run)


def _activation_timings(report: ActivationReport, shutdown_s: float | None) -> Timings:
    t = report.timings_s
    frozen = None if report.dump_stats is None else report.dump_stats.frozen_time_us / 1e6
    return Timings(
        launch_to_capture_ready_s=t.get("launch_to_capture_ready"),
        dump_s=t.get("dump"),
        dump_frozen_s=frozen,
        native_checkpoint_s=t.get("native_checkpoint"),
        lazy_pages_start_s=t.get("lazy_pages_start"),
        restore_s=t.get("restore"),
        native_restore_s=t.get("native_restore"),
        handshake_s=t.get("handshake"),
        validated_to_first_200_s=t.get("validated_to_http_200"),
        shutdown_s=shutdown_s,
    )


def _lazy_pages(report: ActivationReport, pages: PagesStatus | None) -> LazyPages | None:
    """The transfer as the report (at ready) and the wait before shutdown saw it."""
    if not report.lazy or report.lazy_pages_pid is None:
        return None
    complete = pages is not None and pages.state == "complete"
    return LazyPages(
        lazy_pages_pid=report.lazy_pages_pid,
        complete_when_ready=bool(report.pages_complete),
        pages_complete=complete,
        pages_complete_s=pages.complete_s if pages is not None else None,
        pages_complete_at=pages.complete_at if pages is not None else None,
        failure=pages.failure if pages is not None else None,
    )


def _served_result(
    ctx: RunContext, run: str, kind: RunKind, report: ActivationReport, served: _Served, *,
    baseline: Baseline, before: dict[str, FileEntry] | None, started: float,
) -> RunResult:  # fmt: skip
    """Judge a donor or copy that served (its residue scanned now) into its result."""
    res = residue(ctx.state, baseline, load_manifest(ctx.image).shm_files)
    pages = _lazy_pages(report, served.pages)
    expect_lazy = kind == "copy" and ctx.lazy
    return RunResult(
        name=run,
        kind=kind,
        activation_ids=[report.activation_id],
        checks=_serving_checks(
            ctx, served, before=before, res=res, expect_lazy=expect_lazy, lazy=pages
        ),
        timings=_activation_timings(report, served.shutdown_s),
        lazy=report.lazy,
        pages=pages,
        wall_s=time.monotonic() - started,
        cleanup=served.audit,
        residue=res,
        observation=served.observation,
        artifacts=artifacts_dir(ctx, run),
    )


def run_donor(ctx: RunContext) -> RunResult:
    """Launch, capture into ``ctx.image``, activate the continuing original, check, stop."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    try:
        session, report = start_donor(
            ctx.options, image=ctx.image, force=False, criu=ctx.criu, native=ctx.native,
            publish=(PUBLISH_HOST, 0), state=ctx.state,
            progress=lambda step: ctx.progress(f"donor: {step}"),
        )  # fmt: skip
    except SnapctlError as error:
        return _failed_start(ctx, "donor", "donor", error, baseline, started)
    assert report.published is not None
    # What was published is the "before": the manifest's sha256 of every file.
    before = dict(load_manifest(ctx.image).files)
    served = _serve_and_stop(ctx, session, report.published, "donor")
    if served.observation is not None and served.observation.retained is not None:
        # The memory the copies were captured from: what theirs must hash to.
        ctx.retained_baseline = ("donor", served.observation.retained)
    return _served_result(
        ctx, "donor", "donor", report, served, baseline=baseline, before=before, started=started
    )


def run_copy(ctx: RunContext, name: str) -> RunResult:
    """Restore one copy from the image in fresh namespaces (lazily when ``ctx.lazy``),
    activate it, check, stop."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    before = image_hashes(ctx.image)
    try:
        session, report = start_copy(
            ctx.image, ctx.options, criu=ctx.criu, native=ctx.native,
            publish=(PUBLISH_HOST, 0), state=ctx.state,
            progress=lambda step: ctx.progress(f"{name}: {step}"), lazy=ctx.lazy,
        )  # fmt: skip
    except SnapctlError as error:
        return _failed_start(ctx, name, "copy", error, baseline, started, lazy=ctx.lazy)
    assert report.published is not None
    served = _serve_and_stop(ctx, session, report.published, name)
    return _served_result(
        ctx, name, "copy", report, served, baseline=baseline, before=before, started=started
    )
