"""The first program inside a fresh sandbox: prepare mounts, loopback and stdio, then exec.

Run by the launcher as ``unshare --pid --net --ipc --uts --mount --fork -- python -m
snapctl.namespaces.init SPEC.json``, so it is PID 1 of the new PID namespace, and it becomes the
server itself by ``execve``. CRIU needs that root to be PID 1 and a session leader, stdio opened
inside the new mount namespace, and no descriptor leaked from snapctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
from pathlib import Path

from snapctl.namespaces import mounts
from snapctl.namespaces.layout import SandboxSpec

PR_SET_PDEATHSIG = 1


def _needed_paths(spec: SandboxSpec) -> set[str]:
    """Paths whose filesystems the server itself needs, so their tmpfs mounts must stay."""
    paths = {spec.cwd, os.path.realpath(sys.executable)}
    if spec.argv and os.path.isabs(spec.argv[0]):
        paths.add(os.path.realpath(spec.argv[0]))
    return paths


def _drop_foreign_tmpfs(needed: set[str], keep_points: set[str]) -> None:
    """Detach tmpfs mounts the server does not need: CRIU would tar their contents into the
    image, and record host paths (say the donor's own directories) a copy cannot have."""
    for point, fstype in reversed(mounts.mountinfo()):
        if fstype != "tmpfs" or point in keep_points:
            continue
        if any(path == point or path.startswith(point.rstrip("/") + "/") for path in needed):
            continue
        # A mount can already be gone with a parent detached before it.
        with contextlib.suppress(OSError):
            mounts.umount(point, detach=True)


def _loopback_up(addresses: list[str]) -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            prefix = 128 if family == socket.AF_INET6 else 32
            ipr.addr("add", index=lo, address=address, prefixlen=prefix, family=family)


def prepare_and_exec(spec: SandboxSpec) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    os.setsid()
    # unshare's parent-death signal would be saved into the image and kill every copy
    # as soon as the restoring CRIU exits.
    libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    mounts.make_private_recursive("/")

    # Hold the host directories before their parents may be unmounted or covered.
    sources = {b.target: os.open(b.host, os.O_PATH | os.O_DIRECTORY) for b in spec.binds}
    needed = _needed_paths(spec)
    _drop_foreign_tmpfs(needed | {b.host for b in spec.binds}, keep_points=set())
    mounts.mount_tmpfs("/run", "mode=0755")
    for target, fd in sources.items():
        Path(target).mkdir(parents=True, exist_ok=True)
        mounts.bind(f"/proc/self/fd/{fd}", target)
        os.close(fd)
    # Now that the targets hold them, drop the host-side mounts of the sources too.
    _drop_foreign_tmpfs(needed, keep_points={"/run", *sources})
    # A /proc of the new PID namespace, so pids read there match os.getpid().
    mounts.umount("/proc", detach=True)
    mounts.mount("proc", "/proc", "proc", mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC)

    socket.sethostname(spec.hostname)
    _loopback_up(spec.lo_addresses)

    null = os.open("/dev/null", os.O_RDONLY)
    # O_APPEND: CRIU restores such a descriptor without checking the file's size.
    log = os.open(spec.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(spec.cwd)
    os.execve(spec.argv[0], spec.argv, spec.env)


def main() -> None:
    spec = SandboxSpec.model_validate_json(Path(sys.argv[1]).read_text())
    try:
        prepare_and_exec(spec)
    except BaseException as error:
        print(f"snapctl sandbox init failed: {error}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
