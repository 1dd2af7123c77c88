"""``snapctl inspect``: show an image's manifest, and verify every file with --verify."""

from __future__ import annotations

from pathlib import Path

import click

from snapctl.cli.output import emit_json, json_option, stdout


@click.command()
@click.argument("image", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--verify", is_flag=True, help="Check every file's size and sha256.")
@json_option
def inspect(image: Path, verify: bool, as_json: bool) -> None:
    """Show an image's manifest (and verify it)."""
    from snapctl.images import load_manifest, verify_image

    manifest = verify_image(image) if verify else load_manifest(image)
    if as_json:
        emit_json({"manifest": manifest.model_dump(mode="json"), "verified": verify})
        return
    from rich.table import Table

    table = Table(title=f"image {manifest.image_id}", show_header=False)
    for label, value in [
        ("path", str(image)),
        ("created", manifest.created),
        ("capture id", manifest.capture_id),
        ("criu", manifest.criu_version),
        ("kernel", manifest.kernel),
        ("server", " ".join(manifest.server_argv)),
        ("processes", ", ".join(f"{p.pid}:{p.name}" for p in manifest.process_tree)),
        ("files", f"{len(manifest.files)} ({manifest.total_bytes / 1e6:.1f} MB)"),
        ("frozen", f"{manifest.dump_stats.frozen_time_us / 1000:.1f} ms"),
        ("oracle", f"{manifest.oracle.token_ids} {manifest.oracle.text!r}"),
        ("verified", "yes, every sha256 matches" if verify else "not checked (--verify)"),
    ]:
        table.add_row(label, value)
    stdout().print(table)
