"""Lazy copies with real CRIU: serving before the memory is in, completion, and failing closed.

One donor image (with retained memory whose digest must survive) is shared by the module. To
act "during the background transfer", tests keep the transfer held back (the ``held_transfer``
fixture, or ``tests/held_transfer.py`` for the CLI: the daemon serves faults only until the test
releases it), and where the transfer must have begun, pause the copy's lazy-pages daemon with
SIGSTOP, then release the transfer to it (its restore's finished word is queued for the stopped
daemon), and then kill or stop it, never resume it: a daemon stopped while it waits for the
release fails on SIGCONT (its ``epoll_wait`` returns EINTR). Unheld, 2 GiB retained is in about
0.8 s after the restore: too short to be sure of finding it still running on every machine."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from snapctl.activation.copy import RestoreError, start_copies, start_copy
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.activation.session import Session
from snapctl.activation.supervise import run_until_stopped
from snapctl.criu import CriuBinary
from snapctl.criu.kdat import run_is_tmpfs
from snapctl.criu.lazy import tuning
from snapctl.criu.lazy.pagemap import PAGE_SIZE, read_pagemap
from snapctl.criu.lazy.workingset import (
    WorkingSet,
    pagemap_key,
    unlearnable_path,
    working_set_path,
)
from snapctl.images.lock import ImageBusyError, hold_image
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess
from tests.activation.criu_helpers import complete, get, leftovers
from tests.conftest import _real_criu

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]

RETAINED_MB = 2048


@dataclass(frozen=True)
class Donor:
    image: Path
    state: StateDir
    completion: tuple[list[float], str]
    retained_sha256: str


def digest(published: str) -> object:
    status, body = get(published, "/v1/debug/retained-digest")
    assert status == 200, body
    return body["sha256"]


def options() -> LaunchOptions:
    return LaunchOptions(timeout_s=120, fixture_retained_mb=RETAINED_MB)


@pytest.fixture(scope="module")
def donor(tmp_path_factory: pytest.TempPathFactory) -> Donor:
    criu, problem = _real_criu()
    if criu is None:
        pytest.skip(problem)
    root = tmp_path_factory.mktemp("lazy")
    state, image = StateDir(root / "state"), root / "image"
    session, report = start_donor(
        options(), image=image, force=False, criu=criu, native=NoNativeStep(),
        publish=("127.0.0.1", 0), state=state, progress=lambda step: None,
    )  # fmt: skip
    try:
        assert report.published
        status, retained = get(report.published, "/v1/debug/retained-digest")
        assert status == 200 and retained["mb"] == RETAINED_MB
        result = Donor(image, state, complete(report.published), str(retained["sha256"]))
    finally:
        stop_clean(session)
    return result


def stop_clean(session: Session, stop_timeout_s: float = 10.0) -> None:
    how, audit = session.stop(stop_timeout_s)
    assert audit.clean, audit.describe()
    assert how in ("terminated", "killed", "exited")


def lazy_copy(donor: Donor, criu: CriuBinary, running: list[Session]) -> Session:
    session, report = start_copy(
        donor.image, options(), criu=criu, native=NoNativeStep(), publish=("127.0.0.1", 0),
        state=donor.state, progress=lambda step: None, lazy=True,
    )  # fmt: skip
    running.append(session)
    assert report.lazy and report.pages_complete is not None and report.published
    assert session.lazy is not None
    return session


def published(session: Session) -> str:
    assert session.publisher is not None
    return "{}:{}".format(*session.publisher.address)


def pause(daemon: PinnedProcess) -> None:
    """SIGSTOP the pinned lazy-pages daemon and wait until it is stopped."""
    daemon.signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(daemon.pid).status() != psutil.STATUS_STOPPED:
        assert daemon.alive(), "the daemon exited while its transfer was held"
        assert time.monotonic() < deadline, "SIGSTOP was not delivered"
        time.sleep(0.005)


def paused_lazy_copy(donor: Donor, criu: CriuBinary, running: list[Session]) -> tuple[Session, int]:
    """A lazy copy whose daemon is SIGSTOPped with its transfer begun and pages missing: paused
    while the transfer was held (so it cannot have finished), then released to it."""
    session = lazy_copy(donor, criu, running)
    assert session.lazy is not None and session.lazy.daemon.hold is not None
    with PinnedProcess(session.lazy.daemon.pid, session.lazy.daemon.start_time) as daemon:
        pause(daemon)
    session.lazy.release_transfer()
    assert session.lazy.daemon.hold.passed_on.wait(10)
    assert session.lazy.status.state == "transferring"
    return session, daemon.pid


def record_of(session: Session) -> dict[str, object]:
    (record,) = [r for r in session.state_dir.load_records() if r.name == session.name]
    return record.model_dump()


def assert_left_nothing(donor: Donor, activation_id: str) -> None:
    """Nothing of the copy ``activation_id`` is left, and no hold keeps the image busy."""
    assert leftovers(donor.state, [activation_id]) == []
    hold_image(donor.image, exclusive=True).release()


def test_lazy_copy_serves_and_its_memory_equals_the_donors(
    donor: Donor, criu_binary: CriuBinary, running: list[Session]
) -> None:
    session = lazy_copy(donor, criu_binary, running)
    assert complete(published(session)) == donor.completion
    assert session.lazy is not None
    status = session.lazy.wait(120)
    assert status.state == "complete" and status.complete_s is not None and status.complete_at
    assert session.lazy.daemon.poll() == 0
    record = record_of(session)
    assert record["lazy"] and record["pages_complete"] is True
    assert record["pages_complete_s"] == status.complete_s
    assert digest(published(session)) == donor.retained_sha256
    assert complete(published(session)) == donor.completion
    # The image is free again once every page arrived, while the copy still serves.
    hold_image(donor.image, exclusive=True).release()
    if not run_is_tmpfs():
        # Both CRIU processes found the kernel probe cache in their private /run.
        for log in ("restore.log", "lazy-pages.log"):
            assert "Loaded kdat cache from /run/criu.kdat" in (session.dirs.logs / log).read_text()
    stop_clean(session)


def test_a_learned_working_set_is_restored_eagerly_and_the_memory_stays_intact(
    donor: Donor, criu_binary: CriuBinary, running: list[Session]
) -> None:
    """Pagemap entries split into eager and lazy pieces: every page still lands where it was."""
    learned: list[Path] = []
    for path in (donor.image / "criu").glob("pagemap-*.img"):
        data = path.read_bytes()
        pagemap = read_pagemap(path, data)
        if pagemap.lazy_bytes < tuning.EAGER_PROCESS_BELOW:
            continue
        lazy = [entry for entry in pagemap.entries if entry.lazy][:64]
        pages = [e.vaddr // PAGE_SIZE + i for e in lazy for i in (0, 5, 100) if i < e.nr_pages]
        learned.append(working_set_path(donor.state.views, pagemap_key(data)))
        learned[-1].parent.mkdir(parents=True, exist_ok=True)
        learned[-1].write_text(WorkingSet.of_pages(pages).model_dump_json())
    assert learned  # the fixture's retained memory
    try:
        session = lazy_copy(donor, criu_binary, running)
        views = [read_pagemap(p) for p in (session.dirs.work / "images").glob("pagemap-*.img")]
        assert max(len(view.entries) for view in views) > 64 * 2  # pieces, not whole entries
        assert session.lazy is not None and session.lazy.daemon.hold is not None
        assert complete(published(session)) == donor.completion
        assert session.lazy.wait(120).state == "complete"
        assert digest(published(session)) == donor.retained_sha256
        stop_clean(session)
    finally:
        for path in learned:  # the other tests' copies restore by the view's own rule
            path.unlink(missing_ok=True)


def test_the_restore_waits_at_its_inventory_for_a_daemon_that_is_slow_to_listen(
    donor: Donor, criu_binary: CriuBinary, running: list[Session]
) -> None:
    # The daemon starts 1 s late: a restore that connected when it reached the socket (20-40
    # ms after its start) would find nobody listening and fail. It must wait at the gate.
    slow_daemon = dataclasses.replace(
        criu_binary,
        command=(
            "/bin/sh", "-c",
            'for arg in "$@"; do [ "$arg" = lazy-pages ] && sleep 1 && break; done; exec "$@"',
            "slow-daemon", *criu_binary.argv,
        ),
    )  # fmt: skip
    session = lazy_copy(donor, slow_daemon, running)
    assert complete(published(session)) == donor.completion
    assert session.lazy is not None and session.lazy.wait(120).state == "complete"
    stop_clean(session)


@pytest.fixture
def held_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies whose background transfer stays held until a test releases it (a minute)."""
    monkeypatch.setattr(tuning, "TRANSFER_AFTER_READY_S", 60.0)
    monkeypatch.setattr(tuning, "TRANSFER_HOLD_MAX_S", 60.0)


def test_the_transfer_waits_for_its_release_while_faults_are_served(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], held_transfer: None
) -> None:
    session = lazy_copy(donor, criu_binary, running)
    assert session.lazy is not None and session.lazy.daemon.hold is not None
    assert session.lazy.daemon.hold.finished_seen.is_set()
    # Unheld, every page is in 0.8 s after the restore; held, the copy serves on faults alone.
    assert complete(published(session)) == donor.completion
    assert session.lazy.wait(1.5).state == "transferring"
    assert record_of(session)["pages_complete"] is False
    # The image cannot be removed or replaced while a copy still reads its pages.
    with pytest.raises(ImageBusyError, match="in use"):
        hold_image(donor.image, exclusive=True)
    session.lazy.release_transfer()
    assert session.lazy.wait(120).state == "complete"
    assert record_of(session)["pages_complete"] is True
    hold_image(donor.image, exclusive=True).release()
    assert digest(published(session)) == donor.retained_sha256
    stop_clean(session)


class RecordingNativeStep(NoNativeStep):
    """A native step other than none: records whether the transfer was let go before it."""

    name = "recording"

    def __init__(self) -> None:
        self.session: Session | None = None
        self.released_before: bool | None = None

    def after_restore(self, pids: Iterable[int], timeout_s: float) -> None:
        assert self.session is not None and self.session.lazy is not None
        assert self.session.lazy.daemon.hold is not None
        self.released_before = self.session.lazy.daemon.hold.released


def test_a_native_step_gets_the_transfer_released_first(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], held_transfer: None
) -> None:
    native = RecordingNativeStep()
    session, _ = start_copy(
        donor.image, options(), criu=criu_binary, native=native, publish=("127.0.0.1", 0),
        state=donor.state, progress=lambda step: None, lazy=True,
        after_restore=lambda s: setattr(native, "session", s),
    )  # fmt: skip
    running.append(session)
    assert native.released_before is True
    assert session.lazy is not None and session.lazy.wait(120).state == "complete"
    stop_clean(session)


def test_a_copy_with_no_working_set_yet_leaves_its_big_process_all_lazy_and_learns(
    donor: Donor, criu_binary: CriuBinary, running: list[Session]
) -> None:
    """Its short runs, restored eagerly, would hide their touches: one copy learns the set."""
    for known in [
        *donor.state.views.glob("*.touched-runs.json"),
        *donor.state.views.glob("*.scattered"),
    ]:
        known.unlink()
    big = [
        path.name
        for path in (donor.image / "criu").glob("pagemap-*.img")
        if read_pagemap(path).lazy_bytes >= tuning.EAGER_PROCESS_BELOW
    ]
    assert big  # the fixture's retained memory
    session = lazy_copy(donor, criu_binary, running)
    view = session.dirs.work / "images"
    assert all((view / name).is_symlink() for name in big), "a big process got eager pages"
    assert session.lazy is not None and session.lazy.daemon.hold is not None
    assert complete(published(session)) == donor.completion
    assert session.lazy.wait(120).state == "complete"
    stop_clean(session)
    try:
        learned_sets = list(donor.state.views.glob("*.touched-runs.json"))
        assert learned_sets, "the copy learned no working set"
    finally:
        for learned in donor.state.views.glob("*.touched-runs.json"):
            learned.unlink()  # the other tests' copies restore by the view's own rule


def test_little_lazy_memory_is_not_held(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "HOLD_TRANSFER_MIN_BYTES", (RETAINED_MB + 1) * 2**20)
    # A view with a learned working set, or one to learn it, always holds it: nothing to learn.
    for learned in donor.state.views.glob("*.touched-runs.json"):
        learned.unlink()
    markers = [
        unlearnable_path(donor.state.views, pagemap_key(path.read_bytes()))
        for path in (donor.image / "criu").glob("pagemap-*.img")
    ]
    for marker in markers:
        marker.write_bytes(b"")
    try:
        session = lazy_copy(donor, criu_binary, running)
        assert session.lazy is not None and session.lazy.daemon.hold is None
        assert session.lazy.wait(120).state == "complete"
        stop_clean(session)
    finally:
        for marker in markers:
            marker.unlink()


def test_a_copy_stopped_while_its_transfer_is_held_leaves_nothing(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], held_transfer: None
) -> None:
    session = lazy_copy(donor, criu_binary, running)
    assert session.lazy is not None
    daemon = session.lazy.daemon.pid
    stop_clean(session)
    assert session.lazy.status.state == "stopped" and session.failure is None
    assert not psutil.pid_exists(daemon)
    assert_left_nothing(donor, session.activation_id)


def test_daemon_killed_midway_stops_the_copy_and_leaves_nothing(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], held_transfer: None
) -> None:
    session, daemon = paused_lazy_copy(donor, criu_binary, running)
    assert session.root is not None
    tree = [session.root.pid, *(p.pid for p in psutil.Process(session.root.pid).children(True))]
    os.kill(daemon, signal.SIGKILL)
    # The supervision loop returns once the watcher has killed the tree, then cleans up.
    how, audit = run_until_stopped(session)
    assert how == "exited" and audit.clean, audit.describe()
    assert session.failure is not None and "killed by SIGKILL" in session.failure
    assert session.lazy is not None and session.lazy.status.state == "failed"
    assert "before every page was copied" in (Path(session.dirs.logs) / "failure.txt").read_text()
    assert not any(psutil.pid_exists(pid) for pid in [*tree, daemon])
    assert session.state_dir.load_records() == []
    assert_left_nothing(donor, session.activation_id)


def test_stop_during_the_background_transfer_is_clean(
    donor: Donor, criu_binary: CriuBinary, running: list[Session], held_transfer: None
) -> None:
    session, daemon = paused_lazy_copy(donor, criu_binary, running)
    # The paused daemon cannot serve the faults of a graceful shutdown: expect the SIGKILL.
    stop_clean(session, stop_timeout_s=1.0)
    assert session.lazy is not None and session.lazy.status.state == "stopped"
    assert session.failure is None
    assert not psutil.pid_exists(daemon)
    assert_left_nothing(donor, session.activation_id)


def test_failed_lazy_restore_leaves_nothing(
    donor: Donor, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRIU_FAULT", "4")  # opening a link remap fails on restore
    with pytest.raises(RestoreError, match="criu restore failed") as info:
        start_copy(
            donor.image, options(), criu=criu_binary, native=NoNativeStep(), publish=None,
            state=donor.state, progress=lambda step: None, lazy=True,
        )  # fmt: skip
    assert "cleanup: clean" in str(info.value) and "lazy-pages daemon" not in str(info.value)
    assert list(donor.state.activations.iterdir()) == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if is_our_daemon(p, donor.state)]
    hold_image(donor.image, exclusive=True).release()


def is_our_daemon(process: psutil.Process, state: StateDir) -> bool:
    """A lazy-pages daemon of one of ``state``'s activations (it reads the copy's image view in
    the activation's work dir)."""
    cmdline = process.info["cmdline"] or []
    return "lazy-pages" in cmdline and any(str(state.activations) in arg for arg in cmdline)


def test_two_concurrent_lazy_copies_each_complete(
    donor: Donor, criu_binary: CriuBinary, running: list[Session]
) -> None:
    results = start_copies(
        donor.image, options(), 2, criu=criu_binary, native=NoNativeStep(),
        publish_base=("127.0.0.1", 0), state=donor.state,
        progress_for=lambda label: lambda step: None, lazy=True,
    )  # fmt: skip
    sessions = [r[0] for r in results if isinstance(r, tuple)]
    running.extend(sessions)
    assert len(sessions) == 2, [str(r) for r in results if not isinstance(r, tuple)]
    daemons = {s.lazy.daemon.pid for s in sessions if s.lazy is not None}
    assert len(daemons) == 2 and sessions[0].dirs.work != sessions[1].dirs.work
    for session in sessions:
        assert complete(published(session)) == donor.completion
    for session in sessions:
        assert session.lazy is not None and session.lazy.wait(120).state == "complete"
        assert digest(published(session)) == donor.retained_sha256
    for session in sessions:
        stop_clean(session)


def snapctl(
    state: StateDir, *args: str, check: bool = True, cli: str = "snapctl"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state.root)}
    result = subprocess.run(
        [sys.executable, "-m", cli, *args], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert not check or result.returncode == 0, f"snapctl {args[0]}: {result.stderr}"
    return result


@pytest.fixture
def detached(donor: Donor) -> Iterator[str]:
    """The name of a detached copy, stopped after the test whatever happened."""
    yield "lazy-cli"
    if snapctl(donor.state, "ps", "--json").stdout.strip() != "[]":
        snapctl(donor.state, "stop", "lazy-cli", "--timeout", "1", check=False)


def test_cli_detached_lazy_copy_stopped_mid_transfer_leaves_nothing(
    donor: Donor, criu_binary: CriuBinary, detached: str
) -> None:
    # Its detached supervisor is forked from this CLI: its transfer is held too.
    started = snapctl(
        donor.state, "copy", "--image", str(donor.image), "--lazy", "--detach", "--json",
        "--name", detached, "--publish", "0", cli="tests.held_transfer",
    )  # fmt: skip
    report = json.loads(started.stdout)
    assert report["lazy"] is True and report["pages_complete"] is False
    (record,) = donor.state.load_records()
    daemon = report["lazy_pages_pid"]
    with PinnedProcess(daemon, record.lazy_pages_start_time) as pinned:
        pause(pinned)
    (row,) = json.loads(snapctl(donor.state, "ps", "--json").stdout)
    assert row["name"] == detached and row["lazy"] and row["running"]
    assert row["lazy_pages_pid"] == daemon and row["pages_complete"] is False
    with pytest.raises(ImageBusyError):
        hold_image(donor.image, exclusive=True)
    stopped = snapctl(donor.state, "stop", detached, "--timeout", "1", "--json")
    audit = json.loads(stopped.stdout)["audit"]
    assert audit["processes"] == [] and not any(audit.values()), audit
    assert not psutil.pid_exists(daemon)
    assert json.loads(snapctl(donor.state, "ps", "--json").stdout) == []
    assert_left_nothing(donor, report["activation_id"])
