"""``snapctl bake``: capture a server into an image without ever activating it, then stop the
original tree and audit the cleanup. The image is the same as a donor capture's."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep
from snapctl.activation.tools import REAL_TOOLS, Tools
from snapctl.criu import CriuBinary
from snapctl.criu.stats import DumpStats
from snapctl.images import load_manifest
from snapctl.progress import Progress
from snapctl.statedir import StateDir


class BakeReport(BaseModel):
    """The machine-readable record of a bake (``--json``)."""

    model_config = ConfigDict(extra="forbid")

    image: str
    image_id: str
    image_bytes: int
    files: int
    processes: int
    identity_files: int
    dump_stats: DumpStats
    timings_s: dict[str, float]
    logs: str
    stopped: str
    cleanup: str
    clean: bool


def bake_image(
    options: LaunchOptions,
    *,
    image: Path,
    force: bool,
    criu: CriuBinary,
    native: NativeStep,
    state: StateDir,
    progress: Progress,
    tools: Tools = REAL_TOOLS,
) -> BakeReport:
    """Launch → capture-ready → dump → publish → stop the original (never activated, so it
    never binds a public socket) → audit. A failure up to publication leaves nothing published
    or running; after it the image stays, and ``clean`` says whether the stop left anything."""
    session, report = start_donor(
        options, image=image, force=force, criu=criu, native=native, publish=None,
        state=state, progress=progress, activate_donor=False, tools=tools,
    )  # fmt: skip
    progress("stopping the original tree (it was never activated)")
    started = tools.clock()
    how, audit = session.stop()
    timings = dict(report.timings_s)
    timings["stop"] = round(tools.clock() - started, 6)
    published = Path(report.image or image)
    manifest = load_manifest(published)
    assert manifest.identity is not None  # a capture always records it
    return BakeReport(
        image=str(published),
        image_id=manifest.image_id,
        image_bytes=manifest.total_bytes,
        files=len(manifest.files),
        processes=len(manifest.process_tree),
        identity_files=len(manifest.identity.files),
        dump_stats=manifest.dump_stats,
        timings_s=timings,
        logs=report.logs,
        stopped=how,
        cleanup=audit.describe(),
        clean=audit.clean,
    )
