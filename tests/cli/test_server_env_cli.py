"""``--env``, ``--env-file`` and ``--inherit-env`` on ``donor``, ``bake`` and ``qualify`` (what
each asks to start, in-process and through the agent; nothing starts), and what ``inspect``,
``image export`` show of an image's environment: names, never values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.requests import BakeRequest
from snapctl.cli import main
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.qualification.suite import Plan
from tests.images.factories import publish_sample

pytestmark = pytest.mark.timeout(60)


class Stop(SnapctlError):
    """Raised where a command would start something: the test has seen what it asked."""


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CALLER_ONLY", "caller-value")
    monkeypatch.setenv("NAMED", "named-value")
    return tmp_path / "state"


@pytest.fixture
def through_agent(state: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The requests donor and bake send an agent that is never reached."""
    seen: list[dict[str, Any]] = []

    def send(client: object, request: dict[str, Any], **_: object) -> NoReturn:
        seen.append(request)
        raise Stop("stop here")

    monkeypatch.delenv("SNAPCTL_NO_AGENT", raising=False)
    monkeypatch.setattr("snapctl.cli.remote.agent_client", lambda: object())
    for name in ("donor_through_agent", "bake_through_agent"):
        monkeypatch.setattr(f"snapctl.cli.remote.{name}", send)
    return seen


@pytest.fixture
def in_process(state: Path, monkeypatch: pytest.MonkeyPatch) -> list[LaunchOptions]:
    """The launch options donor, bake and qualify start with in-process."""
    seen: list[LaunchOptions] = []

    def start(options: LaunchOptions, *args: object, **kwargs: object) -> NoReturn:
        seen.append(options)
        raise Stop("stop here")

    def qualify(plan: Plan, *args: object) -> NoReturn:
        start(plan.options)

    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    monkeypatch.setattr("snapctl.activation.donor.start_donor", start)
    monkeypatch.setattr("snapctl.activation.bake.bake_image", start)
    monkeypatch.setattr("snapctl.qualification.suite.qualify", qualify)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: None)
    return seen


def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "server.env"
    path.write_text("# given to the server\nFROM_FILE=file-value\nNAMED=from-the-file\n")
    return path


@pytest.mark.parametrize("command", ["donor", "bake"])
def test_the_agent_gets_the_resolved_selection_with_the_client_s_environment(
    command: str, tmp_path: Path, through_agent: list[dict[str, Any]]
) -> None:
    args = [command, "--image", str(tmp_path / "image"), "--env-file", str(env_file(tmp_path)),
            "--env", "NAMED", "--env", "GIVEN=given-value", "--env", "UNSET_HERE"]  # fmt: skip
    assert main(args) == ExitStatus.ERROR
    (request,) = through_agent
    # The files first, then each --env: NAME alone takes this environment's value.
    assert request["env"] == {"FROM_FILE": "file-value", "NAMED": "named-value",
                              "GIVEN": "given-value"}  # fmt: skip
    assert request["inherit_env"] is False
    assert request["environ"]["CALLER_ONLY"] == "caller-value"  # the supervisor's own
    options = BakeRequest.model_validate_json(
        json.dumps({k: v for k, v in request.items()
                    if k in BakeRequest.model_fields})).launch_options()  # fmt: skip
    assert options.env == request["env"] and options.inherit_env is False


@pytest.mark.parametrize("command", ["donor", "bake", "qualify"])
def test_in_process_the_launch_options_carry_the_selection(
    command: str, tmp_path: Path, in_process: list[LaunchOptions]
) -> None:
    assert main([command, "--image", str(tmp_path / command)]) == ExitStatus.ERROR
    assert main([command, "--image", str(tmp_path / command), "--inherit-env", "--env",
                 "NAMED=x", "--env-file", str(env_file(tmp_path))]) == ExitStatus.ERROR  # fmt: skip
    plain, inherited = in_process
    assert plain.env == {} and plain.inherit_env is False
    assert inherited.env == {"FROM_FILE": "file-value", "NAMED": "x"} and inherited.inherit_env


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--env", "BAD NAME=secret-value"], "Invalid value for --env: 'BAD NAME' is not"),
     (["--env-file", "missing.env"], "Invalid value for --env-file: missing.env: No such")],
)  # fmt: skip
def test_a_bad_env_option_is_a_usage_error_without_its_value(
    args: list[str], message: str, tmp_path: Path, in_process: list[LaunchOptions],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(["bake", "--image", str(tmp_path / "image"), *args]) == ExitStatus.USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "secret-value" not in err and in_process == []


def test_inspect_lists_the_names_and_export_warns_on_secret_looking_ones(
    tmp_path: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "image"
    publish_sample(image, server_env_names=["HOME", "MY_API_TOKEN", "PATH", "VLLM_USE_V1"])

    assert main(["inspect", str(image), "--brief"]) == 0
    words = capsys.readouterr().out.replace("│", " ").split()  # the table wraps its cells
    shown = " ".join(words[words.index("environment") + 1 : words.index("binds")])
    assert shown == ("4 variables, in the image's memory (names only): HOME MY_API_TOKEN PATH "
                     "VLLM_USE_V1; looking secret: MY_API_TOKEN")  # fmt: skip
    assert main(["inspect", str(image), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["manifest"]["server_env_names"] == ["HOME", "MY_API_TOKEN", "PATH",
                                                      "VLLM_USE_V1"]  # fmt: skip

    for as_json in ([], ["--json"]):
        archive = tmp_path / f"image{len(as_json)}.tar.zst"
        assert main(["image", "export", str(image), "--out", str(archive), *as_json]) == 0
        captured = capsys.readouterr()
        err = " ".join(captured.err.split())
        assert f"warning: {image}'s server was launched with MY_API_TOKEN" in err
        assert "HOME" not in err and "VLLM_USE_V1" not in err
        if as_json:
            assert json.loads(captured.out)["action"] == "export"  # stdout: the record only

    clean = tmp_path / "clean"
    publish_sample(clean, server_env_names=["HOME", "PATH"])
    assert main(["image", "export", str(clean), "--out", str(tmp_path / "c.tar.zst")]) == 0
    assert "warning" not in capsys.readouterr().err
