"""``snapctl copy``: restore a copy of an image and serve it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from snapctl.cli._activation_options import (
    CommonOptions,
    ServerCommand,
    activation_options,
    usage_error,
    validated_request,
)


class LazyOption(click.Option):
    """``--lazy/--no-lazy``, whose help names the default's threshold: read from the lazy
    tuning only when help is shown (importing it costs every command's start)."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from snapctl.activation.precheck import lazy_help

        self.help = lazy_help()
        return super().get_help_record(ctx)


@click.command(cls=ServerCommand)
@click.option(
    "--image",
    "image_source",
    required=True,
    metavar="DIR|REF",
    help="A published image directory, or a registry reference (REGISTRY/REPOSITORY:TAG or "
    "@sha256:DIGEST), pulled into the local image cache first.",
)
@click.option(
    "--plain-http", is_flag=True, help="With a reference: speak HTTP to the registry (no TLS)."
)
@click.option(
    "--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With a reference: the trust policy, containers-policy.json(5), checked before "
    "anything is fetched [default: /etc/containers/policy.json, else every image is "
    "accepted].",
)  # fmt: skip
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Restore this many copies at once (published ports count up).",
)
@click.option(
    "--allow-mismatch",
    "allow_mismatch",
    multiple=True,
    metavar="FIELD",
    help="Restore even though this identity field differs from the image's (repeatable): "
    "kernel, kernel_features, criu_version, cpu_vendor, cpu_flags, python_version, argv, "
    "identity. File contents cannot be waived; host_id and env never refuse (accepted, "
    "not needed).",
)
@click.option("--lazy/--no-lazy", default=None, cls=LazyOption)
@click.option(
    "--into-container", "into_container", metavar="NAME|ID|PID",
    help="Restore the copy inside this running container (a podman name or ID, or its first "
    "process's PID): its tree joins the container's PID and network namespaces and cgroup "
    "(on cgroup v2, the container's parent), reads the container's files, listens itself "
    "where --publish names on the container's network, and ends with the container.",
)  # fmt: skip
@activation_options
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def copy(image_source: str, plain_http: bool, policy_path: Path | None, count: int,
         allow_mismatch: tuple[str, ...], lazy: bool | None, into_container: str | None,
         server_cmd: tuple[str, ...], common: CommonOptions) -> None:  # fmt: skip
    """Restore a copy of an image and serve it.

    Before CRIU runs, this host is checked against the image's identity (kernel and its
    features, CRIU, CPU flags, files the server had mapped or open); another machine id,
    hostname or environment is shown, never refused. A SERVER_CMD, if given, must be the
    command the image was captured from.

    When an agent runs (snapctl agent), it serves the copy: from its warm pool if a copy of
    the image is parked (snapctl pool set), else restored in a fresh supervisor.
    """
    from snapctl.cli.remote import agent_client

    body = copy_request(image_source, count, allow_mismatch, lazy, server_cmd, common,
                        into_container=into_container)  # fmt: skip
    client = agent_client() if Path(image_source).is_dir() else None
    if client is not None:
        from snapctl.cli.remote import copy_through_agent

        copy_through_agent(client, body, as_json=common.as_json, detach=common.detach)
        return
    from functools import partial

    from snapctl.activation.precheck import CopyUsageError, check_copy_start
    from snapctl.activation.requests import CopyRequest
    from snapctl.activation.start import prepare_copies
    from snapctl.cli.image import image_directory
    from snapctl.cli.output import note
    from snapctl.cli.serving import serve_copies
    from snapctl.statedir import StateDir

    say = partial(note, quiet=common.as_json)
    state = StateDir()
    try:
        published = check_copy_start(
            image=image_source, allow_mismatch=allow_mismatch, name=common.name, count=count,
            publish=common.publish, expose=common.expose, state=state, note=say,
            into_container=into_container,
        )  # fmt: skip
    except CopyUsageError as error:
        raise usage_error(error) from error
    image = published or image_directory(image_source, plain_http=plain_http,
                                         quiet=common.as_json, policy_path=policy_path)  # fmt: skip
    # The body names --image as given, no directory for a reference: the request names the
    # directory found or pulled.
    request = validated_request(CopyRequest, {**body, "image": str(image)})
    copies = prepare_copies(request, state, note=say)
    serve_copies(copies, as_json=common.as_json, detach=common.detach)


def copy_request(
    image_source: str, count: int, allow_mismatch: tuple[str, ...], lazy: bool | None,
    server_cmd: tuple[str, ...], common: CommonOptions, *, into_container: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The agent's ``CopyRequest`` for these options (:func:`snapctl.thin.copy_request_body`,
    which the click-free path builds its request with too)."""
    from snapctl.thin import copy_request_body

    return copy_request_body(
        image_source, count=count, allow_mismatch=allow_mismatch, lazy=lazy,
        server_argv=server_cmd, name=common.name, publish=common.publish,
        expose=common.expose, host=common.host, port=common.port,
        api_key_env=common.api_key_env, timeout_s=common.timeout_s, native=common.native,
        criu_path=common.criu_path, detach=common.detach, memory_bytes=common.memory_bytes,
        cpus=common.cpus, into_container=into_container,
    )  # fmt: skip
