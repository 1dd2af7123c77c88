"""gc's straggler search against a sandbox init that binds /dev/shm and execs *between* two of
its scans (no root: the scans are scripted, the "init" is a real sleeping child)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation import session as session_module
from snapctl.activation.session import end_stragglers
from snapctl.namespaces import layout
from snapctl.namespaces.layout import SANDBOX_INIT_MODULE, ActivationDirs
from snapctl.supervision import process as process_module


class Init:
    """A sandbox init seen by gc's scans: each scan is one instant; ``moves_at`` is the scan
    (counted from 0) before which the init binds /dev/shm and execs the server."""

    def __init__(self, pid: int, dirs: ActivationDirs, moves_at: int) -> None:
        self.pid, self.dirs, self.moves_at, self.scans = pid, dirs, moves_at, 0

    @property
    def moved(self) -> bool:
        return self.scans > self.moves_at

    @property
    def alive(self) -> bool:
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def mounts(self, source: str, point: str) -> list[int]:
        bound = self.moved
        self.scans += 1
        return (
            [self.pid]
            if self.alive and bound and (source, point) == (self.dirs.mount_source, "/dev/shm")
            else []
        )

    def argv(self) -> Iterator[tuple[int, list[str]]]:
        execd = self.moved
        self.scans += 1
        if not self.alive:
            return
        if execd:
            yield self.pid, [sys.executable, "-m", "fixtures", "serve"]
        else:
            yield self.pid, [sys.executable, "-m", SANDBOX_INIT_MODULE, str(self.dirs.sandbox_spec)]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    yield child
    child.kill()
    child.wait()


def scripted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pid: int, moves_at: int
) -> ActivationDirs:
    """An activation whose scans see ``pid`` as its init, moving before scan ``moves_at``."""
    dirs = ActivationDirs(root=tmp_path / "activations" / "donor-x", logs=tmp_path / "logs")
    init = Init(pid, dirs, moves_at)
    monkeypatch.setattr(layout.mounts, "processes_with_mount", init.mounts)
    monkeypatch.setattr(process_module, "each_argv", init.argv)  # launching() imports it late
    monkeypatch.setattr(session_module, "each_argv", lambda: iter(()))  # no CRIU processes
    return dirs


@pytest.mark.parametrize("moves_at", [0, 1, 2, 3])
def test_one_scan_never_misses_an_init_that_binds_and_execs_during_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen[bytes], moves_at: int
) -> None:
    dirs = scripted(tmp_path, monkeypatch, sleeper.pid, moves_at)
    assert dirs.processes() == [sleeper.pid]


@pytest.mark.parametrize("moves_at", range(6))
def test_end_stragglers_kills_an_init_that_moves_while_gc_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen[bytes], moves_at: int
) -> None:
    dirs = scripted(tmp_path, monkeypatch, sleeper.pid, moves_at)
    left = end_stragglers(dirs, timeout_s=5.0)
    # end_stragglers reaps what it killed (PinnedProcess.wait), so ask /proc, not Popen.
    assert not Path(f"/proc/{sleeper.pid}").exists(), "gc left the init running"
    assert left == []


def test_a_donors_dump_is_one_of_its_criu_processes(tmp_path: Path) -> None:
    """``criu dump`` runs in a session of its own (it outlives a SIGKILL of snapctl's group) and
    has no --work-dir under the activation: its action script names it."""
    from snapctl.activation.session import criu_processes

    work = tmp_path / "activations" / "donor-x" / "work"
    other = tmp_path / "activations" / "donor-y" / "work"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    images = str(tmp_path / ".img.staging-0" / "criu")
    dump = ["/opt/snapctl/criu/bin/criu", "dump", "--images-dir", images, "--tree", "1",
            "--action-script"]  # fmt: skip
    ours = subprocess.Popen([*sleeper, *dump, str(work / "action-script"), "--leave-running"])
    theirs = subprocess.Popen([*sleeper, *dump, str(other / "action-script")])
    try:
        deadline = time.monotonic() + 10
        while not criu_processes(work) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert criu_processes(work) == [ours.pid]
    finally:
        for child in (ours, theirs):
            child.kill()
            child.wait()
