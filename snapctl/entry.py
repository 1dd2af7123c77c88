"""The ``snapctl`` entry point: the agent's click-free paths first (:mod:`snapctl.thin`:
``ps [--json]`` and ``copy ... --detach --json``), then everything else through
:func:`snapctl.cli.main`."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: see snapctl.errors
if TYPE_CHECKING:
    from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``snapctl`` with ``argv`` (None: this process's own arguments) and return its exit
    status. A command the agent answered on a click-free path ends this process at once when
    it is the process's own command (``argv`` None): it started no thread and holds nothing
    to release, and the interpreter's teardown of its modules is measurable next to the
    whole command."""
    from snapctl.thin import fast_copy, fast_ps

    args = list(sys.argv[1:] if argv is None else argv)
    for fast in (fast_ps, fast_copy):
        try:
            status = fast(args)
        except KeyboardInterrupt:  # before its handlers hold signals, or while it reports
            from snapctl.errors import ExitStatus

            status = ExitStatus.INTERRUPTED  # as the full CLI exits
        except Exception as error:  # the agent failed it: reported as the full CLI reports
            from snapctl.cli import exit_status_for, report_error
            from snapctl.errors import ExitStatus, SnapctlError

            report_error(error)
            status = exit_status_for(error) if isinstance(error, SnapctlError) else ExitStatus.ERROR
        if status is not None:
            if argv is None:
                _end_now(status)
            return status
    from snapctl.cli import main as full

    return full(args)


def _end_now(status: int) -> None:
    """Flush what was printed, then end without the interpreter's teardown (a flush that
    fails, say on a closed pipe, leaves the ordinary exit to report it)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        return
    os._exit(status)
