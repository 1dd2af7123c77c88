"""``snapctl gc``: what it collects on its first run, and what it must leave alone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from snapctl.activation.core import new_session
from snapctl.activation.launch import LaunchOptions, launch_in_sandbox
from snapctl.activation.supervise import collect_orphans
from snapctl.gc import collect_garbage
from snapctl.namespaces import mounts
from snapctl.namespaces.layout import ActivationDirs, ActivationOwner
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess, start_time
from tests.supervision.test_process import zombie

pytestmark = pytest.mark.criu  # root: an activation's directories are tmpfs mounts


def test_an_activation_whose_supervisor_is_a_zombie_is_collected_the_first_time(
    tmp_path: Path,
) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    session = new_session(state, "copy", "orphan")
    server = subprocess.Popen(["sleep", "60"])
    try:
        session.root = PinnedProcess(server.pid)
        session.save_record()
        with zombie() as supervisor:
            # The owner and the record's supervisor: killed, never reaped.
            owner = ActivationOwner(pid=supervisor, start_time=start_time(supervisor))
            write_json_atomic(session.dirs.owner_file, owner.model_dump(), overwrite=True)
            record = state.load_records()[0]
            state.save_record(
                record.model_copy(
                    update={"supervisor_pid": owner.pid, "supervisor_start_time": owner.start_time}
                )
            )
            collected = collect_orphans(state, stop_timeout_s=2.0)
        assert [entry.names for entry in collected] == [["orphan"]]
        assert collected[0].audit.clean and server.pid in collected[0].processes_ended
        assert server.wait(timeout=5) is not None
        assert state.load_records() == [] and not session.dirs.root.exists()
    finally:
        server.kill()
        server.wait()
        if session.root is not None:
            session.root.close()
        if session.dirs.root.exists():  # not collected: unmount its tmpfs all the same
            session.dirs.remove()


# A sitecustomize that holds the sandbox's init (only it) at its first bind, after it cloned
# the activation's directories and before any of them is at its place inside: the instant a
# kill of snapctl can leave it at. Until then the init's mounts show the activation's tmpfs at
# their host paths only (as every namespace being set up does), never at /dev/shm.
HOLD_AT_FIRST_BIND = """
import signal, sys

def _hold():
    with open("/proc/self/cmdline", "rb") as f:
        if b"snapctl.namespaces.init" not in f.read().split(b"\\0"):
            return
    sys.path.insert(0, {repo!r})
    from snapctl.namespaces import mounts
    attach = mounts.attach_tree

    def held(*args, **kwargs):
        mounts.attach_tree = attach
        signal.signal(signal.SIGUSR1, lambda *_: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
        print("held at the first bind", file=sys.stderr, flush=True)
        signal.sigwait({{signal.SIGUSR1}})
        return attach(*args, **kwargs)

    mounts.attach_tree = held

_hold()
"""


def test_gc_ends_a_sandbox_whose_init_has_not_bound_the_activation_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """snapctl killed while its sandbox's init sets up (a donor's launch): gc must end the
    init and its launcher, or the init, holding clones of the activation's directories, goes
    on to serve in a sandbox no later gc can find (the activation directory is gone)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    repo = str(Path(__file__).resolve().parents[2])
    (hook / "sitecustomize.py").write_text(HOLD_AT_FIRST_BIND.format(repo=repo))
    monkeypatch.setenv("PYTHONPATH", str(hook))  # unshare, and so the init, inherit it
    state = StateDir(tmp_path / "state")
    state.ensure()
    dirs = ActivationDirs(root=state.activations / "donor-held", logs=state.logs / "donor-held")
    dirs.create()
    launcher: subprocess.Popen[bytes] | None = None
    init: PinnedProcess | None = None
    try:
        with zombie() as killed:  # the donor's snapctl, SIGKILLed
            owner = ActivationOwner(pid=killed, start_time=start_time(killed))
            write_json_atomic(dirs.owner_file, owner.model_dump(), overwrite=True)
            env = {"PATH": os.environ["PATH"]}
            launcher, init = launch_in_sandbox(
                ["sleep", "120"], tmp_path, dirs, LaunchOptions(), env
            )
            deadline = time.monotonic() + 60
            while b"held at the first bind" not in dirs.launcher_log.read_bytes():
                assert init.alive() and time.monotonic() < deadline, "the init never got held"
                time.sleep(0.05)
            # The window: only its argv tells the init apart (its mounts do not yet).
            assert init.pid not in mounts.processes_with_mount(dirs.mount_source, "/dev/shm")
            collected = collect_garbage(state, stop_timeout_s=5.0)
        # Were the init still there, it would bind the clones and exec the server now.
        init.signal(signal.SIGUSR1)
        assert init.wait(5.0), "gc left the sandbox's init running"
        assert launcher.wait(timeout=5) is not None
        assert init.pid in collected.activations[0].processes_ended
        assert collected.clean and not dirs.root.exists()
        assert mounts.processes_with_mount(dirs.mount_source, "/dev/shm") == []
    finally:
        if init is not None:
            init.signal(signal.SIGKILL)
            init.wait(5.0)
            init.close()
        if launcher is not None:
            launcher.kill()
            launcher.wait()
        if dirs.root.exists():
            dirs.remove()
