"""``snapctl image``: export, import and remove image directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from snapctl.cli.output import json_option

if TYPE_CHECKING:
    from snapctl.images.archive import ArchiveReport
    from snapctl.registry.pull import PullReport
    from snapctl.registry.push import PushReport

plain_http_option = click.option(
    "--plain-http", is_flag=True, help="Speak HTTP, not HTTPS, to the registry (no TLS)."
)
jobs_option = click.option(
    "--jobs", default=8, show_default=True, type=click.IntRange(1, 64),
    help="Blobs transferred at once.",
)  # fmt: skip
policy_option = click.option(
    "--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Trust policy, containers-policy.json(5) [default: /etc/containers/policy.json, "
         "else every image is accepted].",
)  # fmt: skip


@click.group()
def image() -> None:
    """Export, import, push, pull, sign, verify or remove an image."""


@contextmanager
def transfer_progress(
    label: str, total: int | None, *, quiet: bool
) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """A rich progress bar of bytes and rate on stderr, only on a terminal and unless quiet:
    ``(advance, set_total)``, both thread-safe (rich locks its tasks); ``total`` may be set
    once it is known."""
    from snapctl.cli.output import stderr

    console = stderr()
    if quiet or not console.is_terminal:
        yield (lambda done: None), (lambda size: None)
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield (
            (lambda done: progress.advance(task, done)),
            (lambda size: progress.update(task, total=size)),
        )


@contextmanager
def byte_progress(label: str, total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over ``total`` bytes on stderr, only on a terminal and unless quiet."""
    with transfer_progress(label, total, quiet=quiet) as (advance, _):
        yield advance


def warn_secret_env(directory: Path) -> None:
    """On stderr (not in --json's record), whatever the output: the names in the image's
    server's environment that look secret, whose values its memory carries along."""
    from snapctl.activation.environment import secret_env_warning
    from snapctl.cli.output import stderr
    from snapctl.images import load_manifest

    warning = secret_env_warning(load_manifest(directory), str(directory))
    if warning is not None:
        stderr().print(warning, style="yellow", markup=False, highlight=False)


def render(report: ArchiveReport) -> None:
    """The human form of an export or import report."""
    from snapctl.cli.output import stdout

    verb = "exported" if report.action == "export" else "imported"
    stdout().print(
        f"{verb} image {report.image_id}: {report.image_bytes / 1e6:.1f} MB in {report.files} "
        f"files, archive {report.archive_bytes / 1e6:.1f} MB, {report.seconds:.2f} s "
        f"({report.mb_per_s:.1f} MB/s)\n  image   {report.image}\n  archive {report.archive}\n"
        f"  manifest sha256 {report.manifest_sha256}"
    )


@image.command("export")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Archive to write (FILE.tar.zst); appears only when complete.",
)
@click.option("--force", is_flag=True, help="Replace an existing archive.")
@click.option(
    "--level",
    default=3,
    show_default=True,
    type=click.IntRange(1, 19),
    help="zstd compression level.",
)
@click.option(
    "--threads",
    default=-1,
    show_default=True,
    type=int,
    help="zstd worker threads (-1: one per CPU).",
)
@json_option
def export(directory: Path, out: Path, force: bool, level: int, threads: int,
           as_json: bool) -> None:  # fmt: skip
    """Write an image to one verified .tar.zst archive."""
    from snapctl.cli.output import emit_json
    from snapctl.images import load_manifest
    from snapctl.images.archive import export_image
    from snapctl.images.manifest import MANIFEST_NAME

    warn_secret_env(directory)
    # The progress bar counts what export hashes: every file, the manifest included.
    total = load_manifest(directory).total_bytes + (directory / MANIFEST_NAME).stat().st_size
    with byte_progress("export", total, quiet=as_json) as progress:
        report = export_image(
            directory, out, force=force, level=level, threads=threads, progress=progress
        )
    if as_json:
        emit_json(report)
    else:
        render(report)


@image.command("import")
@click.argument("archive", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Image directory to create (must not exist unless --force).",
)
@click.option(
    "--force", is_flag=True, help="Replace an existing image (not while a copy holds it)."
)
@json_option
def import_(archive: Path, to: Path, force: bool, as_json: bool) -> None:
    """Unpack and verify an image archive, then publish it atomically."""
    from snapctl.cli.output import emit_json
    from snapctl.images.archive import import_image
    from snapctl.statedir import StateDir

    state = StateDir()
    state.ensure()
    with byte_progress("import", archive.stat().st_size, quiet=as_json) as progress:
        report = import_image(
            archive, to, force=force, cache_dir=state.verified, progress=progress,
            claims=state.claims,
        )  # fmt: skip
    if as_json:
        emit_json(report)
    else:
        render(report)


@image.command("rm")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@json_option
def rm(directory: Path, as_json: bool) -> None:
    """Delete an image (refused while a copy or export holds it)."""
    from snapctl.cli.output import emit_json, stdout
    from snapctl.images.catalog import remove_image

    remove_image(directory)
    if as_json:
        emit_json({"removed": str(directory.absolute())})
    else:
        stdout().print(f"removed {directory.absolute()}")


def working_sets_line(report: PushReport | PullReport) -> str:
    """How the working sets fared: they are a hint, so a failure is a note, not an error."""
    sets, pushed = report.working_sets, report.action == "push"
    if sets.error is not None:
        verb, image = ("attached", "pushed") if pushed else ("adopted", "pulled")
        return f"  working sets: not {verb} ({sets.error}); the image was {image}"
    if sets.processes == 0:
        return ("  working sets: none learned here yet (a lazy copy of the image learns them)"
                if pushed else "  working sets: none attached to the image")  # fmt: skip
    processes = "1 process" if sets.processes == 1 else f"{sets.processes} processes"
    if pushed:
        return f"  working sets: {processes}, {sets.pages:,} pages attached"
    return f"  working sets: {processes} adopted, {sets.pages:,} pages new here"


def render_push(report: PushReport) -> None:
    from snapctl.cli.output import stdout

    stdout().print(
        f"pushed image {report.image_id} to {report.reference}: "
        f"{report.image_bytes / 1e6:.1f} MB in {report.files} files, {report.seconds:.2f} s "
        f"({report.mb_per_s:.1f} MB/s)\n  uploaded {report.blobs_uploaded} of {report.blobs} "
        f"blobs ({report.bytes_uploaded / 1e6:.1f} MB), "
        f"{report.blobs - report.blobs_uploaded} already in the repository\n"
        f"  digest {report.manifest_digest}\n{working_sets_line(report)}",
        markup=False, highlight=False,
    )  # fmt: skip


def render_pull(report: PullReport) -> None:
    from snapctl.cli.output import stdout

    if report.already_pulled:
        stdout().print(
            f"image {report.image_id} of {report.reference} is already pulled and "
            f"verified\n  image  {report.image}",
            markup=False,
            highlight=False,
        )
        return
    stdout().print(
        f"pulled image {report.image_id} from {report.reference}: "
        f"{report.image_bytes / 1e6:.1f} MB in {report.files} files, {report.seconds:.2f} s "
        f"({report.mb_per_s:.1f} MB/s)\n  fetched {report.blobs_fetched} blobs "
        f"({report.bytes_fetched / 1e6:.1f} MB, {report.bytes_resumed / 1e6:.1f} MB resumed), "
        f"{report.blobs_cached} were in the cache\n  image  {report.image}\n"
        f"  digest {report.manifest_digest}\n{working_sets_line(report)}{policy_line(report)}",
        markup=False, highlight=False,
    )  # fmt: skip


def policy_line(report: PullReport) -> str:
    """Which rule of the trust policy accepted the pulled image ("" when none was asked)."""
    if report.verdict is None:
        return ""
    return (f"\n  policy: accepted by {report.verdict['scope']} "
            f"({report.verdict['requirement']}) of {report.verdict['policy']}")  # fmt: skip


def image_directory(source: str, *, plain_http: bool, quiet: bool,
                    policy_path: Path | None = None) -> Path:  # fmt: skip
    """The image directory ``copy --image`` names: itself, or a reference pulled into the
    cache (with ``image pull``'s progress and lines) once the trust policy (``policy_path``,
    else the system's) accepts it."""
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


@image.command("push")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("reference")
@plain_http_option
@jobs_option
@json_option
def push(directory: Path, reference: str, plain_http: bool, jobs: int, as_json: bool) -> None:
    """Push an image to an OCI registry (REGISTRY/REPOSITORY:TAG), verifying every file.

    Page data travels as content-defined chunks: blobs the repository already holds are not
    uploaded again. Credentials come from the docker config ($DOCKER_CONFIG, ~/.docker) or
    SNAPCTL_REGISTRY_USERNAME/SNAPCTL_REGISTRY_PASSWORD.
    """
    from snapctl.cli.output import emit_json
    from snapctl.images import load_manifest
    from snapctl.images.manifest import MANIFEST_NAME
    from snapctl.registry.client import Reference, RegistryClient
    from snapctl.registry.push import push_image
    from snapctl.statedir import StateDir

    parsed = Reference.parse(reference)
    warn_secret_env(directory)
    client = RegistryClient(parsed, plain_http=plain_http)
    total = load_manifest(directory).total_bytes + (directory / MANIFEST_NAME).stat().st_size
    try:
        with byte_progress("push", total, quiet=as_json) as progress:
            report = push_image(directory, parsed, client, jobs=jobs, progress=progress,
                                views=StateDir().views)  # fmt: skip
    finally:
        client.close()
    if as_json:
        emit_json(report)
    else:
        render_push(report)


@image.command("pull")
@click.argument("reference")
@click.option(
    "--to", "to", required=True, type=click.Path(file_okay=False, path_type=Path),
    help="Image directory to create (must not exist unless --force).",
)  # fmt: skip
@click.option(
    "--force", is_flag=True, help="Replace an existing image (not while a copy holds it)."
)
@policy_option
@plain_http_option
@jobs_option
@json_option
def pull(reference: str, to: Path, force: bool, policy_path: Path | None, plain_http: bool,
         jobs: int, as_json: bool) -> None:  # fmt: skip
    """Pull an image from an OCI registry, verifying every blob, and publish it atomically.

    The trust policy is checked once the image's manifest digest is known, before any blob
    is fetched: an image it refuses is never published (exit 5). Blobs already in the local
    cache, and partial downloads, are not fetched again.
    """
    from snapctl.cli.output import emit_json, note
    from snapctl.registry.cache import blob_cache
    from snapctl.registry.client import Reference, RegistryClient
    from snapctl.registry.pull import pull_image
    from snapctl.statedir import StateDir
    from snapctl.trust.policy import load_policy

    policy = load_policy(policy_path)
    if policy.note:
        note(policy.note, quiet=as_json)
    state = StateDir()
    state.ensure()
    client = RegistryClient(Reference.parse(reference), plain_http=plain_http)
    try:
        with transfer_progress("pull", None, quiet=as_json) as (advance, set_total):
            report = pull_image(
                client, to, cache=blob_cache(state), verified_cache=state.verified,
                force=force, jobs=jobs, progress=advance, total=set_total, claims=state.claims,
                views=state.views, policy=policy,
            )  # fmt: skip
    finally:
        client.close()
    if as_json:
        emit_json(report)
    else:
        render_pull(report)


# --- signatures and the trust policy (snapctl.trust) ----------------------------------------


def key_passphrase(*, confirm: bool) -> bytes:
    """The key's passphrase: ``SNAPCTL_KEY_PASSWORD`` when set (empty is allowed, as cosign
    allows it), else asked for on the terminal (twice for a new key)."""
    import os

    from snapctl.trust.keys import PASSWORD_ENV

    given = os.environ.get(PASSWORD_ENV)
    if given is not None:
        return given.encode()
    entered: str = click.prompt(
        "Passphrase for the new private key" if confirm else "Passphrase for the private key",
        hide_input=True, confirmation_prompt="Enter it again" if confirm else False,
        err=True,
    )  # fmt: skip
    return entered.encode()


@image.command("keygen")
@click.argument("prefix", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def keygen(prefix: Path, as_json: bool) -> None:
    """Make a signing key pair in cosign's formats: PREFIX.key and PREFIX.pub.

    PREFIX.key is the private key (ECDSA P-256), encrypted as cosign encrypts it, mode 0600;
    PREFIX.pub is the public key (PEM), mode 0644. Neither may exist. The passphrase comes
    from SNAPCTL_KEY_PASSWORD, else it is asked for twice. cosign reads both files, and
    snapctl reads cosign's.
    """
    from snapctl.cli.output import emit_json, stdout
    from snapctl.trust.keys import fingerprint, generate, read_public_keys

    pair = generate(prefix, key_passphrase(confirm=True))
    record = {"private_key": str(pair.private.absolute()),
              "public_key": str(pair.public.absolute()),
              "key": fingerprint(read_public_keys(pair.public)[0])}  # fmt: skip
    if as_json:
        emit_json(record)
        return
    stdout().print(
        f"private key {record['private_key']} (encrypted, keep it secret)\n"
        f"public key  {record['public_key']} (key {record['key']}: give it to whoever "
        "verifies)", markup=False, highlight=False,
    )  # fmt: skip


@image.command("sign")
@click.argument("reference")
@click.option(
    "--key", "key_path", required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Private key file (cosign's, or made by image keygen).",
)  # fmt: skip
@plain_http_option
@json_option
def sign(reference: str, key_path: Path, plain_http: bool, as_json: bool) -> None:
    """Sign an image in a registry (REGISTRY/REPOSITORY:TAG or @DIGEST), as cosign does.

    The signature names the image's manifest digest and the reference as given; it is stored
    in the same repository under the tag sha256-<digest>.sig, where cosign, Podman, CRI-O and
    snapctl's trust policy find it. The passphrase comes from SNAPCTL_KEY_PASSWORD, else it is
    asked for.
    """
    from snapctl.cli.output import emit_json, stdout
    from snapctl.registry.client import Reference, RegistryClient
    from snapctl.trust.keys import load_private_key
    from snapctl.trust.sign import sign_image

    key = load_private_key(key_path, key_passphrase(confirm=False))
    client = RegistryClient(Reference.parse(reference), plain_http=plain_http)
    try:
        signed = sign_image(client, key)
    finally:
        client.close()
    if as_json:
        emit_json(signed.record())
        return
    done = "signed" if signed.added else "already signed by this key:"
    stdout().print(
        f"{done} {signed.reference} ({signed.manifest_digest})\n"
        f"  signed for {signed.signed_identity} with key {signed.key}\n"
        f"  stored at {signed.signature_reference} ({signed.signatures} "
        f"signature{'' if signed.signatures == 1 else 's'})",
        markup=False, highlight=False,
    )  # fmt: skip


@image.command("verify")
@click.argument("reference")
@policy_option
@plain_http_option
@json_option
def verify(reference: str, policy_path: Path | None, plain_http: bool, as_json: bool) -> None:
    """Check an image in a registry against the trust policy, as a pull would.

    Prints the rule that accepted it; a refusal names the rule and why, and exits 5.
    """
    from snapctl.cli.output import emit_json, stdout
    from snapctl.registry.client import Reference, RegistryClient
    from snapctl.trust.policy import load_policy, verify_pull
    from snapctl.trust.store import resolve

    policy = load_policy(policy_path)
    parsed = Reference.parse(reference)
    client = RegistryClient(parsed, plain_http=plain_http)
    try:
        verdict = verify_pull(policy, parsed, resolve(client), client)
    finally:
        client.close()
    if as_json:
        emit_json(verdict.record())
        return
    note = f"\n  note: {verdict.note}" if verdict.note else ""
    stdout().print(f"{verdict.reference}: {verdict.line()}{note}", markup=False,
                   highlight=False)  # fmt: skip
