"""The sandbox's seccomp filter refuses io_uring with ENOSYS and lets every other call through."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

from snapctl.namespaces import seccomp


def _in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child (a filter cannot be removed) and return its exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(body())
        except BaseException:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _io_uring_setup_errno() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    # A NULL params pointer: without the filter the kernel answers EFAULT (or EPERM/ENOSYS
    # where io_uring is disabled), never creating a ring.
    result = libc.syscall(seccomp.IO_URING_SETUP, 1, None)
    return 0 if result >= 0 else ctypes.get_errno()


def test_io_uring_calls_fail_with_enosys_under_the_filter() -> None:
    def body() -> int:
        seccomp.refuse_io_uring()
        libc = ctypes.CDLL(None, use_errno=True)
        for number in (425, 426, 427, 425 | seccomp.X32_SYSCALL_BIT):
            if libc.syscall(number, 0, None, 0, 0) != -1 or ctypes.get_errno() != errno.ENOSYS:
                return 10 + number % 10
        return 0

    assert _in_child(body) == 0


def test_other_calls_work_under_the_filter() -> None:
    def body() -> int:
        seccomp.refuse_io_uring()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(39) != os.getpid():  # getpid
            return 1
        # The calls just below and above the range (pidfd_send_signal, open_tree) reach the
        # kernel, which refuses their bad arguments.
        for number, expected in ((424, errno.EBADF), (428, errno.EFAULT)):
            if libc.syscall(number, -1, None, 0, 0) != -1 or ctypes.get_errno() != expected:
                return number % 10
        with open("/proc/self/status") as status:
            return 0 if "Seccomp:\t2" in status.read() else 4

    assert _in_child(body) == 0


def test_without_the_filter_io_uring_is_not_refused_by_snapctl() -> None:
    """Proves the test above tests the filter: here the kernel, not ENOSYS, answers."""
    if _io_uring_setup_errno() == errno.ENOSYS:  # pragma: no cover - kernel without io_uring
        return
    assert _in_child(lambda: 0 if _io_uring_setup_errno() != errno.ENOSYS else 1) == 0
