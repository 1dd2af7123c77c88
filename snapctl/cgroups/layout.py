"""This host's cgroup hierarchies and where snapctl's cgroups go.

Two layouts: **v2** (``ROOT/cgroup.controllers`` exists: one unified hierarchy with its
controllers), and **v1/hybrid** (``ROOT/memory`` is a v1 hierarchy; a controller-less v2
``unified`` beside it is ignored). snapctl's cgroups live under a ``snapctl`` parent:

- v2: beside snapctl's own cgroup, ``<parent of own>/snapctl/<activation>`` (a cgroup with
  processes cannot hand controllers to its children, so not below its own), or
  ``/snapctl/<activation>`` when snapctl runs in the root cgroup;
- v1: in each of the memory, cpu and pids hierarchies, ``<own>/snapctl/<activation>`` (``own``
  being that hierarchy's line of ``/proc/self/cgroup``), so that the limits of the cgroup
  snapctl was started in still bound them.

``SNAPCTL_CGROUP_PARENT`` (a path inside the hierarchies, such as ``/snapctl``) overrides
where the ``snapctl`` parent is.

Inside a container a hierarchy is often mounted from the container's own cgroup down (the
mount's root, in ``/proc/self/mountinfo``, is that cgroup), while ``/proc/self/cgroup`` names
the full path from the host's root: snapctl's own cgroup is then found below the mount by that
path less the mount's root, and paths are reported as ``/proc/PID/cgroup`` names them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PARENT_NAME = "snapctl"
PARENT_ENV = "SNAPCTL_CGROUP_PARENT"
# The v1 hierarchies an activation's cgroup is made in: memory and cpu for the limits, pids to
# list every process of the activation.
V1_CONTROLLERS = ("memory", "cpu", "pids")
V2_CONTROLLERS = ("memory", "cpu", "pids")
UNIFIED = "unified"


@dataclass(frozen=True)
class Layout:
    """The hierarchies snapctl's cgroups are made in: ``parents`` maps each (``unified`` for
    v2; ``memory``, ``cpu``, ``pids`` for v1) to the directory of its ``snapctl`` parent, and
    ``mounts`` to where that hierarchy is mounted."""

    version: Literal[1, 2]
    parents: dict[str, Path]
    mounts: dict[str, Path]
    # The cgroup each mount shows at its top, where that is not the hierarchy's root.
    roots: dict[str, str] = field(default_factory=dict)

    def cgroup_path(self, key: str, directory: Path) -> str:
        """``directory`` (in the hierarchy ``key``) as ``/proc/PID/cgroup`` names it."""
        inside = str(directory.relative_to(self.mounts[key]))
        base = self.roots.get(key, "/").rstrip("/")
        return f"{base}/{inside}" if inside != "." else base or "/"


def cgroup_paths(text: str) -> dict[str, str]:
    """A ``/proc/PID/cgroup``'s lines: each v1 controller (``name=systemd`` too), and
    :data:`UNIFIED` for v2, to the process's cgroup path there."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [UNIFIED]:
            paths[controller] = parts[2]
    return paths


def _inside(mount: Path, path: str) -> Path:
    return mount / path.strip("/") if path.strip("/") else mount


def mount_roots(root: Path = CGROUP_ROOT, mountinfo: str | None = None) -> dict[str, str]:
    """The cgroup at the top of each cgroup mount under ``root`` that is not the hierarchy's
    own root: ``{"unified" or controller directory name: path}`` (from ``mountinfo``'s text,
    read from ``/proc/self/mountinfo`` when None)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return {}
    roots: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        fstype = fields[fields.index("-") + 1]
        if fstype not in ("cgroup", "cgroup2") or fields[3] == "/":
            continue
        point = Path(fields[4])
        if point == root:
            roots[UNIFIED] = fields[3]
        elif point.parent == root:
            # A v1 hierarchy of several controllers is mounted once (cpu,cpuacct).
            for name in point.name.split(","):
                roots[name] = fields[3]
    return roots


def _below_root(own: str, mount_root: str) -> str:
    """``own`` (a /proc/self/cgroup path) inside a mount whose top is ``mount_root``; the
    mount's top where ``own`` is not below it (a cgroup namespace shows paths from its own
    root, which then is the mount's)."""
    if mount_root in ("", "/"):
        return own
    if own == mount_root or own.startswith(mount_root.rstrip("/") + "/"):
        return own[len(mount_root.rstrip("/")) :] or "/"
    return "/"


def detect_layout(
    root: Path = CGROUP_ROOT,
    self_cgroup: str | None = None,
    parent: str | None = None,
    mountinfo: str | None = None,
) -> Layout | None:
    """This host's layout, or None where no cgroup hierarchy snapctl can use is mounted.
    ``self_cgroup``: the text of ``/proc/self/cgroup`` (read when None); ``parent``: where
    the ``snapctl`` parent goes (else ``SNAPCTL_CGROUP_PARENT``, else as the module says);
    ``mountinfo``: the text of ``/proc/self/mountinfo`` (read when None)."""
    if self_cgroup is None:
        try:
            self_cgroup = PROC_SELF_CGROUP.read_text()
        except OSError:
            return None
    roots = mount_roots(root, mountinfo)
    own = {
        controller: _below_root(path, roots.get(controller, "/"))
        for controller, path in cgroup_paths(self_cgroup).items()
    }
    parent = parent or os.environ.get(PARENT_ENV) or None
    if (root / "cgroup.controllers").is_file():
        mine = own.get(UNIFIED, "/")
        if parent is None:
            base = str(Path(mine).parent) if mine.strip("/") else "/"
            parent = f"{base.rstrip('/')}/{PARENT_NAME}"
        return Layout(
            version=2,
            parents={UNIFIED: _inside(root, parent)},
            mounts={UNIFIED: root},
            roots={k: v for k, v in roots.items() if k == UNIFIED},
        )
    if not (root / "memory" / "cgroup.procs").is_file():
        return None
    parents: dict[str, Path] = {}
    mounts: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        mount = root / controller
        if not (mount / "cgroup.procs").is_file():
            continue
        where = parent or f"{own.get(controller, '/').rstrip('/')}/{PARENT_NAME}"
        mounts[controller] = mount
        parents[controller] = _inside(mount, where)
    kept = {k: v for k, v in roots.items() if k in mounts}
    return Layout(version=1, parents=parents, mounts=mounts, roots=kept)
