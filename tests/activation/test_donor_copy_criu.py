"""End to end with real CRIU and the bundled fixture: donor capture → image → copies.

Each test uses its own state directory and image path under tmp_path, and checks the cleanup
audit after every stop: no process, mount, directory or listener left behind.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from snapctl.activation.copy import RestoreError
from snapctl.activation.donor import CaptureError
from snapctl.activation.launch import LaunchError
from snapctl.activation.native import NoNativeStep, tree_pids
from snapctl.activation.session import Session
from snapctl.criu import CriuBinary
from snapctl.images import ImageError, verify_image
from snapctl.images.store import hash_tree
from snapctl.namespaces.layout import SANDBOX_CONTROL_DIR
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    API_KEY,
    PUBLISH,
    complete,
    get,
    launch_donor,
    options,
    restore_copy,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def test_donor_then_two_copies_serve_identically(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    image = tmp_path / "image"
    donor, report = launch_donor(image, state, criu_binary, publish=PUBLISH)
    running.append(donor)
    assert report.published and report.dump_stats is not None
    assert report.dump_stats.pages_written > 0
    assert len(report.pids) >= 2  # frontend and the spawned engine
    assert report.pids == tree_pids(report.root_pid)  # the tree as the probe left it
    assert all(seccomp_mode(pid) == "2" for pid in report.pids)  # io_uring refused in the tree
    manifest = verify_image(image)
    assert manifest.capture_id and any(n.startswith("shm/") for n in manifest.files)
    assert "***" not in " ".join(manifest.server_argv) or "--api-key" in manifest.server_argv
    hashes_before = hash_tree(image)

    assert get(report.published, "/v1/models", key=None)[0] == 401
    assert get(report.published, "/v1/models", key="wrong")[0] == 401
    reference = complete(report.published)
    digests = get(report.published, "/v1/debug/param-digests")[1]
    stop_clean(donor)

    for _ in range(2):
        copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH)
        running.append(copy)
        assert copy_report.published and copy_report.handshake_phases[-1] == "validated"
        assert copy_report.pids == tree_pids(copy_report.root_pid)
        assert all(seccomp_mode(pid) == "2" for pid in copy_report.pids)  # filter restored
        assert complete(copy_report.published) == reference
        assert get(copy_report.published, "/v1/debug/param-digests")[1] == digests
        stop_clean(copy)
    assert hash_tree(image) == hashes_before  # restores only read the image


def test_copy_while_donor_runs_shares_no_state(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    image = tmp_path / "image"
    donor, report = launch_donor(image, state, criu_binary, publish=PUBLISH)
    running.append(donor)
    copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH)
    running.append(copy)
    assert report.published and copy_report.published
    # Each sees its own control tmpfs where the server expects its control directory.
    for session in (donor, copy):
        assert session.root is not None
        assert control_mount(session.root.pid) == (session.dirs.control_source, "tmpfs")
    assert complete(copy_report.published) == complete(report.published)
    before = get(copy_report.published, "/v1/debug/shm")[1]
    request = urllib.request.Request(
        f"http://{report.published}/v1/debug/shm",
        data=json.dumps({"marker": 4242}).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
    assert get(report.published, "/v1/debug/shm")[1]["marker"] == 4242
    assert get(copy_report.published, "/v1/debug/shm")[1]["marker"] == before["marker"]
    stop_clean(copy)
    stop_clean(donor)


def seccomp_mode(pid: int) -> str:
    """The ``Seccomp:`` mode of a process (2: a filter is installed)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:"))


def control_mount(pid: int) -> tuple[str, str]:
    """(source, fstype) of what process ``pid`` has mounted at the sandbox's control path."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == SANDBOX_CONTROL_DIR:
            separator = fields.index("-")
            return fields[separator + 2], fields[separator + 1]
    raise AssertionError(f"nothing mounted at {SANDBOX_CONTROL_DIR} for pid {pid}")


FAILING_ACTION_SCRIPT = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 7
exit 0
"""


@pytest.mark.parametrize("fault", ["criu", "action-script"])
def test_dump_fault_publishes_nothing_and_cleans_up(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:  # fmt: skip
    if fault == "criu":
        monkeypatch.setenv("CRIU_FAULT", "1")  # CRIU's FI_DUMP_EARLY: the dump fails
    else:
        monkeypatch.setattr("snapctl.criu.ops.ACTION_SCRIPT", FAILING_ACTION_SCRIPT)
    image = tmp_path / "image"
    with pytest.raises(CaptureError, match="no image published") as info:
        launch_donor(image, state, criu_binary)
    assert "cleanup: clean" in str(info.value)
    assert not image.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".image")] == []
    assert list(state.activations.iterdir()) == []


def test_failed_restore_leaves_nothing_and_image_stays_usable(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    image = tmp_path / "image"
    donor, _ = launch_donor(image, state, criu_binary)
    running.append(donor)
    stop_clean(donor)
    monkeypatch.setenv("CRIU_FAULT", "4")  # opening a link remap fails on restore
    with pytest.raises(RestoreError, match="criu restore failed") as info:
        restore_copy(image, state, criu_binary)
    assert "cleanup: clean" in str(info.value)
    assert list(state.activations.iterdir()) == []
    monkeypatch.delenv("CRIU_FAULT")
    verify_image(image)
    copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH)
    running.append(copy)
    assert copy_report.published and get(copy_report.published, "/v1/models")[0] == 200
    stop_clean(copy)


def test_corrupted_image_is_refused_before_criu(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    image = tmp_path / "image"
    donor, _ = launch_donor(image, state, criu_binary)
    running.append(donor)
    stop_clean(donor)
    pages = max((image / "criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[100] ^= 0xFF
    pages.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=pages.name):
        restore_copy(image, state, criu_binary)
    assert not state.activations.exists() or list(state.activations.iterdir()) == []


def test_existing_image_refused(tmp_path: Path, state: StateDir, criu_binary: CriuBinary) -> None:
    image = tmp_path / "image"
    image.mkdir()
    (image / "keep").write_text("precious")
    with pytest.raises(ImageError, match="already exists"):
        launch_donor(image, state, criu_binary)
    assert (image / "keep").read_text() == "precious"
    assert list(state.activations.iterdir()) == []


@pytest.mark.parametrize(
    ("code", "ready_timeout_s", "match"),
    [
        ("import sys; sys.exit(3)", 30.0, "exited before capture-ready"),
        (
            "import time; time.sleep(60)",
            1.5,
            r"did not appear within 1.5 s \(raise --ready-timeout",
        ),
    ],
)
def test_server_that_never_gets_ready(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, code: str, ready_timeout_s: float,
    match: str,
) -> None:  # fmt: skip
    argv = [sys.executable, "-c", code]
    with pytest.raises(LaunchError, match=match) as info:
        launch_donor(
            tmp_path / "image", state, criu_binary, server_argv=argv,
            ready_timeout_s=ready_timeout_s,
        )  # fmt: skip
    assert "cleanup: clean" in str(info.value)
    assert not (tmp_path / "image").exists()
    assert os.listdir(state.activations) == []


def test_four_concurrent_copies_all_serve(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    from snapctl.activation.copy import start_copies

    image = tmp_path / "image"
    donor, report = launch_donor(image, state, criu_binary, publish=PUBLISH)
    running.append(donor)
    assert report.published
    reference = complete(report.published)
    stop_clean(donor)
    results = start_copies(
        image, options(), 4, criu=criu_binary, native=NoNativeStep(),
        publish_base=("127.0.0.1", 0), state=state, progress_for=lambda label: lambda step: None,
    )  # fmt: skip
    sessions = [r[0] for r in results if isinstance(r, tuple)]
    running.extend(sessions)
    assert len(sessions) == 4, [str(r) for r in results if not isinstance(r, tuple)]
    for _, copy_report in (r for r in results if isinstance(r, tuple)):
        assert copy_report.published and complete(copy_report.published) == reference
    for session in sessions:
        stop_clean(session)


def test_recovery_fault_in_a_copy_fails_closed(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, running: list[Session]
) -> None:
    from snapctl.activation.handshake import ActivationError

    image = tmp_path / "image"
    donor, _ = launch_donor(image, state, criu_binary)
    running.append(donor)
    stop_clean(donor)
    weights = next(state.models.glob("fixture-*/model.safetensors"))
    original = weights.read_bytes()
    changed = bytearray(original)
    changed[-10] ^= 0xFF  # a changed weights file: the copy's recovery must refuse it
    weights.write_bytes(bytes(changed))
    try:
        with pytest.raises(ActivationError, match="recovery") as info:
            restore_copy(image, state, criu_binary, publish=PUBLISH)
        assert info.value.phase is not None and info.value.phase.startswith("recovery")
        assert "cleanup: clean" in str(info.value)
    finally:
        weights.write_bytes(original)
    copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH)
    running.append(copy)
    assert copy_report.published and get(copy_report.published, "/v1/models")[0] == 200
    stop_clean(copy)
