"""Launching a server as PID 1 of fresh namespaces and waiting until it is ready for capture."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import snapctl
from snapctl.activation.timeouts import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    READY_TIMEOUT_S,
    SERVER_TIMEOUT_S,
    ready_timeout_hint,
    server_timeout_hint,
)
from snapctl.cgroups import ActivationCgroup, Limits
from snapctl.errors import ExitStatus, ProcessExitedError, SnapctlError, WaitTimeoutError
from snapctl.logtail import log_tail, text_tail
from snapctl.namespaces.devices import host_device_nodes
from snapctl.namespaces.hostview import PrivatePathError, host_binds
from snapctl.namespaces.layout import (
    SANDBOX_CONTROL_DIR,
    SANDBOX_INIT_MODULE,
    ActivationDirs,
    BindMount,
    SandboxSpec,
)
from snapctl.phases import HostPhase
from snapctl.protocol.models import CaptureReady, ControlFile, ErrorReport, SnapshotConfig
from snapctl.protocol.waiter import wait_for
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess, ProcessGoneError

SECRET_FLAGS = ("--api-key", "--token", "--hf-token", "--password")


class LaunchError(SnapctlError):
    """The server could not be launched or died / stalled before capture-ready."""

    exit_status = ExitStatus.CAPTURE_FAILED


@dataclass
class LaunchOptions:
    """How to start a server for capture (``server_argv`` None: the bundled fixture)."""

    server_argv: list[str] | None = None
    name: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    lo_addresses: list[str] = field(default_factory=list)
    api_key_env: str | None = None
    # The server's environment beyond its defaults: ``--env``/``--env-file`` as resolved, and
    # ``--inherit-env`` (see snapctl.activation.environment).
    env: dict[str, str] = field(default_factory=dict)
    inherit_env: bool = False
    # Each step's wall-clock limit (dump, handshake, probe), except the wait for capture-ready.
    timeout_s: float = DEFAULT_TIMEOUT_S
    server_timeout_s: float = SERVER_TIMEOUT_S
    ready_timeout_s: float = READY_TIMEOUT_S
    fixture_params_mb: int = 4
    fixture_retained_mb: int = 16
    fixture_kv_mb: int = 8
    # Identity fields a copy may differ in (``--allow-mismatch``); see images.identity.compare.
    allow_mismatch: tuple[str, ...] = ()
    # The activation's cgroup limits (``--memory``, ``--cpus``); see snapctl.cgroups.
    limits: Limits = field(default_factory=Limits)
    # A copy restored inside this running container (its name, ID or first process's PID):
    # ``copy --into-container``, see snapctl.activation.container. None: on this host.
    into_container: str | None = None

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def repo_root() -> Path:
    return Path(snapctl.__file__).resolve().parent.parent


def redact_argv(argv: list[str]) -> list[str]:
    """Replace the values of secret-bearing flags by ``***``."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            redacted.append("***")
            hide_next = False
        elif arg in SECRET_FLAGS:
            redacted.append(arg)
            hide_next = True
        elif arg.split("=", 1)[0] in SECRET_FLAGS and "=" in arg:
            redacted.append(arg.split("=", 1)[0] + "=***")
        else:
            redacted.append(arg)
    return redacted


def fixture_command(options: LaunchOptions, state: StateDir) -> tuple[list[str], Path]:
    """The bundled fixture's serve command (building its model once), and its cwd."""
    root = repo_root()
    if not (root / "fixtures" / "__init__.py").is_file():
        raise LaunchError(f"the bundled fixture is not beside snapctl ({root / 'fixtures'})")
    model = state.models / f"fixture-{options.fixture_params_mb}mb"
    if not (model / "config.json").exists():
        tmp = state.models / f".{model.name}.{uuid.uuid4().hex[:8]}"
        built = subprocess.run(
            [sys.executable, "-m", "fixtures", "build-model", "--out", str(tmp),
             "--params-mb", str(options.fixture_params_mb)],
            cwd=root, check=False, capture_output=True,
        )  # fmt: skip
        if built.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise LaunchError(
                f"building the fixture model failed (status {built.returncode})",
                phase=HostPhase.LAUNCH,
                path=model,
                log_tail=text_tail(built.stderr.decode(errors="replace")),
            )
        try:
            os.rename(tmp, model)
        except OSError:
            # Built concurrently by another snapctl: theirs is byte-identical.
            shutil.rmtree(tmp, ignore_errors=True)
    argv = [
        sys.executable, "-m", "fixtures", "serve", "--model", str(model),
        "--host", options.host, "--port", str(options.port),
        "--retained-mb", str(options.fixture_retained_mb), "--kv-mb", str(options.fixture_kv_mb),
        # The strictest reload: every recovery maps the file again and compares its digests,
        # so qualify's changed-weights fault has something to catch.
        "--memory-policy", "reload", "--reload-digests",
    ]  # fmt: skip
    return argv, root


def _find_namespace_root(unshare: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The host PID of PID 1 in the new namespace: unshare's only child."""
    deadline = time.monotonic() + timeout_s
    parent = psutil.Process(unshare.pid)
    while time.monotonic() < deadline:
        children = parent.children()
        if children:
            return children[0].pid
        if unshare.poll() is not None:
            raise LaunchError(f"unshare exited with status {unshare.returncode} before forking")
        time.sleep(0.002)
    raise LaunchError("unshare did not start the namespace's first process in time")


def launch_in_sandbox(
    argv: list[str],
    cwd: Path,
    dirs: ActivationDirs,
    options: LaunchOptions,
    env: dict[str, str],
    cgroup: ActivationCgroup | None = None,
) -> tuple[subprocess.Popen[bytes], PinnedProcess]:
    """Start ``argv`` as PID 1 (and session leader) of new pid/net/ipc/uts/mount namespaces,
    inside ``cgroup`` from before unshare forks (so every process of the tree is born there).

    A bare program name is looked up on ``env``'s PATH here: the sandbox's init execs a path.
    """
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
    if program is None:
        raise LaunchError(f"{argv[0]}: no such program on PATH", phase=HostPhase.LAUNCH)
    argv = [program, *argv[1:]]
    try:
        host_paths = host_binds(argv, str(cwd))
    except PrivatePathError as error:
        raise LaunchError(str(error), phase=HostPhase.LAUNCH, path=cwd) from error
    spec = SandboxSpec(
        argv=argv,
        cwd=str(cwd),
        env=env,
        binds=[
            *dirs.binds(),
            *(BindMount(host=path, target=path, no_symlinks=True) for path in host_paths),
            # The sandbox's /dev is its own; GPUs' nodes are the host's, bound in.
            *(BindMount(host=path, target=path, no_symlinks=True) for path in host_device_nodes()),
        ],
        lo_addresses=options.lo_addresses,
    )
    spec_path = dirs.sandbox_spec
    spec_path.write_text(spec.model_dump_json())
    spec_path.chmod(0o600)
    launcher_log = dirs.launcher_log.open("ab")
    try:
        command = ["unshare", "--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--",
                   sys.executable, "-m", SANDBOX_INIT_MODULE, str(spec_path)]  # fmt: skip
        unshare = subprocess.Popen(
            command if cgroup is None else cgroup.enter_argv(command),
            stdin=subprocess.DEVNULL, stdout=launcher_log, stderr=launcher_log,
            close_fds=True, start_new_session=True, cwd=str(repo_root()),
        )  # fmt: skip
    finally:
        launcher_log.close()
    try:
        return unshare, PinnedProcess(_find_namespace_root(unshare, 10.0))
    except BaseException:
        # The caller never gets ``unshare``, so no session can stop it: end it here.
        _end_launch(unshare)
        raise


def _end_launch(unshare: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launch that failed half-way: the namespace's PID 1 (which takes the whole
    namespace along) if unshare forked it already, then unshare itself, reaped."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(unshare.pid).children():
            with contextlib.suppress(ProcessGoneError):
                pinned = PinnedProcess(child.pid)
                # Still unshare's child (unshare is not reaped, so its PID is not reused).
                if psutil.Process(child.pid).ppid() == unshare.pid:
                    pinned.signal(signal.SIGKILL)
                    pinned.wait(10.0)
                pinned.close()
    unshare.kill()
    unshare.wait()


def snapshot_config_arg(timeout_s: float) -> str:
    config = SnapshotConfig(mode="startup", control_dir=SANDBOX_CONTROL_DIR, timeout_s=timeout_s)
    return json.dumps(config.model_dump(mode="json"), separators=(",", ":"))


def wait_capture_ready(dirs: ActivationDirs, root: PinnedProcess, timeout_s: float) -> CaptureReady:
    """Wait for capture-ready.json under our own deadline (``--ready-timeout``), watching the
    tree."""
    from snapctl.protocol.controldir import ControlDir

    control = ControlDir(dirs.control)

    def failed(message: str) -> LaunchError:
        path, tail = dirs.server_log, log_tail(dirs.server_log)
        if not tail.strip():
            # A sandbox that failed to start never ran the server: its reason is here.
            path, tail = dirs.launcher_log, log_tail(dirs.launcher_log)
        return LaunchError(message, phase=HostPhase.LAUNCH, path=path, log_tail=tail)

    try:
        _, model = wait_for(
            control, (ControlFile.CAPTURE_READY, ControlFile.ERROR), timeout_s, alive=root.alive
        )
    except ProcessExitedError as error:
        report = control.read(ControlFile.ERROR)
        detail = ""
        if report:
            hint = server_timeout_hint(report.error_type, report.error)
            detail = f"; error.json: {report.phase}: {report.error}{hint}"
        raise failed(f"server exited before capture-ready{detail}") from error
    except WaitTimeoutError as error:
        raise failed(
            f"capture-ready.json did not appear within {timeout_s:g} s{ready_timeout_hint()}"
        ) from error
    if isinstance(model, ErrorReport):
        raise failed(
            f"server failed before capture: {model.phase}: {model.error_type}: {model.error}"
            + server_timeout_hint(model.error_type, model.error)
        )
    assert isinstance(model, CaptureReady)
    return model
