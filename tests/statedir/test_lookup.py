"""Finding an activation by what ``stop``/``logs`` are given: its name, else its activation id
(a name that is another activation's id names the activation of that name, whichever record
sorts first), and its server log, in-process and through the agent alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.statedir import ActivationRecord, StateDir, UnknownActivationError

pytestmark = pytest.mark.timeout(30)


def save(state: StateDir, name: str, activation_id: str, **changes: Any) -> ActivationRecord:
    state.ensure()
    fields: dict[str, Any] = {
        "name": name, "activation_id": activation_id, "kind": "copy", "image": "/images/one",
        "root_pid": 999999, "root_start_time": 1.0, "supervisor_pid": 999998,
        "supervisor_start_time": 1.0, "activation_dir": "/nowhere",
        "logs_dir": str(state.logs / activation_id), "host": "127.0.0.1", "port": 8000,
        "published": None, "created": "2026-01-01T00:00:00+00:00",
    }  # fmt: skip
    fields.update(changes)
    record = ActivationRecord(**fields)
    state.save_record(record)
    return record


# (the records as (name, activation id), asked, the name of the record found): the name is
# asked for both as one record's name and as another's id, the name's record sorting first
# in one case and last in the other (a first match and a last match each fail one).
AMBIGUOUS = [
    ([("alpha", "copy-1"), ("copy-1", "copy-2")], "copy-1", "copy-1"),
    ([("copy-1", "copy-2"), ("omega", "copy-1")], "copy-1", "copy-1"),
    ([("alpha", "copy-1"), ("omega", "copy-2")], "copy-2", "omega"),
]


@pytest.mark.parametrize(("records", "asked", "found"), AMBIGUOUS)
def test_the_name_wins_over_another_activation_s_id(
    tmp_path: Path, records: list[tuple[str, str]], asked: str, found: str
) -> None:
    state = StateDir(tmp_path)
    for name, activation_id in records:
        save(state, name, activation_id)
    assert state.find_record(asked).name == found


def test_an_unknown_name_says_so_and_where_to_look(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    save(state, "alpha", "copy-1")
    with pytest.raises(UnknownActivationError) as unknown:
        state.find_record("nobody")
    assert unknown.value.message == "no activation named 'nobody' (see snapctl ps)"
    assert unknown.value.exit_status == ExitStatus.ERROR
    with pytest.raises(UnknownActivationError):
        StateDir(tmp_path / "empty").find_record("alpha")  # no records directory yet


def test_the_server_log_of_a_running_and_of_a_stopped_activation(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    running = save(state, "copy-1", "copy-2")
    save(state, "alpha", "copy-1")
    log = Path(running.logs_dir) / "server.log"
    with pytest.raises(SnapctlError, match="copy-1 has no server log yet"):
        state.server_log("copy-1")
    log.parent.mkdir(parents=True)
    log.write_text("running\n")
    assert state.server_log("copy-1") == (log, state.record_path("copy-1"))
    kept = state.logs / "copy-9" / "server.log"  # stopped: its record is gone, its log kept
    kept.parent.mkdir(parents=True)
    kept.write_text("stopped\n")
    assert state.server_log("copy-9") == (kept, None)
    for outside in ("..", ".", "copy-9/../copy-9", "nobody"):
        with pytest.raises(UnknownActivationError, match="no activation named"):
            state.server_log(outside)
