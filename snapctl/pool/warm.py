"""The warm pool: per image, keep ``size`` copies restored and parked, refill in the
background, bound their memory, and discard the ones that can no longer be vouched for.

One refill thread does all the bookkeeping on a tick (and when woken by ``set``, ``take``
or a copy that parked): it drops copies whose supervisor is gone, discards those whose image
was removed, replaced or fails verification, and those over the target or the memory
budget, then starts restores for what is missing, each in a parking thread (a supervisor
forked by the spawner, which reports once parked). A restore that fails backs its image off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from pydantic import ValidationError

from snapctl.activation.precheck import decide_lazy
from snapctl.activation.requests import CopyRequest
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images import ImageError
from snapctl.phases import HostPhase
from snapctl.plain import mib
from snapctl.pool.events import NoEvents, PoolEvents
from snapctl.pool.identity import published_identity, restore_fits
from snapctl.pool.models import (
    AdoptionReport,
    DiscardedCopy,
    DiscardReason,
    ParkedCopyRow,
    ParkedRecord,
    PoolEntry,
    PoolListing,
    PoolTarget,
    PoolTargets,
)
from snapctl.pool.records import (
    SOCKET_NAME,
    discard_recorded,
    load_parked_records,
    parked_home,
    pool_dir,
)
from snapctl.pool.spawner import Spawner, SpawnerGoneError
from snapctl.pool.wire import ParkedHandle, wait_parked
from snapctl.protocol.atomic import read_json_bounded, write_json_atomic
from snapctl.statedir import StateDir
from snapctl.supervision.memory import members_memory, read_ksm, tree_members
from snapctl.supervision.process import ProcessGoneError, is_same_process, same_start, start_time

TARGETS_NAME = "targets.json"
TICK_S = 0.5
# At most this many restores for the pool at once, over all images: parking is background
# work and must leave the host's CPUs to the copies being served.
MAX_PARKING = 2
# A refill waits while a taken copy activates (its restore would take the CPU the activation
# needs on a small host), at most this long after the take.
REFILL_HOLD_S = 5.0
BACKOFF_MAX_S = 30.0
# The memory of parked copies is looked at this often: the resident counters of each tree's
# processes (statm), and its PSS (smaps_rollup: a walk of every page table entry, its time
# in proportion to the memory mapped) only where those moved by more than RESIDENT_SLACK
# since the last PSS, where a copy of the same image was discarded or died since (its share
# of the pages they both mapped is the others' now), or where it is PSS_MAX_AGE_S old (a
# copy taken from the pool and stopped later does the same). docs/pool.md has what it cost.
MEMORY_EVERY_S = 2.0
RESIDENT_SLACK = 0.01
PSS_MAX_AGE_S = 30.0
# The refill thread's niceness, and so that of the parking and discarding threads it starts:
# its reads of /proc and images are background work, never to take the CPU from a copy
# being activated. At least this: an agent started nicer stays so.
REFILL_NICENESS = 10
# With a budget, a copy parked this recently whose memory could not be read yet holds back
# the refill; one unreadable longer counts at the size the others measure.
UNMEASURED_WAIT_S = 2 * MEMORY_EVERY_S
VERIFY_EVERY_S = 5.0
# sun_path holds 108 bytes, the last one a NUL.
MAX_SOCKET_PATH = 107


class PoolError(SnapctlError):
    """A pool request that cannot be done (an image not published, no such target)."""

    exit_status = ExitStatus.USAGE


class PoolTargetsError(SnapctlError):
    """``STATE/pool/targets.json`` cannot be read: the pool refuses to start rather than
    start with no targets and overwrite the file at the next ``pool set``."""


@dataclass
class _Slot:
    """One parked copy, from its restore on."""

    id: str
    image: str
    started: float = field(default_factory=time.monotonic)
    record: ParkedRecord | None = None  # once parked
    parked_at: float | None = None
    memory_bytes: int | None = None
    # What memory_bytes was read against: the tree's (pid, resident bytes) and when.
    memory_basis: tuple[tuple[int, int], ...] = ()
    memory_at: float = -math.inf
    discarding: bool = False
    taken: bool = False  # handed out by take(): the taker's now, never discarded here

    @property
    def ready(self) -> bool:
        return self.record is not None and not self.discarding


@dataclass
class _Image:
    target: PoolTarget
    slots: list[_Slot] = field(default_factory=list)
    identity: tuple[str, str] | None = None
    manifest_stat: tuple[int, int, int] | None = None
    last_failure: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    verified_at: float = 0.0
    # The most a parked copy of this image was measured to hold: what the next one is
    # expected to hold, even once none is left (each discarded for the budget, say).
    copy_bytes: int = 0


def members_resident(members: list[psutil.Process]) -> tuple[tuple[int, int], ...]:
    """Each member's resident bytes, by PID (statm: no walk of its memory, unlike PSS)."""
    readings = []
    for member in members:
        with contextlib.suppress(psutil.Error):
            readings.append((member.pid, int(member.memory_info().rss)))
    return tuple(readings)


def record_members(record: ParkedRecord) -> list[psutil.Process]:
    """A parked copy's tree and its lazy-pages daemon."""
    pids: list[tuple[int, float | None]] = []
    if record.root_pid is not None:
        pids.append((record.root_pid, record.root_start_time))
    if record.lazy_pages_pid is not None:
        pids.append((record.lazy_pages_pid, record.lazy_pages_start_time))
    return tree_members(pids)


def memory_moved(before: tuple[tuple[int, int], ...], now: tuple[tuple[int, int], ...]) -> bool:
    """Whether the tree's resident memory changed enough to read its PSS again: another set
    of processes, or a total that moved by more than :data:`RESIDENT_SLACK` of it."""
    if {pid for pid, _ in before} != {pid for pid, _ in now}:
        return True
    old, new = sum(rss for _, rss in before), sum(rss for _, rss in now)
    return abs(new - old) > RESIDENT_SLACK * max(old, new)


def image_key(image: Path) -> str:
    """One key whatever the spelling (``..``, a symbolic link): a copy request for the image
    must find the pool that ``pool set`` made for it under another path."""
    return os.path.realpath(image)


class WarmPool:
    """The agent's pool: targets by image, their parked copies, and the refill thread.

    Thread-safe. ``adopt`` first (it discards what an earlier agent parked and starts the
    refill thread), then ``set``, ``remove``, ``take`` and ``listing`` from any thread;
    ``close`` stops refilling and discards every parked copy. Targets persist in
    ``STATE/pool/targets.json``: a new agent refills them.
    """

    def __init__(
        self, state: StateDir, *, spawner: Spawner, events: PoolEvents | None = None
    ) -> None:
        self.state = state
        self.spawner = spawner
        self.events: PoolEvents = events or NoEvents()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._images: dict[str, _Image] = {}
        self._parking = 0
        # Taken copies still activating: their id and until when they hold refills back.
        self._activating: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._owner = (os.getpid(), start_time(os.getpid()))
        self._memory_at = 0.0
        for target in self._load_targets():
            self._images[target.image] = _Image(target)

    # -- targets ---------------------------------------------------------------------------

    def _targets_path(self) -> Path:
        return pool_dir(self.state) / TARGETS_NAME

    def _load_targets(self) -> list[PoolTarget]:
        """The targets kept by the last agent (none if it kept none); a file that cannot be
        read is refused, naming it, rather than lost (the next save would replace it)."""
        path = self._targets_path()
        try:
            data = read_json_bounded(path)
            if data is None:
                return []
            return list(PoolTargets.model_validate_json(json.dumps(data)).targets)
        except SnapctlError as error:
            why = error.message
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "file"
            why = f"{where}: {first['msg']}"
        raise PoolTargetsError(
            f"the pool targets in {path} cannot be read ({why}): repair the file, or move it "
            "aside to start with no pool targets (snapctl pool set adds them again)",
            path=path,
        )

    def _save_targets(self) -> None:
        pool_dir(self.state).mkdir(parents=True, mode=0o700, exist_ok=True)
        targets = PoolTargets(targets=tuple(entry.target for entry in self._images.values()))
        write_json_atomic(self._targets_path(), targets, overwrite=True)

    def set(
        self, image: Path, size: int, *, lazy: bool | None = None, max_memory: int | None = None
    ) -> PoolTarget:
        """Keep ``size`` parked copies of ``image`` (0 keeps the target, parks nothing);
        refused unless ``image`` is a published image."""
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
            target = PoolTarget(image=key, size=size, lazy=lazy, max_memory=max_memory)
        except ValueError as error:
            raise PoolError(f"invalid pool target: {error}", phase=HostPhase.POOL) from error
        stale: list[_Slot] = []
        with self._lock:
            entry = self._images.get(key)
            if entry is None:
                self._images[key] = _Image(target)
            else:
                if entry.target.lazy != target.lazy:
                    stale = list(entry.slots)  # parked the other way: not what is asked now
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
            entries = []
            for entry in self._images.values():
                rows = tuple(
                    ParkedCopyRow(
                        id=slot.id,
                        state="parked" if slot.ready else "restoring",
                        age_s=round(now - (slot.parked_at or slot.started), 3),
                        memory_bytes=slot.memory_bytes,
                        supervisor_pid=slot.record.supervisor_pid if slot.record else 0,
                        root_pid=slot.record.root_pid if slot.record else None,
                    )
                    for slot in entry.slots
                    if not slot.discarding
                )
                entries.append(
                    PoolEntry(
                        target=entry.target,
                        image_id=None if entry.identity is None else entry.identity[0],
                        memory_bytes=sum(row.memory_bytes or 0 for row in rows),
                        parked=rows,
                        last_failure=entry.last_failure,
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
            for slot in sorted(entry.slots, key=lambda s: s.parked_at or math.inf):
                if not slot.ready or slot.record is None:
                    continue
                if request is not None and restore_fits(
                    self._park_request(entry.target, slot.record.lazy), request
                ):
                    continue
                if not is_same_process(slot.record.supervisor_pid,
                                       slot.record.supervisor_start_time):  # fmt: skip
                    continue  # died: the next tick drops it
                entry.slots.remove(slot)
                slot.taken = True
                record = slot.record
                self._activating[record.id] = time.monotonic() + REFILL_HOLD_S
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
        """The taker is done activating ``handle`` (served or failed): refills may start."""
        with self._lock:
            self._activating.pop(handle.id, None)
        self._wake.set()

    def forget(self, handle: ParkedHandle) -> None:
        """A taken copy its taker could not use: discard it (in the background), so that it
        holds no memory until the agent exits."""
        from snapctl.pool.records import discard_recorded, load_parked_records

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
        deadline = time.monotonic() + timeout_s
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))

    # -- the refill thread -----------------------------------------------------------------

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._closing.is_set():
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
                self._tick()
            except Exception as error:  # a bug: keep the pool alive, say it where seen
                for entry in list(self._images.values()):
                    entry.last_failure = f"refill: unexpected {type(error).__name__}: {error}"
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _tick(self) -> None:
        now = time.monotonic()
        measure = now - self._memory_at >= MEMORY_EVERY_S
        if measure:
            self._memory_at = now
        with self._lock:
            entries = list(self._images.items())
        for key, entry in entries:
            self._check_image(key, entry, now)
            with self._lock:
                slots = list(entry.slots)
            for slot in slots:
                record = slot.record
                if record is None or slot.discarding:
                    continue
                if not is_same_process(record.supervisor_pid, record.supervisor_start_time):
                    self._drop(entry, slot, "died")
                    continue
                if measure or slot.memory_bytes is None:
                    self._measure(entry, slot, record, now)
            self._enforce(key, entry)
            self._refill(key, entry, now)

    def _check_image(self, key: str, entry: _Image, now: float) -> None:
        """Discard parked copies of an image removed, replaced, or that fails verification."""
        from snapctl.images import verify_image
        from snapctl.images.store import is_verified

        path = Path(key)
        try:
            st = (path / "manifest.json").stat()
            stat_key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stat_key = None
        if stat_key is None or stat_key != entry.manifest_stat:
            entry.manifest_stat = stat_key
            entry.identity = None if stat_key is None else published_identity(path)
            entry.copy_bytes = 0  # another image's copies may hold another size
        reason: DiscardReason | None = None
        if entry.identity is None:
            reason = "removed"
        if reason is None and now - entry.verified_at >= VERIFY_EVERY_S:
            entry.verified_at = now
            manifest = None
            with contextlib.suppress(ImageError, OSError):
                from snapctl.images import load_manifest

                manifest = load_manifest(path)
            if manifest is not None and not is_verified(path, manifest, self.state.verified):
                try:
                    verify_image(path, cache_dir=self.state.verified)
                except (ImageError, OSError) as error:
                    entry.last_failure = f"verification: {error}"
                    reason = "verification"
        with self._lock:
            slots = list(entry.slots)
        for slot in slots:
            record = slot.record
            if record is None or slot.discarding:
                continue
            why = reason
            if why is None and entry.identity != (record.image_id, record.manifest_digest):
                why = "replaced"
            if why is not None:
                self._discard_later(slot, why)
        if reason is not None:
            entry.retry_at = max(entry.retry_at, now + VERIFY_EVERY_S)

    def _enforce(self, key: str, entry: _Image) -> None:
        """Over the target's size, or over its memory budget: discard the newest."""
        with self._lock:
            live = [slot for slot in entry.slots if not slot.discarding]
        target = entry.target
        parked = [slot for slot in live if slot.ready]
        while len(live) > target.size and parked:
            slot = max(parked, key=lambda s: s.parked_at or 0.0)
            parked.remove(slot)
            live.remove(slot)
            self._discard_later(slot, "target")
        if target.max_memory is not None:
            while parked and sum(s.memory_bytes or 0 for s in parked) > target.max_memory:
                slot = max(parked, key=lambda s: s.parked_at or 0.0)
                parked.remove(slot)
                self._discard_later(slot, "memory")
                entry.last_failure = "memory budget: a parked copy was discarded"

    @staticmethod
    def _measure(entry: _Image, slot: _Slot, record: ParkedRecord, now: float) -> None:
        members = record_members(record)
        basis = members_resident(members)
        if (slot.memory_bytes is None or now - slot.memory_at >= PSS_MAX_AGE_S
                or memory_moved(slot.memory_basis, basis)):  # fmt: skip
            # A read that failed (a process between states) keeps the last one.
            memory = members_memory(members)
            if memory is not None:
                slot.memory_bytes, slot.memory_basis, slot.memory_at = memory, basis, now
        entry.copy_bytes = max(entry.copy_bytes, slot.memory_bytes or 0)

    def _shares_changed(self, image: str) -> None:
        """A copy of ``image`` is gone: the pages it shared with the parked ones count more in
        theirs, so their PSS is read again at the next tick."""
        with self._lock:
            entry = self._images.get(image)
            for slot in entry.slots if entry is not None else ():
                slot.memory_at = -math.inf

    def _per_copy_estimate(self, entry: _Image) -> int:
        known = [s.memory_bytes for s in entry.slots if s.memory_bytes]
        return max([entry.copy_bytes, *known])

    def _refill(self, key: str, entry: _Image, now: float) -> None:
        if self._closing.is_set() or entry.identity is None or now < entry.retry_at:
            return
        with self._lock:
            self._activating = {
                key: until for key, until in self._activating.items() if until > now
            }
            if self._activating:
                return  # settled() wakes the tick again
            live = [slot for slot in entry.slots if not slot.discarding]
            restoring = [slot for slot in live if slot.record is None]
            if len(live) >= entry.target.size or restoring or self._parking >= MAX_PARKING:
                return
            if entry.target.max_memory is not None:
                unmeasured = [slot for slot in live if slot.memory_bytes is None]
                if any(now - (slot.parked_at or now) < UNMEASURED_WAIT_S for slot in unmeasured):
                    # Just parked, its memory not read yet: counted as nothing, it would let
                    # one more restore past the budget. A tick reads it soon.
                    return
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
                    return
            slot = _Slot(id=f"pool-{secrets.token_hex(6)}", image=key)
            entry.slots.append(slot)
            self._parking += 1
        worker = threading.Thread(target=self._park, args=(entry, slot), name=f"park-{slot.id}",
                                  daemon=True)  # fmt: skip
        self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def _park_request(self, target: PoolTarget, lazy: bool) -> CopyRequest:
        return CopyRequest(image=target.image, lazy=lazy)

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
                not slot.discarding
                and self._images.get(slot.image) is entry
                and slot in entry.slots
                and not self._closing.is_set()
            )
        if not wanted:
            self._discard_now(slot, "closing")
            return
        self._measure(entry, slot, record, slot.parked_at)
        self.events.parked(slot.image, slot.parked_at - started)
        self._wake.set()

    # -- discarding ------------------------------------------------------------------------

    def _drop(self, entry: _Image, slot: _Slot, reason: DiscardReason) -> None:
        """A copy gone by itself: forget it, clean up what it left."""
        with self._lock:
            if slot.taken:
                return
            if slot in entry.slots:
                entry.slots.remove(slot)
        if slot.record is not None:
            discard_recorded(slot.record, self.state)
            self._shares_changed(slot.image)
        self.events.discarded(slot.image, reason)

    def _discard_later(self, slot: _Slot, reason: DiscardReason) -> None:
        """Discard in a thread of its own: a copy's stop must not hold up the others."""
        with self._lock:
            if slot.discarding or slot.taken:
                return
            slot.discarding = True
        threading.Thread(target=self._discard_now, args=(slot, reason), daemon=True,
                         name=f"discard-{slot.id}").start()  # fmt: skip

    def _discard_now(self, slot: _Slot, reason: DiscardReason) -> None:
        with self._lock:
            if slot.taken:
                return
            slot.discarding = True
            for entry in self._images.values():
                if slot in entry.slots:
                    entry.slots.remove(slot)
        if slot.record is not None:
            _order_discard(slot.record)
            discard_recorded(slot.record, self.state)
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
            conn.sendall(b'{"version":1,"action":"discard"}\n')
            while conn.recv(4096):
                pass
    except OSError:
        return
    # It answered and removed its files; its exit follows, maybe before start_time reads it.
    with contextlib.suppress(psutil.Error, ProcessGoneError):
        process = psutil.Process(record.supervisor_pid)
        if same_start(start_time(process.pid), record.supervisor_start_time):
            process.wait(timeout_s)
