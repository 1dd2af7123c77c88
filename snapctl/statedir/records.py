"""The record ``snapctl ps``/``stop``/``logs`` keep of each activation (``records/NAME.json``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ActivationRecord(BaseModel):
    """What ``snapctl ps``/``stop``/``logs`` know of a running activation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    name: str
    activation_id: str
    kind: str
    image: str | None
    root_pid: int
    root_start_time: float
    supervisor_pid: int
    supervisor_start_time: float
    activation_dir: str
    logs_dir: str
    host: str | None
    port: int
    published: str | None
    created: str
    # A lazy copy: its lazy-pages daemon (stopped with the copy), and whether every page has
    # arrived (None: not lazy; False: still transferring; True since pages_complete_at, which
    # was pages_complete_s after the restore started).
    lazy: bool = False
    lazy_pages_pid: int | None = None
    lazy_pages_start_time: float | None = None
    pages_complete: bool | None = None
    pages_complete_s: float | None = None
    pages_complete_at: str | None = None
    # Its cgroup (snapctl.cgroups): the path as /proc/PID/cgroup names it, its directory in
    # each hierarchy, and the limits set there (None: none).
    cgroup: str | None = None
    cgroup_dirs: dict[str, str] = {}
    memory_limit_bytes: int | None = None
    cpus: float | None = None


class StopOutcome(BaseModel):
    """How an activation ended (``logs/ID/stopped.json``), kept by whichever process stopped
    it, before its record is dropped: a foreground ``snapctl copy`` through the agent reads it
    when the copy's own supervisor stopped it first (its tree exited, or was killed as unsafe),
    to report as the in-process command reports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    name: str
    stopped: str  # how the tree ended: exited, terminated, killed (or why it could not be)
    audit: dict[str, list[int] | list[str]]  # CleanupAudit as JSON
    # Why it was stopped behind its user's back (Session.failure), or None.
    failure: str | None = None
