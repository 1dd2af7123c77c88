"""run_criu: the fixed options, the argv file beside the log, failures and timeouts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary, CriuError, run_criu
from snapctl.criu.ops import dump_tree, restore_tree
from tests.criu.fakes import install_fake_criu

# A fake criu: records its argv and environment, writes a log to --log-file, then behaves as
# FAKE_MODE says (ok, fail, hang).
FAKE_CRIU = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_DIR/argv"
log=
prev=
for arg in "$@"; do
    [ "$prev" = --log-file ] && log=$arg
    prev=$arg
done
echo "(00.000001) Version: 4.2.1" > "$log"
case "$FAKE_MODE" in
    ok) echo "(00.000100) Dumping finished successfully" >> "$log"; exit 0 ;;
    fail)
        echo "(00.000050) Error (criu/cr-dump.c:2093): boom: tree is not a session leader" >> "$log"
        for i in $(seq 1 50)
        do echo "(00.000060) filler line $i" >> "$log"; done
        echo "on stdout" ; exit 1 ;;
    hang) exec sleep 30 ;;
    forked) sleep 300 & wait ;;
esac
exit 42
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CriuBinary:
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return install_fake_criu(tmp_path, FAKE_CRIU)


def test_success_records_the_exact_argv_beside_the_log(fake: CriuBinary, tmp_path: Path) -> None:
    images, log = tmp_path / "img", tmp_path / "logs" / "dump.log"

    result = run_criu(
        fake, "dump", images, log, ["--tree", "7"], timeout_s=10, env={"FAKE_MODE": "ok"}
    )

    expected = (str(fake.path), "dump", "--images-dir", str(images), "--log-file", str(log))
    assert result.argv == (*expected, "-v4", "--tree", "7")
    assert (tmp_path / "argv").read_text().splitlines() == list(result.argv[1:])
    assert (log.parent / "dump.argv").read_text() == shlex.join(result.argv) + "\n"
    assert result.log_path == log and result.action == "dump" and result.seconds >= 0


def test_log_level_can_be_lowered(fake: CriuBinary, tmp_path: Path) -> None:
    result = run_criu(
        fake, "dump", tmp_path / "img", tmp_path / "dump.log", ["--tree", "7"], timeout_s=10,
        env={"FAKE_MODE": "ok"}, log_level=3,
    )  # fmt: skip

    assert "-v3" in result.argv and "-v4" not in result.argv


def test_dump_tree_logs_at_info_level(fake: CriuBinary, tmp_path: Path) -> None:
    # Its log is written while the tree is frozen: debug lines would lengthen the pause.
    result = dump_tree(
        fake, 7, tmp_path / "img", tmp_path / "dump.log", external_mounts={},
        action_script=tmp_path / "script", timeout_s=10, env={"FAKE_MODE": "ok"},
    )  # fmt: skip

    assert result.argv[6] == "-v3" and "-v4" not in result.argv
    assert (tmp_path / "argv").read_text().splitlines()[5] == "-v3"


def test_restore_tree_logs_at_info_level(fake: CriuBinary, tmp_path: Path) -> None:
    # Users wait for a copy's restore: its debug lines cost 10 ms of a lazy one's 0.1 s.
    result = restore_tree(
        fake, tmp_path / "img", tmp_path / "work", tmp_path / "restore.log",
        tmp_path / "root.pid", external_dirs={}, timeout_s=10, env={"FAKE_MODE": "ok"},
    )  # fmt: skip

    assert result.argv[6] == "-v3" and "-v4" not in result.argv


def test_failure_raises_with_the_log_tail(fake: CriuBinary, tmp_path: Path) -> None:
    log = tmp_path / "dump.log"

    with pytest.raises(CriuError) as caught:
        run_criu(fake, "dump", tmp_path, log, timeout_s=10, env={"FAKE_MODE": "fail"})

    error = caught.value
    assert (error.action, error.returncode, error.log_path) == ("dump", 1, log)
    assert "criu dump exited with status 1" in str(error) and str(log) in str(error)
    assert error.path == log
    # The error line survives even though it scrolled out of the last 40 lines.
    tail = error.log_tail or ""
    assert "boom: tree is not a session leader" in tail
    assert "filler line 50" in tail and "on stdout" in tail
    assert "filler line 10\n" not in tail and "criu dump exited" in str(error)


def test_timeout_raises_without_a_returncode(fake: CriuBinary, tmp_path: Path) -> None:
    with pytest.raises(CriuError, match="criu restore timed out") as caught:
        run_criu(
            fake, "restore", tmp_path, tmp_path / "r.log", timeout_s=0.5, env={"FAKE_MODE": "hang"}
        )

    assert caught.value.returncode is None


@pytest.mark.timeout(60)
def test_a_timeout_ends_what_a_wrapper_forked(fake: CriuBinary, tmp_path: Path) -> None:
    # As nsenter forks CRIU into a container: killing the wrapper alone left its child
    # holding the output pipe, and the wait for it lasted as long as the child.
    with pytest.raises(CriuError, match="criu restore timed out"):
        run_criu(
            fake, "restore", tmp_path, tmp_path / "r.log", timeout_s=0.5,
            env={"FAKE_MODE": "forked"},
        )  # fmt: skip


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan")])
def test_timeout_must_be_positive_and_finite(
    fake: CriuBinary, tmp_path: Path, timeout_s: float
) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_criu(fake, "dump", tmp_path, tmp_path / "x.log", timeout_s=timeout_s)
