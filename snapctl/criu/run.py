"""One reproducible CRIU invocation: argv recorded, log kept, failures raised with the log tail."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from snapctl.criu.locate import CriuBinary
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.logtail import log_tail
from snapctl.supervision.signals import interrupts_deferred

# Every invocation logs at debug level unless its caller has a reason to log less (dumps and
# restores, on the paths users wait for: snapctl.criu.ops).
DEFAULT_LOG_LEVEL = 4
# CRIU logs the line that explains a failure well before its last lines: keep that many first.
ERROR_LINES_KEPT = 10


# CRIU actions whose failure means "the capture failed" or "the activation failed".
CAPTURE_ACTIONS = frozenset({"dump", "pre-dump"})
ACTIVATION_ACTIONS = frozenset({"restore", "lazy-pages"})


class CriuError(SnapctlError):
    """CRIU exited non-zero or timed out; carries the action, exit code and, as ``log_tail``,
    the lines that explain it (without ``tail``: those of its log, error lines first)."""

    def __init__(
        self,
        action: str,
        returncode: int | None,
        log_path: Path,
        tail: str | None = None,
        reason: str = "",
    ) -> None:
        what = reason or ("timed out" if returncode is None else f"exited with status {returncode}")
        if tail is None:
            tail = log_tail(log_path, keep_errors=ERROR_LINES_KEPT)
        super().__init__(
            f"criu {action} {what} (log: {log_path})", path=log_path, log_tail=tail or None
        )
        self.action = action
        self.returncode = returncode
        self.log_path = log_path
        if action in CAPTURE_ACTIONS:
            self.exit_status = ExitStatus.CAPTURE_FAILED
        elif action in ACTIVATION_ACTIONS:
            self.exit_status = ExitStatus.ACTIVATION_FAILED


@dataclass(frozen=True)
class CriuResult:
    """A finished CRIU run."""

    action: str
    argv: tuple[str, ...]
    log_path: Path
    seconds: float


def criu_argv(
    criu: CriuBinary,
    action: str,
    images_dir: Path,
    log_path: Path,
    args: Sequence[str],
    log_level: int = DEFAULT_LOG_LEVEL,
) -> tuple[str, ...]:
    """The full argv of ``criu ACTION``, also written to ``<log>.argv`` beside the log."""
    argv = (
        *criu.argv,
        action,
        "--images-dir",
        str(images_dir),
        "--log-file",
        str(log_path),
        f"-v{log_level}",
        *args,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The exact argv beside the log makes every run reproducible by hand.
    log_path.with_suffix(".argv").write_text(shlex.join(argv) + "\n")
    return argv


def spawn_criu(
    criu: CriuBinary,
    action: str,
    images_dir: Path,
    log_path: Path,
    args: Sequence[str] = (),
    *,
    pass_fds: Sequence[int] = (),
    log_level: int = DEFAULT_LOG_LEVEL,
) -> subprocess.Popen[bytes]:
    """Start a long-running ``criu ACTION`` (a service such as ``lazy-pages``) as our child.

    Its own stdout/stderr (rarely more than a line) go to ``<log>.out``; it gets a session of
    its own so a terminal's Ctrl-C reaches snapctl, which stops it in order, and not CRIU.
    """
    argv = criu_argv(criu, action, images_dir, log_path, args, log_level)
    with log_path.with_suffix(".out").open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
        )


class CriuProcess:
    """A started ``criu ACTION`` that runs to completion (dump, restore): :meth:`finish` waits
    for it and raises :class:`CriuError` unless it succeeded."""

    def __init__(
        self, criu: CriuBinary, action: str, images_dir: Path, log_path: Path,
        args: Sequence[str], *, env: Mapping[str, str] | None, pass_fds: Sequence[int],
        log_level: int,
    ) -> None:  # fmt: skip
        self.action = action
        self.log_path = log_path
        self.argv = criu_argv(criu, action, images_dir, log_path, args, log_level)
        self.started = time.monotonic()
        self._interrupted: KeyboardInterrupt | None = None
        try:
            # An interrupt raised inside Popen would lose a CRIU already running: it is
            # deferred until the process is ours, then kept for finish to raise.
            with interrupts_deferred():
                # A new session keeps a terminal's Ctrl-C away from CRIU, and an interrupt in
                # finish waits for CRIU to finish: killed half-way, it leaves a frozen tree or
                # an unknown restored one.
                self.process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    pass_fds=tuple(pass_fds),
                    start_new_session=True,
                )
        except KeyboardInterrupt as error:
            if not hasattr(self, "process"):
                raise
            self._interrupted = error

    def finish(self, timeout_s: float) -> CriuResult:
        """Wait until CRIU exits (killing it after ``timeout_s`` from its start)."""
        proc, action, log_path = self.process, self.action, self.log_path
        interrupted: BaseException | None = self._interrupted
        deadline = self.started + timeout_s
        while True:
            try:
                output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0))
                break
            except subprocess.TimeoutExpired as error:
                # Its whole process group: a wrapper (nsenter into a container) forks CRIU,
                # which a kill of the wrapper alone would leave running, holding the pipe.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.communicate()
                raise CriuError(action, None, log_path) from error
            except KeyboardInterrupt as error:
                interrupted = error
        if interrupted is not None:
            raise interrupted
        seconds = time.monotonic() - self.started
        if proc.returncode != 0:
            printed = output.decode(errors="replace").strip()
            tail = log_tail(log_path, keep_errors=ERROR_LINES_KEPT)
            raise CriuError(action, proc.returncode, log_path, f"{printed}\n{tail}".strip())
        return CriuResult(action=action, argv=self.argv, log_path=log_path, seconds=seconds)


def start_criu(
    criu: CriuBinary,
    action: str,
    images_dir: Path,
    log_path: Path,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    log_level: int = DEFAULT_LOG_LEVEL,
) -> CriuProcess:
    """Start ``criu ACTION``; the caller must :meth:`CriuProcess.finish` it."""
    return CriuProcess(
        criu, action, images_dir, log_path, args, env=env, pass_fds=pass_fds, log_level=log_level
    )


def run_criu(
    criu: CriuBinary,
    action: str,
    images_dir: Path,
    log_path: Path,
    args: Sequence[str] = (),
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    log_level: int = DEFAULT_LOG_LEVEL,
) -> CriuResult:
    """Run ``criu ACTION`` to completion; raise :class:`CriuError` unless it succeeds."""
    if not (timeout_s > 0 and timeout_s < float("inf")):
        raise ValueError("timeout_s must be positive and finite")
    started = start_criu(
        criu, action, images_dir, log_path, args, env=env, pass_fds=pass_fds, log_level=log_level
    )
    return started.finish(timeout_s)
