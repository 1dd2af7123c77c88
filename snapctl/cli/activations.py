"""``snapctl ps``, ``stop``, ``logs`` and ``gc``: activations from their records, in this
process or through the agent (:mod:`snapctl.cli.remote`), with the same output either way.

Light at import (click and :mod:`snapctl.plain`): ``snapctl ps`` through the agent imports
neither rich nor pydantic nor psutil.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from snapctl.cli._activation_options import check_name_option
from snapctl.cli.remote import agent_client, call
from snapctl.plain import PS_COLUMNS, audit_clean, describe_audit, emit_json, print_table
from snapctl.plain import ps_rows as _ps_rows


def json_option(function: Any) -> Any:
    """The shared ``--json`` flag (as :func:`snapctl.cli.output.json_option`, without its
    imports)."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON object on stdout instead of a table; no progress output.",
    )(function)


@click.command()
@json_option
def ps(as_json: bool) -> None:
    """List running activations."""
    client = agent_client()
    if client is None:
        from snapctl.statedir import StateDir
        from snapctl.supervision.listing import activation_rows

        rows = activation_rows(StateDir())
    else:
        rows = call(client, "GET", "/activations")
    if as_json:
        emit_json(rows)
        return
    print_table(PS_COLUMNS, _ps_rows(rows))


@click.command()
@click.argument("name", callback=check_name_option)
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")  # fmt: skip
@json_option
def stop(name: str, timeout_s: float, as_json: bool) -> None:
    """Stop an activation and clean up after it.

    One still starting (its name reserved, no record yet) is interrupted: its start stops
    what it started.
    """
    from snapctl.errors import SnapctlError

    client = agent_client()
    if client is None:
        from snapctl.activation.supervise import stop_named
        from snapctl.statedir import StateDir

        stopped_name, how, audit = stop_named(StateDir(), name, timeout_s)
        answer: dict[str, Any] = {
            "name": stopped_name, "stopped": how, "audit": audit.model_dump()
        }  # fmt: skip
    else:
        answer = call(client, "POST", f"/activations/{quote(name)}/stop", {"timeout_s": timeout_s})
    stopped, audit_record = answer["name"], answer["audit"]
    if as_json:
        emit_json(answer)
    else:
        click.echo(f"{stopped}: {answer['stopped']}; cleanup: {describe_audit(audit_record)}")
    if not audit_clean(audit_record):
        raise SnapctlError(
            f"cleanup incomplete after stopping {stopped}: {describe_audit(audit_record)}"
        )


@click.command()
@click.argument("name", callback=check_name_option)
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing what the server writes until the activation stops.")  # fmt: skip
def logs(name: str, follow: bool) -> None:
    """Print an activation's server log."""
    import io
    import sys

    if isinstance(sys.stdout, io.TextIOWrapper):
        # A log is any bytes; a terminal or pipe whose encoding lacks one of its characters
        # (or U+FFFD) still shows the rest, as a raw copy of the bytes would.
        sys.stdout.reconfigure(errors="replace")
    client = agent_client()
    if client is not None:
        target = f"/activations/{quote(name)}/logs" + ("?follow=1" if follow else "")
        from snapctl.agent.client import READ_TIMEOUT_S
        from snapctl.cli.remote import raise_for

        # Following, silence is no failure: the server may print nothing for hours.
        timeout_s = None if follow else READ_TIMEOUT_S
        for message in client.stream("GET", target, read_timeout_s=timeout_s):
            if "error" in message:  # the follow failed after it began
                raise_for(message)
            sys.stdout.write(message["text"])
            sys.stdout.flush()
        return

    from snapctl.statedir import StateDir

    log, record_path = StateDir().server_log(name)
    from snapctl.supervision.logs import pass_log

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if not follow or record_path is None:
        pass_log(log, write)
    else:
        record_exists = record_path.exists  # dropped when the activation stops
        pass_log(log, write, done=lambda: not record_exists())


@click.command()
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")  # fmt: skip
@json_option
def gc(timeout_s: float, as_json: bool) -> None:
    """Clean up activations whose snapctl process died.

    Also removes what killed snapctl processes left beside images (staging directories, old
    images moved aside) and in the state directory (records' .tmp files), only where no live
    process owns them. Activations still starting are listed and left alone.
    """
    from snapctl.errors import SnapctlError

    client = agent_client()
    if client is None:
        from snapctl.gc import collect_garbage
        from snapctl.statedir import StateDir

        report = collect_garbage(StateDir(), timeout_s).model_dump(mode="json")
    else:
        report = call(client, "POST", "/gc", {"timeout_s": timeout_s})
    if as_json:
        emit_json(report, sort_keys=False)
    else:
        for entry in report["activations"]:
            names = ", ".join(entry["names"]) or "unnamed"
            click.echo(
                f"{entry['activation_id']} ({names}): ended {len(entry['processes_ended'])} "
                f"process(es); cleanup: {describe_audit(entry['audit'])}"
            )
        for path in report["removed"]:
            click.echo(f"removed {path}")
        # An agent older than this field sends none.
        for name in report.get("starting", []):
            click.echo(f"{name}: starting (not garbage, left alone; `snapctl stop {name}` "
                       "stops it)")  # fmt: skip
        if not report["activations"] and not report["removed"] and not report.get("starting"):
            click.echo("nothing to clean up")
    dirty = [entry["activation_id"] for entry in report["activations"]
             if not audit_clean(entry["audit"])]  # fmt: skip
    if dirty:
        raise SnapctlError(f"cleanup incomplete for {', '.join(dirty)}")
