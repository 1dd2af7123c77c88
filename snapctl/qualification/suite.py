"""A whole qualification: which runs, in which order, against which image, into one report.

The order is fixed whatever order the runs are named in: the ordinary reference first (when a
serving run needs it), then the donor (which publishes the image and is shut down), the
CRIU restore fault, the two copies (restored after the donor is gone; lazily with ``lazy``),
the recovery fault, the lazy-pages daemon fault, the stale-control runs and the CRIU dump fault.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from snapctl.activation.launch import LaunchOptions, redact_argv
from snapctl.activation.native import NativeStep
from snapctl.criu import CriuBinary
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images import load_manifest
from snapctl.images.manifest import MANIFEST_NAME
from snapctl.phases import HostPhase
from snapctl.progress import Progress
from snapctl.qualification import checks
from snapctl.qualification.criu_faults import run_criu_dump_fault, run_criu_restore_fault
from snapctl.qualification.faultmodes import FaultMode
from snapctl.qualification.faults import run_fault, run_stale
from snapctl.qualification.lazy_fault import run_lazy_fault
from snapctl.qualification.reference import (
    is_fixture,
    model_file_digests,
    server_command,
    server_from_manifest,
)
from snapctl.qualification.report import Report, environment, now, write_report
from snapctl.qualification.runs import (
    RunContext,
    RunKind,
    RunResult,
    run_copy,
    run_donor,
    run_reference,
)
from snapctl.statedir import StateDir
from snapctl.supervision.process import become_subreaper

RUN_ORDER = (
    "donor",
    "criu-restore-fault",
    "copy-1",
    "copy-2",
    "fault",
    "lazy-fault",
    "stale",
    "criu-dump-fault",
)
LAZY_RUNS = frozenset({"lazy-fault"})
DEFAULT_RUNS = tuple(name for name in RUN_ORDER if name not in LAZY_RUNS)
LAZY_DEFAULT_RUNS = RUN_ORDER
SERVING_RUNS = frozenset({"donor", "copy-1", "copy-2"})
# Runs that restore the image (the donor's, or an existing one given with --image).
IMAGE_RUNS = frozenset({"criu-restore-fault", "copy-1", "copy-2", "fault", "lazy-fault", "stale"})
DEFAULT_API_KEY_ENV = "SNAPCTL_API_KEY"
# The bundled fixture's retained memory when a lazy run is planned: enough to stay lazy (a
# process with less than tuning.EAGER_PROCESS_BELOW is restored eagerly), so that the lazy-fault
# run's daemon has pages left to serve and a lazy copy's memory is worth comparing. Plain runs
# keep the launch default (16 MiB), which keeps the image small.
LAZY_RETAINED_MB = 256


class QualificationError(SnapctlError):
    """The qualification could not be set up (bad run names, no image, no server command)."""


class QualificationFailed(SnapctlError):
    """At least one check failed; the report says which and what differed."""

    exit_status = ExitStatus.VERIFY_FAILED


@dataclass
class Plan:
    """What to qualify and how."""

    options: LaunchOptions
    criu: CriuBinary
    native: NativeStep
    state: StateDir = field(default_factory=StateDir)
    runs: tuple[str, ...] = DEFAULT_RUNS
    image: Path | None = None
    report_dir: Path | None = None
    fault_mode: FaultMode = "auto"
    lazy: bool = False  # restore copy-1 and copy-2 with lazy pages
    # The bundled fixture's retained memory (None: LAZY_RETAINED_MB when a lazy run is planned,
    # else the launch default).
    retained_mb: int | None = None
    # False: qualify without an API key, by request (--no-api-key): none is given to the server
    # or sent, and the key checks are skipped (the report says so).
    api_key: bool = True


def default_runs(lazy: bool) -> tuple[str, ...]:
    """Every run; the lazy-pages daemon fault only when the copies are lazy."""
    return LAZY_DEFAULT_RUNS if lazy else DEFAULT_RUNS


def parse_runs(text: str | None, *, lazy: bool = False) -> tuple[str, ...]:
    """``donor,copy-1`` → the named runs in their fixed order; unknown names are refused.
    None: the default runs (with ``lazy``, the lazy-pages daemon fault too)."""
    if text is None:
        return default_runs(lazy)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(RUN_ORDER))
    if unknown or not names:
        raise QualificationError(
            f"unknown run {unknown[0]!r}" if unknown else "no run named",
            phase=HostPhase.PLAN,
        )
    return tuple(name for name in RUN_ORDER if name in names)


@contextlib.contextmanager
def api_key(options: LaunchOptions, *, required: bool = True) -> Iterator[str]:
    """Make sure the runs have an API key: generate one when none is configured; yield how a
    server started without it is given it (see :func:`keyless_hint`). Not ``required``
    (``--no-api-key``): no key at all."""
    if not required:
        options.api_key_env = None
        yield ""
        return
    if options.api_key_env is None:
        options.api_key_env = DEFAULT_API_KEY_ENV
    variable = options.api_key_env
    generated = not os.environ.get(variable)
    if generated:
        os.environ[variable] = secrets.token_urlsafe(24)
    try:
        yield keyless_hint(variable, generated)
    finally:
        if generated:
            os.environ.pop(variable, None)


def keyless_hint(variable: str, generated: bool) -> str:
    """What the API key check's failure tells about a server started without a key."""
    where = ", generated for this qualification" if generated else ""
    return (
        f"Qualification's key is in ${variable}{where}, which the server gets in its "
        "environment and must read its key from: name the variable your server reads with "
        "--api-key-env VAR (vLLM: --api-key-env VLLM_API_KEY), or qualify it without a key "
        "on purpose with --no-api-key"
    )


def _image_for(plan: Plan, work: Path) -> Path:
    if "donor" in plan.runs or not IMAGE_RUNS & set(plan.runs):
        return (plan.image or work / "image").absolute()
    if plan.image is None:
        raise QualificationError(
            "without the donor run, --image must name an existing image", phase=HostPhase.PLAN
        )
    load_manifest(plan.image)  # refuse early a path that is no published image
    return plan.image.absolute()


def retained_mb_for(plan: Plan) -> int:
    """The bundled fixture's retained memory for this plan (see :data:`LAZY_RETAINED_MB`)."""
    if plan.retained_mb is not None:
        return plan.retained_mb
    if plan.lazy or LAZY_RUNS & set(plan.runs):
        return LAZY_RETAINED_MB
    return plan.options.fixture_retained_mb


def qualify(plan: Plan, progress: Progress) -> Report:
    """Run the plan's runs in order and return the report (written when ``report_dir``)."""
    started = time.monotonic()
    plan.options.fixture_retained_mb = retained_mb_for(plan)
    plan.state.ensure()
    become_subreaper()
    work = plan.state.root / "qualify" / uuid.uuid4().hex[:12]
    work.mkdir(parents=True, mode=0o700)
    try:
        image = _image_for(plan, work)
        artifacts = None if plan.report_dir is None else plan.report_dir.absolute() / "runs"
        with api_key(plan.options, required=plan.api_key) as hint:
            ctx = RunContext(
                options=plan.options, criu=plan.criu, native=plan.native, state=plan.state,
                image=image, work=work, progress=progress, artifacts=artifacts, lazy=plan.lazy,
                check_api_key=plan.api_key, keyless_hint=hint,
            )  # fmt: skip
            argv, cwd = _server(plan, image)
            results = _run_all(plan, ctx, argv, cwd)
        image_id = None
        with contextlib.suppress(SnapctlError):
            image_id = load_manifest(image).image_id
        report = Report(
            created=now(),
            environment=environment(
                plan.criu,
                plan.native.name,
                image if plan.image is not None else Path("(temporary, removed)"),
                image_id,
                redact_argv(argv),
                is_fixture(argv),
                api_key_checked=plan.api_key,
            ),
            runs=results,
            wall_s=round(time.monotonic() - started, 3),
        )
        if plan.report_dir is not None:
            write_report(report, plan.report_dir)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _server(plan: Plan, image: Path) -> tuple[list[str], Path]:
    """The server command (without the capture flag) and its cwd, for the reference."""
    if plan.options.server_argv or "donor" in plan.runs or not IMAGE_RUNS & set(plan.runs):
        return server_command(plan.options, plan.state)
    manifest = load_manifest(image)
    if SERVING_RUNS & set(plan.runs):
        return server_from_manifest(manifest)
    # Nothing is started from it: it is only named in the report.
    return list(manifest.server_argv), Path(manifest.server_cwd)


def _run_all(plan: Plan, ctx: RunContext, argv: list[str], cwd: Path) -> list[RunResult]:
    results: list[RunResult] = []
    if SERVING_RUNS & set(plan.runs):
        ctx.progress("computing the model file's parameter digests")
        ctx.model_digests = model_file_digests(argv)
        ctx.progress("reference: ordinary start")
        results.append(run_reference(ctx, argv, cwd))
    for name in plan.runs:
        ctx.progress(f"{name}: starting")
        started = time.monotonic()
        try:
            found = _perform(name, plan, ctx)
        except Exception as error:  # a run's own bug must not hide the others' evidence
            detail = f"{type(error).__name__}: {error}"
            found = [RunResult(
                name=name, kind=_KINDS[name], checks=[checks.check_completed(detail)],
                wall_s=time.monotonic() - started,
            )]  # fmt: skip
        results.extend(found)
        if name == "donor" and not (ctx.image / MANIFEST_NAME).exists():
            break  # no image was published: nothing else can run
    return results


_KINDS: dict[str, RunKind] = {
    "donor": "donor",
    "criu-restore-fault": "criu-restore-fault",
    "copy-1": "copy",
    "copy-2": "copy",
    "fault": "fault",
    "lazy-fault": "lazy-fault",
    "stale": "stale",
    "criu-dump-fault": "criu-dump-fault",
}


def _perform(name: str, plan: Plan, ctx: RunContext) -> list[RunResult]:
    """Perform the run called ``name`` (one result, or two for ``stale``)."""
    if name == "donor":
        return [run_donor(ctx)]
    if name.startswith("copy-"):
        return [run_copy(ctx, name)]
    if name == "fault":
        return [run_fault(ctx, plan.fault_mode)]
    if name == "lazy-fault":
        return [run_lazy_fault(ctx)]
    if name == "stale":
        return run_stale(ctx)
    if name == "criu-restore-fault":
        return [run_criu_restore_fault(ctx)]
    if name == "criu-dump-fault":
        return [run_criu_dump_fault(ctx)]
    raise QualificationError(f"unknown run {name!r}", phase=HostPhase.PLAN)


def require_passed(report: Report) -> None:
    """Raise :class:`QualificationFailed` naming the first failed check, if any failed."""
    failures = report.failures()
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise QualificationFailed(f"qualification failed: {failures[0]}{more}")
    if not report.runs:
        raise QualificationFailed("qualification ran nothing")
