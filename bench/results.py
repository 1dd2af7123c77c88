"""The benchmark's one output format (``--json``, and the input of the docs writer): strict
pydantic models for the machine, the run's settings, every figure with its samples, and the
targets judged as ratios measured in the same run."""

from __future__ import annotations

import statistics
from typing import Literal

from pydantic import Field

from snapctl.models import StrictModel

Unit = Literal["s", "ms", "MB/s", "x"]


class Machine(StrictModel):
    """Where the figures were measured (they mean little without it)."""

    cpu: str
    cores: int
    memory_gib: float
    kernel: str
    python: str
    criu: str
    load_average: tuple[float, float, float]
    date: str


class Settings(StrictModel):
    """What was measured and how often."""

    quick: bool
    sizes_mb: list[int]
    reps: int
    concurrency_mb: int
    concurrency: list[int]
    donor_sizes_mb: list[int]
    donor_reps: int
    cli_reps: int
    contenders: list[str]
    # Plain and lazy copies started together at these sizes (absent in older runs).
    at_once_sizes_mb: list[int] = []
    at_once_reps: int = 0


class Figure(StrictModel):
    """One quantity for one contender (and size), with every sample kept."""

    metric: str
    contender: str
    size_mb: int | None = None
    unit: Unit
    samples: list[float] = Field(min_length=1)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)


class Target(StrictModel):
    """A goal stated as a ratio (or a bound) and whether this run met it."""

    name: str
    measured: float
    limit: float
    unit: Unit
    comparison: Literal["<=", ">=", "<"]
    met: bool
    note: str = ""


class Results(StrictModel):
    """Everything one ``python -m bench`` run measured."""

    schema_version: Literal[1] = 1
    machine: Machine
    settings: Settings
    figures: list[Figure]
    targets: list[Target]
    wall_s: float
    # Timed starts that failed and were retried once (each a one-line reason).
    failures: list[str] = []

    def find(self, metric: str, contender: str, size_mb: int | None = None) -> Figure | None:
        for figure in self.figures:
            if (figure.metric, figure.contender, figure.size_mb) == (metric, contender, size_mb):
                return figure
        return None


def judge(
    name: str, measured: float, limit: float, unit: Unit, comparison: Literal["<=", ">=", "<"]
) -> Target:
    met = {
        "<=": measured <= limit,
        ">=": measured >= limit,
        "<": measured < limit,
    }[comparison]
    return Target(
        name=name, measured=measured, limit=limit, unit=unit, comparison=comparison, met=met
    )
