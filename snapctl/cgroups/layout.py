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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def _own_paths(text: str) -> dict[str, str]:
    """``/proc/self/cgroup``'s lines: each controller (``""`` for v2) to its cgroup path."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            own[controller] = parts[2]
    return own


def _inside(mount: Path, path: str) -> Path:
    return mount / path.strip("/") if path.strip("/") else mount


def detect_layout(
    root: Path = CGROUP_ROOT, self_cgroup: str | None = None, parent: str | None = None
) -> Layout | None:
    """This host's layout, or None where no cgroup hierarchy snapctl can use is mounted.
    ``self_cgroup``: the text of ``/proc/self/cgroup`` (read when None); ``parent``: where
    the ``snapctl`` parent goes (else ``SNAPCTL_CGROUP_PARENT``, else as the module says)."""
    if self_cgroup is None:
        try:
            self_cgroup = PROC_SELF_CGROUP.read_text()
        except OSError:
            return None
    own = _own_paths(self_cgroup)
    parent = parent or os.environ.get(PARENT_ENV) or None
    if (root / "cgroup.controllers").is_file():
        mine = own.get("", "/")
        if parent is None:
            base = str(Path(mine).parent) if mine.strip("/") else "/"
            parent = f"{base.rstrip('/')}/{PARENT_NAME}"
        return Layout(version=2, parents={UNIFIED: _inside(root, parent)}, mounts={UNIFIED: root})
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
    return Layout(version=1, parents=parents, mounts=mounts)
