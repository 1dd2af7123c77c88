"""The serving runs of a qualification (ordinary reference, donor, copies) and what every run
shares: its context, its result model, its timings and the saving of its control files and logs.

A serving run starts one activation, records how its /dev/shm looks while serving, sends the
workload, saves the activation's control files, stops it, scans the host for leftovers and
judges everything against the ordinary reference. A run never raises for a failed step: the
failure becomes a failed check, so the remaining runs still happen and the report is complete.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from snapctl.activation.copy import start_copy
from snapctl.activation.donor import ActivationReport, start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep
from snapctl.activation.session import CleanupAudit, Session
from snapctl.criu import CriuBinary
from snapctl.errors import SnapctlError
from snapctl.images import FileEntry, hash_tree, load_manifest
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
from snapctl.qualification.workload import ServingObservation, observe_serving
from snapctl.supervision.state import StateDir

Progress = Callable[[str], None]
RunKind = Literal[
    "reference", "donor", "copy", "fault", "stale", "criu-dump-fault", "criu-restore-fault"
]
PUBLISH_HOST = "127.0.0.1"


class Timings(BaseModel):
    """Seconds spent in each step of a run (None: the step is not part of this run)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    launch_to_first_200_s: float | None = None  # the ordinary reference start
    launch_to_capture_ready_s: float | None = None
    dump_s: float | None = None
    dump_frozen_s: float | None = None  # CRIU's own frozen time (stats-dump)
    restore_s: float | None = None
    handshake_s: float | None = None  # activation.json → validated (or → error.json)
    validated_to_first_200_s: float | None = None
    error_to_exit_s: float | None = None
    shutdown_s: float | None = None


class RunResult(BaseModel):
    """One run: its checks, figures, cleanup audit and what it observed."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    kind: RunKind
    activation_ids: list[str] = []
    checks: list[Check]
    timings: Timings = Timings()
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
    # The control files of the last activation that served: the stale run replays them.
    previous_control: dict[str, dict[str, object]] = field(default_factory=dict)

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
        served.observation = observe_serving(published, ctx.options.api_key)
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
) -> list[Check]:
    found: list[Check] = [checks.check_completed(served.error)]
    observation = served.observation
    if observation is not None:
        if compare:
            if ctx.reference is None:
                found.append(checks.failed("prompts match reference", "no reference was recorded"))
            else:
                found.append(checks.check_outputs("prompts", ctx.reference, observation))
                found.append(checks.check_outputs("concurrency", ctx.reference, observation))
        found.append(checks.check_auth(observation.auth))
        baseline = ctx.reference.digests if (compare and ctx.reference) else []
        found.append(checks.check_digests_stable(observation.digests, baseline))
        found.append(checks.check_digests_match_model(observation.digests, ctx.model_digests))
    if before is not None:
        found.append(checks.check_image_unchanged(before, image_hashes(ctx.image)))
    if compare:
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
    assert session.publisher is not None
    published = "{}:{}".format(*session.publisher.address)
    served = _serve_and_stop(ctx, session, published, "reference")
    ctx.reference = served.observation
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
    started: float,
) -> RunResult:  # fmt: skip
    """The result of a serving run whose activation never started serving."""
    res = residue(ctx.state, baseline)
    return RunResult(
        name=run,
        kind=kind,
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
        restore_s=t.get("restore"),
        handshake_s=t.get("handshake"),
        validated_to_first_200_s=t.get("validated_to_http_200"),
        shutdown_s=shutdown_s,
    )


def run_donor(ctx: RunContext) -> RunResult:
    """Launch, capture into ``ctx.image``, activate the continuing original, check, stop."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    try:
        session, report, _ = start_donor(
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
    res = residue(ctx.state, baseline, load_manifest(ctx.image).shm_files)
    return RunResult(
        name="donor",
        kind="donor",
        activation_ids=[report.activation_id],
        checks=_serving_checks(ctx, served, before=before, res=res),
        timings=_activation_timings(report, served.shutdown_s),
        wall_s=time.monotonic() - started,
        cleanup=served.audit,
        residue=res,
        observation=served.observation,
        artifacts=artifacts_dir(ctx, "donor"),
    )


def run_copy(ctx: RunContext, name: str) -> RunResult:
    """Restore one copy from the image in fresh namespaces, activate it, check, stop."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    before = image_hashes(ctx.image)
    try:
        session, report = start_copy(
            ctx.image, ctx.options, criu=ctx.criu, native=ctx.native,
            publish=(PUBLISH_HOST, 0), state=ctx.state,
            progress=lambda step: ctx.progress(f"{name}: {step}"),
        )  # fmt: skip
    except SnapctlError as error:
        return _failed_start(ctx, name, "copy", error, baseline, started)
    assert report.published is not None
    served = _serve_and_stop(ctx, session, report.published, name)
    res = residue(ctx.state, baseline, load_manifest(ctx.image).shm_files)
    return RunResult(
        name=name,
        kind="copy",
        activation_ids=[report.activation_id],
        checks=_serving_checks(ctx, served, before=before, res=res),
        timings=_activation_timings(report, served.shutdown_s),
        wall_s=time.monotonic() - started,
        cleanup=served.audit,
        residue=res,
        observation=served.observation,
        artifacts=artifacts_dir(ctx, name),
    )
