"""What the agent does for each API operation: the same functions the in-process CLI calls
(records for ps, ``stop_named``, ``collect_garbage``, the pool's copy paths), returning
JSON-ready answers and raising :class:`~snapctl.errors.SnapctlError` on failure.

Copies never run in the agent's process: each is served by a parked copy's supervisor
(:func:`snapctl.pool.serve.activate_from_pool`) or restored in a fresh one forked by the spawner
(:func:`snapctl.pool.copy_via_supervisor`), so every copy keeps serving when the agent ends.
Donors and bakes neither: each captures in a fresh supervisor, in the client's directory and
environment (:func:`snapctl.pool.serve.capture_via_supervisor`), and a donor serves on there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapctl import __version__
from snapctl.activation.precheck import decide_lazy
from snapctl.activation.requests import CopyRequest, publish_pair
from snapctl.agent.api import StopAnswer, VersionInfo
from snapctl.agent.metrics import AgentMetrics
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool import PoolListing, PoolTarget, Spawner, WarmPool
from snapctl.pool.serve import activate_from_pool, copy_via_supervisor
from snapctl.statedir import (
    ActivationRecord,
    NoServerLogError,
    StateDir,
    UnknownActivationError,
)

if TYPE_CHECKING:
    from snapctl.activation.requests import BakeRequest, DonorRequest
    from snapctl.pool.cancel import Cancel

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
        from snapctl.supervision.listing import activation_rows

        return activation_rows(self.state)

    def find(self, name: str) -> ActivationRecord:
        try:
            return self.state.find_record(name)
        except UnknownActivationError as error:
            raise NotFoundError(error.message) from error

    def stop(self, name: str, timeout_s: float) -> StopAnswer:
        """``snapctl stop``: a recorded activation, or one still starting under ``name``."""
        from snapctl.activation.supervise import stop_named

        try:
            stopped, how, audit = stop_named(self.state, name, timeout_s)
        except UnknownActivationError as error:
            raise NotFoundError(error.message) from error
        return StopAnswer(name=stopped, stopped=how, audit=audit.model_dump())

    def log_path(self, name: str) -> tuple[Path, Path | None]:
        """An activation's server log, and its record's path while it runs (None: stopped)."""
        try:
            return self.state.server_log(name)
        except (UnknownActivationError, NoServerLogError) as error:
            raise NotFoundError(error.message, path=error.path) from error

    def pass_log(
        self, log: Path, write: Callable[[str], None], *, record: Path | None,
        until: Callable[[], bool] = lambda: False,
    ) -> None:  # fmt: skip
        """Pass on ``log``'s text: what it holds and, given its activation's ``record``
        (following), what it gets until the activation stops (the record goes); either way
        unless ``until()`` turns true first."""
        from snapctl.supervision.logs import pass_log

        done = None if record is None else (lambda: not record.exists())
        try:
            pass_log(log, write, done=done, until=until)
        except FileNotFoundError as error:
            # Removed between the lookup and the read (gc of a stopped activation's kept logs).
            raise NotFoundError("the server log is gone (its activation's logs were removed)",
                                path=log) from error  # fmt: skip

    def gc(self, timeout_s: float) -> dict[str, Any]:
        from snapctl.gc import collect_garbage

        report = collect_garbage(self.state, timeout_s)
        return report.model_dump(mode="json")

    # images ----------------------------------------------------------------------------------

    def images(self, root: str | None, default_root: str | None = None) -> list[dict[str, object]]:
        """``images --json`` for this agent's state directory: the images in ``root``, else in
        ``default_root`` (the caller's ``$SNAPCTL_IMAGE_ROOT``) or the state's ``images/``,
        and the pulled ones."""
        from snapctl.registry.source import image_records

        for path, option in ((root, "--root"), (default_root, "")):
            if path is not None and not Path(path).is_absolute():
                raise BadRequestError(f"{path} is not an absolute path", usage=option)
        images = Path(default_root) if default_root else self.state.root / "images"
        return image_records(None if root is None else Path(root), self.state, images)

    def inspect(self, image: str, verify: bool) -> dict[str, Any]:
        from snapctl.images.catalog import inspect_record

        image_dir = self._published_image(image, "IMAGE", restore=False)
        return inspect_record(image_dir, verify, self.state)

    # pool ------------------------------------------------------------------------------------

    def pool_set(self, target: PoolTarget) -> PoolTarget:
        image = self._published_image(target.image, "--image")
        return self.pool.set(image, target.size, lazy=target.lazy, max_memory=target.max_memory,
                             memory_bytes=target.memory_bytes, cpus=target.cpus)  # fmt: skip

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
            lazy = decide_lazy(request.lazy, image, lambda text: emit({"note": text}))
            request = request.model_copy(update={"lazy": lazy})
            report = copy_via_supervisor(request, self.state, progress, spawner=self.spawner)
        except SnapctlError as error:
            if error.exit_status != ExitStatus.USAGE:  # a refused request failed no phase
                self.metrics.request_failed(error.phase)
            raise
        self.metrics.served(report, source="restore", seconds=time.monotonic() - started)
        return report

    def check_copy(self, request: CopyRequest, emit: Emit) -> None:
        """What ``snapctl copy`` refuses in-process before anything starts, in the same order
        and with the same messages (:func:`~snapctl.activation.precheck.check_copy_start`);
        before a parked copy is taken, so that a refusal costs the pool nothing."""
        from snapctl.activation.precheck import CopyUsageError, check_copy_start

        try:
            check_copy_start(
                image=request.image, allow_mismatch=request.allow_mismatch, name=request.name,
                count=request.count, publish=publish_pair(request.publish),
                expose=request.expose, state=self.state, note=lambda text: emit({"note": text}),
                into_container=request.into_container,
            )  # fmt: skip
        except CopyUsageError as error:
            raise BadRequestError(error.message, usage=error.option) from error

    def _published_image(self, text: str, option: str, *, restore: bool = True) -> Path:
        """The image directory ``text`` names; one the pool restores (``restore``) only if
        no one but root can change it, as a copy's (``require_image``)."""
        from snapctl.registry.source import require_image

        path = Path(text)
        if not path.is_absolute():
            raise BadRequestError(f"{text} is not an absolute path", usage=option)
        return require_image(text, restore=restore).absolute()

    # donor / bake ----------------------------------------------------------------------------

    def check_capture(self, request: BakeRequest) -> None:
        """What ``snapctl donor``/``bake`` refuse in-process before anything starts (the
        router calls it before it answers, so a refusal is a 4xx, not a failed stream)."""
        from snapctl.activation.requests import DonorRequest

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
        :func:`snapctl.activation.precheck.check_publish_target`)."""
        from snapctl.activation.precheck import CopyUsageError, check_publish_target

        try:
            check_publish_target(publish_pair(request.publish), request.expose, 1)
        except CopyUsageError as error:
            raise BadRequestError(error.message, usage=error.option) from error
