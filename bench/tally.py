"""Samples gathered into figures, and the targets judged from them: ratios of medians
measured in the same run, never against figures from another run."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from bench.results import Figure, Target, Unit, judge

if TYPE_CHECKING:
    from bench.plan import Plan


class Recorder:
    """Collects samples into figures keyed by (metric, contender, size)."""

    def __init__(self) -> None:
        self._samples: dict[tuple[str, str, int | None], list[float]] = {}
        self._units: dict[str, Unit] = {}

    def add(
        self, metric: str, contender: str, size_mb: int | None, value: float, unit: Unit
    ) -> None:
        self._samples.setdefault((metric, contender, size_mb), []).append(round(value, 6))
        self._units[metric] = unit

    def median(self, metric: str, contender: str, size_mb: int | None = None) -> float:
        return statistics.median(self._samples[(metric, contender, size_mb)])

    def has(self, metric: str, contender: str, size_mb: int | None = None) -> bool:
        return (metric, contender, size_mb) in self._samples

    def figures(self) -> list[Figure]:
        return [
            Figure(metric=m, contender=c, size_mb=s, unit=self._units[m], samples=v)
            for (m, c, s), v in self._samples.items()
        ]


def judge_targets(rec: Recorder, plan: Plan) -> list[Target]:
    """Every target, judged on medians of this run (a target without its figures is left out)."""
    found: list[Target] = []
    snap = next((c.name for c in plan.contenders if c.name.startswith("snapctl")), None)
    for size in plan.sizes_mb:
        if (
            snap
            and rec.has("validated_s", snap, size)
            and rec.has("validated_s", "bare CRIU", size)
        ):
            ratio = rec.median("validated_s", snap, size) / rec.median(
                "validated_s", "bare CRIU", size
            )
            found.append(
                judge(f"copy restore-to-validated / bare CRIU, {size} MB", ratio, 1.3, "x", "<=")
            )
        if snap and rec.has("restore_MBps", snap, size):
            ratio = rec.median("restore_MBps", snap, size) / rec.median(
                "read_MBps", "page cache -> reused buffer", size
            )
            found.append(
                judge(f"restore throughput / page-cache read, {size} MB", ratio, 0.5, "x", ">=")
            )
    for size in plan.donor_sizes_mb:
        ratio = rec.median("frozen_s", "snapctl donor", size) / rec.median(
            "frozen_s", "bare CRIU dump", size
        )
        found.append(judge(f"donor frozen time / bare CRIU dump, {size} MB", ratio, 1.1, "x", "<="))
    if snap:
        handshakes = [
            v for f in rec.figures() if f.metric == "handshake_ms" and f.contender == snap
            for v in f.samples
        ]  # fmt: skip
        if handshakes:
            found.append(
                judge(
                    "handshake (activation -> validated)",
                    statistics.median(handshakes),
                    20,
                    "ms",
                    "<=",
                )
            )
    found.append(
        judge(
            "snapctl --help",
            rec.median("cli_start_s", "snapctl --help") * 1000,
            150,
            "ms",
            "<=",
        )
    )
    found += _lazy_targets(rec, plan)
    counts = plan.concurrency
    if 1 in counts and max(counts) > 1:
        most, size = max(counts), plan.concurrency_mb
        ratio = rec.median("concurrent_total_s", f"{most} at once", size) / rec.median(
            "concurrent_total_s", "1 at once", size
        )
        found.append(judge(f"{most} concurrent copies / one copy", ratio, float(most), "x", "<"))
    return found


PLAIN, LAZY = "snapctl copy", "snapctl copy --lazy"


def _lazy_targets(rec: Recorder, plan: Plan) -> list[Target]:
    """Lazy against plain: at the largest size a lazy copy answers correctly within 0.15 s and
    at least 8x sooner than a plain copy of the same run; at every size its last page arrives
    no later than a plain restore's."""
    found: list[Target] = []
    sizes = [
        s for s in plan.sizes_mb if rec.has("ready_s", LAZY, s) and rec.has("ready_s", PLAIN, s)
    ]
    if sizes:
        size = max(sizes)
        lazy = rec.median("ready_s", LAZY, size)
        name = f"lazy copy: first correct completion, {size} MB"
        found.append(judge(name, lazy, 0.15, "s", "<="))
        found.append(
            judge(
                f"plain / lazy copy: first correct completion, {size} MB",
                rec.median("ready_s", PLAIN, size) / lazy,
                8.0,
                "x",
                ">=",
            )
        )
    for size in plan.sizes_mb:
        if rec.has("pages_present_s", LAZY, size) and rec.has("pages_present_s", PLAIN, size):
            ratio = rec.median("pages_present_s", LAZY, size) / rec.median(
                "pages_present_s", PLAIN, size
            )
            found.append(
                judge(f"lazy / plain copy: all pages present, {size} MB", ratio, 1.0, "x", "<=")
            )
    return found
