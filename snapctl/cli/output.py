"""Shared output for commands: stdout and stderr consoles, one-record JSON, quiet-aware waits.

Results go to stdout (a rich table, or exactly one JSON record under ``--json``); everything a
person watches while waiting (spinners, notes) goes to stderr and only on a terminal, so a script
reading stdout never has to filter it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

import click
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

F = TypeVar("F", bound=Callable[..., Any])


@cache
def stdout() -> Console:
    """The console for results. It writes to whatever ``sys.stdout`` is at print time."""
    return Console(highlight=False)


@cache
def stderr() -> Console:
    """The console for errors, notes and spinners."""
    return Console(stderr=True, highlight=False)


def json_option(function: F) -> F:
    """The shared ``--json`` flag (parameter ``as_json``)."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON object on stdout instead of a table; no progress output.",
    )(function)


def emit_json(record: BaseModel | dict[str, Any] | list[Any]) -> None:
    """Write exactly one JSON record, on one line, to stdout (no rich markup or wrapping)."""
    if isinstance(record, BaseModel):
        text = record.model_dump_json()
    else:
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextmanager
def status(message: str, *, quiet: bool = False) -> Iterator[None]:
    """Show a spinner with ``message`` while the block runs, on a terminal and unless ``quiet``."""
    console = stderr()
    if quiet or not console.is_terminal:
        yield
        return
    with console.status(message):
        yield


def note(message: str, *, quiet: bool = False) -> None:
    """Print a dim progress line on stderr, on a terminal and unless ``quiet``."""
    console = stderr()
    if not quiet and console.is_terminal:
        console.print(message, style="dim", markup=False)


class Steps:
    """Live progress of a long start on stderr: a spinner per lane on its current step, and a
    line with the time of every finished step. Lanes are concurrent copies (``--count``).

    Silent under ``--json`` or when stderr is not a terminal, so scripts see only results.
    Use as a context manager; ``steps(...)`` reports on the default lane.
    """

    def __init__(self, *, quiet: bool = False) -> None:
        self.enabled = not quiet and stderr().is_terminal
        self._lock = threading.Lock()
        self._lanes: dict[str, tuple[Any, str, float]] = {}  # lane -> (task, step, started)
        self._progress: Any = None

    def __enter__(self) -> Steps:
        if self.enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=stderr(),
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        for lane in list(self._lanes):
            self.end(lane, ok=exc_type is None)
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, step: str) -> None:
        self.lane("")(step)

    def lane(self, name: str) -> Callable[[str], None]:
        """The progress callback of one lane (one copy of several)."""

        def report(step: str) -> None:
            if not self.enabled:
                return
            with self._lock:
                self._finish_step(name)
                label = f"{name}: {step}" if name else step
                task = self._progress.add_task(label)
                self._lanes[name] = (task, label, time.monotonic())

        return report

    def end(self, lane: str, *, ok: bool) -> None:
        """Close a lane's current step as done (✓) or failed (✗)."""
        with self._lock:
            self._finish_step(lane, ok=ok)

    def _finish_step(self, lane: str, *, ok: bool = True) -> None:
        if lane not in self._lanes or self._progress is None:
            return
        task, label, started = self._lanes.pop(lane)
        self._progress.remove_task(task)
        seconds = time.monotonic() - started
        mark = "[green]✓[/]" if ok else "[bold red]✗[/]"
        self._progress.console.print(
            f"{mark} {escape(label)} [dim]{seconds * 1000:.0f} ms[/]", highlight=False
        )
