"""run_startup_capture driven in a thread with fake hooks and a test-side capturer.

The capturer uses the real atomic writer and the real waiter. Every failure must end in
error.json naming the right phase (where the directory is safe to write), a
StartupCaptureError with the same phase, and no BindTarget.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.errors import CanaryMismatchError, ControlDirError, ProtocolError, WaitTimeoutError
from snapctl.launcher import BindTarget, StartupCaptureError, _control, run_startup_capture
from snapctl.protocol.atomic import write_json_atomic
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.facts import FACTS_ENV, CaptureFacts, read_facts
from snapctl.protocol.inotify import DirectoryWatch
from snapctl.protocol.models import (
    Activation,
    CaptureReady,
    Challenge,
    ControlFile,
    ErrorReport,
    Oracle,
    Phase,
    Release,
    SnapshotConfig,
)
from snapctl.protocol.waiter import wait_for
from tests.protocol.factories import (
    OTHER_CAPTURE_ID,
    activation_fields,
    make_control_dir,
    make_oracle,
    make_status,
)

ORACLE = make_oracle()
FAIL_TIMEOUT_S = 0.3  # the launcher's timeout where a test makes it wait in vain
# The frozen-wait tests' timeout: a test acts a third of it after the thaw, which must leave
# room for a loaded machine to schedule the test's thread before the budget runs out.
FROZEN_TIMEOUT_S = 1.5
WAIT_S = 5.0  # the capturer's deadline; tests end long before it
UUID4_HEX = r"[0-9a-f]{32}"


class HookFailure(Exception):
    pass


class FakeHooks:
    """Records each hook call with the control files present and the status phase at the time."""

    def __init__(
        self,
        control: ControlDir,
        canaries: list[Oracle] | None = None,
        fail_at: tuple[str, int] | None = None,
        failure: BaseException | None = None,
    ) -> None:
        self.control = control
        self.canaries = list(canaries or [])
        self.fail_at = fail_at
        self.failure = failure or HookFailure("hook exploded")
        self.events: list[str] = []
        self.seen: list[tuple[str, tuple[str, ...], str | None]] = []

    def _record(self, name: str) -> None:
        self.events.append(name)
        status = self.control.read(ControlFile.STATUS)
        present = tuple(item.value for item in self.control.present())
        self.seen.append((name, present, None if status is None else status.phase))
        if self.fail_at == (name, self.events.count(name)):
            raise self.failure

    def canary(self) -> Oracle:
        self._record("canary")
        return self.canaries.pop(0) if self.canaries else ORACLE

    def release_memory(self) -> None:
        self._record("release_memory")

    def restore_memory(self) -> None:
        self._record("restore_memory")

    def capture_facts(self) -> CaptureFacts:
        self._record("capture_facts")
        return CaptureFacts(memory_policy="in-image", parameter_digests={"w": "0" * 64})


PREPARE_EVENTS = ["canary", "release_memory", "restore_memory", "canary", "release_memory"]
RECOVERY_EVENTS = ["restore_memory", "canary"]


class LauncherRun:
    """run_startup_capture on a thread, as the server's main thread would run it."""

    def __init__(self, config: SnapshotConfig, hooks: FakeHooks, **options: Any) -> None:
        self.result: BindTarget | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, hooks, options))
        self._thread.daemon = True
        self._thread.start()

    def _run(self, config: SnapshotConfig, hooks: FakeHooks, options: dict[str, Any]) -> None:
        try:
            self.result = run_startup_capture(config, hooks, **options)
        except BaseException as error:
            self.error = error

    def join(self) -> None:
        self._thread.join(10)
        assert not self._thread.is_alive(), "launcher did not finish"


@pytest.fixture
def control(tmp_path: Path) -> ControlDir:
    return make_control_dir(tmp_path)


@pytest.fixture
def start(control: ControlDir) -> Iterator[Any]:
    runs: list[LauncherRun] = []

    def start_run(
        hooks: FakeHooks | None = None,
        timeout_s: float = WAIT_S,
        control_dir: ControlDir = control,
        **options: Any,
    ) -> LauncherRun:
        config = SnapshotConfig(
            mode="startup", control_dir=str(control_dir.path), timeout_s=timeout_s
        )
        run = LauncherRun(config, hooks or FakeHooks(control), **options)
        runs.append(run)
        return run

    yield start_run
    for run in runs:
        run.join()


# --- the test-side capturer -------------------------------------------------------------------


def await_ready(control: ControlDir) -> CaptureReady:
    arrival = wait_for(control, [ControlFile.CAPTURE_READY, ControlFile.ERROR], WAIT_S)
    assert isinstance(arrival.model, CaptureReady), arrival
    return arrival.model


def activate(control: ControlDir, ready: CaptureReady, **changes: Any) -> Activation:
    activation = Activation.model_validate(
        activation_fields(capture_id=ready.capture_id, **changes)
    )
    control.write(activation)
    return activation


def await_challenge(control: ControlDir) -> Challenge:
    arrival = wait_for(control, [ControlFile.CHALLENGE, ControlFile.ERROR], WAIT_S)
    assert isinstance(arrival.model, Challenge), arrival
    return arrival.model


def handshake(control: ControlDir, **changes: Any) -> tuple[CaptureReady, Activation, Challenge]:
    ready = await_ready(control)
    activation = activate(control, ready, **changes)
    challenge = await_challenge(control)
    assert challenge.activation_id == activation.activation_id
    control.write(Release.answering(challenge))
    return ready, activation, challenge


def expect_failure(
    run: LauncherRun,
    control: ControlDir,
    phase: Phase,
    error_type: type[BaseException],
    activation_id: str | None = None,
) -> ErrorReport:
    run.join()
    assert run.result is None
    assert isinstance(run.error, StartupCaptureError)
    assert run.error.phase == phase
    assert isinstance(run.error.__cause__, error_type)
    report = control.read(ControlFile.ERROR)
    assert report is not None, "error.json was not written"
    assert report.phase == phase.value
    assert report.error_type == error_type.__name__
    assert report.error == (str(run.error.__cause__) or error_type.__name__)
    assert report.activation_id == activation_id
    ready = control.read(ControlFile.CAPTURE_READY)
    if ready is not None:
        assert report.capture_id == ready.capture_id
    assert_no_tmp(control)
    return report


def assert_no_tmp(control: ControlDir) -> None:
    assert [name for name in os.listdir(control.path) if name.endswith(".tmp")] == []


# --- success ----------------------------------------------------------------------------------


def test_capture_facts_are_stated_before_capture_ready_where_snapctl_asks(
    control: ControlDir, start: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts_file = tmp_path / "facts" / "capture-facts.json"
    facts_file.parent.mkdir()
    monkeypatch.setenv(FACTS_ENV, str(facts_file))
    hooks = FakeHooks(control)
    run = start(hooks)
    handshake(control, kind="copy", host="127.0.0.1", port=8123)
    run.join()
    assert run.error is None
    # After the rehearsal's release, before anything is published.
    assert hooks.events == [*PREPARE_EVENTS, "capture_facts", *RECOVERY_EVENTS]
    assert hooks.seen[5][1] == ()
    assert read_facts(facts_file) == CaptureFacts(
        memory_policy="in-image", parameter_digests={"w": "0" * 64}
    )


class FactlessHooks:
    """Hooks written before capture facts existed: canary, release and restore only."""

    def __init__(self, hooks: FakeHooks) -> None:
        self.canary, self.release_memory = hooks.canary, hooks.release_memory
        self.restore_memory = hooks.restore_memory


def test_hooks_that_state_no_facts_capture_as_before(
    control: ControlDir, start: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts_file = tmp_path / "capture-facts.json"
    monkeypatch.setenv(FACTS_ENV, str(facts_file))
    hooks = FakeHooks(control)
    run = start(FactlessHooks(hooks))
    handshake(control, kind="copy", host="127.0.0.1", port=8123)
    run.join()
    assert run.error is None
    assert hooks.events == PREPARE_EVENTS + RECOVERY_EVENTS
    assert not facts_file.exists()


def test_no_capture_facts_without_the_variable(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FACTS_ENV, raising=False)
    hooks = FakeHooks(control)
    run = start(hooks)
    handshake(control, kind="copy", host="127.0.0.1", port=8123)
    run.join()
    assert run.error is None
    assert "capture_facts" not in hooks.events


@pytest.mark.parametrize(("kind", "host"), [("copy", "127.0.0.1"), ("donor", None)])
def test_full_sequence_returns_the_bind_target(
    control: ControlDir, start: Any, kind: str, host: str | None
) -> None:
    hooks = FakeHooks(control)
    run = start(hooks)
    ready, activation, challenge = handshake(control, kind=kind, host=host, port=8123)
    run.join()
    assert run.error is None
    assert run.result == BindTarget(
        host=host, port=8123, activation_id=activation.activation_id, kind=kind
    )

    assert ready.pid == os.getpid()
    assert ready.oracle == ORACLE
    assert challenge.capture_id == ready.capture_id
    status = control.read(ControlFile.STATUS)
    assert status is not None
    assert (status.phase, status.capture_id, status.activation_id) == (
        "validated",
        ready.capture_id,
        activation.activation_id,
    )
    assert control.read(ControlFile.ERROR) is None

    assert hooks.events == PREPARE_EVENTS + RECOVERY_EVENTS
    # Nothing is published until the rehearsal is done; recovery runs under "recovering".
    assert all(present == () for _, present, _ in hooks.seen[:5])
    for _, present, phase in hooks.seen[5:]:
        assert phase == "recovering"
        assert {"activation.json", "challenge.json", "release.json"} <= set(present)

    for name in ("capture-ready.json", "challenge.json", "status.json"):
        assert stat.S_IMODE((control.path / name).lstat().st_mode) == 0o600
    assert_no_tmp(control)


def test_capture_ids_and_nonces_are_fresh_per_run(tmp_path: Path, start: Any) -> None:
    seen: list[tuple[str, str]] = []
    for index in range(2):
        control = make_control_dir(tmp_path, f"control{index}")
        run = start(FakeHooks(control), control_dir=control)
        ready, _, challenge = handshake(control)
        run.join()
        assert run.result is not None
        seen.append((ready.capture_id, challenge.nonce))
    assert seen[0][0] != seen[1][0]
    assert seen[0][1] != seen[1][1]


def test_nonce_is_drawn_only_after_the_activation_was_accepted(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws: list[tuple[str, ...]] = []
    real_nonce = _control.new_nonce

    def recording_nonce() -> str:
        draws.append(tuple(name.value for name in control.present()))
        return real_nonce()

    monkeypatch.setattr(_control, "new_nonce", recording_nonce)
    run = start()
    handshake(control)
    run.join()
    assert draws == [("capture-ready.json", "activation.json")]


def test_rejected_activation_draws_no_nonce(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws: list[str] = []

    def recording_nonce() -> str:
        draws.append("drawn")
        return "0" * 32

    monkeypatch.setattr(_control, "new_nonce", recording_nonce)
    run = start()
    activate(control, await_ready(control), native_complete=False)
    expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert draws == []


def test_time_frozen_during_a_wait_does_not_count(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_sleep = time.sleep
    frozen = threading.Event()
    freeze_s = 2 * FROZEN_TIMEOUT_S  # a CRIU dump longer than timeout_s

    def sleep_with_one_freeze(seconds: float) -> None:
        if not frozen.is_set():
            frozen.set()
            real_sleep(freeze_s)
        real_sleep(seconds)

    monkeypatch.setattr(_control, "_sleep", sleep_with_one_freeze)
    run = start(timeout_s=FROZEN_TIMEOUT_S)
    ready = await_ready(control)
    assert frozen.wait(WAIT_S)
    # Activate a while after the thaw: a wall-clock budget would have expired by then.
    real_sleep(freeze_s + FROZEN_TIMEOUT_S / 3)
    activate(control, ready)
    control.write(Release.answering(await_challenge(control)))
    run.join()
    assert run.error is None
    assert run.result is not None


def test_time_frozen_during_the_release_wait_does_not_count(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_wait = _control._wait_for_event
    frozen = threading.Event()
    freeze_s = 2 * FROZEN_TIMEOUT_S

    def wait_with_one_freeze(watch: DirectoryWatch, timeout_s: float) -> None:
        if not frozen.is_set():
            frozen.set()
            time.sleep(freeze_s)
        real_wait(watch, timeout_s)

    monkeypatch.setattr(_control, "_wait_for_event", wait_with_one_freeze)
    run = start(timeout_s=FROZEN_TIMEOUT_S)
    activate(control, await_ready(control))
    challenge = await_challenge(control)
    assert frozen.wait(WAIT_S)
    time.sleep(freeze_s + FROZEN_TIMEOUT_S / 3)
    control.write(Release.answering(challenge))
    run.join()
    assert run.error is None
    assert run.result is not None


def test_the_release_wakes_the_server_through_inotify(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without an event the server would re-read only after an hour: the run would not finish.
    monkeypatch.setattr(_control, "FULL_CHECK_S", 3600.0)
    run = start(timeout_s=7200.0)
    handshake(control)
    run.join()
    assert run.result is not None


def test_the_release_is_polled_when_inotify_is_unavailable(
    control: ControlDir, start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_inotify(path: object) -> DirectoryWatch:
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(_control, "DirectoryWatch", no_inotify)
    monkeypatch.setattr(_control, "FULL_CHECK_S", 3600.0)
    run = start(timeout_s=7200.0)
    handshake(control)
    run.join()
    assert run.result is not None


BARRIER_SERVER = """
import sys
from snapctl.launcher import run_startup_capture
from snapctl.protocol.models import Oracle, SnapshotConfig

class Hooks:
    def canary(self):
        return Oracle(token_ids=[1], text=" a", sampled_token_logprob=-0.25)
    def release_memory(self):
        pass
    def restore_memory(self):
        pass

config = SnapshotConfig(mode="startup", control_dir=sys.argv[1], timeout_s=30)
print(run_startup_capture(config, Hooks()).activation_id)
"""


def await_sleeping(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    # The state follows the command name, which is in parentheses and may hold spaces.
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.monotonic() < deadline, f"process {pid} never went to sleep"
        time.sleep(0.001)


def test_the_server_waits_at_the_barrier_without_threads_or_descriptors(
    control: ControlDir,
) -> None:
    # What CRIU checkpoints there must not include an inotify descriptor or a helper thread.
    server = subprocess.Popen(
        [sys.executable, "-c", BARRIER_SERVER, str(control.path)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
    )
    try:
        ready = await_ready(control)
        assert ready.pid == server.pid
        await_sleeping(server.pid)  # in the barrier's wait by now, not still on its way there
        assert os.listdir(f"/proc/{server.pid}/task") == [str(server.pid)]
        fds = Path(f"/proc/{server.pid}/fd")
        targets = [os.readlink(fd) for fd in fds.iterdir()]
        assert not [target for target in targets if "inotify" in target], targets
        activation = activate(control, ready)
        control.write(Release.answering(await_challenge(control)))
        out, _ = server.communicate(timeout=WAIT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0
    assert out.decode().strip() == activation.activation_id


def test_the_server_side_never_loads_watchdog() -> None:
    # Observer threads or inotify descriptors would end up in the CRIU image.
    code = (
        "import sys, snapctl.launcher, snapctl.protocol;"
        "sys.exit(any(m.startswith('watchdog') for m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=30, check=False)
    assert result.returncode == 0


# --- failures before the capture barrier ------------------------------------------------------


def test_non_empty_control_dir_at_start(control: ControlDir, start: Any) -> None:
    (control.path / "leftover").write_text("")
    run = start()
    report = expect_failure(run, control, Phase.INITIALIZE_ENGINE, ControlDirError)
    assert "must be empty" in report.error
    assert control.read(ControlFile.CAPTURE_READY) is None


def test_stale_control_files_at_start(control: ControlDir, start: Any) -> None:
    control.write(make_status())
    run = start()
    expect_failure(run, control, Phase.INITIALIZE_ENGINE, ControlDirError)


def _expect_unwritable_failure(run: LauncherRun, *places: Path) -> None:
    run.join()
    assert run.result is None
    assert isinstance(run.error, StartupCaptureError)
    assert run.error.phase == Phase.INITIALIZE_ENGINE
    assert isinstance(run.error.__cause__, ControlDirError)
    assert "error.json not written" in str(run.error)
    # An unsafe directory is exactly where nothing may be written, error.json included.
    for place in places:
        assert os.listdir(place) == []


def test_symlinked_control_dir(control: ControlDir, tmp_path: Path, start: Any) -> None:
    link = tmp_path / "link"
    link.symlink_to(control.path)
    run = start(control_dir=ControlDir(link))
    _expect_unwritable_failure(run, control.path)


def test_symlinked_ancestor(tmp_path: Path, start: Any) -> None:
    real = make_control_dir(tmp_path, "real")
    inner = make_control_dir(real.path, "control")
    (tmp_path / "alias").symlink_to(real.path)
    run = start(control_dir=ControlDir(tmp_path / "alias" / "control"))
    _expect_unwritable_failure(run, inner.path)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o755])
def test_group_or_world_accessible_control_dir(control: ControlDir, start: Any, mode: int) -> None:
    control.path.chmod(mode)
    run = start()
    _expect_unwritable_failure(run, control.path)


def test_world_writable_ancestor(tmp_path: Path, start: Any) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    inner = make_control_dir(parent)
    parent.chmod(0o777)
    run = start(control_dir=inner)
    _expect_unwritable_failure(run, inner.path)


@pytest.mark.parametrize("control_dir", ["relative/control", "/tmp/../tmp/control"])
def test_relative_or_dotdot_path(control_dir: str) -> None:
    # SnapshotConfig refuses these; a config built around validation must not slip through.
    config = SnapshotConfig.model_construct(mode="startup", control_dir=control_dir, timeout_s=1.0)
    with pytest.raises(StartupCaptureError) as caught:
        run_startup_capture(config, FakeHooks(ControlDir("/nonexistent")))
    assert caught.value.phase == Phase.INITIALIZE_ENGINE
    assert "error.json not written" in str(caught.value)


def test_canary_mismatch_at_rehearsal(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(control, canaries=[ORACLE, make_oracle(token_ids=[13])])
    run = start(hooks)
    report = expect_failure(run, control, Phase.PREPARE, CanaryMismatchError)
    assert "rehearsal canary" in report.error
    assert "token_ids" in report.error
    assert control.read(ControlFile.CAPTURE_READY) is None
    assert hooks.events == ["canary", "release_memory", "restore_memory", "canary"]


@pytest.mark.parametrize(
    ("hook", "call", "phase"),
    [
        ("canary", 1, Phase.PREPARE),
        ("release_memory", 1, Phase.PREPARE),
        ("restore_memory", 1, Phase.PREPARE),
        ("canary", 2, Phase.PREPARE),
        ("release_memory", 2, Phase.PREPARE),
        ("restore_memory", 2, Phase.RECOVERY_RESTORE_MEMORY),
        ("canary", 3, Phase.RECOVERY_CANARY),
    ],
)
def test_a_hook_that_raises(
    control: ControlDir, start: Any, hook: str, call: int, phase: Phase
) -> None:
    hooks = FakeHooks(control, fail_at=(hook, call))
    run = start(hooks)
    activation_id = None
    if phase != Phase.PREPARE:
        _, activation, _ = handshake(control)
        activation_id = activation.activation_id
    report = expect_failure(run, control, phase, HookFailure, activation_id)
    assert report.error == "hook exploded"
    assert run.result is None
    if phase is Phase.PREPARE:
        assert control.read(ControlFile.CAPTURE_READY) is None
    else:
        status = control.read(ControlFile.STATUS)
        assert status is not None
        assert status.phase == "recovering"  # never "validated"


def test_keyboard_interrupt_in_a_hook_is_recorded(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(control, fail_at=("release_memory", 1), failure=KeyboardInterrupt())
    run = start(hooks)
    report = expect_failure(run, control, Phase.PREPARE, KeyboardInterrupt)
    assert report.error == "KeyboardInterrupt"


def test_failing_to_write_error_json_does_not_mask_the_primary_error(
    control: ControlDir, start: Any
) -> None:
    hooks = FakeHooks(control, fail_at=("restore_memory", 2))
    run = start(hooks)
    handshake(control)
    # A directory where error.json should go: the replace must fail.
    (control.path / "error.json").mkdir()
    (control.path / "error.json" / "keep").write_text("")
    run.join()
    assert isinstance(run.error, StartupCaptureError)
    assert run.error.phase == Phase.RECOVERY_RESTORE_MEMORY
    assert isinstance(run.error.__cause__, HookFailure)
    assert "HookFailure: hook exploded" in str(run.error)
    assert "error.json not written" in str(run.error)
    assert_no_tmp(control)


# --- failures at the capture barrier ----------------------------------------------------------


def test_timeout_waiting_for_the_activation(control: ControlDir, start: Any) -> None:
    started = time.monotonic()
    run = start(timeout_s=FAIL_TIMEOUT_S)
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, WaitTimeoutError)
    assert "activation.json" in report.error
    assert time.monotonic() - started < 3


def test_timeout_waiting_for_the_release(control: ControlDir, start: Any) -> None:
    run = start(timeout_s=FAIL_TIMEOUT_S)
    activation = activate(control, await_ready(control))
    await_challenge(control)
    report = expect_failure(
        run, control, Phase.CAPTURE_BARRIER, WaitTimeoutError, activation.activation_id
    )
    assert "release.json" in report.error


def test_foreign_capture_id(control: ControlDir, start: Any) -> None:
    run = start()
    await_ready(control)
    control.write(Activation.model_validate(activation_fields(capture_id=OTHER_CAPTURE_ID)))
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert "capture_id" in report.error
    assert control.read(ControlFile.CHALLENGE) is None


def test_native_complete_false(control: ControlDir, start: Any) -> None:
    run = start()
    activate(control, await_ready(control), native_complete=False)
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert "native_complete" in report.error
    assert control.read(ControlFile.CHALLENGE) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"unexpected": 1},
        {"port": "8000"},
        {"port": 0},
        {"native_complete": 1},
        {"kind": "clone"},
        {"activation_id": "../x"},
        {"version": 2},
    ],
    ids=repr,
)
def test_invalid_activation(control: ControlDir, start: Any, changes: dict[str, Any]) -> None:
    run = start()
    ready = await_ready(control)
    fields = activation_fields(capture_id=ready.capture_id, **changes)
    write_json_atomic(control.file_path(ControlFile.ACTIVATION), fields)
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert report.error.startswith("invalid activation.json")


def _torn(path: Path, ready: CaptureReady) -> None:
    path.write_text('{"version": 1, "capture_id": "' + ready.capture_id)


def _non_object(path: Path, ready: CaptureReady) -> None:
    path.write_text("[1]")


def _oversized(path: Path, ready: CaptureReady) -> None:
    path.write_text('{"pad": "' + "x" * 70000 + '"}')


def _symlink(path: Path, ready: CaptureReady) -> None:
    real = path.parent.parent / "real-activation.json"
    write_json_atomic(real, activation_fields(capture_id=ready.capture_id))
    path.symlink_to(real)


def _fifo(path: Path, ready: CaptureReady) -> None:
    os.mkfifo(path, 0o600)


def _directory(path: Path, ready: CaptureReady) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    "plant", [_torn, _non_object, _oversized, _symlink, _fifo, _directory], ids=lambda f: f.__name__
)
def test_malformed_activation_file(control: ControlDir, start: Any, plant: Any) -> None:
    run = start()
    ready = await_ready(control)
    plant(control.file_path(ControlFile.ACTIVATION), ready)
    expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert control.read(ControlFile.CHALLENGE) is None


@pytest.mark.parametrize("stale", [ControlFile.CHALLENGE, ControlFile.RELEASE, ControlFile.STATUS])
def test_stale_file_present_when_the_activation_arrives(
    control: ControlDir, start: Any, stale: ControlFile
) -> None:
    run = start()
    ready = await_ready(control)
    write_json_atomic(control.file_path(stale), {"stale": True})
    activate(control, ready)
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert f"stale activation control: {stale.value}" in report.error
    assert control.read_raw(stale) == {"stale": True}  # left for the capturer to inspect


def test_stale_error_present_when_the_activation_arrives(control: ControlDir, start: Any) -> None:
    run = start()
    ready = await_ready(control)
    write_json_atomic(control.file_path(ControlFile.ERROR), {"stale": True})
    activate(control, ready)
    # error.json is then replaced by the launcher's own report.
    report = expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError)
    assert "stale activation control: error.json" in report.error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", 2),
        ("version", 1.0),
        ("version", True),
        ("capture_id", OTHER_CAPTURE_ID),
        ("activation_id", "someone-else"),
        ("nonce", "ffffffffffffffffffffffffffffffff"),
        ("extra", "key"),
        ("nonce", None),
    ],
    ids=lambda item: repr(item),
)
def test_release_differing_from_the_challenge(
    control: ControlDir, start: Any, field: str, value: object
) -> None:
    run = start()
    ready = await_ready(control)
    activation = activate(control, ready)
    release = await_challenge(control).model_dump(mode="json")
    if value is None:
        del release[field]
    else:
        release[field] = value
    write_json_atomic(control.file_path(ControlFile.RELEASE), release)
    report = expect_failure(
        run, control, Phase.CAPTURE_BARRIER, ProtocolError, activation.activation_id
    )
    assert report.error == "release.json does not match challenge.json"
    assert control.read_raw(ControlFile.STATUS) is None


def test_malformed_release(control: ControlDir, start: Any) -> None:
    run = start()
    activation = activate(control, await_ready(control))
    await_challenge(control)
    control.file_path(ControlFile.RELEASE).write_text('{"version": 1,')
    expect_failure(run, control, Phase.CAPTURE_BARRIER, ProtocolError, activation.activation_id)


@pytest.mark.parametrize("change", ["port", "removed", "reformatted-only"])
def test_activation_changed_between_reads(control: ControlDir, start: Any, change: str) -> None:
    run = start()
    ready = await_ready(control)
    activation = activate(control, ready)
    challenge = await_challenge(control)
    path = control.file_path(ControlFile.ACTIVATION)
    if change == "port":
        write_json_atomic(
            path, activation_fields(capture_id=ready.capture_id, port=9), overwrite=True
        )
    elif change == "removed":
        path.unlink()
    else:
        # Same object, different bytes: only the content matters, so this one passes.
        fields = activation_fields(capture_id=ready.capture_id)
        path.write_text(json.dumps(fields, indent=2))
    control.write(Release.answering(challenge))
    if change == "reformatted-only":
        run.join()
        assert run.result is not None
        return
    report = expect_failure(
        run, control, Phase.CAPTURE_BARRIER, ProtocolError, activation.activation_id
    )
    assert "activation.json changed" in report.error


def test_control_dir_made_unsafe_while_waiting(control: ControlDir, start: Any) -> None:
    run = start()
    await_ready(control)
    control.path.chmod(0o777)
    run.join()
    assert isinstance(run.error, StartupCaptureError)
    assert run.error.phase == Phase.CAPTURE_BARRIER
    assert isinstance(run.error.__cause__, ControlDirError)
    assert "error.json not written" in str(run.error)
    control.path.chmod(0o700)
    assert control.read(ControlFile.ERROR) is None


# --- failures during recovery -----------------------------------------------------------------


def test_canary_mismatch_at_recovery(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(
        control, canaries=[ORACLE, ORACLE, make_oracle(sampled_token_logprob=-0.25 - 2e-3)]
    )
    run = start(hooks)
    _, activation, _ = handshake(control)
    report = expect_failure(
        run, control, Phase.RECOVERY_CANARY, CanaryMismatchError, activation.activation_id
    )
    assert "recovery canary" in report.error
    assert "sampled_token_logprob" in report.error
    status = control.read(ControlFile.STATUS)
    assert status is not None
    assert status.phase == "recovering"


def test_canary_within_tolerance_at_recovery_passes(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(
        control, canaries=[ORACLE, ORACLE, make_oracle(sampled_token_logprob=-0.25 + 5e-4)]
    )
    run = start(hooks)
    handshake(control)
    run.join()
    assert run.result is not None


def test_canary_text_mismatch_at_recovery(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(control, canaries=[ORACLE, ORACLE, make_oracle(text=" A")])
    run = start(hooks)
    _, activation, _ = handshake(control)
    report = expect_failure(
        run, control, Phase.RECOVERY_CANARY, CanaryMismatchError, activation.activation_id
    )
    assert "text differs" in report.error


def test_invalid_poll_interval_is_recorded(control: ControlDir, start: Any) -> None:
    run = start(poll_s=0.0)
    expect_failure(run, control, Phase.INITIALIZE_ENGINE, ValueError)


def test_status_write_failure_fails_recover(control: ControlDir, start: Any) -> None:
    hooks = FakeHooks(control)
    run = start(hooks)
    ready = await_ready(control)
    activation = activate(control, ready)
    challenge = await_challenge(control)
    # A directory at status.json makes the "recovering" write fail.
    control.file_path(ControlFile.STATUS).mkdir()
    control.write(Release.answering(challenge))
    run.join()
    assert isinstance(run.error, StartupCaptureError)
    assert run.error.phase == Phase.RECOVER
    report = control.read(ControlFile.ERROR)
    assert report is not None
    assert report.phase == "recover"
    assert report.activation_id == activation.activation_id
    assert hooks.events == PREPARE_EVENTS


def test_report_failure_names_the_capture_when_there_was_one(control: ControlDir) -> None:
    from snapctl.launcher import report_failure
    from snapctl.protocol.models import ControlFile, Phase, SnapshotConfig
    from tests.protocol.factories import make_ready

    config = SnapshotConfig(mode="startup", control_dir=str(control.path), timeout_s=5)
    report_failure(config, Phase.INITIALIZE_ENGINE, RuntimeError("no engine"))
    before = control.read(ControlFile.ERROR)
    assert before is not None and before.phase == "initialize engine"
    assert before.error == "no engine" and before.activation_id is None

    ready = make_ready()
    control.write(ready)
    report_failure(config, Phase.SERVE, OSError("address in use"), "copy-abc123abc123")
    after = control.read(ControlFile.ERROR)
    assert after is not None and after.capture_id == ready.capture_id
    assert (after.phase, after.activation_id) == ("serve", "copy-abc123abc123")
