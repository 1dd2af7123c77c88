"""The click-free path of ``snapctl copy ... --detach --json`` (:mod:`snapctl.thin`): the
request it builds is the full CLI's, it declines whatever it does not fully understand, and
through an agent it prints what the full CLI prints, importing neither click nor anything
heavy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from snapctl.cli import main as full_main
from snapctl.entry import main
from snapctl.errors import ExitStatus
from snapctl.thin import parse_fast_copy
from tests.agent.conftest import RunningAgent, make_report
from tests.agent.test_server import HEAVY


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "image"
    path.mkdir()
    return path


def click_request(args: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The request the full CLI (click) sends the agent for ``args``."""
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr("snapctl.cli.remote.agent_client", lambda: object())
    monkeypatch.setattr(
        "snapctl.cli.remote.copy_through_agent",
        lambda client, request, **_: sent.append(request),
    )
    assert full_main(args) == 0
    (request,) = sent
    return request


ACCEPTED = [
    [],
    ["--publish", "18000"],
    ["--publish=[::1]:18001", "--expose"],
    ["--publish", "0.0.0.0:0", "--expose", "--name", "a.b-c_1"],
    ["--lazy"],
    ["--no-lazy", "--host", "0.0.0.0", "--port", "9000"],
    ["--timeout", "12.5", "--api-key-env", "MY_KEY"],
    ["--timeout=1e3", "--port=1"],
]


@pytest.mark.parametrize("extra", ACCEPTED)
def test_its_request_is_the_full_cli_s(
    extra: list[str], image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_KEY", "secret")
    args = ["copy", "--image", str(image), *extra, "--detach", "--json"]
    assert parse_fast_copy(args) == click_request(args, monkeypatch)


DECLINED = [
    ["--count", "2"],
    ["--allow-mismatch", "kernel"],
    ["--criu", "/bin/criu"],
    ["--native", "none"],
    ["--plain-http"],
    ["--name", "bad/name"],
    ["--name", "--json"],
    ["--name="],
    ["--publish", "nope"],
    ["--publish", "70000"],
    ["--port", "0"],
    ["--port", "x"],
    ["--timeout", "0"],
    ["--timeout", "inf"],
    ["--lazy", "--no-lazy"],
    ["--publish", "1", "--publish", "2"],
    ["--json=1"],
    ["--help"],
    ["--", "python", "server.py"],
    ["server.py"],
    ["--no-agent"],
    ["--", "python", "-m", "server", "--json", "--detach"],
]


@pytest.mark.parametrize("extra", DECLINED)
def test_it_declines_what_it_does_not_fully_understand(extra: list[str], image: Path) -> None:
    assert parse_fast_copy(["copy", "--image", str(image), "--detach", "--json", *extra]) is None


@pytest.mark.parametrize("unknown", ["--no-agent", "--traceback", "--no-such", "-x"])
def test_an_option_copy_does_not_know_is_declined_and_the_full_cli_refuses_it(
    unknown: str, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["copy", "--image", str(image), unknown, "--detach", "--json"]
    assert parse_fast_copy(args) is None
    assert full_main(args) == ExitStatus.USAGE
    assert f"No such option '{unknown}'" in capsys.readouterr().err


NAMES = ["a", "Z9", "a.b-c_1", "x" * 64, "x" * 65, "", "-a", ".a", "_a", "a/b", "a b", "é",
         "a\n", "a\x00", "\u0661", "\uff41", "A" + "-" * 63, "0"]  # fmt: skip


def test_its_name_check_is_the_name_pattern() -> None:
    from snapctl.statedir.names import NAME_PATTERN
    from snapctl.thin import is_activation_name

    for name in NAMES:
        assert is_activation_name(name) == bool(NAME_PATTERN.fullmatch(name)), repr(name)
    assert sum(map(is_activation_name, NAMES)) == 6


def test_it_needs_detach_json_and_an_image_directory(image: Path, tmp_path: Path) -> None:
    assert parse_fast_copy(["copy", "--image", str(image), "--json"]) is None
    assert parse_fast_copy(["copy", "--image", str(image), "--detach"]) is None
    assert parse_fast_copy(["copy", "--detach", "--json"]) is None
    ref = ["copy", "--image", "registry.local/one:tag", "--detach", "--json"]
    assert parse_fast_copy(ref) is None  # pulled in-process first
    global_option = ["--no-agent", "copy", "--image", str(image), "--detach", "--json"]
    assert parse_fast_copy(global_option) is None


def test_through_the_agent_it_prints_what_the_full_cli_prints(
    running_agent: RunningAgent, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["copy", "--image", str(image), "--no-lazy", "--detach", "--json"]
    assert main(args) == 0
    fast = capsys.readouterr()
    assert full_main(args) == 0
    assert capsys.readouterr() == fast and json.loads(fast.out) == make_report()
    assert [job["request"]["lazy"] for job in running_agent.spawner.jobs] == [False, False]


def test_a_failure_reads_as_the_full_cli_s(
    running_agent: RunningAgent, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failure = {"error": "restore failed", "status": int(ExitStatus.ACTIVATION_FAILED),
               "phase": "restore", "path": None, "log_tail": "last line"}  # fmt: skip
    args = ["copy", "--image", str(image), "--no-lazy", "--detach", "--json"]
    running_agent.spawner.script = [dict(failure)]
    fast = main(args), capsys.readouterr()
    running_agent.spawner.script = [dict(failure)]
    assert (full_main(args), capsys.readouterr()) == fast
    assert fast[0] == ExitStatus.ACTIVATION_FAILED and "restore failed" in fast[1].err


def test_without_an_agent_the_full_cli_runs(
    image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    ran: list[list[str]] = []
    monkeypatch.setattr("snapctl.cli.main", lambda args: ran.append(args) or 0)
    args = ["copy", "--image", str(image), "--detach", "--json"]
    assert main(args) == 0 and ran == [args]


def test_as_a_process_it_imports_no_click_and_ends_with_the_report(
    running_agent: RunningAgent, image: Path
) -> None:
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "snapctl", "copy", "--image", str(image),
         "--no-lazy", "--detach", "--json", "--name", "light", "--publish", "127.0.0.1:0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and json.loads(done.stdout) == make_report()
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert {name for name in imported if name.split(".")[0] in HEAVY} == set()


# Standard library modules that each cost a pooled copy's command a millisecond or more to
# import, none of which a socket request and a JSON record need (json and socket: their C
# halves serve, see snapctl.wire).
SLOW_STDLIB = {"typing", "pathlib", "threading", "contextlib", "unicodedata", "subprocess",
               "logging", "http", "email", "ssl", "asyncio", "dataclasses", "inspect", "re",
               "enum", "json", "socket", "selectors", "string"}  # fmt: skip
# Imported only once something failed (its exit statuses are an enum).
FAILURE_ONLY = {"snapctl.errors", "snapctl.agent.errors", "snapctl.phases"}
COMMAND = Path(__file__).parents[2] / "bin" / "snapctl"  # the console script pip installs


def test_the_installed_command_is_the_script_not_an_entry_point_wrapper() -> None:
    """What the paths below time is ``bin/snapctl``; the install must be that script (pip's
    wrapper for an entry point imports ``re``), and scripts/setup must refresh a stale copy."""
    installed = Path(sys.executable).parent / "snapctl"
    assert installed.exists(), f"snapctl is not installed beside {sys.executable}: scripts/setup"
    body = installed.read_text().split("\n", 1)[1]  # pip rewrites only the shebang
    assert body == COMMAND.read_text().split("\n", 1)[1]


@pytest.mark.parametrize("command", ["copy", "ps"])
def test_a_command_the_agent_answers_imports_only_the_cheapest_of_the_standard_library(
    running_agent: RunningAgent, image: Path, command: str
) -> None:
    """The console script, run without ``site`` (whatever the install's .pth files import is
    not this path's doing): nothing from :data:`SLOW_STDLIB`, :data:`HEAVY` or
    :data:`FAILURE_ONLY`."""
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root),
           "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    args = ["ps", "--json"] if command == "ps" else [
        "copy", "--image", str(image), "--no-lazy", "--detach", "--json", "--name", "cheap",
        "--publish", "127.0.0.1:0"]  # fmt: skip
    done = subprocess.run([sys.executable, "-S", "-X", "importtime", str(COMMAND), *args],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ([] if command == "ps" else make_report())
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "snapctl.agent.client" in imported  # the agent answered, not the full CLI
    slow = {name for name in imported if name.split(".")[0] in SLOW_STDLIB | HEAVY}
    assert slow | (imported & FAILURE_ONLY) == set()


def test_a_failure_through_the_agent_imports_the_error_tree_and_reports_it(
    running_agent: RunningAgent, image: Path
) -> None:
    failure = {"error": "criu restore failed", "status": int(ExitStatus.ACTIVATION_FAILED),
               "phase": "restore", "path": None, "log_tail": None}  # fmt: skip
    running_agent.spawner.script = [dict(failure)]
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root),
           "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(COMMAND), "copy", "--image", str(image),
         "--no-lazy", "--detach", "--json"], env=env, capture_output=True, text=True,
        timeout=60)  # fmt: skip
    assert done.returncode == ExitStatus.ACTIVATION_FAILED, done.stderr[-2000:]
    assert "criu restore failed" in done.stderr and done.stdout == ""
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    # The thin path asked; the full CLI's agent path (cli.remote) never ran.
    assert {"snapctl.agent.client", "snapctl.agent.errors"} <= imported
    assert "snapctl.cli.remote" not in imported


def test_a_usage_refusal_is_reported_by_the_full_cli_and_starts_nothing(
    running_agent: RunningAgent, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["copy", "--image", str(image), "--detach", "--json", "--expose"]
    assert parse_fast_copy(args) is not None  # the agent refuses it, not the parser
    fast = main(args), capsys.readouterr()
    assert fast[0] == ExitStatus.USAGE and "--expose only widens --publish" in fast[1].err
    assert (full_main(args), capsys.readouterr()) == fast
    assert running_agent.spawner.jobs == []


@pytest.mark.parametrize(
    "given", ["img", "img/", "./img", "img//x/", "a/../img", "/abs/img/", "/abs/./img", ""]
)
def test_request_paths_are_written_as_pathlib_writes_them(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool matches a request to a parked copy by its image path as a string, and
    ``pool set`` writes it as pathlib does: ``img/`` must not miss a copy parked for ``img``."""
    from snapctl.agent import absolute

    monkeypatch.chdir(tmp_path)
    assert absolute(given) == str(Path(given).absolute())


def test_held_signals_hold_sigint_and_sigterm_then_give_back_the_handlers() -> None:
    import signal

    from snapctl.thin import HeldSignals

    notified: list[bool] = []
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with HeldSignals(lambda: notified.append(True)) as held:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert held.signalled and notified == [True, True]
    assert {signum: signal.getsignal(signum) for signum in before} == before
