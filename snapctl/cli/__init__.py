"""The ``snapctl`` command line: a lazily loaded click group and the map from errors to exit codes.

This module owns parsing-level concerns only, split as in httpie's ``main()``/``program()``:
:func:`main` runs the group and turns every failure into one line on stderr and an
:class:`~snapctl.errors.ExitStatus`; commands do the work and have no error handling of their own.

Commands live one per module (``snapctl/cli/<name>.py``) and are listed in :data:`COMMANDS`,
which the group reads without importing them, so ``snapctl --help`` stays fast. Keep this module's
imports to click and :mod:`snapctl.errors`: no pydantic, rich or psutil at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import click

from snapctl import __version__
from snapctl.errors import ExitStatus, SnapctlError


class LazyCommand(NamedTuple):
    """Where a command lives (``"module:attribute"``) and its one-line help for listings."""

    target: str
    short_help: str


# Every subcommand: name -> where it lives and what ``snapctl --help`` says about it. The module
# is imported only when the command runs (or its own --help is asked for); the short help here is
# what the listing shows, so keep it equal to the first line of the command's docstring
# (tests/cli/test_cli.py checks that).
COMMANDS: dict[str, LazyCommand] = {
    "doctor": LazyCommand(
        "snapctl.cli.doctor:doctor", "Check that this machine can capture and restore with CRIU."
    ),
    "donor": LazyCommand(
        "snapctl.cli.donor:donor", "Capture a server and keep the original serving."
    ),
    "copy": LazyCommand("snapctl.cli.copy:copy", "Restore a copy of an image and serve it."),
    "ps": LazyCommand("snapctl.cli.activations:ps", "List running activations."),
    "stop": LazyCommand(
        "snapctl.cli.activations:stop", "Stop an activation and clean up after it."
    ),
    "logs": LazyCommand("snapctl.cli.activations:logs", "Print an activation's server log."),
    "gc": LazyCommand(
        "snapctl.cli.activations:gc", "Clean up activations whose snapctl process died."
    ),
    "inspect": LazyCommand(
        "snapctl.cli.inspect:inspect", "Show an image's manifest (and verify it)."
    ),
    "bake": LazyCommand(
        "snapctl.cli.bake:bake", "Capture a server into an image without ever serving it."
    ),
    "image": LazyCommand(
        "snapctl.cli.image:image", "Export, import, push, pull, sign, verify or remove an image."
    ),
    "images": LazyCommand("snapctl.cli.images:images", "List the images in an image root."),
    "qualify": LazyCommand(
        "snapctl.cli.qualify:qualify",
        "Qualify donor and copies against an ordinary start.",
    ),
    "fault": LazyCommand(
        "snapctl.cli.qualify:fault",
        "Check that a copy whose recovery fails fails closed.",
    ),
    "stale": LazyCommand(
        "snapctl.cli.qualify:stale",
        "Check that copies given stale control fail closed.",
    ),
    "agent": LazyCommand(
        "snapctl.cli.agent:agent", "Run the node agent: the CLI's API, a warm pool, metrics."
    ),
    "pool": LazyCommand(
        "snapctl.cli.pool:pool", "Keep copies of an image parked, ready to activate (agent)."
    ),
}


@dataclass
class CliState:
    """Global options, shared by :func:`main` (error reporting) and the commands (``ctx.obj``)."""

    traceback: bool = False
    # Run in this process even when an agent answers on its socket (see snapctl.cli.remote).
    no_agent: bool = False


class LazyGroup(click.Group):
    """A group that imports a command's module only when that command is needed."""

    def __init__(
        self, *args: Any, lazy_commands: Mapping[str, LazyCommand] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands: Mapping[str, LazyCommand] = lazy_commands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.lazy_commands, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in self.lazy_commands:
            return super().get_command(ctx, cmd_name)
        return load_command(cmd_name, self.lazy_commands[cmd_name].target)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing imports every command to ask for its help; use the map instead.
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max((len(name) for name in names), default=0)
        rows: list[tuple[str, str]] = []
        for name in names:
            if name in self.commands or name not in self.lazy_commands:
                command = super().get_command(ctx, name)
                if command is None or command.hidden:
                    continue
                rows.append((name, command.get_short_help_str(limit)))
            else:
                rows.append((name, self.lazy_commands[name].short_help))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def load_command(name: str, target: str) -> click.Command:
    """Import ``module:attribute`` and check that it is a click command."""
    module_name, _, attribute = target.partition(":")
    command = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(command, click.Command):
        raise TypeError(f"{target} (command {name!r}) is not a click command")
    return command


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", prog_name="snapctl", message="%(prog)s %(version)s")
@click.option("--traceback", is_flag=True, help="Show the full traceback when a command fails.")
@click.option(
    "--no-agent",
    is_flag=True,
    envvar="SNAPCTL_NO_AGENT",
    help="Run the command in this process even when an agent (snapctl agent) answers on its "
    "socket.",
)
@click.pass_context
def snapctl(ctx: click.Context, traceback: bool, no_agent: bool) -> None:
    """Capture an initialized inference server once with CRIU, then start copies of it fast.

    When an agent runs (snapctl agent), ps, stop, logs, gc, images, inspect, copy, donor, bake
    and pool go through it (same output and exit codes); --no-agent keeps them in this process.
    """
    state = ctx.ensure_object(CliState)
    state.traceback = traceback
    state.no_agent = no_agent


def exit_status_for(error: SnapctlError) -> ExitStatus:
    """The exit code for a deliberate error: the one its class declares (see ExitStatus)."""
    return ExitStatus(error.exit_status)


def _error_line(error: SnapctlError) -> str:
    line = f"error: {error.message}"
    if error.phase:
        line += f" [phase: {error.phase}]"
    if error.path is not None and str(error.path) not in error.message:
        line += f" ({error.path})"
    if error.pid is not None:
        line += f" (pid {error.pid})"
    return line


def _error_tail(error: SnapctlError) -> str:
    tail = error.log_tail
    return tail.rstrip() if tail else ""


def report_error(error: BaseException) -> None:
    """Print one red line for ``error`` on stderr (plus the log tail it carries, dimmed)."""
    from rich.text import Text  # imported only on the failure path

    from snapctl.cli.output import stderr

    if isinstance(error, SnapctlError):
        line, tail = _error_line(error), _error_tail(error)
    else:
        line = f"error: {type(error).__name__}: {error} (--traceback shows where)"
        tail = ""
    stderr().print(Text(line, style="bold red"), soft_wrap=True)
    if tail:
        stderr().print(Text(tail, style="dim"), soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status; under ``--traceback`` failures propagate."""
    state = CliState()
    try:
        result = snapctl.main(
            args=None if argv is None else list(argv),
            prog_name="snapctl",
            standalone_mode=False,
            obj=state,
        )
        return result if isinstance(result, int) else ExitStatus.OK
    except click.ClickException as error:  # usage errors: click formats them itself
        error.show()
        return error.exit_code
    except click.Abort as error:  # click turns Ctrl-C into Abort in non-standalone mode
        cause = error.__cause__
        if state.traceback:  # show the interrupt itself, not click's wrapper
            raise (cause if cause is not None else error) from None
        interrupted = isinstance(cause, KeyboardInterrupt | EOFError)
        return ExitStatus.INTERRUPTED if interrupted else ExitStatus.ERROR
    except KeyboardInterrupt:
        if state.traceback:
            raise
        return ExitStatus.INTERRUPTED
    except SnapctlError as error:
        if state.traceback:
            raise
        report_error(error)
        return exit_status_for(error)
    except Exception as error:
        if state.traceback:
            raise
        report_error(error)
        return ExitStatus.ERROR


__all__ = ["COMMANDS", "CliState", "LazyCommand", "LazyGroup", "main", "snapctl"]
