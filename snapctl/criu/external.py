"""Host mounts that CRIU cannot dump, recorded as external mounts instead.

CRIU dumps tmpfs and the pseudo filesystems itself, and takes the namespace's root mount as
it is; any other mount it refuses ("FS mnt ... unsupported"): a squashfs driver tree such as
``/usr/local/nvidia``, a data disk, NFS. A sandbox sees the host's mounts at the same paths,
so each such mount is dumped as external under a ``host:`` key and a restore binds the host's
own mount back at that path. A host path the sandbox binds in under its private /tmp (the
server's model directory, say) is recorded the same way. Mounts every sandbox hides (host
runtime state under /run, nsfs; see ``snapctl.namespaces.hostview``) are never recorded.
That is safe for the files a server uses: the image's identity already records their sha256,
and a copy is refused before CRIU runs when one differs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.namespaces.hostview import HostMount, always_hidden
from snapctl.namespaces.mounts import mountinfo

# The filesystems CRIU 4.2 dumps and restores itself (criu/filesystems.c's fstypes).
CRIU_DUMPS = frozenset(
    {
        "proc", "sysfs", "devtmpfs", "binfmt_misc", "tmpfs", "devpts", "simfs", "pstore",
        "securityfs", "fusectl", "debugfs", "tracefs", "cgroup", "cgroup2", "aufs", "mqueue",
        "fuse", "overlay", "autofs", "bpf",
    }
)  # fmt: skip
HOST_KEY_PREFIX = "host:"


class HostMountMissing(SnapctlError):
    """An image needs a host mount that this machine does not have."""

    exit_status = ExitStatus.UNAVAILABLE


def host_key(mount_point: str) -> str:
    return HOST_KEY_PREFIX + mount_point


def is_host_key(key: str) -> bool:
    return key.startswith(HOST_KEY_PREFIX)


def undumpable(entries: Iterable[tuple[str, str]], skip: Iterable[str] = ()) -> dict[str, str]:
    """``{key: mount point}`` for the (mount point, filesystem type) ``entries`` that CRIU
    would refuse, other than the root, the mount points in ``skip`` and any mount every
    sandbox hides (``hostview.always_hidden``): such a mount is never recorded, so if one were
    still there the dump would fail on it rather than publish an image no restore can bind."""
    skipped = {"/", *skip}
    return {
        host_key(point): point
        for point, fstype in entries
        if point not in skipped
        and fstype not in CRIU_DUMPS
        and not always_hidden(HostMount(point, fstype))
    }


def undumpable_mounts(pid: int, skip: Iterable[str] = ()) -> dict[str, str]:
    """:func:`undumpable` for the mounts ``pid`` sees (``skip``: snapctl's own, already
    external)."""
    return undumpable(mountinfo(pid), skip)


def sandbox_external_mounts(
    pid: int, own: Mapping[str, str], host_binds: Iterable[str]
) -> dict[str, str]:
    """Every mount a capture of the sandbox whose root is ``pid`` declares external: snapctl's
    ``own`` keys, each host path the sandbox binds in (``host:PATH``, whatever its filesystem:
    a tmpfs would otherwise be tarred into the image) and each other mount CRIU cannot dump."""
    binds = {host_key(path): path for path in host_binds}
    return {**own, **binds, **undumpable_mounts(pid, skip=[*own.values(), *binds.values()])}


def host_mounts(external_mounts: Mapping[str, str]) -> list[str]:
    """The host mount points an image binds back (its ``host:`` external mounts)."""
    return [point for key, point in external_mounts.items() if is_host_key(key)]


def host_mount_sources(external_mounts: Mapping[str, str]) -> dict[str, Path]:
    """For a restore: the host path to bind for each ``host:`` key of an image (the same
    path it had in the donor's sandbox), checked to exist."""
    sources: dict[str, Path] = {}
    for point in host_mounts(external_mounts):
        if not Path(point).exists():
            raise HostMountMissing(
                f"the image binds the host's {point} (a mount CRIU cannot dump), which this "
                "machine does not have",
                path=Path(point),
            )
        if os.path.realpath(point) != point:
            # Binding through it would let whoever made the link (under /tmp: anyone) choose
            # what the copy reads at that path.
            raise HostMountMissing(
                f"the image binds the host's {point}, which on this machine is reached "
                f"through a symlink (to {os.path.realpath(point)}): make {point} a plain "
                "directory or file there",
                path=Path(point),
            )
        sources[host_key(point)] = Path(point)
    return sources
