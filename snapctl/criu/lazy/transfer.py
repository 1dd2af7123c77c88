"""A lazy copy's background page transfer: watching its ``criu lazy-pages`` daemon until every
page is copied, and failing the copy closed when the daemon dies first.

A lazily restored tree runs before its memory is in place: the daemon serves page faults and
pushes the rest in the background. If the daemon ends before it has copied every page, the
tree's next touch of a missing page crashes it or, worse, reads a zero-filled page and goes on
with wrong data. So the copy is complete only when the daemon exits 0, and any other end of the
daemon stops the copy at once (SIGKILL to its PID 1, no grace that would run on bad memory).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.daemon import LazyPagesDaemon

PagesState = Literal["transferring", "complete", "failed", "stopped"]


class PagesStatus(BaseModel):
    """Where a lazy copy's page transfer stands (``complete_s``: from the restore's start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: PagesState
    complete_s: float | None = None
    complete_at: str | None = None
    failure: str | None = None


# How long stop() waits for a copy's learning (reading its daemon's log, writing its sets).
LEARN_JOIN_S = 5.0


class LazyTransfer:
    """Watches one lazy-pages daemon from a thread; reports its end through two callbacks.

    ``on_failure(reason)`` runs first thing when the daemon ends in any way but exit 0 (and was
    not stopped by us); ``on_done(status)`` runs after every end, failure included. After an
    exit 0, ``learn(until_s)`` gets the seconds from the restore's start to the transfer's first
    release plus :data:`~snapctl.criu.lazy.tuning.LEARN_AFTER_RELEASE_S` (the first request's
    faults count too; for :mod:`snapctl.criu.lazy.workingset`), once: when the transfer ends if
    it was released, or else at its first release (a transfer not held back can end before
    the copy is ready, and the faults it served until then are the working set all the same).
    """

    def __init__(
        self,
        daemon: LazyPagesDaemon,
        *,
        restore_started: float,
        on_failure: Callable[[str], None],
        on_done: Callable[[PagesStatus], None],
        learn: Callable[[float], object] | None = None,
    ) -> None:
        self.daemon = daemon
        self._learn = learn
        self._learned = False
        self._learner: threading.Thread | None = None
        self._released_at: float | None = None
        self._restore_started = restore_started
        self._on_failure = on_failure
        self._on_done = on_done
        self._lock = threading.Lock()
        self._stopping = False
        self._status = PagesStatus(state="transferring")
        self._finished = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"lazy-pages-{daemon.pid}", daemon=True
        )
        self._thread.start()

    @property
    def status(self) -> PagesStatus:
        with self._lock:
            return self._status

    def _watch(self) -> None:
        status = self.daemon.wait()
        assert status is not None
        with self._lock:
            if self._stopping:
                result = PagesStatus(state="stopped")
            elif status == 0:
                result = PagesStatus(
                    state="complete",
                    complete_s=round(time.monotonic() - self._restore_started, 6),
                    complete_at=datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="milliseconds"
                    ),
                )
            else:
                reason = (
                    f"lazy-pages daemon {self.daemon.describe_exit(status)} before every page "
                    f"was copied; the copy was stopped (log: {self.daemon.log_path})"
                )
                result = PagesStatus(state="failed", failure=reason)
            self._status = result
        try:
            if result.state == "failed":
                assert result.failure is not None
                self._on_failure(result.failure)
            self._on_done(result)
            if result.state == "complete":
                self._learn_until_release()
        finally:
            self._finished.set()

    def _claim_learning(self) -> float | None:
        """The ``until_s`` to learn until, for the one caller that is to learn (else None)."""
        with self._lock:
            if self._learn is None or self._released_at is None or self._learned:
                return None
            ended_s = self._status.complete_s
            if (ended_s is not None and self._released_at - self._restore_started - ended_s
                    > tuning.LEARN_RELEASE_AFTER_END_MAX_S):  # fmt: skip
                return None  # released long after its end: parked meanwhile, nothing to learn
            self._learned = True
            return self._released_at - self._restore_started + tuning.LEARN_AFTER_RELEASE_S

    def _learn_until_release(self) -> None:
        until_s = self._claim_learning()
        if until_s is not None:
            self._learn_until(until_s)

    def _learn_until(self, until_s: float) -> None:
        assert self._learn is not None  # claimed
        with contextlib.suppress(Exception):  # a cache: never the copy's failure
            self._learn(until_s)

    def release_transfer(self, delay_s: float = 0.0) -> None:
        """The copy is ready, or about to need its memory in bulk: start the background
        transfer ``delay_s`` from now if it was held back."""
        release_at = time.monotonic() + delay_s
        with self._lock:
            if self._released_at is None or release_at < self._released_at:
                self._released_at = release_at
            ended = self._status.state == "complete"
        self.daemon.release_transfer(delay_s)
        until_s = self._claim_learning() if ended else None
        if until_s is not None:
            # Off the caller's path (it is the copy becoming ready); stop() waits for it.
            self._learner = threading.Thread(target=self._learn_until, args=(until_s,),
                                             name="lazy-pages-learn", daemon=True)  # fmt: skip
            self._learner.start()

    def wait(self, timeout_s: float | None = None) -> PagesStatus:
        """Wait until the transfer ended (or ``timeout_s``, if given); return the status then."""
        self._finished.wait(timeout_s)
        return self.status

    def stop(self) -> PagesStatus:
        """Stop the daemon (the tree must already be stopping) and wait for the watcher."""
        with self._lock:
            self._stopping = self._status.state == "transferring"
        self.daemon.kill()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._learner is not None:
            self._learner.join(LEARN_JOIN_S)  # a cache: not worth holding a stop for longer
        return self.status
