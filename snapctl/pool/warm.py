"""The warm pool: per image, keep ``size`` copies restored and parked, refill in the
background, bound their memory, and discard the ones that can no longer be vouched for.
Runs in the agent.

Each slot has one explicit state (:mod:`snapctl.pool.states`), changed only by
:meth:`WarmPool._set_state`. One pass of the bookkeeping is :meth:`WarmPool.tick`: it drops
copies whose supervisor is gone, discards those whose image was removed, replaced or fails
verification (:mod:`snapctl.pool.verify`), and those over the target or the memory budget
(:mod:`snapctl.pool.memory`), then starts restores for what is missing, each in a parking
thread (a supervisor forked by the spawner, which reports once parked). A restore that fails
backs its image off. The refill thread runs the tick every :data:`TICK_S` (and when woken by
``set``, ``take`` or a copy that parked); tests call it themselves.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from snapctl.activation.precheck import decide_lazy
from snapctl.activation.requests import CopyRequest
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase
from snapctl.plain import mib
from snapctl.pool.events import NoEvents, PoolEvents
from snapctl.pool.holds import RefillHold, TreeCpu, tree_cpu_seconds
from snapctl.pool.identity import published_identity, restore_fits
from snapctl.pool.memory import MEMORY_EVERY_S, CopyMemory, cgroup_columns
from snapctl.pool.models import (
    AdoptionReport,
    DiscardedCopy,
    DiscardReason,
    ParkedCopyRow,
    ParkedRecord,
    PoolEntry,
    PoolListing,
    PoolTarget,
)
from snapctl.pool.records import SOCKET_NAME, discard_recorded, load_parked_records, parked_home
from snapctl.pool.spawner import Spawner, SpawnerGoneError
from snapctl.pool.states import SlotState, check_slot_transition
from snapctl.pool.targets import PoolTargetsError, load_targets, save_targets
from snapctl.pool.verify import VERIFY_EVERY_S, ImageWatch
from snapctl.pool.wire import ParkedHandle, order_line, wait_parked
from snapctl.statedir import StateDir
from snapctl.supervision.memory import read_ksm
from snapctl.supervision.process import ProcessGoneError, is_same_process, same_start, start_time

__all__ = ["PoolError", "PoolTargetsError", "TickReport", "WarmPool", "image_key"]

TICK_S = 0.5
# At most this many restores for the pool at once, over all images: parking is background
# work and must leave the host's CPUs to the copies being served.
MAX_PARKING = 2
BACKOFF_MAX_S = 30.0
# The refill thread's niceness, and so that of the parking and discarding threads it starts:
# its reads of /proc and images are background work, never to take the CPU from a copy
# being activated. At least this: an agent started nicer stays so.
REFILL_NICENESS = 10
# With a budget, a copy parked this recently whose memory could not be read yet holds back
# the refill; one unreadable longer counts at the size the others measure.
UNMEASURED_WAIT_S = 2 * MEMORY_EVERY_S
# sun_path holds 108 bytes, the last one a NUL.
MAX_SOCKET_PATH = 107


class PoolError(SnapctlError):
    """A pool request that cannot be done (an image not published, no such target)."""

    exit_status = ExitStatus.USAGE


@dataclass
class _Slot:
    """One parked copy, from its restore on."""

    id: str
    image: str
    started: float = field(default_factory=time.monotonic)
    state: SlotState = SlotState.RESTORING
    record: ParkedRecord | None = None  # once parked
    parked_at: float | None = None
    memory: CopyMemory = field(default_factory=CopyMemory)

    @property
    def memory_bytes(self) -> int | None:
        return self.memory.bytes


@dataclass
class _Image:
    target: PoolTarget
    slots: list[_Slot] = field(default_factory=list)
    watch: ImageWatch = field(default_factory=ImageWatch)
    last_failure: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    # The most a parked copy of this image was measured to hold: what the next one is
    # expected to hold, even once none is left (each discarded for the budget, say).
    copy_bytes: int = 0

    def live(self) -> list[_Slot]:
        """Its slots restoring or parked (not being discarded)."""
        return [s for s in self.slots if s.state in (SlotState.RESTORING, SlotState.PARKED)]

    def parked(self) -> list[_Slot]:
        return [slot for slot in self.slots if slot.state is SlotState.PARKED]


@dataclass
class TickReport:
    """What one :meth:`WarmPool.tick` did: the restores it started (slot ids), the parked
    copies it sent to be discarded and why, and those it found gone by themselves."""

    started: list[str] = field(default_factory=list)
    discarding: list[tuple[str, DiscardReason]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def image_key(image: Path) -> str:
    """One key whatever the spelling (``..``, a symbolic link): a copy request for the image
    must find the pool that ``pool set`` made for it under another path."""
    return os.path.realpath(image)


class WarmPool:
    """The agent's pool: targets by image, their parked copies, and the refill thread.

    Thread-safe. ``adopt`` first (it discards what an earlier agent parked and starts the
    refill thread), then ``set``, ``remove``, ``take`` and ``listing`` from any thread;
    ``close`` stops refilling and discards every parked copy. Targets persist in
    ``STATE/pool/targets.json``: a new agent refills them. ``background=False``: no refill
    thread, the caller drives :meth:`tick` (and :meth:`drain` the threads it started);
    ``tree_cpu`` reads a taken copy's CPU use for its hold on refills (:mod:`.holds`).
    """

    def __init__(
        self, state: StateDir, *, spawner: Spawner, events: PoolEvents | None = None,
        background: bool = True, tree_cpu: TreeCpu = tree_cpu_seconds,
    ) -> None:  # fmt: skip
        self.state = state
        self.spawner = spawner
        self.events: PoolEvents = events or NoEvents()
        self._background = background
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._images: dict[str, _Image] = {}
        self._parking = 0
        # Taken copies holding refills back (pool.holds), by id.
        self._holds: dict[str, RefillHold] = {}
        self._tree_cpu = tree_cpu
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._owner = (os.getpid(), start_time(os.getpid()))
        self._memory_at = 0.0
        for target in load_targets(state):
            self._images[target.image] = _Image(target)

    # -- slot states -----------------------------------------------------------------------

    def _set_state(self, slot: _Slot, state: SlotState) -> None:
        """The one place a slot changes state (with ``_lock`` held), along an allowed edge."""
        check_slot_transition(slot.state, state)
        slot.state = state

    def _start_worker(self, target: object, args: tuple[object, ...], name: str) -> None:
        worker = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait for the parking and discarding threads started so far; whether all ended."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return not any(worker.is_alive() for worker in workers)

    # -- targets ---------------------------------------------------------------------------

    def _save_targets(self) -> None:
        save_targets(self.state, [entry.target for entry in self._images.values()])

    def set(
        self, image: Path, size: int, *, lazy: bool | None = None, max_memory: int | None = None,
        memory_bytes: int | None = None, cpus: float | None = None,
    ) -> PoolTarget:  # fmt: skip
        """Keep ``size`` parked copies of ``image`` (0 keeps the target, parks nothing), each
        within ``memory_bytes`` and ``cpus`` (its cgroup's limits); refused unless ``image`` is
        a published image."""
        key = image_key(image)
        sample = parked_home(self.state, "pool-" + "0" * 12) / SOCKET_NAME
        if len(os.fsencode(sample)) > MAX_SOCKET_PATH:
            raise PoolError(f"{self.state.root} is too long a path for the parked copies' "
                            f"sockets ({len(os.fsencode(sample))} bytes, at most "
                            f"{MAX_SOCKET_PATH}): use a shorter SNAPCTL_STATE_DIR",
                            phase=HostPhase.POOL, path=self.state.root)  # fmt: skip
        if published_identity(Path(key)) is None:
            raise PoolError(f"{key} is not a published image (bake one, or give its directory)",
                            phase=HostPhase.POOL, path=Path(key))  # fmt: skip
        try:
            target = PoolTarget(image=key, size=size, lazy=lazy, max_memory=max_memory,
                                memory_bytes=memory_bytes, cpus=cpus)  # fmt: skip
        except ValueError as error:
            raise PoolError(f"invalid pool target: {error}", phase=HostPhase.POOL) from error
        stale: list[_Slot] = []
        with self._lock:
            entry = self._images.get(key)
            if entry is None:
                self._images[key] = _Image(target)
            else:
                if _parked_alike(entry.target) != _parked_alike(target):
                    stale = list(entry.slots)  # parked another way: not what is asked now
                entry.target = target
                entry.failures, entry.retry_at = 0, 0.0
            self._save_targets()
        for slot in stale:
            self._discard_later(slot, "target")
        self._start_thread()
        self._wake.set()
        return target

    def remove(self, image: Path) -> PoolTarget:
        """Forget ``image``'s target and discard its parked copies."""
        key = image_key(image)
        with self._lock:
            entry = self._images.pop(key, None)
            if entry is None:
                raise PoolError(f"no pool target for {key} (see snapctl pool ls)",
                                phase=HostPhase.POOL, path=Path(key))  # fmt: skip
            self._save_targets()
            slots = list(entry.slots)
        for slot in slots:
            self._discard_now(slot, "target")
        return entry.target

    # -- reading ---------------------------------------------------------------------------

    def listing(self) -> PoolListing:
        now = time.monotonic()
        with self._lock:
            snapshot = [
                (entry.target, entry.watch.identity, entry.last_failure,
                 [(slot.id, slot.state, slot.parked_at or slot.started, slot.memory_bytes,
                   slot.record) for slot in entry.live()])
                for entry in self._images.values()
            ]  # fmt: skip
        # The cgroups are read outside the lock: a take must never wait for a scrape's reads.
        entries = []
        for target, identity, last_failure, slots in snapshot:
            rows = tuple(
                ParkedCopyRow(
                    id=slot_id,
                    state="parked" if state is SlotState.PARKED else "restoring",
                    age_s=round(now - since, 3),
                    memory_bytes=memory_bytes,
                    supervisor_pid=record.supervisor_pid if record else 0,
                    root_pid=record.root_pid if record else None,
                    **cgroup_columns(record, self.state.cgroup_prefix),
                )
                for slot_id, state, since, memory_bytes, record in slots
            )
            entries.append(
                PoolEntry(
                    target=target,
                    image_id=None if identity is None else identity[0],
                    memory_bytes=sum(row.memory_bytes or 0 for row in rows),
                    parked=rows,
                    last_failure=last_failure,
                )
            )
        return PoolListing(
            entries=tuple(entries), memory_bytes=sum(e.memory_bytes for e in entries),
            ksm=read_ksm(),
        )  # fmt: skip

    def take(self, image: Path, request: CopyRequest | None = None) -> ParkedHandle | None:
        """A parked copy of ``image``, now the caller's to activate; None if none is ready
        (never waits). With ``request``: only one whose restore fits it (the same host, port,
        server command, waivers, native step and CRIU; ``lazy`` if the request says)."""
        key = image_key(image)
        with self._lock:
            entry = self._images.get(key)
            if entry is None:
                return None
            for slot in sorted(entry.parked(), key=lambda s: s.parked_at or math.inf):
                record = slot.record
                assert record is not None
                if request is not None and restore_fits(
                    self._park_request(entry.target, record.lazy), request
                ):
                    continue
                if not is_same_process(record.supervisor_pid, record.supervisor_start_time):
                    continue  # died: the next tick drops it
                entry.slots.remove(slot)
                self._set_state(slot, SlotState.TAKEN)  # PARKED -> TAKEN
                self._holds[record.id] = RefillHold.of_taken(record, time.monotonic())
                break
            else:
                return None
        self.events.taken(key)
        return ParkedHandle(
            id=record.id, image=record.image, socket=Path(record.socket),
            supervisor_pid=record.supervisor_pid,
            supervisor_start_time=record.supervisor_start_time,
        )  # fmt: skip

    def settled(self, handle: ParkedHandle) -> None:
        """The taker is done activating ``handle`` (served or failed): refills may start once
        its tree is quiet (:mod:`snapctl.pool.holds`)."""
        with self._lock:
            hold = self._holds.get(handle.id)
            if hold is not None:
                hold.settled_at = time.monotonic()
        self._wake.set()

    def forget(self, handle: ParkedHandle) -> None:
        """A taken copy its taker could not use: discard it (in the background), so that it
        holds no memory until the agent exits."""

        def discard() -> None:
            for _home, record in load_parked_records(self.state):
                if record is not None and record.id == handle.id:
                    discard_recorded(record, self.state)

        threading.Thread(target=discard, name=f"forget-{handle.id}", daemon=True).start()

    # -- lifecycle -------------------------------------------------------------------------

    def adopt(self) -> AdoptionReport:
        """At start: discard every parked copy an earlier agent left (it cannot be vouched
        for: its image may have changed while no one watched), then start refilling."""
        discarded, removed = [], []
        for home, record in load_parked_records(self.state):
            if record is not None and (record.owner_pid, record.owner_start_time) == self._owner:
                continue  # ours (adopt called late)
            if record is None:
                ended: list[int] = []
                reason: DiscardReason = "unvouched"
                removed.append(str(home))
            else:
                ended = discard_recorded(record, self.state)
                reason = "unvouched"
            shutil.rmtree(home, ignore_errors=True)
            if record is not None:
                discarded.append(
                    DiscardedCopy(id=record.id, reason=reason, processes_ended=tuple(ended))
                )
                self.events.discarded(record.image, reason)
        self._start_thread()
        return AdoptionReport(discarded=tuple(discarded), removed=tuple(removed))

    def close(self, timeout_s: float = 30.0) -> None:
        """The agent stops: stop refilling, end the restores under way, discard every
        parked copy."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            slots = [slot for entry in self._images.values() for slot in entry.slots]
        for slot in slots:
            self._discard_now(slot, "closing")
        self.drain(timeout_s)

    # -- the refill tick -------------------------------------------------------------------

    def _start_thread(self) -> None:
        with self._lock:
            if self._background and self._thread is None and not self._closing.is_set():
                self._thread = threading.Thread(target=self._run, name="pool-refill",
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def _run(self) -> None:
        thread = threading.get_native_id()
        with contextlib.suppress(OSError):  # Linux keeps a niceness per thread
            niceness = max(os.getpriority(os.PRIO_PROCESS, thread), REFILL_NICENESS)
            os.setpriority(os.PRIO_PROCESS, thread, niceness)
        while not self._closing.is_set():
            try:
                self.tick()
            except Exception as error:  # a bug: keep the pool alive, say it where seen
                for entry in list(self._images.values()):
                    entry.last_failure = f"refill: unexpected {type(error).__name__}: {error}"
            self._wake.wait(TICK_S)
            self._wake.clear()

    def tick(self, now: float | None = None) -> TickReport:
        """One pass of the bookkeeping, in the calling thread: drop what died, discard what
        cannot be vouched for or is over its target or budget, read memory, start restores
        (each in a parking thread); return what it did."""
        report = TickReport()
        now = time.monotonic() if now is None else now
        measure = now - self._memory_at >= MEMORY_EVERY_S
        if measure:
            self._memory_at = now
        with self._lock:
            entries = list(self._images.items())
        for key, entry in entries:
            self._check_image(key, entry, now, report)
            with self._lock:
                slots = entry.parked()
            for slot in slots:
                record = slot.record
                assert record is not None
                if not is_same_process(record.supervisor_pid, record.supervisor_start_time):
                    if self._drop(entry, slot, "died"):
                        report.dropped.append(slot.id)
                    continue
                if measure or slot.memory_bytes is None:
                    self._measure(entry, slot, record, now)
            self._enforce(entry, report)
            started = self._refill(key, entry, now)
            if started is not None:
                report.started.append(started)
        return report

    def _check_image(self, key: str, entry: _Image, now: float, report: TickReport) -> None:
        """Discard parked copies of an image removed, replaced, or that fails verification."""
        reason, changed = entry.watch.check(Path(key), now, self.state.verified)
        if changed:
            entry.copy_bytes = 0  # another image's copies may hold another size
        if reason == "verification":
            entry.last_failure = entry.watch.last_failure
        with self._lock:
            slots = entry.parked()
        for slot in slots:
            assert slot.record is not None
            why = reason
            if why is None and not entry.watch.vouches_for(slot.record):
                why = "replaced"
            if why is not None and self._discard_later(slot, why):
                report.discarding.append((slot.id, why))
        if reason is not None:
            entry.retry_at = max(entry.retry_at, now + VERIFY_EVERY_S)

    def _enforce(self, entry: _Image, report: TickReport) -> None:
        """Over the target's size, or over its memory budget: discard the newest."""
        with self._lock:
            live = entry.live()
        target = entry.target
        parked = [slot for slot in live if slot.state is SlotState.PARKED]
        while len(live) > target.size and parked:
            slot = max(parked, key=lambda s: s.parked_at or 0.0)
            parked.remove(slot)
            live.remove(slot)
            if self._discard_later(slot, "target"):
                report.discarding.append((slot.id, "target"))
        if target.max_memory is not None:
            while parked and sum(s.memory_bytes or 0 for s in parked) > target.max_memory:
                slot = max(parked, key=lambda s: s.parked_at or 0.0)
                parked.remove(slot)
                if self._discard_later(slot, "memory"):
                    report.discarding.append((slot.id, "memory"))
                entry.last_failure = "memory budget: a parked copy was discarded"

    @staticmethod
    def _measure(entry: _Image, slot: _Slot, record: ParkedRecord, now: float) -> None:
        slot.memory.measure(record, now)
        entry.copy_bytes = max(entry.copy_bytes, slot.memory_bytes or 0)

    def _shares_changed(self, image: str) -> None:
        """A copy of ``image`` is gone: the pages it shared with the parked ones count more in
        theirs, so their PSS is read again at the next tick."""
        with self._lock:
            entry = self._images.get(image)
            for slot in entry.slots if entry is not None else ():
                slot.memory.shares_changed()

    def _per_copy_estimate(self, entry: _Image) -> int:
        known = [s.memory_bytes for s in entry.slots if s.memory_bytes]
        return max([entry.copy_bytes, *known])

    def _held(self, now: float) -> bool:
        """Whether a taken copy still holds refills back; ends the holds that ended. Its trees'
        CPU is read outside the lock: a take must never wait for a walk of /proc."""
        with self._lock:
            holds = list(self._holds.items())
        ended = [key for key, hold in holds if not hold.holds(now, self._tree_cpu)]
        with self._lock:
            for key in ended:
                self._holds.pop(key, None)
            return bool(self._holds)

    def _refill(self, key: str, entry: _Image, now: float) -> str | None:
        """Start one restore for ``entry`` if it lacks one and may have it; its slot id."""
        if self._closing.is_set() or entry.watch.identity is None or now < entry.retry_at:
            return None
        if self._held(now):
            return None  # the next ticks sample the taken copies again
        with self._lock:
            live = entry.live()
            restoring = [slot for slot in live if slot.state is SlotState.RESTORING]
            if len(live) >= entry.target.size or restoring or self._parking >= MAX_PARKING:
                return None
            if entry.target.max_memory is not None:
                unmeasured = [slot for slot in live if slot.memory_bytes is None]
                if any(now - (slot.parked_at or now) < UNMEASURED_WAIT_S for slot in unmeasured):
                    # Just parked, its memory not read yet: counted as nothing, it would let
                    # one more restore past the budget. A tick reads it soon.
                    return None
                estimate = self._per_copy_estimate(entry)
                held = sum(
                    estimate if slot.memory_bytes is None else slot.memory_bytes for slot in live
                )
                if held + estimate > entry.target.max_memory:
                    if estimate > entry.target.max_memory:
                        # Each restore would only be discarded again: say so and wait for a
                        # larger budget (pool set) instead of restoring in a loop.
                        entry.last_failure = (
                            f"memory budget: one parked copy holds {mib(estimate)}, more than "
                            f"--max-memory {mib(entry.target.max_memory)}; raise it with "
                            "snapctl pool set"
                        )
                    return None
            slot = _Slot(id=f"pool-{secrets.token_hex(6)}", image=key)  # -> RESTORING
            entry.slots.append(slot)
            self._parking += 1
        self._start_worker(self._park, (entry, slot), f"park-{slot.id}")
        return slot.id

    def _park_request(self, target: PoolTarget, lazy: bool) -> CopyRequest:
        return CopyRequest(image=target.image, lazy=lazy, memory_bytes=target.memory_bytes,
                           cpus=target.cpus)  # fmt: skip

    def _park(self, entry: _Image, slot: _Slot) -> None:
        """A parking thread: one supervisor's restore, until it is parked or failed."""
        started = time.monotonic()
        try:
            lazy = decide_lazy(entry.target.lazy, Path(entry.target.image))
            request = self._park_request(entry.target, lazy)
            job = {
                "kind": "park", "id": slot.id, "state": str(self.state.root),
                "request": request.model_dump(mode="json"), "owner_pid": self._owner[0],
                "owner_start_time": self._owner[1],
            }  # fmt: skip
            read_fd = self.spawner.spawn(job)
            with os.fdopen(read_fd, "rb") as reader:
                record = wait_parked(reader)
        except (SnapctlError, SpawnerGoneError, OSError, ValueError) as error:
            phase = (error.phase if isinstance(error, SnapctlError) else None) or HostPhase.RESTORE
            with self._lock:
                if slot in entry.slots:
                    entry.slots.remove(slot)
                self._set_state(slot, SlotState.GONE)  # RESTORING|DISCARDING -> GONE
                self._parking -= 1
                entry.failures += 1
                entry.last_failure = f"{phase}: {error}"
                entry.retry_at = time.monotonic() + min(BACKOFF_MAX_S, 2.0**entry.failures)
            self.events.failed(slot.image, phase)
            return
        with self._lock:
            self._parking -= 1
            slot.record = record
            slot.parked_at = time.monotonic()
            entry.failures = 0
            entry.last_failure = None
            # Not if its target was removed or changed, or the pool closes, meanwhile.
            wanted = (
                slot.state is SlotState.RESTORING
                and self._images.get(slot.image) is entry
                and slot in entry.slots
                and not self._closing.is_set()
            )
            if wanted:
                self._set_state(slot, SlotState.PARKED)  # RESTORING -> PARKED
        if not wanted:
            self._discard_now(slot, "closing")
            return
        self._measure(entry, slot, record, slot.parked_at)
        self.events.parked(slot.image, slot.parked_at - started)
        self._wake.set()

    # -- discarding ------------------------------------------------------------------------

    def _drop(self, entry: _Image, slot: _Slot, reason: DiscardReason) -> bool:
        """A parked copy gone by itself: forget it, clean up what it left; whether it did
        (not if it was taken or is being discarded meanwhile)."""
        with self._lock:
            if slot.state is not SlotState.PARKED:
                return False
            self._set_state(slot, SlotState.GONE)  # PARKED -> GONE
            if slot in entry.slots:
                entry.slots.remove(slot)
        if slot.record is not None:
            discard_recorded(slot.record, self.state)
            self._shares_changed(slot.image)
        self.events.discarded(slot.image, reason)
        return True

    def _mark_discarding(self, slot: _Slot) -> bool:
        """With ``_lock`` held: the slot is to be discarded; whether it was not already (and
        is not taken: a taken copy is its taker's)."""
        if slot.state not in (SlotState.RESTORING, SlotState.PARKED):
            return False
        self._set_state(slot, SlotState.DISCARDING)  # RESTORING|PARKED -> DISCARDING
        return True

    def _discard_later(self, slot: _Slot, reason: DiscardReason) -> bool:
        """Discard in a thread of its own (a copy's stop must not hold up the others);
        whether it was sent to be discarded here."""
        with self._lock:
            if not self._mark_discarding(slot):
                return False
        self._start_worker(self._finish_discard, (slot, reason), f"discard-{slot.id}")
        return True

    def _discard_now(self, slot: _Slot, reason: DiscardReason) -> None:
        """Discard in this thread; a slot already being discarded by its parking thread (its
        restore ended after its target went) is ended here too, a taken one never."""
        with self._lock:
            if slot.state is SlotState.TAKEN or slot.state is SlotState.GONE:
                return
            if slot.state is not SlotState.DISCARDING:
                self._mark_discarding(slot)
            elif slot.record is None:
                return  # marked while restoring, restore not over: its parking thread ends it
        self._finish_discard(slot, reason)

    def _finish_discard(self, slot: _Slot, reason: DiscardReason) -> None:
        with self._lock:
            if slot.state is not SlotState.DISCARDING:
                return  # another thread finished it meanwhile
            for entry in self._images.values():
                if slot in entry.slots:
                    entry.slots.remove(slot)
            record = slot.record
            if record is not None:
                self._set_state(slot, SlotState.GONE)  # DISCARDING -> GONE
            # else: still restoring; its parking thread discards it once it parked or failed
        if record is not None:
            _order_discard(record)
            discard_recorded(record, self.state)
            self._shares_changed(slot.image)
        self.events.discarded(slot.image, reason)


def _order_discard(record: ParkedRecord, timeout_s: float = 30.0) -> None:
    """Ask a parked copy to discard itself; it answers once it is gone (best effort: one
    that cannot be asked is ended from its record, by ``discard_recorded``)."""
    import socket

    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(timeout_s)
            conn.connect(record.socket)
            conn.sendall(order_line(None))
            while conn.recv(4096):
                pass
    except OSError:
        return
    # It answered and removed its files; its exit follows, maybe before start_time reads it.
    with contextlib.suppress(psutil.Error, ProcessGoneError):
        process = psutil.Process(record.supervisor_pid)
        if same_start(start_time(process.pid), record.supervisor_start_time):
            process.wait(timeout_s)


def _parked_alike(target: PoolTarget) -> tuple[bool | None, int | None, float | None]:
    """What a target's parked copies were restored with: another value needs new copies."""
    return (target.lazy, target.memory_bytes, target.cpus)
