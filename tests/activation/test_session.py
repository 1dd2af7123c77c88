"""Session.stop's teardown, with stand-ins for the parts a real tree would need CRIU for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapctl.activation.core import new_session
from snapctl.activation.session import criu_processes
from snapctl.errors import SnapctlError
from snapctl.namespaces import init
from snapctl.namespaces.layout import SANDBOX_INIT_MODULE, ActivationDirs
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess


@pytest.mark.criu  # root: the activation's directories are tmpfs mounts
def test_a_root_that_survives_sigkill_does_not_stop_the_teardown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    session = new_session(state, "copy", "stuck")
    server = subprocess.Popen(["sleep", "60"])
    session.root = PinnedProcess(server.pid)
    session.tree_pids = [server.pid]

    def unkillable(stop_timeout_s: float = 10.0, kill_timeout_s: float = 10.0) -> str:
        server.kill()  # gone after all, but stop() reports it stuck, as for a D-state process
        server.wait()
        raise SnapctlError(f"process {server.pid} survived SIGKILL for 10 s", pid=server.pid)

    monkeypatch.setattr(session.root, "stop", unkillable)
    how, audit = session.stop(stop_timeout_s=1.0)
    assert "survived SIGKILL" in how
    assert session.stopped and audit.clean and not session.dirs.root.exists()


def test_criu_processes_of_an_activation_include_a_held_lazy_pages_daemon(tmp_path: Path) -> None:
    work = tmp_path / "work"
    fake_criu = tmp_path / "criu"
    fake_criu.symlink_to(sys.executable)
    sleeper = [str(fake_criu), "-c", "import time; time.sleep(60)"]
    ours = [
        subprocess.Popen([*sleeper, "restore", "--work-dir", str(work)]),
        subprocess.Popen([*sleeper, "lazy-pages", "--work-dir", str(work / "lazy-pages")]),
    ]
    # Another activation's CRIU, and a program that is not CRIU at all, are not ours.
    not_criu = [sys.executable, "-c", "import time; time.sleep(60)"]
    others = [
        subprocess.Popen([*sleeper, "lazy-pages", "--work-dir", str(tmp_path / "work2")]),
        subprocess.Popen([*not_criu, "--work-dir", str(work)]),
    ]
    try:
        deadline = time.monotonic() + 10
        while len(criu_processes(work)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # until both have exec'd
        assert criu_processes(work) == sorted(p.pid for p in ours)
    finally:
        for process in [*ours, *others]:
            process.kill()
            process.wait()


def test_the_launcher_and_init_of_a_sandbox_being_set_up_are_found_by_their_argv(
    tmp_path: Path,
) -> None:
    """Before the init binds the activation's tmpfs at /dev/shm, its argv alone says whose it is
    (see ActivationDirs.launching); the launcher runs it by this module name."""
    spec = importlib.util.find_spec(SANDBOX_INIT_MODULE)
    assert spec is not None and spec.origin == init.__file__
    dirs, other = (
        ActivationDirs(root=tmp_path / "activations" / name, logs=tmp_path / "logs" / name)
        for name in ("ours", "other")
    )
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    as_init = ["-m", SANDBOX_INIT_MODULE]
    ours = [
        subprocess.Popen(
            [*sleeper, "--pid", "--", sys.executable, *as_init, str(dirs.sandbox_spec)]
        ),
        subprocess.Popen([*sleeper, *as_init, str(dirs.sandbox_spec)]),
    ]
    # Another activation's init, and a program that merely names the spec, are not ours.
    others = [
        subprocess.Popen([*sleeper, *as_init, str(other.sandbox_spec)]),
        subprocess.Popen([*sleeper, "cat", str(dirs.sandbox_spec)]),
    ]
    try:
        deadline = time.monotonic() + 10
        while len(dirs.launching()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # until both have exec'd
        assert dirs.launching() == sorted(p.pid for p in ours)
    finally:
        for process in [*ours, *others]:
            process.kill()
            process.wait()
