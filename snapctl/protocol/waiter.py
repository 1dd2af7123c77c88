"""Capturer-side waits for control files: woken by inotify, bounded by a wall-clock deadline.

A :class:`ControlDirWatcher` holds one inotify watch on the control directory and the waiting
thread sleeps in ``select`` on its descriptor, so a file that appears wakes that thread at once,
with no helper thread to start, hop through or join. Descriptors are pooled, not closed (see
:mod:`snapctl.protocol.inotify`). Every wait also re-reads on a short poll interval, so a missed
or coalesced event costs at most one interval, never a hang.
Each round checks that the watched process is still alive. Only the capturer uses this module:
the server side (:mod:`snapctl.launcher`) polls at the capture barrier, so no inotify
descriptor ends up in a CRIU image.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import NamedTuple, Self

from snapctl.errors import ProcessExitedError, WaitTimeoutError
from snapctl.protocol.controldir import ControlDir, ControlModel
from snapctl.protocol.inotify import DirectoryWatch
from snapctl.protocol.models import ControlFile

logger = logging.getLogger(__name__)

# The fallback interval; with inotify working a file is seen long before it.
DEFAULT_POLL_S = 0.05

Alive = Callable[[], bool]


class Arrival(NamedTuple):
    """The first awaited file that appeared, and its validated content."""

    name: ControlFile
    model: ControlModel


class ControlDirWatcher:
    """Watches one control directory for the length of a ``with`` block.

    Use one watcher for a whole capture sequence (ready -> challenge -> status). If inotify
    cannot be set up (for example the per-user instance limit is reached) the watcher logs why
    and waits by polling alone.
    """

    def __init__(self, control_dir: ControlDir) -> None:
        self.control_dir = control_dir
        self._inotify: DirectoryWatch | None = None
        self._entered = False

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a ControlDirWatcher can be entered only once")
        self._entered = True
        self.control_dir.validate()
        try:
            self._inotify = DirectoryWatch(self.control_dir.path)
        except OSError as error:
            logger.warning("cannot watch %s, polling only: %s", self.control_dir, error)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            inotify.close()

    def wait_for(
        self,
        names: ControlFile | Iterable[ControlFile],
        timeout_s: float,
        *,
        alive: Alive | None = None,
        poll_s: float = DEFAULT_POLL_S,
    ) -> Arrival:
        """Return the first of ``names`` to exist (checked in the given order each round).

        Raises WaitTimeoutError when ``timeout_s`` of wall-clock time pass, ProcessExitedError
        when ``alive()`` returns False, and ProtocolError when a file exists but is invalid.
        """
        if not self._entered:
            raise RuntimeError("use the watcher in a with block")
        awaited = _as_names(names)
        _require_positive_finite("timeout_s", timeout_s)
        _require_positive_finite("poll_s", poll_s)
        deadline = time.monotonic() + timeout_s
        while True:
            # Drain before reading: an event during the read then wakes the next wait at once.
            if self._inotify is not None:
                self._inotify.drain()
            arrival = self._first_present(awaited)
            if arrival is not None:
                return arrival
            if alive is not None and not alive():
                # It may have written what we wait for (say error.json) just before exiting.
                arrival = self._first_present(awaited)
                if arrival is not None:
                    return arrival
                raise ProcessExitedError(
                    f"process exited while waiting for {_list(awaited)} in {self.control_dir.path}",
                    awaited=(name.value for name in awaited),
                    path=self.control_dir.path,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(
                    f"timed out after {timeout_s:g} s waiting for {_list(awaited)} "
                    f"in {self.control_dir.path}",
                    awaited=(name.value for name in awaited),
                    path=self.control_dir.path,
                )
            if self._inotify is not None:
                self._inotify.wait(min(poll_s, remaining))
            else:
                time.sleep(min(poll_s, remaining))

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until something in the directory changed since the last :meth:`wait_for`
        read it, or ``timeout_s`` passed: how to wait for a file that exists to be replaced."""
        if not self._entered:
            raise RuntimeError("use the watcher in a with block")
        timeout_s = max(0.0, timeout_s)
        if self._inotify is not None:
            self._inotify.wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def _first_present(self, awaited: tuple[ControlFile, ...]) -> Arrival | None:
        for name in awaited:
            model = self.control_dir.read(name)
            if model is not None:
                return Arrival(name, model)
        return None


def wait_for(
    control_dir: ControlDir,
    names: ControlFile | Iterable[ControlFile],
    timeout_s: float,
    *,
    alive: Alive | None = None,
    poll_s: float = DEFAULT_POLL_S,
) -> Arrival:
    """One-shot :meth:`ControlDirWatcher.wait_for` with its own inotify descriptor."""
    _require_positive_finite("timeout_s", timeout_s)
    with ControlDirWatcher(control_dir) as watcher:
        return watcher.wait_for(names, timeout_s, alive=alive, poll_s=poll_s)


def _as_names(names: ControlFile | Iterable[ControlFile]) -> tuple[ControlFile, ...]:
    # ControlFile is a str, so a single name must not be iterated character by character.
    if isinstance(names, str):
        return (ControlFile(names),)
    awaited = tuple(ControlFile(name) for name in names)
    if not awaited:
        raise ValueError("wait_for needs at least one file name")
    return awaited


def _require_positive_finite(label: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{label} must be a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{label} must be a positive finite number of seconds")


def _list(names: tuple[ControlFile, ...]) -> str:
    return " or ".join(name.value for name in names)
