"""What the agent does for each API operation: the same functions the in-process CLI calls
(records for ps, ``stop_recorded``, ``collect_garbage``, the pool's copy paths), returning
JSON-ready answers and raising :class:`~snapctl.errors.SnapctlError` on failure.

Copies never run in the agent's process: each is served by a parked copy's supervisor
(:func:`snapctl.pool.serve.activate_from_pool`) or restored in a fresh one forked by the spawner
(:func:`snapctl.pool.copy_via_supervisor`), so every copy keeps serving when the agent ends.
Donors and bakes neither: each captures in a fresh supervisor, in the client's directory and
environment (:func:`snapctl.pool.serve.capture_via_supervisor`), and a donor serves on there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapctl import __version__
from snapctl.agent.api import ActivationRow, StopAnswer, VersionInfo
from snapctl.agent.metrics import AgentMetrics
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool import CopyRequest, PoolListing, PoolTarget, Spawner, WarmPool
from snapctl.pool.serve import activate_from_pool, copy_via_supervisor
from snapctl.statedir import ActivationRecord, StateDir

if TYPE_CHECKING:
    from snapctl.pool.cancel import Cancel
    from snapctl.pool.models import BakeRequest, DonorRequest

# One message of a streamed answer: {"lane", "progress"}, {"note"}, then the outcome.
Emit = Callable[[dict[str, Any]], None]


class BadRequestError(SnapctlError):
    """A request the agent refuses before anything starts (a bad field or option);
    ``usage`` names the CLI option to blame ("" for the command), as a usage error does."""

    exit_status = ExitStatus.USAGE

    def __init__(self, message: str, *, usage: str = "", **fields: Any) -> None:
        super().__init__(message, **fields)
        self.usage = usage


class NotFoundError(SnapctlError):
    """The request names an activation (or API path) the agent does not know."""

    exit_status = ExitStatus.ERROR


class AgentService:
    """The operations behind the API, for one state directory, its pool and its spawner."""

    def __init__(
        self, state: StateDir, *, pool: WarmPool, spawner: Spawner, metrics: AgentMetrics
    ) -> None:
        self.state = state
        self.pool = pool
        self.spawner = spawner
        self.metrics = metrics

    def version(self) -> VersionInfo:
        import os

        return VersionInfo(snapctl=__version__, pid=os.getpid(), state_dir=str(self.state.root))

    # ps / stop / logs / gc -------------------------------------------------------------------

    def activations(self) -> list[dict[str, Any]]:
        """``snapctl ps --json``: every record, and whether its tree and supervisor run."""
        from snapctl.supervision.process import is_same_process

        rows = []
        for record in self.state.load_records():
            row = ActivationRow(
                **record.model_dump(),
                running=is_same_process(record.root_pid, record.root_start_time),
                supervised=is_same_process(record.supervisor_pid, record.supervisor_start_time),
            )
            rows.append(row.model_dump(mode="json"))
        return rows

    def find(self, name: str) -> ActivationRecord:
        for record in self.state.load_records():
            if name in (record.name, record.activation_id):
                return record
        raise NotFoundError(f"no activation named {name!r} (see snapctl ps)")

    def stop(self, name: str, timeout_s: float) -> StopAnswer:
        from snapctl.activation.supervise import stop_recorded

        record = self.find(name)
        how, audit = stop_recorded(record, self.state, timeout_s)
        return StopAnswer(name=record.name, stopped=how, audit=audit.model_dump())

    def log_path(self, name: str) -> tuple[Path, Path | None]:
        """An activation's server log, and its record's path while it runs (None: stopped)."""
        for record in self.state.load_records():
            if name in (record.name, record.activation_id):
                log = Path(record.logs_dir) / "server.log"
                if not log.exists():
                    raise SnapctlError(f"{name} has no server log yet", path=log)
                return log, self.state.record_path(record.name)
        log = self.state.logs / name / "server.log"  # a stopped activation, by id
        if "/" not in name and name not in (".", "..") and log.exists():
            return log, None
        raise NotFoundError(f"no activation named {name!r} (see snapctl ps)")

    def follow(
        self, log: Path, record: Path, write: Callable[[bytes], None],
        until: threading.Event | None = None,
    ) -> None:  # fmt: skip
        """Pass on what ``log`` holds and gets until the activation stops (its ``record``
        goes), or ``until`` is set."""
        from snapctl.supervision.logs import follow_log

        def done() -> bool:
            return not record.exists() or (until is not None and until.is_set())

        follow_log(log, write, done=done)

    def gc(self, timeout_s: float) -> dict[str, Any]:
        from snapctl.activation.supervise import collect_garbage

        report = collect_garbage(self.state, timeout_s)
        return report.model_dump(mode="json")

    # images ----------------------------------------------------------------------------------

    def images(self, root: str | None) -> list[dict[str, object]]:
        from snapctl.cli.images import image_records

        if root is not None and not Path(root).is_absolute():
            raise BadRequestError(f"{root} is not an absolute path", usage="--root")
        return image_records(None if root is None else Path(root))

    def inspect(self, image: str, verify: bool) -> dict[str, Any]:
        from snapctl.cli.inspect import inspect_record

        return inspect_record(self._published_image(image, "IMAGE"), verify)

    # pool ------------------------------------------------------------------------------------

    def pool_set(self, target: PoolTarget) -> PoolTarget:
        image = self._published_image(target.image, "--image")
        return self.pool.set(image, target.size, lazy=target.lazy, max_memory=target.max_memory)

    def pool_remove(self, image: str) -> PoolTarget:
        return self.pool.remove(Path(image))

    def pool_listing(self) -> PoolListing:
        return self.pool.listing()

    # copy ------------------------------------------------------------------------------------

    def copy(self, request: CopyRequest, emit: Emit) -> dict[str, Any]:
        """Serve one ``snapctl copy``: refuse what the CLI refuses before anything starts,
        then activate a parked copy if one is ready, else restore one in a fresh supervisor.
        Progress and notes go to ``emit``; the report is returned (``from_pool`` says which)."""
        started = time.monotonic()
        try:
            self.check_copy(request, emit)

            def progress(lane: str, step: str) -> None:
                emit({"lane": lane, "progress": step})

            image = Path(request.image)
            if request.count == 1:
                report = activate_from_pool(self.pool, request, progress)
                if report is not None:
                    self.metrics.served(report, source="pool", seconds=time.monotonic() - started)
                    return report
            if request.lazy is None:
                request = request.model_copy(update={"lazy": self._lazy_default(image, emit)})
            report = copy_via_supervisor(request, self.state, progress, spawner=self.spawner)
        except SnapctlError as error:
            if error.exit_status != ExitStatus.USAGE:  # a refused request failed no phase
                self.metrics.request_failed(error.phase)
            raise
        self.metrics.served(report, source="restore", seconds=time.monotonic() - started)
        return report

    def check_copy(self, request: CopyRequest, emit: Emit) -> None:
        """What ``snapctl copy`` refuses in-process before anything starts, in the same order
        and with the same messages (usage errors name their option)."""
        from snapctl.images.identity.compare import check_waivers, needless_waivers

        try:
            check_waivers(request.allow_mismatch)
        except SnapctlError as error:
            raise BadRequestError(error.message, usage="'--allow-mismatch'") from error
        if request.name and request.count > 1:
            from snapctl.statedir.names import InvalidNameError, numbered_names

            try:
                numbered_names(request.name, request.count)
            except InvalidNameError as error:
                raise BadRequestError(error.message, usage="'--name' with '--count'") from error
        self._check_name(request)
        self._check_publish(request)
        self._published_image(request.image, "--image")
        for name in needless_waivers(request.allow_mismatch):
            emit({"note": f"--allow-mismatch {name} is not needed: {name} never refuses a copy"})

    def _check_name(self, request: CopyRequest) -> None:
        """A name in use is refused here, as in-process, before a parked copy is taken for it
        (refused after the take, it would cost the pool that copy)."""
        if request.name is None:
            return
        from snapctl.statedir.names import numbered_names

        names = numbered_names(request.name, request.count) if request.count > 1 else [request.name]
        for name in names:
            self.state.reserve_name(name).release()  # NameInUseError, as in-process

    def _check_publish(self, request: CopyRequest) -> None:
        if request.publish is None:
            if request.expose:
                raise BadRequestError("--expose only widens --publish; give --publish ADDR:PORT")
            return
        from snapctl.namespaces.publish import check_publish

        address, port, count = request.publish.address, request.publish.port, request.count
        if port and port + count - 1 > 65535:
            raise BadRequestError(
                f"{count} copies from port {port} need ports up to {port + count - 1}, past "
                "65535; give a lower first port",
                usage="--publish",
            )
        check_publish(address, [port + index for index in range(count)] if port else [],
                      exposed=request.expose)  # fmt: skip

    def _published_image(self, text: str, option: str) -> Path:
        from snapctl.registry.source import require_image

        path = Path(text)
        if not path.is_absolute():
            raise BadRequestError(f"{text} is not an absolute path", usage=option)
        return require_image(text).absolute()

    def _lazy_default(self, image: Path, emit: Emit) -> bool:
        from snapctl.criu.lazy.transfer import lazy_by_default
        from snapctl.criu.lazy.tuning import LAZY_DEFAULT_MIN_BYTES
        from snapctl.images import load_manifest

        lazy = lazy_by_default(load_manifest(image))
        if lazy:
            threshold = LAZY_DEFAULT_MIN_BYTES >> 20
            emit({"note": f"restoring lazily: the image holds {threshold} MiB of pages or more "
                          "(--no-lazy: restore every page first)"})  # fmt: skip
        return lazy

    # donor / bake ----------------------------------------------------------------------------

    def check_capture(self, request: BakeRequest) -> None:
        """What ``snapctl donor``/``bake`` refuse in-process before anything starts (the
        router calls it before it answers, so a refusal is a 4xx, not a failed stream)."""
        from snapctl.pool.models import DonorRequest

        if not Path(request.cwd).is_dir():
            raise BadRequestError(
                f"the working directory {request.cwd} is not a directory on the agent's host"
            )
        if isinstance(request, DonorRequest):
            self._check_donor_publish(request)

    def donor(
        self, request: DonorRequest, emit: Emit, cancel: Cancel | None = None
    ) -> dict[str, Any]:
        """Serve one ``snapctl donor`` (checked: :meth:`check_capture`): capture in a fresh
        supervisor, which activates the donor and supervises it (it keeps serving when the
        agent ends); the donor's report once it serves. ``cancel`` interrupts the start (its
        client is gone, or hung up on Ctrl-C)."""
        return self._capture("donor", request, emit, cancel)

    def bake(
        self, request: BakeRequest, emit: Emit, cancel: Cancel | None = None
    ) -> dict[str, Any]:
        """Serve one ``snapctl bake`` (checked: :meth:`check_capture`) in a fresh supervisor
        (a slow bake never holds the agent); its report once the image is published and the
        original stopped. ``cancel`` interrupts it before it publishes (see :meth:`donor`)."""
        return self._capture("bake", request, emit, cancel)

    def _capture(
        self, kind: str, request: BakeRequest, emit: Emit, cancel: Cancel | None
    ) -> dict[str, Any]:
        from snapctl.pool.serve import capture_via_supervisor

        started = time.monotonic()
        try:
            report = capture_via_supervisor(
                request, self.state, lambda lane, step: emit({"lane": lane, "progress": step}),
                spawner=self.spawner, cancel=cancel,
            )  # fmt: skip
        except SnapctlError as error:
            self.metrics.capture_failed(kind, error.phase)
            raise
        self.metrics.captured(kind, seconds=time.monotonic() - started)
        return report

    def _check_donor_publish(self, request: DonorRequest) -> None:
        """``--publish``/``--expose`` as ``snapctl donor`` checks them in-process (see
        :func:`snapctl.cli._activation_options.check_publish_option`)."""
        if request.publish is None:
            if request.expose:
                raise BadRequestError("--expose only widens --publish; give --publish ADDR:PORT")
            return
        from snapctl.namespaces.publish import check_publish

        port = request.publish.port
        check_publish(request.publish.address, [port] if port else [], exposed=request.expose)
