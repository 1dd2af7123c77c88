"""``snapctl doctor``: render :func:`snapctl.doctor.run_doctor` as a table or one JSON record."""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from snapctl.cli.output import emit_json, json_option, status, stderr, stdout
from snapctl.doctor import DoctorReport, run_doctor
from snapctl.errors import ExitStatus

_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}


def render(report: DoctorReport) -> Table:
    """The report as a rich table: one row per check, the fix hint under its detail."""
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for check in report.checks:
        detail = Text(check.detail)
        if check.fix:
            detail.append(f"\nfix: {check.fix}", style="dim")
        table.add_row(check.name, Text(check.status, style=_STYLES[check.status]), detail)
    return table


@click.command()
@click.option(
    "--criu",
    "criu_path",
    metavar="PATH",
    help="CRIU binary to check (default: $SNAPCTL_CRIU, the snapctl prefix, then PATH).",
)
@json_option
@click.pass_context
def doctor(ctx: click.Context, criu_path: str | None, as_json: bool) -> None:
    """Check that this machine can capture and restore with CRIU.

    Exits non-zero when capture cannot work here (no usable CRIU, `criu check` fails, not root,
    missing capabilities or namespaces); warnings only degrade optional features.
    """
    with status("checking this machine", quiet=as_json):
        report = run_doctor(criu_path)
    if as_json:
        emit_json(report)
    else:
        stdout().print(render(report))
    if not report.ready:
        stderr().print(
            Text(f"error: capture cannot work here: {', '.join(report.failed)} failed"),
            style="bold red",
            soft_wrap=True,
        )
        ctx.exit(ExitStatus.ERROR)
