"""The warm pool with real CRIU, the agent played by ``tests/pool/pool_host.py``: fill,
take, refill; a pool copy's and a fresh supervisor's outputs equal the donor's; the agent
killed with copies serving and parked: the serving one keeps serving, the parked ones are
discarded, a new agent adopts what is left, and nothing remains at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.criu import CriuBinary
from snapctl.pool.records import load_parked_records, pool_dir
from snapctl.pool.supervisor.parked import PARK_NICENESS
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV, complete, leftovers
from tests.agent.helpers import Started, gone, stop_all_clean, until

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


class Host:
    """One pool_host process: the agent of these tests."""

    def __init__(self, state: StateDir) -> None:
        env = {**os.environ, "SNAPCTL_STATE_DIR": str(state.root)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.pool.pool_host"], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def __call__(self, **command: Any) -> Any:
        answer = self.ask(**command)
        assert "ok" in answer, answer
        return answer["ok"]

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        return answer

    def parked(self) -> list[dict[str, Any]]:
        entries = self(op="ls")["entries"]
        return [row for entry in entries for row in entry["parked"] if row["state"] == "parked"]

    def wait_parked(self, count: int, timeout_s: float = 60.0) -> None:
        until(lambda: len(self.parked()) == count, timeout_s, shown=lambda: self(op="ls"))

    def fill(self, image: Path, size: int, *, lazy: bool, timeout_s: float = 60.0) -> Any:
        """Adopt (the answer is returned), keep ``size`` copies of ``image`` parked, and wait
        until they are."""
        adopted = self(op="adopt")
        self(op="set", image=str(image), size=size, lazy=lazy)
        self.wait_parked(size, timeout_s)
        return adopted

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def state(agent_state: StateDir) -> StateDir:
    return agent_state


@pytest.fixture
def hosts(state: StateDir) -> Iterator[Started[Host]]:
    """Hosts on ``state``; each is killed at the end (then ``agent_state`` ends whatever ran)."""
    hosts = Started(lambda: Host(state))
    yield hosts
    for host in hosts.started:
        host.kill()


def request(image: Path, **changes: Any) -> dict[str, Any]:
    return {"image": str(image), "publish": {"port": 0}, "api_key_env": API_KEY_ENV,
            "api_key": API_KEY, "timeout_s": 60.0, **changes}  # fmt: skip


def test_fill_take_refill_outputs_equal_the_donors(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    image, expected = donor_image
    host = hosts.start()
    assert host.fill(image, 2, lazy=False) == {"version": 1, "discarded": [], "removed": []}
    first = {row["id"] for row in host.parked()}
    # Read at parking and again on each tick (a read that met a process between states is
    # retried): known soon, and what the parked tree holds.
    until(lambda: all(row["memory_bytes"] for row in host.parked()), timeout_s=10,
          shown=host.parked)  # fmt: skip
    assert all(row["memory_bytes"] > 1 << 20 for row in host.parked())
    # Each in its own cgroup (no limit asked), charged every page of its tree.
    for row in host.parked():
        assert row["cgroup"].rsplit("/", 1)[-1].startswith(state.cgroup_prefix), row
        assert row["cgroup_memory_bytes"] > 1 << 20 and row["memory_limit_bytes"] is None
    assert len({row["cgroup"] for row in host.parked()}) == 2
    # Parking is background work: its supervisor runs nicer; CRIU gives the tree its own.
    for row in host.parked():
        assert os.getpriority(os.PRIO_PROCESS, row["supervisor_pid"]) == PARK_NICENESS
        assert os.getpriority(os.PRIO_PROCESS, row["root_pid"]) == 0

    taken = host(op="copy", request=request(image, name="from-pool"))
    report = taken["report"]
    assert report["from_pool"] is True and report["name"] == "from-pool"
    (serving,) = state.load_records()
    assert os.getpriority(os.PRIO_PROCESS, serving.supervisor_pid) == 0  # ordered: not nicer
    assert complete(report["published"]) == expected
    host.wait_parked(2)  # refilled
    assert len(first & {row["id"] for row in host.parked()}) == 1
    assert [r.name for r in state.load_records()] == ["from-pool"]  # ps: serving ones only

    fresh = host(op="fresh", request=request(image, name="fresh"))["report"]
    assert fresh["from_pool"] is False
    assert complete(fresh["published"]) == expected

    host(op="close")
    assert host.process.wait(30) == 0
    assert load_parked_records(state) == []
    assert sorted(r.name for r in state.load_records()) == ["fresh", "from-pool"]
    stop_all_clean(state)
    assert leftovers(state) == []


def test_agent_killed_serving_copies_live_parked_ones_are_discarded(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    image, expected = donor_image
    host = hosts.start()
    host.fill(image, 2, lazy=False)
    report = host(op="copy", request=request(image, name="serving"))["report"]
    host.wait_parked(2)
    parked = [record for _home, record in load_parked_records(state) if record is not None]
    assert len(parked) == 2 and all(r.root_pid for r in parked)

    host.process.send_signal(signal.SIGKILL)
    host.kill()
    # The parked copies see their agent gone and discard themselves.
    until(lambda: load_parked_records(state) == [], timeout_s=30)
    for record in parked:
        assert record.root_pid is not None
        # Its files go first; the supervisor exits a moment later (seen under load).
        for pid, start_time in ((record.supervisor_pid, record.supervisor_start_time),
                                (record.root_pid, record.root_start_time)):  # fmt: skip
            until(lambda pid=pid, start_time=start_time: gone(pid, start_time), timeout_s=10)
    assert complete(report["published"]) == expected  # still serving

    again = hosts.start()
    adopted = again(op="adopt")
    assert adopted["discarded"] == [] and adopted["removed"] == []
    again.wait_parked(2)  # its targets persisted: refilled
    assert [r.name for r in state.load_records()] == ["serving"]
    again(op="close")
    assert again.process.wait(30) == 0
    assert len(state.load_records()) == 1
    stop_all_clean(state)
    assert leftovers(state) == []
    assert [p.name for p in pool_dir(state).iterdir()] == ["targets.json"]


def test_a_new_agent_discards_parked_copies_it_cannot_vouch_for(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    """A parked copy still there when the next agent starts (its supervisor stopped for a
    moment, say) is discarded by adoption, which ends its tree and removes its files."""
    image, _expected = donor_image
    host = hosts.start()
    host.fill(image, 1, lazy=False)
    ((home, record),) = load_parked_records(state)
    assert record is not None and record.root_pid is not None
    os.kill(record.supervisor_pid, signal.SIGSTOP)  # it cannot notice its agent die
    try:
        host.kill()
        again = hosts.start()
        adopted = again(op="adopt")
    finally:
        os.kill(record.supervisor_pid, signal.SIGCONT)
    assert [(d["id"], d["reason"]) for d in adopted["discarded"]] == [(record.id, "unvouched")]
    assert gone(record.root_pid, record.root_start_time)
    assert gone(record.supervisor_pid, record.supervisor_start_time)
    assert not home.exists()
    again(op="rm", image=str(image))
    again(op="close")
    assert leftovers(state) == []


def test_lazy_parked_copy_serves_the_donors_output(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    image, expected = donor_image
    host = hosts.start()
    host.fill(image, 1, lazy=True)
    assert host(op="take", request=request(image, lazy=False)) is None  # restored lazily
    report = host(op="copy", request=request(image, name="lazy"))["report"]
    assert report["from_pool"] is True and report["lazy"] is True
    assert complete(report["published"]) == expected
    host(op="rm", image=str(image))
    host(op="close")
    assert len(state.load_records()) == 1
    stop_all_clean(state)
    assert leftovers(state) == []


def test_a_lazy_parked_copy_whose_image_changed_in_place_is_refused(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    """A lazy copy still reads pages from its image after it activates: a page file changed
    in place (same manifest, so not a replacement) since the parking must refuse it."""
    image, _expected = donor_image
    host = hosts.start()
    host.fill(image, 1, lazy=True)
    ((home, record),) = load_parked_records(state)
    assert record is not None
    parked_id = host(op="take", request=request(image, lazy=True))
    assert parked_id == record.id
    pages = max((image / "criu").glob("pages-*.img"), key=lambda path: path.stat().st_size)
    try:
        os.utime(pages, ns=(pages.stat().st_atime_ns, pages.stat().st_mtime_ns + 1))
        answer = host.ask(op="activate", id=parked_id, request=request(image, name="changed"))
        assert "ParkedCopyUnusableError" in answer["error"], answer
        assert "changed since this copy was parked" in answer["error"]
        until(lambda: gone(record.supervisor_pid, record.supervisor_start_time), timeout_s=10)
        assert record.root_pid is not None and gone(record.root_pid, record.root_start_time)
        assert not home.exists() and state.load_records() == []
    finally:
        host(op="rm", image=str(image))
        host(op="close")
    assert leftovers(state) == []


def test_image_replaced_after_the_take_is_refused_before_activation(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host], criu_binary: CriuBinary
) -> None:
    from snapctl.activation.bake import bake_image
    from snapctl.activation.native import NoNativeStep
    from tests.activation.criu_helpers import options

    image, expected = donor_image
    host = hosts.start()
    host.fill(image, 1, lazy=False)
    ((home, record),) = load_parked_records(state)
    assert record is not None
    parked_id = host(op="take", request=request(image))
    assert parked_id == record.id
    bake_image(options(), image=image, force=True, criu=criu_binary, native=NoNativeStep(),
               state=state, progress=lambda step: None)  # fmt: skip

    answer = host.ask(op="activate", id=parked_id, request=request(image, name="late"))
    assert "ParkedCopyUnusableError" in answer["error"] and "replaced" in answer["error"]
    until(lambda: gone(record.supervisor_pid, record.supervisor_start_time), timeout_s=10)
    assert record.root_pid is not None and gone(record.root_pid, record.root_start_time)
    assert not home.exists() and state.load_records() == []
    # The pool refills from the image published now.
    host.wait_parked(1)
    report = host(op="copy", request=request(image, name="new"))["report"]
    assert report["from_pool"] is True and report["image_id"] != record.image_id
    assert complete(report["published"]) == expected
    host(op="close")


def test_gc_without_an_agent_ends_what_a_killed_parked_supervisor_left(
    state: StateDir, donor_image: tuple[Path, Any], hosts: Started[Host]
) -> None:
    from snapctl.gc import collect_garbage

    image, _expected = donor_image
    host = hosts.start()
    host.fill(image, 1, lazy=False)
    ((home, record),) = load_parked_records(state)
    assert record is not None and record.root_pid is not None
    os.kill(record.supervisor_pid, signal.SIGSTOP)  # it cannot discard itself
    host.kill()  # first: no agent to notice the supervisor die
    os.kill(record.supervisor_pid, signal.SIGKILL)  # its tree is left without a supervisor
    until(lambda: gone(record.supervisor_pid, record.supervisor_start_time), timeout_s=10)
    assert not gone(record.root_pid, record.root_start_time)

    report = collect_garbage(state)

    assert str(home) in report.removed and report.clean
    assert gone(record.root_pid, record.root_start_time)
    assert not home.exists() and leftovers(state) == []
