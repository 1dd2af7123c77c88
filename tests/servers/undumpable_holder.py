"""A process holding what CRIU cannot dump, beside what it can, for the inventory's tests.

``undumpable_holder.py`` opens an io_uring (io_uring_setup through ctypes, its SQ ring mapped
as libuv maps it; skipped where io_uring is refused), a userfaultfd and, dumpable, an eventfd,
an epoll, a pidfd, a pipe and /dev/null; prints one JSON line ``{"io_uring": FD or null,
"userfaultfd": FD, "dumpable": [FD, ...]}`` and sleeps. With ``--snapshot-config JSON`` it
then runs the startup-capture protocol as a server would (it never gets past capture).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import select
import struct
import sys
import time

from capture_stub import StubHooks, capture, exit_on_sigterm

SYS_IO_URING_SETUP = 425
SYS_USERFAULTFD = 323
IO_URING_PARAMS_SIZE = 120
SQ_ARRAY_OFFSET = 64  # io_uring_params.sq_off.array

libc = ctypes.CDLL(None, use_errno=True)


def io_uring() -> tuple[int, mmap.mmap] | None:
    params = ctypes.create_string_buffer(IO_URING_PARAMS_SIZE)
    fd = libc.syscall(SYS_IO_URING_SETUP, 4, params)
    if fd < 0:
        return None  # refused (ENOSYS under seccomp, EPERM by sysctl)
    sq_entries = struct.unpack_from("I", params.raw, 0)[0]
    sq_array = struct.unpack_from("I", params.raw, SQ_ARRAY_OFFSET)[0]
    ring = mmap.mmap(fd, sq_array + 4 * sq_entries, offset=0)  # IORING_OFF_SQ_RING
    return fd, ring


def main() -> None:
    exit_on_sigterm()
    ring = io_uring()
    userfaultfd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC)
    assert userfaultfd >= 0, os.strerror(ctypes.get_errno())
    reader, writer = os.pipe()
    epoll = select.epoll()
    dumpable = [
        os.eventfd(0), epoll.fileno(), os.pidfd_open(os.getpid()), reader, writer,
        os.open(os.devnull, os.O_RDONLY),
    ]  # fmt: skip
    held = {"io_uring": ring[0] if ring else None, "userfaultfd": userfaultfd}
    print(json.dumps({**held, "dumpable": dumpable}), flush=True)
    if "--snapshot-config" not in sys.argv:
        while True:
            time.sleep(60)
    capture(sys.argv[sys.argv.index("--snapshot-config") + 1], StubHooks(text="a"))
    time.sleep(3600)


if __name__ == "__main__":
    main()
