"""How an activation's memory is in place: all of it at once (a donor, a plain copy) or
arriving lazily (:mod:`snapctl.criu.lazy`). A session holds one of these two and asks it,
never whether it is lazy."""

from __future__ import annotations

from typing import Any, Protocol

from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.transfer import LazyTransfer, PagesStatus


class Memory(Protocol):
    @property
    def transfer(self) -> LazyTransfer | None:
        """The lazy transfer (qualification's lazy-fault run pauses its daemon), or None."""

    def status(self) -> PagesStatus | None:
        """Where a lazy transfer stands; None when memory was all in place from the start."""

    def wait(self, timeout_s: float | None) -> PagesStatus | None:
        """Wait until every page is in (or ``timeout_s``); return the status then."""

    def bulk_read_ahead(self) -> None:
        """Something is about to read much of the memory (a native restore): let it stream."""

    def serving(self) -> None:
        """The activation answers now: the rest of its memory may stream in."""

    def stop(self) -> list[int]:
        """After the tree stopped: end what delivers memory; return PIDs that survived."""

    def report_fields(self) -> dict[str, Any]:
        """The activation report's and record's fields about the memory."""


class InPlace:
    """Every page was in place when the tree started running."""

    transfer: LazyTransfer | None = None

    def status(self) -> PagesStatus | None:
        return None

    def wait(self, timeout_s: float | None) -> PagesStatus | None:
        return None

    def bulk_read_ahead(self) -> None:
        pass

    def serving(self) -> None:
        pass

    def stop(self) -> list[int]:
        return []

    def report_fields(self) -> dict[str, Any]:
        return {"lazy": False}


class LazyPages:
    """Pages arrive from a ``criu lazy-pages`` daemon, watched by ``transfer``."""

    def __init__(self, transfer: LazyTransfer) -> None:
        self.transfer: LazyTransfer | None = transfer
        self._transfer = transfer

    def status(self) -> PagesStatus | None:
        return self._transfer.status

    def wait(self, timeout_s: float | None) -> PagesStatus | None:
        return self._transfer.wait(timeout_s)

    def bulk_read_ahead(self) -> None:
        self._transfer.release_transfer()

    def serving(self) -> None:
        # The request that asked for the copy usually follows at once: give it a head start.
        self._transfer.release_transfer(tuning.TRANSFER_AFTER_READY_S)

    def stop(self) -> list[int]:
        # Only after the tree: a daemon stopped first would leave it running on zero pages.
        self._transfer.stop()
        daemon = self._transfer.daemon
        return [daemon.pid] if daemon.poll() is None else []

    def report_fields(self) -> dict[str, Any]:
        pages = self._transfer.status
        return {
            "lazy": True,
            "lazy_pages_pid": self._transfer.daemon.pid,
            "pages_complete": pages.state == "complete",
            "pages_complete_s": pages.complete_s,
            "pages_complete_at": pages.complete_at,
        }
