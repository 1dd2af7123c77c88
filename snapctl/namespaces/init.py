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
import stat
import sys
from pathlib import Path

# Imported before any mount changes: once the sandbox's private /tmp covers the host's, a
# snapctl installed under /tmp could no longer import it.
from pyroute2 import IPRoute

from snapctl.namespaces import devices, mounts, seccomp
from snapctl.namespaces.hostview import HostMount, mounts_to_detach, server_paths
from snapctl.namespaces.layout import SandboxSpec

PR_SET_PDEATHSIG = 1


def _needed_paths(spec: SandboxSpec) -> list[str]:
    """Paths whose mounts the server (and this init, until it execs) needs kept."""
    return [*server_paths(spec.argv, spec.cwd), os.path.realpath(sys.executable)]


def _detach_hidden(needed: list[str]) -> None:
    """Detach every host mount the sandbox hides (see ``hostview``)."""
    table = [HostMount(*entry) for entry in mounts.mountinfo_entries()]
    for point in mounts_to_detach(table, needed):
        # A mount can already be gone with a parent detached before it.
        with contextlib.suppress(OSError):
            mounts.umount(point, detach=True)


def _loopback_up(addresses: list[str]) -> None:

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

    # Detached copies of the host directories to bind, taken before their mounts are detached
    # or covered (a bind from a detached mount is refused; a cloned tree is not).
    trees = [(b, mounts.clone_tree(b.host, no_symlinks=b.no_symlinks)) for b in spec.binds]
    _detach_hidden(_needed_paths(spec))
    mounts.mount_tmpfs("/run", "mode=0755")
    mounts.mount_tmpfs("/tmp", "mode=1777")
    devices.build_dev()
    for bind, tree in trees:
        target = Path(bind.target)
        if stat.S_ISDIR(os.fstat(tree).st_mode):  # what was cloned, not what the path is now
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        mounts.attach_tree(tree, target)
        os.close(tree)
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
    seccomp.refuse_io_uring()  # CRIU cannot dump an io_uring; libraries fall back without
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
