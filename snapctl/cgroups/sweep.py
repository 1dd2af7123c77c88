"""What ``snapctl gc`` removes of cgroups: the empty per-activation cgroups under the
``snapctl`` parents that no running activation owns (left by a snapctl process that was killed
before it could remove them). A cgroup with a process in it is never touched, nor one made in
the last :data:`GRACE_S` (an activation of another state directory, about to be entered)."""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

from snapctl.cgroups.group import ActivationCgroup
from snapctl.cgroups.layout import CGROUP_ROOT, Layout, detect_layout

GRACE_S = 60.0


def sweep_cgroups(
    keep: Collection[str],
    *,
    prefix: str = "",
    root: Path = CGROUP_ROOT,
    layout: Layout | None = None,
    grace_s: float = GRACE_S,
) -> list[str]:
    """Remove every empty cgroup under the ``snapctl`` parents whose name starts with
    ``prefix`` (one state directory's) and is not in ``keep``; return the paths removed."""
    layout = layout or detect_layout(root)
    if layout is None:
        return []
    names: set[str] = set()
    for parent in layout.parents.values():
        if parent.is_dir():
            names.update(
                child.name
                for child in parent.iterdir()
                if child.is_dir() and child.name.startswith(prefix)
            )
    removed = []
    for name in sorted(names - set(keep)):
        dirs = {key: parent / name for key, parent in layout.parents.items()}
        present = {key: d for key, d in dirs.items() if d.is_dir()}
        key = next(iter(present))
        group = ActivationCgroup(dirs=present, path=layout.cgroup_path(key, present[key]))
        newest = max(d.stat().st_mtime for d in present.values())
        if group.pids() or time.time() - newest < grace_s:
            continue
        if group.remove(0.0):
            removed.append(f"cgroup {group.path}")
    return removed
