"""``snapctl agent``: run the node agent in the foreground (see :mod:`snapctl.agent`)."""

from __future__ import annotations

from pathlib import Path

import click

from snapctl.cli._activation_options import parse_publish


def _address(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, int] | None:
    address = parse_publish(value)
    if address is not None and not address[1]:
        raise click.BadParameter("give a port (HOST:PORT)")
    return address


@click.command()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The API's unix socket (default: $SNAPCTL_AGENT_SOCKET, else "
    "STATE/agent.sock); mode 0600, root only.",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    callback=_address,
    help="Also serve the API over TCP there; every request needs "
    "'Authorization: Bearer TOKEN' (--token-file).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The bearer token for --listen: its first line, a regular file owned by root (or the "
    "agent's user) with no access for group or others (chmod 600).",
)
@click.option(
    "--metrics-listen",
    metavar="HOST:PORT",
    callback=_address,
    help="Also serve GET /metrics (Prometheus text format) over TCP there.",
)
@click.option(
    "--share-memory/--no-share-memory",
    default=True,
    show_default=True,
    help="Start the host's KSM (ksmd) where it is stopped, so copies of an in-image image share "
    "the pages they never write (the weights); it scans only memory marked mergeable.",
)
def agent(socket_path: Path | None, listen: tuple[str, int] | None, token_file: Path | None,
          metrics_listen: tuple[str, int] | None, share_memory: bool) -> None:  # fmt: skip
    """Run the node agent: the CLI's API, a warm pool, metrics.

    Runs in the foreground until SIGTERM or Ctrl-C (contrib/systemd/snapctl-agent.service
    runs it as a service). The CLI on this host talks to it when it answers on its socket;
    copies it starts keep serving when it stops, and parked copies are discarded.
    """
    from snapctl.agent import default_socket_path
    from snapctl.agent.daemon import AgentOptions, run_agent
    from snapctl.statedir import StateDir

    options = AgentOptions(
        socket=socket_path or default_socket_path(), listen=listen, token_file=token_file,
        metrics_listen=metrics_listen, share_memory=share_memory,
    )  # fmt: skip
    run_agent(StateDir(), options)
