"""Finding an activation's cgroup by its name, where no record keeps its directories: a parked
copy's record names its activation and its tree, not its cgroup, and ``pool ls`` and the
agent's ``/metrics`` show the cgroup's use and limit all the same.

The directories are where :func:`~snapctl.cgroups.group.create_cgroup` makes them for the
name (under the ``snapctl`` parents of this process's layout: the agent forks every parked
copy's supervisor, so theirs is the same); the path is the one ``/proc/PID/cgroup`` names for
a process of the tree, so that it is shown as ``ps`` shows an activation's.
"""

from __future__ import annotations

from pathlib import Path

from snapctl.cgroups.group import ActivationCgroup, own_pid_cgroup
from snapctl.cgroups.layout import CGROUP_ROOT, UNIFIED, Layout, cgroup_paths, detect_layout


def proc_cgroup_path(text: str, key: str) -> str | None:
    """The cgroup path of hierarchy ``key`` (``unified`` for v2, else a v1 controller) in
    ``text``, a ``/proc/PID/cgroup``; None where it names none."""
    return cgroup_paths(text).get(key)


def cgroup_named(
    name: str,
    pid: int,
    *,
    root: Path = CGROUP_ROOT,
    layout: Layout | None = None,
    proc_cgroup: str | None = None,
) -> ActivationCgroup | None:
    """The cgroup ``name`` that process ``pid`` is in; None where there is none of that name
    (no usable hierarchy, none made) or ``pid`` is not in it (gone, or never entered). Its
    limits are what its files say (:meth:`~ActivationCgroup.memory_limit_bytes`), not the
    ones it was made with. ``proc_cgroup``: the text of ``/proc/PID/cgroup`` (read when
    None)."""
    layout = layout or detect_layout(root)
    if layout is None:
        return None
    dirs = {key: parent / name for key, parent in layout.parents.items()}
    dirs = {key: directory for key, directory in dirs.items() if directory.is_dir()}
    key = UNIFIED if UNIFIED in dirs else "memory" if "memory" in dirs else None
    if key is None:
        return None
    text = own_pid_cgroup(pid) if proc_cgroup is None else proc_cgroup
    path = proc_cgroup_path(text, key)
    if path is None or path.rstrip("/").rsplit("/", 1)[-1] != name:
        return None
    return ActivationCgroup(dirs=dirs, path=path)
