"""``snapctl ps``, ``snapctl stop`` and ``snapctl logs``: activations from their records."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from snapctl.cli.output import emit_json, json_option, stdout

if TYPE_CHECKING:
    from snapctl.supervision.state import ActivationRecord


@click.command()
@json_option
def ps(as_json: bool) -> None:
    """List running activations."""
    import psutil

    from snapctl.supervision.state import StateDir

    rows = []
    for record in StateDir().load_records():
        try:
            started = psutil.Process(record.root_pid).create_time()
            alive = abs(started - record.root_start_time) < 0.05
        except psutil.NoSuchProcess:
            alive = False
        rows.append({**record.model_dump(mode="json"), "running": alive})
    if as_json:
        emit_json(rows)
        return
    from rich.table import Table

    table = Table("name", "kind", "root pid", "port", "published", "running", "image")
    for row in rows:
        table.add_row(
            row["name"], row["kind"], str(row["root_pid"]), str(row["port"]),
            row["published"] or "-", "yes" if row["running"] else "no", row["image"] or "-",
        )  # fmt: skip
    stdout().print(table)


def _find(name: str) -> ActivationRecord:
    from snapctl.errors import SnapctlError
    from snapctl.supervision.state import StateDir

    for record in StateDir().load_records():
        if name in (record.name, record.activation_id):
            return record
    raise SnapctlError(f"no activation named {name!r} (see snapctl ps)")


@click.command()
@click.argument("name")
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")  # fmt: skip
@json_option
def stop(name: str, timeout_s: float, as_json: bool) -> None:
    """Stop an activation and clean up after it."""
    from snapctl.activation.supervise import stop_recorded
    from snapctl.errors import SnapctlError
    from snapctl.supervision.state import StateDir

    record = _find(name)
    how, audit = stop_recorded(record, StateDir(), timeout_s)
    if as_json:
        emit_json({"name": record.name, "stopped": how, "audit": audit.model_dump()})
    else:
        stdout().print(f"{record.name}: {how}; cleanup: {audit.describe()}")
    if not audit.clean:
        raise SnapctlError(f"cleanup incomplete after stopping {record.name}: {audit.describe()}")


@click.command()
@click.argument("name")
def logs(name: str) -> None:
    """Print an activation's server log."""
    from pathlib import Path

    from snapctl.errors import SnapctlError
    from snapctl.supervision.state import ActivationRecord, StateDir

    state = StateDir()
    log = None
    for record in state.load_records():
        if name in (record.name, record.activation_id):
            assert isinstance(record, ActivationRecord)
            log = Path(record.logs_dir) / "server.log"
    if log is None and (state.logs / name / "server.log").exists():
        log = state.logs / name / "server.log"  # a stopped activation, by id
    if log is None:
        raise SnapctlError(f"no activation named {name!r} (see snapctl ps)")
    click.echo(log.read_text(errors="replace"), nl=False)
