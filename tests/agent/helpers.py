"""What the real agent and pool tests (tests/agent, tests/pool, tests/vllm) share: a state
directory cleaned up after them, a captured fixture image, ``snapctl agent`` in its own
process and the CLI run against it, and bounded waits (for parked copies, for processes to
end). The fixtures are in tests/conftest.py (``agent_state``, ``donor_image``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from snapctl.agent.client import connect
from snapctl.criu import CriuBinary
from snapctl.errors import SnapctlError
from snapctl.statedir import StateDir
from snapctl.supervision.process import is_same_process
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV, complete, launch_donor

T = TypeVar("T")


class Started(Generic[T]):
    """What a test starts (agents, pool hosts), each by ``start()``; its fixture ends them."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self.started: list[T] = []

    def start(self) -> T:
        started = self._factory()
        self.started.append(started)
        return started


def until(
    condition: Callable[[], bool], timeout_s: float = 90.0, shown: Callable[[], Any] = str
) -> None:
    """Wait for ``condition``, polling; fail after ``timeout_s``, showing ``shown()``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {shown()}"
        time.sleep(0.1)


def gone(pid: int, start_time: float | None) -> bool:
    """Not running: exited (a zombie counts: a test process that is a subreaper gets the
    orphans of a killed agent as its children), or the PID is another process's now."""
    return start_time is None or not is_same_process(pid, start_time)


def clean_up(state: StateDir) -> None:
    """End whatever a test left running in ``state``: parked copies, activations, orphans."""
    from snapctl.activation.supervise import collect_orphans, stop_recorded
    from snapctl.pool.records import discard_recorded, load_parked_records

    for _home, parked in load_parked_records(state):
        if parked is not None:
            discard_recorded(parked, state)
    for record in state.load_records():
        stop_recorded(record, state)
    collect_orphans(state)


def stop_all_clean(state: StateDir) -> None:
    """Stop every activation recorded in ``state``; each stop must leave nothing behind."""
    from snapctl.activation.supervise import stop_recorded

    for record in state.load_records():
        _how, audit = stop_recorded(record, state)
        assert audit.clean, audit.describe()


def capture_donor(tmp_path: Path, state: StateDir, criu: CriuBinary) -> tuple[Path, Any]:
    """An image of the fixture server, and the donor's greedy completion before it stopped."""
    image = tmp_path / "image"
    session, report = launch_donor(image, state, criu, publish=("127.0.0.1", 0))
    try:
        assert report.published is not None
        expected = complete(report.published)
    finally:
        session.stop()
    return image, expected


def env_for(state: StateDir, **extra: str) -> dict[str, str]:
    """The environment of a CLI or agent process on ``state`` (an agent answers it)."""
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state.root), API_KEY_ENV: API_KEY, **extra}
    env.pop("SNAPCTL_NO_AGENT", None)
    env.pop("SNAPCTL_AGENT_SOCKET", None)
    return env


def cli(
    state: StateDir, *args: str, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """``snapctl ARGS`` in its own process, on ``state``; ``check``: it must exit 0."""
    done = subprocess.run([sys.executable, "-m", "snapctl", *args], env=env_for(state),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if check:
        assert done.returncode == 0, done.stderr
    return done


class AgentProcess:
    """``snapctl agent`` on ``state`` in its own process, answering once constructed."""

    def __init__(self, state: StateDir, *, held_transfers: bool = False) -> None:
        """``held_transfers``: every lazy copy's background transfer held for a minute
        (``tests/held_transfer.py``)."""
        self.state = state
        self.log = state.root.parent / "agent.log"
        cli = "tests.held_transfer" if held_transfers else "snapctl"
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                # The host's KSM is the machine's: tests do not start it.
                [sys.executable, "-m", cli, "agent", "--no-share-memory"],
                env=env_for(state),
                stdout=log,
                stderr=log,
            )
        # Answering, not only there: a killed agent's socket file stays until the next binds.
        until(lambda: self._answers() or self.process.poll() is not None)
        assert self.process.poll() is None, self.log.read_text()

    def _answers(self) -> bool:
        client = connect(self.state.root / "agent.sock")
        if client is None:
            return False
        try:
            return bool(client.call("GET", "/version")["pid"] == self.process.pid)
        except SnapctlError:
            return False

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)
            self.process.wait(60)


def parked_rows(state: StateDir, which: str = "parked") -> list[dict[str, Any]]:
    """``pool ls --json``'s parked copies in state ``which`` ("any": all of them)."""
    listing = json.loads(cli(state, "pool", "ls", "--json").stdout)
    rows = [row for entry in listing["entries"] for row in entry["parked"]]
    return [row for row in rows if which == "any" or row["state"] == which]


def wait_parked(state: StateDir, timeout_s: float = 90.0) -> None:
    """Until the agent on ``state`` has a copy parked (``pool ls``)."""
    until(lambda: bool(parked_rows(state)), timeout_s=timeout_s,
          shown=lambda: parked_rows(state, "any"))  # fmt: skip


def fill_pool(state: StateDir, image: Path, timeout_s: float = 90.0) -> None:
    """``pool set --size 1 --no-lazy`` through the agent on ``state``, and wait until a copy
    of ``image`` is parked."""
    cli(state, "pool", "set", "--image", str(image), "--size", "1", "--no-lazy")
    wait_parked(state, timeout_s)
