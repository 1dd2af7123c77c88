"""Images on this host: listing an image root (without hashing anything), an image's record for
``inspect`` (its manifest, verified when asked) and removing an image no copy holds."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from snapctl.images.lock import hold_image
from snapctl.images.manifest import MANIFEST_NAME
from snapctl.images.store import ImageError, is_verified, load_manifest
from snapctl.statedir import StateDir, state_dir

IMAGE_ROOT_ENV = "SNAPCTL_IMAGE_ROOT"


def default_image_root() -> Path:
    """``$SNAPCTL_IMAGE_ROOT``, else ``images/`` in the state directory."""
    configured = os.environ.get(IMAGE_ROOT_ENV)
    return Path(configured).absolute() if configured else state_dir() / "images"


class ImageSummary(BaseModel):
    """One row of ``snapctl images``."""

    model_config = ConfigDict(extra="forbid")

    path: str
    image_id: str | None
    created: str | None
    server: str | None
    bytes: int | None
    criu_version: str | None
    schema_version: int | None
    verified: bool
    problem: str | None = None
    reference: str | None = None  # pulled images: the references they were pulled by


def server_summary(argv: list[str]) -> str:
    """A short name for the captured server: the program (or ``python -m MODULE``), its leading
    positional words (``serve MODEL``) and the value of ``--model`` when there is one."""
    if not argv:
        return "-"
    parts, rest = [Path(argv[0]).name], argv[1:]
    if len(rest) > 1 and rest[0] == "-m":
        parts.append(f"-m {rest[1]}")
        rest = rest[2:]
    for word in rest[:2]:
        if word.startswith("-"):
            break
        parts.append(word)
    for index, word in enumerate(rest):
        if word == "--model" and index + 1 < len(rest):
            parts.append(f"--model {rest[index + 1]}")
            break
        if word.startswith("--model="):
            parts.append(f"--model {word.removeprefix('--model=')}")
            break
    return " ".join(parts)


def summarize(image: Path, cache_dir: Path) -> ImageSummary:
    """Read one image's manifest (never its files' contents)."""
    try:
        manifest = load_manifest(image)
    except ImageError as error:
        return ImageSummary(
            path=str(image), image_id=None, created=None, server=None, bytes=None,
            criu_version=None, schema_version=None, verified=False, problem=error.message,
        )  # fmt: skip
    return ImageSummary(
        path=str(image),
        image_id=manifest.image_id,
        created=manifest.created,
        server=server_summary(manifest.server_argv),
        bytes=manifest.total_bytes,
        criu_version=manifest.criu_version,
        schema_version=manifest.schema_version,
        verified=is_verified(image, manifest, cache_dir),
    )


def list_images(root: Path, cache_dir: Path) -> list[ImageSummary]:
    """Every image directory directly below ``root`` (those with a manifest), by name.

    ``verified`` means a full verification is cached and no file changed since (as ``copy``
    would find it); nothing is hashed here.
    """
    if not root.is_dir():
        return []
    images = sorted(
        entry
        for entry in root.iterdir()
        if not entry.name.startswith(".") and entry.is_dir() and (entry / MANIFEST_NAME).exists()
    )
    return [summarize(image, cache_dir) for image in images]


def remove_image(image: Path) -> None:
    """Delete a published image; refuse while anything holds it (a copy, an export)."""
    image = image.absolute()
    if not (image / MANIFEST_NAME).is_file():
        raise ImageError(f"{image} is not a published image (no {MANIFEST_NAME})", path=image)
    with hold_image(image, exclusive=True):
        # Unpublish by one rename first: a crash mid-delete leaves a hidden leftover, never a
        # half image under the published name.
        doomed = image.parent / f".{image.name}.removing-{uuid.uuid4().hex[:8]}"
        os.rename(image, doomed)
    try:
        shutil.rmtree(doomed)
    except OSError as error:
        raise ImageError(
            f"{image} was unpublished but {doomed} could not be deleted: {error.strerror}",
            path=doomed,
        ) from error


def inspect_record(image: Path, verify: bool, state: StateDir) -> dict[str, Any]:
    """``inspect --json``'s record of a local image (the agent answers ``GET
    /v1/images/inspect`` with the same); ``verify`` hashes every file and records it in
    ``state``, where ``snapctl images`` reads it."""
    from snapctl.images.store import record_verified, verify_image

    if verify:
        manifest = verify_image(image)  # always a full hash when asked, cache or not
        state.ensure()
        record_verified(image, manifest, state.verified)  # so `snapctl images` shows it
    else:
        manifest = load_manifest(image)
    return {"path": str(image.absolute()), "manifest": manifest.model_dump(mode="json"),
            "verified": verify}  # fmt: skip
