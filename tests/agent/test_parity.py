"""The same exit status, stdout and stderr in-process (``--no-agent``) and through the agent,
where things go wrong after a foreground copy serves (stopped as unsafe, a dirty cleanup) and
for refusals before anything starts.

No root: the in-process side runs on a fake session (``start_copy`` replaced), the agent's
on a fake spawner (see conftest), and what the copy's supervisor kept when it stopped the copy
(``stopped.json``) is written here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapctl.activation.core import ActivationReport
from snapctl.activation.session import CleanupAudit
from snapctl.agent.client import AgentClient
from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.statedir import STOPPED_FILE, ActivationRecord, StateDir, StopOutcome
from snapctl.supervision import listing
from snapctl.supervision.process import start_time
from tests.agent.conftest import RunningAgent, make_report

pytestmark = pytest.mark.timeout(60)

CLEAN: dict[str, list[Any]] = {
    "processes": [], "mounts": [], "directories": [], "listeners": [], "shm_files": []
}  # fmt: skip
UNSAFE = "lazy-pages daemon killed by SIGKILL before every page was copied"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@dataclass
class FakeSession:
    """What the foreground supervision reads of a session: a tree that already ended."""

    name: str
    how: str
    audit: dict[str, list[Any]]
    failure: str | None = None
    lazy: Any = None

    def alive(self) -> bool:
        return False

    @property
    def dirs(self) -> SimpleNamespace:  # its log, which the supervising loop keeps bounded
        return SimpleNamespace(server_log=Path("/nonexistent/server.log"))

    def stop(self, stop_timeout_s: float = 10.0) -> tuple[str, CleanupAudit]:
        return self.how, CleanupAudit(**self.audit)


@dataclass
class Scenario:
    """One foreground copy that ended badly, set up for both paths."""

    image: Path
    report: dict[str, Any]
    logs: Path

    def in_process(self, monkeypatch: pytest.MonkeyPatch, session: FakeSession) -> None:
        model = ActivationReport.model_validate(self.report)
        monkeypatch.setattr(
            "snapctl.activation.copy.start_copy", lambda *args, **kwargs: (session, model)
        )
        monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: None)

    def kept(self, how: str, audit: dict[str, list[Any]], failure: str | None) -> None:
        """What the copy's supervisor keeps when it stops the copy itself."""
        outcome = StopOutcome(name=self.report["name"], stopped=how, audit=audit, failure=failure)
        (self.logs / STOPPED_FILE).write_text(outcome.model_dump_json())

    def args(self, *extra: str) -> list[str]:
        return ["copy", "--image", str(self.image), "--no-lazy", *extra]


@pytest.fixture
def scenario(running_agent: RunningAgent, tmp_path: Path) -> Scenario:
    image = tmp_path / "image"
    image.mkdir()
    logs = running_agent.state.logs / "copy-0123456789ab"
    logs.mkdir(parents=True)
    report = ActivationReport.model_validate(make_report(logs=str(logs), lazy=True))
    as_json = report.model_dump(mode="json")
    running_agent.spawner.script = [{"report": as_json}]
    return Scenario(image, as_json, logs)


def both_ways(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    session: FakeSession, *extra: str,
) -> tuple[int, str, str]:  # fmt: skip
    """The command through the agent, then in-process: the same outcome, which is returned."""
    through = run_cli(capsys, *scenario.args(*extra))
    with monkeypatch.context() as patched:
        scenario.in_process(patched, session)
        local = run_cli(capsys, "--no-agent", *scenario.args(*extra))
    assert through[0] == local[0] and through[2] == local[2], (through, local)
    assert through == local
    return through


@pytest.mark.parametrize("as_json", [False, True])
def test_a_copy_stopped_as_unsafe_after_it_served_fails_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    as_json: bool,
) -> None:  # fmt: skip
    # Its supervisor killed it (the lazy transfer failed), cleaned up and dropped its record.
    scenario.kept("exited", CLEAN, UNSAFE)
    session = FakeSession("copy-1", "exited", CLEAN, failure=UNSAFE)
    extra = ("--json",) if as_json else ()
    code, out, err = both_ways(capsys, monkeypatch, scenario, session, *extra)
    assert code == ExitStatus.ERROR
    assert err.splitlines()[-1] == f"error: copy-1: {UNSAFE} [phase: lazy-pages]"
    if as_json:
        assert json.loads(out) == scenario.report and len(err.splitlines()) == 1
    else:
        assert "copy-1: stopped (exited); cleanup: clean" in err.splitlines()


def test_a_dirty_cleanup_by_the_copy_s_supervisor_fails_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario
) -> None:
    dirty = {**CLEAN, "processes": [4242]}
    scenario.kept("exited", dirty, None)
    session = FakeSession("copy-1", "exited", dirty)
    code, _, err = both_ways(capsys, monkeypatch, scenario, session)
    assert code == ExitStatus.ERROR
    assert err.splitlines()[-2:] == [
        "copy-1: stopped (exited); cleanup: processes: [4242]",
        "error: cleanup incomplete after stopping copy-1: processes: [4242]",
    ]


def test_a_dirty_cleanup_of_the_agent_s_stop_fails_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    running_agent: RunningAgent,
) -> None:  # fmt: skip
    # Still recorded when the client stops it (its tree is gone: not running), and the
    # agent's stop finds a mount left.
    save_record(running_agent.state, "copy-1")
    dirty = {**CLEAN, "mounts": ["/run/x"]}
    monkeypatch.setattr(
        "snapctl.agent.service.AgentService.stop",
        lambda self, name, timeout_s: {"name": name, "stopped": "exited", "audit": dirty},
    )
    code, _, err = both_ways(capsys, monkeypatch, scenario, FakeSession("copy-1", "exited", dirty))
    assert code == ExitStatus.ERROR
    assert err.splitlines()[-1] == (
        "error: cleanup incomplete after stopping copy-1: mounts: ['/run/x']"
    )


def test_a_copy_that_exited_cleanly_reports_its_stop_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario
) -> None:
    scenario.kept("exited", CLEAN, None)
    code, _, err = both_ways(capsys, monkeypatch, scenario, FakeSession("copy-1", "exited", CLEAN))
    assert code == 0
    assert err.splitlines() == [
        "serving; press Ctrl-C to stop", "copy-1: stopped (exited); cleanup: clean"
    ]  # fmt: skip


def save_record(state: StateDir, name: str, *, logs_dir: str = "/nowhere/logs",
                root_pid: int = 999999, root_start_time: float = 1.0) -> None:  # fmt: skip
    state.ensure()
    state.save_record(
        ActivationRecord(
            name=name, activation_id=f"copy-{name}", kind="copy", image="/images/one",
            root_pid=root_pid, root_start_time=root_start_time, supervisor_pid=999998,
            supervisor_start_time=1.0, activation_dir="/nowhere", logs_dir=logs_dir,
            host="127.0.0.1", port=8000, published=None, created="2026-01-01T00:00:00+00:00",
        )
    )  # fmt: skip


# Refusals and failures before anything serves: the same status and message either way.


def test_logs_of_an_unknown_name_fails_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in (["logs", "nobody"], ["logs", "-f", "nobody"]):
        through = run_cli(capsys, *args)
        assert through == run_cli(capsys, "--no-agent", *args)
        assert through[0] == ExitStatus.ERROR and "no activation named 'nobody'" in through[2]


def test_a_refused_publish_fails_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import socket

    image = tmp_path / "image"
    image.mkdir()
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {
            ExitStatus.CONFLICT: ["--publish", f"127.0.0.1:{port}"],  # in use
            ExitStatus.USAGE: ["--publish", f"0.0.0.0:{port + 1}"],  # not loopback, no --expose
        }
        for status, extra in cases.items():
            args = ["copy", "--image", str(image), "--no-lazy", "--detach", *extra]
            through = run_cli(capsys, *args)
            assert through == run_cli(capsys, "--no-agent", *args)
            assert through[0] == status, through
    assert running_agent.spawner.jobs == []


@pytest.mark.parametrize("detach", [False, True])
def test_an_interrupted_start_fails_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    running_agent: RunningAgent, detach: bool,
) -> None:  # fmt: skip
    extra = ("--detach",) if detach else ()
    # Through the agent: SIGINT while the agent starts the copy (it is stopped once started).
    release = running_agent.spawner.release = threading.Event()
    stopped: list[str] = []
    monkeypatch.setattr(
        "snapctl.agent.service.AgentService.stop",
        lambda self, name, timeout_s: stopped.append(name) or {"name": name},
    )

    def interrupt() -> None:
        deadline = time.monotonic() + 10
        while not running_agent.spawner.jobs and time.monotonic() < deadline:
            time.sleep(0.02)
        if running_agent.spawner.jobs:  # else the command failed: no signal to interrupt pytest
            os.kill(os.getpid(), signal.SIGINT)  # to the command, which holds SIGINT by then
        release.set()  # the start ends only once interrupted

    sender = threading.Thread(target=interrupt)
    sender.start()
    through = run_cli(capsys, *scenario.args(*extra))
    sender.join(10)
    assert stopped == ["copy-1"]
    # In-process: the first signal interrupts the start where it is (the detached supervisor
    # relays it as its error).
    with monkeypatch.context() as patched:
        if detach:
            from snapctl.activation.supervise import DetachedStartError

            def start(*args: Any, **kwargs: Any) -> Any:
                raise DetachedStartError(
                    "interrupted while starting (SIGINT/SIGTERM); what had started was stopped",
                    exit_status=ExitStatus.INTERRUPTED,
                )

            patched.setattr("snapctl.activation.supervise.detach", start)
        else:

            def start(*args: Any, **kwargs: Any) -> Any:
                raise KeyboardInterrupt

            patched.setattr("snapctl.activation.copy.start_copy", start)
        patched.setattr("snapctl.criu.find_criu", lambda path=None: None)
        local = run_cli(capsys, "--no-agent", *scenario.args(*extra))
    assert through == local and through[0] == ExitStatus.INTERRUPTED


class Polls:
    """Counts the foreground command's polls of its copies, through the agent or, once the
    agent is gone, from the records, so a test acts after one rather than after a sleep."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.through_agent = 0
        self.from_records = 0
        real_call = AgentClient.call
        real_rows = listing.activation_rows

        def call(client: AgentClient, method: str, target: str, *args: Any, **kw: Any) -> Any:
            answer = real_call(client, method, target, *args, **kw)
            self.through_agent += (method, target) == ("GET", "/activations")
            return answer

        def rows(*args: Any, **kw: Any) -> Any:
            answer = real_rows(*args, **kw)
            self.from_records += 1
            return answer

        monkeypatch.setattr(AgentClient, "call", call)
        monkeypatch.setattr(listing, "activation_rows", rows)

    @staticmethod
    def wait(count: Any) -> None:
        deadline = time.monotonic() + 30
        while not count():
            assert time.monotonic() < deadline, "the command never polled"
            time.sleep(0.02)


def test_a_foreground_copy_serves_on_when_the_agent_stops(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    running_agent: RunningAgent,
) -> None:  # fmt: skip
    polls = Polls(monkeypatch)
    # The copy's tree (a stand-in that runs), recorded as its supervisor records it.
    tree = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(tree.pid)
        save_record(running_agent.state, "copy-1", root_pid=tree.pid, root_start_time=started)
        alive_after_agent: list[bool] = []

        def agent_stops_then_the_copy_exits() -> None:
            polls.wait(lambda: polls.through_agent)  # the command waits, polling the agent
            running_agent.agent.stop()
            # And goes on waiting without it (the agent may have read records too, before).
            seen = polls.from_records
            polls.wait(lambda: polls.from_records > seen)
            alive_after_agent.append(tree.poll() is None)
            scenario.kept("exited", CLEAN, None)  # its supervisor's stop
            running_agent.state.drop_record("copy-1")
            tree.kill()

        thread = threading.Thread(target=agent_stops_then_the_copy_exits)
        thread.start()
        code, _, err = run_cli(capsys, *scenario.args())
        thread.join(10)
    finally:
        tree.kill()
        tree.wait(10)
    assert alive_after_agent == [True]  # the agent's stop did not end the command's copy
    assert code == 0, err
    assert err.splitlines()[-1] == "copy-1: stopped (exited); cleanup: clean"


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_detached_copy_prints_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    running_agent: RunningAgent, count: int, as_json: bool,
) -> None:  # fmt: skip
    if count == 1:
        record = scenario.report
    else:
        copies = [{**scenario.report, "name": f"copy-{i}"} for i in (1, 2)]
        record = {"copies": copies, "total_s": 0.25}
    running_agent.spawner.script = [{"report": record}]
    extra = ["--detach", "--count", str(count), *(["--json"] if as_json else [])]
    through = run_cli(capsys, *scenario.args(*extra))
    with monkeypatch.context() as patched:
        patched.setattr("snapctl.activation.supervise.detach", lambda *a, **k: record)
        patched.setattr("snapctl.criu.find_criu", lambda path=None: None)
        local = run_cli(capsys, "--no-agent", *scenario.args(*extra))
    assert through == local and through[0] == 0
    if as_json:
        assert json.loads(through[1]) == record
    else:
        assert "copy-1" in through[1]


def test_a_lazy_copy_s_pages_complete_note_is_the_same_either_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scenario: Scenario,
    running_agent: RunningAgent,
) -> None:  # fmt: skip
    polls = Polls(monkeypatch)
    tree = subprocess.Popen(["sleep", "60"])
    try:
        state = running_agent.state
        save_record(state, "copy-1", root_pid=tree.pid,
                    root_start_time=start_time(tree.pid))  # fmt: skip
        record = state.load_records()[0]
        state.save_record(record.model_copy(update={"lazy": True, "pages_complete": True,
                                                    "pages_complete_s": 0.5}))  # fmt: skip

        def the_copy_exits() -> None:
            polls.wait(lambda: polls.through_agent)  # it has seen the pages complete
            scenario.kept("exited", CLEAN, None)
            state.drop_record("copy-1")
            tree.kill()

        thread = threading.Thread(target=the_copy_exits)
        thread.start()
        through = run_cli(capsys, *scenario.args())
        thread.join(10)
    finally:
        tree.kill()
        tree.wait(10)

    @dataclass
    class Pages:
        state: str = "complete"
        complete_s: float = 0.5

    class Transfer:
        def wait(self, timeout_s: float | None = None) -> Pages:
            return Pages()

    class LazySession(FakeSession):
        ends_at = time.monotonic() + 0.5

        def alive(self) -> bool:
            return time.monotonic() < self.ends_at

    session = LazySession("copy-1", "exited", CLEAN, lazy=Transfer())
    with monkeypatch.context() as patched:
        scenario.in_process(patched, session)
        session.ends_at = time.monotonic() + 2.0  # time for the note's thread to print
        local = run_cli(capsys, "--no-agent", *scenario.args())
    assert through == local and through[0] == 0
    assert through[2].splitlines() == [
        "serving; press Ctrl-C to stop",
        "copy-1: pages complete 0.500 s after its restore",
        "copy-1: stopped (exited); cleanup: clean",
    ]
