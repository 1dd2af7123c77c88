"""The runs whose activation must fail closed: a copy whose recovery fails (``fault``) and
copies given stale control (``stale``).

``fault`` and ``stale`` restore a real copy and take over between the restore and
activation.json (``start_copy``'s ``before_activation``): they inject the fault into that
activation only, drive the handshake, then watch the tree: error.json with the expected phase,
no listener on the public port at any poll, the root exiting by itself, and nothing left after.
Once everything is seen the hook raises :class:`_Concluded`, which makes ``start_copy`` run its
own cleanup.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from snapctl.activation.copy import start_copy
from snapctl.activation.handshake import ActivationError, activate
from snapctl.activation.session import CleanupAudit, Session
from snapctl.errors import SnapctlError
from snapctl.images import load_manifest
from snapctl.images.manifest import Manifest
from snapctl.namespaces.layout import SANDBOX_SHM_DIR
from snapctl.protocol.models import (
    Activation,
    Challenge,
    ControlFile,
    ErrorReport,
    Phase,
    Release,
    Status,
)
from snapctl.protocol.waiter import ControlDirWatcher
from snapctl.qualification import checks
from snapctl.qualification.faultmodes import FaultMode
from snapctl.qualification.memfault import MemoryFault, candidate_tensors, inject_memory_fault
from snapctl.qualification.reference import weights_file, weights_files
from snapctl.qualification.runs import (
    RunContext,
    RunResult,
    Timings,
    artifacts_dir,
    image_hashes,
    read_control,
    save_control,
    save_logs,
    save_new_logs,
)
from snapctl.qualification.watch import ListenerWatch, residue, take_baseline
from snapctl.supervision.process import PinnedProcess, descendants

FAULT_FILE = ".snapctl-qualify-fault-weights"
# How long a failed activation may take to exit by itself after error.json.
EXIT_TIMEOUT_S = 30.0


class _Concluded(Exception):
    """Raised by the hook once it has observed the failed activation to its end."""


@dataclass
class FailClosedSeen:
    """What a fail-closed activation showed, before it is judged."""

    activation_id: str = ""
    error: ErrorReport | None = None
    handshake_error: str | None = None
    phases: list[str] = field(default_factory=list)
    handshake_s: float | None = None
    exited: bool = False
    error_to_exit_s: float | None = None
    listeners: list[str] = field(default_factory=list)
    polls: int = 0
    exit_wait_s: float | None = None  # how long the run waited for the tree to exit by itself
    how: str = ""
    audit: CleanupAudit | None = None
    shutdown_s: float | None = None


Drive = Callable[[Session], list[str]]


def _observe_fail_closed(
    ctx: RunContext, session: Session, run: str, drive: Drive, seen: FailClosedSeen
) -> None:
    """Drive the handshake, watch the tree end by itself, save its files, stop, audit."""
    seen.activation_id = session.activation_id
    watch = ListenerWatch(session.tree.pid, session.port, alive=session.tree.alive)
    try:
        started = time.monotonic()
        try:
            seen.phases = drive(session)
        except SnapctlError as error:
            seen.handshake_error = error.message
        seen.handshake_s = time.monotonic() - started
        with contextlib.suppress(SnapctlError):
            seen.error = session.control.read(ControlFile.ERROR)
        with contextlib.suppress(SnapctlError):
            status = session.control.read(ControlFile.STATUS)
            # A status.json naming another activation is one the stale run planted.
            mine = status is not None and status.activation_id == session.activation_id
            if status is not None and mine and status.phase not in seen.phases:
                seen.phases.append(status.phase)
        if "validated" not in seen.phases:
            # Give it the time to exit on its own; a server that validated never would.
            seen.exit_wait_s = min(ctx.options.timeout_s, EXIT_TIMEOUT_S)
            waited = time.monotonic()
            seen.exited = session.tree.wait(seen.exit_wait_s)
            if seen.exited:
                seen.error_to_exit_s = time.monotonic() - waited
    finally:
        seen.listeners, seen.polls = watch.stop()
        target = ctx.run_dir(run)
        with contextlib.suppress(OSError):
            save_control(read_control(session), target)
        stopped = time.monotonic()
        seen.how, seen.audit = session.stop()
        seen.shutdown_s = time.monotonic() - stopped
        with contextlib.suppress(OSError):
            save_logs(session, target)
    raise _Concluded


def _activate(ctx: RunContext, manifest: Manifest) -> Drive:
    """The ordinary capturer handshake (it raises ActivationError on error.json)."""

    def drive(session: Session) -> list[str]:
        return activate(
            session.control, capture_id=manifest.capture_id,
            activation_id=session.activation_id, kind="copy", host=session.host,
            port=session.port, timeout_s=ctx.options.timeout_s, alive=session.tree.alive,
        ).phases  # fmt: skip

    return drive


def expect_error(
    seen: FailClosedSeen, phase: str, reason: checks.Reason | None = None
) -> checks.Check:
    return checks.check_error_phase(
        seen.error, expect_phase=phase, expect_reason=reason, capturer_saw=seen.handshake_error
    )


def _restore_failing(
    ctx: RunContext, run: str, kind: Literal["fault", "stale"], hook: Callable[[Session], None],
    seen: FailClosedSeen, judge: Callable[[], list[checks.Check]],
) -> RunResult:  # fmt: skip
    """Restore a copy with ``hook`` taking over its activation; then judge what it saw
    (``judge`` adds the run's own checks: the expected error.json and the like)."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    before = image_hashes(ctx.image)
    manifest = load_manifest(ctx.image)
    error: str | None = None
    try:
        session, _ = start_copy(
            ctx.image, ctx.options, criu=ctx.criu, native=ctx.native, publish=None,
            state=ctx.state, progress=lambda step: ctx.progress(f"{run}: {step}"),
            before_activation=hook,
        )  # fmt: skip
        session.stop()
        error = "the copy activated and served despite the fault"
    except _Concluded:
        pass
    except SnapctlError as failure:
        error = failure.message
    except OSError as failure:  # injecting the fault or watching failed: say so, go on
        error = f"{type(failure).__name__}: {failure}"
    res = residue(ctx.state, baseline, manifest.shm_files)
    found = [checks.check_completed(error)]
    if seen.activation_id:
        found += [
            *judge(),
            checks.check_never_validated(seen.phases),
            checks.check_no_listener(seen.listeners, seen.polls),
            checks.check_exited(seen.exited, seen.error_to_exit_s, seen.exit_wait_s),
        ]
    found.append(checks.check_image_unchanged(before, image_hashes(ctx.image)))
    found.append(checks.check_cleanup(seen.audit, res, seen.how or None))
    return RunResult(
        name=run,
        kind=kind,
        # Without a hook call the copy failed before activation: keep its logs all the same.
        activation_ids=[seen.activation_id]
        if seen.activation_id
        else save_new_logs(ctx, baseline, run),
        checks=found,
        timings=Timings(
            handshake_s=seen.handshake_s,
            error_to_exit_s=seen.error_to_exit_s,
            shutdown_s=seen.shutdown_s,
        ),
        wall_s=time.monotonic() - started,
        cleanup=seen.audit,
        residue=res,
        artifacts=artifacts_dir(ctx, run),
    )


# -- fault: recovery fails after memory wake ------------------------------------------------------


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _nsenter(root: PinnedProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``root``'s mount namespace. The namespace is opened by PID, then the
    pidfd is asked whether the process still runs: only then is it the copy's namespace and not
    that of a later process given the same PID; nsenter enters it through that descriptor."""
    try:
        namespace = os.open(f"/proc/{root.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise SnapctlError(f"cannot open the mount namespace of {root.pid}: {error}") from error
    try:
        if not root.alive():
            raise SnapctlError(f"the copy's root {root.pid} exited before the fault was injected")
        return subprocess.run(
            ["nsenter", f"--mount=/proc/self/fd/{namespace}", "--", *argv],
            capture_output=True, text=True, check=False, timeout=60, pass_fds=(namespace,),
        )  # fmt: skip
    finally:
        os.close(namespace)


@dataclass
class _WeightsFault:
    host_before: str = ""
    inside: str | None = None


def inject_weights_fault(
    session: Session, weights: str, mode: Literal["changed", "unreadable"], record: _WeightsFault
) -> None:
    """Make ``weights`` changed (one byte flipped) or unreadable in this activation's mount
    namespace only, by a bind mount made from outside; the host's file is not touched."""
    root = session.tree
    record.host_before = _sha256(weights)
    if mode == "changed":
        # The copy sees its own /dev/shm (this host directory): stage the changed file there.
        staged = session.dirs.shm / FAULT_FILE
        shutil.copyfile(weights, staged)
        with open(staged, "r+b") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - 10))
            byte = handle.read(1)
            handle.seek(max(0, size - 10))
            handle.write(bytes([byte[0] ^ 0xFF]))
        source = f"{SANDBOX_SHM_DIR}/{FAULT_FILE}"
    else:
        source = "/dev/null"
    try:
        proc = _nsenter(root, "mount", "--bind", source, weights)
        if proc.returncode != 0:
            raise SnapctlError(f"bind mount over {weights} failed: {proc.stderr.strip()}")
    finally:
        if mode == "changed":
            # The mount keeps the inode; the copy's /dev/shm shows nothing of ours.
            (session.dirs.shm / FAULT_FILE).unlink(missing_ok=True)
    proc = _nsenter(root, "sha256sum", weights)
    if proc.returncode == 0 and proc.stdout.split():
        record.inside = proc.stdout.split()[0]


def fault_mode_for(manifest: Manifest) -> FaultMode:
    """The fault a recovery under the image's memory policy must catch: a weight changed in
    memory where the weights come back with the pages (in-image), a changed weights file where
    each reload compares digests, else an unreadable weights file (the reload itself fails)."""
    facts = manifest.capture_facts
    if facts is None or (facts.memory_policy == "reload" and facts.reload_digests):
        return "changed"
    return "memory" if facts.memory_policy == "in-image" else "unreadable"


def run_fault(ctx: RunContext, mode: FaultMode = "auto") -> RunResult:
    """Restore a copy whose weights are changed (or unreadable) for that activation only:
    in its files, or (``memory``) in its memory."""
    manifest = load_manifest(ctx.image)
    if mode == "auto":
        mode = fault_mode_for(manifest)
    if mode == "memory":
        return _run_memory_fault(ctx, manifest)
    file_mode: Literal["changed", "unreadable"] = (
        "unreadable" if mode == "unreadable" else "changed"
    )
    weights_path = weights_file(manifest.server_argv)
    if weights_path is None:
        return RunResult(
            name="fault", kind="fault", wall_s=0.0,
            checks=[
                checks.failed(
                    "run completed",
                    "no local weights file found in the server command (--model PATH)",
                )
            ],
        )  # fmt: skip
    weights = str(weights_path)
    seen = FailClosedSeen()
    fault = _WeightsFault()
    drive = _activate(ctx, manifest)

    def hook(session: Session) -> None:
        inject_weights_fault(session, weights, file_mode, fault)
        _observe_fail_closed(ctx, session, "fault", drive, seen)

    def judge() -> list[checks.Check]:
        return [
            expect_error(seen, Phase.RECOVER.value),
            checks.check_fault_confined(fault.host_before, _sha256(weights), fault.inside, weights),
        ]

    return _restore_failing(ctx, "fault", "fault", hook, seen, judge)


def _run_memory_fault(ctx: RunContext, manifest: Manifest) -> RunResult:
    files = [p for p in weights_files(manifest.server_argv) if p.suffix == ".safetensors"]
    if not files:
        return RunResult(
            name="fault", kind="fault", wall_s=0.0,
            checks=[checks.failed("run completed", "no local weights file in the server command")],
        )  # fmt: skip
    tensors = candidate_tensors(files)
    seen = FailClosedSeen()
    fault = MemoryFault()
    drive = _activate(ctx, manifest)

    def hook(session: Session) -> None:
        inject_memory_fault(descendants(session.tree.pid), tensors, fault)
        _observe_fail_closed(ctx, session, "fault", drive, seen)

    def judge() -> list[checks.Check]:
        return [
            expect_error(seen, Phase.RECOVER.value),
            checks.check_memory_fault(fault.tensors, fault.places, fault.written),
        ]

    return _restore_failing(ctx, "fault", "fault", hook, seen, judge)


# -- stale: leftover control files, replayed release ----------------------------------------------


def _earlier(ctx: RunContext, manifest: Manifest) -> tuple[Challenge, Status, str]:
    """The previous activation's challenge and status (or a plausible earlier one)."""
    previous = ctx.previous_control
    with contextlib.suppress(Exception):
        challenge = Challenge.model_validate(previous[ControlFile.CHALLENGE.value])
        status = Status.model_validate(previous[ControlFile.STATUS.value])
        if challenge.capture_id == manifest.capture_id:
            return challenge, status, f"from the earlier activation {challenge.activation_id}"
    activation_id = f"copy-earlier-{uuid.uuid4().hex[:12]}"
    challenge = Challenge(
        capture_id=manifest.capture_id, activation_id=activation_id, nonce=uuid.uuid4().hex
    )
    status = Status(capture_id=manifest.capture_id, activation_id=activation_id, phase="validated")
    return challenge, status, "made up (no earlier activation in this qualification)"


def _replay_drive(ctx: RunContext, manifest: Manifest, earlier: Challenge) -> Drive:
    """Activate, then answer the fresh challenge with the earlier challenge's nonce."""

    def drive(session: Session) -> list[str]:
        alive = session.tree.alive
        deadline = time.monotonic() + ctx.options.timeout_s

        def send(payload: Activation | Release, *answers: ControlFile) -> object:
            session.control.write(payload)
            _, answer = watcher.wait_for(answers, deadline - time.monotonic(), alive=alive)
            return answer

        with ControlDirWatcher(session.control) as watcher:
            activation = Activation(
                capture_id=manifest.capture_id, activation_id=session.activation_id,
                kind="copy", native_complete=True, host=session.host, port=session.port,
            )  # fmt: skip
            challenge = send(activation, ControlFile.CHALLENGE, ControlFile.ERROR)
            if isinstance(challenge, ErrorReport):
                raise ActivationError(f"error.json before the challenge: {challenge.error}")
            assert isinstance(challenge, Challenge)
            # Only the nonce differs from the live challenge: only the nonce check can refuse.
            replayed = Release(
                capture_id=challenge.capture_id, activation_id=challenge.activation_id,
                nonce=earlier.nonce,
            )  # fmt: skip
            answer = send(replayed, ControlFile.ERROR, ControlFile.STATUS)
            if isinstance(answer, ErrorReport):
                raise ActivationError(f"server refused: {answer.error}", report=answer)
            assert isinstance(answer, Status)
            return [answer.phase]

    return drive


def _noting(check: checks.Check, note: str) -> checks.Check:
    return check.model_copy(update={"evidence": f"{check.evidence} [{note}]"})


def run_stale(ctx: RunContext) -> list[RunResult]:
    """Two copies: one finds the previous activation's release.json and status.json in its
    control directory, the other gets a release replayed from an earlier challenge."""
    manifest = load_manifest(ctx.image)
    challenge, status, origin = _earlier(ctx, manifest)
    results: list[RunResult] = []

    files_seen = FailClosedSeen()
    files_drive = _activate(ctx, manifest)

    def files_hook(session: Session) -> None:
        session.control.write(Release.answering(challenge))
        session.control.write(status)
        _observe_fail_closed(ctx, session, "stale-files", files_drive, files_seen)

    def files_judge() -> list[checks.Check]:
        check = expect_error(files_seen, Phase.CAPTURE_BARRIER.value, checks.STALE_CONTROL)
        return [_noting(check, f"stale release.json and status.json {origin}")]

    results.append(
        _restore_failing(ctx, "stale-files", "stale", files_hook, files_seen, files_judge)
    )

    replay_seen = FailClosedSeen()
    replay_drive = _replay_drive(ctx, manifest, challenge)

    def replay_hook(session: Session) -> None:
        _observe_fail_closed(ctx, session, "stale-replay", replay_drive, replay_seen)

    def replay_judge() -> list[checks.Check]:
        check = expect_error(replay_seen, Phase.CAPTURE_BARRIER.value, checks.RELEASE_MISMATCH)
        return [_noting(check, f"replayed nonce {challenge.nonce[:8]}… {origin}")]

    results.append(
        _restore_failing(ctx, "stale-replay", "stale", replay_hook, replay_seen, replay_judge)
    )
    return results
