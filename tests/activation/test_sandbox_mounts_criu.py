"""The sandbox shows the server only what it needs, with real CRIU: host network namespaces
made and removed around capture and restore (``ip netns`` leaves /run/netns mounted, as every
Kubernetes node with CNI does) never reach an image, and every activation has a /tmp of its own
whose unix sockets survive capture and restore."""

from __future__ import annotations

import contextlib
import json
import os
import site
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation.session import Session
from snapctl.criu import CriuBinary
from snapctl.criu.external import is_host_key
from snapctl.namespaces import mounts
from snapctl.namespaces.hostview import PRIVATE_ROOTS, is_within
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    PUBLISH,
    complete,
    launch_donor,
    leftovers,
    restore_copy,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

RUN_NETNS = Path("/run/netns")
TMP_SERVER = Path(__file__).parents[1] / "servers" / "tmp_server.py"
# The checkout the fixture runs from: under /tmp in a clone there, and then bound in too.
CHECKOUT = str(Path(__file__).resolve().parents[2])
# What a server run from that checkout sees of it in its own /tmp: the top directory, if any.
CHECKOUT_IN_TMP = (
    {Path(CHECKOUT).relative_to("/tmp").parts[0]} if CHECKOUT.startswith("/tmp/") else set()
)


def bound_in(test_dir: Path) -> list[str]:
    """What the sandbox binds in under /tmp by design: the test's directory (holding the
    fixture's model) and the checkout the server runs from, where they lie there."""
    return [path for path in (str(test_dir), CHECKOUT) if is_within(path, "/tmp")]


@pytest.fixture
def run_netns_restored() -> Iterator[None]:
    """Puts /run/netns back as it was before the test (``ip netns`` mounts it and leaves it
    mounted after its last namespace is deleted), unless another namespace appeared there."""
    existed = RUN_NETNS.exists()
    was_mounted = existed and mounts.is_mountpoint(RUN_NETNS)
    yield
    if was_mounted or not RUN_NETNS.exists() or os.listdir(RUN_NETNS):
        return
    while mounts.is_mountpoint(RUN_NETNS):
        mounts.umount(RUN_NETNS, detach=True)
    if not existed:
        RUN_NETNS.rmdir()


@contextlib.contextmanager
def host_netns() -> Iterator[str]:
    """A named network namespace on the host for as long as the block runs (a unique name:
    other tests, and the host itself, may have theirs)."""
    name = f"snapctl-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True, capture_output=True)


def host_mounts_seen(session: Session, bound: Path) -> list[tuple[str, str]]:
    """(mount point, type) of what the activation's root sees that the sandbox should hide: any
    nsfs, or anything under /run or /tmp but the sandbox's own and what it binds in from
    ``bound`` (the test's directory, holding the fixture's model)."""
    assert session.root is not None
    own = {"/run", "/tmp", "/run/snapctl/control", "/run/snapctl/logs"}

    def private(point: str) -> bool:
        return any(is_within(point, root) for root in PRIVATE_ROOTS)

    return [
        (point, fstype)
        for point, fstype in mounts.mountinfo(session.root.pid)
        if fstype == "nsfs"
        or (
            private(point)
            and point not in own
            and not any(is_within(point, path) for path in bound_in(bound))
        )
    ]


def recorded_host_mounts(image: Path) -> list[str]:
    external: dict[str, str] = json.loads((image / "manifest.json").read_text())["external_mounts"]
    return [point for key, point in external.items() if is_host_key(key)]


@pytest.mark.usefixtures("run_netns_restored")
def test_host_netns_made_and_removed_around_capture_and_restore(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    image = tmp_path / "image"
    with host_netns():
        donor, report = launch_donor(image, state, criu_binary, publish=PUBLISH)
    try:
        assert report.published
        expected = complete(report.published)
        assert host_mounts_seen(donor, tmp_path) == []
        # The fixture's model sits in the test's /tmp: bound in, recorded, nothing else is.
        recorded = recorded_host_mounts(image)
        assert all(any(is_within(p, path) for path in bound_in(tmp_path)) for p in recorded)
        assert mounts.is_mountpoint(RUN_NETNS)  # `ip netns del` leaves it mounted
        with host_netns():
            copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH)
        try:
            assert copy_report.published and complete(copy_report.published) == expected
            assert host_mounts_seen(copy, tmp_path) == []
        finally:
            stop_clean(copy)
    finally:
        stop_clean(donor)
    assert leftovers(state) == []


@pytest.mark.usefixtures("run_netns_restored")
def test_a_leftover_run_netns_mount_neither_reaches_the_image_nor_blocks_copies(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    with host_netns():
        pass
    assert mounts.is_mountpoint(RUN_NETNS) and os.listdir(RUN_NETNS) == []
    image = tmp_path / "image"
    donor, _ = launch_donor(image, state, criu_binary, activate=False)
    stop_clean(donor)
    assert not any(is_within(p, "/run") for p in recorded_host_mounts(image))
    copy, report = restore_copy(image, state, criu_binary, publish=PUBLISH)
    try:
        assert report.published and complete(report.published)[1]
    finally:
        stop_clean(copy)
    assert leftovers(state) == []


def ask_unix_socket(session: Session) -> dict[str, object]:
    """What the server's unix socket under its /tmp answers, reached through its root."""
    assert session.root is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(f"/proc/{session.root.pid}/root/tmp/snapctl-test.sock")
        reply: dict[str, object] = json.loads(client.makefile("rb").read())
    return reply


def test_every_activation_has_its_own_tmp_and_its_unix_sockets_survive_restore(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    image = tmp_path / "image"
    argv = [sys.executable, str(TMP_SERVER)]
    donor, _ = launch_donor(image, state, criu_binary, server_argv=argv, api_key_env=None)
    sessions = [donor]
    try:
        for _ in range(2):
            sessions.append(restore_copy(image, state, criu_binary, api_key_env=None)[0])
        tmp_dirs = []
        for index, session in enumerate(sessions):
            assert session.root is not None
            tmp = Path(f"/proc/{session.root.pid}/root/tmp")
            # Restored with its contents (the unix socket's file included) from the image.
            assert (tmp / "written-before-capture").read_text() == "before capture\n"
            (tmp / f"written-by-{index}").write_text("mine\n")
            tmp_dirs.append(tmp)
        for index, tmp in enumerate(tmp_dirs):
            written = sorted(p.name for p in tmp.glob("written-by-*"))
            assert written == [f"written-by-{index}"]
            reply = ask_unix_socket(sessions[index])
            assert reply["tmp"] == sorted(
                {"snapctl-test.sock", "written-before-capture", f"written-by-{index}"}
                | CHECKOUT_IN_TMP
            )
        assert not Path("/tmp/written-before-capture").exists()  # the host's /tmp untouched
    finally:
        for session in sessions:
            stop_clean(session)
    assert leftovers(state) == []


def venv_under_tmp(root: Path) -> Path:
    """A virtual environment at ``root`` (under /tmp) whose python runs the fixture servers:
    this interpreter's, with snapctl's checkout and site-packages on its path."""
    assert is_within(str(root), "/tmp")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    base = os.path.dirname(os.path.realpath(sys.executable))
    (root / "pyvenv.cfg").write_text(f"home = {base}\ninclude-system-site-packages = false\n")
    site_packages = root / "lib" / version / "site-packages"
    site_packages.mkdir(parents=True)
    (site_packages / "snapctl-tests.pth").write_text(f"{CHECKOUT}\n{site.getsitepackages()[0]}\n")
    return root


def test_a_venv_under_tmp_run_from_another_cwd_is_bound_into_the_private_tmp(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    venv = venv_under_tmp(tmp_path / "venv")
    # The server runs from the checkout's cwd (bound in whole, even under /tmp): it must not
    # hold the venv, which only its own bind can bring in.
    assert not is_within(str(venv), os.getcwd())
    argv = [str(venv / "bin" / "python"), str(TMP_SERVER)]
    image = tmp_path / "image"
    donor, _ = launch_donor(image, state, criu_binary, server_argv=argv, api_key_env=None)
    sessions = [donor]
    try:
        assert str(venv) in recorded_host_mounts(image)
        sessions.append(restore_copy(image, state, criu_binary, api_key_env=None)[0])
        for session in sessions:
            assert ask_unix_socket(session)["prefix"] == str(venv)
    finally:
        for session in sessions:
            stop_clean(session)
    assert leftovers(state) == []
