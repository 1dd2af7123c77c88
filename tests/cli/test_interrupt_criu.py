"""SIGTERM and SIGINT to a real foreground ``snapctl copy`` at several instants, including
while its report prints (issue 21: the copy kept running without a supervisor): the command
always ends, and leaves nothing running or mounted, without any gc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapctl.errors import ExitStatus
from snapctl.namespaces import mounts
from snapctl.supervision.process import each_argv
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

KEY = ("--api-key-env", API_KEY_ENV)


@pytest.fixture(scope="module")
def baked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("interrupt")
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(root / "state"), API_KEY_ENV: API_KEY}
    subprocess.run(
        [sys.executable, "-m", "snapctl", "bake", "--image", str(root / "image"), *KEY],
        env=env, check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    return root, env


def left_behind(state: Path) -> list[str]:
    """Activations, records and processes of every activation this state dir ever had."""
    found = [str(p) for p in (state / "activations").glob("*")]
    found += [str(p) for p in (state / "records").glob("*.json")]
    for logs in (state / "logs").glob("copy-*"):
        found += [f"pid {pid}" for pid in mounts.processes_with_mount(f"snapctl-{logs.name}",
                                                                     "/dev/shm")]  # fmt: skip
    return found + mounts.mounts_under(state)


@pytest.mark.parametrize(
    ("signum", "when"),
    [
        (signal.SIGTERM, "report"),  # the moment its report is written
        (signal.SIGINT, "report"),
        (signal.SIGTERM, "restoring"),  # its activation directory exists: restore, activation
        (signal.SIGINT, "restoring"),
        (signal.SIGTERM, "startup"),  # before its handlers exist: nothing started either
    ],
)
def test_an_interrupted_foreground_copy_leaves_nothing(
    baked: tuple[Path, dict[str, str]], signum: int, when: str | float
) -> None:
    root, env = baked
    # Only this copy's activation counts (a failed case before it may have left its own).
    before = set((root / "state" / "activations").glob("copy-*"))
    copy = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "copy", "--image", str(root / "image"), "--no-lazy",
         "--publish", "127.0.0.1:0", *KEY, "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        if when == "report":
            assert copy.stdout is not None
            line = copy.stdout.readline()  # the report: it is serving now
            assert line.startswith(b"{"), copy.stderr.read() if copy.stderr else ""
        elif when == "restoring":
            deadline = time.monotonic() + 60
            while not set((root / "state" / "activations").glob("copy-*")) - before:
                assert time.monotonic() < deadline and copy.poll() is None
                time.sleep(0.005)
        copy.send_signal(signum)
        _, errors = copy.communicate(timeout=60)
    finally:
        if copy.poll() is None:
            copy.kill()
            copy.wait()
    # Stopped while serving (0), while starting (130), or killed by the default action before
    # snapctl took the signals over, when it had started nothing yet.
    assert copy.returncode in (ExitStatus.OK, ExitStatus.INTERRUPTED, -signum), errors
    if when != "startup":
        assert copy.returncode != -signum, "the default action killed it"
    assert b"Traceback" not in errors
    assert left_behind(root / "state") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_bake_stops_what_it_launched(
    tmp_path: Path, signum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process (``--no-agent``): its server never gets ready, the signal comes while the
    bake waits for it; the bake ends as interrupted and its sandbox and server are gone."""
    state = tmp_path / "state"
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state)}
    marker = f"never-ready-{tmp_path.name}"
    server = [sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"]
    bake = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "--no-agent", "bake", "--image",
         str(tmp_path / "image"), "--ready-timeout", "120", "--", *server],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip

    def servers() -> list[int]:  # observed only: never signalled by name
        return [pid for pid, argv in each_argv() if argv[: len(server)] == server]

    try:
        deadline = time.monotonic() + 60
        while not servers():
            assert time.monotonic() < deadline and bake.poll() is None
            time.sleep(0.05)
        bake.send_signal(signum)
        _, errors = bake.communicate(timeout=60)
    finally:
        if bake.poll() is None:
            bake.kill()
            bake.wait()
    assert bake.returncode == ExitStatus.INTERRUPTED, errors
    assert b"Traceback" not in errors
    deadline = time.monotonic() + 30
    while servers():
        assert time.monotonic() < deadline, f"left running: {servers()}"
        time.sleep(0.05)
    assert not (tmp_path / "image" / "manifest.json").exists()
    assert list((state / "activations").glob("*")) == [] and mounts.mounts_under(state) == []
