"""Telling a recorded process from a later one that reuses its PID."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from snapctl.namespaces.layout import ActivationOwner
from snapctl.supervision.process import (
    PinnedProcess,
    descendants,
    is_same_process,
    same_start,
    start_time,
)


def test_same_process_only_with_its_own_start_time() -> None:
    me = os.getpid()
    assert is_same_process(me, start_time(me))
    assert not is_same_process(me, start_time(me) - 5.0)  # another process, same PID
    assert not is_same_process(me, start_time(me) - 0.5)


def test_a_process_that_is_gone_is_not_the_same() -> None:
    gone = subprocess.Popen(["true"])
    started = start_time(gone.pid)
    gone.wait()
    assert not is_same_process(gone.pid, started)


@contextlib.contextmanager
def zombie() -> Iterator[int]:
    """A child that has exited and that nobody reaps (until the end of the block)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    try:
        yield pid
    finally:
        os.waitpid(pid, 0)


def test_a_zombie_is_not_the_same_process() -> None:
    with zombie() as pid:
        started = start_time(pid)  # a zombie keeps its PID and its start time
        assert not is_same_process(pid, started)


def test_a_zombie_owner_is_not_alive() -> None:
    with zombie() as pid:
        assert not ActivationOwner(pid=pid, start_time=start_time(pid)).alive()


def test_a_pinned_zombie_is_not_alive() -> None:
    with zombie() as pid, PinnedProcess(pid) as pinned:
        assert not pinned.alive()


def test_descendants_lists_the_tree_parents_first_and_only_it() -> None:
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & wait) & wait"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants(tree.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        expected = [tree.pid, *(c.pid for c in psutil.Process(tree.pid).children(recursive=True))]
        assert found[0] == tree.pid and sorted(found) == sorted(expected) and len(found) == 4
        assert other.pid not in found
        parents = {pid: psutil.Process(pid).ppid() for pid in found[1:]}
        assert all(found.index(parent) < found.index(pid) for pid, parent in parents.items())
    finally:
        for process in (tree, other):
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()
    assert descendants(tree.pid) == [tree.pid]  # gone: only what was asked for


def test_descendants_falls_back_to_psutil_without_the_children_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import snapctl.supervision.process as process

    def no_children_file(path: str, mode: str = "r") -> Any:
        raise FileNotFoundError(path)

    monkeypatch.setattr(process, "open", no_children_file, raising=False)
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(tree.pid).children() and time.monotonic() < deadline:
            time.sleep(0.01)
        (child,) = psutil.Process(tree.pid).children()
        assert descendants(tree.pid) == [tree.pid, child.pid]
    finally:
        for child in psutil.Process(tree.pid).children(recursive=True):
            child.kill()
        tree.kill()
        tree.wait()


def test_start_times_one_kernel_boot_second_apart_are_the_same_process() -> None:
    assert same_start(1000.0, 1000.0) and same_start(1000.03, 1000.0)
    assert same_start(1001.0, 1000.0) and same_start(999.02, 1000.0)  # btime moved a second
    assert not same_start(1000.5, 1000.0) and not same_start(1002.0, 1000.0)
