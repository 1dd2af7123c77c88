"""``snapctl ps``, ``snapctl stop`` and ``snapctl logs``: activations from their records."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from snapctl.cli._activation_options import check_name_option
from snapctl.cli.output import emit_json, json_option, stdout

if TYPE_CHECKING:
    from snapctl.statedir import ActivationRecord


@click.command()
@json_option
def ps(as_json: bool) -> None:
    """List running activations."""
    from snapctl.statedir import StateDir
    from snapctl.supervision.process import is_same_process

    rows = []
    for record in StateDir().load_records():
        alive = is_same_process(record.root_pid, record.root_start_time)
        supervised = is_same_process(record.supervisor_pid, record.supervisor_start_time)
        rows.append({**record.model_dump(mode="json"), "running": alive, "supervised": supervised})
    if as_json:
        emit_json(rows)
        return
    from rich.table import Table

    table = Table("name", "kind", "root pid", "port", "published", "running", "pages", "image")
    for row in rows:
        running = "yes" if row["running"] else "no"
        if row["running"] and not row["supervised"]:
            running = "yes, unsupervised (snapctl gc)"
        table.add_row(
            row["name"], row["kind"], str(row["root_pid"]), str(row["port"]),
            row["published"] or "-", running, _pages(row), row["image"] or "-",
        )  # fmt: skip
    stdout().print(table)


def _pages(row: dict[str, object]) -> str:
    """A lazy copy's memory: "transferring", or complete and how long after its restore."""
    if row["pages_complete"] is None:
        return "-"
    if not row["pages_complete"]:
        return "transferring"
    return f"complete ({row['pages_complete_s']:.2f} s)"


def _find(name: str) -> ActivationRecord:
    from snapctl.errors import SnapctlError
    from snapctl.statedir import StateDir

    for record in StateDir().load_records():
        if name in (record.name, record.activation_id):
            return record
    raise SnapctlError(f"no activation named {name!r} (see snapctl ps)")


@click.command()
@click.argument("name", callback=check_name_option)
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")  # fmt: skip
@json_option
def stop(name: str, timeout_s: float, as_json: bool) -> None:
    """Stop an activation and clean up after it."""
    from snapctl.activation.supervise import stop_recorded
    from snapctl.errors import SnapctlError
    from snapctl.statedir import StateDir

    record = _find(name)
    how, audit = stop_recorded(record, StateDir(), timeout_s)
    if as_json:
        emit_json({"name": record.name, "stopped": how, "audit": audit.model_dump()})
    else:
        stdout().print(f"{record.name}: {how}; cleanup: {audit.describe()}", markup=False)
    if not audit.clean:
        raise SnapctlError(f"cleanup incomplete after stopping {record.name}: {audit.describe()}")


@click.command()
@click.argument("name", callback=check_name_option)
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing what the server writes until the activation stops.")  # fmt: skip
def logs(name: str, follow: bool) -> None:
    """Print an activation's server log."""
    import sys
    from pathlib import Path

    from snapctl.errors import SnapctlError
    from snapctl.statedir import ActivationRecord, StateDir

    state = StateDir()
    log = None
    record_path = None
    for record in state.load_records():
        if name in (record.name, record.activation_id):
            assert isinstance(record, ActivationRecord)
            log = Path(record.logs_dir) / "server.log"
            record_path = state.record_path(record.name)
    if log is None and (state.logs / name / "server.log").exists():
        log = state.logs / name / "server.log"  # a stopped activation, by id
    if log is None:
        raise SnapctlError(f"no activation named {name!r} (see snapctl ps)")
    if not log.exists():
        raise SnapctlError(f"{name} has no server log yet", path=log)
    if not follow or record_path is None:
        click.echo(log.read_text(errors="replace"), nl=False)
        return
    from snapctl.supervision.logs import follow_log

    def write(chunk: bytes) -> None:
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    record_exists = record_path.exists  # dropped when the activation stops
    follow_log(log, write, done=lambda: not record_exists())


@click.command()
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")  # fmt: skip
@json_option
def gc(timeout_s: float, as_json: bool) -> None:
    """Clean up activations whose snapctl process died.

    Also removes what killed snapctl processes left beside images (staging directories, old
    images moved aside) and in the state directory (records' .tmp files), only where no live
    process owns them.
    """
    from snapctl.activation.supervise import collect_garbage
    from snapctl.errors import SnapctlError
    from snapctl.statedir import StateDir

    report = collect_garbage(StateDir(), timeout_s)
    if as_json:
        emit_json(report)
    else:
        for entry in report.activations:
            names = ", ".join(entry.names) or "unnamed"
            stdout().print(
                f"{entry.activation_id} ({names}): ended {len(entry.processes_ended)} "
                f"process(es); cleanup: {entry.audit.describe()}", markup=False,
            )  # fmt: skip
        for path in report.removed:
            stdout().print(f"removed {path}", markup=False)
        if not report.activations and not report.removed:
            stdout().print("nothing to clean up")
    dirty = [entry.activation_id for entry in report.activations if not entry.audit.clean]
    if dirty:
        raise SnapctlError(f"cleanup incomplete for {', '.join(dirty)}")
