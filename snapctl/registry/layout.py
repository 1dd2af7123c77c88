"""The OCI form of a snapctl image: an OCI image manifest whose config blob maps every image
file to the blobs that hold it.

Blobs, in the manifest's ``layers`` order:

- ``manifest.json`` of the image (snapctl's own manifest, with every file's sha256), alone, so
  ``inspect REF`` reads it without any page data;
- the small files (everything under ``SMALL_FILE_BYTES``: CRIU's core, mm, fd images, the
  saved ``/dev/shm``, logs), concatenated into one blob;
- page data and other large files as content-defined chunks (see :mod:`.chunks`), each its own
  blob, so an image pushed again after a re-bake uploads only chunks the repository lacks.

Manifest annotations use the names CRI-O and Podman checkpoint images use (checkpointctl's
``org.criu.checkpoint.*``) where they mean the same.
"""

from __future__ import annotations

import platform
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from snapctl.images.manifest import is_safe_relative
from snapctl.models import StrictModel
from snapctl.registry.chunks import MAX_CHUNK

OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE: Final = "application/vnd.snapctl.image.v1"
CONFIG_MEDIA_TYPE = "application/vnd.snapctl.image.config.v1+json"
IMAGE_MANIFEST_MEDIA_TYPE = "application/vnd.snapctl.image.manifest.v1+json"
SMALL_FILES_MEDIA_TYPE = "application/vnd.snapctl.image.files.v1"
CHUNK_MEDIA_TYPE = "application/vnd.snapctl.image.chunk.v1"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"

# Files at least this large are chunked; the rest travel together in one blob.
SMALL_FILE_BYTES = 1 << 20
# Bounds on what is read whole into memory.
MAX_OCI_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 64 << 20

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"


class Descriptor(StrictModel):
    """An OCI content descriptor."""

    mediaType: str
    digest: str = Field(pattern=DIGEST_PATTERN)
    size: int = Field(ge=0)
    annotations: dict[str, str] | None = None


class OciManifest(BaseModel):
    """The OCI image manifest of a snapctl image (other fields a registry keeps are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    schemaVersion: Literal[2]
    mediaType: Literal["application/vnd.oci.image.manifest.v1+json"]
    artifactType: Literal["application/vnd.snapctl.image.v1"]
    config: Descriptor
    layers: list[Descriptor]
    annotations: dict[str, str] = {}

    @model_validator(mode="after")
    def _check(self) -> OciManifest:
        if self.config.mediaType != CONFIG_MEDIA_TYPE:
            raise ValueError(
                f"config media type is {self.config.mediaType}, not {CONFIG_MEDIA_TYPE}"
            )
        if not self.layers or self.layers[0].mediaType != IMAGE_MANIFEST_MEDIA_TYPE:
            raise ValueError("the first layer must be the image's manifest.json")
        return self


class Chunk(StrictModel):
    """One content-defined piece of a large file (never above the cutter's largest)."""

    digest: str = Field(pattern=DIGEST_PATTERN)
    size: int = Field(gt=0, le=MAX_CHUNK)


class StoredFile(StrictModel):
    """Where one image file's bytes are: a range of the small-files blob, a list of chunks,
    or (a hard link) another file of the image.

    A file's chunks are its bytes in order, one after the other: adding up to its size is
    covering ``[0, size)`` exactly once. A chunk may appear any number of times (a run of
    zero pages is one chunk, repeated), so what a file costs to write is its size, not the
    size of its distinct chunks: :meth:`ImageConfig.written_bytes` is what a pull bounds.
    """

    name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    mode: int = Field(ge=0, le=0o7777)
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)
    offset: int | None = Field(default=None, ge=0)  # in the small-files blob
    chunks: list[Chunk] | None = None
    link_to: str | None = None

    @model_validator(mode="after")
    def _check(self) -> StoredFile:
        placements = [self.offset is not None, self.chunks is not None, self.link_to is not None]
        if sum(placements) != 1:
            raise ValueError(f"{self.name}: exactly one of offset, chunks, link_to")
        if not is_safe_relative(self.name):
            raise ValueError(f"file name {self.name!r} is not a plain path inside the image")
        if self.chunks is not None and sum(c.size for c in self.chunks) != self.size:
            raise ValueError(f"{self.name}: chunks do not add up to its size")
        return self


class StoredDirectory(StrictModel):
    name: str
    mode: int = Field(ge=0, le=0o7777)


class ImageConfig(StrictModel):
    """The config blob: the image's id, its manifest.json blob, and where every file is."""

    version: Literal[1] = 1
    image_id: str
    manifest_digest: str = Field(pattern=DIGEST_PATTERN)
    small_files_digest: str = Field(pattern=DIGEST_PATTERN)
    small_files_size: int = Field(ge=0)
    directories: list[StoredDirectory]
    files: list[StoredFile]

    @model_validator(mode="after")
    def _check(self) -> ImageConfig:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        directories = [d.name for d in self.directories]
        if len(set(directories)) != len(directories):
            raise ValueError("a directory is listed twice")
        for name in directories:
            if not is_safe_relative(name):
                raise ValueError(f"directory name {name!r} is not a plain path inside the image")
        # The small files are the small-files blob, one after the other in the files' order
        # (as a push concatenates them): each of its bytes is written once.
        end = 0
        for stored in self.files:
            if stored.offset is None:
                continue
            if stored.offset + stored.size > self.small_files_size:
                raise ValueError(f"{stored.name}: outside the small-files blob")
            if stored.offset != end:
                raise ValueError(f"{stored.name}: the small files do not follow one another in "
                                 "the small-files blob")  # fmt: skip
            end += stored.size
        if end != self.small_files_size:
            raise ValueError("the small files do not fill the small-files blob")
        return self

    def written_bytes(self) -> int:
        """The bytes a pull writes for the files (a hard link writes none)."""
        return sum(f.size for f in self.files if f.link_to is None)

    def chunk_digests(self) -> dict[str, int]:
        """Every chunk blob the image needs -> its size (first appearance order)."""
        out: dict[str, int] = {}
        for stored in self.files:
            for chunk in stored.chunks or []:
                out.setdefault(chunk.digest, chunk.size)
        return out


def manifest_annotations(
    *, criu_version: str, kernel: str, snapctl_version: str, image_id: str, created: str
) -> dict[str, str]:
    """The manifest's annotations: checkpointctl's names where they mean the same."""
    return {
        "org.criu.checkpoint.engine.name": "snapctl",
        "org.criu.checkpoint.engine.version": snapctl_version,
        "org.criu.checkpoint.criu.version": criu_version,
        "org.criu.checkpoint.host.arch": _oci_arch(platform.machine()),
        "org.criu.checkpoint.host.kernel": kernel,
        "io.snapctl.image.id": image_id,
        CREATED: created,
    }


def _oci_arch(machine: str) -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
