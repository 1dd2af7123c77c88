"""The sandbox's seccomp filter refuses io_uring with ENOSYS, through every system call entry
of an x86_64 kernel, and lets every other call through.

The kernel answers for the entries it has (native, and i386 where its emulation is on); the
x32 entry, absent from most kernels (which refuse its calls with ENOSYS whatever the filter
says), is checked by running the filter's program on the calls' seccomp data here.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable

import pytest

from snapctl.namespaces import seccomp

# Classic BPF, decoded here independently of the module's own opcode constants.
LD_W_ABS, ALU_AND_K, JEQ_K, JGT_K, JGE_K, RET_K = 0x20, 0x54, 0x15, 0x25, 0x35, 0x06
AUDIT_ARCH_AARCH64 = 0xC00000B7
ENOSYS_RETURN = seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS


def run_filter(arch: int, nr: int) -> int:
    """What the filter's program returns for a call ``nr`` of ``arch``."""
    data = {0: nr & 0xFFFFFFFF, 4: arch}
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = seccomp.PROGRAM[pc]
        pc += 1
        if code == LD_W_ABS:
            accumulator = data[k]
        elif code == ALU_AND_K:
            accumulator &= k
        elif code in (JEQ_K, JGT_K, JGE_K):
            taken = {JEQ_K: accumulator == k, JGT_K: accumulator > k, JGE_K: accumulator >= k}
            pc += jt if taken[code] else jf
        elif code == RET_K:
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")


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


def test_the_program_refuses_io_uring_on_every_x86_64_entry_and_only_there() -> None:
    x32 = seccomp.X32_SYSCALL_BIT
    for arch in (seccomp.AUDIT_ARCH_X86_64, seccomp.AUDIT_ARCH_I386):
        for nr in (425, 426, 427):
            assert run_filter(arch, nr) == ENOSYS_RETURN, (hex(arch), nr)
        for nr in (0, 39, 424, 428, 1 << 20):
            assert run_filter(arch, nr) == seccomp.SECCOMP_RET_ALLOW, (hex(arch), nr)
    for nr in (425, 426, 427):
        assert run_filter(seccomp.AUDIT_ARCH_X86_64, nr | x32) == ENOSYS_RETURN, nr
    assert run_filter(seccomp.AUDIT_ARCH_X86_64, 39 | x32) == seccomp.SECCOMP_RET_ALLOW
    # An architecture an x86_64 kernel never reports is left alone.
    assert run_filter(AUDIT_ARCH_AARCH64, 425) == seccomp.SECCOMP_RET_ALLOW


def test_io_uring_calls_fail_with_enosys_under_the_filter() -> None:
    def body() -> int:
        seccomp.refuse_io_uring()
        libc = ctypes.CDLL(None, use_errno=True)
        for number in (425, 426, 427):
            if libc.syscall(number, 0, None, 0, 0) != -1 or ctypes.get_errno() != errno.ENOSYS:
                return 10 + number % 10
        return 0

    assert _in_child(body) == 0


# push rbx; mov eax, 425; mov ebx, 1; xor ecx, ecx; int 0x80; pop rbx; ret: io_uring_setup(1,
# NULL) through the i386 entry, returning -errno (EFAULT from the kernel: no ring is made).
I386_IO_URING_SETUP = bytes.fromhex("53b8a9010000bb0100000031c9cd805bc3")


def _i386_io_uring_setup_errno() -> int:
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(I386_IO_URING_SETUP)
    call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    return -int(call())


def test_io_uring_through_the_i386_entry_fails_with_enosys_under_the_filter() -> None:
    # Without the filter the kernel answers (a crash: no i386 emulation, which is not tested).
    unfiltered = _in_child(_i386_io_uring_setup_errno)
    if unfiltered < 0 or unfiltered == errno.ENOSYS:
        pytest.skip(f"this kernel has no i386 system call entry (it answered {unfiltered})")
    assert unfiltered == errno.EFAULT

    def body() -> int:
        seccomp.refuse_io_uring()
        return _i386_io_uring_setup_errno()

    assert _in_child(body) == errno.ENOSYS


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
    """Proves the kernel tests above test the filter: here the kernel, not ENOSYS, answers."""
    if _io_uring_setup_errno() == errno.ENOSYS:
        pytest.skip("this kernel has no io_uring: the filter's refusal cannot be told apart")
    assert _in_child(_io_uring_setup_errno) in (errno.EFAULT, errno.EPERM)
