"""The phases an error names (``SnapctlError.phase``): :class:`HostPhase`, what snapctl itself
was doing, and :class:`Phase`, the server's own, named in ``error.json`` (v1 protocol); a
host-side error raised while waiting on the server in one of those (``capture barrier``,
``recover``, ``serve``) names that one instead. The values are what reports, ``--json`` output
and the CLI's ``[phase: P]`` have always shown. Imports nothing, so every module may use it.
"""

from __future__ import annotations

from enum import StrEnum


class HostPhase(StrEnum):
    """Where on the host a deliberate error happened, in pipeline order."""

    PLAN = "plan"  # a qualification's runs and their arguments
    NAME = "name"  # checking and reserving an activation's --name
    PUBLISH = "publish"  # checking the --publish address and port
    REGISTRY = "registry"  # speaking to an OCI registry (references, credentials, transfers)
    LAUNCH = "launch"  # starting the server for capture, until capture-ready.json
    REFERENCE = "reference"  # the qualification's ordinary (never captured) start
    INVENTORY = "inventory"  # checking the tree holds nothing CRIU cannot dump
    NATIVE = "native"  # the device step (cuda-checkpoint) before a dump or after a restore
    CAPTURE = "capture"  # the native step, CRIU dump and publication of an image
    IMAGE = "image"  # staging, publishing, opening or holding an image directory
    VERIFY = "verify"  # checking an image's hashes before a restore
    IDENTITY = "identity"  # comparing this host with the image's identity; --allow-mismatch
    RESTORE = "restore"  # CRIU restore into fresh namespaces
    LAZY_PAGES = "lazy-pages"  # the lazy-pages daemon and its page transfer
    POOL = "pool"  # the warm pool: a parked copy's restore ahead of time, its order, its image
    SUPERVISE = "supervise"  # starting a copy's supervisor for the agent, until it reported
    CLEANUP = "cleanup"  # stopping and removing what a command started


class Phase(StrEnum):
    """Phases named in ``error.json``. Finer recovery phases share the ``recovery:`` prefix."""

    INITIALIZE_ENGINE = "initialize engine"
    PREPARE = "prepare"
    CAPTURE_BARRIER = "capture barrier"
    RECOVER = "recover"
    RECOVERY_RESTORE_MEMORY = "recovery: restore memory"
    RECOVERY_CANARY = "recovery: canary"
    SERVE = "serve"


def phase_named(value: object) -> HostPhase | Phase | None:
    """The phase an error named on the wire (its value), as the enum it was; None for none or
    for one this version does not know."""
    if isinstance(value, str):
        for kind in (HostPhase, Phase):
            try:
                return kind(value)
            except ValueError:
                continue
    return None
