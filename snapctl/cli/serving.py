"""Running activations from the CLI: progress, reports, foreground or detached supervision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from snapctl.phases import HostPhase
from snapctl.progress import Progress

# snapctl.cli.output (rich, pydantic) is imported where it is used: `copy --help` and
# `donor --help` import this module and must stay fast.


POOLED = "yes (verify to restore ran while it was parked)"


def render_report(report: Any) -> None:
    from rich.table import Table

    from snapctl.cli.output import stdout

    table = Table(title=f"{report.kind} {report.name}", show_header=False)
    table.add_row("activation", report.activation_id)
    if report.image:
        table.add_row("image", f"{report.image} ({report.image_id})")
    table.add_row("root pid", str(report.root_pid))
    table.add_row("serving", f"{report.host}:{report.port} (inside its netns)")
    table.add_row("published", report.published or "-")
    table.add_row("logs", report.logs)
    if report.kind == "copy":
        # A pooled copy's phases up to its restore ran while it was parked, not for this request.
        table.add_row("from pool", POOLED if report.from_pool else "no (restored for this request)")
    for phase, seconds in report.timings_s.items():
        table.add_row(f"time {phase}", f"{seconds * 1000:.1f} ms")
    if report.lazy:
        pages = "complete" if report.pages_complete else "transferring in the background"
        table.add_row("pages (lazy)", pages)
    if report.dump_stats is not None:
        stats = report.dump_stats
        table.add_row("criu frozen", f"{stats.frozen_time_us / 1000:.1f} ms")
        table.add_row("pages written", str(stats.pages_written))
    stdout().print(table)


def render_copies(reports: list[Any], total_s: float) -> None:
    """One row per copy with its phase times, and the total wall time of the whole start."""
    from rich.table import Table

    from snapctl.cli.output import stdout

    phases = list(dict.fromkeys(phase for report in reports for phase in report.timings_s))
    table = Table(title=f"{len(reports)} copies ready in {total_s * 1000:.0f} ms")
    for column in ("copy", "published", *phases, "sum"):
        table.add_column(column, justify="left" if column in ("copy", "published") else "right")
    for report in reports:
        times = [report.timings_s.get(phase) for phase in phases]
        cells = ["-" if t is None else f"{t * 1000:.0f} ms" for t in times]
        total = sum(t for t in times if t is not None)
        table.add_row(report.name, report.published or "-", *cells, f"{total * 1000:.0f} ms")
    stdout().print(table)


def serve(start: Callable[[Progress], tuple[Any, Any]], *, as_json: bool, detach: bool) -> None:
    """Start (with progress), print the report, then supervise or hand over to a supervisor."""
    from snapctl.activation.core import ActivationReport

    if detach:
        run_detached(
            lambda progress_for: start(progress_for("")),
            as_json=as_json,
            show=lambda record: render_report(ActivationReport.model_validate(record)),
        )
        return
    run_in_foreground(lambda steps: start(steps), as_json=as_json, show=render_report)


def serve_copies(
    start: Callable[[Callable[[str], Progress]], tuple[list[Any], Any]], *, as_json: bool,
    detach: bool,
) -> None:  # fmt: skip
    """Start copies (``start(progress_for)``: one, or ``--count N``, each on its lane), print
    the report (of several: one row per copy and the total), then supervise or hand over to a
    supervisor."""
    from snapctl.activation.copy import CopiesReport
    from snapctl.activation.core import ActivationReport

    def show(report: ActivationReport | CopiesReport) -> None:
        if isinstance(report, CopiesReport):
            render_copies(report.copies, report.total_s)
        else:
            render_report(report)

    if detach:
        run_detached(
            start,
            as_json=as_json,
            show=lambda record: show(
                CopiesReport.model_validate(record)
                if "copies" in record
                else ActivationReport.model_validate(record)
            ),
        )
        return
    run_in_foreground(lambda steps: start(steps.lane), as_json=as_json, show=show)


def run_in_foreground(
    start: Callable[[Any], tuple[Any, Any]], *, as_json: bool, show: Callable[[Any], None]
) -> None:
    """Start (``start(steps)``: one session or a list, and the report), print the report
    (``show``, or one JSON line), then supervise until Ctrl-C, SIGTERM or every tree exited.

    No interrupt leaves an activation running: :class:`StopSignals` holds SIGINT and SIGTERM
    from before the start until everything stopped (while starting, the first one interrupts
    the start, whose cleanup runs; after, they request the stop), and whatever this process
    started and did not stop is stopped on the way out, however it goes out.
    """
    from snapctl.cli.output import Steps, emit_json
    from snapctl.supervision.signals import StopSignals, stop_all_tracked

    with StopSignals() as signals:
        try:
            with Steps(quiet=as_json) as steps:
                supervised, report = start(steps)
            signals.started()
            sessions = supervised if isinstance(supervised, list) else [supervised]
            if as_json:
                emit_json(report)
            else:
                show(report)
            wait_and_stop(sessions, as_json=as_json, stop=signals.requested)
        finally:
            signals.cleaning()
            stop_all_tracked()


def run_detached(
    start: Callable[[Callable[[str], Progress]], tuple[Any, Any]],
    *,
    as_json: bool,
    show: Callable[[dict[str, Any]], None],
) -> None:
    """Start in a forked supervisor that outlives this command. Here: its progress, then its
    report (``show``, or one JSON line with ``--json``). There: supervise until stopped."""
    from snapctl.activation.supervise import InSupervisor, detach, run_all_until_stopped
    from snapctl.cli.output import Steps, emit_json
    from snapctl.supervision.signals import stop_all_tracked

    with Steps(quiet=as_json) as steps:
        outcome = detach(start, on_progress=lambda lane, step: steps.lane(lane)(step))
    if isinstance(outcome, InSupervisor):
        supervised = outcome.supervised
        sessions = supervised if isinstance(supervised, list) else [supervised]
        try:
            run_all_until_stopped(sessions, stop=outcome.stop)
        finally:
            stop_all_tracked()
    elif as_json:
        emit_json(outcome)
    else:
        show(outcome)
        stderr_line("running detached: `snapctl ps` lists it, `snapctl stop NAME` stops it", "dim")


def wait_and_stop(sessions: list[Any], *, as_json: bool, stop: Any) -> None:
    """Supervise in the foreground until ``stop`` is set (Ctrl-C, SIGTERM) or every tree
    exited, then report cleanup (see :func:`report_ended`)."""
    from snapctl.activation.supervise import run_all_until_stopped

    if not as_json:
        stderr_line("serving; press Ctrl-C to stop", "dim")
        for session in sessions:
            note_pages_complete(session)
    results = run_all_until_stopped(sessions, stop=stop)
    report_ended(
        [
            Ended(session.name, how, audit.model_dump(), session.failure)
            for session, (how, audit) in zip(sessions, results, strict=True)
        ],
        as_json=as_json,
    )


def note_pages_complete(session: Any) -> None:
    """For a lazy copy in the foreground: say on stderr when its last page arrived."""
    import threading

    if session.lazy is None:
        return

    def wait() -> None:
        status = session.lazy.wait()
        if status.state == "complete":
            stderr_line(pages_complete_note(session.name, status.complete_s), "dim")

    threading.Thread(target=wait, name="pages-note", daemon=True).start()


def pages_complete_note(name: str, complete_s: float) -> str:
    return f"{name}: pages complete {complete_s:.3f} s after its restore"


@dataclass(frozen=True)
class Ended:
    """How one activation of a foreground command ended: how its tree stopped, its cleanup
    audit (``CleanupAudit`` as JSON), and why it was stopped as unsafe (``Session.failure``)."""

    name: str
    stopped: str
    audit: dict[str, Any]
    failure: str | None = None


def report_ended(ended: list[Ended], *, as_json: bool) -> None:
    """The end of a foreground command, in-process or through the agent alike: a cleanup line
    per activation (not under ``--json``), then the command fails if one was stopped as unsafe
    (a lazy copy whose page transfer failed: its reason, phase lazy-pages) or, as ``snapctl
    stop`` does, if a cleanup is incomplete."""
    show_ended(ended, as_json=as_json)
    fail_if_ended_badly(ended)


def show_ended(ended: list[Ended], *, as_json: bool) -> None:
    """The cleanup lines of :func:`report_ended`."""
    from snapctl.plain import audit_clean, describe_audit

    if not as_json:
        for end in ended:
            style = "green" if audit_clean(end.audit) and not end.failure else "bold red"
            stderr_line(
                f"{end.name}: stopped ({end.stopped}); cleanup: {describe_audit(end.audit)}", style
            )


def fail_if_ended_badly(ended: list[Ended]) -> None:
    """The failure of :func:`report_ended`, if any."""
    from snapctl.errors import SnapctlError
    from snapctl.plain import audit_clean, describe_audit

    for end in ended:
        if end.failure is not None:
            raise SnapctlError(f"{end.name}: {end.failure}", phase=HostPhase.LAZY_PAGES)
    dirty = [f"{end.name}: {describe_audit(end.audit)}" for end in ended
             if not audit_clean(end.audit)]  # fmt: skip
    if dirty:
        raise SnapctlError(f"cleanup incomplete after stopping {'; '.join(dirty)}")


def stderr_line(text: str, style: str) -> None:
    """One line on stderr, in ``style`` on a terminal; elsewhere as it is (never wrapped)."""
    import sys

    if sys.stderr.isatty():
        from snapctl.cli.output import stderr

        stderr().print(text, style=style, markup=False, soft_wrap=True)
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
