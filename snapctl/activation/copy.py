"""``snapctl copy``: verify an image, stage fresh directories, restore into new namespaces
with CRIU (:mod:`snapctl.activation.restore`), then activate the copy exactly like the donor.

The two halves can run apart: :func:`restore_copy` leaves a copy *parked* at the activation
barrier (restored, its server waiting for ``activation.json``), and :func:`activate_copy`
activates it later; :func:`start_copy` does both at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.activation.container import Container, ContainerHold, resolve_container
from snapctl.activation.core import (
    ActivationReport,
    activate_and_probe,
    activation_report,
    new_session,
    reserve_session_name,
)
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep, NoNativeStep, timed, tree_pids_when_read
from snapctl.activation.restore import (
    RestoreError,
    pidfile,
    pin_restored,
    restore_tree,
    strategy_for,
)
from snapctl.activation.session import Session
from snapctl.activation.states import SessionState
from snapctl.activation.tools import REAL_TOOLS, Tools
from snapctl.criu import CriuBinary
from snapctl.errors import SnapctlError
from snapctl.images import ImageError, Manifest
from snapctl.images.lock import ImageHold, hold_image
from snapctl.logtail import log_tail
from snapctl.phases import HostPhase
from snapctl.progress import Progress
from snapctl.statedir import StateDir
from snapctl.statedir.names import NameReservation, numbered_names
from snapctl.supervision.process import ProcessGoneError
from snapctl.supervision.signals import cleaning

__all__ = ["ParkedCopy", "RestoreError", "activate_copy", "restore_copy", "start_copy"]


class CopiesReport(BaseModel):
    """The machine-readable record of ``copy --count N``: each copy and the total wall time."""

    model_config = ConfigDict(extra="forbid")

    copies: list[ActivationReport]
    total_s: float


@dataclass
class ParkedCopy:
    """A restored copy waiting at the activation barrier, and what activating it needs."""

    session: Session
    manifest: Manifest
    timings: dict[str, float] = field(default_factory=dict)


def restore_copy(
    image: Path,
    options: LaunchOptions,
    *,
    criu: CriuBinary,
    native: NativeStep,
    state: StateDir,
    progress: Progress,
    lazy: bool = False,
    hold_transfer: bool | None = None,
    reservation: NameReservation | None = None,
    after_restore: Callable[[Session], None] | None = None,
    publish: tuple[str, int] | None = None,
    tools: Tools = REAL_TOOLS,
) -> ParkedCopy:
    """Verify, check identity, restore and run the native restore: the copy is parked at the
    activation barrier. On failure everything started is stopped and cleaned up, then raised.
    In a container (``options.into_container``) its server will listen where ``publish``
    names on the container's network (else at ``options``' host and port there).

    ``after_restore`` (qualification's hook) runs once CRIU restored the tree, before the
    native step (a lazy-fault run kills the daemon there, before a native restore pulls every
    page in); whatever it raises fails the copy. ``hold_transfer`` overrides whether a lazy
    copy's background transfer waits until it is ready (None: as its image view decides).

    The image is held shared from before its verification until the copy no longer reads it
    (for a lazy copy: until its last page is in). The name is reserved first (or
    ``reservation``, taken by the caller, is used and owned from here on).
    """
    state.ensure()
    container = container_hold = None
    if options.into_container is not None:
        try:
            # Before anything is reserved or started: a container that cannot host the copy
            # (or hosts one already) is refused here, with the fix.
            container = resolve_container(options.into_container)
            container_hold = container.hold()
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
    if reservation is None:
        try:
            reservation = reserve_session_name(state, "copy", options.name)
        except BaseException:
            if container_hold is not None:
                container_hold.release()
            raise
    timings: dict[str, float] = {}
    image = image.absolute()
    # Shared: another copy may read it too, but no rm/replace while we depend on it.
    try:
        hold = hold_image(image)
    except (FileNotFoundError, NotADirectoryError) as error:
        _release(reservation, container_hold)
        message = f"{image} is not a published image ({error.strerror})"
        raise ImageError(message, path=image) from error
    except BaseException:
        _release(reservation, container_hold)
        raise
    try:
        manifest = _check_image(image, options, criu, state, timings, progress, tools,
                                container=container)  # fmt: skip
        if container is not None:
            # On the container's network the server listens where it is published.
            host, port = container.claim_network(
                manifest.lo_addresses, publish or (options.host, options.port)
            )
            options = replace(options, host=host, port=port)
        tools.sandbox.adopt_restored_trees()
    except BaseException:
        _release(hold, reservation, container_hold)
        raise
    session = new_session(
        state, "copy", options.name, reservation, options=options, image=image, image_hold=hold,
        container=container, container_hold=container_hold, tools=tools,
    )  # fmt: skip
    try:
        restore_tree(
            session, image, manifest, strategy_for(lazy, tools, hold_transfer=hold_transfer),
            criu=tools.criu.for_restores(criu, state), timeout_s=options.timeout_s,
            timings=timings, progress=progress, tools=tools,
        )  # fmt: skip
        if after_restore is not None:
            after_restore(session)
        _fail_if_pages_failed(session)
        if native.name != NoNativeStep.name:
            # A native restore (cuda-checkpoint) reads much of the memory: in bulk, not by faults.
            session.memory.bulk_read_ahead()
        with timed(native, timings, "native_restore"):
            native.after_restore(tree_pids_when_read(session.tree.pid), options.timeout_s)
        session.advance(SessionState.PARKED)
        # Its thread enters the netns now, while nothing waits on it: a copy parked in a pool
        # then starts its handshake at once when ordered. Failing here is not fatal: the
        # activation tries again, and reports a tree gone meanwhile with its reason.
        with contextlib.suppress(OSError):
            session.connector = tools.server.connect(session.tree.pid)
        return ParkedCopy(session=session, manifest=manifest, timings=timings)
    except BaseException as error:
        if session.root is None and pidfile(session).exists():
            # Interrupted after CRIU restored the tree but before we pinned it.
            with contextlib.suppress(ProcessGoneError, ValueError):
                pin_restored(session)
        session.stop_failed_start(error)
        raise


def _release(*holds: ImageHold | NameReservation | ContainerHold | None) -> None:
    for each in holds:
        if each is not None:
            each.release()


def activate_copy(
    parked: ParkedCopy,
    options: LaunchOptions,
    *,
    publish: tuple[str, int] | None,
    progress: Progress,
    before_activation: Callable[[Session], None] | None = None,
    name: str | None = None,
    tools: Tools = REAL_TOOLS,
) -> tuple[Session, ActivationReport]:
    """Activate a parked copy: handshake, probe, publish; on failure stop it, then raise.
    ``name``: serve under this name (reserved here) instead of the one it was parked under.
    ``before_activation`` (qualification's fault runs inject a fault into this activation
    only) runs first; whatever it raises fails the copy."""
    session, manifest, timings = parked.session, parked.manifest, parked.timings
    try:
        if name is not None and name != session.name:
            session.rename(session.state_dir.reserve_name(name))
        if before_activation is not None:
            before_activation(session)
        progress("activating the copy")
        try:
            phases = activate_and_probe(
                session, manifest.capture_id, options, publish, timings, tools=tools
            )
        except SnapctlError as error:
            if error.log_tail is None:
                error.log_tail = log_tail(session.dirs.server_log)
            raise
        _fail_if_pages_failed(session)
        report = activation_report(
            session, manifest, timings, phases,
            restore_stats=tools.criu.restore_stats(session.dirs.work),
        )  # fmt: skip
        return session, report
    except BaseException as error:
        session.stop_failed_start(error)
        raise


def start_copy(
    image: Path,
    options: LaunchOptions,
    *,
    criu: CriuBinary,
    native: NativeStep,
    publish: tuple[str, int] | None,
    state: StateDir,
    progress: Progress,
    after_restore: Callable[[Session], None] | None = None,
    before_activation: Callable[[Session], None] | None = None,
    lazy: bool = False,
    hold_transfer: bool | None = None,
    reservation: NameReservation | None = None,
    tools: Tools = REAL_TOOLS,
) -> tuple[Session, ActivationReport]:
    """Restore one copy and activate it at once (:func:`restore_copy`, :func:`activate_copy`).

    With ``lazy`` the copy serves while its memory still arrives (``session.memory`` watches
    the transfer; the report's ``pages_complete`` says whether it had finished by then).
    """
    parked = restore_copy(
        image, options, criu=criu, native=native, state=state, progress=progress, lazy=lazy,
        hold_transfer=hold_transfer, reservation=reservation, after_restore=after_restore,
        publish=publish, tools=tools,
    )  # fmt: skip
    return activate_copy(
        parked, options, publish=publish, progress=progress,
        before_activation=before_activation, tools=tools,
    )  # fmt: skip


def _check_image(
    image: Path,
    options: LaunchOptions,
    criu: CriuBinary,
    state: StateDir,
    timings: dict[str, float],
    progress: Progress,
    tools: Tools,
    *,
    container: Container | None = None,
) -> Manifest:
    """Verify every entry of the image, then this host against its identity (the files
    where the copy will read them: ``container``'s, when given)."""
    progress("verifying the image")
    started = tools.clock()
    manifest = tools.images.verify(image, state)
    timings["verify"] = tools.clock() - started
    progress("checking this host against the image's identity")
    started = tools.clock()
    if container is None:
        shown = tools.images.check_identity(
            manifest, image, criu_version=criu.version, options=options, state=state
        )
    else:
        view = container.file_view(manifest.external_mounts)
        progress(f"checking the container's files against the image's identity ({view.root})")
        shown = tools.images.check_identity(
            manifest, image, criu_version=criu.version, options=options, state=state, view=view
        )
    timings["identity"] = tools.clock() - started
    waived = [d for d in shown if d.refuses]
    if waived:
        progress("waived: " + "; ".join(f"{d.field}: {d.detail}" for d in waived))
    noted = [d for d in shown if not d.refuses]
    if noted:
        progress("differs, does not refuse: " + "; ".join(f"{d.field}: {d.detail}"
                                                          for d in noted))  # fmt: skip
    return manifest


def _fail_if_pages_failed(session: Session) -> None:
    if session.failure is not None:  # the lazy transfer failed: the memory is incomplete
        raise RestoreError(session.failure, phase=HostPhase.LAZY_PAGES)


def start_copies(
    image: Path,
    options: LaunchOptions,
    count: int,
    *,
    criu: CriuBinary,
    native: NativeStep,
    publish_base: tuple[str, int] | None,
    state: StateDir,
    progress_for: Callable[[str], Progress],
    lazy: bool = False,
    tools: Tools = REAL_TOOLS,
) -> list[tuple[Session, ActivationReport] | SnapctlError]:
    """Restore ``count`` copies at once, each with its own name, directories and port (and,
    with ``lazy``, its own lazy-pages daemon and work dir).

    ``progress_for(label)`` gives the progress callback of the copy labelled ``label``.
    """
    names: list[str | None] = (
        [*numbered_names(options.name, count)] if options.name else [None] * count
    )
    state.ensure()
    reservations: list[NameReservation] = []
    try:
        # Every name before anything starts: one in use fails them all, and nothing ran.
        for name in names:
            reservations.append(reserve_session_name(state, "copy", name))
        tools.images.verify(image.absolute(), state)  # once, before the parallel starts
    except BaseException:
        for reservation in reservations:
            reservation.release()
        raise

    def one(index: int) -> tuple[Session, ActivationReport] | SnapctlError:
        copy_options = replace(options, name=names[index])
        publish = None
        if publish_base is not None:
            publish = (publish_base[0], publish_base[1] + index if publish_base[1] else 0)
        try:
            return start_copy(
                image, copy_options, criu=criu, native=native, publish=publish, state=state,
                progress=progress_for(f"copy {index + 1}"), lazy=lazy,
                reservation=reservations[index], tools=tools,
            )  # fmt: skip
        except SnapctlError as error:
            return error

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(one, index) for index in range(count)]
        try:
            return [future.result() for future in futures]
        except BaseException:
            # Interrupted (Ctrl-C reaches only this thread), or a start raised something
            # unexpected: the copies that started are returned to no one, so stop them here,
            # and a first signal now must not cut that short.
            cleaning()
            for future in futures:
                with contextlib.suppress(BaseException):
                    started = future.result()  # after that start ended, one way or another
                    if isinstance(started, tuple):
                        started[0].stop()
            raise


def require_all(
    results: list[tuple[Session, ActivationReport] | SnapctlError], total_s: float
) -> tuple[list[Session], CopiesReport]:
    """``copy --count N``: all or nothing. If any copy of ``results`` (of
    :func:`start_copies`) failed, the others are stopped and one error says how many failed
    and why the first did."""
    sessions = [result[0] for result in results if isinstance(result, tuple)]
    failures = [result for result in results if isinstance(result, SnapctlError)]
    if failures:
        for session in sessions:
            session.stop()
        first = failures[0]
        error = SnapctlError(
            f"{len(failures)} of {len(results)} copies failed (the others were stopped): "
            f"{first.message}",
            phase=first.phase, path=first.path, log_tail=first.log_tail,
        )  # fmt: skip
        error.exit_status = first.exit_status  # why the first failed decides the exit status
        raise error
    reports = [result[1] for result in results if isinstance(result, tuple)]
    return sessions, CopiesReport(copies=reports, total_s=round(total_s, 6))
