"""``snapctl donor`` and ``snapctl bake`` through the agent (``POST /v1/donors``, ``/v1/bakes``),
without root: the request the CLI sends (the client's directory and environment), strict
validation, usage errors as in-process, the CLI's choice of path, and the supervisor's job
(:func:`snapctl.pool.supervisor.jobs.run_capture`) through its seams. The real capture:
test_agent_criu.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.requests import BakeRequest, DonorRequest
from snapctl.cli import main
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool.serve import capture_payload
from snapctl.pool.supervisor import jobs
from tests.agent.conftest import RunningAgent, make_report
from tests.agent.test_server import HEAVY, metrics_of, post

pytestmark = pytest.mark.timeout(60)


def make_bake_report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "image": "/images/baked", "image_id": "0123456789abcdef", "image_bytes": 4_000_000,
        "files": 12, "processes": 2, "identity_files": 30,
        "dump_stats": {"frozen_time_us": 12345, "pages_written": 100},
        "timings_s": {"dump": 0.2, "publish": 0.01, "stop": 0.05}, "logs": "/logs/bake-1",
        "stopped": "SIGTERM", "cleanup": "clean", "clean": True,
    }  # fmt: skip
    report.update(changes)
    return report


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_donor_through_the_agent_carries_the_client_s_directory_and_environment(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("TEST_KEY", "s3cret")
    donor_report = make_report(kind="donor", name="d", image=str(workdir / "img"))
    running_agent.spawner.script = [
        {"lane": "", "progress": "capturing the process tree with CRIU"},
        {"report": donor_report},
    ]
    code, out, err = run_cli(capsys, "donor", "--image", "img", "--detach", "--json",
                             "--name", "d", "--api-key-env", "TEST_KEY", "--publish",
                             "127.0.0.1:0", "--", "python3", "server.py")  # fmt: skip
    assert code == 0, err
    assert json.loads(out) == donor_report and out == json.dumps(
        donor_report, sort_keys=True, separators=(",", ":")) + "\n"  # fmt: skip
    (job,) = running_agent.spawner.jobs
    assert job["kind"] == "donor" and job["state"] == str(running_agent.state.root)
    request = job["request"]
    assert request["image"] == str(workdir / "img") and request["cwd"] == str(workdir)
    assert request["server_argv"] == ["python3", "server.py"]
    assert request["name"] == "d" and request["detach"] is True
    assert request["publish"] == {"address": "127.0.0.1", "port": 0}
    # The whole environment, values and all, reaches the supervisor (and only it).
    assert request["environ"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert request["environ"]["TEST_KEY"] == "s3cret"
    assert request["api_key_env"] == "TEST_KEY"
    # Which of it the server gets is chosen there, as in-process (none named here).
    assert request["env"] == {} and request["inherit_env"] is False
    metrics = metrics_of(running_agent.socket)
    assert b'snapctl_captures_total{kind="donor"} 1.0' in metrics


def test_a_capture_request_s_environment_is_masked_in_every_dump() -> None:
    body = {"image": "/i", "cwd": "/", "environ": {"KEY": "s3cret"}, "env": {"GIVEN": "s3cret"}}
    request = DonorRequest.model_validate_json(json.dumps(body))
    assert "s3cret" not in request.model_dump_json() and "s3cret" not in repr(request)
    assert "s3cret" not in json.dumps(request.model_dump(mode="json"))
    assert capture_payload(request)["environ"] == {"KEY": "s3cret"}
    assert capture_payload(request)["env"] == {"GIVEN": "s3cret"}
    assert request.launch_options().env == {"GIVEN": "s3cret"}


def test_bake_through_the_agent_prints_what_it_prints_in_process(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path
) -> None:
    report = make_bake_report()
    running_agent.spawner.script = [{"report": report}]
    code, out, err = run_cli(capsys, "bake", "--image", "img", "--json")
    assert code == 0, err
    # Field order, as BakeReport's own dump (the in-process --json) gives it.
    assert out == json.dumps(report, separators=(",", ":"), ensure_ascii=False) + "\n"
    (job,) = running_agent.spawner.jobs
    assert job["kind"] == "bake" and job["request"]["image"] == str(workdir / "img")
    assert not {"name", "publish", "expose", "detach"} & set(job["request"])

    code, out, err = run_cli(capsys, "bake", "--image", "img")
    assert code == 0, err
    assert "baked image 0123456789abcdef" in out and "12.3 ms" in out
    assert b'snapctl_captures_total{kind="bake"} 2.0' in metrics_of(running_agent.socket)


def test_a_bake_whose_cleanup_left_something_fails_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path
) -> None:
    running_agent.spawner.script = [
        {"report": make_bake_report(clean=False, cleanup="1 process left")}
    ]
    code, out, err = run_cli(capsys, "bake", "--image", "img", "--json")
    assert code == ExitStatus.ERROR and json.loads(out)["clean"] is False
    assert "image published, but the original tree's cleanup left: 1 process left" in err


def test_a_failed_capture_exits_with_its_status_and_message(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path
) -> None:
    running_agent.spawner.script = [
        {"error": "capture failed, no image published: criu dump failed", "status": 3,
         "phase": "capture", "path": None, "log_tail": None},
    ]  # fmt: skip
    code, out, err = run_cli(capsys, "donor", "--image", "img", "--detach")
    assert code == ExitStatus.CAPTURE_FAILED and out == ""
    assert err.strip() == (
        "error: capture failed, no image published: criu dump failed [phase: capture]"
    )
    metrics = metrics_of(running_agent.socket)
    assert b'snapctl_failures_total{phase="capture",what="donor"} 1.0' in metrics


@pytest.mark.parametrize(
    ("target", "body", "status", "reason"),
    [
        ("/v1/donors", b"{}", 422, "image: Field required"),
        ("/v1/bakes", b'{"image": "/i", "environ": {}}', 422, "cwd: Field required"),
        ("/v1/donors", b'{"image": "rel", "cwd": "/", "environ": {}}', 422, "image: String"),
        ("/v1/bakes", b'{"image": "/i", "cwd": "/", "environ": {}, "name": "x"}', 422,
         "name: Extra inputs"),
        ("/v1/donors", b'{"image": "/i", "cwd": "/", "environ": {"A": 1}}', 422, "environ.A"),
        ("/v1/donors", b'{"image": "/i", "cwd": "/", "environ": {"A=B": "v"}}', 422,
         "'A=B' is not an environment variable name"),
        ("/v1/bakes", b'{"image": "/i", "cwd": "/", "environ": {"": "v"}}', 422,
         "'' is not an environment variable name"),
        ("/v1/bakes", b'{"image": "/i", "cwd": "/", "environ": {"A\\u0000": "v"}}', 422,
         "environ: holds NUL"),
        ("/v1/donors", b'{"image": "/i", "cwd": "/", "environ": {"K": "s\\u0000x"}}', 422,
         "environ.K: holds NUL"),
        ("/v1/donors", b'{"image": "/i", "cwd": "/", "environ": {}, "ready_timeout_s": 0}',
         422, "positive, finite"),
        ("/v1/donors", b'{"image": "/i", "cwd": "/", "environ": {}, "expose": true}', 400,
         "--expose only widens --publish"),
        ("/v1/bakes", b'{"image": "/i", "cwd": "/nowhere/at/all", "environ": {}}', 400,
         "is not a directory"),
        ("/v1/bakes", b"not json", 400, "not a JSON object"),
        ("/v1/donors", b"", 422, "Field required"),
    ],
)  # fmt: skip
def test_malformed_capture_requests_are_refused_with_the_reason(
    running_agent: RunningAgent, target: str, body: bytes, status: int, reason: str
) -> None:
    got, answer = post(running_agent.socket, target, body)
    assert got == status and reason in answer["error"], answer
    assert answer["status"] == ExitStatus.USAGE and "Traceback" not in answer["error"]
    assert running_agent.spawner.jobs == []


def test_a_refused_environment_is_not_echoed(running_agent: RunningAgent) -> None:
    body = json.dumps({"image": "/i", "cwd": "/", "environ": {"K": ["secret-value"]}})
    got, answer = post(running_agent.socket, "/v1/donors", body.encode())
    assert got == 422 and "secret-value" not in json.dumps(answer)


def test_a_usage_error_reads_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path
) -> None:
    args = ["donor", "--image", "img", "--detach", "--expose"]
    through = run_cli(capsys, *args)
    assert through[0] == ExitStatus.USAGE and "--expose only widens --publish" in through[2]
    assert through == run_cli(capsys, "--no-agent", *args)
    assert running_agent.spawner.jobs == []


def test_a_port_in_use_is_refused_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["donor", "--image", "img", "--detach", "--publish",
                f"127.0.0.1:{taken.getsockname()[1]}"]  # fmt: skip
        through = run_cli(capsys, *args)
        local = run_cli(capsys, "--no-agent", *args)
    assert through[0] == ExitStatus.CONFLICT and "in use" in through[2]
    assert through == local and running_agent.spawner.jobs == []


@pytest.mark.parametrize("how", ["--no-agent", "SNAPCTL_NO_AGENT"])
@pytest.mark.parametrize("command", ["donor", "bake"])
def test_no_agent_runs_in_process(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], workdir: Path,
    monkeypatch: pytest.MonkeyPatch, how: str, command: str,
) -> None:  # fmt: skip
    ran: list[str] = []

    def in_process(*args: Any, **kwargs: Any) -> Any:
        ran.append(command)
        raise SnapctlError("ran in-process")

    monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: None)
    monkeypatch.setattr("snapctl.activation.donor.start_donor", in_process)
    monkeypatch.setattr("snapctl.activation.bake.bake_image", in_process)
    argv = [command, "--image", "img", "--json"]
    if how == "--no-agent":
        argv.insert(0, how)
    else:
        monkeypatch.setenv(how, "1")
    code, _, err = run_cli(capsys, *argv)
    assert code == ExitStatus.ERROR and "ran in-process" in err
    assert ran == [command] and running_agent.spawner.jobs == []


def test_donor_through_the_agent_imports_nothing_heavy(
    running_agent: RunningAgent, tmp_path: Path
) -> None:
    running_agent.spawner.script = [{"report": make_report(kind="donor")}]
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "snapctl", "donor", "--image",
         str(tmp_path / "img"), "--detach", "--json", "--publish", "127.0.0.1:0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and json.loads(done.stdout) == make_report(kind="donor")
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    heavy = {name for name in imported if name.split(".")[0] in HEAVY - {"click"}}
    assert heavy == set(), heavy


class _Reporter:
    def __init__(self, *, reader: bool = True) -> None:
        self.sent: list[dict[str, Any]] = []
        self.reader = reader  # False: its reader is gone (the agent, or the client)

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return self.reader

    def progress(self, lane: str, step: str) -> None:
        self.send({"lane": lane, "progress": step})

    def error(self, error: BaseException) -> int:
        assert isinstance(error, SnapctlError), error
        self.send({"error": error.message})
        return int(error.exit_status)

    def close(self) -> None:
        self.send({"closed": True})


class _Signals:
    requested = object()

    def install(self) -> _Signals:
        return self

    def started(self) -> None:
        pass


def _job(kind: str, **changes: Any) -> dict[str, Any]:
    model = DonorRequest if kind == "donor" else BakeRequest
    request = model.model_validate_json(json.dumps(
        {"image": "/images/x", "cwd": "/work", "environ": {"KEY": "v"}, **changes}))  # fmt: skip
    return {"kind": kind, "state": "/state", "request": capture_payload(request)}


@pytest.fixture
def supervisor_seams(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The supervisor's side effects, recorded in order (no fork, chdir, environment,
    signal handlers or stdio of this test process are touched)."""
    events: list[Any] = []
    monkeypatch.setattr("snapctl.supervision.signals.StopSignals", _Signals)
    monkeypatch.setattr("snapctl.supervision.signals.stop_all_tracked",
                        lambda: events.append("stop-all-tracked"))  # fmt: skip
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: f"criu:{path}")
    monkeypatch.setattr(jobs, "detach_stdio", lambda: events.append("detach-stdio"))
    monkeypatch.setattr(
        "snapctl.activation.supervise.run_all_until_stopped",
        lambda sessions, stop: events.append(("supervise", sessions)),
    )
    return events


class _Report:
    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def model_dump(self, mode: str) -> dict[str, Any]:
        return self.fields


def test_the_donor_job_adopts_the_client_then_captures_reports_and_supervises(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    events = supervisor_seams

    def start_donor(options: Any, **kwargs: Any) -> Any:
        events.append(("start-donor", options.name, options.api_key_env, kwargs["publish"],
                       str(kwargs["image"]), kwargs["criu"]))  # fmt: skip
        return "session", _Report(name="d")

    monkeypatch.setattr("snapctl.activation.donor.start_donor", start_donor)
    reporter = _Reporter()
    job = _job("donor", name="d", api_key_env="KEY", publish={"port": 0}, criu_path="/c")
    code = jobs.run_capture(
        job, reporter,  # type: ignore[arg-type]
        adopt=lambda request: events.append(("adopt", request.cwd, {
            name: value.get_secret_value() for name, value in request.environ.items()})),
    )  # fmt: skip
    assert code == 0
    assert events == [
        ("adopt", "/work", {"KEY": "v"}),
        ("start-donor", "d", "KEY", ("127.0.0.1", 0), "/images/x", "criu:/c"),
        "detach-stdio",
        ("supervise", ["session"]),
        "stop-all-tracked",
    ]
    assert reporter.sent == [{"report": {"name": "d"}}, {"closed": True}]


def test_the_bake_job_reports_and_exits_without_supervising(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("snapctl.activation.bake.bake_image",
                        lambda options, **kwargs: _Report(image="/images/x"))  # fmt: skip
    reporter = _Reporter()
    code = jobs.run_capture(_job("bake"), reporter, adopt=lambda request: None)  # type: ignore[arg-type]
    assert code == 0 and supervisor_seams == []
    assert reporter.sent == [{"report": {"image": "/images/x"}}, {"closed": True}]


def test_a_failed_capture_job_stops_what_it_started_and_reports_the_error(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def start_donor(options: Any, **kwargs: Any) -> Any:
        raise SnapctlError("name 'd' is in use")

    monkeypatch.setattr("snapctl.activation.donor.start_donor", start_donor)
    reporter = _Reporter()
    code = jobs.run_capture(_job("donor"), reporter, adopt=lambda request: None)  # type: ignore[arg-type]
    assert code == ExitStatus.ERROR and supervisor_seams == ["stop-all-tracked"]
    assert reporter.sent == [{"error": "name 'd' is in use"}]


def test_the_text_report_through_the_agent_is_drawn_as_in_process(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The renderers read a relayed report's mapping fields (``timings_s``) as mappings."""
    image = tmp_path / "image"
    image.mkdir()
    code, out, err = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach")
    assert code == 0, err
    assert "copy copy-1" in out and "time restore" in out and "50.0 ms" in out
    assert "no (restored for this request)" in out
    running_agent.spawner.script = [{"report": make_report(from_pool=True)}]
    code, out, err = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach")
    assert code == 0, err
    assert "from pool" in out and "yes (verify to restore ran while it was parked)" in out
    running_agent.spawner.script = [{"report": make_report(kind="donor", name="d")}]
    code, out, err = run_cli(capsys, "donor", "--image", str(tmp_path / "img"), "--detach")
    assert code == 0, err
    assert "donor d" in out and "time activate" in out and "running detached" in err


@pytest.mark.parametrize("detach", [False, True])
def test_a_donor_whose_report_reached_no_one_is_stopped_unless_detached(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch, detach: bool
) -> None:
    monkeypatch.setattr("snapctl.activation.donor.start_donor",
                        lambda options, **kwargs: ("session", _Report(name="d")))  # fmt: skip
    reporter = _Reporter(reader=False)
    job = _job("donor", detach=detach)
    code = jobs.run_capture(job, reporter, adopt=lambda request: None)  # type: ignore[arg-type]
    if detach:  # its own: `snapctl ps` lists it, `snapctl stop` stops it
        assert code == 0
        assert supervisor_seams == ["detach-stdio", ("supervise", ["session"]), "stop-all-tracked"]
    else:  # no client will stop it: it must not serve on with no owner
        assert code == ExitStatus.ERROR and supervisor_seams == ["stop-all-tracked"]


@pytest.mark.parametrize("detach", [False, True])
def test_a_copy_whose_report_reached_no_one_is_stopped_unless_detached(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch, detach: bool
) -> None:
    from snapctl.activation.requests import CopyRequest

    monkeypatch.setattr(jobs, "check_request", lambda request, state=None: None)
    monkeypatch.setattr(
        "snapctl.activation.copy.start_copy",
        lambda image, options, **kwargs: ("session", _Report(name="c")),
    )
    request = CopyRequest(image="/images/x", lazy=False, detach=detach)
    job = {"kind": "copy", "state": "/state", "request": request.model_dump(mode="json")}
    code = jobs.run_copy(job, _Reporter(reader=False))  # type: ignore[arg-type]
    if detach:
        assert code == 0
        assert supervisor_seams == ["detach-stdio", ("supervise", ["session"]), "stop-all-tracked"]
    else:
        assert code == ExitStatus.ERROR and supervisor_seams == ["stop-all-tracked"]


def _recording_signals(events: list[Any]) -> type[_Signals]:
    class Signals(_Signals):
        def started(self) -> None:
            events.append("signals-started")

    return Signals


def test_a_job_s_start_that_ends_well_lets_the_signals_ask_for_the_stop(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("snapctl.supervision.signals.StopSignals",
                        _recording_signals(supervisor_seams))  # fmt: skip
    reporter = _Reporter()
    with jobs.starting(reporter) as start:  # type: ignore[arg-type]
        supervisor_seams.append("start")
    assert start.failed is None and reporter.sent == []
    assert supervisor_seams == ["start", "signals-started"]


@pytest.mark.parametrize(
    ("raised", "status"),
    [(SnapctlError("name 'c' is in use"), ExitStatus.ERROR),
     (KeyboardInterrupt(), ExitStatus.INTERRUPTED)],
)  # fmt: skip
def test_a_job_s_start_that_fails_stops_what_it_started_then_reports_it_and_raises_nothing(
    supervisor_seams: list[Any], monkeypatch: pytest.MonkeyPatch, raised: BaseException,
    status: ExitStatus,
) -> None:  # fmt: skip
    monkeypatch.setattr("snapctl.supervision.signals.StopSignals",
                        _recording_signals(supervisor_seams))  # fmt: skip
    reporter = jobs.Reporter(os.open(os.devnull, os.O_WRONLY))
    monkeypatch.setattr(reporter, "send", lambda message: supervisor_seams.append(message))
    with jobs.starting(reporter) as start:
        supervisor_seams.append("start")
        raise raised
    assert start.failed == status
    assert supervisor_seams[:2] == ["start", "stop-all-tracked"]  # no signals-started
    assert [event["status"] for event in supervisor_seams[2:]] == [status]
    reporter.close()


def test_the_reporter_says_whether_its_message_was_delivered() -> None:
    read_fd, write_fd = os.pipe()
    reporter = jobs.Reporter(write_fd)
    try:
        assert reporter.send({"lane": "", "progress": "one"}) is True
        os.close(read_fd)  # the agent (or its relay) is gone
        assert reporter.send({"report": {}}) is False
    finally:
        reporter.close()
