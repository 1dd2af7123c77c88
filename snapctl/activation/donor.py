"""``snapctl donor``: launch, wait for capture-ready, dump with CRIU (leave running), publish
a verified image, then activate the continuing original (through :mod:`snapctl.activation.core`,
like a copy)."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

import snapctl
from snapctl.activation.core import (
    ActivationReport,
    activate_and_probe,
    activation_report,
    new_session,
    reserve_session_name,
)
from snapctl.activation.environment import server_environment
from snapctl.activation.launch import (
    LaunchOptions,
    fixture_command,
    redact_argv,
    snapshot_config_arg,
)
from snapctl.activation.native import NativeStep, timed
from snapctl.activation.session import Session
from snapctl.activation.states import SessionState
from snapctl.activation.tools import REAL_TOOLS, Tools
from snapctl.criu import CriuBinary
from snapctl.criu.ops import write_action_script
from snapctl.criu.stats import DumpStats
from snapctl.errors import ExitStatus, SnapctlError, is_no_space, no_space_message
from snapctl.images import ImageStaging, Manifest, ProcessEntry, hash_tree
from snapctl.namespaces.devices import BUILT
from snapctl.namespaces.layout import SANDBOX_LOGS_DIR
from snapctl.phases import HostPhase
from snapctl.progress import Progress
from snapctl.protocol.facts import FACTS_ENV, FACTS_FILE, CaptureFacts, read_facts
from snapctl.protocol.models import CaptureReady
from snapctl.statedir import StateDir


class CaptureError(SnapctlError):
    """The capture (native step, CRIU dump, publication) failed; no image was published."""

    exit_status = ExitStatus.CAPTURE_FAILED


@dataclass
class _Captured:
    manifest: Manifest
    image: Path


def _process_tree(pids: list[int]) -> list[ProcessEntry]:
    entries = []
    for pid in pids:
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
    tools: Tools,
    facts: CaptureFacts | None = None,
) -> _Captured:
    """Dump the running tree into a staging directory and publish it; the tree keeps running."""
    root = session.tree
    clock = tools.clock
    try:
        pids = tools.sandbox.tree_pids(root.pid)
        process_tree = _process_tree(pids)
        started = clock()
        # Read while the tree waits at its barrier: it maps and opens nothing new until released.
        identity = tools.images.capture_identity(
            pids, criu_version=criu.version, server_argv=server_argv, server_env=server_env,
            state=session.state_dir,
        )  # fmt: skip
        timings["identity"] = clock() - started
        external_mounts = tools.sandbox.external_mounts(root.pid, session.dirs)
        stats = _dump(
            session, pids, staging, criu=criu, native=native, options=options,
            external_mounts=external_mounts, timings=timings, tools=tools,
        )  # fmt: skip
        started = clock()
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
            root_pid=root.pid,
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
            files=hash_tree(staging.dir),
            identity=identity,
            capture_facts=facts,
            server_env_names=sorted(server_env),
            sandbox_dev=BUILT,
        )
        published = staging.publish(manifest)
        timings["publish"] = clock() - started
        return _Captured(manifest=manifest, image=published)
    except BaseException as error:
        staging.abort()
        translated = _capture_error(error, staging)
        if translated is None:
            raise
        raise translated from error


def _dump(
    session: Session,
    pids: list[int],
    staging: ImageStaging,
    *,
    criu: CriuBinary,
    native: NativeStep,
    options: LaunchOptions,
    external_mounts: dict[str, str],
    timings: dict[str, float],
    tools: Tools,
) -> DumpStats:
    """Native checkpoint, descriptor inventory, ``criu dump``, native restore: the tree runs
    on after it, whatever failed (the native restore runs after a failed dump too)."""
    clock = tools.clock
    with timed(native, timings, "native_checkpoint"):
        native.before_dump(pids, options.timeout_s)
    action = write_action_script(session.dirs.work / "action-script", staging.dir / "shm")
    started = clock()
    try:
        # What CRIU cannot dump is refused before CRIU runs, so the tree is never frozen for
        # nothing; after the native step, which releases devices, as CRIU would see it.
        tools.criu.require_dumpable(pids)
        timings["inventory"] = clock() - started
        started = clock()
        stats = tools.criu.dump(
            criu,
            session.tree.pid,
            staging.dir / "criu",
            # In the activation's logs, which outlive a failed capture's staging directory.
            session.dirs.logs / "dump.log",
            external_mounts=external_mounts,
            action_script=action,
            timeout_s=options.timeout_s,
        )
    except BaseException as dump_error:
        if "inventory" in timings:  # the dump itself ran
            timings["dump"] = clock() - started
        try:
            native.after_dump(pids, options.timeout_s)
        except SnapctlError as native_error:
            # Both failed: the dump's error stays the primary one, the native one is named.
            if isinstance(dump_error, SnapctlError):
                dump_error.message += f"; then the native restore failed too: {native_error}"
                dump_error.args = (dump_error.message,)
        raise
    timings["dump"] = clock() - started
    (staging.dir / "logs").mkdir(exist_ok=True)
    shutil.copy2(session.dirs.logs / "dump.log", staging.dir / "logs" / "dump.log")
    with timed(native, timings, "native_restore"):
        native.after_dump(pids, options.timeout_s)
    return stats


def _capture_error(error: BaseException, staging: ImageStaging) -> CaptureError | None:
    """The capture's error for ``error`` (None: let it through as it is, e.g. an interrupt)."""
    if is_no_space(error):
        # Still the capture's error (and exit status), saying ENOSPC, where, and how much.
        where = staging.dir.parent
        message = no_space_message(where, "capture failed, no image published")
        return CaptureError(message, phase=HostPhase.CAPTURE, path=where)
    if isinstance(error, SnapctlError):
        return CaptureError(
            f"capture failed, no image published: {error.message}",
            phase=HostPhase.CAPTURE,
            path=error.path,
            log_tail=error.log_tail,
        )
    if isinstance(error, OSError):
        return CaptureError(f"capture failed, no image published: {error}", phase=HostPhase.CAPTURE)
    return None


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
    tools: Tools = REAL_TOOLS,
) -> tuple[Session, ActivationReport]:
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
        session = new_session(
            state, "donor", options.name, reservation, options=options, tools=tools
        )
    except BaseException:
        staging.abort()
        raise
    try:
        if options.server_argv:
            argv, cwd = list(options.server_argv), Path.cwd()
        else:
            progress("preparing the bundled fixture model")
            argv, cwd = fixture_command(options, state)
        argv = [*argv, "--snapshot-config", snapshot_config_arg(options.server_timeout_s)]
        # The defaults and what the caller named, not the caller's whole environment: the
        # image holds the tree's memory, the environment included, wherever it travels.
        env = server_environment(options, os.environ)
        if options.api_key and not options.server_argv:
            env["FIXTURE_API_KEY"] = options.api_key
        # Where a snapctl-aware server states its memory policy and first digests.
        env[FACTS_ENV] = f"{SANDBOX_LOGS_DIR}/{FACTS_FILE}"
        progress("launching the server in fresh namespaces")
        session.advance(SessionState.LAUNCHING)
        started = tools.clock()
        session.launched(
            *tools.sandbox.launch(argv, cwd, session.dirs, options, env, cgroup=session.cgroup)
        )
        progress("waiting for capture-ready.json")
        ready = tools.sandbox.wait_capture_ready(
            session.dirs, session.tree, options.ready_timeout_s
        )
        timings["launch_to_capture_ready"] = tools.clock() - started
        session.advance(SessionState.CAPTURE_READY)
        session.remember_tree()
        facts = read_facts(session.dirs.logs / FACTS_FILE)
        progress("capturing the process tree with CRIU")
        captured = capture(
            session, ready, staging=staging, criu=criu, native=native,
            server_argv=argv, server_cwd=cwd, options=options, timings=timings,
            server_env=env, tools=tools, facts=facts,
        )  # fmt: skip
        session.image = captured.image
        session.advance(SessionState.PARKED)
        phases: list[str] = []
        if activate_donor:
            progress("activating the donor")
            phases = activate_and_probe(
                session, ready.capture_id, options, publish, timings, tools=tools
            )
        report = activation_report(
            session, captured.manifest, timings, phases, dump_stats=captured.manifest.dump_stats
        )
        return session, report
    except BaseException as error:
        staging.abort()
        session.stop_failed_start(error)
        raise
