"""The CLI as a thin client of the agent: whether to use it, and running a copy, a donor or a
bake through it with the same progress, output and exit status as in-process.

Light on purpose (click, the standard library and :mod:`snapctl.agent.client`): rich is
imported only to draw what a terminal shows, pydantic never.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from snapctl.agent import NO_AGENT_ENV
from snapctl.agent.client import AgentClient, Hangup
from snapctl.agent.errors import AgentError
from snapctl.thin import HeldSignals, relay_report, stop_interrupted

if TYPE_CHECKING:
    from snapctl.cli._activation_options import CommonOptions
    from snapctl.cli._server_env import ServerEnv
    from snapctl.thin import LaneProgress


def agent_client() -> AgentClient | None:
    """The agent's client when one answers and neither ``--no-agent`` nor
    ``$SNAPCTL_NO_AGENT`` says to stay in-process; else None (run in-process)."""
    from snapctl.cli import CliState

    ctx = click.get_current_context(silent=True)
    state = ctx.find_object(CliState) if ctx is not None else None
    if (state is not None and state.no_agent) or os.environ.get(NO_AGENT_ENV):
        return None
    from snapctl.agent.client import connect

    return connect()


def _terminal(as_json: bool) -> bool:
    return not as_json and sys.stderr.isatty()


def raise_for(message: dict[str, Any]) -> None:
    """An error message from the agent, raised as the CLI raises it in-process."""
    from snapctl.agent.errors import error_from

    raise as_cli_error(error_from(message))


def as_cli_error(error: AgentError) -> BaseException:
    """A usage error (the agent names the option) as click's own; anything else as is."""
    if error.usage is None:
        return error
    if error.usage:
        return click.BadParameter(error.message, param_hint=error.usage)
    return click.UsageError(error.message)


def call(client: AgentClient, method: str, target: str, body: Any = None) -> Any:
    """One request; the agent's error raised as in-process (see :func:`as_cli_error`)."""
    try:
        return client.call(method, target, body)
    except AgentError as error:
        raise as_cli_error(error) from None


class Record(dict[str, Any]):
    """A JSON object whose fields read as attributes too (``report.name``), while a field that
    is a mapping stays one (``report.timings_s.items()``), as on the model it came from."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def namespace(value: Any) -> Any:
    """A JSON record as attributes, for the renderers that read reports' fields (a mapping
    field, such as ``timings_s``, still iterates as the mapping it is)."""
    if isinstance(value, dict):
        return Record({key: namespace(item) for key, item in value.items()})
    if isinstance(value, list):
        return [namespace(item) for item in value]
    return value


def capture_request(
    image: Path, force: bool, lo_addresses: tuple[str, ...], ready_timeout_s: float,
    server_timeout_s: float, server_cmd: tuple[str, ...], common: CommonOptions, *,
    donor: bool, server_env: ServerEnv | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The agent's ``DonorRequest`` (``donor``) or ``BakeRequest`` (see
    :mod:`snapctl.pool.models`) for these options: paths made absolute, and this process's
    working directory and whole environment, where the server command runs (the agent's are
    not the caller's; the API key ``--api-key-env`` names travels among them), and what the
    server gets of it beyond its defaults (``server_env``: ``--env``, ``--env-file``,
    ``--inherit-env``), which it applies where it launches the server."""
    request: dict[str, Any] = {
        "image": str(image.absolute()),
        "force": force,
        "lo_addresses": list(lo_addresses),
        "ready_timeout_s": ready_timeout_s,
        "server_timeout_s": server_timeout_s,
        "host": common.host,
        "port": common.port,
        "api_key_env": common.api_key_env,
        "timeout_s": common.timeout_s,
        "native": common.native,
        "criu_path": None if common.criu_path is None else str(Path(common.criu_path).absolute()),
        "server_argv": list(server_cmd) or None,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "env": {} if server_env is None else dict(server_env.given),
        "inherit_env": server_env is not None and server_env.inherit,
        "memory_bytes": common.memory_bytes,
        "cpus": common.cpus,
    }
    if donor:
        request.update({
            "name": common.name,
            "publish": None if common.publish is None else {
                "address": common.publish[0], "port": common.publish[1]},
            "expose": common.expose,
            "detach": common.detach,
        })  # fmt: skip
    return request


def copy_through_agent(
    client: AgentClient, request: dict[str, Any], *, as_json: bool, detach: bool
) -> None:
    """``snapctl copy`` served by the agent: its progress and notes (on a terminal), then its
    report as in-process (``--detach``: and return; else serve until Ctrl-C/SIGTERM or the
    copy exits, then stop it through the agent and report the cleanup)."""
    serve_through_agent(client, "/copies", request, as_json=as_json, detach=detach)


def donor_through_agent(
    client: AgentClient, request: dict[str, Any], *, as_json: bool, detach: bool
) -> None:
    """``snapctl donor`` served by the agent (``POST /v1/donors``), as a copy is: the donor
    lives in a supervisor the agent forked; without ``--detach`` this command stops it when
    it ends."""
    serve_through_agent(client, "/donors", request, as_json=as_json, detach=detach)


def _lane_progress(stack: ExitStack, as_json: bool) -> LaneProgress | None:
    """Progress by lane drawn on the terminal (its display entered on ``stack``), or None
    when nothing is drawn (``--json``, or stderr is no terminal)."""
    if not _terminal(as_json):
        return None
    from snapctl.cli.output import Steps

    steps = stack.enter_context(Steps(quiet=as_json))
    return lambda lane, step: steps.lane(lane)(step)


@contextlib.contextmanager
def signals_held() -> Iterator[threading.Event]:
    """:class:`~snapctl.thin.HeldSignals` with an event to wait on (the foreground's loop)."""
    event = threading.Event()
    with HeldSignals(event.set):
        yield event


def bake_through_agent(client: AgentClient, request: dict[str, Any], *, as_json: bool) -> Any:
    """``snapctl bake`` served by the agent (``POST /v1/bakes``): its progress (on a terminal),
    then its report (a dict). SIGINT/SIGTERM meanwhile hang up on the request, and the agent
    interrupts the bake in its supervisor, as the signal does in-process: its tree is stopped,
    nothing is published, and the command fails as an interrupted in-process bake (exit 130,
    no message). A bake that published before the interrupt reached it is named instead."""
    hangup = Hangup()
    with signals_held() as signalled, ExitStack() as stack:
        lane_step = _lane_progress(stack, as_json)
        try:
            with hanging_up_on_signal(signalled, hangup):
                report = _relay(client, "/bakes", request, lane_step, as_json, hangup)
        except AgentError as error:
            if cancelled_by(error, signalled):
                raise KeyboardInterrupt from None
            raise
    if signalled.is_set():
        from snapctl.errors import ExitStatus

        raise AgentError(
            "interrupted while baking (SIGINT/SIGTERM); the bake ran on in its supervisor and "
            f"published {report['image']} (remove it if it is not wanted)",
            exit_status=ExitStatus.INTERRUPTED,
        )
    return report


def serve_through_agent(
    client: AgentClient, target: str, request: dict[str, Any], *, as_json: bool, detach: bool
) -> None:
    """An activation (``target``: ``/copies`` or ``/donors``) served by the agent: its
    progress and notes (on a terminal), then its report as in-process (``--detach``: and
    return; else serve until Ctrl-C/SIGTERM or it exits, then stop it through the agent and
    report the cleanup)."""
    # One set of handlers from the request to the last stop: a signal at any moment in
    # between either stops what started or asks the serving loop to stop, never kills the
    # command and leaves a copy serving with no one to stop it.
    with signals_held() as signalled:
        with ExitStack() as stack:
            lane_step = _lane_progress(stack, as_json)
            outcome = _stream_start(client, target, request, lane_step, as_json, signalled)
        if as_json:
            from snapctl.plain import emit_json

            # As in-process: a detached start prints the supervisor's record as JSON (sorted
            # keys), a foreground one its report model (field order).
            emit_json(outcome, sort_keys=detach)
        else:
            _show(outcome)
        if detach:
            if not as_json:
                _dim("running detached: `snapctl ps` lists it, `snapctl stop NAME` stops it")
            return
        copies = outcome.get("copies", [outcome])
        _serve_until_stopped(client, copies, as_json=as_json, stop=signalled)


@contextlib.contextmanager
def hanging_up_on_signal(signalled: threading.Event, hangup: Hangup) -> Iterator[None]:
    """While the body streams a capture's start: SIGINT/SIGTERM set ``signalled`` (as
    :func:`snapctl.thin.HeldSignals` does) and hang up on the request, so that the agent
    interrupts the capture in its supervisor (as the signal does in-process) instead of this
    command waiting for the whole capture. The previous handlers come back after."""

    def handle(signum: int, frame: Any) -> None:
        signalled.set()
        hangup.hang_up()

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT,
                                                                     signal.SIGTERM)}  # fmt: skip
    if signalled.is_set():
        hangup.hang_up()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def cancelled_by(error: AgentError, signalled: threading.Event) -> bool:
    """Whether ``error`` is the interrupted start our own hang-up (on a signal) caused."""
    from snapctl.errors import ExitStatus

    return signalled.is_set() and error.exit_status == ExitStatus.INTERRUPTED


def _stream_start(
    client: AgentClient, target: str, request: dict[str, Any], lane_step: Any, as_json: bool,
    interrupted: threading.Event,
) -> dict[str, Any]:  # fmt: skip
    """Relay the start request's stream up to its report. SIGINT/SIGTERM while it starts do
    not cut the stream (the copy or donor would be left serving with no one to stop it): they
    set ``interrupted``, and the command fails as an interrupted in-process start does (exit
    130): in the foreground as an interrupt (click's Abort: no message), with ``--detach``
    with the detached supervisor's message. A donor's start (a capture: minutes) is hung up
    on, and the agent interrupts it where it is; a copy's (short) runs on to its report, and
    what started is stopped then."""
    hangup = Hangup() if target == "/donors" else None
    try:
        with hanging_up_on_signal(interrupted, hangup) if hangup else contextlib.nullcontext():
            report = _relay(client, target, request, lane_step, as_json, hangup)
    except AgentError as failure:
        if cancelled_by(failure, interrupted) and not request.get("detach"):
            raise KeyboardInterrupt from None
        raise
    if interrupted.is_set():
        error = stop_interrupted(client.path, report)
        if not request.get("detach"):
            raise KeyboardInterrupt
        raise error
    return report


def _relay(
    client: AgentClient, target: str, request: dict[str, Any], lane_step: Any, as_json: bool,
    hangup: Hangup | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Relay ``POST target``'s stream: progress and notes as they come; its report."""

    def on_note(text: str) -> None:
        if _terminal(as_json):
            from snapctl.cli.output import note

            note(text)

    try:
        messages = client.stream("POST", target, request, hangup=hangup)
        return relay_report(messages, lane_step, on_note)
    except AgentError as error:  # refused before the stream began (a 4xx), or failed
        raise as_cli_error(error) from None


def _show(outcome: dict[str, Any]) -> None:
    from snapctl.cli.serving import render_copies, render_report

    if "copies" in outcome:
        render_copies(namespace(outcome["copies"]), outcome["total_s"])
    else:
        render_report(namespace(outcome))


def _dim(text: str) -> None:
    from snapctl.cli.serving import stderr_line

    stderr_line(text, "dim")


def _serve_until_stopped(
    client: AgentClient, copies: list[dict[str, Any]], *, as_json: bool, stop: threading.Event
) -> None:
    """The foreground's wait: until ``stop`` (Ctrl-C/SIGTERM) or every copy exited, then stop
    each and report as in-process (:func:`snapctl.cli.serving.report_ended`: its cleanup line,
    and the command fails if it was stopped as unsafe or its cleanup is incomplete). A copy
    its supervisor stopped first is reported from what that kept (``stopped.json``). Through
    the agent; if the agent stops meanwhile, the copies serve on (they live in their own
    supervisors) and this waits on from their records, then stops them itself, in-process:
    they live as long as the command, as in-process."""
    from snapctl.agent.errors import AgentUnavailableError
    from snapctl.cli.serving import pages_complete_note, report_ended, show_ended
    from snapctl.errors import SnapctlError

    names = {copy["name"] for copy in copies}
    if not as_json:
        _dim("serving; press Ctrl-C to stop")
    noted: set[str] = set()
    through_agent = True
    while not stop.wait(0.5):
        rows = None
        if through_agent:
            try:
                rows = AgentClient(client.path).call("GET", "/activations")
            except AgentUnavailableError:
                through_agent = False  # the agent stopped: the copies did not, nor do we
        if rows is None:
            from snapctl.statedir import StateDir
            from snapctl.supervision.listing import activation_rows

            rows = activation_rows(StateDir())
        mine = {row["name"]: row for row in rows if row["name"] in names}
        if not as_json:
            _note_pages(copies, mine, noted, pages_complete_note)
        if not any(row["running"] for row in mine.values()):
            break
    ended, failures = [], []
    for copy in copies:
        try:
            end = _end_of(client, copy)
        except SnapctlError as error:  # still stop the others, then fail with it
            failures.append(error)
            continue
        if end is not None:
            ended.append(end)
    if failures:
        show_ended(ended, as_json=as_json)
        raise failures[0]
    report_ended(ended, as_json=as_json)


def _note_pages(
    copies: list[dict[str, Any]], rows: dict[str, dict[str, Any]], noted: set[str], note: Any
) -> None:
    """As in-process: say once when a lazy copy's last page arrived."""
    for copy in copies:
        row = rows.get(copy["name"])
        if copy.get("lazy") and row and row.get("pages_complete") and copy["name"] not in noted:
            noted.add(copy["name"])
            _dim(note(copy["name"], row["pages_complete_s"]))


def _end_of(client: AgentClient, copy: dict[str, Any]) -> Any:
    """How ``copy`` ended (:class:`snapctl.cli.serving.Ended`): stopped now if it is still
    recorded, and what its supervisor kept if it stopped it (the reason it was stopped as
    unsafe, and its own stop if ours found nothing left); None if neither knows it."""
    from snapctl.cli.serving import Ended

    answer = _stop_one(client, copy["name"])
    kept = _kept_outcome(copy)
    if answer is None and kept is None:
        return None  # stopped and cleaned up by someone else (snapctl stop, gc)
    source = answer if answer is not None else kept
    assert source is not None
    failure = None if kept is None else kept.get("failure")
    return Ended(copy["name"], source["stopped"], source["audit"], failure)


def _kept_outcome(copy: dict[str, Any]) -> dict[str, Any] | None:
    """The ``StopOutcome`` the copy's supervisor kept in its logs, or None."""
    import json
    from pathlib import Path

    from snapctl.statedir import STOPPED_FILE

    try:
        kept = json.loads((Path(copy["logs"]) / STOPPED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


def _stop_one(client: AgentClient, name: str) -> dict[str, Any] | None:
    """Stop ``name`` through the agent, or in-process from its record when no agent answers;
    None when it is recorded no more."""
    from snapctl.agent.errors import AgentError, AgentUnavailableError

    try:
        answer: dict[str, Any] = AgentClient(client.path).call(
            "POST", f"/activations/{name}/stop", {}
        )
        return answer
    except AgentError as error:
        if error.http_status == 404:
            return None
        raise
    except AgentUnavailableError:
        from snapctl.activation.supervise import stop_recorded
        from snapctl.statedir import StateDir

        state = StateDir()
        record = next((r for r in state.load_records() if r.name == name), None)
        if record is None:
            return None
        how, audit = stop_recorded(record, state)
        return {"name": name, "stopped": how, "audit": audit.model_dump()}
