"""``snapctl images``: list the images in an image root."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from snapctl.cli.output import json_option

if TYPE_CHECKING:
    pass


@click.command()
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="Directory holding image directories (default: $SNAPCTL_IMAGE_ROOT, "
                   "else images/ in the state directory).")  # fmt: skip
@json_option
def images(root: Path | None, as_json: bool) -> None:
    """List the images in an image root.

    Without --root, the images pulled into the local image cache are listed too, by the
    references they were pulled by.
    """
    from snapctl.cli.remote import agent_client, call, namespace
    from snapctl.plain import emit_json

    client = agent_client()
    if client is None:
        from snapctl.images.catalog import default_image_root
        from snapctl.registry.source import image_records
        from snapctl.statedir import StateDir

        records = image_records(root, StateDir(), default_image_root())
    else:
        records = call(client, "GET", f"/images{images_query(root)}")
    if as_json:
        emit_json(records)
        return
    render(namespace(records))
    if not records:
        from snapctl.cli.output import note

        # An image captured to a path of the user's choosing is not in the default root.
        where = str(root) if root is not None else "the image root or the pull cache"
        note(f"no images in {where} (one in another directory: snapctl images --root DIR)")


def images_query(root: Path | None) -> str:
    """``GET /v1/images``'s query for ``--root``; without it, this process's
    ``$SNAPCTL_IMAGE_ROOT`` if set (the agent's environment is not the caller's)."""
    import os
    from urllib.parse import quote

    from snapctl.images.catalog import IMAGE_ROOT_ENV

    if root is not None:
        return f"?root={quote(str(root.absolute()))}"
    configured = os.environ.get(IMAGE_ROOT_ENV)
    return f"?default_root={quote(str(Path(configured).absolute()))}" if configured else ""


def render(rows: list[Any]) -> None:
    from rich.table import Table

    from snapctl.cli.output import stdout

    table = Table()
    for column in ("image", "id", "created", "server", "size", "criu", "verified"):
        table.add_column(column)
    for row in rows:
        # A pulled image is shown by the references it was pulled by.
        name = row.reference or Path(row.path).name
        if row.problem:
            table.add_row(name, "-", "-", row.problem, "-", "-", "no")
            continue
        table.add_row(
            name,
            (row.image_id or "")[:12],
            row.created or "-",
            row.server or "-",
            f"{(row.bytes or 0) / 1e6:.1f} MB",
            row.criu_version or "-",
            "yes" if row.verified else "no",
        )
    stdout().print(table)
