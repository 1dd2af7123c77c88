"""restore_tree_lazily against a fake CRIU: the daemon and the restore start together, the
restore is held at its inventory until the daemon listens, and every failure leaves nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary, CriuError
from snapctl.criu.lazy.daemon import LazyPagesDaemon, restore_tree_lazily
from tests.criu.fakes import install_fake_criu

INVENTORY = b"\x01\x02inventory\x00\x03"

# lazy-pages: after FAKE_DAEMON_DELAY s writes "$FAKE_DIR/daemon-ready", then the status byte
# (or, with FAKE_DAEMON=fail, exits 1); then waits to be killed. restore: after
# FAKE_RESTORE_DELAY s reads its inventory.img into "$FAKE_DIR/inventory.read", noting whether
# the daemon was ready when the read returned; an empty inventory fails it, and FAKE_RESTORE=fail
# fails it anyway.
FAKE_CRIU = """#!/bin/bash
action=$1; prev=
for arg in "$@"; do
    [ "$prev" = --status-fd ] && fd=$arg
    [ "$prev" = --images-dir ] && images=$arg
    [ "$prev" = --log-file ] && log=$arg
    prev=$arg
done
echo "$$" > "$FAKE_DIR/$action.pid"
echo "(00.000001) Version: 4.2.1" > "$log"
if [ "$action" = lazy-pages ]; then
    sleep "$FAKE_DAEMON_DELAY"
    [ "$FAKE_DAEMON" = fail ] && { echo "(00.1) Error (uffd.c:1): no socket" >> "$log"; exit 1; }
    touch "$FAKE_DIR/daemon-ready"
    printf '\\0' >&"$fd"; exec {fd}>&-
    exec sleep 30
fi
sleep "$FAKE_RESTORE_DELAY"
cat "$images/inventory.img" > "$FAKE_DIR/inventory.read"
[ -e "$FAKE_DIR/daemon-ready" ] && echo ready > "$FAKE_DIR/daemon-at-read"
[ -s "$FAKE_DIR/inventory.read" ] || { echo "(00.2) Error (image.c:1): empty" >> "$log"; exit 1; }
[ "$FAKE_RESTORE" = fail ] && { echo "(00.3) Error (cr-restore.c:1): no luck" >> "$log"; exit 1; }
exit 0
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CriuBinary:
    for name, value in {
        "FAKE_DIR": str(tmp_path), "FAKE_DAEMON_DELAY": "0", "FAKE_RESTORE_DELAY": "0",
        "FAKE_DAEMON": "ok", "FAKE_RESTORE": "ok",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    view = tmp_path / "view"
    view.mkdir()
    (view / "inventory.img").write_bytes(INVENTORY)
    (view / "pstree.img").write_bytes(b"pstree")
    (tmp_path / "work").mkdir()
    return install_fake_criu(tmp_path, FAKE_CRIU)


def restore(fake: CriuBinary, tmp_path: Path, handed: list[LazyPagesDaemon]) -> LazyPagesDaemon:
    _, daemon = restore_tree_lazily(
        fake, tmp_path / "view", tmp_path / "work", tmp_path / "logs", tmp_path / "root.pid",
        external_dirs={}, timeout_s=10, on_daemon_ready=handed.append,
    )  # fmt: skip
    return daemon


def gone(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_the_restore_reads_its_inventory_only_once_the_daemon_listens(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DAEMON_DELAY", "0.3")
    handed: list[LazyPagesDaemon] = []
    daemon = restore(fake, tmp_path, handed)
    try:
        assert (tmp_path / "daemon-at-read").exists()
        assert (tmp_path / "inventory.read").read_bytes() == INVENTORY
        assert handed == [daemon] and daemon.poll() is None
        # Both read the image through the view; the restore through its gated copy of it.
        restore_images = tmp_path / "work" / "restore-images"
        # Relative: it must resolve through the host's mounts from inside the copy too.
        assert (restore_images / "pstree.img").readlink() == Path("../../view/pstree.img")
        assert (tmp_path / "logs" / "restore.argv").read_text().count(str(restore_images)) == 1
        assert "--lazy-pages" in (tmp_path / "logs" / "restore.argv").read_text()
    finally:
        daemon.kill()


def test_a_restore_that_opens_its_inventory_late_still_reads_all_of_it(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon is ready long before the restore reads: the gate must not close the FIFO
    # (which would discard what it wrote) before the restore has read it.
    monkeypatch.setenv("FAKE_RESTORE_DELAY", "0.3")
    daemon = restore(fake, tmp_path, [])
    daemon.kill()
    assert (tmp_path / "inventory.read").read_bytes() == INVENTORY


def test_a_daemon_that_fails_fails_the_restore_with_its_own_error_and_leaves_nothing(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DAEMON", "fail")
    monkeypatch.setenv("FAKE_DAEMON_DELAY", "0.2")
    handed: list[LazyPagesDaemon] = []
    with pytest.raises(CriuError) as info:
        restore(fake, tmp_path, handed)
    assert info.value.action == "lazy-pages" and "no socket" in (info.value.log_tail or "")
    assert handed == []
    # The restore got an empty inventory, failed on it, and was waited for.
    assert (tmp_path / "inventory.read").read_bytes() == b""
    assert gone(tmp_path / "restore.pid") and gone(tmp_path / "lazy-pages.pid")


def test_a_failed_restore_leaves_its_daemon_to_whoever_took_it_over(
    fake: CriuBinary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_RESTORE", "fail")
    handed: list[LazyPagesDaemon] = []
    with pytest.raises(CriuError) as info:
        restore(fake, tmp_path, handed)
    assert info.value.action == "restore" and "no luck" in (info.value.log_tail or "")
    assert gone(tmp_path / "restore.pid")
    [daemon] = handed
    assert daemon.poll() is None
    daemon.kill()
    assert gone(tmp_path / "lazy-pages.pid")


def test_an_inventory_too_big_for_one_pipe_write_is_refused(
    fake: CriuBinary, tmp_path: Path
) -> None:
    (tmp_path / "view" / "inventory.img").write_bytes(b"x" * (64 * 1024))
    with pytest.raises(CriuError, match=r"could not be prepared: .*too big"):
        restore(fake, tmp_path, [])
    assert not (tmp_path / "lazy-pages.pid").exists()


def test_a_held_transfer_puts_the_daemon_in_its_own_dir_behind_the_relay(
    fake: CriuBinary, tmp_path: Path
) -> None:
    handed: list[LazyPagesDaemon] = []
    _, daemon = restore_tree_lazily(
        fake, tmp_path / "view", tmp_path / "work", tmp_path / "logs", tmp_path / "root.pid",
        external_dirs={}, timeout_s=10, on_daemon_ready=handed.append, hold_transfer=True,
    )  # fmt: skip
    assert handed == [daemon] and daemon.hold is not None
    argv = [str(arg) for arg in daemon.process.args]
    assert argv[argv.index("--work-dir") + 1] == str(tmp_path / "work" / "lazy-pages")
    # The restore (work dir "work") connects to the relay, not to the daemon.
    assert (tmp_path / "work" / "lazy-pages.socket").is_socket()
    daemon.kill()
    assert gone(tmp_path / "lazy-pages.pid")


def test_a_hold_that_cannot_be_prepared_starts_nothing(fake: CriuBinary, tmp_path: Path) -> None:
    (tmp_path / "work" / "lazy-pages").mkdir()  # taken: the daemon's dir must be new
    with pytest.raises(CriuError, match=r"could not be prepared: .*File exists"):
        restore_tree_lazily(
            fake, tmp_path / "view", tmp_path / "work", tmp_path / "logs", tmp_path / "root.pid",
            external_dirs={}, timeout_s=10, on_daemon_ready=lambda daemon: None,
            hold_transfer=True,
        )  # fmt: skip
    assert not (tmp_path / "lazy-pages.pid").exists() and not (tmp_path / "restore.pid").exists()
