"""Shared output for commands: stdout and stderr consoles, one-record JSON, quiet-aware waits.

Results go to stdout (a rich table, or exactly one JSON record under ``--json``); everything a
person watches while waiting (spinners, notes) goes to stderr and only on a terminal, so a script
reading stdout never has to filter it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

import click
from pydantic import BaseModel
from rich.console import Console

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
