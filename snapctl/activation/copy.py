"""``snapctl copy``: verify an image, stage fresh directories, restore into new namespaces
with CRIU, then activate the copy exactly like the donor."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.activation.donor import (
    ActivationReport,
    activate_and_probe,
    activation_report,
    new_session,
    reserve_session_name,
)
from snapctl.activation.gate import check_identity
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.lazy import HOLD_TRANSFER_MIN_BYTES, LazyTransfer
from snapctl.activation.native import NativeStep, NoNativeStep, timed, tree_pids_when_read
from snapctl.activation.session import Session
from snapctl.criu import CriuBinary, CriuError, read_restore_stats
from snapctl.criu.external import host_mount_sources, is_host_key
from snapctl.criu.kdat import with_private_run
from snapctl.criu.netdumps import redundant_net_dumps
from snapctl.criu.ops import LazyPagesDaemon, restore_tree, restore_tree_lazily
from snapctl.criu.pagemap import lazy_view
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images import ImageError, Manifest, stage_shm_copy, verify_image
from snapctl.images.lock import hold_image
from snapctl.logtail import log_tail
from snapctl.supervision.names import NameReservation, numbered_names
from snapctl.supervision.process import PinnedProcess, ProcessGoneError, become_subreaper
from snapctl.supervision.state import StateDir

Progress = Callable[[str], None]


class CopiesReport(BaseModel):
    """The machine-readable record of ``copy --count N``: each copy and the total wall time."""

    model_config = ConfigDict(extra="forbid")

    copies: list[ActivationReport]
    total_s: float


class RestoreError(SnapctlError):
    """CRIU could not restore the image; nothing of the copy was left running."""

    exit_status = ExitStatus.ACTIVATION_FAILED


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
    reservation: NameReservation | None = None,
) -> tuple[Session, ActivationReport]:
    """Restore one copy and activate it; on failure stop and clean up, then raise.

    Qualification's hooks, whatever they raise fails the copy: ``after_restore`` runs once CRIU
    restored the tree, before the native step (a lazy-fault run kills the daemon there, before
    a native restore pulls every page in); ``before_activation`` runs after the native step,
    before activation.json (fault runs inject a fault into this activation only).

    With ``lazy`` the copy serves while its memory still arrives (``session.lazy`` watches the
    transfer; the report's ``pages_complete`` says whether it had finished by then). The image
    is held shared from before its verification until the copy no longer reads it.

    The name is reserved first (or ``reservation``, taken by the caller, is used and owned
    from here on): a name in use is refused before anything else happens.
    """
    state.ensure()
    if reservation is None:
        reservation = reserve_session_name(state, "copy", options.name)
    timings: dict[str, float] = {}
    image = image.absolute()
    # Shared: another copy may read it too, but no rm/replace while we depend on it.
    try:
        hold = hold_image(image)
    except (FileNotFoundError, NotADirectoryError) as error:
        reservation.release()
        message = f"{image} is not a published image ({error.strerror})"
        raise ImageError(message, path=image) from error
    except BaseException:
        reservation.release()
        raise
    try:
        progress("verifying the image")
        started = time.monotonic()
        manifest = verify_image(image, cache_dir=state.verified)
        timings["verify"] = time.monotonic() - started
        progress("checking this host against the image's identity")
        started = time.monotonic()
        shown = check_identity(
            manifest, image, criu_version=criu.version, options=options, state=state
        )
        timings["identity"] = time.monotonic() - started
        waived = [d for d in shown if d.refuses]
        if waived:
            progress("waived: " + "; ".join(f"{d.field}: {d.detail}" for d in waived))
        noted = [d for d in shown if not d.refuses]
        if noted:
            progress("differs, does not refuse: " + "; ".join(f"{d.field}: {d.detail}"
                                                              for d in noted))  # fmt: skip
        # Restored trees are reparented to the nearest subreaper: let that be us.
        become_subreaper()
        session = new_session(state, "copy", options.name, reservation)
    except BaseException:
        hold.release()
        reservation.release()
        raise
    session.image = image
    session.image_hold = hold
    session.host, session.port = options.host, options.port
    pidfile = session.dirs.work / "root.pid"
    try:
        # Restores (and lazy-pages daemons) skip CRIU's kernel probe with a cache for this boot.
        criu = with_private_run(criu, state.criu)
        _restore(session, image, manifest, criu, options, timings, progress, lazy=lazy)
        assert session.root is not None
        if after_restore is not None:
            after_restore(session)
        if session.failure is not None:  # the lazy transfer failed: the memory is incomplete
            raise RestoreError(session.failure, phase="lazy-pages")
        if session.lazy is not None and native.name != NoNativeStep.name:
            # A native restore (cuda-checkpoint) reads much of the memory: in bulk, not by faults.
            session.lazy.release_transfer()
        with timed(native, timings, "native_restore"):
            native.after_restore(tree_pids_when_read(session.root.pid), options.timeout_s)
        if before_activation is not None:
            before_activation(session)
        progress("activating the copy")
        try:
            phases = activate_and_probe(session, manifest.capture_id, options, publish, timings)
        except SnapctlError as error:
            if error.log_tail is None:
                error.log_tail = log_tail(session.dirs.server_log)
            raise
        if session.failure is not None:
            raise RestoreError(session.failure, phase="lazy-pages")
        return session, _report(session, manifest, timings, phases)
    except BaseException as error:
        if session.root is None and pidfile.exists():
            # Interrupted after CRIU restored the tree but before we pinned it.
            with contextlib.suppress(ProcessGoneError, ValueError):
                session.root = PinnedProcess(int(pidfile.read_text().strip()))
        session.stop_failed_start(error)
        raise


def _restore(
    session: Session,
    image: Path,
    manifest: Manifest,
    criu: CriuBinary,
    options: LaunchOptions,
    timings: dict[str, float],
    progress: Progress,
    *,
    lazy: bool,
) -> None:
    """Stage the copy's directories and restore its tree (pinned as ``session.root``).

    Lazy: see :func:`_restore_lazily`. Plain: every page is in place when CRIU returns, so the
    image is let go at once.
    """
    pidfile = session.dirs.work / "root.pid"
    progress("staging the copy's directories")
    started = time.monotonic()
    stage_shm_copy(image / "shm", session.dirs.shm)
    timings["stage"] = time.monotonic() - started
    external_dirs = {
        **{k: session.dirs.host_dir_for(k) for k in manifest.external_mounts if not is_host_key(k)},
        **host_mount_sources(manifest.external_mounts),
    }
    if lazy:
        _restore_lazily(session, image, criu, options, timings, progress, pidfile, external_dirs)
    else:
        progress("restoring with CRIU")
        started = time.monotonic()
        try:
            restore_tree(
                criu, image / "criu", session.dirs.work, session.dirs.logs / "restore.log",
                pidfile, external_dirs=external_dirs, timeout_s=options.timeout_s,
            )  # fmt: skip
        except SnapctlError as error:
            raise _criu_failed("criu restore failed", error, session, "restore") from error
        timings["restore"] = time.monotonic() - started
    session.root = PinnedProcess(int(pidfile.read_text().strip()))
    session.remember_tree()
    if session.lazy is None:
        session.release_image()
    elif session.lazy.status.state == "failed":
        # It died before we could pin the tree, so its watcher had nothing to kill yet.
        session.kill_unsafe(session.lazy.status.failure or "lazy-pages daemon failed")


def _restore_lazily(
    session: Session,
    image: Path,
    criu: CriuBinary,
    options: LaunchOptions,
    timings: dict[str, float],
    progress: Progress,
    pidfile: Path,
    external_dirs: dict[str, Path],
) -> None:
    """Restore with ``--lazy-pages`` and the copy's own lazy-pages daemon on its own work dir,
    started together (:func:`restore_tree_lazily`); ``session.lazy`` watches the daemon from
    the moment it listens. Both read the image through a view in the work dir in which only big
    runs of memory stay lazy (see :mod:`snapctl.criu.pagemap`) and the network dumps that
    restore nothing are left out (:mod:`snapctl.criu.netdumps`). With much memory left lazy,
    the daemon's background transfer is held back until the copy is ready
    (:mod:`snapctl.criu.relay`): until then it only serves faults."""
    progress("restoring with CRIU")
    view_started = time.monotonic()
    view = session.dirs.work / "images"
    try:
        omit = redundant_net_dumps(image / "criu")
        summary = lazy_view(image / "criu", view, cache_dir=session.state.views, omit=omit)
    except (SnapctlError, OSError) as error:
        raise RestoreError(
            f"cannot build the lazy restore's image view: {error}", phase="restore", path=view
        ) from error
    timings["lazy_view"] = time.monotonic() - view_started

    def watch(daemon: LazyPagesDaemon) -> None:
        # From now on a daemon that dies, during the restore or after, fails the copy.
        timings["lazy_pages_start"] = time.monotonic() - started
        session.lazy = LazyTransfer(
            daemon, restore_started=started, on_failure=session.kill_unsafe,
            on_done=session.pages_done,
        )  # fmt: skip

    started = time.monotonic()
    try:
        restore_tree_lazily(
            criu, view, session.dirs.work, session.dirs.logs, pidfile,
            external_dirs=external_dirs, timeout_s=options.timeout_s, on_daemon_ready=watch,
            hold_transfer=summary.lazy_bytes >= HOLD_TRANSFER_MIN_BYTES,
        )  # fmt: skip
    except SnapctlError as error:
        if isinstance(error, CriuError) and error.action == "lazy-pages":
            raise _criu_failed(
                "criu lazy-pages failed to start", error, session, "lazy-pages"
            ) from error
        if session.lazy is not None:
            # Its daemon ends with the failed restore: a consequence, not the cause.
            session.lazy.stop()
            session.failure = None
        raise _criu_failed("criu restore failed", error, session, "restore") from error
    timings["restore"] = time.monotonic() - started


def _criu_failed(what: str, error: SnapctlError, session: Session, log: str) -> RestoreError:
    """The restore's error for a CRIU step that failed, pointing at that step's log."""
    return RestoreError(
        f"{what}: {error}",
        phase="restore",
        path=session.dirs.logs / f"{log}.log",
        log_tail=error.excerpt,
    )


def _report(
    session: Session, manifest: Manifest, timings: dict[str, float], phases: list[str]
) -> ActivationReport:
    pages = session.pages
    return activation_report(
        session, manifest, timings, phases,
        restore_stats=read_restore_stats(session.dirs.work).model_dump(),
        lazy=pages is not None,
        lazy_pages_pid=None if session.lazy is None else session.lazy.daemon.pid,
        pages_complete=None if pages is None else pages.state == "complete",
        pages_complete_s=None if pages is None else pages.complete_s,
        pages_complete_at=None if pages is None else pages.complete_at,
    )  # fmt: skip


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
        verify_image(image.absolute(), cache_dir=state.verified)  # once, before the parallel starts
    except BaseException:
        for reservation in reservations:
            reservation.release()
        raise

    def one(index: int) -> tuple[Session, ActivationReport] | SnapctlError:
        copy_options = LaunchOptions(**{**options.__dict__})
        copy_options.name = names[index]
        publish = None
        if publish_base is not None:
            publish = (publish_base[0], publish_base[1] + index if publish_base[1] else 0)
        try:
            return start_copy(
                image, copy_options, criu=criu, native=native, publish=publish, state=state,
                progress=progress_for(f"copy {index + 1}"), lazy=lazy,
                reservation=reservations[index],
            )  # fmt: skip
        except SnapctlError as error:
            return error

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(one, index) for index in range(count)]
        try:
            return [future.result() for future in futures]
        except BaseException:
            # Interrupted (Ctrl-C reaches only this thread), or a start raised something
            # unexpected: the copies that started are returned to no one, so stop them here.
            for future in futures:
                with contextlib.suppress(BaseException):
                    started = future.result()  # after that start ended, one way or another
                    if isinstance(started, tuple):
                        started[0].stop()
            raise


def start_all_copies(
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
) -> tuple[list[Session], CopiesReport]:
    """``copy --count N``: all or nothing. If any copy fails, the others are stopped and one
    error says how many failed and why the first did."""
    started = time.monotonic()
    results = start_copies(
        image, options, count, criu=criu, native=native, publish_base=publish_base,
        state=state, progress_for=progress_for, lazy=lazy,
    )  # fmt: skip
    total_s = time.monotonic() - started
    sessions = [result[0] for result in results if isinstance(result, tuple)]
    failures = [result for result in results if isinstance(result, SnapctlError)]
    if failures:
        for session in sessions:
            session.stop()
        first = failures[0]
        raise SnapctlError(
            f"{len(failures)} of {count} copies failed (the others were stopped): {first}",
            phase=first.phase, path=first.path,
        )  # fmt: skip
    reports = [result[1] for result in results if isinstance(result, tuple)]
    return sessions, CopiesReport(copies=reports, total_s=round(total_s, 6))
