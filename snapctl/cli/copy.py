"""``snapctl copy``: restore a copy of an image and serve it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from snapctl.cli._activation_options import CommonOptions, activation_options
from snapctl.cli.serving import Progress, serve


@click.command()
@click.option(
    "--image",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A published image directory.",
)
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Restore this many copies at once (published ports count up).",
)
@activation_options
def copy(image: Path, count: int, common: CommonOptions) -> None:  # fmt: skip
    """Restore a copy of an image and serve it."""
    from snapctl.activation.copy import start_copy
    from snapctl.activation.launch import LaunchOptions
    from snapctl.activation.native import native_step
    from snapctl.criu import find_criu
    from snapctl.supervision.state import StateDir

    options = LaunchOptions(
        name=common.name,
        host=common.host,
        port=common.port,
        api_key_env=common.api_key_env,
        timeout_s=common.timeout_s,
    )
    criu = find_criu(common.criu_path)
    native = native_step(common.native)

    if count > 1:
        serve_many(image, options, count, criu, native, common)
        return

    def start(progress: Progress) -> tuple[Any, Any]:
        return start_copy(
            image, options, criu=criu, native=native, publish=common.publish,
            state=StateDir(), progress=progress,
        )  # fmt: skip

    serve(start, as_json=common.as_json, detach=common.detach)


def serve_many(
    image: Path, options: Any, count: int, criu: Any, native: Any, common: CommonOptions
) -> None:
    """``--count N``: restore N copies at once, report each and the total, then supervise."""
    import time

    from snapctl.activation.copy import start_copies
    from snapctl.activation.supervise import run_all_until_stopped
    from snapctl.cli.output import emit_json, note, stderr
    from snapctl.errors import SnapctlError
    from snapctl.supervision.state import StateDir

    if common.detach:
        raise click.UsageError("--count with --detach is not supported yet; detach one at a time")
    started = time.monotonic()
    results = start_copies(
        image, options, count, criu=criu, native=native, publish_base=common.publish,
        state=StateDir(), progress=lambda step: note(f"• {step}", quiet=common.as_json),
    )  # fmt: skip
    total_s = time.monotonic() - started
    sessions = [result[0] for result in results if isinstance(result, tuple)]
    failures = [str(result) for result in results if isinstance(result, SnapctlError)]
    record = {
        "copies": [r[1].model_dump(mode="json") for r in results if isinstance(r, tuple)],
        "failures": failures,
        "total_s": round(total_s, 6),
    }
    if common.as_json:
        emit_json(record)
    else:
        for result in results:
            if isinstance(result, tuple):
                report = result[1]
                line = f"{report.name}: ready in {sum(report.timings_s.values()):.3f} s"
                stderr().print(f"{line}, published {report.published or '-'}")
        stderr().print(f"{len(sessions)}/{count} copies ready in {total_s:.3f} s")
    if failures:
        for session in sessions:
            session.stop()
        raise SnapctlError(f"{len(failures)} of {count} copies failed: {failures[0]}")
    run_all_until_stopped(sessions)
