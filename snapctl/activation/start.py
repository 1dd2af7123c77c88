"""A :class:`~snapctl.activation.requests.CopyRequest` started, as every entry that restores
fresh copies starts one (``snapctl copy`` in-process, a copy's supervisor forked by the agent):
first what it needs is found and decided (:func:`prepare_copies`), then the copies start
(:meth:`CopyStart.__call__`), one or ``count`` of them, all or nothing.

The two halves run apart because the CLI refuses what the first finds missing, and shows its
notes, before it draws progress or forks a detached supervisor for the second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Modules, not names: each start looks its steps up where they are defined, which is where
# the entries' tests stand in for them (snapctl.activation.copy.start_copy, snapctl.criu.find_criu).
from snapctl import criu
from snapctl.activation import copy
from snapctl.activation.core import ActivationReport
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep, native_step
from snapctl.activation.precheck import Note, decide_lazy
from snapctl.activation.requests import CopyRequest, publish_pair
from snapctl.activation.session import Session
from snapctl.activation.tools import REAL_TOOLS, Tools
from snapctl.progress import Progress
from snapctl.statedir import StateDir

__all__ = ["CopyStart", "prepare_copies"]

# The progress callback of one lane: "" for a single copy, "copy N" for each of several.
ProgressFor = Callable[[str], Progress]


@dataclass(frozen=True)
class CopyStart:
    """What one request starts, with everything found and decided: called once, it starts
    the copies and returns them with their report (one copy's, or ``--count N``'s)."""

    image: Path
    options: LaunchOptions
    count: int
    criu: criu.CriuBinary
    native: NativeStep
    lazy: bool
    publish: tuple[str, int] | None
    state: StateDir
    tools: Tools = REAL_TOOLS

    def __call__(
        self, progress_for: ProgressFor
    ) -> tuple[list[Session], ActivationReport | copy.CopiesReport]:
        """Start the copies; on failure none is left running (each start stops what it
        started, and of several the ones that started are stopped: ``require_all``)."""
        if self.count == 1:
            session, report = copy.start_copy(
                self.image, self.options, criu=self.criu, native=self.native,
                publish=self.publish, state=self.state, progress=progress_for(""),
                lazy=self.lazy, tools=self.tools,
            )  # fmt: skip
            return [session], report
        started = self.tools.clock()
        results = copy.start_copies(
            self.image, self.options, self.count, criu=self.criu, native=self.native,
            publish_base=self.publish, state=self.state, progress_for=progress_for,
            lazy=self.lazy, tools=self.tools,
        )  # fmt: skip
        return copy.require_all(results, self.tools.clock() - started)


def prepare_copies(
    request: CopyRequest,
    state: StateDir,
    *,
    options: LaunchOptions | None = None,
    note: Note | None = None,
    tools: Tools = REAL_TOOLS,
) -> CopyStart:
    """Find the request's CRIU, choose its native step and decide whether it restores lazily
    (said in a ``note`` when it was not asked); nothing starts yet.

    ``options``: the launch options to start with (None: the request's own; a supervisor
    passes its own, which carry the API key under its private name)."""
    return CopyStart(
        image=Path(request.image),
        options=request.launch_options() if options is None else options,
        count=request.count,
        criu=criu.find_criu(request.criu_path),
        native=native_step(request.native),
        lazy=decide_lazy(request.lazy, Path(request.image), note),
        publish=publish_pair(request.publish),
        state=state,
        tools=tools,
    )
