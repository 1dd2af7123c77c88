"""``snapctl donor``: capture a server and keep the original serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from snapctl.cli._activation_options import (
    CommonOptions,
    ServerCommand,
    activation_options,
    capture_options,
    check_publish_option,
    validated_request,
)
from snapctl.cli._server_env import ServerEnv, server_env_options
from snapctl.cli.serving import serve
from snapctl.progress import Progress


@click.command(cls=ServerCommand)
@capture_options
@server_env_options
@activation_options
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def donor(image: Path, force: bool, lo_addresses: tuple[str, ...], ready_timeout_s: float,
          server_timeout_s: float, server_cmd: tuple[str, ...], server_env: ServerEnv,
          common: CommonOptions) -> None:  # fmt: skip
    """Capture a server and keep the original serving.

    When an agent runs (snapctl agent), it captures in a supervisor of its own, in this
    command's working directory and environment, and the donor serves on there.
    """
    from snapctl.cli.remote import agent_client

    client = agent_client()
    if client is not None:
        from snapctl.cli.remote import capture_request, donor_through_agent

        request = capture_request(image, force, lo_addresses, ready_timeout_s,
                                  server_timeout_s, server_cmd, common, donor=True,
                                  server_env=server_env)  # fmt: skip
        donor_through_agent(client, request, as_json=common.as_json, detach=common.detach)
        return
    from snapctl.activation.donor import start_donor
    from snapctl.activation.native import native_step
    from snapctl.criu import find_criu
    from snapctl.statedir import StateDir

    check_publish_option(common)
    from snapctl.activation.requests import DonorRequest
    from snapctl.cli.remote import capture_request

    body = capture_request(image, force, lo_addresses, ready_timeout_s, server_timeout_s,
                           server_cmd, common, donor=True, server_env=server_env)  # fmt: skip
    options = validated_request(DonorRequest, body).launch_options()
    criu = find_criu(common.criu_path)
    native = native_step(common.native)

    def start(progress: Progress) -> tuple[Any, Any]:
        session, report = start_donor(
            options, image=image, force=force, criu=criu, native=native,
            publish=common.publish, state=StateDir(), progress=progress,
        )  # fmt: skip
        return session, report

    serve(start, as_json=common.as_json, detach=common.detach)
