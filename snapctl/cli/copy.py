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
@activation_options
def copy(image: Path, common: CommonOptions) -> None:  # fmt: skip
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

    def start(progress: Progress) -> tuple[Any, Any]:
        return start_copy(
            image, options, criu=criu, native=native, publish=common.publish,
            state=StateDir(), progress=progress,
        )  # fmt: skip

    serve(start, as_json=common.as_json, detach=common.detach)
