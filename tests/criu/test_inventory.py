"""The pre-dump inventory: what CRIU cannot dump is named (PID, process, fd, fix), what it can
dump is left alone; read from a fake /proc view and from a real process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from snapctl.criu.inventory import (
    FIX_INFINIBAND,
    FIX_IO_URING,
    FIX_NVIDIA,
    MappedFile,
    OpenFile,
    ProcFs,
    UndumpableError,
    classify_mapping,
    classify_open_file,
    inventory,
    require_dumpable,
)

HOLDER = Path(__file__).parents[1] / "servers" / "undumpable_holder.py"
CHR = stat.S_IFCHR | 0o600
BLK = stat.S_IFBLK | 0o600
REG = stat.S_IFREG | 0o644


class FakeView:
    """A /proc of made-up processes: ``{pid: (name, open files, mappings)}``."""

    def __init__(self, processes: dict[int, tuple[str, list[OpenFile], list[MappedFile]]]) -> None:
        self.processes = processes
        self.read: list[int] = []

    def name(self, pid: int) -> str:
        return self.processes[pid][0]

    def open_files(self, pid: int) -> list[OpenFile]:
        self.read.append(pid)
        return self.processes[pid][1]

    def mapped_files(self, pid: int) -> list[MappedFile]:
        return self.processes[pid][2]


def device(target: str, major: int, minor: int, fd: int = 7) -> OpenFile:
    return OpenFile(fd=fd, target=target, mode=CHR, rdev=os.makedev(major, minor))


@pytest.mark.parametrize(
    "target",
    [
        "anon_inode:[eventfd]", "anon_inode:[eventpoll]", "anon_inode:inotify",
        "anon_inode:[fanotify]", "anon_inode:[signalfd]", "anon_inode:[timerfd]",
        "anon_inode:[pidfd]", "anon_inode:bpf-map",
    ],
)  # fmt: skip
def test_anonymous_inodes_criu_dumps_pass(target: str) -> None:
    assert classify_open_file(OpenFile(fd=3, target=target)) is None


@pytest.mark.parametrize(
    ("target", "fdinfo"),
    [("anon_inode:[io_uring]", {}), ("anon_inode:[something]", {"SqMask": "0x3"})],
)
def test_io_uring_is_refused_by_link_or_by_fdinfo(target: str, fdinfo: dict[str, str]) -> None:
    verdict = classify_open_file(OpenFile(fd=4, target=target, fdinfo=fdinfo))
    assert verdict is not None
    why, fix = verdict
    assert "io_uring" in why and fix == FIX_IO_URING
    assert "seccomp" in fix and "kernel.io_uring_disabled=2" in fix


@pytest.mark.parametrize("kind", ["[userfaultfd]", "[perf_event]", "[seccomp notify]"])
def test_other_anonymous_inodes_are_refused(kind: str) -> None:
    verdict = classify_open_file(OpenFile(fd=5, target=f"anon_inode:{kind}"))
    assert verdict is not None and kind in verdict[0]


@pytest.mark.parametrize(
    ("target", "major", "minor"),
    [
        ("/dev/null", 1, 3), ("/dev/urandom", 1, 9), ("/dev/tty", 5, 0), ("/dev/ptmx", 5, 2),
        ("/dev/pts/0", 136, 0), ("/dev/tty1", 4, 1), ("/dev/net/tun", 10, 200),
        ("/dev/ttyUSB0", 188, 0),
    ],
)  # fmt: skip
def test_devices_criu_dumps_pass(target: str, major: int, minor: int) -> None:
    assert classify_open_file(device(target, major, minor)) is None


def test_devices_criu_cannot_dump_are_refused_with_their_fix() -> None:
    rdma = classify_open_file(device("/dev/infiniband/uverbs0", 231, 192))
    assert rdma is not None and "RDMA" in rdma[0] and "231:192" in rdma[0]
    assert rdma[1] == FIX_INFINIBAND
    gpu = classify_open_file(device("/dev/nvidia0", 195, 0))
    assert gpu is not None and gpu[1] == FIX_NVIDIA
    fuse = classify_open_file(device("/dev/fuse", 10, 229))
    assert fuse is not None and "10:229" in fuse[0]
    serial = classify_open_file(device("/dev/ttyS0", 4, 64))  # a UART, not a console
    assert serial is not None
    block = classify_open_file(OpenFile(fd=9, target="/dev/loop0", mode=BLK))
    assert block is not None and "block device" in block[0]


def test_files_sockets_pipes_and_unreadable_entries_are_left_to_criu() -> None:
    for entry in (
        OpenFile(fd=3, target="/models/tiny/model.safetensors", mode=REG),
        OpenFile(fd=4, target="socket:[1234]", mode=stat.S_IFSOCK | 0o777),
        OpenFile(fd=5, target="pipe:[99]", mode=stat.S_IFIFO | 0o600),
        OpenFile(fd=6, target="/memfd:weights (deleted)", mode=REG),
        OpenFile(fd=7, target="/dev/fuse", mode=None),  # closed while read: no stat
    ):
        assert classify_open_file(entry) is None, entry


def test_mappings_of_io_uring_and_devices_are_refused_but_not_dev_zero() -> None:
    ring = classify_mapping(MappedFile(span="7f00-7f01", path="anon_inode:[io_uring]"))
    assert ring is not None and ring[1] == FIX_IO_URING
    zero = MappedFile(span="7f00-7f10", path="/dev/zero", mode=CHR, rdev=os.makedev(1, 5))
    assert classify_mapping(zero) is None
    verbs = MappedFile(
        span="7f00-7f10", path="/dev/infiniband/uverbs0", mode=CHR, rdev=os.makedev(231, 192)
    )
    verdict = classify_mapping(verbs)
    assert verdict is not None and verdict[0].startswith("a mapping of an RDMA")
    assert classify_mapping(MappedFile(span="1-2", path="/dev/shm/psm_1", mode=REG)) is None


def test_inventory_names_pid_process_fd_and_fix_in_order() -> None:
    view = FakeView(
        {
            1: ("python3", [OpenFile(fd=0, target="/dev/null", mode=CHR, rdev=os.makedev(1, 3))],
                []),
            20: ("python3", [OpenFile(fd=3, target="anon_inode:[eventfd]"),
                             OpenFile(fd=4, target="anon_inode:[io_uring]")],
                 # libuv keeps its ring mapped too: named once, as the descriptor.
                 [MappedFile(span="7f00-7f01", path="anon_inode:[io_uring]"),
                  MappedFile(span="7f01-7f02", path="anon_inode:[io_uring]")]),
            31: ("VLLM::Worker", [device("/dev/infiniband/uverbs0", 231, 192, fd=12)],
                 [MappedFile(span="7e00-7e10", path="anon_inode:[io_uring]")]),
        }
    )  # fmt: skip
    findings = inventory([1, 20, 31], view=view)
    assert [(f.pid, f.name, f.where) for f in findings] == [
        (20, "python3", "fd 4"),
        (31, "VLLM::Worker", "fd 12"),
        (31, "VLLM::Worker", "mapping 7e00-7e10"),  # a ring whose descriptor was closed
    ]
    with pytest.raises(UndumpableError) as info:
        require_dumpable([1, 20, 31], view=view)
    message = info.value.message
    assert message.startswith("the tree holds 3 thing(s) CRIU cannot dump; it was not frozen")
    assert "pid 20 (python3) fd 4: anon_inode:[io_uring]: an io_uring instance" in message
    assert "fix: io_uring must be unavailable" in message
    assert "pid 31 (VLLM::Worker) fd 12: /dev/infiniband/uverbs0" in message
    assert info.value.pid == 20 and info.value.phase == "inventory"
    assert len(info.value.findings) == 3


def test_a_dumpable_tree_passes() -> None:
    view = FakeView({5: ("server", [OpenFile(fd=3, target="anon_inode:[eventpoll]")], [])})
    require_dumpable([5], view=view)
    assert view.read == [5]


def _fake_proc(root: Path, pid: int, fds: dict[int, str], maps: str = "") -> None:
    """A /proc/PID laid out as the kernel does, fd links pointing nowhere (not stat-able)."""
    base = root / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "fdinfo").mkdir()
    (base / "comm").write_text("uvloop-server\n")
    (base / "maps").write_text(maps)
    for fd, target in fds.items():
        (base / "fd" / str(fd)).symlink_to(target)
        (base / "fdinfo" / str(fd)).write_text("pos:\t0\nflags:\t02000002\nmnt_id:\t17\n")


def test_procfs_reads_links_fdinfo_and_maps_of_a_proc_tree(tmp_path: Path) -> None:
    maps = (
        "7f00-7f01 rw-s 00000000 00:0f 115028                     anon_inode:[io_uring]\n"
        "7f10-7f20 r--p 00000000 08:01 42                         /usr/lib/libuv.so.1\n"
        "7ffd-7ffe rw-p 00000000 00:00 0                          [stack]\n"
    )
    _fake_proc(tmp_path, 77, {0: "/dev/null", 4: "anon_inode:[io_uring]"}, maps)
    view = ProcFs(tmp_path)
    files = view.open_files(77)
    assert [(f.fd, f.target, f.fdinfo.get("flags")) for f in files] == [
        (0, "/dev/null", "02000002"),
        (4, "anon_inode:[io_uring]", "02000002"),
    ]
    assert [m.path for m in view.mapped_files(77)] == ["anon_inode:[io_uring]"]
    assert view.name(77) == "uvloop-server"
    assert view.open_files(78) == [] and view.mapped_files(78) == []  # gone: skipped
    findings = inventory([77], view=view)
    assert [(f.where, f.fix) for f in findings] == [("fd 4", FIX_IO_URING)]


@pytest.fixture
def holder() -> Iterator[tuple[int, dict[str, object]]]:
    """The holder process (our child, ended by its PID) and what it reported holding."""
    process = subprocess.Popen([sys.executable, str(HOLDER)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        held = json.loads(process.stdout.readline())
        yield process.pid, held
    finally:
        process.kill()
        process.wait(10)


def test_a_real_process_holding_io_uring_and_userfaultfd_is_refused(
    holder: tuple[int, dict[str, object]],
) -> None:
    pid, held = holder
    findings = inventory([pid])
    named = {f.where: f for f in findings}
    assert f"fd {held['userfaultfd']}" in named
    assert named[f"fd {held['userfaultfd']}"].what == "anon_inode:[userfaultfd]"
    if held["io_uring"] is not None:  # io_uring is allowed here: the real ring is found
        ring = named[f"fd {held['io_uring']}"]
        assert ring.what == "anon_inode:[io_uring]" and ring.fix == FIX_IO_URING
    # Nothing else: (Python's mmap holds a duplicate of the ring's descriptor, named too).
    assert {f.what for f in findings} <= {"anon_inode:[io_uring]", "anon_inode:[userfaultfd]"}
    assert {(f.pid, f.name) for f in findings} == {(pid, psutil.Process(pid).name())}
    dumpable = held["dumpable"]
    assert isinstance(dumpable, list) and len(dumpable) == 6
    assert not {f"fd {fd}" for fd in dumpable} & set(named)
