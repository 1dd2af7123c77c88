"""WarmPool's bookkeeping with the spawner stood in for: fill, take, refill, targets, image
removed or replaced, the memory budget, failed restores, adoption and close. Each fake
parked copy's "supervisor" is a sleeping child of the test, so what is discarded is seen
ended."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.requests import CopyRequest
from snapctl.pool import WarmPool
from snapctl.pool.identity import published_identity
from snapctl.pool.memory import PSS_MAX_AGE_S, memory_moved
from snapctl.pool.models import ParkedRecord, PoolTarget
from snapctl.pool.records import RECORD_NAME, parked_home
from snapctl.pool.states import SlotState
from snapctl.pool.warm import REFILL_NICENESS, UNMEASURED_WAIT_S, TickReport, _Image, _Slot
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from snapctl.supervision.process import start_time
from tests.images.factories import publish_sample

pytestmark = pytest.mark.timeout(60)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def parked(self, image: str, seconds: float) -> None:
        self.seen.append(("parked", image))

    def taken(self, image: str) -> None:
        self.seen.append(("taken", image))

    def discarded(self, image: str, reason: str) -> None:
        self.seen.append(("discarded", reason))

    def failed(self, image: str, phase: str) -> None:
        self.seen.append(("failed", phase))


class FakeSpawner:
    """Parks at once: a ``sleep`` child stands for each parked copy's supervisor."""

    def __init__(self, state: StateDir, memory: int | None = None) -> None:
        self.state = state
        self.jobs: list[dict[str, Any]] = []
        self.children: list[subprocess.Popen[bytes]] = []
        self.fail_with: str | None = None
        self.gate: threading.Event | None = None  # when set: each restore waits for it
        self.with_root = False  # the sleep child stands for the tree's root too

    def spawn(self, job: dict[str, Any]) -> int:
        self.jobs.append(job)
        if self.gate is not None:
            assert self.gate.wait(30)
        read_fd, write_fd = os.pipe()
        with os.fdopen(write_fd, "w") as writer:
            if self.fail_with is not None:
                writer.write(json.dumps({"error": self.fail_with, "status": 3, "phase": "restore",
                                         "path": None, "log_tail": None}) + "\n")  # fmt: skip
                return read_fd
            child = subprocess.Popen(["sleep", "60"])
            self.children.append(child)
            identity = published_identity(Path(job["request"]["image"]))
            assert identity is not None
            root = dict(root_pid=child.pid, root_start_time=start_time(child.pid))
            record = make_record(job["id"], job["request"]["image"], identity, child.pid,
                                 job["owner_pid"], job["owner_start_time"],
                                 **(root if self.with_root else {}))  # fmt: skip
            parked_home(self.state, job["id"]).mkdir(parents=True)
            write_json_atomic(parked_home(self.state, job["id"]) / RECORD_NAME, record)
            writer.write(json.dumps({"parked": record.model_dump(mode="json")}) + "\n")
        return read_fd

    def alive(self) -> list[int]:
        return [child.pid for child in self.children if child.poll() is None]

    def end(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


def make_record(
    parked_id: str, image: str, identity: tuple[str, str], pid: int, owner_pid: int,
    owner_start_time: float, **changes: Any,
) -> ParkedRecord:  # fmt: skip
    fields: dict[str, Any] = dict(
        id=parked_id, state="parked", image=image, image_id=identity[0],
        manifest_digest=identity[1], lazy=False, activation_id=None, supervisor_pid=pid,
        supervisor_start_time=start_time(pid), root_pid=None,
        root_start_time=None, owner_pid=owner_pid, owner_start_time=owner_start_time,
        socket=f"/nonexistent/{parked_id}.sock",
        created=datetime.datetime.now(datetime.UTC).isoformat(),
    )  # fmt: skip
    fields.update(changes)
    return ParkedRecord(**fields)


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the pool"
        time.sleep(0.02)


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    return StateDir(tmp_path / "state")


@pytest.fixture
def image(tmp_path: Path) -> Path:
    publish_sample(tmp_path / "image")
    return tmp_path / "image"


@pytest.fixture
def spawner(state: StateDir) -> Iterator[FakeSpawner]:
    fake = FakeSpawner(state)
    yield fake
    fake.end()


@pytest.fixture
def pool(state: StateDir, spawner: FakeSpawner) -> Iterator[tuple[WarmPool, Events]]:
    events = Events()
    warm = WarmPool(state, spawner=spawner, events=events)  # type: ignore[arg-type]
    warm.adopt()
    yield warm, events
    warm.close(5.0)


@pytest.fixture
def manual(state: StateDir, spawner: FakeSpawner) -> Iterator[tuple[WarmPool, Events]]:
    """A pool with no refill thread: the test drives :meth:`WarmPool.tick` itself."""
    events = Events()
    warm = WarmPool(state, spawner=spawner, events=events, background=False)  # type: ignore[arg-type]
    warm.adopt()
    yield warm, events
    warm.close(5.0)


def tick(warm: WarmPool) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """One tick, then its parking and discarding threads waited for: what it did."""
    done = warm.tick()
    assert warm.drain(10.0)
    return done.started, [(i, str(why)) for i, why in done.discarding], done.dropped


def parked(warm: WarmPool) -> list[str]:
    return [row.id for e in warm.listing().entries for row in e.parked if row.state == "parked"]


def test_fill_take_refill(
    manual: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = manual
    assert warm.take(image) is None  # no target: never waits
    warm.set(image, 2)
    first = tick(warm)[0] + tick(warm)[0]  # one restore at a time per image
    assert len(first) == 2 and sorted(parked(warm)) == sorted(first)
    assert tick(warm) == ([], [], [])  # full: nothing to do
    handle = warm.take(image, CopyRequest(image=str(image)))
    assert handle is not None and handle.id in first
    for _ in range(3):  # while the taken copy activates, no restore competes with it
        assert tick(warm) == ([], [], [])
    assert len(spawner.jobs) == 2 and len(parked(warm)) == 1
    warm.settled(handle)
    (refill,) = tick(warm)[0]  # refilled
    assert parked(warm) == [i for i in first if i != handle.id] + [refill]
    assert len(spawner.jobs) == 3
    assert all(job["kind"] == "park" and job["owner_pid"] == os.getpid() for job in spawner.jobs)
    assert ("taken", str(image)) in events.seen


def test_a_taker_that_never_settles_holds_refills_back_only_so_long(
    pool: tuple[WarmPool, Events], image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("snapctl.pool.holds.REFILL_HOLD_S", 1.0)
    warm, _events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    taken_at = time.monotonic()
    assert warm.take(image) is not None
    until(lambda: len(parked(warm)) == 1)  # refilled once the hold expired
    assert time.monotonic() - taken_at >= 1.0


def test_a_settled_copy_holds_refills_back_while_its_tree_is_busy(
    state: StateDir, image: Path, spawner: FakeSpawner
) -> None:
    used = [0.0]  # the taken tree's CPU seconds so far
    warm = WarmPool(state, spawner=spawner, background=False,  # type: ignore[arg-type]
                    tree_cpu=lambda pid, start: used[0])  # fmt: skip
    try:
        spawner.with_root = True
        warm.set(image, 1)
        assert len(tick(warm)[0]) == 1
        handle = warm.take(image, CopyRequest(image=str(image)))
        assert handle is not None
        warm.settled(handle)
        now = time.monotonic()
        assert warm.tick(now).started == []  # the first sample
        used[0] += 0.8  # its first request: two cores for 0.4 s
        assert warm.tick(now + 0.4).started == []
        used[0] += 0.01  # served: quiet
        assert warm.tick(now + 0.6).started == []  # too short a window to tell
        assert len(warm.tick(now + 0.9).started) == 1
        assert warm.drain(10.0)
        assert len(spawner.jobs) == 2
    finally:
        warm.close(5.0)


def test_take_skips_copies_restored_for_other_options(
    pool: tuple[WarmPool, Events], image: Path
) -> None:
    warm, _ = pool
    warm.set(image, 1, lazy=False)
    until(lambda: len(parked(warm)) == 1)
    assert warm.take(image, CopyRequest(image=str(image), port=9000)) is None
    assert warm.take(image, CopyRequest(image=str(image), lazy=True)) is None
    assert warm.take(image, CopyRequest(image=str(image), count=2)) is None
    assert warm.take(image, CopyRequest(image=str(image), name="x", lazy=False)) is not None


def test_smaller_target_and_remove_discard(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 3)
    until(lambda: len(parked(warm)) == 3)
    warm.set(image, 1)
    until(lambda: events.seen.count(("discarded", "target")) == 2)
    assert len(parked(warm)) == 1 and len(spawner.alive()) == 1
    warm.remove(image)
    assert spawner.alive() == [] and warm.listing().entries == ()
    assert not any(parked_home(warm.state, job["id"]).exists() for job in spawner.jobs)


def test_targets_persist_for_the_next_agent(state: StateDir, image: Path) -> None:
    fake = FakeSpawner(state)
    warm = WarmPool(state, spawner=fake)  # type: ignore[arg-type]
    warm.set(image, 2, lazy=True, max_memory=1 << 30, memory_bytes=1 << 30, cpus=0.5)
    warm.close(5.0)
    fake.end()
    again = WarmPool(state, spawner=FakeSpawner(state))  # type: ignore[arg-type]
    assert [e.target.model_dump() for e in again.listing().entries] == [
        {"image": str(image), "size": 2, "lazy": True, "max_memory": 1 << 30,
         "memory_bytes": 1 << 30, "cpus": 0.5}
    ]  # fmt: skip


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'{"version": 2, "targets": []}',
        b'{"version": 1, "targets": [{"image": "relative", "size": 1}]}',
        b'{"version": 1, "targets": [], "extra": true}',
        b"",
    ],
)
def test_unreadable_targets_are_refused_naming_the_file_and_kept(
    state: StateDir, content: bytes
) -> None:
    """Not started with no targets: the next save would replace the file, targets lost."""
    from snapctl.pool.warm import PoolTargetsError

    path = state.root / "pool" / "targets.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(PoolTargetsError) as refused:
        WarmPool(state, spawner=FakeSpawner(state))  # type: ignore[arg-type]
    assert str(path) in refused.value.message and refused.value.path == path
    assert "repair the file, or move it aside" in refused.value.message
    assert path.read_bytes() == content


def test_a_targets_path_that_is_no_file_is_refused(state: StateDir) -> None:
    from snapctl.pool.warm import PoolTargetsError

    path = state.root / "pool" / "targets.json"
    path.mkdir(parents=True)
    with pytest.raises(PoolTargetsError, match="must be a regular file, found a directory"):
        WarmPool(state, spawner=FakeSpawner(state))  # type: ignore[arg-type]


def test_targets_are_written_in_their_model_s_format(state: StateDir, image: Path) -> None:
    from snapctl.pool.models import PoolTargets

    warm = WarmPool(state, spawner=FakeSpawner(state))  # type: ignore[arg-type]
    warm.set(image, 0, lazy=False)
    kept = PoolTargets.model_validate_json((state.root / "pool" / "targets.json").read_bytes())
    assert [target.model_dump() for target in kept.targets] == [
        {"image": str(image), "size": 0, "lazy": False, "max_memory": None,
         "memory_bytes": None, "cpus": None}
    ]  # fmt: skip
    warm.close(5.0)


def test_set_refuses_what_is_not_an_image(pool: tuple[WarmPool, Events], tmp_path: Path) -> None:
    warm, _ = pool
    from snapctl.pool.warm import PoolError

    with pytest.raises(PoolError, match="not a published image"):
        warm.set(tmp_path, 1)
    with pytest.raises(PoolError, match="no pool target"):
        warm.remove(tmp_path)


def test_replaced_image_discards_and_refills(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    old = parked(warm)
    publish_sample(image, force=True, image_id="9" * 32)
    until(lambda: ("discarded", "replaced") in events.seen)
    until(lambda: len(parked(warm)) == 1 and parked(warm) != old)
    assert warm.listing().entries[0].image_id == "9" * 32


def test_removed_image_discards(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    (image / "manifest.json").unlink()
    until(lambda: ("discarded", "removed") in events.seen)
    assert parked(warm) == [] and spawner.alive() == []
    assert warm.take(image) is None


def test_damaged_image_fails_verification(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    with (image / "criu" / "core-1.img").open("r+b") as damaged:
        damaged.write(b"X")
    until(lambda: ("discarded", "verification") in events.seen, timeout_s=15)
    assert "verification" in (warm.listing().entries[0].last_failure or "")


def test_memory_budget_bounds_parked_copies(
    manual: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    warm, events = manual
    monkeypatch.setattr("snapctl.pool.memory.members_memory", lambda members: 100)
    warm.set(image, 4, max_memory=250)
    assert len(tick(warm)[0]) == 1 and len(tick(warm)[0]) == 1
    for _ in range(3):  # a third would exceed the budget: never started
        assert tick(warm) == ([], [], [])
    assert len(spawner.jobs) == 2
    assert warm.listing().entries[0].memory_bytes == 200
    warm.set(image, 4, max_memory=150)
    newest = max(warm._images[str(image)].slots, key=lambda s: s.parked_at or 0.0)
    _started, discarding, _dropped = tick(warm)
    assert discarding == [(newest.id, "memory")] and newest.state is SlotState.GONE
    assert ("discarded", "memory") in events.seen and len(parked(warm)) == 1


def test_a_budget_below_one_copy_restores_once_and_says_so_instead_of_restoring_in_a_loop(
    manual: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    warm, events = manual
    monkeypatch.setattr("snapctl.pool.memory.members_memory", lambda members: 3 << 20)
    warm.set(image, 2, max_memory=1 << 20)
    (first,) = tick(warm)[0]
    assert tick(warm)[1] == [(first, "memory")]
    assert ("discarded", "memory") in events.seen and not warm._images[str(image)].slots
    for _ in range(5):  # the old pool restored again at each tick
        assert tick(warm) == ([], [], [])
    assert len(spawner.jobs) == 1
    failure = warm.listing().entries[0].last_failure or ""
    assert "one parked copy holds 3 MiB, more than --max-memory 1 MiB" in failure
    warm.set(image, 2, max_memory=8 << 20)  # a budget that fits two
    assert len(tick(warm)[0]) == 1 and len(tick(warm)[0]) == 1
    assert len(parked(warm)) == 2
    assert warm.listing().entries[0].last_failure is None


def test_a_copy_whose_memory_is_not_read_yet_holds_back_a_restore_over_the_budget(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    warm, _ = pool
    monkeypatch.setattr("snapctl.pool.memory.members_memory", lambda members: 100)
    warm.set(image, 4, max_memory=250)
    until(lambda: len(parked(warm)) == 2)
    entry = warm._images[str(image)]
    # As between a parking thread's record and its first memory read, when a tick refills;
    # unreadable from now on, so the pool's own ticks cannot read it meanwhile either.
    monkeypatch.setattr("snapctl.pool.memory.members_memory", lambda members: None)
    newest = max(entry.slots, key=lambda slot: slot.parked_at or 0.0)
    newest.memory.bytes = None
    now = time.monotonic()
    warm._refill(str(image), entry, now)
    assert len(entry.slots) == 2  # no third restore: 100 + (unread) + 100 more exceed 250
    # Unreadable for longer: it counts at the other's 100, which still leaves no room.
    warm._refill(str(image), entry, now + UNMEASURED_WAIT_S + 1)
    assert len(entry.slots) == 2


def test_parked_memory_is_read_again_only_when_its_resident_memory_moves_or_it_is_old(
    image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PSS walks every page table entry of a tree, in time with its memory; the resident
    counters it is gated on are read without such a walk."""
    reads: list[int] = []
    resident = [((7, 1000 << 20),)]
    monkeypatch.setattr("snapctl.pool.memory.record_members", lambda record: [])
    monkeypatch.setattr("snapctl.pool.memory.members_memory",
                        lambda members: reads.append(1) or 600)  # fmt: skip
    monkeypatch.setattr("snapctl.pool.memory.members_resident", lambda members: resident[0])
    entry = _Image(target=PoolTarget(image=str(image), size=1))
    slot = _Slot(id="pool-00000000000a", image=str(image))
    record = make_record(slot.id, str(image), ("0" * 64, "sha256:" + "0" * 64), os.getpid(),
                         os.getpid(), start_time(os.getpid()))  # fmt: skip
    now = 1000.0
    WarmPool._measure(entry, slot, record, now)  # parked: read at once
    assert reads == [1] and (slot.memory_bytes, entry.copy_bytes) == (600, 600)
    for step in (1.0, 2.0, 3.0):  # idle, and within RESIDENT_SLACK of it: no walk
        resident[0] = ((7, (1000 << 20) + int(step * (1 << 20))),)
        WarmPool._measure(entry, slot, record, now + step)
    assert reads == [1] and slot.memory.at == now
    resident[0] = ((7, 1100 << 20),)  # 10 % more: pages came in
    WarmPool._measure(entry, slot, record, now + 4.0)
    assert reads == [1, 1] and slot.memory.at == now + 4.0
    resident[0] = ((7, 1100 << 20), (8, 4096))  # another process in the tree
    WarmPool._measure(entry, slot, record, now + 5.0)
    assert len(reads) == 3
    WarmPool._measure(entry, slot, record, now + 5.0 + PSS_MAX_AGE_S)  # a taken copy stopped
    assert len(reads) == 4
    entry.copy_bytes = 0  # its manifest changed (_check_image): known again without a walk
    WarmPool._measure(entry, slot, record, now + 6.0 + PSS_MAX_AGE_S)
    assert len(reads) == 4 and entry.copy_bytes == 600


def test_a_discarded_copy_has_its_siblings_memory_read_again(
    manual: tuple[WarmPool, Events], image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages two parked copies shared count whole in the one left: its PSS grows while its
    resident counters do not move."""
    warm, events = manual
    pss = [100]
    reads: list[int] = []

    def members_memory(members: Any) -> int:
        reads.append(pss[0])
        return pss[0]

    monkeypatch.setattr("snapctl.pool.memory.members_memory", members_memory)
    monkeypatch.setattr("snapctl.pool.memory.members_resident", lambda members: ((7, 1 << 30),))
    warm.set(image, 2)
    tick(warm), tick(warm)
    entry = warm._images[str(image)]
    assert [slot.memory_bytes for slot in entry.slots] == [100, 100] and reads == [100, 100]
    pss[0] = 150
    now = time.monotonic()
    for step in (1, 2, 3):  # ticks that look at memory, none reads PSS again: nothing moved
        assert warm.tick(now + 5 * step) == TickReport()
    assert [slot.memory_bytes for slot in entry.slots] == [100, 100] and len(reads) == 2
    warm.set(image, 1)
    assert [why for _id, why in tick(warm)[1]] == ["target"]
    assert ("discarded", "target") in events.seen
    warm.tick(now + 20)  # not yet PSS_MAX_AGE_S old: read again for the sibling gone
    assert [slot.memory_bytes for slot in entry.slots] == [150] and reads[2:] == [150]


def test_memory_moved_follows_the_tree_and_the_slack() -> None:
    base = ((1, 100 << 20), (2, 900 << 20))
    assert not memory_moved(base, base)
    assert not memory_moved(base, ((1, 100 << 20), (2, (900 << 20) + (5 << 20))))
    assert memory_moved(base, ((1, 100 << 20), (2, (900 << 20) + (20 << 20))))
    assert memory_moved(base, ((1, 100 << 20), (2, (900 << 20) - (20 << 20))))
    assert memory_moved(base, ((1, 100 << 20), (3, 900 << 20)))  # the same total, another tree
    assert memory_moved((), base) and not memory_moved((), ())


def test_the_refill_thread_runs_nicer_than_the_copies_it_serves(
    pool: tuple[WarmPool, Events], image: Path
) -> None:
    warm, _ = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    assert warm._thread is not None and warm._thread.native_id is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, warm._thread.native_id) == max(mine, REFILL_NICENESS)


def test_an_agent_started_nicer_than_the_refill_thread_stays_so(
    state: StateDir, spawner: FakeSpawner, image: Path
) -> None:
    def start_niced() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), REFILL_NICENESS + 5)
        warm.set(image, 1)  # starts the refill thread, which inherits this thread's niceness

    warm = WarmPool(state, spawner=spawner)  # type: ignore[arg-type]
    try:
        starter = threading.Thread(target=start_niced)
        starter.start()
        starter.join()
        until(lambda: len(parked(warm)) == 1)
        assert warm._thread is not None and warm._thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, warm._thread.native_id) == REFILL_NICENESS + 5
    finally:
        warm.close(5.0)


def test_failed_restore_backs_off(
    manual: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = manual
    spawner.fail_with = "criu restore failed: boom"
    warm.set(image, 1)
    assert len(tick(warm)[0]) == 1
    assert ("failed", "restore") in events.seen
    for _ in range(3):  # backing off, not retrying on every tick
        assert tick(warm) == ([], [], [])
    assert len(spawner.jobs) == 1
    entry = warm._images[str(image)]
    assert len(warm.tick(entry.retry_at + 0.01).started) == 1  # once backed off, it retries
    assert warm.drain(10.0) and len(spawner.jobs) == 2
    assert "boom" in (warm.listing().entries[0].last_failure or "")


def test_dead_supervisor_is_dropped(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    spawner.children[0].kill()
    spawner.children[0].wait()
    assert warm.take(image) is None  # never hands out a copy whose supervisor is gone
    until(lambda: ("discarded", "died") in events.seen)
    until(lambda: len(parked(warm)) == 1)


def test_adopt_discards_what_another_agent_parked(
    state: StateDir, image: Path, spawner: FakeSpawner
) -> None:
    identity = published_identity(image)
    assert identity is not None
    other = subprocess.Popen(["sleep", "60"])
    spawner.children.append(other)
    old_agent = os.getppid()
    record = make_record("pool-0123456789ab", str(image), identity, other.pid, old_agent,
                         start_time(old_agent))  # fmt: skip
    parked_home(state, record.id).mkdir(parents=True)
    write_json_atomic(parked_home(state, record.id) / RECORD_NAME, record)
    torn = parked_home(state, "pool-ba9876543210")
    torn.mkdir()
    warm = WarmPool(state, spawner=spawner)  # type: ignore[arg-type]
    report = warm.adopt()
    warm.close(5.0)
    assert [(d.id, d.reason) for d in report.discarded] == [(record.id, "unvouched")]
    assert report.removed == (str(torn),)
    assert other.wait(5) is not None  # its supervisor was ended
    assert not parked_home(state, record.id).exists() and not torn.exists()


def test_close_discards_every_parked_copy(
    state: StateDir, image: Path, spawner: FakeSpawner
) -> None:
    warm = WarmPool(state, spawner=spawner)  # type: ignore[arg-type]
    warm.adopt()
    warm.set(image, 2)
    until(lambda: len(parked(warm)) == 2)
    warm.close(5.0)
    assert spawner.alive() == []
    assert [p.name for p in (state.root / "pool").iterdir()] == ["targets.json"]


def test_a_taken_copy_is_the_takers_even_if_a_tick_saw_it_before(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    """A tick that listed the copy just before the take must not discard it under the taker
    (the parked copy checks its image itself when the taker's order comes)."""
    warm, events = pool
    warm.set(image, 1)
    until(lambda: len(parked(warm)) == 1)
    (seen,) = warm._images[str(image)].slots
    handle = warm.take(image)
    assert handle is not None and handle.id == seen.id
    assert seen.state is SlotState.TAKEN
    warm._discard_now(seen, "replaced")  # what that tick does next
    assert warm._discard_later(seen, "replaced") is False
    assert warm._drop(warm._images[str(image)], seen, "died") is False
    assert warm.drain(10.0) and seen.state is SlotState.TAKEN
    taken = [c for c in spawner.children if c.pid == handle.supervisor_pid]
    assert taken and taken[0].poll() is None
    assert parked_home(warm.state, handle.id).exists()
    assert not any(event[0] == "discarded" for event in events.seen)


def test_changing_lazy_discards_what_was_parked_the_other_way(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1, lazy=False)
    until(lambda: len(parked(warm)) == 1)
    (old,) = parked(warm)
    warm.set(image, 1, lazy=True)
    until(lambda: ("discarded", "target") in events.seen)
    until(lambda: len(parked(warm)) == 1 and parked(warm) != [old])
    assert [job["request"]["lazy"] for job in spawner.jobs] == [False, True]


def test_changing_a_copy_s_limits_parks_copies_with_the_new_ones(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, events = pool
    warm.set(image, 1, lazy=False)
    until(lambda: len(parked(warm)) == 1)
    (old,) = parked(warm)
    target = warm.set(image, 1, lazy=False, memory_bytes=1 << 30, cpus=1.5)
    assert (target.memory_bytes, target.cpus) == (1 << 30, 1.5)
    until(lambda: ("discarded", "target") in events.seen)
    until(lambda: len(parked(warm)) == 1 and parked(warm) != [old])
    limits = [(job["request"]["memory_bytes"], job["request"]["cpus"]) for job in spawner.jobs]
    assert limits == [(None, None), (1 << 30, 1.5)]


def test_a_target_removed_while_its_copy_restores_leaves_nothing(
    pool: tuple[WarmPool, Events], image: Path, spawner: FakeSpawner
) -> None:
    warm, _events = pool
    spawner.gate = threading.Event()
    warm.set(image, 1)
    until(lambda: len(spawner.jobs) == 1)
    warm.remove(image)
    spawner.gate.set()  # the restore ends after its target went
    until(lambda: len(spawner.children) == 1)
    home = parked_home(warm.state, spawner.jobs[0]["id"])
    until(lambda: spawner.alive() == [] and not home.exists())
    assert warm.listing().entries == ()


def _gone_meanwhile(pid: int) -> float:
    """``start_time`` of a process that exited and was reaped after psutil found it."""
    from snapctl.supervision.process import ProcessGoneError

    raise ProcessGoneError(f"process {pid} does not exist", pid=pid)


def test_a_process_gone_between_two_reads_counts_no_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from snapctl.supervision import memory

    monkeypatch.setattr(memory, "start_time", _gone_meanwhile)
    assert memory.tree_members([(os.getpid(), 1.0)]) == []
    assert memory.members_memory([]) is None


def test_a_discarded_copy_that_exits_at_once_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor answers the discard, then exits: maybe before its start time is read
    (the agent's close failed on it, as ProcessGoneError)."""
    import socket

    from snapctl.pool import warm

    path = str(tmp_path / "order.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)

    thread = threading.Thread(target=answer)
    thread.start()
    monkeypatch.setattr(warm, "start_time", _gone_meanwhile)
    record = ParkedRecord.model_construct(
        socket=path, supervisor_pid=os.getpid(), supervisor_start_time=1.0
    )
    try:
        warm._order_discard(record, timeout_s=5)
    finally:
        thread.join(5)
        listener.close()
