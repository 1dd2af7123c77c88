"""``snapctl gc``: everything a state directory's garbage collection does, in one pass over the
activations (:mod:`snapctl.activation.supervise`), the leftovers of killed snapctl processes
(:mod:`snapctl.supervision.leftovers`) and the pool's parked copies (:mod:`snapctl.pool.records`).
Above all three, so that none of them imports another's cleanup."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from snapctl.activation.supervise import (
    CollectedActivation,
    collect_orphans,
    starting_names,
    sweep_creating,
    sweep_stale_records,
)
from snapctl.cgroups import sweep_cgroups
from snapctl.cgroups.sweep import GRACE_S as CGROUP_GRACE_S
from snapctl.pool.records import load_parked_records, sweep_parked
from snapctl.statedir import StateDir
from snapctl.supervision.leftovers import sweep_claims, sweep_records


class GarbageReport(BaseModel):
    """What one ``snapctl gc`` cleaned up: orphaned activations, and the leftovers of killed
    snapctl processes outside them (staging directories, records' .tmp files)."""

    model_config = ConfigDict(extra="forbid")

    activations: list[CollectedActivation]
    removed: list[str]
    # Names reserved by a live start that has no record yet: not garbage, left alone (``snapctl
    # stop NAME`` stops one); a warm pool's parked copies are not listed.
    starting: list[str] = []

    @property
    def clean(self) -> bool:
        return all(entry.audit.clean for entry in self.activations)


def collect_garbage(
    state: StateDir, stop_timeout_s: float = 10.0, cgroup_grace_s: float = CGROUP_GRACE_S
) -> GarbageReport:
    """Everything ``snapctl gc`` does: orphaned activations first (which drops their records),
    then what killed processes left elsewhere, only where no live process owns it: last, the
    empty snapctl cgroups of activations that no longer exist here."""
    activations = collect_orphans(state, stop_timeout_s)
    removed = sweep_creating(state) + sweep_stale_records(state)
    removed += sweep_claims(state.claims) + sweep_records(state.records)
    removed += sweep_parked(state)
    live = {r.activation_id for r in state.load_records()}
    if state.activations.is_dir():
        live.update(path.name for path in state.activations.iterdir())
    prefix = state.cgroup_prefix
    removed += sweep_cgroups({prefix + name for name in live}, prefix=prefix,
                             grace_s=cgroup_grace_s)  # fmt: skip
    parked = frozenset(
        record.supervisor_pid for _, record in load_parked_records(state) if record is not None
    )
    starting = starting_names(state, exclude_pids=parked)
    return GarbageReport(activations=activations, removed=removed, starting=starting)
