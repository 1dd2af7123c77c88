"""Image directories on disk: staging and atomic publication, hashing, verification, staging
of the saved ``/dev/shm`` for a restore (hard links kept)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from snapctl.errors import ExitStatus, NoSpaceError, SnapctlError, is_no_space
from snapctl.images.filecache import FileCache, StatKey, path_key
from snapctl.images.lock import ImageHold, hold_image
from snapctl.images.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapctl.phases import HostPhase
from snapctl.protocol.atomic import (
    describe_mode,
    fsync_directory,
    write_json_atomic,
)
from snapctl.supervision.leftovers import ClaimHandle, claim

CHUNK = 4 << 20
# A manifest lists every image file and every file the tree depended on: far above the 64 KiB
# of a control file for a large server, still small enough to read whole.
MAX_MANIFEST_BYTES = 16 << 20


class ImageError(SnapctlError):
    """An image is missing, incomplete, or fails verification (subclasses: it already exists,
    or cannot be written)."""

    exit_status = ExitStatus.VERIFY_FAILED

    def __init__(
        self, message: str, *, phase: HostPhase = HostPhase.IMAGE, path: str | Path | None = None
    ) -> None:
        super().__init__(message, phase=phase, path=path)


class ImageExistsError(ImageError):
    """The image directory asked for already exists (and replacing it was not asked for)."""

    exit_status = ExitStatus.CONFLICT


class ImageWriteError(ImageError):
    """An image could not be written (staged, synced, published) on this host's disk."""

    exit_status = ExitStatus.ERROR


def _size_and_sha256(path: Path) -> tuple[int, str]:
    # The size is what was hashed, so the two always describe the same bytes.
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST_NAME
    )


def hash_tree(root: Path) -> dict[str, FileEntry]:
    """Size, sha256 and hard-link group of every regular file below ``root``."""
    paths = _files(root)
    inodes: dict[tuple[int, int], list[str]] = {}
    for path in paths:
        st = path.stat()
        inodes.setdefault((st.st_dev, st.st_ino), []).append(str(path.relative_to(root)))
    groups = {
        name: index
        for index, names in enumerate(v for v in inodes.values() if len(v) > 1)
        for name in names
    }
    # Hashing is I/O and hashlib releases the GIL: a few threads use both cores.
    with ThreadPoolExecutor(max_workers=4) as pool:
        hashed = list(pool.map(_size_and_sha256, paths))
    return {
        str(path.relative_to(root)): FileEntry(
            size=size, sha256=digest, link_group=groups.get(str(path.relative_to(root)))
        )
        for path, (size, digest) in zip(paths, hashed, strict=True)
    }


def manifest_problem(error: ValidationError) -> str:
    """One line naming where the first validation error is (never the offending value)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    return f"{where}: {first['msg']}"


def load_manifest(image: Path) -> Manifest:
    """Read and validate ``image``'s manifest (bounded); no file of the image is read."""
    path = image / MANIFEST_NAME
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError) as error:
        raise ImageError(
            f"{image} is not a published image (no {MANIFEST_NAME})", path=image
        ) from error
    except OSError as error:
        raise ImageError(f"cannot read {path}: {error.strerror}", path=path) from error
    if len(data) > MAX_MANIFEST_BYTES:
        raise ImageError(f"{path} exceeds {MAX_MANIFEST_BYTES} bytes", path=path)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as error:
        raise ImageError(
            f"{path} is not a valid manifest: {manifest_problem(error)}", path=path
        ) from error


def _verification_name(image: Path, manifest: Manifest) -> str:
    # Per image id and directory: an exported image imported elsewhere keeps its id.
    return f"image {manifest.image_id} at {image.absolute()}"


def _expected_files(manifest: Manifest) -> str:
    # The expected hashes are part of the key: a cache entry vouches for these files against
    # this manifest, not against one edited since (same id, other sha256 or link groups).
    return hashlib.sha256(
        json.dumps(
            {name: entry.model_dump() for name, entry in manifest.files.items()}, sort_keys=True
        ).encode()
    ).hexdigest()


def _listed_keys(image: Path, manifest: Manifest) -> dict[str, StatKey] | None:
    """The stat key of every file ``manifest`` lists, as ``image`` holds them now (None: one
    cannot be stat'ed)."""
    try:
        return {name: path_key(image / name) for name in sorted(manifest.files)}
    except OSError:
        return None


def _remember_verified(
    image: Path, manifest: Manifest, cache_dir: Path, keys: dict[str, StatKey] | None
) -> None:
    if keys is not None:
        cache = FileCache(cache_dir)
        cache.remember(_verification_name(image, manifest), keys, _expected_files(manifest))


def record_verified(image: Path, manifest: Manifest, cache_dir: Path) -> None:
    """Remember that every file of ``image`` matched ``manifest`` as it is now; best effort:
    a cache that cannot be written only costs a full verification next time."""
    _remember_verified(image, manifest, cache_dir, _listed_keys(image, manifest))


def _cache_hit(image: Path, manifest: Manifest, cache_dir: Path) -> bool:
    keys = _listed_keys(image, manifest)
    if keys is None:
        return False
    remembered = FileCache(cache_dir).lookup(_verification_name(image, manifest), keys)
    return remembered == _expected_files(manifest)


def is_verified(image: Path, manifest: Manifest, cache_dir: Path) -> bool:
    """True when a full verification against this manifest is cached, no listed file changed
    since and nothing else is there (no hashing)."""
    try:
        check_image_tree(image, manifest)
    except (ImageError, OSError):
        return False
    return _cache_hit(image, manifest, cache_dir)


def file_keys(image: Path, manifest: Manifest) -> dict[str, StatKey] | None:
    """The stat key of every file ``manifest`` lists, as ``image`` holds them now (None: one
    cannot be stat'ed): compare with :func:`unchanged_since` later."""
    return _listed_keys(image, manifest)


def unchanged_since(image: Path, manifest: Manifest, keys: dict[str, StatKey] | None) -> bool:
    """True when ``image`` holds exactly the files ``manifest`` lists, each with the stat key
    :func:`file_keys` gave (no file changed, added or removed since; no hashing)."""
    if keys is None:
        return False
    try:
        check_image_tree(image, manifest)
    except (ImageError, OSError):
        return False
    return _listed_keys(image, manifest) == keys


REFETCH_HINT = "re-import the image from its archive or bake it again"
# The directories every image has; empty ones are as published (a saved /dev/shm may be empty).
IMAGE_DIRS = ("criu", "shm", "logs")


def check_file_set(
    image: Path, manifest: Manifest, present: set[str], error: type[ImageError] = ImageError
) -> None:
    """Raise ``error`` naming the first manifest file absent from ``present``, else the first
    file present that the manifest does not list."""
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise error(f"image file missing: {missing[0]} ({REFETCH_HINT})", path=image / missing[0])
    extra = sorted(present - set(manifest.files))
    if extra:
        raise error(
            f"unexpected file in image: {extra[0]} is not in the manifest, and CRIU or a "
            f"restore could read it ({REFETCH_HINT})",
            path=image / extra[0],
        )


def listed_directories(manifest: Manifest) -> set[str]:
    """Every directory that holds a file the manifest lists (relative)."""
    return {str(parent) for name in manifest.files for parent in Path(name).parents}


def is_image_directory(relative: str, listed: set[str]) -> bool:
    """Whether an image may have this directory (``listed``: :func:`listed_directories`): one
    of its own, one holding a listed file, or a saved /dev/shm's (empty ones are kept)."""
    return relative in IMAGE_DIRS or relative.startswith("shm/") or relative in listed


def check_image_tree(
    image: Path, manifest: Manifest, error: type[ImageError] = ImageError
) -> list[str]:
    """Check every entry under ``image`` (never following a link) against ``manifest``: the
    regular files must be exactly those it lists, each directory one that holds them (or a
    saved /dev/shm's), and nothing else may be there (a symlink, a FIFO, a device node).

    Returns the directories, relative, parents first. Raises ``error`` naming the first entry
    that is wrong and how to get a good image back.
    """
    listed = listed_directories(manifest)
    directories: list[str] = []
    files: set[str] = set()
    for root, dirnames, filenames in os.walk(image):  # links to directories are not entered
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(root) / name
            relative = str(path.relative_to(image))
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                if not is_image_directory(relative, listed):
                    raise error(
                        f"unexpected directory in image: {relative} holds no file of the "
                        f"manifest ({REFETCH_HINT})",
                        path=path,
                    )
                directories.append(relative)
            elif stat.S_ISREG(mode):
                if relative != MANIFEST_NAME:
                    files.add(relative)
            else:
                raise error(
                    f"image entry {relative} is a {describe_mode(mode)}: an image holds only "
                    f"the regular files its manifest lists, in plain directories "
                    f"({REFETCH_HINT})",
                    path=path,
                )
    check_file_set(image, manifest, files, error)
    return sorted(directories)


def _link_groups(files: dict[str, FileEntry]) -> dict[str, frozenset[str]]:
    """Each hard-linked file's name -> every name sharing its inode (group numbers differ
    between two hashings of one tree; the partition does not)."""
    groups: dict[int, set[str]] = {}
    for name, entry in files.items():
        if entry.link_group is not None:
            groups.setdefault(entry.link_group, set()).add(name)
    return {name: frozenset(names) for names in groups.values() for name in names}


def verify_image(image: Path, cache_dir: Path | None = None) -> Manifest:
    """Check every file against the manifest; raise naming the first file that differs.

    A full verification is cached in ``cache_dir`` (per image id and directory, keyed by the
    manifest's file entries and the stat key of every file, see
    :mod:`snapctl.images.filecache`): a hit is as strong as a re-hash. A damaged or
    unwritable cache only costs a full verification.
    """
    manifest = load_manifest(image)
    check_image_tree(image, manifest)  # every time: the cache vouches only for listed files
    if cache_dir is not None and _cache_hit(image, manifest, cache_dir):
        return manifest
    # Keyed as they were before hashing: a file written while it was read is not vouched for.
    before = _listed_keys(image, manifest) if cache_dir is not None else None
    actual = hash_tree(image)
    for name, expected in sorted(manifest.files.items()):
        got = actual[name]
        if got.size != expected.size or got.sha256 != expected.sha256:
            raise ImageError(f"image file {name} does not match its sha256", path=image / name)
    expected_links, actual_links = _link_groups(manifest.files), _link_groups(actual)
    for name in sorted(manifest.files):
        if expected_links.get(name) != actual_links.get(name):
            raise ImageError(
                f"image file {name} does not share its inode as the manifest records "
                "(hard links lost or added)",
                path=image / name,
            )
    if cache_dir is not None and before is not None and _listed_keys(image, manifest) == before:
        _remember_verified(image, manifest, cache_dir, before)
    return manifest


def stage_shm_copy(source: Path, target: Path) -> None:
    """Copy a saved /dev/shm into ``target``, keeping modes and hard-link identity.

    CRIU's ``link_remap.N`` and a named semaphore's ``sem.NAME`` are one inode; copied as two
    files the restore still succeeds but ``sem_open`` by name reaches a different semaphore.
    Holes stay holes: a server's shared-memory segments are mostly never written (vLLM's are
    hundreds of MiB, a few KiB of data), and copying their zeros would cost both the time and
    the copy's memory.
    """
    seen: dict[tuple[int, int], Path] = {}
    path = source
    try:
        for path in sorted(source.rglob("*")):
            destination = target / path.relative_to(source)
            st = path.lstat()
            if stat.S_ISDIR(st.st_mode):
                destination.mkdir(mode=st.st_mode & 0o7777, exist_ok=True)
                continue
            if not stat.S_ISREG(st.st_mode):
                # Verification refuses these too; a copy's /dev/shm never gets one.
                raise ImageError(
                    f"cannot stage the saved /dev/shm: {path} is a {describe_mode(st.st_mode)} "
                    f"({REFETCH_HINT})",
                    path=path,
                )
            key = (st.st_dev, st.st_ino)
            if key in seen:
                os.link(seen[key], destination)
                continue
            if stat.S_ISREG(st.st_mode):
                _copy_sparse(path, destination, st.st_size)
                shutil.copystat(path, destination, follow_symlinks=False)
            else:
                shutil.copy2(path, destination, follow_symlinks=False)
            os.chown(destination, st.st_uid, st.st_gid, follow_symlinks=False)
            seen[key] = destination
    except OSError as error:
        raise ImageError(
            f"cannot stage the saved /dev/shm: {path}: {error.strerror or error}", path=path
        ) from error


def _copy_sparse(source: Path, destination: Path, size: int) -> None:
    """Copy only the data extents of ``source`` (SEEK_DATA/SEEK_HOLE), then set its size."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while offset < size:
                try:
                    data = os.lseek(src, offset, os.SEEK_DATA)
                except OSError as error:
                    if error.errno == errno.ENXIO:  # only a hole is left
                        break
                    raise
                offset = os.lseek(src, data, os.SEEK_HOLE)
                os.lseek(dst, data, os.SEEK_SET)
                while data < offset:
                    sent = os.sendfile(dst, src, data, offset - data)
                    if sent == 0:
                        raise OSError(errno.EIO, f"{source} shrank while it was copied")
                    data += sent
            os.ftruncate(dst, size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def sync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root``, deepest first: a published image
    is on disk before its manifest says so, and restores that follow do not compete with its
    writeback."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(directory, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue  # links point into the image (or nowhere); nothing else is data
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(Path(directory))


class ImageStaging:
    """A staging directory beside the final image path, published by one rename.

    Replacing an existing image (``force``) holds it exclusively from here until the rename,
    so an image a copy still reads is never replaced under it. With ``claims`` (the state
    directory's, see ``snapctl.supervision.leftovers``) the staging directory and the name the
    old image is moved aside to are claimed before either exists, so ``snapctl gc`` removes
    them if this process is killed before it does.
    """

    def __init__(self, final: Path, force: bool = False, claims: Path | None = None) -> None:
        self.final = final.absolute()
        self.force = force
        self._hold: ImageHold | None = None
        self._claim: ClaimHandle | None = None
        if self.final.exists() and not force:
            raise ImageExistsError(
                f"image directory {self.final} already exists (use --force to replace it)",
                path=self.final,
            )
        if self.final.is_dir():
            self._hold = hold_image(self.final, exclusive=True)
        self.dir = self.final.parent / f".{self.final.name}.staging-{uuid.uuid4().hex[:8]}"
        self._old = self.final.parent / f".{self.final.name}.replaced-{uuid.uuid4().hex[:8]}"
        try:
            if claims is not None:
                self._claim = claim(claims, [self.dir, self._old])
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.dir.mkdir(mode=0o700)
            for sub in ("criu", "shm", "logs"):
                (self.dir / sub).mkdir(mode=0o700)
        except OSError as error:
            self.abort()
            what = f"cannot create a staging directory beside {self.final}"
            if is_no_space(error):
                raise NoSpaceError.at(self.final.parent, what, phase=HostPhase.IMAGE) from error
            raise ImageWriteError(f"{what}: {error.strerror}", path=self.final.parent) from error

    def publish(self, manifest: Manifest) -> Path:
        """Write the manifest last, then rename the staging directory into place.

        Without ``force`` an image that appeared under the name since the staging began is
        refused, never replaced. On failure the previous image (if any) stays published and
        the caller still owns the staging directory (``abort``). Every file is fsynced
        first, the manifest with its directory, and the parent after the rename: "published"
        survives a crash.
        """
        try:
            sync_tree(self.dir)
            write_json_atomic(
                self.dir / MANIFEST_NAME, manifest.model_dump(mode="json"),
                max_bytes=MAX_MANIFEST_BYTES,
            )  # fmt: skip
        except (OSError, SnapctlError) as error:
            what = f"cannot write {self.final} to disk"
            if is_no_space(error):
                raise NoSpaceError.at(self.dir, what, phase=HostPhase.IMAGE) from error
            detail = error.strerror if isinstance(error, OSError) else error.message
            raise ImageWriteError(f"{what}: {detail}", path=self.dir) from error
        try:
            if not os.path.lexists(self.final):
                os.rename(self.dir, self.final)
            elif not self.force:
                raise ImageExistsError(
                    f"image directory {self.final} appeared while this image was staged",
                    path=self.final,
                )
            else:
                if self._hold is None:  # it appeared since __init__: hold it like any other
                    self._hold = hold_image(self.final, exclusive=True)
                # Move the old image aside first so a crash never leaves neither.
                old = self._old
                os.rename(self.final, old)
                try:
                    os.rename(self.dir, self.final)
                except OSError:
                    os.rename(old, self.final)
                    raise
                # Published: a leftover of the old image is hidden and harmless.
                shutil.rmtree(old, ignore_errors=True)
            fsync_directory(self.final.parent)
        except OSError as error:
            raise ImageWriteError(
                f"cannot publish {self.final}: {error.strerror}", path=self.final
            ) from error
        finally:
            self._release()
        self._drop_claim()
        return self.final

    def abort(self) -> None:
        """Remove the staging directory and drop the hold; harmless after ``publish``."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._release()
        self._drop_claim()

    def _release(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def _drop_claim(self) -> None:
        # Only once nothing it names is left (a failed publish still owns its staging dir).
        if self._claim is not None and not (self.dir.exists() or self._old.exists()):
            self._claim.release()
            self._claim = None
