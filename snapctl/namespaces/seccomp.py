"""The sandbox's seccomp filter: the io_uring system calls fail with ENOSYS.

CRIU cannot dump an io_uring descriptor (``Unknown shit 600 (anon_inode:[io_uring])``), and
libraries make one on their own: uvloop's libuv opens one when a loop is created. When
``io_uring_setup`` fails they fall back (libuv to epoll), as they do under the default seccomp
profiles of container runtimes, so the tree stays capturable. A filter is inherited by every
child and by ``execve``, and CRIU dumps and restores it with the task.

The filter is nine classic-BPF instructions loaded with ``prctl``: libseccomp's own Python
binding is not published on the package index, and a wrapper of it would be one more dependency
of the sandbox's first program (and of every server venv) for a filter this small. It covers
every system call entry an x86_64 kernel has: the native one, x32 (matched by its number
without the x32 bit) and i386 (``int 0x80``, which a 64-bit process can use too: io_uring has
the same numbers there). Calls of any other architecture pass unchanged (the sandbox only runs
on x86_64, whose kernel accepts no other).
"""

from __future__ import annotations

import ctypes
import errno
import os

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000
IO_URING_SETUP = 425  # io_uring_enter is 426, io_uring_register 427
IO_URING_REGISTER = 427

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

# seccomp_data: int nr (offset 0), u32 arch (offset 4)
_OFFSET_NR = 0
_OFFSET_ARCH = 4

# Classic BPF opcodes
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K = 0x04 | 0x50 | 0x00  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_JGT_K = 0x05 | 0x20 | 0x00  # BPF_JMP | BPF_JGT | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# Jump offsets count instructions after the next one.
PROGRAM: tuple[tuple[int, int, int, int], ...] = (
    (_LD_W_ABS, 0, 0, _OFFSET_ARCH),  # 0
    (_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),  # 1: x86_64 (and x32) -> 3
    (_JEQ_K, 0, 5, AUDIT_ARCH_I386),  # 2: i386 -> 3; another architecture -> 8 (allow)
    (_LD_W_ABS, 0, 0, _OFFSET_NR),  # 3
    (_ALU_AND_K, 0, 0, ~X32_SYSCALL_BIT & 0xFFFFFFFF),  # 4: (i386 numbers never have it)
    (_JGE_K, 0, 2, IO_URING_SETUP),  # 5: below io_uring_setup -> 8
    (_JGT_K, 1, 0, IO_URING_REGISTER),  # 6: above io_uring_register -> 8
    (_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),  # 7
    (_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # 8
)


def refuse_io_uring() -> None:
    """Install the filter on the calling thread; its children and ``execve`` inherit it.

    Without ``CAP_SYS_ADMIN`` the kernel requires no_new_privs first, so it is set only then.
    """
    instructions = (_SockFilter * len(PROGRAM))(*(_SockFilter(*i) for i in PROGRAM))
    program = _SockFprog(len(PROGRAM), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0) == 0:
        return
    if ctypes.get_errno() != errno.EACCES:
        raise _os_error("prctl(PR_SET_SECCOMP)")
    if prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise _os_error("prctl(PR_SET_NO_NEW_PRIVS)")
    if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0) != 0:
        raise _os_error("prctl(PR_SET_SECCOMP)")


def _os_error(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")
