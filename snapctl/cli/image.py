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


@click.group()
def image() -> None:
    """Export, import or remove an image."""


@contextmanager
def byte_progress(label: str, total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over ``total`` bytes on stderr, only on a terminal and unless quiet."""
    from snapctl.cli.output import stderr

    console = stderr()
    if quiet or not console.is_terminal:
        yield lambda done: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda done: progress.advance(task, done)


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
    from snapctl.supervision.state import StateDir

    state = StateDir()
    state.ensure()
    with byte_progress("import", archive.stat().st_size, quiet=as_json) as progress:
        report = import_image(archive, to, force=force, cache_dir=state.verified, progress=progress)
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
