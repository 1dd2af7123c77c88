"""SIGINT and SIGTERM while snapctl owns activations, so that no interrupt leaves one running
without its supervisor.

A command that starts activations holds :class:`StopSignals` from before its first start until
it has stopped them (the foreground command) or for the whole life of a detached supervisor.
While starting, the first signal raises ``KeyboardInterrupt`` where the main thread is, so the
start's own cleanup runs; every later signal, and every signal once started, only sets
``requested``, which the supervising loop checks: a cleanup in progress is never cut short and
a stop request is never lost (the default action, process death, is never taken). A start that
fails for another reason calls :func:`cleaning` (or :meth:`StopSignals.cleaning`) as its cleanup
begins, so that a first signal arriving during that cleanup does not cut it short either.

Whatever was started and not yet stopped is registered (:func:`track`), so a start
interrupted between creating an activation and handing it to its caller is still stopped, by
:func:`stop_all_tracked` at the end of the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Protocol

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stoppable(Protocol):
    def stop(self, stop_timeout_s: float = ...) -> Any: ...


_tracked: list[Stoppable] = []
_tracked_lock = threading.Lock()

# The StopSignals installed in this process, for cleanups that do not hold it (a Session).
_installed: StopSignals | None = None


def track(activation: Stoppable) -> None:
    """Register an activation as started and not yet stopped."""
    with _tracked_lock:
        _tracked.append(activation)


def untrack(activation: Stoppable) -> None:
    """It has stopped (called by its ``stop``)."""
    with _tracked_lock:
        for index, tracked in enumerate(_tracked):
            if tracked is activation:
                del _tracked[index]
                return


def stop_all_tracked(stop_timeout_s: float = 10.0) -> int:
    """Stop every activation this process started and has not stopped; return how many."""
    with _tracked_lock:
        pending = list(_tracked)
    failures: list[Exception] = []
    for activation in pending:
        # One stop that fails must not leave the others running.
        try:
            activation.stop(stop_timeout_s)
        except Exception as error:
            failures.append(error)
        finally:
            untrack(activation)
    if failures:
        raise failures[0]
    return len(pending)


class StopSignals:
    """SIGINT/SIGTERM handlers for a command that owns activations (see the module docstring).

    Single use: ``with StopSignals() as signals: ...start...; signals.started(); ...serve``.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.received: int | None = None
        self._raising = True
        # While deferring, a first signal's interrupt waits until the deferral ends.
        self._deferring = False
        self._deferred = False
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._outer: StopSignals | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        self.requested.set()
        if self._raising:
            self._raising = False  # once: the cleanup this starts must run to its end
            if self._deferring:
                self._deferred = True
            else:
                raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Run the body whole (starting a child that must not be lost half-way); a first
        signal that came meanwhile raises its interrupt when the body has ended."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._deferred:
                self._deferred = False
                raise KeyboardInterrupt

    def started(self) -> None:
        """Everything is started and owned: from now on a signal only requests the stop."""
        self._raising = False

    def cleaning(self) -> None:
        """A cleanup begins: from now on a signal only records (``requested``, ``received``);
        raising in the middle of it would leave half of what it stops running."""
        self._raising = False

    def install(self) -> StopSignals:
        """Take over SIGINT and SIGTERM (a detached supervisor: for the rest of its life)."""
        global _installed
        if self._previous:
            raise RuntimeError("StopSignals is single use")
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._outer, _installed = _installed, self
        return self

    def restore(self) -> None:
        global _installed
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if _installed is self:
            _installed = self._outer

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()


def cleaning() -> None:
    """A cleanup begins (see :meth:`StopSignals.cleaning`), in code that does not hold the
    process's :class:`StopSignals`; nothing to do when none is installed.

    Only the main thread's: a signal handler raises only there, so another thread's cleanup
    cannot be cut short, and it must not make the main thread's start uninterruptible.
    """
    installed = _installed
    if installed is not None and threading.current_thread() is threading.main_thread():
        installed.cleaning()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """:meth:`StopSignals.deferring` of the process's StopSignals, in code that does not hold
    it (only the main thread's, where handlers raise; nothing to do when none is installed)."""
    installed = _installed
    if installed is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with installed.deferring():
        yield


def forward_to(pid: int) -> Callable[[int, FrameType | None], None]:
    """A handler that passes SIGINT/SIGTERM on to ``pid`` as SIGTERM (our unreaped child, so
    its PID cannot have been reused)."""

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    return forward
