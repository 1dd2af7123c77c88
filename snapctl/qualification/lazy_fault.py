"""The ``lazy-fault`` run: a lazy copy whose ``criu lazy-pages`` daemon dies while pages are
still missing must be stopped at once, fail naming the daemon's death, and leave nothing; its
image must stay intact, verified and free for an exclusive hold.

The copy restores with its background transfer held (as a big image's is): its daemon serves
page faults only, and has not begun to push pages when the run takes over, right after CRIU
restored the copy (``start_copy``'s ``after_restore``), within the hold's 2 s deadline. The run
pins the daemon by pidfd (checked by its start time, never found by name), pauses it with
SIGSTOP, checks that it is still transferring, releases the transfer (the restore's finished
word reaches the stopped daemon: it would now push every remaining page), then SIGKILLs it.
Everything after that is snapctl's own doing: the transfer's watcher SIGKILLs the copy,
``start_copy`` fails and cleans up, and the run only watches and audits. An attempt whose
daemon exited, or whose hold's deadline came, before the pause tests nothing: it is stopped and
retried afresh.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from snapctl.activation.copy import start_copy
from snapctl.activation.session import Session
from snapctl.criu.lazy.relay import TransferHold
from snapctl.criu.lazy.transfer import PagesStatus
from snapctl.errors import SnapctlError
from snapctl.images import load_manifest, verify_image
from snapctl.images.lock import hold_image
from snapctl.qualification import checks
from snapctl.qualification.runs import (
    LazyPages,
    RunContext,
    RunResult,
    Timings,
    artifacts_dir,
    image_hashes,
    read_control,
    save_control,
    save_new_logs,
)
from snapctl.qualification.watch import ListenerWatch, residue, take_baseline
from snapctl.supervision.process import PinnedProcess, ProcessGoneError, wait_gone

RUN = "lazy-fault"
ATTEMPTS = 3
# How long the copy may take to be gone once its daemon was killed ("at once", with room for a
# loaded machine); how long a SIGSTOP may take to be delivered; and the released finished word
# to reach the daemon's socket.
STOP_BOUND_S = 10.0
PAUSE_TIMEOUT_S = 10.0
PASS_ON_TIMEOUT_S = 10.0


class _NotPausable(Exception):
    """The daemon exited, or its held transfer started, before it was paused: this attempt
    can test nothing."""


@dataclass
class LazyFaultSeen:
    """What one attempt showed, before it is judged."""

    session: Session | None = None
    daemon_pid: int | None = None
    paused: bool = False
    exited: bool = False
    kill_to_exit_s: float | None = None
    left: list[int] = field(default_factory=list)
    listeners: list[str] = field(default_factory=list)
    polls: int = 0
    pages: PagesStatus | None = None


def _proc_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` ("" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def pause(process: PinnedProcess, timeout_s: float = PAUSE_TIMEOUT_S) -> bool:
    """SIGSTOP a pinned process and wait until it is stopped; False if it exited first."""
    process.signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _proc_state(process.pid)
        # Read by PID: trusted only while the pidfd says the process has not exited, since a
        # PID cannot be reused before its process exited.
        if not process.alive():
            return False
        if state == "T":
            return True
        time.sleep(0.001)
    raise SnapctlError(f"process {process.pid} did not stop within {timeout_s:g} s of SIGSTOP")


def kill_daemon_midway(ctx: RunContext, session: Session, seen: LazyFaultSeen) -> None:
    """Pause the copy's lazy-pages daemon, check pages are still missing, SIGKILL it, and watch
    snapctl stop the copy. Returns with the tree gone, so ``start_copy`` fails by itself."""
    assert session.lazy is not None  # a lazy copy: its transfer
    seen.session = session
    daemon = session.lazy.daemon
    seen.daemon_pid = daemon.pid
    watch = ListenerWatch(session.tree.pid, session.port, alive=session.tree.alive)
    try:
        try:
            # Our child, but the watcher thread reaps it the moment it exits: pin it, and
            # refuse a PID that already names another process.
            pinned = PinnedProcess(daemon.pid, expected_start=daemon.start_time)
        except ProcessGoneError:
            raise _NotPausable from None
        with pinned:
            hold = session.lazy.daemon.hold
            if hold is None:
                raise SnapctlError("the lazy-fault run's copy was restored without a held transfer")
            if session.lazy.status.state != "transferring" or not pause(pinned):
                raise _NotPausable
            if hold.passed_on.is_set():
                # Its hold's deadline (tuning.TRANSFER_HOLD_MAX_S after the restore) came
                # first: its pages may all be in by now.
                raise _NotPausable
            # Stopped, it cannot finish: pages are missing until it runs again, and it never will.
            _release_to_stopped(hold, session)
            seen.paused = True
            # One look from here: the watch thread may not get to run before the tree is gone.
            watch.poll_once()
            ctx.progress(f"{RUN}: killing the lazy-pages daemon {daemon.pid} mid-transfer")
            killed = time.monotonic()
            pinned.signal(signal.SIGKILL)
        seen.exited = session.tree.wait(STOP_BOUND_S)
        if seen.exited:
            # PID 1 is gone; the kernel takes the rest of its namespace along asynchronously.
            seen.left = wait_gone(session.tree_pids, STOP_BOUND_S)
            seen.kill_to_exit_s = time.monotonic() - killed
        seen.pages = session.lazy.wait(STOP_BOUND_S)
    finally:
        seen.listeners, seen.polls = watch.stop()
        with contextlib.suppress(OSError):
            save_control(read_control(session), ctx.run_dir(RUN))


def _release_to_stopped(hold: TransferHold, session: Session) -> None:
    """Start the held transfer of a paused daemon: its restore's finished word is queued on
    its socket once this returns, as it is for a daemon killed while it pushes pages."""
    assert session.lazy is not None
    session.lazy.release_transfer()
    if not hold.passed_on.wait(PASS_ON_TIMEOUT_S):
        raise SnapctlError(
            f"the held transfer was not passed on to the lazy-pages daemon within "
            f"{PASS_ON_TIMEOUT_S:g} s of its release ({hold.error or 'no relay error'})"
        )


def _hook(ctx: RunContext, seen: LazyFaultSeen) -> Callable[[Session], None]:
    return lambda session: kill_daemon_midway(ctx, session, seen)


def _image_usable(ctx: RunContext) -> str | None:
    """Why the image is not usable after the run (None: it verifies and is free)."""
    try:
        verify_image(ctx.image)  # no cache: every file is hashed again
        hold_image(ctx.image, exclusive=True).release()
    except (SnapctlError, OSError) as error:
        return str(error)
    return None


def _failure_file(session: Session | None) -> str | None:
    if session is None:
        return None
    try:
        return (session.dirs.logs / "failure.txt").read_text()
    except OSError:
        return None


def run_lazy_fault(ctx: RunContext) -> RunResult:
    """Restore a lazy copy, kill its lazy-pages daemon mid-transfer, and expect the copy
    stopped, the failure reported, nothing left and the image intact and free."""
    started = time.monotonic()
    baseline = take_baseline(ctx.state)
    before = image_hashes(ctx.image)
    manifest = load_manifest(ctx.image)
    error: str | None = None  # the run could not do its job
    raised: str | None = None  # what start_copy raised once the daemon was killed
    seen = LazyFaultSeen()
    attempt = 0
    for attempt in range(1, ATTEMPTS + 1):
        seen = LazyFaultSeen()
        try:
            session, _ = start_copy(
                ctx.image, ctx.options, criu=ctx.criu, native=ctx.native, publish=None,
                state=ctx.state, progress=lambda step: ctx.progress(f"{RUN}: {step}"),
                after_restore=_hook(ctx, seen), lazy=True, hold_transfer=True,
            )  # fmt: skip
            session.stop()
            error = "the copy activated and served despite its lazy-pages daemon's death"
        except _NotPausable:
            ctx.progress(f"{RUN}: the daemon could not be paused in time (attempt {attempt})")
            continue
        except SnapctlError as failure:
            if seen.paused:
                raised = failure.message
            else:
                error = failure.message
        except OSError as failure:  # pinning or watching failed: say so, go on
            error = f"{type(failure).__name__}: {failure}"
        break
    how, audit = "", None
    if seen.session is not None:
        # start_copy stopped it already; a second stop only audits what is left.
        how, audit = seen.session.stop()
    res = residue(ctx.state, baseline, manifest.shm_files)
    found = [checks.check_completed(error)]
    if seen.session is not None and (seen.paused or error is None):
        # (A run that failed before its pause already says why in "run completed".)
        found.append(checks.check_transfer_running(seen.paused, attempt, seen.daemon_pid))
    if seen.paused:
        found += [
            checks.check_copy_stopped(seen.exited, seen.kill_to_exit_s, seen.left, STOP_BOUND_S),
            checks.check_failure_reported(
                seen.session.failure if seen.session else None,
                seen.pages,
                raised,
                _failure_file(seen.session),
            ),
            checks.check_no_listener(seen.listeners, seen.polls),
        ]
    found.append(checks.check_image_unchanged(before, image_hashes(ctx.image)))
    found.append(checks.check_image_usable(_image_usable(ctx)))
    found.append(checks.check_cleanup(audit, res, how or None))
    return RunResult(
        name=RUN,
        kind="lazy-fault",
        # Every attempt's logs: the copy never reached the caller.
        activation_ids=save_new_logs(ctx, baseline, RUN),
        checks=found,
        timings=Timings(kill_to_exit_s=seen.kill_to_exit_s),
        lazy=True,
        pages=_pages(seen),
        wall_s=time.monotonic() - started,
        cleanup=audit,
        residue=res,
        artifacts=artifacts_dir(ctx, RUN),
    )


def _pages(seen: LazyFaultSeen) -> LazyPages | None:
    if seen.daemon_pid is None:
        return None
    return LazyPages(
        lazy_pages_pid=seen.daemon_pid,
        complete_when_ready=False,  # never ready
        pages_complete=seen.pages is not None and seen.pages.state == "complete",
        failure=None if seen.pages is None else seen.pages.failure,
    )
