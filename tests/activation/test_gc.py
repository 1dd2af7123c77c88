"""``snapctl gc``: what it collects on its first run, and what it must leave alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from snapctl.activation.core import new_session
from snapctl.activation.supervise import collect_orphans
from snapctl.namespaces.layout import ActivationOwner
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
