"""The detached supervisor's hand-over: progress and errors reach the parent intact; and a
start whose command was killed can still be stopped by name while it starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from snapctl.activation import supervise
from snapctl.activation.supervise import DetachedStartError, detach, stop_named, sweep_creating
from snapctl.cli import main
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images.lock import ImageBusyError
from snapctl.phases import HostPhase
from snapctl.statedir import StateDir, UnknownActivationError
from snapctl.supervision.signals import track


def test_progress_then_error_with_its_fields_reach_the_parent() -> None:
    seen: list[tuple[str, str]] = []

    def start(progress_for):  # type: ignore[no-untyped-def]
        progress_for("copy 1")("restoring")
        error = SnapctlError("it broke\n  detail line", phase="restore", path="/x/restore.log")
        error.exit_status = ExitStatus.VERIFY_FAILED  # type: ignore[attr-defined]
        raise error

    with pytest.raises(DetachedStartError) as info:
        detach(start, on_progress=lambda lane, step: seen.append((lane, step)))
    assert seen == [("copy 1", "restoring")]
    assert info.value.message == "it broke\n  detail line"
    assert info.value.phase is HostPhase.RESTORE and str(info.value.path) == "/x/restore.log"
    assert info.value.exit_status == ExitStatus.VERIFY_FAILED


def test_an_unexpected_exception_in_the_supervisor_is_reported() -> None:
    def start(progress_for):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug")

    expected = "unexpected RuntimeError in the supervisor: a bug"
    with pytest.raises(DetachedStartError, match=expected):
        detach(start)


def test_the_supervisor_exits_with_its_error_s_status(monkeypatch: pytest.MonkeyPatch) -> None:
    reaped: list[int] = []
    waitpid = os.waitpid

    def recording_waitpid(pid: int, options: int) -> tuple[int, int]:
        done = waitpid(pid, options)
        reaped.append(os.waitstatus_to_exitcode(done[1]))
        return done

    monkeypatch.setattr(os, "waitpid", recording_waitpid)

    def start(progress_for):  # type: ignore[no-untyped-def]
        raise ImageBusyError("image /x is in use", phase=HostPhase.IMAGE, path="/x")

    with pytest.raises(DetachedStartError) as info:
        detach(start)
    assert info.value.exit_status == ExitStatus.CONFLICT
    assert info.value.phase is HostPhase.IMAGE
    assert reaped == [ExitStatus.CONFLICT]


# -- stop NAME while a detached start is still starting ------------------------------------------


class _StartedSoFar:
    """What a start had started when it is interrupted: its stop (the start's own cleanup,
    run by ``stop_all_tracked``) leaves a mark."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def stop(self, stop_timeout_s: float = 10.0) -> None:
        self.mark.write_text("stopped by the interrupted start")


def _command_whose_start_hangs(root: Path, mark: Path) -> None:
    """A ``donor --detach``'s command: the supervisor it forks reserves the name, starts
    something and then takes its time, as a capture does."""
    state = StateDir(root)

    def start(progress_for):  # type: ignore[no-untyped-def]
        state.reserve_name("web")
        track(_StartedSoFar(mark))
        (root / "reserved").write_text("")
        while True:
            time.sleep(0.05)

    detach(start)


def _start_then_kill_its_command(tmp_path: Path) -> tuple[StateDir, Path, int]:
    """A detached start of ``web`` whose command is SIGKILLed once the name is reserved (its
    supervisor goes on starting); the state, the start's mark and the supervisor's PID."""
    state = StateDir(tmp_path / "state")
    state.ensure()
    mark = tmp_path / "mark"
    command = os.fork()
    if command == 0:
        try:
            _command_whose_start_hangs(state.root, mark)
        finally:
            os._exit(1)
    try:
        deadline = time.monotonic() + 30
        while not (state.root / "reserved").exists():
            assert time.monotonic() < deadline and os.waitpid(command, os.WNOHANG) == (0, 0)
            time.sleep(0.02)
    finally:
        os.kill(command, signal.SIGKILL)
        os.waitpid(command, 0)
    holder = state.name_holder("web")
    assert holder is not None and holder.pid != command  # the supervisor holds it
    return state, mark, holder.pid


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_interrupts_a_detached_start_whose_command_was_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state, mark, supervisor = _start_then_kill_its_command(tmp_path)
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    try:
        assert main(["stop", "web", "--json", "--timeout", "10"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["name"] == "web" and answer["stopped"] == "interrupted while starting"
        assert all(not value for value in answer["audit"].values())
        assert mark.read_text() == "stopped by the interrupted start"
        assert _ended(supervisor)
        state.reserve_name("web").release()  # the name is free again
        assert main(["gc", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["starting"] == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGKILL)


def test_gc_lists_a_start_in_progress_and_leaves_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state, mark, supervisor = _start_then_kill_its_command(tmp_path)
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    try:
        assert main(["gc"]) == 0
        out = capsys.readouterr().out
        assert "web: starting" in out and "snapctl stop web" in out
        assert "nothing to clean up" not in out
        assert not _ended(supervisor) and not mark.exists()  # gc left the start alone
        assert main(["gc", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["starting"] == ["web"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGKILL)


def test_the_agent_stops_a_start_in_progress_as_the_cli_does(tmp_path: Path) -> None:
    from snapctl.agent.service import AgentService

    state, mark, supervisor = _start_then_kill_its_command(tmp_path)
    service = AgentService(state, pool=None, spawner=None, metrics=None)  # type: ignore[arg-type]
    try:
        answer = service.stop("web", 10.0)
        assert (answer.name, answer.stopped) == ("web", "interrupted while starting")
        assert mark.exists() and _ended(supervisor)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGKILL)


def test_a_holder_that_ignores_sigterm_is_killed_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "from snapctl.statedir import StateDir\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "StateDir(pathlib.Path(sys.argv[1])).reserve_name('web')\n"
        "pathlib.Path(sys.argv[2]).write_text('')\n"
        "time.sleep(60)\n"
    )
    stuck = subprocess.Popen([sys.executable, "-c", code, str(state.root), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and stuck.poll() is None
            time.sleep(0.02)
        monkeypatch.setattr(supervise, "START_CLEANUP_S", 0.0)
        name, how, audit = stop_named(state, "web", 0.5)
        assert (name, how, audit.clean) == ("web", "killed while starting", True)
        stuck.wait(10)  # reaped already by the stop, which waited for it
    finally:
        stuck.kill()
        stuck.wait()


def test_stop_of_a_name_no_one_holds_says_so(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    with pytest.raises(UnknownActivationError, match="no activation named 'web'"):
        stop_named(state, "web")
    state.check_name_free("web")  # only a look: no holder is written, nothing to stop
    with pytest.raises(UnknownActivationError):
        stop_named(state, "web")


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_stop_right_after_a_detached_donor_s_command_was_killed_leaves_nothing(
    tmp_path: Path, criu_binary: object
) -> None:
    from snapctl.namespaces import mounts
    from tests.activation.criu_helpers import API_KEY, API_KEY_ENV

    state, image = tmp_path / "state", tmp_path / "image"
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state), API_KEY_ENV: API_KEY,
           "SNAPCTL_NO_AGENT": "1"}  # fmt: skip
    command = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "donor", "--image", str(image), "--name", "web",
         "--api-key-env", API_KEY_ENV, "--detach", "--json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        # Killed while its supervisor launches the server, long before the capture.
        deadline = time.monotonic() + 60
        while not [p for p in (state / "activations").glob("donor-*") if p.is_dir()]:
            assert time.monotonic() < deadline and command.poll() is None
            time.sleep(0.01)
    finally:
        command.kill()
        command.wait()
    holder = StateDir(state).name_holder("web")
    assert holder is not None

    def snapctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "snapctl", *args], env=env, text=True,
                              capture_output=True, timeout=120, check=False)  # fmt: skip

    stopped = snapctl("stop", "web", "--json")
    assert stopped.returncode == 0, stopped.stderr
    answer = json.loads(stopped.stdout)
    assert answer["stopped"] == "interrupted while starting", answer
    assert all(not value for value in answer["audit"].values()), answer
    assert _ended(holder.pid)
    collected = json.loads(snapctl("gc", "--json").stdout)
    assert (collected["activations"], collected["starting"]) == ([], [])
    assert list((state / "activations").iterdir()) == []
    assert list((state / "records").glob("*.json")) == []
    assert not image.exists() and list(tmp_path.glob(".image.*")) == []
    assert mounts.mounts_under(tmp_path) == []
    ours = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(state) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert ours == []


def test_gc_judges_a_creating_directory_without_owner_by_its_name_s_holder(
    tmp_path: Path,
) -> None:
    """Killed between making ``.ID.creating`` and writing its owner file: an unnamed
    activation's id is the name its creator reserved first, so gc removes the directory at
    once when that holder is dead, keeps it while it lives, and judges by age without one."""
    state = StateDir(tmp_path / "state")
    state.ensure()
    dead, live, unknown = (state.activations / f".copy-{n}.creating" for n in ("a1", "b2", "c3"))
    for path in (dead, live, unknown):
        path.mkdir()
    child = os.fork()
    if child == 0:
        state.reserve_name("copy-a1")  # and dies holding it
        os._exit(0)
    os.waitpid(child, 0)
    held = state.reserve_name("copy-b2")
    try:
        assert sweep_creating(state) == [str(dead)]
        assert live.exists() and unknown.exists()
    finally:
        held.release()
