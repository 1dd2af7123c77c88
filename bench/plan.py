"""What a ``python -m bench`` run measures (:class:`Plan`) and its presets: :func:`full`,
:func:`quick` and :func:`tiny` (the smoke test's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.contenders import Contender, default_contenders


@dataclass
class Plan:
    """What to measure; :func:`full`, :func:`quick` and :func:`tiny` are the presets."""

    sizes_mb: list[int]
    reps: int
    donor_sizes_mb: list[int]
    donor_reps: int
    concurrency_mb: int
    concurrency: list[int]
    cli_reps: int
    # Plain and lazy copies started together (first correct completion, all pages present).
    at_once_sizes_mb: list[int] = field(default_factory=list)
    at_once_reps: int = 0
    quick: bool = False
    contenders: list[Contender] = field(default_factory=default_contenders)


def full() -> Plan:
    return Plan(
        sizes_mb=[64, 512, 2048], reps=7, donor_sizes_mb=[64, 512, 2048], donor_reps=5,
        concurrency_mb=512, concurrency=[1, 2, 4], cli_reps=10,
        at_once_sizes_mb=[64, 512, 2048], at_once_reps=3,
    )  # fmt: skip


def quick() -> Plan:
    return Plan(
        sizes_mb=[64], reps=3, donor_sizes_mb=[64], donor_reps=2, concurrency_mb=64,
        concurrency=[1, 2, 4], cli_reps=5, at_once_sizes_mb=[64], at_once_reps=1, quick=True,
    )  # fmt: skip


def tiny() -> Plan:
    """The smoke test's plan: every measurement once, at a size that restores in a blink."""
    return Plan(
        sizes_mb=[8], reps=1, donor_sizes_mb=[8], donor_reps=1, concurrency_mb=8,
        concurrency=[1, 2], cli_reps=1, at_once_sizes_mb=[8], at_once_reps=1, quick=True,
    )  # fmt: skip
