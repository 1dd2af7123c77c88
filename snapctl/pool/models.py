"""The pool's wire and file formats: a copy request (everything ``snapctl copy`` takes), the
capture requests (``snapctl donor``, ``snapctl bake``), the rows of ``pool ls``, a parked
copy's record, and what adoption found. Pydantic only: the
agent types its API with these, and nothing here starts anything."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from snapctl.activation.timeouts import READY_TIMEOUT_S, SERVER_TIMEOUT_S, positive_seconds
from snapctl.models import StrictModel
from snapctl.statedir.names import NAME_PATTERN
from snapctl.supervision.memory import KsmStatus

PARKED_ID_PATTERN = r"^pool-[0-9a-f]{12}$"
ParkedState = Literal["restoring", "parked"]
DiscardReason = Literal[
    "removed", "replaced", "verification", "memory", "target", "closing", "unvouched", "died"
]


class PublishTarget(StrictModel):
    """``--publish [ADDR:]PORT``: the host address and port (0: any free one)."""

    address: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)


def publish_pair(target: PublishTarget | None) -> tuple[str, int] | None:
    """``target`` as the ``(address, port)`` the activation code takes; None for none."""
    return None if target is None else (target.address, target.port)


class CopyRequest(StrictModel):
    """One ``snapctl copy``, as the CLI parsed it (a registry reference already pulled:
    ``image`` is a published image directory, absolute).

    ``api_key`` is the value of ``api_key_env`` in the client's environment (the probe's
    authenticated GET needs it; the agent's own environment does not have it); never logged.
    ``detach`` is the client's: the copy lives in its own supervisor either way, and without
    it the client stops the copy when it ends.
    """

    version: Literal[1] = 1
    image: str = Field(min_length=1, pattern=r"^/")
    name: str | None = Field(default=None, pattern=f"^{NAME_PATTERN.pattern}$")
    publish: PublishTarget | None = None
    expose: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key: SecretStr | None = None
    lazy: bool | None = None  # None: lazy when the image holds enough pages (as the CLI)
    allow_mismatch: tuple[str, ...] = ()
    count: int = Field(default=1, ge=1, le=64)
    timeout_s: float = 300.0
    native: Literal["none", "cuda-checkpoint"] = "none"
    criu_path: str | None = None
    server_argv: tuple[str, ...] | None = None
    detach: bool = False

    _seconds = field_validator("timeout_s")(positive_seconds)


class BakeRequest(StrictModel):
    """One ``snapctl bake``, as the CLI parsed it, with the client's working directory and
    environment: the server command runs in them (not the agent's), exactly as in-process
    (a relative SERVER_CMD or image path, ``VLLM_*`` settings, the identity's env record).

    ``environ`` may hold any secret (the API key ``api_key_env`` names, tokens): every value
    is a :class:`SecretStr`, masked in every dump, and never logged or echoed in a refusal.
    """

    version: Literal[1] = 1
    image: str = Field(min_length=1, pattern=r"^/")
    force: bool = False
    lo_addresses: tuple[str, ...] = ()
    ready_timeout_s: float = READY_TIMEOUT_S
    server_timeout_s: float = SERVER_TIMEOUT_S
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    timeout_s: float = 300.0
    native: Literal["none", "cuda-checkpoint"] = "none"
    criu_path: str | None = Field(default=None, pattern=r"^/")
    server_argv: tuple[str, ...] | None = None
    cwd: str = Field(min_length=1, pattern=r"^/")
    environ: dict[str, SecretStr]

    _seconds = field_validator("ready_timeout_s", "server_timeout_s", "timeout_s")(positive_seconds)

    @field_validator("environ")
    @classmethod
    def _settable_environ(cls, environ: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # What os.environ refuses, refused here, before anything starts (the supervisor sets
        # them after it cleared its own). Names only in the reason: values may be secrets.
        for name, value in environ.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} is not an environment variable name (empty, or "
                                 "holds '=' or NUL)")  # fmt: skip
            if "\0" in value.get_secret_value():
                raise ValueError(f"the value of {name} holds NUL")
        return environ


class DonorRequest(BakeRequest):
    """One ``snapctl donor``: a bake's fields, and how the donor serves after its capture
    (``detach`` is the client's: the donor lives in its own supervisor either way, and
    without it the client stops the donor when it ends)."""

    name: str | None = Field(default=None, pattern=f"^{NAME_PATTERN.pattern}$")
    publish: PublishTarget | None = None
    expose: bool = False
    detach: bool = False


CaptureRequest = BakeRequest | DonorRequest


class ParkedCopyRow(StrictModel):
    """One parked copy in ``pool ls``."""

    id: str = Field(pattern=PARKED_ID_PATTERN)
    state: ParkedState
    age_s: float
    memory_bytes: int | None  # PSS of its whole tree (RSS where PSS is unreadable); None: gone
    supervisor_pid: int
    root_pid: int | None


class PoolTarget(StrictModel):
    """What the pool keeps for one image: ``size`` parked copies, restored lazily or not,
    within ``max_memory`` bytes (None: no budget) for all of this image's parked copies."""

    image: str = Field(min_length=1, pattern=r"^/")
    size: int = Field(ge=0, le=64)
    lazy: bool | None = None
    max_memory: int | None = Field(default=None, ge=1)


class PoolTargets(StrictModel):
    """``STATE/pool/targets.json``: the pool's targets, kept for the next agent."""

    version: Literal[1] = 1
    targets: tuple[PoolTarget, ...] = ()


class PoolEntry(StrictModel):
    """One image's row in ``pool ls``: its target and the copies parked for it now."""

    target: PoolTarget
    image_id: str | None  # None: the image is not (or no longer) published
    memory_bytes: int
    parked: tuple[ParkedCopyRow, ...]
    last_failure: str | None = None  # the last restore that failed, and why (refill backs off)


class PoolListing(StrictModel):
    """``pool ls --json``."""

    version: Literal[1] = 1
    entries: tuple[PoolEntry, ...]
    memory_bytes: int
    # The host's same-page merging: what copies sharing their pages save (None: no KSM).
    ksm: KsmStatus | None = None


class ParkedRecord(StrictModel):
    """``STATE/pool/<id>/parked.json``: a parked copy's supervisor and tree, so that a new
    agent (or ``gc``) finds it; written by the parked supervisor, dropped when it ends."""

    version: Literal[1] = 1
    id: str = Field(pattern=PARKED_ID_PATTERN)
    state: ParkedState
    image: str
    image_id: str | None  # None until restored (then: what it was restored from)
    manifest_digest: str | None
    lazy: bool
    activation_id: str | None
    supervisor_pid: int
    supervisor_start_time: float
    root_pid: int | None
    root_start_time: float | None
    lazy_pages_pid: int | None = None
    lazy_pages_start_time: float | None = None
    owner_pid: int  # the agent it was parked for: without it, the parked copy discards itself
    owner_start_time: float
    socket: str
    created: str  # ISO 8601, UTC


class DiscardedCopy(StrictModel):
    id: str
    reason: DiscardReason
    processes_ended: tuple[int, ...] = ()


class AdoptionReport(StrictModel):
    """What :meth:`WarmPool.adopt` found at start: the parked copies it discarded (a new agent
    cannot vouch for what an earlier one parked) and what it removed besides."""

    version: Literal[1] = 1
    discarded: tuple[DiscardedCopy, ...]
    removed: tuple[str, ...]


class ActivationOrder(StrictModel):
    """What a parked copy's socket takes, once: activate it for ``request``, or discard it."""

    version: Literal[1] = 1
    action: Literal["activate", "discard"]
    request: CopyRequest | None = None
