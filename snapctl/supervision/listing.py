"""``snapctl ps``'s rows: each activation record, whether its tree and its supervisor still
run, and what its tree holds in memory (PSS: pages shared with other copies count once among
them); the agent answers ``GET /v1/activations`` with the same rows."""

from __future__ import annotations

from typing import Any

from snapctl.cgroups import ActivationCgroup
from snapctl.statedir import StateDir
from snapctl.supervision.memory import tree_memory
from snapctl.supervision.process import is_same_process


def activation_rows(state: StateDir) -> list[dict[str, Any]]:
    """``ps --json``: the records in ``state`` (by name), each with ``running`` (its tree),
    ``supervised`` (its supervisor), ``memory_bytes`` (its tree's PSS; None when gone) and
    ``ksm_saved_bytes`` (what KSM saves in it: pages merged with other copies' and the host's);
    its cgroup (``cgroup``, ``memory_limit_bytes``, ``cpus``, from the record) and what the
    cgroup charges (``cgroup_memory_bytes``: every page of the tree, shared ones included)."""
    rows = []
    for record in state.load_records():
        running = is_same_process(record.root_pid, record.root_start_time)
        memory = tree_memory(record.root_pid, record.root_start_time) if running else None
        rows.append({
            **record.model_dump(mode="json"),
            "running": running,
            "supervised": is_same_process(record.supervisor_pid, record.supervisor_start_time),
            "memory_bytes": None if memory is None else memory.pss_bytes,
            "ksm_saved_bytes": None if memory is None else memory.ksm_saved_bytes,
            "cgroup_memory_bytes": _cgroup_memory(record.cgroup, record.cgroup_dirs),
        })  # fmt: skip
    return rows


def _cgroup_memory(path: str | None, dirs: dict[str, str]) -> int | None:
    if path is None or not dirs:
        return None
    return ActivationCgroup.from_record(path, dirs).memory_bytes()
