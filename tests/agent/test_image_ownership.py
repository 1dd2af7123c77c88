"""The agent refuses what snapctl copy refuses in-process: ``pool set`` (and a copy through
the agent) of an image that someone other than root can change, before the pool keeps it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapctl.cli import main
from snapctl.errors import ExitStatus
from tests.agent.conftest import RunningAgent
from tests.images.factories import publish_sample

pytestmark = pytest.mark.timeout(60)
NOBODY = 65534


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def image(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    root.mkdir(mode=0o755)
    publish_sample(root / "sample")
    return root / "sample"


def test_pool_set_refuses_an_image_writable_by_others(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], image: Path
) -> None:
    os.chmod(image / "criu", 0o777)
    code, _, err = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "1")
    assert code == ExitStatus.VERIFY_FAILED, err
    assert f"{image / 'criu'} is a directory writable by its group and others" in err
    assert f"fix: chmod go-w {image / 'criu'}" in err
    assert running_agent.pool.targets == {}

    through = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach", "--json")
    assert through[0] == ExitStatus.VERIFY_FAILED and "writable by its group" in through[2]
    assert running_agent.pool.taken_for == []  # refused before a parked copy was taken

    os.chmod(image / "criu", 0o700)
    code, _, err = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "1")
    assert code == 0, err
    assert str(image) in running_agent.pool.targets


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_pool_set_refuses_an_image_owned_by_another_user(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], image: Path
) -> None:
    os.chown(image, NOBODY, -1)
    code, _, err = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "1")
    assert code == ExitStatus.VERIFY_FAILED, err
    assert f"{image} is a directory owned by uid {NOBODY}, not root" in err
    assert f"fix: chown root {image}" in err
    assert running_agent.pool.targets == {}
    # Reading it is not restoring it: the agent still inspects it.
    assert run_cli(capsys, "inspect", str(image), "--json")[0] == 0
