"""Small pieces of activation: argv redaction, --publish parsing, the native step seam."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import click
import psutil
import pytest

from snapctl.activation import launch
from snapctl.activation.launch import LaunchError, LaunchOptions, fixture_command, redact_argv
from snapctl.activation.native import (
    CudaCheckpoint,
    NativeStepError,
    NoNativeStep,
    native_step,
    timed,
    tree_pids_when_read,
)
from snapctl.cli._activation_options import parse_publish
from snapctl.namespaces.layout import ActivationDirs, SandboxSpec
from snapctl.statedir import StateDir
from snapctl.supervision.process import wait_gone


def test_redact_argv_hides_secret_values() -> None:
    argv = ["vllm", "serve", "m", "--api-key", "sk-1", "--hf-token=abc", "--port", "8000"]
    assert redact_argv(argv) == [
        "vllm", "serve", "m", "--api-key", "***", "--hf-token=***", "--port", "8000",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8080", ("127.0.0.1", 8080)), ("127.0.0.2:9", ("127.0.0.2", 9)), ("0", ("127.0.0.1", 0))],
)
def test_parse_publish(value: str, expected: tuple[str, int]) -> None:
    assert parse_publish(value) == expected


@pytest.mark.parametrize("value", ["x", "1:70000", "host:"])
def test_parse_publish_rejects(value: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_publish(value)


def fake_cuda_checkpoint(tmp_path: Path, fail_action: str = "") -> tuple[Path, Path]:
    calls = tmp_path / "calls"
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        f'[ "$2" = "{fail_action}" ] && {{ echo "boom" >&2; exit 3; }}\n'
        "exit 0\n"
    )
    tool.chmod(0o755)
    return tool, calls


def test_cuda_checkpoint_runs_each_action_for_cuda_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool, calls = fake_cuda_checkpoint(tmp_path)
    monkeypatch.setattr("snapctl.activation.native.holds_cuda", lambda pid: pid != 3)
    step = CudaCheckpoint(str(tool))
    step.before_dump([1, 2, 3], timeout_s=5)
    step.after_restore([1], timeout_s=5)
    assert calls.read_text().splitlines() == [
        "--action lock --pid 1", "--action lock --pid 2",
        "--action checkpoint --pid 1", "--action checkpoint --pid 2",
        "--action restore --pid 1", "--action unlock --pid 1",
    ]  # fmt: skip


def test_cuda_checkpoint_failure_names_action_and_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool, _ = fake_cuda_checkpoint(tmp_path, fail_action="checkpoint")
    monkeypatch.setattr("snapctl.activation.native.holds_cuda", lambda pid: True)
    with pytest.raises(NativeStepError, match="checkpoint failed") as info:
        CudaCheckpoint(str(tool)).before_dump([42], timeout_s=5)
    assert info.value.pid == 42


def test_a_native_steps_pids_are_scanned_only_when_it_reads_them() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    pids = tree_pids_when_read(gone.pid)
    NoNativeStep().after_restore(pids, timeout_s=5)  # never reads them: nothing scanned
    with pytest.raises(NativeStepError, match="before its native step"):
        list(pids)  # a step that reads them scans, and finds the tree gone
    assert next(tree_pids_when_read(os.getpid())) == os.getpid()


def test_native_step_names() -> None:
    assert native_step("none").name == "none"
    with pytest.raises(NativeStepError):
        native_step("bogus")


def test_fixture_model_that_cannot_be_built_is_a_launch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    monkeypatch.setattr(launch.sys, "executable", "/bin/false")
    with pytest.raises(LaunchError, match="building the fixture model failed") as info:
        fixture_command(LaunchOptions(fixture_params_mb=1), state)
    assert info.value.phase == "launch"
    assert list(state.models.iterdir()) == []  # its half-built directory is gone too


@pytest.mark.criu
def test_a_launch_failing_half_way_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[subprocess.Popen[bytes], int]] = []

    def root_found_too_late(unshare: subprocess.Popen[bytes], timeout_s: float) -> int:
        parent = psutil.Process(unshare.pid)
        deadline = time.monotonic() + 30
        while not parent.children():
            assert unshare.poll() is None and time.monotonic() < deadline, "no namespace root"
            time.sleep(0.01)  # until the namespace's PID 1 exists, then fail anyway
        seen.append((unshare, parent.children()[0].pid))
        raise LaunchError("injected: no namespace root")

    monkeypatch.setattr(launch, "_find_namespace_root", root_found_too_late)
    dirs = ActivationDirs(root=tmp_path / "activation", logs=tmp_path / "logs")
    dirs.create()
    try:
        with pytest.raises(LaunchError, match="injected"):
            launch.launch_in_sandbox(
                ["sleep", "60"], tmp_path, dirs, LaunchOptions(), {"PATH": os.environ["PATH"]}
            )
        [(unshare, namespace_root)] = seen
        assert unshare.returncode is not None  # killed and reaped
        assert wait_gone([namespace_root], 10.0) == []
        # The bare name was looked up on PATH: the sandbox's init execs a path.
        spec = SandboxSpec.model_validate_json((dirs.root / "sandbox.json").read_text())
        assert spec.argv == [shutil.which("sleep"), "60"]
    finally:
        dirs.remove()


def test_a_program_not_on_path_fails_before_anything_starts(tmp_path: Path) -> None:
    dirs = ActivationDirs(root=tmp_path / "activation", logs=tmp_path / "logs")
    with pytest.raises(LaunchError, match="no-such-server: no such program on PATH"):
        launch.launch_in_sandbox(
            ["no-such-server", "serve"], tmp_path, dirs, LaunchOptions(), {"PATH": "/usr/bin"}
        )


def test_native_step_times_are_recorded_only_for_a_real_step(tmp_path: Path) -> None:
    timings: dict[str, float] = {}
    with timed(NoNativeStep(), timings, "native_restore"):
        pass
    assert timings == {}
    tool, _ = fake_cuda_checkpoint(tmp_path)
    with timed(CudaCheckpoint(str(tool)), timings, "native_restore"):
        pass
    assert set(timings) == {"native_restore"} and timings["native_restore"] >= 0


@pytest.mark.parametrize(
    ("error_type", "error", "named"),
    [
        ("WaitTimeoutError", "timed out after 900 s waiting for activation.json", True),
        ("TimeoutError", "", True),  # asyncio.wait_for's, as vLLM reports it
        ("ProtocolError", "stale activation control: release.json already present", False),
    ],
)
def test_a_servers_own_timeout_before_capture_names_server_timeout(
    tmp_path: Path, error_type: str, error: str, named: bool
) -> None:
    from snapctl.supervision.process import PinnedProcess
    from tests.protocol.factories import make_control_dir, make_error

    dirs = ActivationDirs(root=tmp_path, logs=tmp_path / "logs")
    control = make_control_dir(tmp_path)
    control.write(make_error(phase="prepare", error_type=error_type, error=error))
    with pytest.raises(LaunchError, match="server failed before capture") as info:
        launch.wait_capture_ready(dirs, PinnedProcess(os.getpid()), 5.0)
    assert ("raise --server-timeout" in info.value.message) is named


@pytest.mark.parametrize("server_wrote", [True, False])
def test_a_failed_start_shows_the_server_log_or_else_the_sandbox_s(
    tmp_path: Path, server_wrote: bool
) -> None:
    from snapctl.supervision.process import PinnedProcess
    from tests.protocol.factories import make_control_dir, make_error

    dirs = ActivationDirs(root=tmp_path, logs=tmp_path / "logs")
    dirs.logs.mkdir()
    dirs.server_log.write_text("server: loading\n" if server_wrote else "")
    dirs.launcher_log.write_text("snapctl sandbox init failed: No such file: '/dev/null'\n")
    make_control_dir(tmp_path).write(make_error(phase="prepare", error="boom"))
    with pytest.raises(LaunchError) as info:
        launch.wait_capture_ready(dirs, PinnedProcess(os.getpid()), 5.0)
    shown = dirs.server_log if server_wrote else dirs.launcher_log
    assert info.value.path == shown
    assert info.value.log_tail == shown.read_text().strip()
