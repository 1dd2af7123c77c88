"""Options shared by ``donor`` and ``copy``, gathered into one :class:`CommonOptions`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click


@dataclass(frozen=True)
class CommonOptions:
    name: str | None
    host: str
    port: int
    publish: tuple[str, int] | None
    api_key_env: str | None
    timeout_s: float
    criu_path: str | None
    native: str
    detach: bool
    as_json: bool


def parse_publish(value: str | None) -> tuple[str, int] | None:
    """``[ADDR:]PORT`` → (address, port); the address defaults to 127.0.0.1."""
    if value is None:
        return None
    address, _, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError as error:
        raise click.BadParameter(f"{value!r} is not [ADDR:]PORT") from error
    if not 0 <= number <= 65535:
        raise click.BadParameter(f"port {number} is out of range")
    return (address or "127.0.0.1", number)


_OPTIONS = [
    click.option("--name", help="Name for ps/stop/logs (default: the activation id)."),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address the server binds inside its network namespace."),
    click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535),
                 help="Port the server binds inside its network namespace."),
    click.option("--publish", metavar="[ADDR:]PORT",
                 help="Forward this host loopback port to the server's port."),
    click.option("--api-key-env", metavar="VAR",
                 help="Environment variable holding the API key (used for probes)."),
    click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=float,
                 help="Wall-clock limit in seconds for each step."),
    click.option("--criu", "criu_path", type=click.Path(dir_okay=False),
                 help="CRIU binary (default: $SNAPCTL_CRIU, /opt/snapctl/criu, PATH)."),
    click.option("--native", default="none", show_default=True,
                 type=click.Choice(["none", "cuda-checkpoint"]),
                 help="Device step around dump and restore."),
    click.option("--detach", is_flag=True,
                 help="Return once ready; a supervisor keeps it running (snapctl stop)."),
    click.option("--json", "as_json", is_flag=True,
                 help="Print one JSON record on stdout; no progress output."),
]  # fmt: skip


def activation_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """Add the shared options; the command receives them as ``common: CommonOptions``."""

    @functools.wraps(function)
    def wrapper(**kwargs: Any) -> Any:
        fields = {name: kwargs.pop(name) for name in CommonOptions.__dataclass_fields__}
        fields["publish"] = parse_publish(fields["publish"])
        return function(common=CommonOptions(**fields), **kwargs)

    for decorator in reversed(_OPTIONS):
        wrapper = decorator(wrapper)
    return wrapper
