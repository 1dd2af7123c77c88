"""A tree's PSS and the host's KSM: read from /proc and a KSM directory, started only where
stopped, tuned by the kernel's advisor where it has one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from snapctl.supervision.memory import (
    KSM_PAGES_PER_WAKE,
    KSM_SLEEP_MS,
    KsmStatus,
    enable_ksm,
    ksm_saved,
    read_ksm,
    tree_memory,
)
from snapctl.supervision.process import start_time


def _ksm_dir(tmp_path: Path, *, run: int, advisor: bool) -> Path:
    ksm = tmp_path / "ksm"
    ksm.mkdir()
    values: dict[str, object] = {
        "run": run, "pages_sharing": 2560, "full_scans": 3, "general_profit": 10 << 20,
        "pages_to_scan": 100, "sleep_millisecs": 200,
    }  # fmt: skip
    if advisor:
        values["advisor_mode"] = "[none] scan-time"
    for name, value in values.items():
        (ksm / name).write_text(f"{value}\n")
    return ksm


def test_ksm_is_read_from_its_directory(tmp_path: Path) -> None:
    assert read_ksm(_ksm_dir(tmp_path, run=1, advisor=True)) == KsmStatus(
        running=True, saved_bytes=10 << 20, pages_sharing=2560, full_scans=3
    )
    assert read_ksm(tmp_path / "none") is None  # a kernel without KSM


@pytest.mark.parametrize("advisor", [True, False])
def test_a_stopped_ksm_is_started_at_snapctls_rate(tmp_path: Path, advisor: bool) -> None:
    ksm = _ksm_dir(tmp_path, run=0, advisor=advisor)
    assert enable_ksm(ksm) is True
    assert (ksm / "run").read_text() == "1"
    assert (ksm / "pages_to_scan").read_text() == str(KSM_PAGES_PER_WAKE)
    assert (ksm / "sleep_millisecs").read_text() == str(KSM_SLEEP_MS)
    if advisor:
        assert (ksm / "advisor_mode").read_text() == "none"


@pytest.mark.parametrize("run", [1, 2])  # running, or told to unmerge by the host's operator
def test_a_ksm_the_host_set_keeps_its_settings(tmp_path: Path, run: int) -> None:
    ksm = _ksm_dir(tmp_path, run=run, advisor=True)
    assert enable_ksm(ksm) is False
    assert (ksm / "run").read_text() == f"{run}\n"
    assert (ksm / "pages_to_scan").read_text() == "100\n"
    assert enable_ksm(tmp_path / "none") is False  # a kernel without KSM


TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import sys, time\\n"
    "held = bytearray(64 << 20)\\nheld[::4096] = b'x' * (16 << 10)\\n"
    "print('ready', flush=True)\\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), child.pid, flush=True)
time.sleep(60)
"""


def test_a_trees_memory_counts_its_children() -> None:
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert root.stdout is not None
        ready, child_pid = root.stdout.readline().split()
        assert ready == "ready"
        child = int(child_pid)
        alone = psutil.Process(root.pid).memory_full_info().pss
        total = tree_memory(root.pid, start_time(root.pid))
        assert total is not None and total.pss_bytes is not None
        assert total.pss_bytes > alone + (60 << 20)
        assert total.ksm_saved_bytes == 0  # nothing marked mergeable
        assert tree_memory(root.pid, start_time(root.pid) + 100) is None  # not that process
    finally:
        if child:
            os.kill(child, 9)
        root.kill()
        root.wait()


def test_ksm_saved_adds_each_process_profit(tmp_path: Path) -> None:
    for pid, profit in ((10, "4096"), (11, "-64")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "ksm_stat").write_text(
            f"ksm_rmap_items 2\nksm_merging_pages 1\nksm_process_profit {profit}\n"
        )
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "ksm_stat").write_text("ksm_rmap_items 0\n")  # a kernel before 6.7
    assert ksm_saved([10, 11, 12, 13], proc=tmp_path) == 4032
    assert ksm_saved([12, 13], proc=tmp_path) is None
