"""``snapctl image push``: an image directory to a registry, verified on the way out.

Every file is read once: hashed against the image's manifest (an image that no longer matches
it is refused, as ``image export`` refuses it) while its chunks are cut and uploaded. A blob
the repository already holds (``HEAD``) is not uploaded again: after a re-bake of the same
server only the chunks that changed travel. The manifest is put last, so the reference names
the image only once every blob it lists is in the registry.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

from snapctl.images.archive import ArchiveError, held_for_reading
from snapctl.images.manifest import MANIFEST_NAME, Manifest
from snapctl.progress import ByteProgress
from snapctl.registry import layout, workingsets
from snapctl.registry.chunks import cut
from snapctl.registry.client import Reference, RegistryClient, RegistryError
from snapctl.registry.pull import TransferReport

DEFAULT_JOBS = 8


class PushReport(TransferReport):
    """What a push moved (``--json``)."""

    action: str = "push"
    blobs_uploaded: int
    bytes_uploaded: int  # blob bytes sent; blobs the registry held are not counted


class _Uploader:
    """Hashes and uploads blobs in parallel, each digest once, skipping those the registry
    holds. Chunks are hashed here, in the workers (hashlib releases the GIL), while the
    caller's thread cuts the next ones and hashes the whole file."""

    def __init__(self, client: RegistryClient, jobs: int, progress: ByteProgress | None) -> None:
        self.client = client
        self.pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="push")
        # Bounds the chunk bytes copied out for uploads still waiting: about 2 per worker.
        self.slots = threading.BoundedSemaphore(2 * jobs)
        self.progress = progress
        self.seen: set[str] = set()
        self.futures: list[Future[str]] = []
        self.lock = threading.Lock()
        self.uploaded = 0
        self.bytes_uploaded = 0

    def submit(self, data: bytes | memoryview) -> Future[str]:
        """Upload ``data`` unless the registry holds it; the future gives its digest."""
        self._raise_first_failure()
        self.slots.acquire()
        try:
            payload = bytes(data)  # the view dies with its mapping; the upload runs later
            future = self.pool.submit(self._upload, payload)
        except BaseException:
            self.slots.release()
            raise
        self.futures.append(future)
        return future

    def _upload(self, data: bytes) -> str:
        try:
            digest = _digest(data)
            with self.lock:
                first = digest not in self.seen
                self.seen.add(digest)
            if first and not self.client.has_blob(digest):
                self.client.upload_blob(digest, data)
                with self.lock:
                    self.uploaded += 1
                    self.bytes_uploaded += len(data)
            if self.progress is not None:
                self.progress(len(data))
            return digest
        finally:
            self.slots.release()

    def _raise_first_failure(self) -> None:
        for future in self.futures:
            if future.done() and future.exception() is not None:
                future.result()

    def finish(self) -> None:
        try:
            for future in self.futures:
                future.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _Owner(TypedDict):
    mode: int
    uid: int
    gid: int


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _store_files(
    image: Path, manifest: Manifest, uploader: _Uploader, small: bytearray
) -> list[layout.StoredFile]:
    """Hash every file against the manifest while its bytes go to the uploader (large files,
    by chunk) or into ``small``; return where each file went."""
    stored: list[layout.StoredFile] = []
    first_of_inode: dict[tuple[int, int], str] = {}
    for name, entry in sorted(manifest.files.items()):
        path = image / name
        st = path.lstat()
        owner = _Owner(mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid)
        inode = (st.st_dev, st.st_ino)
        if inode in first_of_inode:
            stored.append(layout.StoredFile(name=name, size=entry.size, sha256=entry.sha256,
                                            link_to=first_of_inode[inode], **owner))  # fmt: skip
            if uploader.progress is not None:
                uploader.progress(entry.size)
            continue
        first_of_inode[inode] = name
        if st.st_size != entry.size:
            raise ArchiveError(f"image file {name} does not match its manifest size", path=path)
        digest = hashlib.sha256()
        if entry.size < layout.SMALL_FILE_BYTES:
            data = path.read_bytes()
            digest.update(data)
            placed = layout.StoredFile(name=name, size=len(data), sha256=entry.sha256,
                                       offset=len(small), **owner)  # fmt: skip
            small += data
            if uploader.progress is not None:
                uploader.progress(len(data))
        else:
            pending: list[tuple[Future[str], int]] = []
            for piece in cut(path):
                digest.update(piece)
                pending.append((uploader.submit(piece), len(piece)))
            chunks = [layout.Chunk(digest=f.result(), size=size) for f, size in pending]
            placed = layout.StoredFile(name=name, size=entry.size, sha256=entry.sha256,
                                       chunks=chunks, **owner)  # fmt: skip
        if digest.hexdigest() != entry.sha256 or placed.size != entry.size:
            raise ArchiveError(f"image file {name} does not match its sha256", path=path)
        stored.append(placed)
    return stored


def push_image(
    image: Path,
    reference: Reference,
    client: RegistryClient,
    *,
    jobs: int = DEFAULT_JOBS,
    progress: ByteProgress | None = None,
    views: Path | None = None,
) -> PushReport:
    """Push ``image`` to ``reference`` (a tag); every file is checked against the manifest.
    With ``views`` (``STATE/views``), the working sets learned there for the image's
    processes are attached to it (:mod:`.workingsets`)."""
    if reference.tag is None or reference.digest is not None:
        raise RegistryError(f"push to a tag, not a digest: {reference}", reference=str(reference))
    image = image.absolute()
    started = time.monotonic()
    with held_for_reading(image) as (manifest, manifest_bytes, directories):
        uploader = _Uploader(client, jobs, progress)
        try:
            small = bytearray()
            stored = _store_files(image, manifest, uploader, small)
            small_bytes = bytes(small)
            config = layout.ImageConfig(
                image_id=manifest.image_id,
                manifest_digest=_digest(manifest_bytes),
                small_files_digest=_digest(small_bytes),
                small_files_size=len(small_bytes),
                directories=[
                    layout.StoredDirectory(
                        name=name, mode=stat.S_IMODE(os.lstat(image / name).st_mode)
                    )
                    for name in directories
                ],
                files=stored,
            )
            config_bytes = config.model_dump_json().encode()
            for blob in (manifest_bytes, small_bytes, config_bytes):
                uploader.submit(blob)
            uploader.finish()
            # Read while the image is held: the pagemaps are the ones just pushed.
            sets = _learned(image, views)
        except BaseException:
            uploader.abort()
            raise
    oci = _oci_manifest(manifest, config, manifest_bytes, small_bytes, config_bytes)
    oci_bytes = oci.model_dump_json(exclude_none=True).encode()
    assert reference.tag is not None
    client.put_manifest(reference.tag, layout.OCI_MANIFEST, oci_bytes)
    subject = layout.Descriptor(mediaType=layout.OCI_MANIFEST, digest=_digest(oci_bytes),
                                size=len(oci_bytes))  # fmt: skip
    attached = workingsets.push_working_sets(client, sets, subject)
    seconds = time.monotonic() - started
    total = manifest.total_bytes + len(manifest_bytes)
    return PushReport(
        image=str(image),
        reference=str(reference),
        manifest_digest=_digest(oci_bytes),
        image_id=manifest.image_id,
        files=len(manifest.files),
        image_bytes=total,
        blobs=len(oci.layers) + 1,
        blobs_uploaded=uploader.uploaded,
        bytes_uploaded=uploader.bytes_uploaded,
        seconds=round(seconds, 6),
        mb_per_s=round(total / 1e6 / seconds, 3) if seconds > 0 else 0.0,
        working_sets=attached,
    )


def _learned(image: Path, views: Path | None) -> dict[str, list[int]]:
    """The working sets to attach; none when ``views`` is unreadable (they are a hint)."""
    if views is None:
        return {}
    try:
        return workingsets.learned_sets(image, views)
    except OSError:
        return {}


def _oci_manifest(
    manifest: Manifest,
    config: layout.ImageConfig,
    manifest_bytes: bytes,
    small_bytes: bytes,
    config_bytes: bytes,
) -> layout.OciManifest:
    layers = [
        layout.Descriptor(mediaType=layout.IMAGE_MANIFEST_MEDIA_TYPE,
                          digest=config.manifest_digest, size=len(manifest_bytes),
                          annotations={layout.TITLE: MANIFEST_NAME}),
        layout.Descriptor(mediaType=layout.SMALL_FILES_MEDIA_TYPE,
                          digest=config.small_files_digest, size=len(small_bytes)),
    ] + [
        layout.Descriptor(mediaType=layout.CHUNK_MEDIA_TYPE, digest=digest, size=size)
        for digest, size in config.chunk_digests().items()
    ]  # fmt: skip
    return layout.OciManifest(
        schemaVersion=2,
        mediaType=layout.OCI_MANIFEST,
        artifactType=layout.ARTIFACT_TYPE,
        config=layout.Descriptor(mediaType=layout.CONFIG_MEDIA_TYPE,
                                 digest=_digest(config_bytes), size=len(config_bytes)),
        layers=layers,
        annotations=layout.manifest_annotations(
            criu_version=manifest.criu_version, kernel=manifest.kernel,
            snapctl_version=manifest.snapctl_version, image_id=manifest.image_id,
            created=manifest.created,
        ),
    )  # fmt: skip
