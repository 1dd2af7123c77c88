"""Options shared by ``donor``, ``copy`` and ``bake``, gathered into one :class:`CommonOptions`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from snapctl.activation.timeouts import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    READY_TIMEOUT_S,
    SECONDS_RULE,
    SERVER_TIMEOUT_S,
    is_positive_seconds,
)
from snapctl.thin import split_publish

if TYPE_CHECKING:
    from pydantic import BaseModel

    from snapctl.activation.precheck import CopyUsageError

RequestT = TypeVar("RequestT", bound="BaseModel")


@dataclass(frozen=True)
class CommonOptions:
    name: str | None
    host: str
    port: int
    publish: tuple[str, int] | None
    expose: bool
    api_key_env: str | None
    timeout_s: float
    criu_path: str | None
    native: str
    detach: bool
    as_json: bool
    memory_bytes: int | None = None
    cpus: float | None = None


class ServerCommand(click.Command):
    """A command whose trailing ``SERVER_CMD`` is the server's own command line.

    The command's options come first; ``--``, or the first argument that is not an option,
    starts the server's command, which runs on as given (its own options included). An option
    the command does not know before that is a usage error naming it, never a program to run.
    """

    allow_interspersed_args = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault(
            "epilog",
            "SERVER_CMD follows the options, after -- (needed when it begins with an option): "
            "from there on every argument is the server's.",
        )
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as error:
            raise _snapctl_option_error(error, ctx) from None


def _snapctl_option_error(error: click.NoSuchOption, ctx: click.Context) -> click.NoSuchOption:
    """``error``, or, for an option of ``snapctl`` itself (``--no-agent``), the same refusal
    saying where that option goes."""
    parent = ctx.parent
    if parent is None:
        return error
    names = {
        name
        for param in parent.command.params
        if isinstance(param, click.Option) and not param.is_eager
        for name in (*param.opts, *param.secondary_opts)
    }
    if error.option_name not in names:
        return error
    return click.NoSuchOption(
        error.option_name,
        message=f"No such option {error.option_name!r}: it is snapctl's own, given before the "
        f"command ({parent.command_path} {error.option_name} {ctx.info_name} ...).",
        ctx=ctx,
    )


def parse_publish(value: str | None) -> tuple[str, int] | None:
    """``[ADDR:]PORT`` → (address, port); the address defaults to 127.0.0.1 (an IPv6 one may
    be bracketed: ``[::1]:8000``)."""
    if value is None:
        return None
    try:
        return split_publish(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from error


class Seconds(click.ParamType[float, Any]):
    """A positive, finite number of seconds (``inf``, ``nan``, 0 and negatives refused)."""

    name = "seconds"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not is_positive_seconds(seconds):
            self.fail(f"{value!r} is not {SECONDS_RULE}", param, ctx)
        return seconds


SECONDS = Seconds()


# Each step's wall-clock limit; the wait for capture-ready has its own (--ready-timeout).
timeout_option = click.option(
    "--timeout", "timeout_s", default=DEFAULT_TIMEOUT_S, show_default=True, type=SECONDS,
    help="Wall-clock limit in seconds for each step (dump, restore, handshake, HTTP probe).",
)  # fmt: skip


def startup_timeout_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """``--ready-timeout`` and ``--server-timeout`` (``ready_timeout_s``, ``server_timeout_s``)
    of a command that starts a server for capture (``donor``, ``bake``, ``qualify``)."""
    for decorator in reversed(
        (
            click.option(
                "--ready-timeout", "ready_timeout_s", default=READY_TIMEOUT_S,
                show_default=True, type=SECONDS,
                help="How long to wait, in seconds, for a launched server to be ready: "
                "capture-ready.json (an ordinary start's first HTTP 200 in qualify). Loading, "
                "compiling and warming up a real model takes minutes.",
            ),
            click.option(
                "--server-timeout", "server_timeout_s", default=SERVER_TIMEOUT_S,
                show_default=True, type=SECONDS,
                help="The server's own limit, in seconds, on its prepare stage and each wait at "
                "the capture barrier (snapshot-config timeout_s; vLLM's default).",
            ),
        )
    ):  # fmt: skip
        function = decorator(function)
    return function


def check_name_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--name``/``NAME``: refused as a usage error before anything starts."""
    if value is None:
        return None
    from snapctl.statedir.names import InvalidNameError, check_name

    try:
        return check_name(value)
    except InvalidNameError as error:
        raise click.BadParameter(error.message) from error


_OPTIONS = {
    "name": click.option("--name", callback=check_name_option,
                         help="Name for ps/stop/logs (default: the activation id): 1 to 64 "
                              "letters, digits, '_', '.', '-'."),
    "host": click.option("--host", default=DEFAULT_HOST, show_default=True,
                         help="Address the server binds inside its network namespace."),
    "port": click.option("--port", default=DEFAULT_PORT, show_default=True,
                         type=click.IntRange(1, 65535),
                         help="Port the server binds inside its network namespace."),
    "publish": click.option("--publish", metavar="[ADDR:]PORT",
                            help="Forward this host port (on 127.0.0.1 unless ADDR is given) to "
                                 "the server's port; checked free before anything starts."),
    "expose": click.option("--expose", is_flag=True,
                           help="Allow a --publish ADDR that is not loopback (0.0.0.0, a host "
                                "address): the copy becomes reachable from other machines."),
    "api_key_env": click.option("--api-key-env", metavar="VAR",
                                help="Environment variable holding the server's API key. Not "
                                     "needed to serve: readiness is GET /health; with a key, an "
                                     "authenticated GET /v1/models must answer too."),
    "timeout_s": timeout_option,
    "criu_path": click.option("--criu", "criu_path", type=click.Path(dir_okay=False),
                              help="CRIU binary (default: $SNAPCTL_CRIU, /opt/snapctl/criu, "
                                   "PATH)."),
    "native": click.option("--native", default="none", show_default=True,
                           type=click.Choice(["none", "cuda-checkpoint"]),
                           help="Device step around dump and restore."),
    "detach": click.option("--detach", is_flag=True,
                           help="Return once ready; a supervisor keeps it running (snapctl stop)."),
    "as_json": click.option("--json", "as_json", is_flag=True,
                            help="Print one JSON record on stdout; no progress output."),
    "memory_bytes": click.option("--memory", "memory_bytes", metavar="SIZE",
                                 callback=lambda ctx, param, value: _limit("size", value),
                                 help="Memory limit of the activation's own cgroup (512m, 4g, "
                                      "bytes); the kernel kills it past that."),
    "cpus": click.option("--cpus", metavar="N",
                         callback=lambda ctx, param, value: _limit("cpus", value),
                         help="CPU limit of the activation's own cgroup: N CPUs' worth (1.5)."),
}  # fmt: skip


def cgroup_limit_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """``--memory`` and ``--cpus`` alone (``memory_bytes``, ``cpus``): ``pool set``'s limits
    for each parked copy, spelled as the activation commands spell them."""
    return _OPTIONS["memory_bytes"](_OPTIONS["cpus"](function))


def _limit(kind: str, value: str | None) -> int | float | None:
    """``--memory``'s bytes or ``--cpus``' CPUs, refused as click's usage error."""
    if value is None:
        return None
    from snapctl.cgroups.limits import parse_cpus, parse_size  # pydantic: only when given

    try:
        return parse_size(value) if kind == "size" else parse_cpus(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from error


# What an excluded option stands for (a bake never serves: nothing to name, publish or detach).
_DEFAULTS: dict[str, Any] = {"name": None, "publish": None, "expose": False, "detach": False}


def activation_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """Add the shared options; the command receives them as ``common: CommonOptions``."""
    return shared_options()(function)


def shared_options(
    exclude: frozenset[str] = frozenset(),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like :func:`activation_options` without the ``exclude``d ones (name, publish, expose,
    detach), which take their defaults."""
    unknown = exclude - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"options without a default cannot be excluded: {sorted(unknown)}")

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(**kwargs: Any) -> Any:
            fields = {
                name: kwargs.pop(name) if name not in exclude else _DEFAULTS[name]
                for name in CommonOptions.__dataclass_fields__
            }
            fields["publish"] = parse_publish(fields["publish"])
            return function(common=CommonOptions(**fields), **kwargs)

        for name, decorator in reversed(_OPTIONS.items()):
            if name not in exclude:
                wrapper = decorator(wrapper)
        return wrapper

    return decorate


def check_publish_option(common: CommonOptions, count: int = 1) -> None:
    """Refuse ``--publish`` before anything starts (see
    :func:`snapctl.activation.precheck.check_publish_target`)."""
    from snapctl.activation.precheck import CopyUsageError, check_publish_target

    try:
        check_publish_target(common.publish, common.expose, count)
    except CopyUsageError as error:
        raise usage_error(error) from error


def validated_request(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    """The request ``body`` describes, or a usage error naming the field it refuses: the
    in-process path starts from the model the agent reads (its JSON form is held to the same
    model by tests/activation/test_requests.py)."""
    from pydantic import ValidationError

    try:
        # Lax: the body's lists stand for the model's tuples, as JSON arrays do for the agent.
        return model.model_validate(body, strict=False)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise click.UsageError(f"{where}: {first['msg']}") from error


def usage_error(error: CopyUsageError) -> click.UsageError:
    """A refusal that names its option as click's own usage error (exit status 2)."""
    if error.option:
        return click.BadParameter(error.message, param_hint=error.option)
    return click.UsageError(error.message)


def capture_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The options of a command that captures (``donor``, ``bake``): the image to publish
    (``image``), ``force``, the sandbox's extra loopback addresses (``lo_addresses``) and
    the startup limits (``ready_timeout_s``, ``server_timeout_s``)."""
    function = startup_timeout_options(function)
    for decorator in reversed(
        (
            click.option(
                "--image",
                required=True,
                type=click.Path(file_okay=False, path_type=Path),
                help="Directory to publish the image into (must not exist unless --force).",
            ),
            click.option(
                "--force",
                is_flag=True,
                help="Replace an existing image (not while a copy holds it).",
            ),
            click.option(
                "--lo-address",
                "lo_addresses",
                multiple=True,
                metavar="ADDR",
                help="Extra address on the sandbox's loopback (repeatable).",
            ),
        )
    ):
        function = decorator(function)
    return function
