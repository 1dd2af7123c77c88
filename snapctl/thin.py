"""Commands the agent answers before click is imported: ``snapctl ps [--json]`` and the
detached ``snapctl copy --image DIR ... --detach --json`` that scripts, hooks and autoscalers
run. The standard library's cheapest modules and :mod:`snapctl.agent.client` only: no ``re``,
``json``, ``socket`` or ``enum`` either (:mod:`snapctl.wire` says why).

Through the agent such a command is a socket write and a few reads, so the interpreter's start,
click and the CLI's modules (tens of milliseconds) would be most of its wall time. Each path
takes only argument lists it fully understands; anything else (another option, a value it
would have to refuse, a terminal to draw on, no agent) returns None and the full CLI runs,
which parses with click and gives the same request, output and exit status (the tests build
requests both ways and compare). A refusal of the request by the agent is a usage error
raised before anything starts: the full CLI then asks again and reports it as click does.
"""

from __future__ import annotations

# signal's C half, which the interpreter imported already (no stub in typeshed): signal itself
# imports enum (see snapctl.wire).
import _signal  # type: ignore[import-not-found]
import os

from snapctl.activation.timeouts import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TIMEOUT_S
from snapctl.agent import NO_AGENT_ENV, absolute

# Not typing's, and no pathlib, threading or contextlib: this module's imports are most of a
# pooled copy's CLI wall (see docs/agent.md); mypy reads any TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, TypeAlias

    # on_progress(lane, step) and on_note(text), as the copy request's stream delivers them.
    LaneProgress: TypeAlias = Callable[[str, str], None]

_PS = (["ps"], ["ps", "--json"])


_COPY_FLAGS = {"--detach", "--json", "--lazy", "--no-lazy", "--expose"}
_COPY_VALUES = {"--image", "--publish", "--name", "--host", "--port", "--timeout", "--api-key-env"}


def copy_request_body(
    image: str,
    *,
    count: int = 1,
    allow_mismatch: tuple[str, ...] = (),
    lazy: bool | None = None,
    server_argv: tuple[str, ...] = (),
    name: str | None = None,
    publish: tuple[str, int] | None = None,
    expose: bool = False,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key_env: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    native: str = "none",
    criu_path: str | None = None,
    detach: bool = False,
    memory_bytes: int | None = None,
    cpus: float | None = None,
    into_container: str | None = None,
) -> dict[str, Any]:
    """The agent's ``CopyRequest`` (:mod:`snapctl.activation.requests`) for these options. The
    API key travels as its value: the agent's environment is not the caller's.
    ``into_container`` is sent only when given (an agent of before it knows no such field)."""
    body = {
        "image": absolute(image),
        "name": name,
        "publish": None if publish is None else {"address": publish[0], "port": publish[1]},
        "expose": expose,
        "host": host,
        "port": port,
        "api_key_env": api_key_env,
        "api_key": os.environ.get(api_key_env) if api_key_env else None,
        "lazy": lazy,
        "allow_mismatch": list(allow_mismatch),
        "count": count,
        "timeout_s": timeout_s,
        "native": native,
        "criu_path": None if criu_path is None else absolute(criu_path),
        "server_argv": list(server_argv) or None,
        "detach": detach,
        "memory_bytes": memory_bytes,
        "cpus": cpus,
    }
    if into_container is not None:
        body["into_container"] = into_container
    return body


_NAME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def is_activation_name(name: str) -> bool:
    """Whether ``name`` matches :data:`snapctl.statedir.names.NAME_PATTERN` (without ``re``:
    tests/agent/test_thin.py holds the two to the same answers)."""
    return 0 < len(name) <= 64 and name[0] not in "_.-" and _NAME_CHARACTERS.issuperset(name)


def split_publish(value: str) -> tuple[str, int]:
    """``[ADDR:]PORT`` as (address, port), the address 127.0.0.1 when not given (an IPv6 one
    may be bracketed: ``[::1]:8000``); ValueError, saying why, when it is not that."""
    address, _, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{value!r} is not [ADDR:]PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port {number} is out of range")
    return (address.strip("[]") or DEFAULT_HOST, number)


def parse_fast_copy(args: list[str]) -> dict[str, Any] | None:
    """The request of ``copy --image DIR [options] --detach --json``, or None unless every
    argument is one this path understands, given once, with a value the full CLI accepts."""
    if not args or args[0] != "copy":
        return None
    seen: dict[str, str | bool] = {}
    rest = iter(args[1:])
    for arg in rest:
        option, equals, value = arg.partition("=")
        if option in _COPY_FLAGS and not equals:
            parsed: str | bool = True
        elif option in _COPY_VALUES:
            if not equals:
                value = next(rest, "")
            if not value or value.startswith("-"):
                return None  # click would read it (or fail) another way
            parsed = value
        else:
            return None
        if option in seen:
            return None
        seen[option] = parsed
    if not (seen.get("--detach") and seen.get("--json")) or "--image" not in seen:
        return None
    if "--lazy" in seen and "--no-lazy" in seen:
        return None
    fields = _copy_fields(seen)
    if fields is None:
        return None
    return copy_request_body(detach=True, **fields)


def _copy_fields(seen: dict[str, str | bool]) -> dict[str, Any] | None:
    """The options' values, or None where one is not what the full CLI would accept as is."""
    from snapctl.activation.timeouts import is_positive_seconds

    values = {key: value for key, value in seen.items() if isinstance(value, str)}
    if not os.path.isdir(values["--image"]):
        return None  # a registry reference: pulled in-process first
    fields: dict[str, Any] = {"image": values["--image"], "expose": "--expose" in seen}
    if "--lazy" in seen or "--no-lazy" in seen:
        fields["lazy"] = "--lazy" in seen
    for option, field in (("--name", "name"), ("--host", "host"), ("--api-key-env", "api_key_env")):
        if option in values:
            fields[field] = values[option]
    if "name" in fields and not is_activation_name(fields["name"]):
        return None
    try:
        if "--publish" in values:
            fields["publish"] = split_publish(values["--publish"])
        if "--port" in values:
            fields["port"] = int(values["--port"])
        if "--timeout" in values:
            fields["timeout_s"] = float(values["--timeout"])
    except ValueError:
        return None
    if not 1 <= fields.get("port", DEFAULT_PORT) <= 65535:
        return None
    if not is_positive_seconds(fields.get("timeout_s", DEFAULT_TIMEOUT_S)):
        return None
    return fields


class HeldSignals:
    """While its body runs, SIGINT/SIGTERM only set :attr:`signalled` and call ``notify`` (a
    copy that started must be stopped by us, not left serving by a command killed halfway);
    the previous handlers come back after. A class, not a generator: no contextlib here."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self.signalled = False
        self._notify = notify
        self._previous: dict[int, Any] = {}

    def _hold(self, signum: int, frame: object) -> None:
        self.signalled = True
        if self._notify is not None:
            self._notify()

    def __enter__(self) -> HeldSignals:
        for signum in (_signal.SIGINT, _signal.SIGTERM):
            self._previous[signum] = _signal.signal(signum, self._hold)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            _signal.signal(signum, handler)


def relay_report(
    messages: Iterator[Any], on_progress: LaneProgress | None, on_note: Callable[[str], None]
) -> dict[str, Any]:
    """A start request's stream (copy, donor, bake) up to its report; the agent's error
    raised as its :class:`~snapctl.agent.errors.AgentError`."""
    for message in messages:
        if "progress" in message:
            if on_progress is not None:
                on_progress(message.get("lane", ""), message["progress"])
        elif "note" in message:
            on_note(message["note"])
        elif "report" in message:
            report: dict[str, Any] = message["report"]
            return report
        elif "error" in message:
            from snapctl.agent.errors import error_from

            raise error_from(message)
    from snapctl.agent.errors import AgentUnavailableError

    raise AgentUnavailableError("the agent ended the request without a report")


def stop_interrupted(client_path: str | os.PathLike[str], report: dict[str, Any]) -> BaseException:
    """SIGINT/SIGTERM came while the copy started: stop what started; the error to fail
    with, as an interrupted in-process start fails (exit 130)."""
    import contextlib

    from snapctl.agent.client import AgentClient
    from snapctl.agent.errors import AgentError
    from snapctl.errors import ExitStatus

    for copy in report.get("copies", [report]):
        with contextlib.suppress(Exception):
            AgentClient(client_path).call("POST", f"/activations/{copy['name']}/stop", {})
    return AgentError(
        "interrupted while starting (SIGINT/SIGTERM); what had started was stopped",
        exit_status=ExitStatus.INTERRUPTED,
    )


def fast_ps(args: list[str]) -> int | None:
    """``snapctl ps [--json]`` answered by the agent, or None to take the full CLI's path."""
    if args not in _PS or os.environ.get(NO_AGENT_ENV):
        return None
    from snapctl.agent.client import connect

    client = connect()
    if client is None:
        return None
    try:
        rows = client.call("GET", "/activations")
    except Exception:  # the full CLI asks again, and reports a failure its usual way
        return None
    from snapctl.plain import PS_COLUMNS, emit_json, print_table, ps_rows

    if args == ["ps", "--json"]:
        emit_json(rows)
    else:
        print_table(PS_COLUMNS, ps_rows(rows))
    return 0


def fast_copy(args: list[str]) -> int | None:
    """``snapctl copy --image DIR ... --detach --json`` served by the agent: its report on
    stdout, exit 0; a failure raised, for the caller to report as the full CLI does
    (:mod:`snapctl.entry`). None (nothing was asked of the agent, or it refused before
    anything started): take the full CLI's path."""
    if os.environ.get(NO_AGENT_ENV):
        return None
    request = parse_fast_copy(args)
    if request is None:
        return None
    from snapctl.agent.client import connect

    client = connect()
    if client is None:
        return None
    from snapctl.plain import emit_json

    try:
        with HeldSignals() as held:
            report = relay_report(client.stream("POST", "/copies", request), None, lambda _: None)
            if held.signalled:
                raise stop_interrupted(client.path, report)
            # Inside the held signals: a copy that started is never left unprinted.
            emit_json(report)  # sorted keys, as the detached in-process start prints its record
    except Exception as error:
        from snapctl.agent.errors import AgentError  # only now: see snapctl.agent.errors

        if isinstance(error, AgentError) and error.usage is not None:
            return None  # refused before anything started: the full CLI reports it as click
        raise
    return 0
