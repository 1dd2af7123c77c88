"""Running an activation from the CLI: progress, the report, foreground or detached."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from snapctl.cli.output import emit_json, note, stderr, stdout

Progress = Callable[[str], None]


def render_report(report: Any) -> None:
    from rich.table import Table

    table = Table(title=f"{report.kind} {report.name}", show_header=False)
    table.add_row("activation", report.activation_id)
    if report.image:
        table.add_row("image", f"{report.image} ({report.image_id})")
    table.add_row("root pid", str(report.root_pid))
    table.add_row("serving", f"{report.host}:{report.port} (inside its netns)")
    table.add_row("published", report.published or "-")
    table.add_row("logs", report.logs)
    for phase, seconds in report.timings_s.items():
        table.add_row(f"time {phase}", f"{seconds * 1000:.1f} ms")
    if report.dump_stats is not None:
        stats = report.dump_stats
        table.add_row("criu frozen", f"{stats.frozen_time_us / 1000:.1f} ms")
        table.add_row("pages written", str(stats.pages_written))
    stdout().print(table)


def serve(start: Callable[[Progress], tuple[Any, Any]], *, as_json: bool, detach: bool) -> None:
    """Start (with progress), print the report, then supervise or hand over to a supervisor."""
    from snapctl.activation.supervise import detach as detach_supervisor
    from snapctl.activation.supervise import run_until_stopped

    def progress(step: str) -> None:
        note(f"• {step}", quiet=as_json)

    if detach:
        # The child supervises; the parent prints the child's report and exits there.
        child = detach_supervisor(lambda: start(lambda step: None))
        assert child is not None
        session, _ = child
        run_until_stopped(session)
        return
    session, report = start_interruptible(progress, start)
    if as_json:
        emit_json(report)
    else:
        render_report(report)
        stderr().print("serving; press Ctrl-C to stop", style="dim")
    how, audit = run_until_stopped(session)
    if not as_json:
        style = "green" if audit.clean else "bold red"
        stderr().print(f"stopped ({how}); cleanup: {audit.describe()}", style=style)


def start_interruptible(
    progress: Progress, start: Callable[[Progress], tuple[Any, Any]]
) -> tuple[Any, Any]:
    """Run ``start`` with SIGTERM raising KeyboardInterrupt, so a stop request during launch or
    restore still runs the cleanup of whatever was started (the default action would not)."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return start(progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
