"""Where the options of ``copy``, ``bake``, ``donor`` and ``qualify`` end and the server's
command (SERVER_CMD) begins: ``--`` or the first argument that is not an option. Before that,
an option the command does not know is a usage error naming it, never a program to launch;
from there on every argument is the server's, its options included."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import pytest

from snapctl.activation.timeouts import DEFAULT_PORT
from snapctl.cli import main
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.qualification.suite import Plan

pytestmark = pytest.mark.timeout(60)

COMMANDS = ["copy", "bake", "donor", "qualify"]
SERVER = ["python", "-m", "server", "--port", "1", "--json", "--no-agent"]


class Stop(SnapctlError):
    """Raised where a command would start something: the test has seen what it asked."""


@pytest.fixture
def asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What each command asks to start (the agent's request, or qualify's launch options),
    through an agent that is never reached; nothing starts."""
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("SNAPCTL_NO_AGENT", raising=False)
    seen: list[dict[str, Any]] = []

    def through_agent(client: object, request: dict[str, Any], **_: object) -> NoReturn:
        seen.append(request)
        raise Stop("stop here")

    def qualify(plan: Plan, *args: object) -> NoReturn:
        seen.append({"server_argv": plan.options.server_argv, "port": plan.options.port,
                     "as_json": None})  # fmt: skip
        raise Stop("stop here")

    monkeypatch.setattr("snapctl.cli.remote.agent_client", lambda: object())
    for name in ("copy_through_agent", "donor_through_agent", "bake_through_agent"):
        monkeypatch.setattr(f"snapctl.cli.remote.{name}", through_agent)
    monkeypatch.setattr("snapctl.qualification.suite.qualify", qualify)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    return seen


def image_args(command: str, tmp_path: Path) -> list[str]:
    """A copy's ``--image`` (a directory: the agent restores it); a capture's (not yet there)."""
    image = tmp_path / "image"
    if command == "copy":
        image.mkdir(exist_ok=True)
    return ["--image", str(image)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("unknown", ["--no-agent", "--traceback", "--no-such", "-x", "--jsn=1"])
def test_an_unknown_option_before_the_server_command_is_a_usage_error(
    command: str, unknown: str, tmp_path: Path, asked: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    args = [command, *image_args(command, tmp_path), unknown, "--", *SERVER]

    assert main(args) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert f"No such option '{unknown.split('=')[0]}'" in err, err
    assert asked == []  # nothing was asked to start


@pytest.mark.parametrize("command", COMMANDS)
def test_an_option_of_snapctl_itself_is_named_as_one(
    command: str, tmp_path: Path, asked: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, *image_args(command, tmp_path), "--no-agent"]) == ExitStatus.USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"it is snapctl's own, given before the command (snapctl --no-agent {command} " in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("dashes", [["--"], []], ids=["after --", "without --"])
def test_the_server_command_is_passed_on_as_given_with_its_own_options(
    command: str, dashes: list[str], tmp_path: Path, asked: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Its ``--port``, ``--json`` and ``--no-agent`` are the server's, not the command's (a
    ``--`` is needed only when the server's command begins with an option)."""
    args = [command, *image_args(command, tmp_path), "--timeout", "60", *dashes, *SERVER]

    assert main(args) == ExitStatus.ERROR, capsys.readouterr().err
    (request,) = asked
    assert request["server_argv"] == SERVER
    assert request["port"] == DEFAULT_PORT
    assert request.get("as_json") is None


@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_command_that_begins_with_an_option_follows_dashes(
    command: str, tmp_path: Path, asked: list[dict[str, Any]]
) -> None:
    args = [command, *image_args(command, tmp_path), "--", "--weird", "x"]

    assert main(args) == ExitStatus.ERROR
    assert [request["server_argv"] for request in asked] == [["--weird", "x"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_without_a_server_command_the_options_are_all_the_command_s(
    command: str, tmp_path: Path, asked: list[dict[str, Any]]
) -> None:
    assert main([command, *image_args(command, tmp_path), "--port", "9000"]) == ExitStatus.ERROR
    assert [(r["server_argv"], r["port"]) for r in asked] == [(None, 9000)]


def test_a_global_option_before_the_command_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []

    def bake_image(*args: object, **kwargs: object) -> NoReturn:
        started.append(args)
        raise Stop("stop here")

    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr("snapctl.agent.client.connect", lambda: pytest.fail("asked the agent"))
    monkeypatch.setattr("snapctl.activation.bake.bake_image", bake_image)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    args = ["--no-agent", "bake", "--image", str(tmp_path / "image"), "--", "python", "-V"]
    assert main(args) == ExitStatus.ERROR and len(started) == 1


@pytest.mark.parametrize("command", ["copy", "bake", "donor"])
def test_a_relative_criu_path_is_sent_absolute(
    command: str, tmp_path: Path, asked: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([command, *image_args(command, tmp_path), "--criu", "bin/criu"]) == 1
    assert [request["criu_path"] for request in asked] == [str(tmp_path / "bin" / "criu")]
