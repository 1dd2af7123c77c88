"""The agent's Prometheus metrics (``GET /metrics``): copies served and where from, phase
durations, donors and bakes served, failures by phase, the warm pool's size, memory and churn,
each activation's memory, its cgroup's charge and limit, what the host's KSM saves, and TCP
connections refused at the listeners' limits.

One private registry per agent (not prometheus_client's global one, so tests can run several);
the pool's gauges are read from :meth:`WarmPool.listing` at scrape time, never cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from snapctl.pool import PoolListing
from snapctl.pool.models import DiscardReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# From a pool activation's few milliseconds to a large plain restore's seconds.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 300.0)  # fmt: skip


class _PoolCollector(Collector):
    def __init__(self, listing: Callable[[], PoolListing | None]) -> None:
        self._listing = listing

    def collect(self) -> Iterator[GaugeMetricFamily]:
        listing = self._listing()
        target = GaugeMetricFamily(
            "snapctl_pool_target_size", "Parked copies the pool keeps per image.", labels=["image"]
        )
        parked = GaugeMetricFamily(
            "snapctl_pool_parked", "Parked copies now, by image and state.",
            labels=["image", "state"],
        )  # fmt: skip
        memory = GaugeMetricFamily(
            "snapctl_pool_memory_bytes", "Memory (PSS) the parked copies hold, by image.",
            labels=["image"],
        )  # fmt: skip
        charged = GaugeMetricFamily(
            "snapctl_pool_cgroup_memory_bytes", "What the parked copies' own cgroups are "
            "charged together (every page, shared ones included), by image.", labels=["image"],
        )  # fmt: skip
        limit = GaugeMetricFamily(
            "snapctl_pool_copy_memory_limit_bytes", "Each parked copy's cgroup memory limit "
            "(pool set --memory), by image.", labels=["image"],
        )  # fmt: skip
        for entry in listing.entries if listing is not None else ():
            image = entry.target.image
            target.add_metric([image], entry.target.size)
            memory.add_metric([image], entry.memory_bytes)
            if entry.target.memory_bytes is not None:
                limit.add_metric([image], entry.target.memory_bytes)
            charges = [row.cgroup_memory_bytes for row in entry.parked if row.cgroup]
            if charges:
                charged.add_metric([image], sum(charge or 0 for charge in charges))
            states: dict[str, int] = {}
            for row in entry.parked:
                states[row.state] = states.get(row.state, 0) + 1
            for state, count in sorted(states.items()):
                parked.add_metric([image, state], count)
        yield target
        yield parked
        yield memory
        yield charged
        yield limit
        ksm = listing.ksm if listing is not None else None
        if ksm is not None:
            yield GaugeMetricFamily(
                "snapctl_ksm_running", "Whether the host's ksmd merges identical pages.",
                value=int(ksm.running),
            )  # fmt: skip
            yield GaugeMetricFamily(
                "snapctl_ksm_saved_bytes", "Memory the host saves by pages copies share (KSM's "
                "general profit).", value=ksm.saved_bytes,
            )  # fmt: skip


class _ActivationCollector(Collector):
    def __init__(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memory = GaugeMetricFamily(
            "snapctl_activation_memory_bytes", "Memory (PSS) of each running activation's tree.",
            labels=["name", "kind"],
        )  # fmt: skip
        charged = GaugeMetricFamily(
            "snapctl_activation_cgroup_memory_bytes", "What each activation's own cgroup is "
            "charged (every page of its tree, shared ones included).", labels=["name", "kind"],
        )  # fmt: skip
        limit = GaugeMetricFamily(
            "snapctl_activation_cgroup_memory_limit_bytes", "Each running activation's cgroup "
            "memory limit (--memory; none: unlimited).", labels=["name", "kind"],
        )  # fmt: skip
        for row in self._rows():
            labels = [row["name"], row["kind"]]
            if row.get("memory_bytes") is not None:
                memory.add_metric(labels, row["memory_bytes"])
            if row.get("cgroup_memory_bytes") is not None:
                charged.add_metric(labels, row["cgroup_memory_bytes"])
            if row.get("running") and row.get("memory_limit_bytes") is not None:
                limit.add_metric(labels, row["memory_limit_bytes"])
        yield memory
        yield charged
        yield limit


class AgentMetrics:
    """The counters and histograms the agent updates, and the pool's events (it is the
    :class:`snapctl.pool.PoolEvents` the agent hands its pool)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.copies = Counter(
            "snapctl_copies_started", "Copies served, by source (pool: a parked copy was "
            "activated; restore: restored for the request).", ["source"], registry=self.registry,
        )  # fmt: skip
        self.phases = Histogram(
            "snapctl_copy_phase_seconds", "Duration of each phase of a served copy.",
            ["phase", "source"], buckets=PHASE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "snapctl_copy_request_seconds", "A copy request from its arrival to its report.",
            ["source"], buckets=PHASE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.failures = Counter(
            "snapctl_failures", "Failed copy requests and pool restores, by phase.",
            ["phase", "what"], registry=self.registry,
        )  # fmt: skip
        self.parked_total = Counter(
            "snapctl_pool_parked_copies", "Copies the pool restored and parked.",
            registry=self.registry,
        )  # fmt: skip
        self.park_seconds = Histogram(
            "snapctl_pool_park_seconds", "From a pool restore's start to its copy parked.",
            buckets=PHASE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.taken_total = Counter(
            "snapctl_pool_taken", "Parked copies taken for a request.", registry=self.registry
        )
        self.discarded_total = Counter(
            "snapctl_pool_discarded", "Parked copies discarded, by reason.", ["reason"],
            registry=self.registry,
        )  # fmt: skip
        self.captures = Counter(
            "snapctl_captures", "Donor and bake requests served (the image published), by "
            "kind.", ["kind"], registry=self.registry,
        )  # fmt: skip
        self.capture_seconds = Histogram(
            "snapctl_capture_request_seconds", "A donor or bake request from its arrival to its "
            "report.", ["kind"], buckets=PHASE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tcp_refused = Counter(
            "snapctl_agent_tcp_refused", "TCP connections answered 503 at a limit, by listener "
            "and limit (listener: all its slots taken; address: that client's share).",
            ["listener", "limit"], registry=self.registry,
        )  # fmt: skip
        self._listing: Callable[[], PoolListing | None] = lambda: None
        self.registry.register(_PoolCollector(lambda: self._listing()))
        self._activations: Callable[[], list[dict[str, Any]]] = list
        self.registry.register(_ActivationCollector(lambda: self._activations()))

    def watch_pool(self, listing: Callable[[], PoolListing | None]) -> None:
        """Read the pool's gauges from ``listing()`` at each scrape."""
        self._listing = listing

    def watch_activations(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        """Read each activation's memory from ``rows()`` (``ps --json``'s) at each scrape."""
        self._activations = rows

    def served(self, report: dict[str, Any], *, source: str, seconds: float) -> None:
        """A copy request was served (``report``: one copy's, or ``--count``'s CopiesReport)."""
        copies = report.get("copies", [report])
        self.copies.labels(source=source).inc(len(copies))
        self.request_seconds.labels(source=source).observe(seconds)
        for copy in copies:
            for phase, value in (copy.get("timings_s") or {}).items():
                if isinstance(value, int | float):
                    self.phases.labels(phase=phase, source=source).observe(value)

    def request_failed(self, phase: str | None) -> None:
        self.failures.labels(phase=phase or "unknown", what="copy").inc()

    def captured(self, kind: str, *, seconds: float) -> None:
        """A donor or bake request was served (``kind``: ``donor`` or ``bake``)."""
        self.captures.labels(kind=kind).inc()
        self.capture_seconds.labels(kind=kind).observe(seconds)

    def capture_failed(self, kind: str, phase: str | None) -> None:
        self.failures.labels(phase=phase or "unknown", what=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # PoolEvents: called from the pool's threads; prometheus_client is thread-safe.
    def parked(self, image: str, seconds: float) -> None:
        self.parked_total.inc()
        self.park_seconds.observe(seconds)

    def taken(self, image: str) -> None:
        self.taken_total.inc()

    def discarded(self, image: str, reason: DiscardReason) -> None:
        self.discarded_total.labels(reason=reason).inc()

    def failed(self, image: str, phase: str) -> None:
        self.failures.labels(phase=phase, what="pool").inc()
