"""Start times fixed against wall-clock steps: one ``btime`` per boot, shared by every process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from snapctl.supervision import clock
from snapctl.supervision.process import PinnedProcess, is_same_process, start_time


@pytest.fixture
def boot_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private boot-clock file; this process reads it afresh, and forgets it afterwards."""
    path = tmp_path / "run" / "snapctl" / "boot-clock.json"
    monkeypatch.setattr(clock, "BOOT_CLOCK", path)
    clock.forget_btime()
    yield path
    clock.forget_btime()


def step_the_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """As a process started after ``date -s`` sees it: /proc/stat's btime moved by the step."""
    real = clock.read_btime()
    monkeypatch.setattr(clock, "read_btime", lambda: real + seconds)
    clock.forget_btime()


def boot_id() -> str:
    return clock.BOOT_ID.read_text().strip()


def test_a_clock_step_moves_no_start_time(
    boot_clock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = os.getpid()
    recorded = start_time(me)
    assert boot_clock.exists()
    step_the_clock(monkeypatch, -37.0)
    assert start_time(me) == recorded
    assert is_same_process(me, recorded)
    PinnedProcess(me, recorded).close()


def test_without_the_fixed_btime_a_clock_step_loses_the_process(
    boot_clock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the fixed btime prevents: each process reading its own."""
    me = os.getpid()
    recorded = start_time(me)
    boot_clock.unlink()  # the file gone, the next process fixes a btime of its own
    step_the_clock(monkeypatch, -37.0)
    assert not is_same_process(me, recorded)


def test_the_first_btime_fixed_this_boot_wins(boot_clock: Path) -> None:
    boot_clock.parent.mkdir(parents=True)
    earlier = clock.read_btime() - 3.0
    boot_clock.write_text(clock.BootClock(boot_id=boot_id(), btime=earlier).model_dump_json())
    me = os.getpid()
    assert start_time(me) == pytest.approx(earlier + clock.read_stat(me)[1] / clock.CLOCK_TICKS)


@pytest.mark.parametrize("content", ['{"boot_id": "another-boot", "btime": 5.0}', "{not json"])
def test_another_boot_s_or_an_unreadable_clock_file_is_replaced(
    boot_clock: Path, content: str
) -> None:
    boot_clock.parent.mkdir(parents=True)
    boot_clock.write_text(content)
    me = os.getpid()
    expected = clock.read_btime() + clock.read_stat(me)[1] / clock.CLOCK_TICKS
    assert start_time(me) == pytest.approx(expected)
    recorded = clock.BootClock.model_validate_json(boot_clock.read_text())
    assert recorded.boot_id == boot_id() and recorded.btime == clock.read_btime()
    assert [p.name for p in boot_clock.parent.iterdir()] == ["boot-clock.json"]


def test_unwritable_clock_file_keeps_this_process_s_first_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setattr(clock, "BOOT_CLOCK", blocker / "boot-clock.json")
    clock.forget_btime()
    try:
        me = os.getpid()
        recorded = start_time(me)
        real = clock.read_btime()
        monkeypatch.setattr(clock, "read_btime", lambda: real + 60.0)
        assert start_time(me) == recorded  # read once per process
    finally:
        clock.forget_btime()


def test_a_record_psutil_wrote_is_still_the_process_a_boot_second_later(
    boot_clock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records written before the fixed btime hold psutil's start time, whose btime an NTP
    adjustment of milliseconds can move by one whole second."""
    me = os.getpid()
    recorded = psutil.Process(me).create_time()
    step_the_clock(monkeypatch, 1.0)
    assert is_same_process(me, recorded)


def test_the_start_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) b (c'); input()"],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).name() != "a) b (c":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        since_boot = psutil.Process(child.pid).create_time() - psutil.boot_time()
        assert clock.read_stat(child.pid)[1] / clock.CLOCK_TICKS == pytest.approx(since_boot)
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_no_stat() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(FileNotFoundError):
        clock.read_stat(child.pid)[1]
