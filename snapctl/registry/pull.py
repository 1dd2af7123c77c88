"""``snapctl image pull`` and ``inspect REF``: an image from a registry, verified while it
streams, published by one rename as ``image import`` publishes.

Order: the OCI manifest (its sha256 must be the digest asked for, when one was), the trust
policy when one is given (:mod:`snapctl.trust.policy`: a refusal ends the pull before any of the
image's blobs is read), the config blob and the image's ``manifest.json`` (each against its
digest; the config must describe exactly the files, sizes and sha256 of the manifest, its hard
links and only directories an image may have), the space the files will take (refused before
anything is fetched when the disk lacks it), then every blob the image lacks here (in parallel,
each hashed as it arrives and kept in the cache only if it matches; a partial download is
resumed with a range request), then the files, assembled in a staging directory beside the
target and each hashed against the manifest, and the staged tree checked as a copy's
verification checks it. Any mismatch: a clear error, the staging directory removed, nothing
published, nothing unverified kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from snapctl.errors import NoSpaceError, is_no_space
from snapctl.images.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapctl.images.ownership import arriving_mode
from snapctl.images.store import (
    MAX_MANIFEST_BYTES,
    ImageError,
    ImageStaging,
    check_image_tree,
    is_image_directory,
    is_verified,
    listed_directories,
    load_manifest,
    manifest_problem,
    record_verified,
)
from snapctl.phases import HostPhase
from snapctl.progress import ByteProgress
from snapctl.registry import layout
from snapctl.registry.cache import BlobCache, pulled_image, pulled_record, write_record
from snapctl.registry.client import BlobMismatchError, Reference, RegistryClient
from snapctl.registry.workingsets import WorkingSetsTransfer, learned_sets, pull_working_sets
from snapctl.statedir import StateDir

if TYPE_CHECKING:
    from snapctl.trust.policy import Policy
    from snapctl.trust.verdict import Verdict

M = TypeVar("M", bound=BaseModel)
DEFAULT_JOBS = 8
PIECE = 4 << 20
# Bytes free on the filesystem holding a path (an existing one): a seam for tests.
FreeSpace = Callable[[Path], int]


class TransferReport(BaseModel):
    """What a push or pull moved (``--json``): the fields both have."""

    model_config = ConfigDict(extra="forbid")

    action: str
    image: str
    reference: str
    manifest_digest: str
    image_id: str
    files: int
    image_bytes: int
    blobs: int  # the OCI manifest's config and layers
    seconds: float
    mb_per_s: float  # image bytes per second, 1 MB = 10^6 bytes
    working_sets: WorkingSetsTransfer = WorkingSetsTransfer()  # attached, or adopted


class PullReport(TransferReport):
    """What a pull moved (``--json``)."""

    action: str = "pull"
    blobs_fetched: int  # blobs transferred now (in whole or resumed)
    blobs_cached: int  # blobs already complete and verified in the cache
    bytes_fetched: int  # bytes received from the registry
    bytes_resumed: int  # bytes of partial downloads that were not fetched again
    already_pulled: bool = False
    verdict: dict[str, Any] | None = None  # the trust policy's (None: no policy was asked)


@dataclass(frozen=True)
class Remote:
    """An image's description in the registry: enough for ``inspect`` and to plan a pull."""

    reference: Reference
    manifest_digest: str
    oci: layout.OciManifest
    config: layout.ImageConfig
    manifest: Manifest
    manifest_bytes: bytes
    verdict: Verdict | None = None  # the trust policy's, when one was asked


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _small_blob(client: RegistryClient, cache: BlobCache, descriptor: layout.Descriptor,
                max_bytes: int, what: str) -> bytes:  # fmt: skip
    """A small blob (config, manifest.json), from the cache or fetched whole; verified."""
    cached = cache.read(descriptor.digest)
    if cached is not None:
        return cached
    return client.read_blob(descriptor.digest, descriptor.size, max_bytes, what)


def _parse(model: type[M], data: bytes, what: str) -> M:
    try:
        return model.model_validate_json(data)
    except ValidationError as error:
        raise BlobMismatchError(f"{what}: {manifest_problem(error)}") from error


def describe(client: RegistryClient, cache: BlobCache, policy: Policy | None = None) -> Remote:
    """Read and check the OCI manifest, the config and the image's manifest.json (no page
    data). The small blobs are kept in the cache only once all three agree.

    With a trust ``policy``, the image must pass it (:func:`snapctl.trust.policy.verify_pull`,
    :class:`~snapctl.trust.errors.PolicyRefusedError` otherwise) as soon as its manifest's
    digest is known, before any of its blobs is read; None: no policy is asked."""
    reference = client.reference
    oci_bytes = client.get_manifest(layout.OCI_MANIFEST, layout.MAX_OCI_MANIFEST_BYTES)
    digest = _digest(oci_bytes)
    if reference.digest is not None and digest != reference.digest:
        raise BlobMismatchError(
            f"the manifest of {reference} has sha256 {digest}, not the digest asked for"
        )
    verdict = None
    if policy is not None:
        from snapctl.trust.policy import verify_pull

        verdict = verify_pull(policy, reference, digest, client)
    oci = _parse(layout.OciManifest, oci_bytes, f"{reference} is not a snapctl image")
    config_bytes = _small_blob(client, cache, oci.config, layout.MAX_CONFIG_BYTES, "the config")
    config = _parse(layout.ImageConfig, config_bytes, f"the config of {reference} is not valid")
    first = oci.layers[0]
    if first.digest != config.manifest_digest:
        raise BlobMismatchError(f"{reference}: the config names another manifest.json")
    manifest_bytes = _small_blob(client, cache, first, MAX_MANIFEST_BYTES, "manifest.json")
    manifest = _parse(Manifest, manifest_bytes, f"manifest.json of {reference} is not valid")
    _check_agreement(reference, oci, config, manifest)
    cache.put(oci.config.digest, config_bytes)
    cache.put(first.digest, manifest_bytes)
    return Remote(reference, digest, oci, config, manifest, manifest_bytes, verdict)


def _check_agreement(reference: Reference, oci: layout.OciManifest,
                     config: layout.ImageConfig, manifest: Manifest) -> None:  # fmt: skip
    """The config must place exactly the manifest's files with its sizes and sha256, and
    every blob it names must be a layer of the OCI manifest with that size."""
    if config.image_id != manifest.image_id:
        raise BlobMismatchError(f"{reference}: the config is of another image")
    placed = {stored.name: stored for stored in config.files}
    if set(placed) != set(manifest.files):
        name = sorted(set(placed) ^ set(manifest.files))[0]
        raise BlobMismatchError(f"{reference}: the config and manifest.json differ on {name}")
    for name, entry in manifest.files.items():
        stored = placed[name]
        if (stored.size, stored.sha256) != (entry.size, entry.sha256):
            raise BlobMismatchError(f"{reference}: the config and manifest.json differ on {name}")
        if stored.link_to is not None:
            target = manifest.files.get(stored.link_to)
            if (
                target is None
                or placed[stored.link_to].link_to is not None
                or entry.link_group is None
                or target.link_group != entry.link_group
                or (target.size, target.sha256) != (entry.size, entry.sha256)
            ):
                raise BlobMismatchError(f"{reference}: {name} is a hard link the manifest "
                                        "does not record")  # fmt: skip
    _check_link_groups(reference, placed, manifest)
    _check_directories(reference, config, manifest)
    layers = {layer.digest: layer.size for layer in oci.layers}
    needed = {**config.chunk_digests(), config.small_files_digest: config.small_files_size}
    for digest, size in needed.items():
        if layers.get(digest) != size:
            raise BlobMismatchError(f"{reference}: blob {digest} is not a layer of that size")


def _link_groups(files: dict[str, FileEntry]) -> dict[int, set[str]]:
    groups: dict[int, set[str]] = {}
    for name, entry in files.items():
        if entry.link_group is not None:
            groups.setdefault(entry.link_group, set()).add(name)
    return groups


def _check_link_groups(reference: Reference, placed: dict[str, layout.StoredFile],
                       manifest: Manifest) -> None:  # fmt: skip
    """Every hard-link group of the manifest must arrive as one stored file and links to it
    (a copy's verification compares the inodes with the groups: a group of one name, or
    one stored twice, would be published as an image that never verifies)."""
    for group, names in sorted(_link_groups(manifest.files).items()):
        stored = [name for name in names if placed[name].link_to is None]
        if len(names) < 2 or len(stored) != 1:
            raise BlobMismatchError(f"{reference}: hard-link group {group} of manifest.json "
                                    "is not one file and its links in the config")  # fmt: skip


def _check_directories(reference: Reference, config: layout.ImageConfig,
                       manifest: Manifest) -> None:  # fmt: skip
    """The rules ``image import`` applies: a directory of the config must be one an image
    may have (its own, one holding a listed file, a saved /dev/shm's), never a listed file;
    and no listed file may be another's directory."""
    listed = listed_directories(manifest)
    both = sorted({*manifest.files, MANIFEST_NAME} & listed)
    if both:
        raise BlobMismatchError(f"{reference}: manifest.json lists {both[0]} both as a file "
                                "and as a directory")  # fmt: skip
    for directory in config.directories:
        name = directory.name
        if name in manifest.files or not is_image_directory(name, listed):
            raise BlobMismatchError(f"{reference}: the config lists a directory {name} that "
                                    "holds no file of manifest.json")  # fmt: skip


def free_bytes(path: Path) -> int:
    """Bytes available on the filesystem of ``path`` (what ``df`` shows as available)."""
    return shutil.disk_usage(path).free


def _existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists."""
    for where in (path, *path.parents):
        if where.exists():
            return where
    return Path("/")


def _require_space(remote: Remote, to: Path, cache: BlobCache, missing: dict[str, int],
                   free_space: FreeSpace) -> None:  # fmt: skip
    """Refuse, before any blob is fetched or any file written, a pull whose files (each the
    size the config declares, however often its chunks repeat) and missing blobs do not fit
    in the space free where they go."""
    files = remote.config.written_bytes() + len(remote.manifest_bytes)
    blobs = sum(missing.values())
    target, store = _existing(to.parent), _existing(cache.root)
    if target.stat().st_dev == store.stat().st_dev:
        needs = [(to.parent, target, files + blobs)]
    else:
        needs = [(to.parent, target, files), (cache.root, store, blobs)]
    for where, existing, need in needs:
        free = free_space(existing)
        if need > free:
            raise NoSpaceError(
                f"cannot pull {remote.reference}: it needs {-(-need >> 20)} MiB at {where}, "
                f"{free >> 20} MiB free (free space there, or choose another directory); "
                "nothing was fetched or published", phase=HostPhase.IMAGE, path=where,
            )  # fmt: skip


@contextlib.contextmanager
def _out_of_space(where: Path, what: str) -> Iterator[None]:
    """Say where a write that ran out of space was, as every other writer of images does."""
    try:
        yield
    except OSError as error:
        if is_no_space(error):
            raise NoSpaceError.at(where, what, phase=HostPhase.IMAGE) from error
        raise


class _Fetcher:
    """Brings blobs into the cache in parallel, resuming partial downloads."""

    def __init__(self, client: RegistryClient, cache: BlobCache,
                 progress: ByteProgress | None) -> None:  # fmt: skip
        self.client, self.cache, self.progress = client, cache, progress
        self.lock = threading.Lock()
        self.fetched = self.bytes_fetched = self.bytes_resumed = 0
        self.stop = threading.Event()

    def fetch(self, digest: str, size: int) -> None:
        if self.stop.is_set():
            return
        partial = self.cache.partial(digest)
        hasher = hashlib.sha256()
        done = 0
        with contextlib.suppress(FileNotFoundError):
            with partial.open("rb") as handle:
                while (piece := handle.read(PIECE)) and done + len(piece) <= size:
                    hasher.update(piece)
                    done += len(piece)
            os.truncate(partial, done)  # only whole, in-order bytes are kept
        resumed = done
        if self.progress is not None and resumed:
            self.progress(resumed)
        try:
            with partial.open("ab") as out:
                if done < size:
                    for piece in self.client.blob_pieces(digest, done):
                        if self.stop.is_set():
                            return  # another blob failed: keep what arrived, for a resume
                        if done + len(piece) > size:
                            raise BlobMismatchError(
                                f"blob {digest} of {self.client.reference} is larger than its "
                                f"{size} bytes: nothing was published"
                            )
                        out.write(piece)
                        hasher.update(piece)
                        done += len(piece)
                        with self.lock:
                            self.bytes_fetched += len(piece)
                        if self.progress is not None:
                            self.progress(len(piece))
            if done != size or "sha256:" + hasher.hexdigest() != digest:
                raise BlobMismatchError(
                    f"blob {digest} of {self.client.reference} does not match its digest "
                    f"({done} of {size} bytes; damaged in the registry or in transit): nothing "
                    "was published"
                )
            self.cache.adopt(digest, partial)
        except BlobMismatchError:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()  # bytes that fail their digest are never kept
            self.stop.set()
            raise
        except BaseException:
            self.stop.set()
            raise
        with self.lock:
            self.fetched += 1
            self.bytes_resumed += resumed


def _fetch_all(fetcher: _Fetcher, missing: dict[str, int], jobs: int) -> None:
    """Fetch ``missing`` in parallel; on the first failure the others stop. A transfer that
    broke off keeps its partial download, to be resumed; after a blob that failed its digest
    (a damaged registry), the partials this pull started are removed too."""
    if not missing:
        return
    fetcher.cache.ensure()
    earlier = {d for d in missing if fetcher.cache.partial(d).exists()}
    try:
        _fetch_parallel(fetcher, missing, jobs)
    except BlobMismatchError:
        for digest in set(missing) - earlier:
            with contextlib.suppress(FileNotFoundError):
                fetcher.cache.partial(digest).unlink()
        raise


def _fetch_parallel(fetcher: _Fetcher, missing: dict[str, int], jobs: int) -> None:
    with ThreadPoolExecutor(max_workers=min(jobs, len(missing)),
                            thread_name_prefix="pull") as pool:  # fmt: skip
        futures = [pool.submit(fetcher.fetch, d, s) for d, s in missing.items()]
        errors = []
        for future in futures:
            try:
                future.result()
            except BaseException as error:
                errors.append(error)
        if errors:
            raise errors[0]


def _assemble(remote: Remote, cache: BlobCache, root: Path) -> None:
    """Write every file from its blobs into ``root``, each hashed against the manifest, owned
    by the puller with what :func:`arriving_mode` keeps of its recorded mode."""
    small = cache.path(remote.config.small_files_digest)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for directory in remote.config.directories:
        (root / directory.name).mkdir(parents=True, exist_ok=True, mode=0o700)
    with small.open("rb") as small_handle:
        for stored in remote.config.files:
            if stored.link_to is not None:
                continue
            path = root / stored.name
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            digest = hashlib.sha256()
            written = 0
            with os.fdopen(os.open(path, flags, 0o600), "wb") as out:
                if stored.offset is not None:
                    small_handle.seek(stored.offset)
                    while written < stored.size:
                        data = small_handle.read(min(PIECE, stored.size - written))
                        if not data:
                            break
                        digest.update(data)
                        out.write(data)
                        written += len(data)
                # Each chunk was hashed on arrival; the file's sha256 below covers the bytes
                # again, so one damaged on disk since is caught there (and then dropped).
                for chunk in stored.chunks or []:
                    data = cache.path(chunk.digest).read_bytes()
                    digest.update(data)
                    out.write(data)
                    written += len(data)
                # Owned by whoever pulls: another host's uid/gid mean nothing here (only our
                # restore reads these files) and would hand them to whoever has those ids.
                os.fchmod(out.fileno(), arriving_mode(stored.name, stored.mode, directory=False))
            if written != stored.size or digest.hexdigest() != stored.sha256:
                _drop_damaged(cache, stored, remote.config.small_files_digest)
                raise BlobMismatchError(f"image file {stored.name} of {remote.reference} does "
                                        "not match its sha256 in the manifest (a damaged cached "
                                        "blob was dropped: pull again)")  # fmt: skip
    for stored in remote.config.files:
        if stored.link_to is not None:
            (root / stored.name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.link(root / stored.link_to, root / stored.name, follow_symlinks=False)
    for directory in sorted(remote.config.directories, key=lambda d: d.name, reverse=True):
        os.chmod(root / directory.name, arriving_mode(directory.name, directory.mode,
                                                      directory=True))  # fmt: skip


def _check_staged(remote: Remote, root: Path) -> None:
    """What a copy's verification (``verify_image``) checks, of the staged tree: exactly the
    manifest's files, in directories an image may have, nothing else, and each name sharing
    an inode with exactly the names its hard-link group has. Every file's bytes were hashed
    against the manifest as they were written (a link's are its target's, recorded with the
    same sha256), so what is published and recorded verified is what verifies."""
    try:
        check_image_tree(root, remote.manifest)
    except ImageError as error:
        raise BlobMismatchError(f"{remote.reference}: the pulled files are not the image "
                                f"manifest.json describes ({error.message}): nothing was "
                                "published") from error  # fmt: skip
    inodes: dict[tuple[int, int], set[str]] = {}
    for name in remote.manifest.files:
        st = (root / name).lstat()
        inodes.setdefault((st.st_dev, st.st_ino), set()).add(name)
    shared = sorted(sorted(names) for names in inodes.values() if len(names) > 1)
    expected = sorted(sorted(names) for names in _link_groups(remote.manifest.files).values())
    if shared != expected:
        raise BlobMismatchError(f"{remote.reference}: the pulled files do not share inodes as "
                                "manifest.json records: nothing was published")  # fmt: skip


def _drop_damaged(cache: BlobCache, stored: layout.StoredFile, small_digest: str) -> None:
    """Drop every cached blob of ``stored`` that no longer matches its digest."""
    blobs = [chunk.digest for chunk in stored.chunks or []]
    if stored.offset is not None:
        blobs.append(small_digest)
    for digest in blobs:
        if cache.read(digest) is None:  # drops it
            cache.drop(digest)


def pull_image(
    client: RegistryClient,
    to: Path,
    *,
    cache: BlobCache,
    verified_cache: Path | None,
    force: bool = False,
    jobs: int = DEFAULT_JOBS,
    progress: ByteProgress | None = None,
    total: Callable[[int], None] | None = None,
    remote: Remote | None = None,
    claims: Path | None = None,
    views: Path | None = None,
    free_space: FreeSpace = free_bytes,
    policy: Policy | None = None,
) -> PullReport:
    """Pull ``client.reference`` into the image directory ``to`` (see the module docstring).

    ``total`` is told the bytes the pull will account for, before any arrives; ``claims`` is
    where the staging directory is claimed for ``snapctl gc`` (see ImageStaging); ``views``
    (``STATE/views``) adopts the working sets attached to the image (:mod:`.workingsets`);
    ``free_space`` says how many bytes are free where the files and blobs go; ``policy`` is
    the trust policy the image must pass first (:func:`describe`; a ``remote`` given was
    described with it).
    """
    started = time.monotonic()
    to = to.absolute()
    remote = remote or describe(client, cache, policy)
    needed = {**remote.config.chunk_digests(),
              remote.config.small_files_digest: remote.config.small_files_size}  # fmt: skip
    missing = {d: s for d, s in needed.items() if not cache.has(d)}
    _require_space(remote, to, cache, missing, free_space)
    if total is not None:
        total(sum(missing.values()))
    fetcher = _Fetcher(client, cache, progress)
    staging = ImageStaging(to, force=force, claims=claims)
    what = f"cannot pull {remote.reference}, nothing was published"
    try:
        with _out_of_space(cache.root, what):
            _fetch_all(fetcher, missing, jobs)
        with _out_of_space(staging.dir, what):
            _assemble(remote, cache, staging.dir)
        _check_staged(remote, staging.dir)
        final = staging.publish(remote.manifest)
    except BaseException:
        staging.abort()
        raise
    if verified_cache is not None:
        # Every file hashed as written, and the tree checked: all that verify_image checks.
        record_verified(final, remote.manifest, verified_cache)
    adopted = (pull_working_sets(client, final, views, remote.manifest_digest)
               if views is not None else WorkingSetsTransfer())  # fmt: skip
    report = _report(remote, final, fetcher, len(needed) - len(missing), started)
    return report.model_copy(update={"working_sets": adopted})


def _report(remote: Remote, final: Path, fetcher: _Fetcher | None, cached: int,
            started: float, *, already: bool = False) -> PullReport:  # fmt: skip
    seconds = time.monotonic() - started
    total = remote.manifest.total_bytes + len(remote.manifest_bytes)
    return PullReport(
        image=str(final),
        reference=str(remote.reference),
        manifest_digest=remote.manifest_digest,
        image_id=remote.manifest.image_id,
        files=len(remote.manifest.files),
        image_bytes=total,
        blobs=len(remote.oci.layers) + 1,
        blobs_fetched=fetcher.fetched if fetcher else 0,
        blobs_cached=cached,
        bytes_fetched=fetcher.bytes_fetched if fetcher else 0,
        bytes_resumed=fetcher.bytes_resumed if fetcher else 0,
        seconds=round(seconds, 6),
        mb_per_s=round(total / 1e6 / seconds, 3) if seconds > 0 else 0.0,
        already_pulled=already,
        verdict=None if remote.verdict is None else remote.verdict.record(),
    )


def pull_cached(
    client: RegistryClient,
    state: StateDir,
    *,
    jobs: int = DEFAULT_JOBS,
    progress: ByteProgress | None = None,
    total: Callable[[int], None] | None = None,
    free_space: FreeSpace = free_bytes,
    policy: Policy | None = None,
) -> PullReport:
    """Pull into the local image cache (``copy --image REF``): an image already pulled by
    exactly that manifest digest (its entry's name and its record say so), with that
    manifest, and still verified, is used as it is. Either way the manifest is read from the
    registry first and the image must pass the trust ``policy`` (:func:`describe`), so one
    pulled before is used for this reference only if the policy accepts it now."""
    from snapctl.registry.cache import blob_cache

    started = time.monotonic()
    cache = blob_cache(state)
    remote = describe(client, cache, policy)
    target = pulled_image(state, remote.manifest_digest)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    if target.is_dir() and pulled_record(target, remote.manifest_digest) is not None:
        try:
            present = load_manifest(target)
        except Exception:
            present = None
        if (
            present is not None
            and present == remote.manifest
            and is_verified(target, present, state.verified)
        ):
            write_record(target, manifest_digest=remote.manifest_digest,
                         image_id=present.image_id, reference=str(client.reference),
                         pulled=now)  # fmt: skip
            # Sets pushed since it was pulled are adopted, while this host knows none of its
            # own (they cost a few requests: not on every copy).
            adopted = WorkingSetsTransfer()
            if not _knows_sets(target, state.views):
                adopted = pull_working_sets(client, target, state.views, remote.manifest_digest)
            report = _report(remote, target, None, len(remote.oci.layers), started, already=True)
            return report.model_copy(update={"working_sets": adopted})
    report = pull_image(client, target, cache=cache, verified_cache=state.verified,
                        force=target.exists(), jobs=jobs, progress=progress, total=total,
                        remote=remote, claims=state.claims, views=state.views,
                        free_space=free_space)  # fmt: skip
    write_record(target, manifest_digest=remote.manifest_digest, image_id=report.image_id,
                 reference=str(client.reference), pulled=now)  # fmt: skip
    return report


def _knows_sets(image: Path, views: Path) -> bool:
    try:
        return bool(learned_sets(image, views))
    except OSError:
        return True  # the image cannot be read now: nothing to adopt for it
