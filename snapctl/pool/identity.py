"""Which image a parked copy was restored from, and whether the image there is still it."""

from __future__ import annotations

import hashlib
from pathlib import Path

from snapctl.images import ImageError, Manifest, load_manifest


def manifest_digest(manifest: Manifest) -> str:
    """A digest of everything the manifest says (the files' sizes and hashes included)."""
    return "sha256:" + hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()


def published_identity(image: Path) -> tuple[str, str] | None:
    """``(image_id, manifest digest)`` of the image published at ``image`` now; None if none
    is (removed, or being replaced)."""
    try:
        manifest = load_manifest(image)
    except (ImageError, OSError):
        return None
    return manifest.image_id, manifest_digest(manifest)
