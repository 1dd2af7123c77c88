"""Cancelling one request the agent serves in a fresh supervisor: once its client is gone (or
hung up on purpose: an interrupted ``snapctl donor``/``bake``), the supervisor serving it is
sent SIGTERM, through the pidfd the spawner pinned it by (never a pid, which may be reused).
Its :class:`~snapctl.supervision.signals.StopSignals` then interrupt the start where it is, as
Ctrl-C does in-process: what had started is stopped, nothing is published, and it reports
``interrupted`` (exit status 130) on its wire.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Cancel:
    """One request's cancellation: :meth:`request` from any thread, any number of times; the
    supervisor serving it, while :meth:`supervising` holds it, gets one SIGTERM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested = False
        self._pidfd: int | None = None
        self._signalled = False

    @property
    def requested(self) -> bool:
        return self._requested

    def request(self) -> None:
        with self._lock:
            self._requested = True
            self._terminate()

    @contextlib.contextmanager
    def supervising(self, pidfd: int | None) -> Iterator[None]:
        """While the body relays the supervisor ``pidfd`` pins, a cancel terminates it (at
        once if it was requested already). The caller still owns (and closes) ``pidfd``."""
        with self._lock:
            self._pidfd = pidfd
            self._terminate()
        try:
            yield
        finally:
            with self._lock:
                self._pidfd = None

    def _terminate(self) -> None:
        if self._requested and self._pidfd is not None and not self._signalled:
            self._signalled = True
            with contextlib.suppress(ProcessLookupError):  # it has exited already
                signal.pidfd_send_signal(self._pidfd, signal.SIGTERM)
