"""Moving an image between hosts as one file: a zstd-compressed tar (``.tar.zst``) whose first
member is ``manifest.json``.

Export streams every file through sha256 on the way out and refuses an image that no longer
matches its manifest. Import reads the manifest first, then checks each member's name, type,
size and sha256 while unpacking into a staging directory beside the target, which is renamed
into place only when everything matched: on any failure nothing usable appears. Only plain
files, directories and hard links to earlier members are accepted; absolute names, ``..``,
duplicates, symlinks, device nodes, sparse members and links leading outside are refused.
What an import may write is bounded before it writes: the manifest's sizes must fit in the
space free at the destination, and no member may yield more bytes than it declares.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import struct
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, ValidationError

from snapctl.errors import ExitStatus, NoSpaceError, is_no_space
from snapctl.images.lock import hold_image
from snapctl.images.manifest import MANIFEST_NAME, Manifest, is_safe_relative
from snapctl.images.ownership import arriving_mode
from snapctl.images.store import (
    CHUNK,
    MAX_MANIFEST_BYTES,
    ImageError,
    ImageExistsError,
    ImageStaging,
    check_image_tree,
    is_image_directory,
    listed_directories,
    manifest_problem,
    record_verified,
)
from snapctl.phases import HostPhase
from snapctl.progress import ByteProgress

ARCHIVE_SUFFIX = ".tar.zst"
DEFAULT_LEVEL = 3
# The archive ends in a zstd skippable frame (ignored by ``zstd -d``) holding the sha256 of
# every byte before it: a flipped byte that still decompresses to the same content (a frame
# header bit, an unused table bit) is caught too, and the digest can be compared out of band.
SEAL_MAGIC = 0x184D2A5E
SEAL_LABEL = b"SNAPCTL-SHA256\0\0"
SEAL_BYTES = 8 + len(SEAL_LABEL) + 32


class ArchiveError(ImageError):
    """An archive is malformed, hostile, or does not match its manifest; nothing was published."""

    exit_status = ExitStatus.VERIFY_FAILED


class ArchiveReport(BaseModel):
    """What an export or import moved and how fast (``--json``)."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["export", "import"]
    image: str
    archive: str
    image_id: str
    files: int
    image_bytes: int
    archive_bytes: int
    seconds: float
    mb_per_s: float  # image (uncompressed) bytes per second, 1 MB = 10^6 bytes
    manifest_sha256: str
    archive_sha256: str  # of the archive's body, as recorded in its seal


def _report(
    action: Literal["export", "import"],
    image: Path,
    archive: Path,
    manifest: Manifest,
    manifest_bytes: bytes,
    seconds: float,
    archive_sha256: str,
) -> ArchiveReport:
    total = manifest.total_bytes + len(manifest_bytes)
    return ArchiveReport(
        action=action,
        image=str(image),
        archive=str(archive),
        image_id=manifest.image_id,
        files=len(manifest.files),
        image_bytes=total,
        archive_bytes=archive.stat().st_size,
        seconds=round(seconds, 6),
        mb_per_s=round(total / 1e6 / seconds, 3) if seconds > 0 else 0.0,
        manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
        archive_sha256=archive_sha256,
    )


class _HashingReader:
    """Reads a file for tarfile while hashing it and reporting progress."""

    def __init__(self, handle: IO[bytes], progress: ByteProgress | None) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        if self.progress is not None and data:
            self.progress(len(data))
        return data


class _SealedBody:
    """Reads an archive's body (everything before the seal) for the decompressor, hashing it
    and reporting progress; EOF comes at the seal."""

    def __init__(self, handle: IO[bytes], size: int, progress: ByteProgress | None) -> None:
        self.handle = handle
        self.left = size
        self.digest = hashlib.sha256()
        self.progress = progress

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.handle.read(size)
        self.left -= len(data)
        self.digest.update(data)
        if self.progress is not None and data:
            self.progress(len(data))
        return data


class _HashingWriter:
    """Passes the compressed stream to the file, hashing it for the seal."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _seal(digest: bytes) -> bytes:
    return struct.pack("<II", SEAL_MAGIC, len(SEAL_LABEL) + len(digest)) + SEAL_LABEL + digest


# --- export -----------------------------------------------------------------------------------


def walk_image(image: Path, manifest: Manifest) -> list[str]:
    """The image's directories (relative, parents first); refuse anything export cannot carry."""
    return check_image_tree(image, manifest, ArchiveError)


@contextlib.contextmanager
def held_for_reading(image: Path) -> Iterator[tuple[Manifest, bytes, list[str]]]:
    """Hold ``image`` shared (copies may read meanwhile; rm and replace wait) and yield its
    manifest, the manifest's bytes and its directories; refuse an image that has a file the
    manifest does not list, or lacks one it does."""
    try:
        hold = hold_image(image)
    except (FileNotFoundError, NotADirectoryError) as error:
        raise ImageError(f"{image} is not a published image", path=image) from error
    with hold:
        manifest_path = image / MANIFEST_NAME
        try:
            with manifest_path.open("rb") as handle:
                manifest_bytes = handle.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError as error:
            raise ImageError(f"{image} is not a published image", path=image) from error
        manifest = parse_manifest(manifest_bytes, manifest_path)
        yield manifest, manifest_bytes, walk_image(image, manifest)


def _tarinfo(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)
    return info


def export_image(
    image: Path,
    out: Path,
    *,
    force: bool = False,
    level: int = DEFAULT_LEVEL,
    threads: int = -1,
    progress: ByteProgress | None = None,
) -> ArchiveReport:
    """Write ``image`` to ``out`` (zstd with ``threads`` workers; -1: one per CPU), checking
    every file against the manifest on the way; ``out`` appears only when complete."""
    image, out = image.absolute(), out.absolute()
    if out.exists() and not force:
        raise ImageExistsError(f"{out} already exists (use --force to replace it)", path=out)
    started = time.monotonic()
    with held_for_reading(image) as (manifest, manifest_bytes, directories):
        tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with tmp.open("xb") as raw:
                compressor = zstandard.ZstdCompressor(
                    level=level, threads=threads, write_checksum=True
                )
                body = _HashingWriter(raw)
                with (
                    compressor.stream_writer(body, closefd=False) as compressed,  # type: ignore[arg-type]
                    tarfile.open(
                        fileobj=compressed,
                        mode="w|",
                        format=tarfile.PAX_FORMAT,
                    ) as tar,
                ):
                    _write_members(tar, image, manifest, manifest_bytes, directories, progress)
                raw.write(_seal(body.digest.digest()))
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, out)
        except BaseException as error:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            if isinstance(error, OSError):
                where = Path(error.filename) if error.filename else out
                raise ArchiveError(
                    f"cannot export to {out}: {where}: {error.strerror or error}", path=where
                ) from error
            raise
    seconds = time.monotonic() - started
    return _report("export", image, out, manifest, manifest_bytes, seconds, body.digest.hexdigest())


def _write_members(
    tar: tarfile.TarFile,
    image: Path,
    manifest: Manifest,
    manifest_bytes: bytes,
    directories: list[str],
    progress: ByteProgress | None,
) -> None:
    # The manifest first, so an import knows every expected hash before any content arrives.
    info = _tarinfo(MANIFEST_NAME, (image / MANIFEST_NAME).stat())
    info.size = len(manifest_bytes)
    tar.addfile(info, _HashingReader(_BytesReader(manifest_bytes), progress))  # type: ignore[arg-type]
    for name in directories:
        info = _tarinfo(name, (image / name).lstat())
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    first_of_inode: dict[tuple[int, int], str] = {}
    for name, entry in sorted(manifest.files.items()):
        path = image / name
        st = path.lstat()
        info = _tarinfo(name, st)
        inode = (st.st_dev, st.st_ino)
        if inode in first_of_inode:
            info.type = tarfile.LNKTYPE
            info.linkname = first_of_inode[inode]
            tar.addfile(info)
            continue
        first_of_inode[inode] = name
        if st.st_size != entry.size:
            raise ArchiveError(f"image file {name} does not match its manifest size", path=path)
        info.size = entry.size
        with path.open("rb") as handle:
            reader = _HashingReader(handle, progress)
            tar.addfile(info, reader)
        if reader.digest.hexdigest() != entry.sha256:
            raise ArchiveError(f"image file {name} does not match its sha256", path=path)


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else self.pos + size
        chunk = self.data[self.pos : end]
        self.pos += len(chunk)
        return chunk


# --- import -----------------------------------------------------------------------------------

FreeBytes = Callable[[Path], int]


def free_bytes_at(path: Path) -> int:
    """Bytes free to this process on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


def parse_manifest(data: bytes, where: Path) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArchiveError(f"manifest exceeds {MAX_MANIFEST_BYTES} bytes", path=where)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as error:
        raise ArchiveError(
            f"manifest is not valid: {manifest_problem(error)}", path=where
        ) from error


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "a symbolic link"
    if member.ischr() or member.isblk():
        return "a device node"
    if member.isfifo():
        return "a fifo"
    return f"of tar type {member.type!r}"


def _is_sparse(member: tarfile.TarInfo) -> bool:
    """A GNU sparse member in any form: old GNU (type ``S``) or PAX (``GNU.sparse.*``), even
    one tarfile does not decode. tarfile counts them as regular files and expands their holes
    to zeros, so a few bytes of archive would write a dense file of whatever size they say."""
    return (
        member.issparse()
        or member.type == tarfile.GNUTYPE_SPARSE
        or any(key.startswith("GNU.sparse") for key in member.pax_headers)
    )


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """``tar``'s members, a header tarfile cannot decode (a GNU sparse map that is not numbers)
    raising ``tarfile.ReadError``, as every other damage does, not ``ValueError``."""
    while True:
        try:
            member = tar.next()
        except ValueError as error:
            raise tarfile.ReadError(f"unreadable member header: {error}") from error
        if member is None:
            return
        yield member


def _amount(size: int) -> str:
    return f"{size:,} bytes ({size / (1 << 20):.1f} MiB)"


class _Unpacker:
    """Checks and writes one archive's members into a staging directory."""

    def __init__(self, archive: Path, root: Path, free_bytes: FreeBytes) -> None:
        self.archive = archive
        self.root = root
        self.free_bytes = free_bytes
        self.manifest: Manifest | None = None
        self.manifest_bytes = b""
        self.seen: set[str] = set()
        self.written: set[str] = set()  # regular files written (hard-link targets)
        self.group_files: dict[int, str] = {}  # the one file written of each hard-link group
        self.linked: set[str] = set()  # hard links made to them
        # Applied in ``finish``: a read-only directory must still take the files inside it.
        self.directory_modes: dict[str, int] = {}
        self.current = "(start)"
        self.listed: set[str] | None = None  # directories holding listed files

    def refuse(self, message: str) -> ArchiveError:
        return ArchiveError(f"archive {self.archive.name}: {message}", path=self.archive)

    def member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = member.name
        self.current = name
        if _is_sparse(member):
            raise self.refuse(f"member {name!r} is a sparse file (only files, directories and "
                              "hard links are accepted)")  # fmt: skip
        if self.manifest is None:
            if name != MANIFEST_NAME or not member.isreg():
                raise self.refuse(f"first member is {name!r}, not {MANIFEST_NAME}")
            if member.size > MAX_MANIFEST_BYTES:
                raise self.refuse(f"manifest exceeds {MAX_MANIFEST_BYTES} bytes")
            source = tar.extractfile(member)
            assert source is not None
            self.manifest_bytes = source.read()
            try:
                self.manifest = parse_manifest(self.manifest_bytes, self.archive)
            except ArchiveError as error:
                raise self.refuse(error.message) from error
            self.seen.add(name)
            self._check_space(self.manifest)
            return
        if not is_safe_relative(name):
            raise self.refuse(f"member {name!r} is not a plain relative path")
        if name in self.seen:
            raise self.refuse(f"member {name} appears twice")
        self.seen.add(name)
        if member.isdir():
            self._directory(member)
        elif member.isreg():
            self._file(tar, member)
        elif member.islnk():
            self._hard_link(member)
        else:
            raise self.refuse(f"member {name} is {_kind(member)} (only files, directories "
                              "and hard links are accepted)")  # fmt: skip

    def _check_space(self, manifest: Manifest) -> None:
        """Refuse, before any file is written, an image the destination has no room for: its
        files as the manifest declares them, a hard-link group once, and the manifest."""
        groups: dict[int, int] = {}
        needed = len(self.manifest_bytes)
        for name, entry in sorted(manifest.files.items()):
            if entry.size < 0:
                raise self.refuse(f"manifest lists {name} with a negative size")
            if entry.link_group is None:
                needed += entry.size
            else:
                groups[entry.link_group] = max(entry.size, groups.get(entry.link_group, 0))
        needed += sum(groups.values())
        free = self.free_bytes(self.root)
        if needed > free:
            where = self.root.parent
            raise NoSpaceError(
                f"cannot import {self.archive.name}, nothing was published: its image needs "
                f"{_amount(needed)} and {where} has {_amount(free)} free (free space there, "
                "or import to another directory)",
                phase=HostPhase.IMAGE, path=where,
            )  # fmt: skip

    def _parent(self, name: str) -> None:
        # Every directory below root was made by us and no symlink is ever created, so
        # resolving below root cannot leave it.
        (self.root / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _directory(self, member: tarfile.TarInfo) -> None:
        assert self.manifest is not None
        if self.listed is None:
            self.listed = listed_directories(self.manifest)
        if member.name in self.manifest.files:
            raise self.refuse(f"member {member.name} is a directory; the manifest lists a file")
        if not is_image_directory(member.name, self.listed):
            raise self.refuse(f"member {member.name} is a directory that holds no image file")
        path = self.root / member.name
        self._parent(member.name)
        if not path.is_dir():
            path.mkdir(mode=0o700)
        self.directory_modes[member.name] = arriving_mode(
            member.name, stat.S_IMODE(member.mode), directory=True
        )

    def _expected(self, name: str) -> tuple[int, str, int | None]:
        assert self.manifest is not None
        entry = self.manifest.files.get(name)
        if entry is None:
            raise self.refuse(f"member {name} is not in the manifest")
        return entry.size, entry.sha256, entry.link_group

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = member.name
        size, sha256, group = self._expected(name)
        if member.size != size:
            raise self.refuse(f"member {name} has {member.size} bytes, the manifest {size}")
        if group is not None:
            # The space check counted the group once: its other names must be hard links.
            first = self.group_files.setdefault(group, name)
            if first != name:
                raise self.refuse(f"member {name} is a second copy of hard-link group {group} "
                                  f"(it must be a hard link to {first})")  # fmt: skip
        self._parent(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.root / name, flags, 0o600)
        digest = hashlib.sha256()
        source = tar.extractfile(member)
        assert source is not None
        written = 0
        with os.fdopen(fd, "wb") as target:
            while chunk := source.read(CHUNK):
                # tarfile bounds a member's reader by its size; what the space check counted
                # holds only while that is so, hence checked before the chunk is written.
                written += len(chunk)
                if written > size:
                    raise self.refuse(f"member {name} holds more than its {size} bytes")
                digest.update(chunk)
                target.write(chunk)
            # Owned by whoever imports: another host's uid/gid would hand the file to
            # whoever holds those ids here (only our restore reads it).
            os.fchmod(target.fileno(), arriving_mode(name, stat.S_IMODE(member.mode),
                                                     directory=False))  # fmt: skip
        if digest.hexdigest() != sha256:
            raise self.refuse(f"member {name} does not match its sha256 in the manifest")
        self.written.add(name)

    def _hard_link(self, member: tarfile.TarInfo) -> None:
        name, target = member.name, member.linkname
        if not is_safe_relative(target) or target not in self.written:
            raise self.refuse(
                f"member {name} links to {target!r}, which is not an earlier file of the archive"
            )
        size, sha256, group = self._expected(name)
        t_size, t_sha256, t_group = self._expected(target)
        if (size, sha256) != (t_size, t_sha256) or group is None or group != t_group:
            raise self.refuse(f"member {name} is a hard link the manifest does not record")
        self._parent(name)
        os.link(self.root / target, self.root / name, follow_symlinks=False)
        self.linked.add(name)

    def finish(self) -> Manifest:
        if self.manifest is None:
            raise self.refuse(f"no {MANIFEST_NAME}: not an image archive")
        # Not ``seen``: a listed name that arrived as a directory was never hashed.
        missing = sorted(set(self.manifest.files) - self.written - self.linked)
        if missing:
            raise self.refuse(f"image file {missing[0]} is missing from the archive")
        groups: dict[int, set[tuple[int, int]]] = {}
        for name, entry in self.manifest.files.items():
            if entry.link_group is not None:
                st = (self.root / name).lstat()
                groups.setdefault(entry.link_group, set()).add((st.st_dev, st.st_ino))
        for group, inodes in groups.items():
            if len(inodes) != 1:
                raise self.refuse(f"hard-link group {group} arrived as separate files")
        for name, mode in sorted(self.directory_modes.items(), reverse=True):  # children first
            os.chmod(self.root / name, mode)
        # What is published is exactly what a copy's verification accepts.
        check_image_tree(self.root, self.manifest, ArchiveError)
        return self.manifest


def import_image(
    archive: Path,
    to: Path,
    *,
    force: bool = False,
    cache_dir: Path | None = None,
    progress: ByteProgress | None = None,
    claims: Path | None = None,
    free_bytes: FreeBytes = free_bytes_at,
) -> ArchiveReport:
    """Unpack ``archive`` into the image directory ``to``, verifying while streaming; publish
    by rename only when every member and the archive's seal matched. ``progress`` counts
    compressed bytes; ``claims`` is where the staging directory is claimed (ImageStaging);
    ``free_bytes`` says how many bytes are free where the staging directory is, which the
    image the manifest declares must fit in (checked before any file is unpacked)."""
    archive, to = archive.absolute(), to.absolute()
    started = time.monotonic()
    try:
        raw = archive.open("rb")
    except OSError as error:
        raise ArchiveError(f"cannot open {archive}: {error.strerror}", path=archive) from error
    with raw:
        size = os.fstat(raw.fileno()).st_size
        seal = os.pread(raw.fileno(), SEAL_BYTES, max(0, size - SEAL_BYTES))
        sealed = seal[:8] == _seal(b"\0" * 32)[:8] and seal[8 : 8 + len(SEAL_LABEL)] == SEAL_LABEL
        staging = ImageStaging(to, force=force, claims=claims)
        unpacker = _Unpacker(archive, staging.dir, free_bytes)
        # Unsealed, the whole file is streamed: a hostile member is named before the seal is.
        body = _SealedBody(raw, size - SEAL_BYTES if sealed else size, progress)
        try:
            try:
                decompressor = zstandard.ZstdDecompressor()
                with decompressor.stream_reader(body) as stream:  # type: ignore[arg-type]
                    with tarfile.open(fileobj=stream, mode="r|") as tar:
                        for member in _members(tar):
                            unpacker.member(tar, member)
                    # Read to the end: zstd checks the frame's checksum only there.
                    while stream.read(CHUNK):
                        pass
                manifest = unpacker.finish()
            except (zstandard.ZstdError, tarfile.TarError, EOFError) as error:
                raise unpacker.refuse(
                    f"corrupt near member {unpacker.current}: {error or type(error).__name__}"
                ) from error
            except OSError as error:
                # A member that collides with another (a file where a directory is needed, a
                # name the staging layout already uses), or the disk: nothing is published.
                if is_no_space(error):
                    raise NoSpaceError.at(
                        staging.dir, f"cannot unpack {archive.name}, nothing was published",
                        phase=HostPhase.IMAGE,
                    ) from error  # fmt: skip
                raise unpacker.refuse(
                    f"cannot unpack member {unpacker.current}: {error.strerror or error}"
                ) from error
            while body.read(CHUNK):  # whatever follows the frame is covered by the seal too
                pass
            if not sealed:
                raise unpacker.refuse("it has no seal (not written by snapctl image export)")
            if seal != _seal(body.digest.digest()):
                raise unpacker.refuse(
                    "its bytes do not match the sha256 in its seal (damaged in transit, or not "
                    "written by snapctl image export)"
                )
            final = staging.publish(manifest)
        except BaseException:
            staging.abort()
            raise
    if cache_dir is not None:
        record_verified(final, manifest, cache_dir)  # every hash was checked while unpacking
    seconds = time.monotonic() - started
    return _report(
        "import", final, archive, manifest, unpacker.manifest_bytes, seconds,
        body.digest.hexdigest(),
    )  # fmt: skip
