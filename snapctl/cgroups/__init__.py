"""Cgroups per activation: every donor, copy and parked copy runs in a cgroup of its own, with
the memory and CPU limits its user asked for (``--memory``, ``--cpus``).

``limits`` owns the limits and their podman spellings; ``layout`` finds the cgroup hierarchies
of this host (v2 unified, or v1/hybrid) and where snapctl's cgroups go; ``group`` creates,
fills, reads and removes one activation's cgroup; ``lookup`` finds one by its name where no
record keeps it (a parked copy's); ``sweep`` is what ``snapctl gc`` removes.
Every function takes the cgroup filesystem's root as a parameter, so tests use a fake tree.
"""

from __future__ import annotations

from snapctl.cgroups.group import ActivationCgroup, CgroupError, CgroupUsage, create_cgroup
from snapctl.cgroups.layout import CGROUP_ROOT, Layout, detect_layout
from snapctl.cgroups.limits import Limits, format_size, parse_cpus, parse_size
from snapctl.cgroups.sweep import sweep_cgroups

__all__ = [
    "CGROUP_ROOT",
    "ActivationCgroup",
    "CgroupError",
    "CgroupUsage",
    "Layout",
    "Limits",
    "create_cgroup",
    "detect_layout",
    "format_size",
    "parse_cpus",
    "parse_size",
    "sweep_cgroups",
]
