"""The supervisor side of the pool: what runs in a supervisor process the spawner forked (a
fresh copy, a parked copy, a donor, a bake: :func:`run_job`), never in the agent.

The agent imports this package only to hand :func:`run_job` to the spawner before it forks
it (:class:`SupervisorSpawner`), so that a supervisor starts with everything imported. Below
it: :mod:`snapctl.pool.supervisor.common` (shared by the jobs), then
:mod:`~snapctl.pool.supervisor.parked`, then :mod:`~snapctl.pool.supervisor.jobs`; above
nothing of the agent's side (:mod:`snapctl.pool.warm`, :mod:`snapctl.pool.serve`).
"""

from __future__ import annotations

from typing import Self

from snapctl.pool.spawner import JobRunner, Spawner
from snapctl.pool.supervisor.jobs import run_job


class SupervisorSpawner(Spawner):
    """The agent's spawner: its supervisors run :func:`run_job` unless told otherwise."""

    @classmethod
    def start(cls, runner: JobRunner = run_job) -> Self:
        return super().start(runner)


__all__ = ["SupervisorSpawner", "run_job"]
