"""Which image a parked copy was restored from, whether the image there is still it, and which
requests fit how it was restored. Shared: the agent's pool (which copy to take) and a parked
copy's supervisor (whether to activate) ask the same questions."""

from __future__ import annotations

import hashlib
from pathlib import Path

from snapctl.activation.requests import CopyRequest
from snapctl.images import ImageError, Manifest, load_manifest
from snapctl.images.manifest import MANIFEST_NAME


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


def manifest_stat(image: Path) -> tuple[int, ...] | None:
    """The manifest file's stat (device, inode, size, times): another one once a publication
    renamed a new manifest in; None if there is none."""
    try:
        st = (image / MANIFEST_NAME).stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def restore_fits(parked: CopyRequest, request: CopyRequest) -> str | None:
    """Why ``request`` cannot be served by a copy restored for ``parked``; None if it can."""
    fields = ("image", "host", "port", "server_argv", "allow_mismatch", "native", "criu_path",
              "into_container")  # fmt: skip
    for field in fields:
        if getattr(parked, field) != getattr(request, field):
            return f"{field} differs from the parked copy's"
    if request.lazy is not None and request.lazy != parked.lazy:
        return "lazy differs from the parked copy's"
    for limit in ("memory_bytes", "cpus"):  # none asked: the pool's limits serve
        asked = getattr(request, limit)
        if asked is not None and asked != getattr(parked, limit):
            return f"{limit} differs from the parked copy's"
    if request.count != 1:
        return "a parked copy serves one copy"
    return None
