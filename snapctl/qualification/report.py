"""The qualification report: one strict model (``report.json``), its Markdown rendering
(``report.md``) and the terminal table a reviewer reads (check, result, evidence)."""

from __future__ import annotations

import datetime
import platform
import socket
from pathlib import Path
from typing import Literal

from rich.table import Table
from rich.text import Text

import snapctl
from snapctl.criu import CriuBinary
from snapctl.models import StrictModel
from snapctl.protocol.atomic import replace_file
from snapctl.qualification.runs import RunResult, Timings

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
_STYLES = {"passed": "green", "failed": "bold red", "skipped": "yellow"}
_TIMING_LABELS: dict[str, str] = {
    "launch_to_first_200_s": "launch → first 200 (ordinary)",
    "launch_to_capture_ready_s": "launch → capture-ready",
    "dump_s": "dump",
    "dump_frozen_s": "dump frozen (CRIU)",
    "native_checkpoint_s": "native checkpoint (before the dump)",
    "lazy_pages_start_s": "lazy-pages daemon listening (during restore)",
    "restore_s": "restore",
    "native_restore_s": "native restore (after the dump or restore)",
    "handshake_s": "handshake",
    "validated_to_first_200_s": "validated → first 200",
    "error_to_exit_s": "error.json → exit",
    "kill_to_exit_s": "daemon killed → copy gone",
    "shutdown_s": "shutdown",
}
_PAGES_LABEL = "restore → pages complete"


class Environment(StrictModel):
    """Where and with what the qualification ran, so two reports can be compared."""

    snapctl_version: str
    criu_version: str
    criu_path: str
    kernel: str
    python_version: str
    hostname: str
    machine: str
    native_step: str
    image_id: str | None
    image: str
    server_argv: list[str]
    fixture: bool
    # "checked", or "skipped by request (--no-api-key)": the server was qualified without a key.
    api_key: str = "checked"


class Report(StrictModel):
    """``report.json``: every run, check and figure of one qualification."""

    version: Literal[1] = 1
    created: str
    environment: Environment
    runs: list[RunResult]
    wall_s: float

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(run.passed for run in self.runs)

    def failures(self) -> list[str]:
        """``run: check: evidence`` for every failed check."""
        return [
            f"{run.name}: {check.name}: {check.evidence}"
            for run in self.runs
            for check in run.checks
            if check.failed
        ]

    def counts(self) -> dict[str, int]:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for run in self.runs:
            for check in run.checks:
                counts[check.status] += 1
        return counts


API_KEY_SKIPPED = "skipped by request (--no-api-key)"


def environment(
    criu: CriuBinary, native: str, image: Path, image_id: str | None, argv: list[str],
    fixture: bool, *, api_key_checked: bool = True,
) -> Environment:  # fmt: skip
    return Environment(
        snapctl_version=snapctl.__version__,
        criu_version=criu.version,
        criu_path=str(criu.path),
        kernel=platform.release(),
        python_version=platform.python_version(),
        hostname=socket.gethostname(),
        machine=platform.machine(),
        native_step=native,
        image_id=image_id,
        image=str(image),
        server_argv=argv,
        fixture=fixture,
        api_key="checked" if api_key_checked else API_KEY_SKIPPED,
    )


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _pages_complete_s(run: RunResult) -> float | None:
    return None if run.pages is None else run.pages.pages_complete_s


def _timing_rows(runs: list[RunResult]) -> tuple[list[str], list[list[str]]]:
    used = [
        name
        for name in Timings.model_fields
        if any(getattr(run.timings, name) is not None for run in runs)
    ]
    rows = [
        [_TIMING_LABELS[name], *(_ms(getattr(run.timings, name)) for run in runs)] for name in used
    ]
    if any(_pages_complete_s(run) is not None for run in runs):
        rows.append([_PAGES_LABEL, *(_ms(_pages_complete_s(run)) for run in runs)])
    return [run.name for run in runs], rows


def _run_label(run: RunResult) -> str:
    # The lazy-fault run is lazy by nature: only a lazy copy among plain ones needs the mark.
    return f"{run.name} (lazy)" if run.lazy and run.kind == "copy" else run.name


def describe_pages(run: RunResult) -> str | None:
    """One line on a lazy run's page transfer (None for a run without lazy pages)."""
    pages = run.pages
    if not run.lazy:
        return None
    if pages is None:
        return "lazy; no lazy-pages daemon was started"
    if pages.pages_complete:
        when = "already when" if pages.complete_when_ready else "after"
        return (
            f"lazy-pages daemon {pages.lazy_pages_pid}: pages complete "
            f"{_ms(pages.pages_complete_s)} after the restore started ({when} the copy was "
            f"ready), at {pages.pages_complete_at}"
        )
    return f"lazy-pages daemon {pages.lazy_pages_pid}: pages never complete: {pages.failure or '-'}"


def render_table(report: Report) -> Table:
    """The validation table: one row per check, grouped by run."""
    counts = report.counts()
    verdict = "PASSED" if report.passed else "FAILED"
    table = Table(
        title=f"qualification {verdict}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped ({report.wall_s:.1f} s)",
        show_lines=False,
        header_style="bold",
    )
    table.add_column("run", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("evidence", overflow="fold")
    for run in report.runs:
        for index, check in enumerate(run.checks):
            table.add_row(
                _run_label(run) if index == 0 else "",
                check.name,
                Text(check.status, style=_STYLES[check.status]),
                Text(check.evidence),  # evidence may hold brackets: never rich markup
                end_section=index == len(run.checks) - 1,
            )
    return table


def render_timings(report: Report) -> Table:
    """One row per run: the figures it has, in step order (fits a narrow terminal)."""
    table = Table(title="timings", header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("figures", overflow="fold")
    for run in report.runs:
        figures = [
            f"{label} {_ms(getattr(run.timings, name))}"
            for name, label in _TIMING_LABELS.items()
            if getattr(run.timings, name) is not None
        ]
        if _pages_complete_s(run) is not None:
            figures.append(f"{_PAGES_LABEL} {_ms(_pages_complete_s(run))}")
        figures.append(f"run {run.wall_s:.2f} s")
        table.add_row(run.name, Text(" · ".join(figures)))
    return table


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    env = report.environment
    counts = report.counts()
    lines = [
        "# snapctl qualification report",
        "",
        f"**{'PASSED' if report.passed else 'FAILED'}**: {counts['passed']} checks passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped, in {report.wall_s:.1f} s "
        f"({report.created}).",
        "",
        "## Environment",
        "",
        "| | |",
        "|---|---|",
    ]
    for key, value in env.model_dump().items():
        shown = " ".join(value) if isinstance(value, list) else str(value)
        lines.append(f"| {key} | `{_md_cell(shown)}` |")
    lines += ["", "## Checks", "", "| run | check | result | evidence |", "|---|---|---|---|"]
    for run in report.runs:
        for check in run.checks:
            result = f"**{check.status}**" if check.failed else check.status
            lines.append(
                f"| {_run_label(run)} | {check.name} | {result} | {_md_cell(check.evidence)} |"
            )
    names, rows = _timing_rows(report.runs)
    lines += ["", "## Timings", "", "| step | " + " | ".join(names) + " |"]
    lines.append("|---|" + "---:|" * len(names))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "## Activations", ""]
    for run in report.runs:
        ids = ", ".join(run.activation_ids) or "-"
        where = f"; files in `{run.artifacts}`" if run.artifacts else ""
        pages = describe_pages(run)
        lazy = f"; {_md_cell(pages)}" if pages else ""
        lines.append(f"- {run.name}: {ids}{lazy}{where}")
    failures = report.failures()
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {_md_cell(failure)}" for failure in failures]
    return "\n".join(lines) + "\n"


def write_report(report: Report, directory: Path) -> tuple[Path, Path]:
    """Write report.json (the model) and report.md into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / REPORT_JSON, directory / REPORT_MD
    # Not a control file: larger than the protocol's 64 KiB cap, and meant to be read by people.
    replace_file(json_path, (report.model_dump_json(indent=2) + "\n").encode())
    replace_file(md_path, render_markdown(report).encode())
    return json_path, md_path
