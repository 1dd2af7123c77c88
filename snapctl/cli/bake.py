"""``snapctl bake``: capture a server into an image without ever serving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from snapctl.cli._activation_options import (
    CommonOptions,
    ServerCommand,
    capture_options,
    shared_options,
    validated_request,
)
from snapctl.cli._server_env import ServerEnv, server_env_options
from snapctl.phases import HostPhase


@click.command(cls=ServerCommand)
@capture_options
@server_env_options
@shared_options(exclude=frozenset({"name", "publish", "expose", "detach"}))
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def bake(image: Path, force: bool, lo_addresses: tuple[str, ...], ready_timeout_s: float,
         server_timeout_s: float, server_cmd: tuple[str, ...], server_env: ServerEnv,
         common: CommonOptions) -> None:  # fmt: skip
    """Capture a server into an image without ever serving it.

    Launches SERVER_CMD (default: the bundled fixture) in fresh namespaces, waits until it is
    ready for capture, dumps it with CRIU, publishes the image with its identity record, then
    stops the original tree without activating it. --host/--port are what copies bind.

    When an agent runs (snapctl agent), it bakes in a supervisor of its own, in this
    command's working directory and environment.
    """
    from snapctl.cli.remote import agent_client

    client = agent_client()
    if client is not None:
        from snapctl.cli.remote import bake_through_agent, capture_request, namespace

        request = capture_request(image, force, lo_addresses, ready_timeout_s,
                                  server_timeout_s, server_cmd, common, donor=False,
                                  server_env=server_env)  # fmt: skip
        record = bake_through_agent(client, request, as_json=common.as_json)
        if common.as_json:
            from snapctl.plain import emit_json as emit_record

            emit_record(record, sort_keys=False)  # as the report model's own dump: field order
        else:
            render_bake(namespace(record))
        check_clean(record["clean"], record["cleanup"])
        return
    from snapctl.activation.bake import bake_image
    from snapctl.activation.native import native_step
    from snapctl.activation.requests import BakeRequest
    from snapctl.cli.output import Steps, emit_json
    from snapctl.cli.remote import capture_request
    from snapctl.criu import find_criu
    from snapctl.pool.identity import published_identity
    from snapctl.statedir import StateDir
    from snapctl.supervision.signals import StopSignals, stop_all_tracked

    body = capture_request(image, force, lo_addresses, ready_timeout_s, server_timeout_s,
                           server_cmd, common, donor=False, server_env=server_env)  # fmt: skip
    options = validated_request(BakeRequest, body).launch_options()
    before = published_identity(image)
    # SIGTERM as SIGINT: either interrupts the bake, whose cleanup stops what it launched.
    with StopSignals() as signals:
        interrupted = False
        try:
            with Steps(quiet=common.as_json) as steps:
                report = bake_image(
                    options, image=image, force=force, criu=find_criu(common.criu_path),
                    native=native_step(common.native), state=StateDir(), progress=steps,
                )  # fmt: skip
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            signals.cleaning()
            stop_all_tracked()
            if interrupted:
                _name_what_was_published(image, before)
    if common.as_json:
        emit_json(report)
    else:
        render_bake(report)
    check_clean(report.clean, report.cleanup)


def _name_what_was_published(image: Path, before: tuple[str, str] | None) -> None:
    """An interrupt that came after the bake published (its last milliseconds: the original
    tree's stop) still exits as interrupted, but says the image is there, as the agent's
    path says it (a user who saw only "interrupted" would take it for not published)."""
    from snapctl.cli import report_error
    from snapctl.errors import SnapctlError
    from snapctl.pool.identity import published_identity

    now = published_identity(image)
    if now is not None and now != before:
        report_error(
            SnapctlError(
                "interrupted while baking (SIGINT/SIGTERM), after it published "
                f"{image} ({now[0]}): remove it if it is not wanted",
                phase=HostPhase.CLEANUP,
            )
        )


def render_bake(report: Any) -> None:
    """The bake's table (``report``: the :class:`BakeReport`, or its JSON as attributes)."""
    from rich.table import Table

    from snapctl.cli.output import stdout

    table = Table(title=f"baked image {report.image_id}", show_header=False)
    table.add_row("image", report.image)
    table.add_row("size", f"{report.image_bytes / 1e6:.1f} MB in {report.files} files")
    table.add_row("processes", str(report.processes))
    table.add_row("identity", f"{report.identity_files} files outside the image recorded")
    table.add_row("criu frozen", f"{report.dump_stats.frozen_time_us / 1000:.1f} ms")
    for phase, seconds in report.timings_s.items():
        table.add_row(f"time {phase}", f"{seconds * 1000:.1f} ms")
    table.add_row("original", f"stopped ({report.stopped}); cleanup: {report.cleanup}")
    stdout().print(table)


def check_clean(clean: bool, cleanup: str) -> None:
    """A bake whose original tree's stop left something fails (its image stays published)."""
    from snapctl.errors import SnapctlError

    if not clean:
        raise SnapctlError(
            f"image published, but the original tree's cleanup left: {cleanup}",
            phase=HostPhase.CLEANUP,
        )
