"""``snapctl donor``: launch, wait for capture-ready, dump with CRIU (leave running), publish
a verified image, then activate the continuing original."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict

import snapctl
from snapctl.activation.gate import capture_identity
from snapctl.activation.handshake import activate, probe_http_ready
from snapctl.activation.launch import (
    LaunchOptions,
    fixture_command,
    launch_in_sandbox,
    redact_argv,
    snapshot_config_arg,
    wait_capture_ready,
)
from snapctl.activation.lazy import TRANSFER_AFTER_READY_S
from snapctl.activation.native import NativeStep, timed, tree_pids
from snapctl.activation.session import CleanupAudit, Session
from snapctl.criu import CriuBinary, read_dump_stats
from snapctl.criu.external import sandbox_external_mounts
from snapctl.criu.inventory import require_dumpable
from snapctl.criu.ops import dump_tree, write_action_script
from snapctl.criu.stats import DumpStats
from snapctl.errors import ExitStatus, SnapctlError, is_no_space, no_space_message
from snapctl.images import ImageStaging, Manifest, ProcessEntry, hash_tree
from snapctl.namespaces.layout import EXTERNAL_MOUNT_KEYS, ActivationDirs
from snapctl.protocol.models import CaptureReady
from snapctl.supervision.names import NameReservation
from snapctl.supervision.state import StateDir

Progress = Callable[[str], None]


class CaptureError(SnapctlError):
    """The capture (native step, CRIU dump, publication) failed; no image was published."""

    exit_status = ExitStatus.CAPTURE_FAILED


class ActivationReport(BaseModel):
    """The one machine-readable record of a started activation (``--json``)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    image: str | None
    image_id: str | None
    activation_id: str
    root_pid: int
    pids: list[int]
    host: str | None
    port: int
    published: str | None
    logs: str
    timings_s: dict[str, float]
    image_bytes: int | None = None
    dump_stats: DumpStats | None = None
    restore_stats: dict[str, int] | None = None
    handshake_phases: list[str] = []
    # A lazy copy serves before its memory is all in place (see snapctl.activation.lazy).
    # pages_complete: None when not lazy; False while the lazy-pages daemon still transfers;
    # True once it exited 0, pages_complete_s after the restore started (at pages_complete_at).
    lazy: bool = False
    lazy_pages_pid: int | None = None
    pages_complete: bool | None = None
    pages_complete_s: float | None = None
    pages_complete_at: str | None = None


@dataclass
class _Captured:
    manifest: Manifest
    image: Path


def new_activation_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def reserve_session_name(state: StateDir, kind: str, name: str | None) -> NameReservation:
    """Reserve the activation's name (``name``, else a fresh activation id) before anything
    starts; a name in use is refused here (see ``snapctl.supervision.names``)."""
    return state.reserve_name(name or new_activation_id(kind))


def new_session(
    state: StateDir, kind: str, name: str | None, reservation: NameReservation | None = None
) -> Session:
    """A session with fresh directories, under ``reservation`` (taken here when None). The
    session owns the reservation from here on, and releases it when it stops; if this fails,
    the reservation is released."""
    if reservation is None:
        reservation = reserve_session_name(state, kind, name)
    try:
        # Unnamed, the activation goes by its id, which is what was reserved.
        activation_id = reservation.name if name is None else new_activation_id(kind)
        dirs = ActivationDirs(
            root=state.activations / activation_id, logs=state.logs / activation_id
        )
        dirs.create()
    except BaseException:
        reservation.release()
        raise
    return Session(
        name=reservation.name, activation_id=activation_id, kind=kind, dirs=dirs, state=state,
        reservation=reservation,
    )  # fmt: skip


def _process_tree(root_pid: int) -> list[ProcessEntry]:
    entries = []
    for pid in tree_pids(root_pid):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                entries.append(
                    ProcessEntry(
                        pid=pid,
                        ppid=proc.ppid(),
                        name=proc.name(),
                        threads=proc.num_threads(),
                        cmdline=redact_argv(proc.cmdline()),
                    )
                )
        except psutil.NoSuchProcess:
            continue
    return entries


def capture(
    session: Session,
    ready: CaptureReady,
    *,
    staging: ImageStaging,
    criu: CriuBinary,
    native: NativeStep,
    server_argv: list[str],
    server_cwd: Path,
    options: LaunchOptions,
    timings: dict[str, float],
    server_env: Mapping[str, str],
) -> _Captured:
    """Dump the running tree into a staging directory and publish it; the tree keeps running."""
    assert session.root is not None
    try:
        pids = tree_pids(session.root.pid)
        process_tree = _process_tree(session.root.pid)
        started = time.monotonic()
        # Read while the tree waits at its barrier: it maps and opens nothing new until released.
        identity = capture_identity(
            pids, criu_version=criu.version, server_argv=server_argv, server_env=server_env,
            state=session.state,
        )  # fmt: skip
        timings["identity"] = time.monotonic() - started
        external_mounts = sandbox_external_mounts(
            session.root.pid, EXTERNAL_MOUNT_KEYS, session.dirs.host_binds()
        )
        with timed(native, timings, "native_checkpoint"):
            native.before_dump(pids, options.timeout_s)
        action = write_action_script(session.dirs.work / "action-script", staging.dir / "shm")
        started = time.monotonic()
        try:
            # What CRIU cannot dump is refused before CRIU runs, so the tree is never frozen
            # for nothing; after the native step, which releases devices, as CRIU would see it.
            require_dumpable(pids)
            timings["inventory"] = time.monotonic() - started
            started = time.monotonic()
            dump_tree(
                criu,
                session.root.pid,
                staging.dir / "criu",
                # In the activation's logs, which outlive a failed capture's staging directory.
                session.dirs.logs / "dump.log",
                external_mounts=external_mounts,
                action_script=action,
                timeout_s=options.timeout_s,
            )
        except BaseException as dump_error:
            if "inventory" in timings:  # the dump itself ran
                timings["dump"] = time.monotonic() - started
            try:
                native.after_dump(pids, options.timeout_s)
            except SnapctlError as native_error:
                # Both failed: the dump's error stays the primary one, the native one is named.
                if isinstance(dump_error, SnapctlError):
                    dump_error.message += f"; then the native restore failed too: {native_error}"
                    dump_error.args = (dump_error.message,)
            raise
        timings["dump"] = time.monotonic() - started
        (staging.dir / "logs").mkdir(exist_ok=True)
        shutil.copy2(session.dirs.logs / "dump.log", staging.dir / "logs" / "dump.log")
        with timed(native, timings, "native_restore"):
            native.after_dump(pids, options.timeout_s)
        stats = read_dump_stats(staging.dir / "criu")
        started = time.monotonic()
        files = hash_tree(staging.dir)
        manifest = Manifest(
            image_id=uuid.uuid4().hex,
            capture_id=ready.capture_id,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            snapctl_version=snapctl.__version__,
            criu_version=criu.version,
            kernel=platform.release(),
            hostname=socket.gethostname(),
            python_version=platform.python_version(),
            server_argv=redact_argv(server_argv),
            server_cwd=str(server_cwd),
            oracle=ready.oracle,
            root_pid=session.root.pid,
            process_tree=process_tree,
            dump_stats=stats,
            dump_seconds=round(timings["dump"], 6),
            native_step=native.name,
            external_mounts=external_mounts,
            lo_addresses=options.lo_addresses,
            host=options.host,
            port=options.port,
            shm_files=sorted(
                str(p.relative_to(staging.dir / "shm")) for p in (staging.dir / "shm").rglob("*")
            ),
            files=files,
            identity=identity,
        )
        published = staging.publish(manifest)
        timings["publish"] = time.monotonic() - started
        return _Captured(manifest=manifest, image=published)
    except BaseException as error:
        staging.abort()
        if is_no_space(error):
            # Still the capture's error (and exit status), saying ENOSPC, where, and how much.
            where = staging.dir.parent
            message = no_space_message(where, "capture failed, no image published")
            raise CaptureError(message, phase="capture", path=where) from error
        if isinstance(error, SnapctlError):
            raise CaptureError(
                f"capture failed, no image published: {error}",
                phase="capture",
                path=error.path,
                log_tail=error.excerpt,
            ) from error
        if isinstance(error, OSError):
            raise CaptureError(
                f"capture failed, no image published: {error}", phase="capture"
            ) from error
        raise


def start_donor(
    options: LaunchOptions,
    *,
    image: Path,
    force: bool,
    criu: CriuBinary,
    native: NativeStep,
    publish: tuple[str, int] | None,
    state: StateDir,
    progress: Progress,
    activate_donor: bool = True,
) -> tuple[Session, ActivationReport, CleanupAudit | None]:
    """Launch → capture-ready → dump → publish → (activate the donor). On failure everything
    started is stopped and audited before the error propagates."""
    state.ensure()
    timings: dict[str, float] = {}
    # Refuse a name in use and an existing or unwritable image path before anything launches.
    reservation = reserve_session_name(state, "donor", options.name)
    try:
        staging = ImageStaging(image, force=force, claims=state.claims)
    except BaseException:
        reservation.release()
        raise
    try:
        session = new_session(state, "donor", options.name, reservation)
    except BaseException:
        staging.abort()
        raise
    session.host, session.port = options.host, options.port
    try:
        if options.server_argv:
            argv, cwd = list(options.server_argv), Path.cwd()
        else:
            progress("preparing the bundled fixture model")
            argv, cwd = fixture_command(options, state)
        argv = [*argv, "--snapshot-config", snapshot_config_arg(options.server_timeout_s)]
        env = dict(os.environ)
        if options.api_key and not options.server_argv:
            env["FIXTURE_API_KEY"] = options.api_key
        progress("launching the server in fresh namespaces")
        started = time.monotonic()
        session.launcher, session.root = launch_in_sandbox(argv, cwd, session.dirs, options, env)
        progress("waiting for capture-ready.json")
        ready = wait_capture_ready(session.dirs, session.root, options.ready_timeout_s)
        timings["launch_to_capture_ready"] = time.monotonic() - started
        session.remember_tree()
        progress("capturing the process tree with CRIU")
        captured = capture(
            session, ready, staging=staging, criu=criu, native=native,
            server_argv=argv, server_cwd=cwd, options=options, timings=timings,
            server_env=os.environ,
        )  # fmt: skip
        session.image = captured.image
        phases: list[str] = []
        if activate_donor:
            progress("activating the donor")
            phases = activate_and_probe(session, ready.capture_id, options, publish, timings)
        report = activation_report(
            session, captured.manifest, timings, phases, dump_stats=captured.manifest.dump_stats
        )
        return session, report, None
    except BaseException as error:
        staging.abort()
        session.stop_failed_start(error)
        raise


def activation_report(
    session: Session,
    manifest: Manifest,
    timings: dict[str, float],
    phases: list[str],
    **details: Any,
) -> ActivationReport:
    """The report of an activation that serves: what every kind has, read from its session
    and image, plus ``details``, the fields of its own kind."""
    assert session.root is not None
    return ActivationReport(
        name=session.name,
        kind=session.kind,
        image=None if session.image is None else str(session.image),
        image_id=manifest.image_id,
        activation_id=session.activation_id,
        root_pid=session.root.pid,
        pids=session.current_pids,
        host=session.host,
        port=session.port,
        published=session.published,
        logs=str(session.dirs.logs),
        timings_s={k: round(v, 6) for k, v in timings.items()},
        image_bytes=manifest.total_bytes,
        handshake_phases=phases,
        **details,
    )


def activate_and_probe(
    session: Session,
    capture_id: str,
    options: LaunchOptions,
    publish: tuple[str, int] | None,
    timings: dict[str, float],
) -> list[str]:
    """Handshake, then probe public HTTP through the activation's netns, then publish."""
    assert session.root is not None
    # Its thread enters the netns while the server validates, not after. A tree that is gone
    # already (stopped by a failing lazy transfer, say) fails the handshake, with its reason.
    with contextlib.suppress(OSError):
        session.connect_network()
    started = time.monotonic()
    handshake = activate(
        session.control,
        capture_id=capture_id,
        activation_id=session.activation_id,
        kind="donor" if session.kind == "donor" else "copy",
        host=session.host,
        port=session.port,
        timeout_s=options.timeout_s,
        alive=session.root.alive,
    )
    timings["handshake"] = time.monotonic() - started
    session.connect_network()
    assert session.connector is not None
    timings["validated_to_http_200"] = probe_http_ready(
        session.connector,
        session.host or "127.0.0.1",
        session.port,
        api_key=options.api_key,
        timeout_s=options.timeout_s,
        alive=session.root.alive,
    )
    if session.lazy is not None:
        # Ready: the rest of a lazy copy's memory may stream in now, before anyone can ask.
        session.lazy.release_transfer(TRANSFER_AFTER_READY_S)
    session.publish(publish)
    session.remember_tree()
    session.save_record()
    return handshake.phases
