"""Image directories on disk: staging and atomic publication, hashing, verification, staging
of the saved ``/dev/shm`` for a restore (hard links kept)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from snapctl.errors import SnapctlError
from snapctl.images.lock import ImageHold, hold_image
from snapctl.images.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapctl.protocol.atomic import write_json_atomic

CHUNK = 4 << 20
# A manifest lists every image file and every file the tree depended on: far above the 64 KiB
# of a control file for a large server, still small enough to read whole.
MAX_MANIFEST_BYTES = 16 << 20


class ImageError(SnapctlError):
    """An image is missing, incomplete, already present, or fails verification."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
        digests = list(pool.map(_sha256, paths))
    return {
        str(path.relative_to(root)): FileEntry(
            size=path.stat().st_size,
            sha256=digest,
            link_group=groups.get(str(path.relative_to(root))),
        )
        for path, digest in zip(paths, digests, strict=True)
    }


def load_manifest(image: Path) -> Manifest:
    path = image / MANIFEST_NAME
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ImageError(f"{path} exceeds {MAX_MANIFEST_BYTES} bytes", path=path)
        return Manifest.model_validate_json(data)
    except FileNotFoundError as error:
        raise ImageError(
            f"{image} is not a published image (no {MANIFEST_NAME})", path=image
        ) from error
    except ValidationError as error:
        raise ImageError(f"{path} is not a valid manifest: {error}", path=path) from error


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _cache_file(cache_dir: Path, manifest: Manifest, image: Path) -> Path:
    # Per image id and directory: an exported image imported elsewhere keeps its id.
    where = hashlib.sha256(str(image.absolute()).encode()).hexdigest()[:12]
    return cache_dir / f"{manifest.image_id}-{where}.json"


def _stat_keys(image: Path, manifest: Manifest) -> dict[str, list[int]]:
    return {name: _stat_key(image / name) for name in sorted(manifest.files)}


def record_verified(image: Path, manifest: Manifest, cache_dir: Path) -> None:
    """Remember that every file of ``image`` matched its sha256 as it is now."""
    cache = _cache_file(cache_dir, manifest, image)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(_stat_keys(image, manifest)))
    os.replace(tmp, cache)


def is_verified(image: Path, manifest: Manifest, cache_dir: Path) -> bool:
    """True when a full verification is cached and no file changed since (no hashing)."""
    try:
        cached = json.loads(_cache_file(cache_dir, manifest, image).read_text())
        return bool(cached == _stat_keys(image, manifest))
    except (OSError, ValueError):
        return False


def verify_image(image: Path, cache_dir: Path | None = None) -> Manifest:
    """Check every file against the manifest; raise naming the first file that differs.

    A full hash is cached (per image id, by size, mtime, ctime and inode of every file) in
    ``cache_dir``; any change to a file changes its ctime, so a cache hit is as strong as a
    re-hash for files only the system itself could alter.
    """
    manifest = load_manifest(image)
    present = {str(p.relative_to(image)) for p in _files(image)}
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise ImageError(f"image file missing: {missing[0]}", path=image / missing[0])
    extra = sorted(present - set(manifest.files))
    if extra:
        raise ImageError(f"unexpected file in image: {extra[0]}", path=image / extra[0])
    # A damaged cache only costs a full verification.
    if cache_dir is not None and is_verified(image, manifest, cache_dir):
        return manifest
    actual = hash_tree(image)
    for name, expected in manifest.files.items():
        got = actual[name]
        if got.size != expected.size or got.sha256 != expected.sha256:
            raise ImageError(f"image file {name} does not match its sha256", path=image / name)
        if got.link_group is None and expected.link_group is not None:
            raise ImageError(f"image file {name} lost its hard links", path=image / name)
    if cache_dir is not None:
        record_verified(image, manifest, cache_dir)
    return manifest


def stage_shm_copy(source: Path, target: Path) -> None:
    """Copy a saved /dev/shm into ``target``, keeping modes and hard-link identity.

    CRIU's ``link_remap.N`` and a named semaphore's ``sem.NAME`` are one inode; copied as two
    files the restore still succeeds but ``sem_open`` by name reaches a different semaphore.
    """
    seen: dict[tuple[int, int], Path] = {}
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        destination = target / relative
        st = path.lstat()
        if path.is_dir():
            destination.mkdir(mode=st.st_mode & 0o7777, exist_ok=True)
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            os.link(seen[key], destination)
            continue
        shutil.copy2(path, destination, follow_symlinks=False)
        os.chown(destination, st.st_uid, st.st_gid, follow_symlinks=False)
        seen[key] = destination


class ImageStaging:
    """A staging directory beside the final image path, published by one rename.

    Replacing an existing image (``force``) holds it exclusively from here until the rename,
    so an image a copy still reads is never replaced under it.
    """

    def __init__(self, final: Path, force: bool = False) -> None:
        self.final = final.absolute()
        self.force = force
        self._hold: ImageHold | None = None
        if self.final.exists() and not force:
            raise ImageError(
                f"image directory {self.final} already exists (use --force to replace it)",
                path=self.final,
            )
        if self.final.is_dir():
            self._hold = hold_image(self.final, exclusive=True)
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.dir = self.final.parent / f".{self.final.name}.staging-{uuid.uuid4().hex[:8]}"
            self.dir.mkdir(mode=0o700)
        except OSError as error:
            self._release()
            raise ImageError(
                f"cannot create a staging directory beside {self.final}: {error.strerror}",
                path=self.final.parent,
            ) from error
        for sub in ("criu", "shm", "logs"):
            (self.dir / sub).mkdir(mode=0o700)

    def publish(self, manifest: Manifest) -> Path:
        """Write the manifest last, then rename the staging directory into place."""
        write_json_atomic(
            self.dir / MANIFEST_NAME, manifest.model_dump(mode="json"), max_bytes=MAX_MANIFEST_BYTES
        )
        try:
            if self.final.exists():
                # --force: move the old image aside first so a crash never leaves neither.
                old = self.final.parent / f".{self.final.name}.replaced-{uuid.uuid4().hex[:8]}"
                os.rename(self.final, old)
                os.rename(self.dir, self.final)
                shutil.rmtree(old)
            else:
                os.rename(self.dir, self.final)
        finally:
            self._release()
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None
