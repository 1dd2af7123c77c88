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
from snapctl.cli.serving import serve
from snapctl.progress import Progress


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
@activation_options
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def copy(image_source: str, plain_http: bool, policy_path: Path | None, count: int,
         allow_mismatch: tuple[str, ...], lazy: bool | None, server_cmd: tuple[str, ...],
         common: CommonOptions) -> None:  # fmt: skip
    """Restore a copy of an image and serve it.

    Before CRIU runs, this host is checked against the image's identity (kernel and its
    features, CRIU, CPU flags, files the server had mapped or open); another machine id,
    hostname or environment is shown, never refused. A SERVER_CMD, if given, must be the
    command the image was captured from.

    When an agent runs (snapctl agent), it serves the copy: from its warm pool if a copy of
    the image is parked (snapctl pool set), else restored in a fresh supervisor.
    """
    from snapctl.cli.remote import agent_client

    client = agent_client() if Path(image_source).is_dir() else None
    if client is not None:
        from snapctl.cli.remote import copy_through_agent

        body = copy_request(image_source, count, allow_mismatch, lazy, server_cmd, common)
        copy_through_agent(client, body, as_json=common.as_json, detach=common.detach)
        return
    from snapctl.activation.copy import start_copy
    from snapctl.activation.native import native_step
    from snapctl.activation.precheck import CopyUsageError, check_copy_start, decide_lazy
    from snapctl.activation.requests import CopyRequest
    from snapctl.cli.output import note
    from snapctl.criu import find_criu
    from snapctl.statedir import StateDir

    def say(text: str) -> None:
        note(text, quiet=common.as_json)

    state = StateDir()
    try:
        published = check_copy_start(
            image=image_source, allow_mismatch=allow_mismatch, name=common.name, count=count,
            publish=common.publish, expose=common.expose, state=state, note=say,
        )  # fmt: skip
    except CopyUsageError as error:
        raise usage_error(error) from error
    image = published or image_path(image_source, plain_http=plain_http, quiet=common.as_json,
                                    policy_path=policy_path)  # fmt: skip
    body = copy_request(str(image), count, allow_mismatch, lazy, server_cmd, common)
    request = validated_request(CopyRequest, body)
    options = request.launch_options()
    criu = find_criu(request.criu_path)
    native = native_step(request.native)
    lazy = decide_lazy(request.lazy, image, say)

    if count > 1:
        serve_many(image, options, count, criu, native, common, lazy=lazy)
        return

    def start(progress: Progress) -> tuple[Any, Any]:
        return start_copy(
            image, options, criu=criu, native=native, publish=common.publish,
            state=state, progress=progress, lazy=lazy,
        )  # fmt: skip

    serve(start, as_json=common.as_json, detach=common.detach)


def copy_request(
    image_source: str, count: int, allow_mismatch: tuple[str, ...], lazy: bool | None,
    server_cmd: tuple[str, ...], common: CommonOptions,
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
        cpus=common.cpus,
    )  # fmt: skip


def serve_many(
    image: Path, options: Any, count: int, criu: Any, native: Any, common: CommonOptions,
    *, lazy: bool = False,
) -> None:  # fmt: skip
    """``--count N``: restore N copies at once, report each and the total, then supervise."""
    from snapctl.activation.copy import CopiesReport
    from snapctl.cli.serving import render_copies, run_detached, run_in_foreground

    if common.detach:
        run_detached(
            lambda progress_for: start_many(
                image, options, count, criu, native, common, progress_for, lazy
            ),
            as_json=common.as_json,
            show=lambda record: render_copies(
                CopiesReport.model_validate(record).copies, record["total_s"]
            ),
        )
        return
    run_in_foreground(
        lambda steps: start_many(image, options, count, criu, native, common, steps.lane, lazy),
        as_json=common.as_json,
        show=lambda report: render_copies(report.copies, report.total_s),
    )


def start_many(
    image: Path, options: Any, count: int, criu: Any, native: Any, common: CommonOptions,
    progress_for: Any, lazy: bool = False,
) -> tuple[list[Any], Any]:  # fmt: skip
    """Start the copies, all or nothing (see ``require_all``)."""
    import time

    from snapctl.activation.copy import require_all, start_copies
    from snapctl.statedir import StateDir

    started = time.monotonic()
    results = start_copies(
        image, options, count, criu=criu, native=native, publish_base=common.publish,
        state=StateDir(), progress_for=progress_for, lazy=lazy,
    )  # fmt: skip
    return require_all(results, time.monotonic() - started)


def image_path(source: str, *, plain_http: bool, quiet: bool,
               policy_path: Path | None = None) -> Path:  # fmt: skip
    """The image directory ``--image`` names: itself, or a reference pulled into the cache
    once the trust policy (``policy_path``, else the system's) accepts it."""
    from snapctl.cli.image import policy_line, transfer_progress, working_sets_line
    from snapctl.cli.output import note
    from snapctl.registry.source import is_reference, pull_for_copy, require_image
    from snapctl.statedir import StateDir
    from snapctl.trust.policy import load_policy

    if not is_reference(source):
        return require_image(source)
    policy = load_policy(policy_path)
    if policy.note:
        note(policy.note, quiet=quiet)
    with transfer_progress("pull", None, quiet=quiet) as (advance, set_total):
        report = pull_for_copy(source, StateDir(), plain_http=plain_http, policy=policy,
                               progress=advance, total=set_total)  # fmt: skip
    if report.already_pulled:
        note(f"{source}: image {report.image_id[:12]} already pulled", quiet=quiet)
    else:
        note(f"pulled {source}: {report.bytes_fetched / 1e6:.1f} MB in {report.seconds:.2f} s",
             quiet=quiet)  # fmt: skip
    if report.working_sets.processes or report.working_sets.error:
        note(working_sets_line(report).strip(), quiet=quiet)
    if policy.note is None:
        note(policy_line(report).strip(), quiet=quiet)
    return Path(report.image)
