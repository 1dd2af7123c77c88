"""The sandbox's own ``/dev``: a fresh tmpfs with the device nodes a server uses, as container
runtimes build one, instead of whatever the host mounts there.

CRIU records every mount of the sandbox and a restore rebuilds that tree. A host's ``/dev`` is
a devtmpfs with devpts, mqueue and hugetlbfs below it; a container's is a tmpfs with nodes
made by its runtime; either way an image that kept it would only restore where ``/dev`` is
mounted alike (a copy inside a container could not restore an image baked on its host). Built
here, ``/dev`` is one tmpfs CRIU dumps with its contents and restores as it was, wherever the
copy runs.

The standard nodes are made with mknod (as a rootful runtime does): their numbers are the same
on every Linux. GPU nodes are not made but bound from the host's ``/dev`` and recorded as
external host mounts (``snapctl.criu.external``): some have numbers the driver picks at load
time (``nvidia-uvm``), so a copy must get the restoring machine's own nodes, and one that lacks
them is refused before CRIU runs.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.namespaces import mounts

SANDBOX_DEV = "/dev"
# Small: a few nodes, links and bind targets; /dev/shm is a mount of the activation's own.
DEV_TMPFS_OPTIONS = "mode=0755,size=1m,nr_inodes=1024"
# Not nodev, which would make every node in it unusable.
DEV_TMPFS_FLAGS = mounts.MS_NOSUID | mounts.MS_NOEXEC
# How an image's sandbox had its /dev (the manifest's ``sandbox_dev``): ``host``, the host's
# mounts left in place (images captured before the sandbox built its own); ``own``, built here.
SandboxDev = Literal["host", "own"]
BUILT: SandboxDev = "own"


@dataclass(frozen=True)
class DeviceNode:
    """A character device node made in the sandbox's /dev."""

    name: str
    major: int
    minor: int
    mode: int = 0o666


# The OCI runtime specification's default devices (those every container gets).
STANDARD_NODES = (
    DeviceNode("null", 1, 3),
    DeviceNode("zero", 1, 5),
    DeviceNode("full", 1, 7),
    DeviceNode("random", 1, 8),
    DeviceNode("urandom", 1, 9),
    DeviceNode("tty", 5, 0),
)
STANDARD_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
# Host nodes a sandbox binds in where the host has them (relative to /dev, shell patterns).
HOST_NODE_PATTERNS = ("nvidia*", "nvidia-caps/*", "dri/*")


class DevOps(Protocol):
    """What building /dev does to the world (the real one below; fakes in tests)."""

    def mount_tmpfs(self, target: str, options: str, flags: int) -> None: ...
    def mknod(self, path: str, mode: int, device: int) -> None: ...
    def symlink(self, target: str, path: str) -> None: ...
    def mkdir(self, path: str, mode: int) -> None: ...


class _RealDevOps:
    def mount_tmpfs(self, target: str, options: str, flags: int) -> None:
        mounts.mount_tmpfs(target, options, source="snapctl-dev", flags=flags)

    def mknod(self, path: str, mode: int, device: int) -> None:
        os.mknod(path, mode, device)
        # mknod's mode is masked by the umask; the node's must be exact.
        os.chmod(path, stat.S_IMODE(mode))

    def symlink(self, target: str, path: str) -> None:
        os.symlink(target, path)

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(path, mode)
        os.chmod(path, mode)


REAL_DEV_OPS: DevOps = _RealDevOps()


class DevBuildError(OSError):
    """The sandbox's /dev could not be built; the message names the fix where one is known."""


def build_dev(
    target: str = SANDBOX_DEV,
    *,
    nodes: Iterable[DeviceNode] = STANDARD_NODES,
    links: dict[str, str] | None = None,
    ops: DevOps = REAL_DEV_OPS,
) -> None:
    """Mount a fresh tmpfs at ``target`` (whatever was mounted there must be detached first)
    and make ``nodes`` and ``links`` in it; bind targets (``shm``, GPU nodes) are made by
    whoever binds them."""
    ops.mount_tmpfs(target, DEV_TMPFS_OPTIONS, DEV_TMPFS_FLAGS)
    for node in nodes:
        path = f"{target}/{node.name}"
        try:
            ops.mknod(path, stat.S_IFCHR | node.mode, os.makedev(node.major, node.minor))
        except PermissionError as error:
            # A device cgroup refusing mknod: what a container runtime sets up unless told
            # the container is privileged.
            raise DevBuildError(
                errno.EPERM,
                f"cannot make the sandbox's {path} (mknod: {error.strerror}): snapctl builds "
                "each sandbox's /dev with mknod, which this cgroup's device rules refuse; in a "
                "container, run it with --privileged",
            ) from error
    for name, link in (STANDARD_LINKS if links is None else links).items():
        ops.symlink(link, f"{target}/{name}")


def host_device_nodes(dev: Path = Path(SANDBOX_DEV)) -> list[str]:
    """The host's character devices under ``dev`` that a sandbox binds in
    (``HOST_NODE_PATTERNS``), sorted; none where it has none."""
    found: list[str] = []
    for pattern in HOST_NODE_PATTERNS:
        directory, _, name_pattern = pattern.rpartition("/")
        base = dev / directory if directory else dev
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            if not fnmatch.fnmatch(entry.name, name_pattern):
                continue
            try:
                if stat.S_ISCHR(entry.stat(follow_symlinks=False).st_mode):
                    found.append(entry.path)
            except OSError:
                continue
    return sorted(found)


class DevLayoutError(SnapctlError):
    """An image's sandbox kept the host's /dev, which cannot be rebuilt where a copy runs."""

    exit_status = ExitStatus.UNAVAILABLE


def dev_fstype(mounts_text: str | None = None) -> str | None:
    """What is mounted at /dev in this mount namespace (None: nothing, or unreadable)."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    return mounts.mount_type(mounts_text, SANDBOX_DEV)


def require_restorable_dev(sandbox_dev: SandboxDev, here: str | None) -> None:
    """Refuse, before CRIU runs, an image whose sandbox kept the host's /dev where ``here``
    (this machine's /dev filesystem) is not the devtmpfs CRIU would mount again for it."""
    if sandbox_dev == "host" and here != "devtmpfs":
        raise DevLayoutError(
            "the image was captured by an older snapctl whose sandbox kept the host's /dev (a "
            f"devtmpfs); here /dev is {here or 'not mounted'} (a container's), where CRIU "
            "cannot restore that mount: bake the image again with this snapctl, or restore "
            "it on a host",
            path=Path(SANDBOX_DEV),
        )
