"""Failures of donor capture and copy restore, with real CRIU: each one gives a clear reason
and phase, publishes nothing half-made, and leaves no process, mount or directory behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation.copy import RestoreError, start_copy
from snapctl.activation.donor import CaptureError
from snapctl.activation.handshake import ActivationError
from snapctl.activation.native import NativeStepError, NoNativeStep
from snapctl.activation.session import Session
from snapctl.criu import CriuBinary
from snapctl.images import ImageError, verify_image
from snapctl.namespaces import mounts
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    API_KEY,
    API_KEY_ENV,
    PUBLISH,
    get,
    image_files,
    launch_donor,
    leftovers,
    options,
    restore_copy,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(API_KEY_ENV, API_KEY)
        yield StateDir(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def image(
    tmp_path_factory: pytest.TempPathFactory, state: StateDir, criu_binary: CriuBinary
) -> Path:
    """One captured fixture image shared by the restore-failure tests (restores only read it)."""
    path = tmp_path_factory.mktemp("images") / "image"
    donor, _ = launch_donor(path, state, criu_binary, activate=False)
    stop_clean(donor)
    return path


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root can fill it), unmounted afterwards."""
    target = tmp_path / "small"
    target.mkdir()
    mounts.mount_tmpfs(target, "size=2m,mode=0755")
    try:
        yield target
    finally:
        mounts.umount(target, detach=True)


def assert_restores(image: Path, state: StateDir, criu: CriuBinary) -> None:
    """The image still verifies and a copy from it serves."""
    verify_image(image)
    session, report = restore_copy(image, state, criu, publish=PUBLISH)
    try:
        assert report.published and get(report.published, "/v1/models")[0] == 200
    finally:
        stop_clean(session)


def test_interrupt_after_restore_before_pin_leaves_nothing(
    image: Path, state: StateDir, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C right after CRIU restored the tree, before snapctl learnt its root PID."""
    import snapctl.activation.tools as tools_module

    real_restore = tools_module.restore_tree
    restored: list[str] = []

    def restore_then_interrupt(criu: CriuBinary, images: Path, work: Path, log: Path,
                               pidfile: Path, **kwargs: object) -> None:  # fmt: skip
        real_restore(criu, images, work, log, pidfile, **kwargs)  # type: ignore[arg-type]
        restored.append(work.parent.name)
        pidfile.unlink()  # as if the interrupt came before the pidfile could be read
        raise KeyboardInterrupt

    monkeypatch.setattr(tools_module, "restore_tree", restore_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        restore_copy(image, state, criu_binary)
    assert restored, "the restore ran"
    assert leftovers(state, restored) == []


def test_missing_staged_file_fails_restore_and_image_stays_usable(
    image: Path, state: StateDir, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    import snapctl.activation.tools as tools_module

    real_stage = tools_module.stage_shm_copy
    removed: list[str] = []

    def stage_then_lose_a_file(source: Path, target: Path) -> None:
        real_stage(source, target)
        victim = next(p for p in sorted(target.iterdir()) if p.is_file())
        removed.append(victim.name)
        victim.unlink()

    monkeypatch.setattr(tools_module, "stage_shm_copy", stage_then_lose_a_file)
    before = image_files(image)
    with pytest.raises(RestoreError, match="criu restore failed") as info:
        restore_copy(image, state, criu_binary)
    assert removed and info.value.phase == "restore"
    assert "cleanup: clean" in str(info.value) and "logs:" in str(info.value)
    assert leftovers(state) == []
    assert image_files(image) == before
    monkeypatch.undo()
    assert_restores(image, state, criu_binary)


NEVER_BINDS = """
import sys, time
from snapctl.launcher import run_startup_capture
from snapctl.protocol.facts import CaptureFacts
from snapctl.protocol.models import Oracle, SnapshotConfig

class Hooks:
    def canary(self):
        return Oracle(token_ids=[1], text="a", sampled_token_logprob=-0.5)
    def release_memory(self): pass
    def restore_memory(self): pass
    def capture_facts(self): return CaptureFacts(memory_policy="in-image")

config = SnapshotConfig.model_validate_json(sys.argv[sys.argv.index("--snapshot-config") + 1])
run_startup_capture(config, Hooks())
time.sleep(3600)  # validated, but never binds its public port
"""


def test_public_port_that_never_answers_fails_in_phase_serve(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    script = tmp_path / "never_binds.py"
    script.write_text(NEVER_BINDS)
    image = tmp_path / "image"
    with pytest.raises(ActivationError, match="port") as info:
        launch_donor(
            image,
            state,
            criu_binary,
            publish=PUBLISH,
            server_argv=[sys.executable, str(script)],
            timeout_s=3.0,
        )
    assert info.value.phase == "serve"
    assert "cleanup: clean" in str(info.value) and "logs:" in str(info.value)
    assert leftovers(state) == []
    verify_image(image)  # the capture itself succeeded and stays published


FAILS_RECOVERY = """
import sys
from snapctl.launcher import StartupCaptureError, run_startup_capture
from snapctl.protocol.facts import CaptureFacts
from snapctl.protocol.models import Oracle, SnapshotConfig

class Hooks:
    restores = 0
    def canary(self):
        return Oracle(token_ids=[1], text="a", sampled_token_logprob=-0.5)
    def release_memory(self): pass
    def restore_memory(self):
        self.restores += 1
        if self.restores > 1:  # the first is the rehearsal before capture-ready
            raise OSError("weights file vanished")
    def capture_facts(self): return CaptureFacts(memory_policy="reload")

config = SnapshotConfig.model_validate_json(sys.argv[sys.argv.index("--snapshot-config") + 1])
try:
    run_startup_capture(config, Hooks())
except StartupCaptureError:
    sys.exit(1)
"""


def test_error_json_after_donor_activation_is_reported(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    script = tmp_path / "fails_recovery.py"
    script.write_text(FAILS_RECOVERY)
    with pytest.raises(ActivationError, match="weights file vanished") as info:
        launch_donor(
            tmp_path / "image",
            state,
            criu_binary,
            publish=PUBLISH,
            server_argv=[sys.executable, str(script)],
            timeout_s=30.0,
        )
    assert info.value.phase is not None and info.value.phase.startswith("recovery")
    assert "cleanup: clean" in str(info.value) and "logs:" in str(info.value)
    assert leftovers(state) == []


class FailingUnlock(NoNativeStep):
    """A device step whose restore/unlock after the dump fails."""

    def after_dump(self, pids: object, timeout_s: float) -> None:
        raise NativeStepError("cuda-checkpoint --action unlock failed", phase="native")


def test_dump_and_native_unlock_both_failing_name_both(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRIU_FAULT", "1")  # the dump fails early
    with pytest.raises(CaptureError, match="criu dump") as info:
        launch_donor(tmp_path / "image", state, criu_binary, native=FailingUnlock())
    assert "native restore failed too: cuda-checkpoint --action unlock failed" in str(info.value)
    assert "cleanup: clean" in str(info.value)
    # The log it names outlives the staging directory that the failed capture removed.
    named = re.search(r"log: (\S+/dump\.log)", str(info.value))
    assert named and "Error" in Path(named.group(1)).read_text()
    assert leftovers(state) == []


def test_disk_full_publishes_nothing(
    small_mount: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    image = small_mount / "image"
    with pytest.raises(CaptureError, match="no image published") as info:
        launch_donor(image, state, criu_binary)
    assert info.value.phase == "capture" and "cleanup: clean" in str(info.value)
    assert f"no space left on device (ENOSPC) at {small_mount}" in str(info.value)
    assert "MiB free" in str(info.value)
    assert list(small_mount.iterdir()) == []  # no image, no staging directory
    assert leftovers(state) == []


def test_unwritable_image_path_refused_before_launch(
    small_mount: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    mounts.mount("none", small_mount, None, mounts.MS_REMOUNT | mounts.MS_RDONLY)
    with pytest.raises(ImageError, match="cannot create a staging directory") as info:
        launch_donor(small_mount / "image", state, criu_binary)
    assert "Read-only file system" in str(info.value)
    assert leftovers(state) == []


def test_lo_address_serves_in_donor_and_copy(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    address = "10.77.1.2"  # exists only on the sandbox's loopback
    image = tmp_path / "image"
    running: list[Session] = []
    try:
        donor, report = launch_donor(
            image, state, criu_binary, publish=PUBLISH, lo_addresses=[address], host=address
        )
        running.append(donor)
        assert report.host == address and report.published
        assert get(report.published, "/v1/models")[0] == 200
        stop_clean(donor)
        # A lazy copy too: its view keeps the address dump, which says more than lo's own.
        for lazy in (False, True):
            copy, copy_report = restore_copy(
                image, state, criu_binary, publish=PUBLISH, host=address, lazy=lazy
            )
            running.append(copy)
            assert copy_report.published and get(copy_report.published, "/v1/models")[0] == 200
            stop_clean(copy)
    finally:
        for session in running:
            if not session.stopped:
                session.stop()
    assert os.listdir(state.activations) == []


def network_of(session: Session) -> dict[str, str]:
    """What ``ip`` lists in the copy's network namespace: links, addresses, rules, routes."""
    assert session.root is not None
    enter = ["nsenter", f"--net=/proc/{session.root.pid}/ns/net", "ip"]
    listings = {
        "links": ["-o", "link"], "addresses": ["-o", "addr"], "rules4": ["-4", "rule"],
        "rules6": ["-6", "rule"], "routes4": ["-4", "route", "show", "table", "all"],
        "routes6": ["-6", "route", "show", "table", "all"],
    }  # fmt: skip
    return {
        name: subprocess.run([*enter, *args], capture_output=True, text=True, check=True).stdout
        for name, args in listings.items()
    }


def test_a_lazy_copy_skips_the_ip_restores_and_gets_the_same_network(
    image: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    # The lazy view leaves out the address, route and rule dumps of a sandbox namespace; CRIU
    # then runs no `ip` for them and the namespace must still be what a plain restore makes.
    dumps = {"ifaddr-10.img", "route-10.img", "route6-10.img", "rule-10.img"}
    assert dumps <= {path.name for path in (image / "criu").iterdir()}
    networks = {}
    for lazy in (False, True):
        copy, _ = restore_copy(image, state, criu_binary, lazy=lazy)
        try:
            networks[lazy] = network_of(copy)
            if lazy:  # what CRIU read: the image less these dumps
                seen = {path.name for path in (copy.dirs.work / "images").iterdir()}
                assert not dumps & seen and "netdev-10.img" in seen
        finally:
            stop_clean(copy)
    assert networks[True] == networks[False]
    assert "inet 127.0.0.1/8" in networks[True]["addresses"]
    assert "lookup main" in networks[True]["rules4"]


class RecordingNative(NoNativeStep):
    """A device step that records when it ran (named, so its time is reported too)."""

    name = "recording"

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def after_restore(self, pids: object, timeout_s: float) -> None:
        self.order.append("native")


def test_copy_hooks_surround_the_native_step(
    image: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    # A lazy-fault run must act before a native restore pulls every page in; fault runs after
    # it, since activation.json may only follow the native restore.
    order: list[str] = []
    session, report = start_copy(
        image, options(), criu=criu_binary, native=RecordingNative(order), publish=None,
        state=state, progress=lambda step: None,
        after_restore=lambda session: order.append("after_restore"),
        before_activation=lambda session: order.append("before_activation"),
    )  # fmt: skip
    try:
        assert order == ["after_restore", "native", "before_activation"]
        assert "native_restore" in report.timings_s
    finally:
        stop_clean(session)
