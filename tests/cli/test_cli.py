"""The snapctl CLI: version, lazy command listing, error-to-exit-status mapping, doctor."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import click
import pytest
from click.testing import CliRunner

from snapctl import __version__
from snapctl.activation.launch import LaunchOptions
from snapctl.cli import COMMANDS, load_command, main, snapctl
from snapctl.criu import CriuError
from snapctl.criu.stats import DumpStats
from snapctl.doctor import DoctorReport
from snapctl.errors import CanaryMismatchError, ExitStatus, SnapctlError
from snapctl.qualification.suite import Plan
from tests.images.factories import publish_sample

HEAVY_MODULES = ("pydantic", "rich", "psutil", "pyroute2", "watchdog")


@pytest.fixture
def raising(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """A ``boom`` command that raises whatever the test puts in the returned list."""
    to_raise: list[BaseException] = []

    @click.command()
    def boom() -> None:
        """Raise the exception the test chose."""
        raise to_raise[0]

    monkeypatch.setitem(snapctl.commands, "boom", boom)
    yield to_raise


def test_version() -> None:
    result = CliRunner().invoke(snapctl, ["--version"])

    assert result.exit_code == 0 and result.stdout == f"snapctl {__version__}\n"


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(snapctl, ["--help"])

    assert result.exit_code == 0 and "--traceback" in result.stdout
    for name, lazy in COMMANDS.items():
        assert f"{name}  " in result.stdout and lazy.short_help in result.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_listed_command_loads_and_matches_its_listing(name: str) -> None:
    command = load_command(name, COMMANDS[name].target)

    assert command.name == name
    assert (command.help or "").strip().splitlines()[0] == COMMANDS[name].short_help


@pytest.mark.parametrize("command", ["copy", "donor"])
def test_command_help_imports_nothing_heavy(command: str) -> None:
    # `snapctl copy --help` imports its command module, but not what only running it needs.
    probe = (
        "import sys\n"
        "from snapctl.cli import main\n"
        "code = main([sys.argv[1], '--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[2:]))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, command, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    assert done.stdout.splitlines()[-1] == "[]"


def test_help_imports_no_command_and_nothing_heavy() -> None:
    # --help must stay fast: the group lists commands from COMMANDS without importing them.
    probe = (
        "import sys\n"
        "from snapctl.cli import main\n"
        "code = main(['--help'])\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in sys.argv[1:]"
        " or m.startswith('snapctl.cli.')]\n"
        "print(sorted(loaded))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    assert done.stdout.splitlines()[-1] == "[]"


def test_snapctl_error_is_one_red_line_with_phase_and_path(
    raising: list[BaseException], capsys: pytest.CaptureFixture[str]
) -> None:
    raising.append(SnapctlError("control dir is not empty", phase="prepare", path="/run/x"))

    code = main(["boom"])

    assert code == ExitStatus.ERROR
    assert capsys.readouterr().err == "error: control dir is not empty [phase: prepare] (/run/x)\n"


def test_criu_error_names_its_log_once_and_shows_the_tail(
    raising: list[BaseException], capsys: pytest.CaptureFixture[str]
) -> None:
    raising.append(CriuError("dump", 1, Path("/logs/dump.log"), "Error (cr-dump.c:1): boom"))

    code = main(["boom"])

    err = capsys.readouterr().err
    assert code == ExitStatus.CAPTURE_FAILED
    assert err.splitlines() == [
        "error: criu dump exited with status 1 (log: /logs/dump.log)",
        "Error (cr-dump.c:1): boom",
    ]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (CriuError("restore", None, Path("/r.log"), ""), ExitStatus.ACTIVATION_FAILED),
        (CanaryMismatchError("canary text differs"), ExitStatus.VERIFY_FAILED),
        (KeyboardInterrupt(), ExitStatus.INTERRUPTED),
        (ValueError("unexpected"), ExitStatus.ERROR),
    ],
)
def test_exit_status_mapping(
    raising: list[BaseException],
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
    status: ExitStatus,
) -> None:
    raising.append(error)

    assert main(["boom"]) == status
    if isinstance(error, ValueError):
        assert "error: ValueError: unexpected (--traceback shows where)" in capsys.readouterr().err


def test_declared_exit_status_wins(raising: list[BaseException]) -> None:
    error = SnapctlError("image identity differs")
    error.exit_status = ExitStatus.ACTIVATION_FAILED  # type: ignore[attr-defined]
    raising.append(error)

    assert main(["boom"]) == ExitStatus.ACTIVATION_FAILED


@pytest.mark.parametrize("error", [SnapctlError("x"), KeyboardInterrupt(), ValueError("y")])
def test_traceback_flag_reraises(raising: list[BaseException], error: BaseException) -> None:
    raising.append(error)

    with pytest.raises(type(error)):
        main(["--traceback", "boom"])


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == ExitStatus.USAGE
    assert "No such command" in capsys.readouterr().err


def test_doctor_json_is_one_valid_report() -> None:
    result = CliRunner().invoke(snapctl, ["doctor", "--json"])

    report = DoctorReport.model_validate_json(result.stdout)
    assert len(result.stdout.splitlines()) == 1
    assert result.exit_code == (ExitStatus.OK if report.ready else ExitStatus.ERROR)
    assert {"criu", "criu check", "root", "namespaces"} <= {check.name for check in report.checks}


@pytest.mark.criu
def test_doctor_reports_ok_on_a_capture_machine() -> None:
    result = CliRunner().invoke(snapctl, ["doctor", "--json"])

    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert report["ready"] is True
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert statuses["criu"] == statuses["criu check"] == statuses["namespaces"] == "ok"


def test_doctor_table_renders(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor"])

    out = capsys.readouterr().out
    assert code in (ExitStatus.OK, ExitStatus.ERROR)
    assert "criu check" in out and "namespaces" in out


def test_doctor_with_a_bogus_criu_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "no-such-criu"

    code = main(["doctor", "--json", "--criu", str(bogus)])

    captured = capsys.readouterr()
    criu = {check["name"]: check for check in json.loads(captured.out)["checks"]}["criu"]
    assert code == ExitStatus.ERROR
    assert criu["status"] == "fail"
    assert criu["detail"] == f"CRIU given by option does not exist: {bogus}"
    assert criu["fix"].startswith("--criu must name a CRIU >= 4.2")
    assert captured.err == "error: capture cannot work here: criu, criu check failed\n"


@pytest.mark.parametrize(
    ("flags", "pages", "expected"),
    [
        ([], 65536, True),  # 256 MiB of pages: lazy by default
        ([], 65535, False),
        (["--lazy"], 1, True),
        (["--no-lazy"], 10**6, False),
    ],
)
def test_copy_restores_lazily_by_default_from_256_mib_of_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], pages: int, expected: bool
) -> None:
    image = tmp_path / "image"
    publish_sample(image, dump_stats=DumpStats(pages_written=pages))
    asked: list[bool] = []

    def start_copy(*args: object, lazy: bool, **kwargs: object) -> NoReturn:
        asked.append(lazy)
        raise SnapctlError("stop here")

    monkeypatch.setattr("snapctl.activation.copy.start_copy", start_copy)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    result = CliRunner().invoke(snapctl, ["copy", "--image", str(image), *flags])
    assert str(result.exception) == "stop here" and asked == [expected]


@pytest.mark.parametrize(
    ("command", "target"),
    [
        ("copy", "snapctl.activation.copy.start_copy"),
        ("donor", "snapctl.activation.donor.start_donor"),
        ("bake", "snapctl.activation.bake.bake_image"),
    ],
)
def test_a_value_the_request_refuses_is_a_usage_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, target: str
) -> None:
    """In-process, the command's request is read as the agent's model: a value the model
    refuses (and click does not) fails as a usage error naming the field."""
    image = tmp_path / "image"
    if command == "copy":
        publish_sample(image)
    started: list[object] = []
    monkeypatch.setattr(target, lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path=None: None)
    result = CliRunner().invoke(snapctl, [command, "--image", str(image), "--api-key-env", "1X"])
    assert result.exit_code == ExitStatus.USAGE, result.output
    assert "Error: api_key_env: String should match pattern" in result.output
    assert started == []


@pytest.mark.parametrize(
    ("command", "target"),
    [
        ("donor", "snapctl.activation.donor.start_donor"),
        ("bake", "snapctl.activation.bake.bake_image"),
        ("qualify", "snapctl.qualification.suite.qualify"),
    ],
)
def test_startup_timeouts_are_options_of_every_command_that_launches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, target: str
) -> None:
    asked: list[tuple[float, float, float]] = []

    def launch(given: LaunchOptions | Plan, *args: object, **kwargs: object) -> NoReturn:
        options = given.options if isinstance(given, Plan) else given
        asked.append((options.ready_timeout_s, options.server_timeout_s, options.timeout_s))
        raise SnapctlError("stop here")

    monkeypatch.setattr(target, launch)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    image = ["--image", str(tmp_path / "image")]
    runner = CliRunner()
    result = runner.invoke(snapctl, [command, *image])
    assert str(result.exception) == "stop here"
    flags = ["--ready-timeout", "1800", "--server-timeout", "2400.5", "--timeout", "60"]
    result = runner.invoke(snapctl, [command, *image, *flags])
    assert str(result.exception) == "stop here"
    assert asked == [(900.0, 900.0, 300.0), (1800.0, 2400.5, 60.0)]  # vLLM's 900 by default


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "soon"])
@pytest.mark.parametrize("flag", ["--ready-timeout", "--server-timeout", "--timeout"])
def test_timeouts_must_be_positive_and_finite(tmp_path: Path, flag: str, value: str) -> None:
    result = CliRunner().invoke(snapctl, ["bake", "--image", str(tmp_path / "i"), flag, value])
    assert result.exit_code == ExitStatus.USAGE
    assert f"Invalid value for '{flag}'" in result.output
    assert "seconds" in result.output


def test_startup_timeouts_are_documented_in_help() -> None:
    for command in ("donor", "bake", "qualify"):
        result = CliRunner().invoke(snapctl, [command, "--help"])
        assert "--ready-timeout SECONDS" in result.output
        assert "--server-timeout SECONDS" in result.output


def test_published_ports_of_count_copies_must_fit_below_65536(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        snapctl,
        ["copy", "--image", str(tmp_path), "--count", "3", "--publish", "127.0.0.1:65534"],
    )
    assert result.exit_code == 2, result.output
    assert "past 65535" in result.output


@pytest.mark.parametrize("published", [True, False])
def test_an_in_process_bake_interrupted_after_publishing_names_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    published: bool,
) -> None:  # fmt: skip
    """A signal in the bake's last milliseconds (the original tree's stop) still exits as
    interrupted, saying the image is there, as the agent's path says it."""
    image = tmp_path / "image"

    def bake_image(*args: object, **kwargs: object) -> NoReturn:
        if published:
            publish_sample(image)
        raise KeyboardInterrupt

    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr("snapctl.activation.bake.bake_image", bake_image)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    assert main(["--no-agent", "bake", "--image", str(image)]) == ExitStatus.INTERRUPTED
    err = capsys.readouterr().err
    assert (f"after it published {image}" in " ".join(err.split())) is published, err
