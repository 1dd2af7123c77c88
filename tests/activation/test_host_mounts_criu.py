"""Host mounts CRIU cannot dump (a squashfs driver tree on GPU machines; ramfs here) are
recorded as external and bound back into every copy, with real CRIU."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary
from snapctl.criu.external import HostMountMissing, host_key
from snapctl.namespaces import mounts
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    PUBLISH,
    get,
    launch_donor,
    leftovers,
    restore_copy,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


@pytest.fixture
def ramfs() -> Iterator[Path]:
    """A ramfs (which CRIU refuses to dump: "FS mnt ... unsupported") holding one file, outside
    /tmp (which every sandbox replaces by a private tmpfs, hiding what the host mounts there)."""
    target = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="snapctl-test-driver-"))
    mounts.mount("snapctl-test-ramfs", target, "ramfs", 0)
    try:
        (target / "marker").write_text("host side\n")
        yield target
    finally:
        mounts.umount(target, detach=True)
        target.rmdir()


@pytest.fixture
def image(tmp_path: Path, state: StateDir, criu_binary: CriuBinary, ramfs: Path) -> Path:
    """An image captured while the ramfs was mounted (the donor stopped)."""
    path = tmp_path / "image"
    donor, _ = launch_donor(path, state, criu_binary, activate=False)
    stop_clean(donor)
    return path


def mount_type_seen_by(pid: int, point: Path) -> str | None:
    return dict(mounts.mountinfo(pid)).get(str(point))


def test_undumpable_host_mount_is_external_and_bound_into_copies(
    image: Path, state: StateDir, criu_binary: CriuBinary, ramfs: Path
) -> None:
    recorded = json.loads((image / "manifest.json").read_text())["external_mounts"]
    assert recorded[host_key(str(ramfs))] == str(ramfs)

    copy, report = restore_copy(image, state, criu_binary, publish=PUBLISH)
    try:
        assert report.published and get(report.published, "/v1/models")[0] == 200
        assert copy.root is not None
        assert mount_type_seen_by(copy.root.pid, ramfs) == "ramfs"
    finally:
        stop_clean(copy)
    assert leftovers(state) == []


def test_copy_refused_before_criu_when_the_host_mount_is_gone(
    image: Path, state: StateDir, criu_binary: CriuBinary, ramfs: Path
) -> None:
    mounts.umount(ramfs)
    ramfs.rmdir()
    try:
        with pytest.raises(HostMountMissing, match="does not have") as info:
            restore_copy(image, state, criu_binary)
        assert info.value.path == ramfs
        assert not list(state.logs.glob("copy-*/restore.log"))  # CRIU never ran
    finally:
        ramfs.mkdir()
        mounts.mount("snapctl-test-ramfs", ramfs, "ramfs", 0)  # for the fixture's unmount
    assert leftovers(state) == []
