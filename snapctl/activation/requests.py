"""The requests that start something, as every entry builds them (the CLI in-process, the thin
client, the agent, the pool): a copy (:class:`CopyRequest`) and a capture (:class:`BakeRequest`,
:class:`DonorRequest`), with their defaults, and the one translation of each into the
:class:`~snapctl.activation.launch.LaunchOptions` the activation code takes. Pydantic only:
nothing here starts anything."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.timeouts import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    READY_TIMEOUT_S,
    SERVER_TIMEOUT_S,
    positive_seconds,
)
from snapctl.cgroups import Limits
from snapctl.cgroups.limits import MIN_MEMORY_BYTES
from snapctl.models import StrictModel
from snapctl.statedir.names import NAME_PATTERN


class PublishTarget(StrictModel):
    """``--publish [ADDR:]PORT``: the host address and port (0: any free one)."""

    address: str = DEFAULT_HOST
    port: int = Field(ge=0, le=65535)


def publish_pair(target: PublishTarget | None) -> tuple[str, int] | None:
    """``target`` as the ``(address, port)`` the activation code takes; None for none."""
    return None if target is None else (target.address, target.port)


# podman's container names and IDs, and PIDs: a letter or digit, then letters, digits, '_',
# '.', '-' (nothing a shell or a path could read as more).
CONTAINER_REFERENCE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


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
    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key: SecretStr | None = None
    lazy: bool | None = None  # None: lazy when the image holds enough pages (as the CLI)
    allow_mismatch: tuple[str, ...] = ()
    count: int = Field(default=1, ge=1, le=64)
    timeout_s: float = DEFAULT_TIMEOUT_S
    native: Literal["none", "cuda-checkpoint"] = "none"
    criu_path: str | None = Field(default=None, pattern=r"^/")
    server_argv: tuple[str, ...] | None = None
    detach: bool = False
    # The copy's cgroup limits (``--memory``, ``--cpus``; see snapctl.cgroups): None is none.
    memory_bytes: int | None = Field(default=None, ge=MIN_MEMORY_BYTES)
    cpus: float | None = Field(default=None, ge=0.01)
    # Restore inside this running container (its name, ID or first process's PID) and publish
    # on its network (``--into-container``; see snapctl.activation.container). None: here.
    into_container: str | None = Field(default=None, pattern=CONTAINER_REFERENCE)

    _seconds = field_validator("timeout_s")(positive_seconds)

    def launch_options(self) -> LaunchOptions:
        """The restore's and the activation's options (the API key is read from
        ``api_key_env`` in the environment of whoever activates)."""
        return LaunchOptions(
            server_argv=None if self.server_argv is None else list(self.server_argv),
            allow_mismatch=self.allow_mismatch,
            name=self.name,
            host=self.host,
            port=self.port,
            api_key_env=self.api_key_env,
            timeout_s=self.timeout_s,
            limits=Limits(memory_bytes=self.memory_bytes, cpus=self.cpus),
            into_container=self.into_container,
        )


class BakeRequest(StrictModel):
    """One ``snapctl bake``, as the CLI parsed it, with the client's working directory and
    environment: the server command runs in them (not the agent's), exactly as in-process
    (a relative SERVER_CMD or image path, ``VLLM_*`` settings, the identity's env record); the
    server gets the part of it :func:`snapctl.activation.environment.server_environment`
    selects, there as in-process.

    ``environ`` may hold any secret (the API key ``api_key_env`` names, tokens): every value
    is a :class:`SecretStr`, masked in every dump, and never logged or echoed in a refusal.
    """

    version: Literal[1] = 1
    image: str = Field(min_length=1, pattern=r"^/")
    force: bool = False
    lo_addresses: tuple[str, ...] = ()
    ready_timeout_s: float = READY_TIMEOUT_S
    server_timeout_s: float = SERVER_TIMEOUT_S
    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    timeout_s: float = DEFAULT_TIMEOUT_S
    native: Literal["none", "cuda-checkpoint"] = "none"
    criu_path: str | None = Field(default=None, pattern=r"^/")
    server_argv: tuple[str, ...] | None = None
    cwd: str = Field(min_length=1, pattern=r"^/")
    environ: dict[str, SecretStr]
    # What the server gets beyond its minimal environment: ``--env``/``--env-file`` as the
    # client resolved them, and with ``inherit_env`` the whole of ``environ``.
    env: dict[str, SecretStr] = {}
    inherit_env: bool = False
    # The captured server's cgroup limits (``--memory``, ``--cpus``): None is none.
    memory_bytes: int | None = Field(default=None, ge=MIN_MEMORY_BYTES)
    cpus: float | None = Field(default=None, ge=0.01)

    _seconds = field_validator("ready_timeout_s", "server_timeout_s", "timeout_s")(positive_seconds)

    def launch_options(self) -> LaunchOptions:
        """The capture's options, as ``snapctl donor``/``bake`` give them."""
        return LaunchOptions(
            server_argv=None if self.server_argv is None else list(self.server_argv),
            name=self.name if isinstance(self, DonorRequest) else None,
            host=self.host,
            port=self.port,
            lo_addresses=list(self.lo_addresses),
            api_key_env=self.api_key_env,
            timeout_s=self.timeout_s,
            env={name: value.get_secret_value() for name, value in self.env.items()},
            inherit_env=self.inherit_env,
            ready_timeout_s=self.ready_timeout_s,
            server_timeout_s=self.server_timeout_s,
            limits=Limits(memory_bytes=self.memory_bytes, cpus=self.cpus),
        )

    @field_validator("environ", "env")
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
