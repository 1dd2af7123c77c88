"""Working sets travel with an image: ``image push`` attaches them as an OCI referrer of the
image's manifest, ``image pull`` (and ``copy --image REF``) adopts them.

Why: a lazy copy restores eagerly the pages that earlier copies of the same image touched on
their way to ready (:mod:`snapctl.criu.lazy.workingset`), learned on the host where those
copies ran. Without them a host's first lazy copy of a pulled image restores all its small
memory eagerly and is the slowest one (docs/lazy.md), on every host of a fleet.

How: the sets of the image's processes that this host learned are one JSON blob, put in an
artifact manifest whose ``subject`` is the image's OCI manifest. The image's manifest and its
digest do not change (digest pins and signatures hold), and the sets can be pushed again as
they grow. A pull finds such artifacts through the referrers API or, where the
registry has none, the referrers tag schema of OCI distribution 1.1 (an image index tagged
``sha256-<hex>``, which other tools' referrers, signatures say, share: their entries are
written back as they were read). The artifact has no timestamp: the same sets pushed again
are the same manifest, so pushes do not pile up referrers; of several, a pull takes the one
with the most pages (a host's sets only grow).

Best effort both ways: the sets are a hint (a page missing is a page fault, one too many is
restored early), so a failure here is reported and never fails the transfer, and a set whose
pagemap is not one of the image's own is ignored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from snapctl.criu.lazy.workingset import add_pages, pagemap_key, read_runs
from snapctl.errors import SnapctlError
from snapctl.models import StrictModel
from snapctl.registry import layout
from snapctl.registry.client import BlobMismatchError, RegistryClient

M = TypeVar("M", bound=BaseModel)

ARTIFACT_TYPE: Final = "application/vnd.snapctl.working-sets.v1"
BLOB_MEDIA_TYPE: Final = "application/vnd.snapctl.working-sets.v1+json"
INDEX_MEDIA_TYPE: Final = "application/vnd.oci.image.index.v1+json"
EMPTY_MEDIA_TYPE: Final = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG: Final = b"{}"
PAGES_ANNOTATION: Final = "io.snapctl.working-sets.pages"
# Bounds on what is read whole: an index lists referrers; a blob holds sets of at most
# MAX_SET_PAGES pages (room for the weights of a model whose recovery reads them whole) for at
# most MAX_PROCESSES processes. A bigger set stays on its host.
MAX_INDEX_BYTES = 4 << 20
MAX_BLOB_BYTES = 32 << 20
MAX_PROCESSES = 1024
MAX_SET_PAGES = 1 << 20
# Answers to the referrers API that mean "no such API here" (404 is the spec's; proxies and
# older registries answer an unknown route with the others): use the referrers tag instead.
NO_REFERRERS_API = (400, 404, 405, 501)


class WorkingSets(StrictModel):
    """The blob: the pages (address / page size) each process touched, keyed by the sha256 of
    its pagemap image (``criu/pagemap-N.img``), as ``STATE/views`` keeps them."""

    version: Literal[1] = 1
    sets: dict[str, list[int]]

    @model_validator(mode="after")
    def _check(self) -> WorkingSets:
        if len(self.sets) > MAX_PROCESSES:
            raise ValueError(f"more than {MAX_PROCESSES} processes")
        for key, pages in self.sets.items():
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                raise ValueError(f"{key!r} is not the sha256 of a pagemap")
            if len(pages) > MAX_SET_PAGES:
                raise ValueError(f"a set of more than {MAX_SET_PAGES} pages")
            if any(page < 0 for page in pages):
                raise ValueError("a page number is negative")
        return self


class ReferrerManifest(BaseModel):
    """The artifact manifest that carries the blob (other fields a registry keeps are
    ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    schemaVersion: Literal[2]
    mediaType: Literal["application/vnd.oci.image.manifest.v1+json"]
    artifactType: Literal["application/vnd.snapctl.working-sets.v1"]
    config: layout.Descriptor
    layers: list[layout.Descriptor] = Field(min_length=1, max_length=1)
    subject: layout.Descriptor
    annotations: dict[str, str] = {}

    @property
    def blob(self) -> layout.Descriptor:
        return self.layers[0]


class IndexEntry(BaseModel):
    """A working-sets referrer in an image index (other tools' entries stay raw)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    mediaType: Literal["application/vnd.oci.image.manifest.v1+json"]
    digest: str = Field(pattern=layout.DIGEST_PATTERN)
    size: int = Field(ge=0)
    artifactType: Literal["application/vnd.snapctl.working-sets.v1"]
    annotations: dict[str, str] = {}

    @property
    def pages(self) -> int:
        text = self.annotations.get(PAGES_ANNOTATION, "")
        return int(text) if text.isdigit() else 0


class ReferrerIndex(BaseModel):
    """The referrers API's answer, or the index at the referrers tag: its entries as read, so
    that an index written back keeps other tools' entries whatever their fields."""

    model_config = ConfigDict(extra="allow", strict=True)

    schemaVersion: Literal[2]
    mediaType: Literal["application/vnd.oci.image.index.v1+json"]
    manifests: list[dict[str, Any]] = []

    def ours(self) -> list[IndexEntry]:
        return [IndexEntry.model_validate(entry) for entry in self.manifests
                if entry.get("artifactType") == ARTIFACT_TYPE]  # fmt: skip

    def others(self) -> list[dict[str, Any]]:
        return [entry for entry in self.manifests if entry.get("artifactType") != ARTIFACT_TYPE]


class WorkingSetsTransfer(StrictModel):
    """What a push attached or a pull adopted (``--json``): processes and their pages; the
    reason when it failed (the image's own transfer did not)."""

    processes: int = 0
    pages: int = 0
    error: str | None = None


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def referrers_tag(digest: str) -> str:
    """The referrers tag schema's tag for the manifest ``digest``: ``sha256-<hex>``."""
    return digest.replace(":", "-")


def image_pagemaps(image: Path) -> dict[str, Path]:
    """The image's pagemap images by the key their working sets have."""
    return {pagemap_key(path.read_bytes()): path
            for path in sorted((image / "criu").glob("pagemap-*.img"))}  # fmt: skip


def learned_sets(image: Path, views: Path) -> dict[str, list[int]]:
    """What this host learned of the image's processes (those that fit a blob)."""
    found = {}
    for key in image_pagemaps(image):
        learned = read_runs(views, key)
        if learned is not None and 0 < learned.page_count <= MAX_SET_PAGES:
            found[key] = [page for start, count in learned.runs
                          for page in range(start, start + count)]  # fmt: skip
    return found


def adopt(image: Path, views: Path, sets: WorkingSets) -> WorkingSetsTransfer:
    """Add the sets of ``image``'s own processes to this host's: how many processes' sets
    it holds, and how many pages were new here."""
    own = image_pagemaps(image)
    taken = {key: pages for key, pages in sets.sets.items() if key in own}
    added = sum(add_pages(views, key, pages) for key, pages in taken.items())
    return WorkingSetsTransfer(processes=len(taken), pages=added)


class AttachedSets(StrictModel):
    """The working sets attached to an image in its registry (``inspect REF``): how many
    artifacts, the pages of the one a pull takes; the reason when they could not be read."""

    artifacts: int = 0
    pages: int = 0
    error: str | None = None


def attached(client: RegistryClient, subject: str) -> AttachedSets:
    """What is attached to the image manifest ``subject``: the referrers' list only."""
    try:
        ours = _attached(client, subject)
    except (SnapctlError, OSError, ValueError) as error:
        return AttachedSets(error=_one_line(error))
    return AttachedSets(artifacts=len(ours), pages=max((e.pages for e in ours), default=0))


def _attached(client: RegistryClient, subject: str) -> list[IndexEntry]:
    listed = client.find_referrers(subject, ARTIFACT_TYPE, MAX_INDEX_BYTES, NO_REFERRERS_API)
    where = f"the referrers of {subject}"
    if listed is None:
        where = f"the referrers tag {referrers_tag(subject)}"
        listed = client.find_manifest(referrers_tag(subject), INDEX_MEDIA_TYPE,
                                      MAX_INDEX_BYTES)  # fmt: skip
    return [] if listed is None else _parse(ReferrerIndex, listed, where).ours()


def _one_line(error: Exception) -> str:
    message = error.message if isinstance(error, SnapctlError) else str(error)
    return " ".join(message.split())  # pydantic's is many lines


def _failed(error: Exception) -> WorkingSetsTransfer:
    return WorkingSetsTransfer(error=_one_line(error))


def push_working_sets(client: RegistryClient, sets: dict[str, list[int]],
                      subject: layout.Descriptor) -> WorkingSetsTransfer:  # fmt: skip
    """Attach ``sets`` (:func:`learned_sets`) to the image manifest ``subject`` (nothing
    when there are none)."""
    if not sets:
        return WorkingSetsTransfer()
    try:
        blob = WorkingSets(sets=sets).model_dump_json().encode()
        for data in (EMPTY_CONFIG, blob):
            if not client.has_blob(_digest(data)):
                client.upload_blob(_digest(data), data)
        pages = sum(map(len, sets.values()))
        manifest = ReferrerManifest(
            schemaVersion=2, mediaType=layout.OCI_MANIFEST, artifactType=ARTIFACT_TYPE,
            config=layout.Descriptor(mediaType=EMPTY_MEDIA_TYPE, digest=_digest(EMPTY_CONFIG),
                                     size=len(EMPTY_CONFIG)),
            layers=[layout.Descriptor(mediaType=BLOB_MEDIA_TYPE, digest=_digest(blob),
                                      size=len(blob))],
            subject=subject, annotations={PAGES_ANNOTATION: str(pages)},
        )  # fmt: skip
        body = manifest.model_dump_json(exclude_none=True).encode()
        headers = client.put_manifest(_digest(body), layout.OCI_MANIFEST, body)
        if headers.get("OCI-Subject") is None:
            # No referrers API kept it: list it under the referrers tag instead.
            entry = IndexEntry(mediaType=layout.OCI_MANIFEST, digest=_digest(body),
                               size=len(body), artifactType=ARTIFACT_TYPE,
                               annotations=manifest.annotations)  # fmt: skip
            _list_under_tag(client, subject.digest, entry)
        return WorkingSetsTransfer(processes=len(sets), pages=pages)
    except (SnapctlError, OSError, ValueError) as error:
        return _failed(error)


def _list_under_tag(client: RegistryClient, subject: str, entry: IndexEntry) -> None:
    """Put ``entry`` in the index at the subject's referrers tag, in place of any earlier
    working sets; other tools' entries are written back as read. Read, then rewritten, as
    every client of the tag schema does: an entry another client adds in between is lost."""
    tag = referrers_tag(subject)
    found = client.find_manifest(tag, INDEX_MEDIA_TYPE, MAX_INDEX_BYTES)
    index = (ReferrerIndex(schemaVersion=2, mediaType=INDEX_MEDIA_TYPE) if found is None
             else _parse(ReferrerIndex, found, f"the referrers tag {tag}"))  # fmt: skip
    updated = index.model_copy(
        update={"manifests": [*index.others(), entry.model_dump(exclude_none=True)]}
    )
    client.put_manifest(tag, INDEX_MEDIA_TYPE, updated.model_dump_json().encode())


def _parse(model: type[M], data: bytes, what: str) -> M:
    try:
        return model.model_validate_json(data)
    except ValidationError as error:
        raise BlobMismatchError(f"{what} is not a valid {model.__name__}: {error}") from error


def pull_working_sets(client: RegistryClient, image: Path, views: Path,
                      subject: str) -> WorkingSetsTransfer:  # fmt: skip
    """Adopt the working sets attached to the manifest ``subject`` of the pulled ``image``
    (of several, those with the most pages; nothing when none are)."""
    try:
        ours = _attached(client, subject)
        if not ours:
            return WorkingSetsTransfer()
        chosen = max(ours, key=lambda entry: entry.pages)
        body = client.find_manifest(chosen.digest, layout.OCI_MANIFEST,
                                    layout.MAX_OCI_MANIFEST_BYTES)  # fmt: skip
        if body is None or _digest(body) != chosen.digest:
            raise BlobMismatchError(f"the working sets' manifest {chosen.digest} is missing or "
                                    "does not match its digest")  # fmt: skip
        manifest = _parse(ReferrerManifest, body, f"the manifest {chosen.digest}")
        if manifest.subject.digest != subject:
            raise BlobMismatchError(f"{chosen.digest} is not attached to {subject}")
        if manifest.blob.mediaType != BLOB_MEDIA_TYPE:
            raise BlobMismatchError(f"{chosen.digest} holds {manifest.blob.mediaType}")
        data = client.read_blob(manifest.blob.digest, manifest.blob.size, MAX_BLOB_BYTES,
                                "the working sets", outcome="none were adopted")  # fmt: skip
        return adopt(image, views, _parse(WorkingSets, data, "the working sets"))
    except (SnapctlError, OSError, ValueError) as error:
        return _failed(error)
