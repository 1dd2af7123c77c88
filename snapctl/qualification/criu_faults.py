"""The CRIU-level fault runs: CRIU failing under ``CRIU_FAULT`` at dump (no image may be
published and the donor must be stopped cleanly) and at restore (nothing may be left, and the
image must still restore)."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import time
from collections.abc import Iterator
from typing import Literal

from snapctl.activation.copy import start_copy
from snapctl.activation.donor import start_donor
from snapctl.errors import SnapctlError
from snapctl.images import load_manifest, verify_image
from snapctl.qualification import checks
from snapctl.qualification.runs import (
    PUBLISH_HOST,
    RunContext,
    RunResult,
    Timings,
    artifacts_dir,
    image_hashes,
    save_new_logs,
)
from snapctl.qualification.watch import Baseline, Residue, residue, take_baseline
from snapctl.qualification.workload import Client

CRIU_DUMP_FAULT = "1"  # CRIU's FI_DUMP_EARLY: the dump fails before writing an image
CRIU_RESTORE_FAULT = "4"  # opening a link remap fails on restore


@contextlib.contextmanager
def criu_fault(code: str) -> Iterator[None]:
    """Set ``CRIU_FAULT`` for the CRIU calls made inside the block (CRIU inherits our env)."""
    previous = os.environ.get("CRIU_FAULT")
    os.environ["CRIU_FAULT"] = code
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CRIU_FAULT", None)
        else:
            os.environ["CRIU_FAULT"] = previous


def run_criu_dump_fault(ctx: RunContext) -> RunResult:
    """A dump that fails (CRIU_FAULT=1) publishes no image and leaves the donor cleanly stopped."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    # The published image, when there is one, must not be touched by a failed capture.
    before = image_hashes(ctx.image) if ctx.image.exists() else None
    target = ctx.work / "dump-fault-image"
    error: str | None = None
    with criu_fault(CRIU_DUMP_FAULT):
        try:
            session, _ = start_donor(
                ctx.options, image=target, force=False, criu=ctx.criu, native=ctx.native,
                publish=None, state=ctx.state,
                progress=lambda step: ctx.progress(f"criu-dump-fault: {step}"),
                activate_donor=False,
            )  # fmt: skip
            session.stop()
            shutil.rmtree(target, ignore_errors=True)
        except SnapctlError as failure:
            error = failure.message
    res = residue(ctx.state, baseline)
    staging = sorted(str(p) for p in target.parent.glob(f".{target.name}.*"))
    found = [
        checks.check_failed_with(error, "no image published", "dump"),
        checks.check_not_published(target.exists(), staging, str(target)),
        checks.check_cleanup(None, res),
    ]
    if before is not None:
        found.append(checks.check_image_unchanged(before, image_hashes(ctx.image)))
    return _result(ctx, "criu-dump-fault", found, baseline, res, started)


def run_criu_restore_fault(ctx: RunContext) -> RunResult:
    """A restore that fails (CRIU_FAULT=4) leaves nothing, and the image still restores."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    before = image_hashes(ctx.image)
    manifest = load_manifest(ctx.image)
    error: str | None = None
    with criu_fault(CRIU_RESTORE_FAULT):
        try:
            session, _ = start_copy(
                ctx.image, ctx.options, criu=ctx.criu, native=ctx.native, publish=None,
                state=ctx.state,
                progress=lambda step: ctx.progress(f"criu-restore-fault: {step}"),
            )  # fmt: skip
            session.stop()
        except SnapctlError as failure:
            error = failure.message
    res = residue(ctx.state, baseline, manifest.shm_files)
    # The next restore: a full re-hash of the image, then a copy that answers HTTP 200.
    again_error: str | None = None
    evidence = ""
    timings = Timings()
    try:
        verify_image(ctx.image)
        session, report = start_copy(
            ctx.image, ctx.options, criu=ctx.criu, native=ctx.native,
            publish=(PUBLISH_HOST, 0), state=ctx.state,
            progress=lambda step: ctx.progress(f"criu-restore-fault: next restore: {step}"),
        )  # fmt: skip
        try:
            assert report.published is not None
            status, _ = Client(report.published, ctx.options.api_key).call("GET", "/v1/models")
        finally:
            stopped = time.monotonic()
            _, audit = session.stop()
            shutdown_s = time.monotonic() - stopped
        timings = Timings(
            restore_s=report.timings_s.get("restore"),
            handshake_s=report.timings_s.get("handshake"),
            validated_to_first_200_s=report.timings_s.get("validated_to_http_200"),
            shutdown_s=shutdown_s,
        )
        if status != 200:
            again_error = f"the next copy answered GET /v1/models with HTTP {status}"
        elif not audit.clean:
            again_error = f"the next copy left: {audit.describe()}"
        else:
            evidence = (
                f"every sha256 verified; the next copy restored in "
                f"{report.timings_s.get('restore', 0.0) * 1000:.0f} ms and answered 200"
            )
    except SnapctlError as failure:
        again_error = failure.message
    except (OSError, http.client.HTTPException) as failure:  # the next copy's HTTP answer
        again_error = f"GET /v1/models failed: {type(failure).__name__}: {failure}"
    found = [
        checks.check_failed_with(error, "criu restore failed", "restore"),
        checks.check_cleanup(None, res),
        checks.check_image_restores(again_error, evidence),
        checks.check_image_unchanged(before, image_hashes(ctx.image)),
    ]
    return _result(ctx, "criu-restore-fault", found, baseline, res, started, timings)


def _result(
    ctx: RunContext, run: Literal["criu-dump-fault", "criu-restore-fault"],
    found: list[checks.Check], baseline: Baseline, res: Residue, started: float,
    timings: Timings | None = None,
) -> RunResult:  # fmt: skip
    """A CRIU fault run's result. The failed activation never reached the run as a session, so
    every activation's logs are found by their log directories."""
    return RunResult(
        name=run,
        kind=run,
        activation_ids=save_new_logs(ctx, baseline, run),
        checks=found,
        timings=timings or Timings(),
        wall_s=time.monotonic() - started,
        residue=res,
        artifacts=artifacts_dir(ctx, run),
    )
