"""``snapctl qualify``, ``snapctl fault`` and ``snapctl stale``: run qualification runs and
render their report (a table, or one JSON record); exit non-zero when any check failed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click
from click.core import ParameterSource

from snapctl.activation.timeouts import READY_TIMEOUT_S, SERVER_TIMEOUT_S
from snapctl.cli._activation_options import (
    ServerCommand,
    startup_timeout_options,
    timeout_option,
)
from snapctl.cli._server_env import ServerEnv, server_env_options
from snapctl.cli.output import emit_json, json_option, note, stderr, stdout
from snapctl.qualification.faultmodes import FAULT_MODES, FaultMode

if TYPE_CHECKING:
    from snapctl.qualification.report import Report

_image_option = click.option(
    "--image",
    type=click.Path(file_okay=False, path_type=Path),
    help="Image directory: published by the donor run (must not exist), or an existing image "
    "when the donor is not among the runs (default: a temporary one).",
)
_report_option = click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write report.json, report.md and each activation's control files and logs here.",
)
_common = [
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address the server binds inside its network namespace."),
    click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535),
                 help="Port the server binds inside its network namespace (the ordinary "
                      "reference must listen there too)."),
    click.option("--api-key-env", metavar="VAR",
                 help="Variable holding the API key (default SNAPCTL_API_KEY; generated when "
                      "unset); the server gets it and must read its key from it (vLLM: "
                      "VLLM_API_KEY)."),
    click.option("--no-api-key", "no_api_key", is_flag=True,
                 help="Qualify a server that takes no API key: none is given to it or sent, "
                      "and the key checks are skipped (the report says so)."),
    timeout_option,
    click.option("--criu", "criu_path", type=click.Path(dir_okay=False),
                 help="CRIU binary (default: $SNAPCTL_CRIU, /opt/snapctl/criu, PATH)."),
    click.option("--native", default="none", show_default=True,
                 type=click.Choice(["none", "cuda-checkpoint"]),
                 help="Device step around dump and restore."),
    _report_option,
    json_option,
]  # fmt: skip


def _with_common(function: Any) -> Any:
    for decorator in reversed(_common):
        function = decorator(function)
    return function


def _run(
    runs: str | None,
    *,
    image: Path | None,
    server_cmd: tuple[str, ...],
    host: str,
    port: int,
    api_key_env: str | None,
    no_api_key: bool,
    timeout_s: float,
    criu_path: str | None,
    native: str,
    report_dir: Path | None,
    as_json: bool,
    fault_mode: str = "auto",
    lazy: bool = False,
    retained_mb: int | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    server_timeout_s: float = SERVER_TIMEOUT_S,
    server_env: ServerEnv | None = None,
) -> None:
    from snapctl.activation.launch import LaunchOptions
    from snapctl.activation.native import native_step
    from snapctl.criu import find_criu
    from snapctl.qualification.suite import Plan, parse_runs, qualify, require_passed

    if no_api_key and api_key_env is not None:
        raise click.UsageError("--no-api-key qualifies without a key: drop --api-key-env")
    plan = Plan(
        options=LaunchOptions(
            server_argv=list(server_cmd) or None,
            host=host,
            port=port,
            api_key_env=api_key_env,
            timeout_s=timeout_s,
            ready_timeout_s=ready_timeout_s,
            server_timeout_s=server_timeout_s,
            env={} if server_env is None else dict(server_env.given),
            inherit_env=server_env is not None and server_env.inherit,
        ),
        criu=find_criu(criu_path),
        native=native_step(native),
        runs=parse_runs(runs, lazy=lazy),
        image=image,
        report_dir=report_dir,
        fault_mode=cast(FaultMode, fault_mode),
        lazy=lazy,
        retained_mb=retained_mb,
        api_key=not no_api_key,
    )
    report = qualify(plan, lambda step: note(f"• {step}", quiet=as_json))
    if as_json:
        emit_json(report)
    else:
        render(report, report_dir)
    require_passed(report)


def render(report: Report, report_dir: Path | None) -> None:
    from snapctl.qualification.report import render_table, render_timings

    stdout().print(render_table(report))
    stdout().print(render_timings(report))
    env = report.environment
    stderr().print(
        f"snapctl {env.snapctl_version}, CRIU {env.criu_version}, kernel {env.kernel}, "
        f"Python {env.python_version}, image {env.image_id or '-'}",
        style="dim",
    )
    if report_dir is not None:
        stderr().print(f"report: {report_dir / 'report.md'}", style="dim")


_fault_help = (
    "How the fault run breaks the weights for its activation: auto chooses by the image's memory "
    "policy (memory for in-image, changed where each reload compares digests, else unreadable); "
    "changed flips a byte of the weights file, unreadable hides it behind /dev/null, memory "
    "overwrites weights in the copy's memory."
)
_lazy_help = (
    "Restore copy-1 and copy-2 with lazy pages (each must also complete its pages and keep the "
    "donor's retained memory), and add the lazy-fault run."
)


@click.command(cls=ServerCommand)
@_image_option
@click.option("--runs", show_default="donor,criu-restore-fault,copy-1,copy-2,fault,stale,"
              "criu-dump-fault; lazy-fault too with --lazy",
              help="Runs to perform (always in the fixed order; the reference runs when a "
                   "serving run is named).")  # fmt: skip
@click.option("--fault", "fault_mode", default="auto", show_default=True,
              type=click.Choice(FAULT_MODES), help=_fault_help)  # fmt: skip
@click.option("--lazy", is_flag=True, help=_lazy_help)
@click.option("--retained-mb", type=click.IntRange(0), metavar="MIB",
              help="Retained memory of the bundled fixture the donor launches (default 16; "
                   "256 when a lazy run is planned).")  # fmt: skip
@startup_timeout_options
@server_env_options
@_with_common
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def qualify(image: Path | None, runs: str | None, fault_mode: str, lazy: bool,
            retained_mb: int | None, server_cmd: tuple[str, ...],
            **common: Any) -> None:  # fmt: skip
    """Qualify donor and copies against an ordinary start.

    Runs an ordinary reference start, the donor, two copies restored after it is gone, a
    recovery fault, stale control and CRIU faults; checks each and reports. Without
    SERVER_CMD (after --) the bundled fixture is qualified with a model it builds. With
    --lazy the copies are restored with lazy pages and a copy whose lazy-pages daemon is
    killed mid-transfer must fail closed.
    """
    if retained_mb is not None and server_cmd:
        raise click.UsageError("--retained-mb applies to the bundled fixture, not SERVER_CMD")
    _run(runs, image=image, server_cmd=server_cmd, fault_mode=fault_mode, lazy=lazy,
         retained_mb=retained_mb, **common)  # fmt: skip


@click.command()
@click.option("--image", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The published image to restore.")  # fmt: skip
@click.option("--fault", "fault_mode", default="auto", show_default=True,
              type=click.Choice(FAULT_MODES), help=_fault_help)  # fmt: skip
@click.option("--lazy", is_flag=True,
              help="Instead: restore a lazy copy and kill its lazy-pages daemon mid-transfer "
                   "(the lazy-fault run).")  # fmt: skip
@_with_common
@click.pass_context
def fault(ctx: click.Context, /, image: Path, fault_mode: str, lazy: bool, **common: Any) -> None:
    """Check that a copy whose recovery fails fails closed.

    Restores a copy from IMAGE whose weights are changed (in its files or its memory) or
    unreadable for that activation only, and expects error.json at recovery, no listener, the
    tree exiting, no leftovers.
    With --lazy, restores a lazy copy and kills its lazy-pages daemon while pages are still
    missing: the copy must be stopped at once and the failure reported, nothing left, and the
    image must still verify and be free.
    """
    if lazy and ctx.get_parameter_source("fault_mode") is not ParameterSource.DEFAULT:
        raise click.UsageError("--fault breaks the weights; it does not apply with --lazy")
    run = "lazy-fault" if lazy else "fault"
    _run(run, image=image, server_cmd=(), fault_mode=fault_mode, **common)


@click.command()
@click.option("--image", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The published image to restore.")  # fmt: skip
@_with_common
def stale(image: Path, **common: Any) -> None:
    """Check that copies given stale control fail closed.

    Restores two copies from IMAGE: one finds an earlier release.json and status.json, the
    other gets a release replayed from an earlier challenge; both must fail at the capture
    barrier.
    """
    _run("stale", image=image, server_cmd=(), **common)
