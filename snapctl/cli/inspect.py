"""``snapctl inspect``: show an image's manifest, and verify every file with --verify."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click

from snapctl.cli.output import emit_json, json_option, stdout

if TYPE_CHECKING:
    from snapctl.images import Manifest
    from snapctl.registry.workingsets import AttachedSets


@click.command()
@click.argument("source", metavar="IMAGE")
@click.option("--verify", is_flag=True, help="Check every file's size and sha256.")
@click.option("--brief", is_flag=True, help="Only the summary table.")
@click.option(
    "--plain-http", is_flag=True, help="With a reference: speak HTTP to the registry (no TLS)."
)
@json_option
def inspect(source: str, verify: bool, brief: bool, plain_http: bool, as_json: bool) -> None:
    """Show an image's manifest (and verify it).

    IMAGE is an image directory or a registry reference; for a reference only the manifests
    and small metadata are fetched, never page data. Shows the process tree, the image's
    files, the identity a copy is checked against (files outside the image it depends on
    included) and CRIU's dump statistics.
    """
    from snapctl.registry.source import describe_remote, is_reference, require_image
    from snapctl.statedir import StateDir

    if is_reference(source):
        if verify:
            raise click.UsageError("--verify reads every file: pull the image first")
        remote, sets = describe_remote(source, StateDir(), plain_http=plain_http)
        if as_json:
            emit_json(
                {"reference": source, "manifest_digest": remote.manifest_digest,
                 "annotations": remote.oci.annotations,
                 "manifest": remote.manifest.model_dump(mode="json"), "verified": False,
                 "working_sets": sets.model_dump(mode="json")}
            )  # fmt: skip
            return
        _show(source, remote.manifest, False, brief, sets=_sets_text(sets))
        return
    from snapctl.cli.remote import agent_client, call

    client = agent_client() if Path(source).is_dir() else None
    if client is None:
        from snapctl.images.catalog import inspect_record

        image = require_image(source, restore=False)
        record = inspect_record(image, verify, StateDir())
    else:
        query = f"?image={quote(str(Path(source).absolute()))}" + ("&verify=1" if verify else "")
        record = call(client, "GET", f"/images/inspect{query}")
    if as_json:
        emit_json(record)
        return
    from snapctl.images import Manifest

    _show(source, Manifest.model_validate(record["manifest"]), verify, brief)


def _sets_text(sets: AttachedSets) -> str:
    if sets.error is not None:
        return f"not readable ({sets.error})"
    if not sets.artifacts:
        return "none attached (a push after lazy copies attaches them)"
    artifacts = "1 artifact" if sets.artifacts == 1 else f"{sets.artifacts} artifacts"
    return f"{sets.pages:,} pages attached ({artifacts})"


def _show(where: str, manifest: Manifest, verify: bool, brief: bool,
          sets: str | None = None) -> None:  # fmt: skip
    console = stdout()
    console.print(_summary(where, manifest, verify, sets))
    if brief:
        return
    console.print(_processes(manifest))
    console.print(_files(manifest))
    console.print(_identity(manifest))
    console.print(_depends(manifest))
    console.print(_stats(manifest))


def _table(title: str, *columns: str) -> Any:
    from rich.table import Table

    table = Table(title=title, show_header=bool(columns), title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


def _summary(image: str, manifest: Manifest, verify: bool, sets: str | None) -> Any:
    from snapctl.criu.external import host_mounts

    table = _table(f"image {manifest.image_id}")
    table.add_column()
    table.add_column()
    for label, value in [
        ("path", image),
        ("schema", str(manifest.schema_version)),
        ("created", manifest.created),
        ("capture id", manifest.capture_id),
        ("snapctl", manifest.snapctl_version),
        ("criu", manifest.criu_version),
        ("kernel", manifest.kernel),
        ("server", " ".join(manifest.server_argv)),
        ("cwd", manifest.server_cwd),
        ("environment", _environment(manifest)),
        ("binds", f"{manifest.host or '(server default)'}:{manifest.port}"),
        ("native step", manifest.native_step),
        ("memory policy", _memory_policy(manifest)),
        ("host mounts", ", ".join(host_mounts(manifest.external_mounts)) or "none"),
        ("files", f"{len(manifest.files)} ({manifest.total_bytes / 1e6:.1f} MB)"),
        ("oracle", f"{manifest.oracle.token_ids} {manifest.oracle.text!r}"),
        ("verified", "yes, every sha256 matches" if verify else "not checked (--verify)"),
        *([("working sets", sets)] if sets is not None else []),
    ]:
        table.add_row(label, value)
    return table


def _environment(manifest: Manifest) -> str:
    """The names (never the values) of the server's environment, which the image holds."""
    from snapctl.activation.environment import captured_names, secret_looking

    names, complete = captured_names(manifest)
    secrets = secret_looking(names)
    flagged = f"; looking secret: {' '.join(secrets)}" if secrets else ""
    if not complete:
        return ("not recorded: captured with the caller's whole environment, in the image's "
                f"memory; its identity records {' '.join(names) or 'none'}{flagged}")  # fmt: skip
    return (f"{len(names)} variables, in the image's memory (names only): {' '.join(names)}"
            f"{flagged}")  # fmt: skip


def _memory_policy(manifest: Manifest) -> str:
    facts = manifest.capture_facts
    if facts is None:
        return "not stated by the server"
    if facts.memory_policy == "in-image":
        text = "in-image (the weights come back with the pages; a recovery reads no file)"
    else:
        digests = ", digests compared" if facts.reload_digests else ""
        text = f"reload (every recovery reads the weights files{digests})"
    return f"{text}; {len(facts.parameter_digests)} first-load digests recorded"


def _processes(manifest: Manifest) -> Any:
    table = _table("process tree (host PIDs at capture)", "pid", "ppid", "name", "threads", "cmd")
    for process in manifest.process_tree:
        table.add_row(
            str(process.pid), str(process.ppid), process.name, str(process.threads),
            " ".join(process.cmdline),
        )  # fmt: skip
    return table


def _files(manifest: Manifest) -> Any:
    table = _table("image files", "file", "bytes", "sha256", "link group")
    for name, entry in sorted(manifest.files.items()):
        group = "" if entry.link_group is None else str(entry.link_group)
        table.add_row(name, str(entry.size), entry.sha256[:16], group)
    return table


def _identity(manifest: Manifest) -> Any:
    identity = manifest.identity
    table = _table("identity (checked by every copy; * shown, never refuses)")
    table.add_column()
    table.add_column()
    if identity is None:
        table.add_row("identity", "not recorded (schema 1 image)")
        return table
    features = identity.kernel_features
    for label, value in [
        ("kernel", identity.kernel),
        ("kernel features", "not recorded" if features is None else " ".join(features)),
        ("criu", identity.criu_version),
        ("cpu", f"{identity.cpu_vendor} {identity.cpu_model}"),
        ("cpu flags", " ".join(identity.cpu_flags)),
        ("host id *", identity.host_id),
        ("hostname *", identity.hostname),
        ("python", identity.python_version),
        ("argv", " ".join(identity.argv)),
        ("env *", f"{len(identity.env)} variables at capture (values salted sha256): "
                  + " ".join(identity.env)),
    ]:  # fmt: skip
        table.add_row(label, value)
    table.add_row("files", f"{len(identity.files)} outside the image (listed below)")
    return table


def _depends(manifest: Manifest) -> Any:
    table = _table("files outside the image the tree had mapped or open", "path", "bytes",
                   "sha256")  # fmt: skip
    for record in manifest.identity.files if manifest.identity else []:
        table.add_row(record.path, str(record.size), record.sha256[:16])
    return table


def _stats(manifest: Manifest) -> Any:
    table = _table("criu dump statistics")
    table.add_column()
    table.add_column()
    table.add_row("dump wall time", f"{manifest.dump_seconds * 1000:.1f} ms")
    for name, value in manifest.dump_stats.model_dump().items():
        shown = f"{value / 1000:.1f} ms" if name.endswith("_us") else str(value)
        table.add_row(name.removesuffix("_us"), shown)
    return table
