"""A parked copy's supervisor: restore the copy, park it at the activation barrier, wait on
its own socket for one order, then activate it and supervise it like a detached copy.

Its files live in ``STATE/pool/<id>/`` (0700): ``parked.json`` (:class:`ParkedRecord`, so a
new agent or ``gc`` finds it), ``order.sock`` (0600, one connection: an
:class:`ActivationOrder` line in, the report wire out) and ``supervisor.log``. The directory
goes when the copy is activated (it is then an ordinary activation with its record) or
discarded. A parked copy discards itself when the agent it was parked for is gone, when its
tree dies, or on SIGTERM; it is never left waiting for an order that cannot come. Runs in a
parked copy's supervisor process.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from snapctl.activation.copy import ParkedCopy, activate_copy, restore_copy
from snapctl.activation.requests import CopyRequest, publish_pair
from snapctl.errors import ExitStatus
from snapctl.images.filecache import StatKey
from snapctl.images.store import ImageError, file_keys, load_manifest, unchanged_since
from snapctl.phases import HostPhase
from snapctl.pool.identity import manifest_digest, manifest_stat, published_identity, restore_fits
from snapctl.pool.models import ActivationOrder, ParkedRecord
from snapctl.pool.records import LOG_NAME, RECORD_NAME, SOCKET_NAME, parked_home
from snapctl.pool.supervisor.common import (
    abandon_undelivered,
    check_request,
    detach_stdio,
    launch_options,
)
from snapctl.pool.wire import ParkedCopyUnusableError, Reporter
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from snapctl.supervision.process import is_same_process, start_time
from snapctl.supervision.sockets import bind_private

# Parking is background work: its restore runs this much nicer than the copies being served
# (CRIU gives the restored tree back its own dumped niceness), until the copy is ordered.
PARK_NICENESS = 10
# How often a parked copy looks whether its agent and its tree are still there.
WATCH_INTERVAL_S = 0.5
# A client that connected has this long to send its order line.
ORDER_READ_TIMEOUT_S = 5.0
MAX_ORDER_BYTES = 64 * 1024


def set_niceness(pid: int, niceness: int) -> None:
    """Every thread of ``pid`` at ``niceness`` (Linux keeps one per thread); a thread that
    ends meanwhile is skipped, and a failure only leaves the old niceness."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for thread in threads:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(thread), niceness)


class _Parked:
    """The supervisor's side of one parked copy."""

    def __init__(self, job: dict[str, Any], reporter: Reporter) -> None:
        from snapctl.supervision.signals import StopSignals

        self.signals = StopSignals().install()
        self.state = StateDir(Path(job["state"]))
        self.id: str = job["id"]
        self.home = parked_home(self.state, self.id)
        self.request = CopyRequest.model_validate_json(json.dumps(job["request"]))
        self.owner = (int(job["owner_pid"]), float(job["owner_start_time"]))
        self.reporter = reporter
        self.copy: ParkedCopy | None = None
        self.image = Path(self.request.image)
        self.manifest_stat: tuple[int, ...] | None = None
        self.file_keys: dict[str, StatKey] | None = None
        self.listener: socket.socket | None = None
        me = os.getpid()
        self.record = ParkedRecord(
            id=self.id, state="restoring", image=self.request.image, image_id=None,
            manifest_digest=None, lazy=bool(self.request.lazy), activation_id=None,
            supervisor_pid=me, supervisor_start_time=start_time(me), root_pid=None,
            root_start_time=None, owner_pid=self.owner[0], owner_start_time=self.owner[1],
            socket=str(self.home / SOCKET_NAME),
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )  # fmt: skip

    def save(self, **changes: Any) -> None:
        self.record = self.record.model_copy(update=changes)
        write_json_atomic(self.home / RECORD_NAME, self.record, overwrite=True)

    def park(self) -> None:
        """Restore, then listen: the copy is ready for an order."""
        self.home.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        self.home.mkdir(mode=0o700)
        log = os.open(self.home / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for fd in (1, 2):
            os.dup2(log, fd)
        os.close(log)
        self.save()
        self.restore()
        assert self.copy is not None
        session = self.copy.session
        assert session.root is not None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_private(listener, self.record.socket)
        listener.listen(4)
        listener.settimeout(WATCH_INTERVAL_S)
        self.listener = listener
        lazy = session.lazy
        self.save(
            state="parked", image_id=self.copy.manifest.image_id,
            manifest_digest=manifest_digest(self.copy.manifest),
            activation_id=session.activation_id, root_pid=session.root.pid,
            root_start_time=session.root.start_time,
            lazy_pages_pid=None if lazy is None else lazy.daemon.pid,
            lazy_pages_start_time=None if lazy is None else lazy.daemon.start_time,
        )  # fmt: skip

    def restore(self) -> None:
        """Restore the copy, and note what later checks compare the image with."""
        from snapctl.activation.native import native_step
        from snapctl.criu import find_criu

        # A lazy copy reads its image long after the restore: its baseline is taken before
        # the restore verifies the image, so that a change during the restore shows too.
        baseline = self._file_keys_now() if self.request.lazy else None
        options = launch_options(self.request)
        self.copy = restore_copy(
            Path(self.request.image), options, criu=find_criu(self.request.criu_path),
            native=native_step(self.request.native), state=self.state,
            progress=lambda step: self.reporter.progress("", step), lazy=bool(self.request.lazy),
        )  # fmt: skip
        # Read after the restore verified the image: a change since shows as another stat.
        self.manifest_stat = manifest_stat(self.image)
        if baseline is not None and baseline[0] == manifest_digest(self.copy.manifest):
            self.file_keys = baseline[1]  # else None: never still verified, discarded
        if published_identity(self.image) != (
            self.copy.manifest.image_id,
            manifest_digest(self.copy.manifest),
        ):
            raise ParkedCopyUnusableError(
                "the image changed during the restore", phase=HostPhase.POOL
            )

    def _file_keys_now(self) -> tuple[str, dict[str, StatKey] | None] | None:
        """The published manifest's digest and its files' stat keys now (None: none is)."""
        try:
            manifest = load_manifest(self.image)
        except (ImageError, OSError):
            return None
        return manifest_digest(manifest), file_keys(self.image, manifest)

    def image_now(self) -> tuple[str | None, str | None] | None:
        """The image's ``(image_id, manifest digest)`` now; without reading the manifest
        when its file is the very one seen at parking (a publication renames a new one in:
        another inode, another ctime)."""
        if self.manifest_stat is not None and manifest_stat(self.image) == self.manifest_stat:
            return self.record.image_id, self.record.manifest_digest
        return published_identity(self.image)

    def still_verified(self) -> bool:
        """Every file of the image is still the one verified for the restore: the same stat
        key as right after it and no file added or removed (no hashing)."""
        assert self.copy is not None
        return unchanged_since(self.image, self.copy.manifest, self.file_keys)

    def discard(self) -> None:
        """Stop the parked copy (if it got that far) and remove its files."""
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
        if self.copy is not None:
            copy, self.copy = self.copy, None
            copy.session.stop()
        shutil.rmtree(self.home, ignore_errors=True)

    def wait_for_order(self) -> int:
        """Until an order is served: watch the agent, the tree and the stop request."""
        assert self.listener is not None and self.copy is not None
        while True:
            if self.signals.requested.is_set():
                self.discard()
                return 0
            if not is_same_process(*self.owner):
                self.discard()  # its agent is gone: no one can vouch for it any more
                return 0
            if not self.copy.session.alive():
                self.discard()
                return 1
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                status = self.serve_order(conn)
            if status is not None:
                return status

    def serve_order(self, conn: socket.socket) -> int | None:
        """One connection's order; None: not an order (keep waiting), else the exit status."""
        reporter = Reporter(os.dup(conn.fileno()))
        try:
            order = self.read_order(conn)
        except ParkedCopyUnusableError as error:
            reporter.error(error)
            reporter.close()
            return None
        if order.action == "discard":
            reporter.send({"discarded": self.id})
            reporter.close()
            self.discard()
            return 0
        assert order.request is not None
        # Ordered: it is no background work any more (nor is its lazy-pages daemon).
        set_niceness(os.getpid(), 0)
        if self.record.lazy_pages_pid is not None:
            set_niceness(self.record.lazy_pages_pid, 0)
        try:
            session, delivered = self.activate(order.request, reporter)
        except BaseException as error:
            self.discard()  # first: once answered, nothing of it is left
            status = reporter.error(error)
            reporter.close()
            return status
        reporter.close()
        conn.close()
        if abandon_undelivered(delivered, order.request.detach):
            return int(ExitStatus.ERROR)  # a foreground copy whose report reached no one
        return self.supervise(session)

    def read_order(self, conn: socket.socket) -> ActivationOrder:
        conn.settimeout(ORDER_READ_TIMEOUT_S)
        data = b""
        try:
            while b"\n" not in data and len(data) <= MAX_ORDER_BYTES:
                chunk = conn.recv(MAX_ORDER_BYTES)
                if not chunk:
                    break
                data += chunk
        except OSError as error:
            raise ParkedCopyUnusableError(
                f"no order read: {error}", phase=HostPhase.POOL
            ) from error
        line = data.split(b"\n", 1)[0]
        try:
            order = ActivationOrder.model_validate_json(line)
        except ValueError as error:
            raise ParkedCopyUnusableError(
                f"not an activation order: {error}", phase=HostPhase.POOL
            ) from error
        if order.action == "activate" and order.request is None:
            raise ParkedCopyUnusableError(
                "an activate order needs its request", phase=HostPhase.POOL
            )
        return order

    def activate(self, request: CopyRequest, reporter: Reporter) -> tuple[Any, bool]:
        """Check the image is still the one restored, then activate; return the session and
        whether its report was delivered."""
        assert self.copy is not None and self.listener is not None
        self.listener.close()  # one order only
        self.listener = None
        why = restore_fits(self.request, request)
        now = self.image_now()
        if why is None and now is None:
            why = f"{self.request.image} is no longer a published image"
        elif why is None and now != (self.record.image_id, self.record.manifest_digest):
            why = f"{self.request.image} was replaced since this copy was parked"
        if why is None and self.record.lazy and not self.still_verified():
            why = (f"{self.request.image} changed since this copy was parked (a lazy copy "
                   "still reads its pages from it)")  # fmt: skip
        if why is not None:
            raise ParkedCopyUnusableError(f"parked copy {self.id} cannot serve: {why}",
                                          phase=HostPhase.POOL)  # fmt: skip
        check_request(request)
        options = launch_options(request)
        publish = publish_pair(request.publish)
        copy, self.copy = self.copy, None  # activate_copy cleans up after its own failure
        session, report = activate_copy(
            copy, options, publish=publish, name=request.name,
            progress=lambda step: reporter.progress("", step),
        )  # fmt: skip
        self.signals.started()
        report = report.model_copy(update={"from_pool": True})
        delivered = reporter.send({"report": report.model_dump(mode="json")})
        shutil.rmtree(self.home, ignore_errors=True)  # it is an ordinary activation now
        return session, delivered

    def supervise(self, session: Any) -> int:
        from snapctl.activation.supervise import run_all_until_stopped
        from snapctl.supervision.signals import stop_all_tracked

        detach_stdio()
        try:
            run_all_until_stopped([session], stop=self.signals.requested)
        finally:
            stop_all_tracked()
        return 0


def run_parked(job: dict[str, Any], reporter: Reporter) -> int:
    """The ``park`` job: report ``{"parked": record}`` (or the error) on the pipe, then wait
    for the order on the socket; return the exit status."""
    from snapctl.supervision.signals import stop_all_tracked

    set_niceness(os.getpid(), PARK_NICENESS)
    parked = _Parked(job, reporter)
    try:
        try:
            parked.park()
        except BaseException:
            stop_all_tracked()
            raise
    except BaseException as error:
        parked.discard()
        return reporter.error(error)
    parked.signals.started()  # from here a signal asks for the discard
    reporter.send({"parked": parked.record.model_dump(mode="json")})
    reporter.close()
    return parked.wait_for_order()
