"""What pulls keep under the state directory: verified blobs by digest, partial downloads to
resume, and pulled images with the references they were pulled by.

```
STATE/cache/blobs/sha256/HEX           a blob whose bytes matched its digest
STATE/cache/blobs/sha256/HEX.partial   the first bytes of one being downloaded
STATE/cache/images/sha256-HEX/         an image pulled by a manifest of that digest (all of it)
STATE/cache/images/sha256-HEX.pull.json     which references named it (``PullRecord``)
```

A blob enters the cache only by a rename after its digest matched, so a blob present is a blob
verified; a partial holds only bytes received in order, and its digest is checked when it is
complete. Nothing unverified is ever kept once a pull fails on it.

A pulled image is named by the whole sha256 of its manifest and reused only when its record
names that same digest: a shorter name would let two manifests share one entry. Entries that
earlier versions named by 16 hex digits are never taken for a digest: they are listed, and
removed like any image, but a pull by reference makes its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from pydantic import ValidationError

from snapctl.models import StrictModel
from snapctl.protocol.atomic import fsync_directory, replace_file
from snapctl.statedir import StateDir

PIECE = 4 << 20
_MANIFEST_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class PullRecord(StrictModel):
    """``NAME.pull.json`` beside a pulled image."""

    version: int = 1
    manifest_digest: str
    image_id: str
    references: list[str]
    pulled: str


class BlobCache:
    """Verified blobs by digest (``sha256:HEX``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        return self.root / "sha256" / digest.removeprefix("sha256:")

    def partial(self, digest: str) -> Path:
        return self.path(digest).with_suffix(".partial")

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def ensure(self) -> None:
        (self.root / "sha256").mkdir(parents=True, exist_ok=True, mode=0o700)

    def adopt(self, digest: str, partial: Path) -> None:
        """Publish a completed, verified download under its digest."""
        fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, self.path(digest))
        fsync_directory(self.path(digest).parent)

    def put(self, digest: str, data: bytes) -> None:
        """Keep a small blob fetched whole (already verified by the caller)."""
        self.ensure()
        replace_file(self.path(digest), data)

    def read(self, digest: str) -> bytes | None:
        """A cached blob's bytes if they still match the digest (else it is dropped)."""
        try:
            data = self.path(digest).read_bytes()
        except OSError:
            return None
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            self.drop(digest)
            return None
        return data

    def drop(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(digest).unlink()


def cache_root(state: StateDir) -> Path:
    return state.root / "cache"


def blob_cache(state: StateDir) -> BlobCache:
    return BlobCache(cache_root(state) / "blobs")


def pulled_root(state: StateDir) -> Path:
    return cache_root(state) / "images"


def pulled_image(state: StateDir, manifest_digest: str) -> Path:
    """Where the image of a manifest digest (``sha256:`` and 64 hex digits) is kept once
    pulled: named by the whole digest."""
    if not _MANIFEST_DIGEST.fullmatch(manifest_digest):
        raise ValueError(f"not a sha256 manifest digest: {manifest_digest!r}")
    return pulled_root(state) / f"sha256-{manifest_digest.removeprefix('sha256:')}"


def pulled_record(image: Path, manifest_digest: str) -> PullRecord | None:
    """The record of ``image`` if it says the image was pulled by exactly that manifest
    digest (else None: not this image, or no record of what it is)."""
    record = read_record(image)
    return record if record is not None and record.manifest_digest == manifest_digest else None


def record_path(image: Path) -> Path:
    return image.with_name(image.name + ".pull.json")


def read_record(image: Path) -> PullRecord | None:
    try:
        return PullRecord.model_validate_json(record_path(image).read_bytes())
    except (OSError, ValidationError):
        return None


def write_record(image: Path, *, manifest_digest: str, image_id: str, reference: str,
                 pulled: str) -> None:  # fmt: skip
    """Remember (again) that ``reference`` named this image."""
    old = read_record(image)
    references = [] if old is None or old.manifest_digest != manifest_digest else old.references
    if reference not in references:
        references = [*references, reference]
    record = PullRecord(manifest_digest=manifest_digest, image_id=image_id,
                        references=references, pulled=pulled)  # fmt: skip
    replace_file(record_path(image), record.model_dump_json().encode())
