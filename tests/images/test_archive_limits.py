"""Image archives that would write more than they declare: sparse members (GNU and PAX), an
image larger than the free space at the destination, and a member that yields more bytes than
its size. Every archive is built here, byte by byte where tarfile cannot write it, and sealed
as export seals it, so only what is under test can be what is refused."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import zstandard

from snapctl.errors import ExitStatus, NoSpaceError
from snapctl.images import load_manifest, verify_image
from snapctl.images.archive import ArchiveError, _seal, export_image, import_image
from snapctl.images.manifest import Manifest
from tests.images.factories import publish_sample

BLOCK = tarfile.BLOCKSIZE
PAGES = "criu/pages-1.img"
# What a forged manifest says the sparse page file holds: holes only, so the member carries
# almost nothing while the file it describes is this large.
HOLES = 1 << 20


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A published sample image to build archives from."""
    publish_sample(tmp_path / "src")
    return tmp_path / "src"


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def regular(name: str, data: bytes, **pax: str) -> bytes:
    """A regular file member (PAX headers ``pax``, if any) as tar bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.pax_headers = len(data), 0o600, dict(pax)
    return info.tobuf(tarfile.PAX_FORMAT) + padded(data)


def hard_link(name: str, target: str) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.LNKTYPE, target, 0o600
    return info.tobuf(tarfile.PAX_FORMAT)


def gnu_sparse(name: str, realsize: int) -> bytes:
    """An old GNU sparse member (type 'S'): one empty region at ``realsize``, so the file is
    a hole of ``realsize`` bytes and the member carries no data. tarfile cannot write one."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = tarfile.GNUTYPE_SPARSE, 0, 0o600
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:398] = tarfile.itn(realsize, 12, tarfile.GNU_FORMAT)  # first region: offset
    header[398:410] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # and length
    header[483:495] = tarfile.itn(realsize, 12, tarfile.GNU_FORMAT)  # the file's real size
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header)


def pax_sparse(name: str, version: str, realsize: int) -> bytes:
    """A PAX member in GNU's sparse format ``version`` (0.0, 0.1 or 1.0): a hole of
    ``realsize`` bytes."""
    if version == "1.0":
        # The map (region count, then offset and length of each) opens the data area.
        info = tarfile.TarInfo(f"GNUSparseFile.0/{Path(name).name}")
        info.size, info.mode = BLOCK, 0o600
        info.pax_headers = {
            "GNU.sparse.major": "1", "GNU.sparse.minor": "0",
            "GNU.sparse.name": name, "GNU.sparse.realsize": str(realsize),
        }  # fmt: skip
        return info.tobuf(tarfile.PAX_FORMAT) + padded(f"1\n{realsize}\n0\n".encode())
    info = tarfile.TarInfo(name)
    info.size, info.mode = 0, 0o600
    info.pax_headers = {"GNU.sparse.size": str(realsize), "GNU.sparse.numblocks": "1"}
    if version == "0.1":
        info.pax_headers["GNU.sparse.map"] = f"{realsize},0"
    else:
        info.pax_headers |= {"GNU.sparse.offset": str(realsize), "GNU.sparse.numbytes": "0"}
    return info.tobuf(tarfile.PAX_FORMAT)


def forged(source: Path, files: dict[str, tuple[int, str]]) -> bytes:
    """The manifest of ``source`` with the given files' (size, sha256) replaced."""
    document: dict[str, Any] = json.loads((source / "manifest.json").read_bytes())
    for name, (size, sha256) in files.items():
        document["files"][name] = {**document["files"][name], "size": size, "sha256": sha256}
    return json.dumps(document).encode()


def sealed(path: Path, manifest: bytes, members: list[bytes]) -> Path:
    """A sealed archive: ``manifest`` first, then ``members`` (tar bytes), as export seals it."""
    tar = regular("manifest.json", manifest) + b"".join(members) + b"\0" * (2 * BLOCK)
    body = zstandard.ZstdCompressor().compress(tar)
    path.write_bytes(body + _seal(hashlib.sha256(body).digest()))
    return path


def genuine(source: Path, instead: dict[str, bytes] | None = None) -> list[bytes]:
    """Every file of ``source`` as export writes it, except those named in ``instead``, which
    arrive as the given tar bytes."""
    replaced = instead or {}
    out: list[bytes] = []
    first_of_group: dict[int, str] = {}
    for name, entry in sorted(load_manifest(source).files.items()):
        if name in replaced:
            out.append(replaced[name])
        elif entry.link_group in first_of_group:
            out.append(hard_link(name, first_of_group[entry.link_group]))
        else:
            if entry.link_group is not None:
                first_of_group[entry.link_group] = name
            out.append(regular(name, (source / name).read_bytes()))
    return out


def members_of(archive: Path) -> list[tarfile.TarInfo]:
    with archive.open("rb") as raw:
        stream = zstandard.ZstdDecompressor().stream_reader(raw)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            return list(tar)


def nothing_left(target: Path) -> bool:
    """No image and no staging directory beside it."""
    return list(target.parent.iterdir()) == [] if target.parent.exists() else True


# --- sparse members ----------------------------------------------------------------------------

ZEROS = hashlib.sha256(b"\0" * HOLES).hexdigest()
SPARSE = {
    "GNU type S": gnu_sparse(PAGES, HOLES),
    "PAX 0.0": pax_sparse(PAGES, "0.0", HOLES),
    "PAX 0.1": pax_sparse(PAGES, "0.1", HOLES),
    "PAX 1.0": pax_sparse(PAGES, "1.0", HOLES),
}


@pytest.mark.parametrize("case", sorted(SPARSE))
def test_a_sparse_member_is_refused_before_its_holes_are_written(
    tmp_path: Path, source: Path, case: str
) -> None:
    # The manifest is forged to match what the holes expand to, and the archive is sealed: a
    # member that is tiny in the archive would otherwise pass as a dense file of any size.
    archive = sealed(
        tmp_path / "sparse.tar.zst",
        forged(source, {PAGES: (HOLES, ZEROS)}),
        genuine(source, {PAGES: SPARSE[case]}),
    )
    assert archive.stat().st_size < 4096
    sparse = [m for m in members_of(archive) if m.name == PAGES]
    assert [(m.issparse(), m.size) for m in sparse] == [(True, HOLES)]  # tarfile reads it so
    target = tmp_path / "dst" / "image"

    with pytest.raises(ArchiveError, match=r"member 'criu/pages-1\.img' is a sparse file"):
        import_image(archive, target)

    assert nothing_left(target)


def test_a_member_with_gnu_sparse_headers_tarfile_does_not_decode_is_refused(
    tmp_path: Path, source: Path
) -> None:
    # A sparse format tarfile does not know reads as a plain file; what another tar would
    # make of it is unknown, so any GNU.sparse header is refused, even on genuine content.
    data = (source / PAGES).read_bytes()
    archive = sealed(
        tmp_path / "sparse.tar.zst",
        (source / "manifest.json").read_bytes(),
        genuine(source, {PAGES: regular(PAGES, data, **{"GNU.sparse.major": "2"})}),
    )
    assert not [m for m in members_of(archive) if m.issparse()]
    target = tmp_path / "dst" / "image"

    with pytest.raises(ArchiveError, match=r"member 'criu/pages-1\.img' is a sparse file"):
        import_image(archive, target)

    assert nothing_left(target)


def test_a_sparse_manifest_is_refused(tmp_path: Path, source: Path) -> None:
    manifest = (source / "manifest.json").read_bytes()
    tar = pax_sparse("manifest.json", "0.1", len(manifest)) + b"\0" * (2 * BLOCK)
    body = zstandard.ZstdCompressor().compress(tar)
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(body + _seal(hashlib.sha256(body).digest()))

    with pytest.raises(ArchiveError, match=r"member 'manifest\.json' is a sparse file"):
        import_image(archive, tmp_path / "image")


def test_an_unreadable_sparse_map_is_an_archive_error(tmp_path: Path, source: Path) -> None:
    # tarfile raises ValueError on a GNU 1.0 sparse map that is not numbers.
    info = tarfile.TarInfo("GNUSparseFile.0/pages-1.img")
    info.size, info.mode = BLOCK, 0o600
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
    bad = info.tobuf(tarfile.PAX_FORMAT) + padded(b"one\n")
    archive = sealed(
        tmp_path / "bad.tar.zst",
        (source / "manifest.json").read_bytes(),
        genuine(source, {PAGES: bad}),
    )
    target = tmp_path / "dst" / "image"

    with pytest.raises(ArchiveError, match=r"bad\.tar\.zst: corrupt near member criu/core"):
        import_image(archive, target)

    assert nothing_left(target)


# --- declared size against free space ------------------------------------------------------------


def needed(manifest: Manifest, manifest_bytes: int) -> int:
    """The bytes an import writes: each file once (a hard-link group once), and the manifest."""
    groups = {e.link_group: e.size for e in manifest.files.values() if e.link_group is not None}
    alone = sum(e.size for e in manifest.files.values() if e.link_group is None)
    return alone + sum(groups.values()) + manifest_bytes


class FreeSpace:
    """A ``free_bytes`` seam that says ``free`` and records what the staging directory held
    when it was asked."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.asked: list[tuple[Path, list[Path]]] = []

    def __call__(self, path: Path) -> int:
        self.asked.append((path, sorted(p for p in path.rglob("*") if not p.is_dir())))
        return self.free


@pytest.fixture
def exported(tmp_path: Path, source: Path) -> tuple[Path, int]:
    """The sample image's archive, and the bytes importing it writes."""
    archive = tmp_path / "image.tar.zst"
    export_image(source, archive)
    return archive, needed(load_manifest(source), (source / "manifest.json").stat().st_size)


def test_an_image_larger_than_the_free_space_is_refused_before_anything_is_unpacked(
    tmp_path: Path, exported: tuple[Path, int]
) -> None:
    archive, size = exported
    target = tmp_path / "dst" / "image"
    free = FreeSpace(size - 1)

    with pytest.raises(NoSpaceError) as info:
        import_image(archive, target, free_bytes=free)

    message = str(info.value)
    assert f"needs {size:,} bytes" in message and f"has {size - 1:,} bytes" in message
    assert str(target.parent) in message and "image.tar.zst" in message
    assert info.value.exit_status == ExitStatus.UNAVAILABLE
    [(asked, files)] = free.asked
    assert asked.parent == target.parent and files == []  # beside the target, still empty
    assert nothing_left(target)


def test_an_image_that_just_fits_is_imported(tmp_path: Path, exported: tuple[Path, int]) -> None:
    archive, size = exported
    target = tmp_path / "dst" / "image"

    import_image(archive, target, free_bytes=FreeSpace(size))

    assert verify_image(target).image_id == "0" * 32


def test_a_manifest_declaring_more_than_any_disk_holds_is_refused_for_space(
    tmp_path: Path, source: Path
) -> None:
    # The real free space (the default seam): nothing is written before the refusal.
    archive = sealed(
        tmp_path / "huge.tar.zst",
        forged(source, {PAGES: (1 << 60, "0" * 64)}),
        genuine(source),
    )
    target = tmp_path / "dst" / "image"

    with pytest.raises(NoSpaceError, match=r"its image needs 1,152,921,50[0-9,]+ bytes"):
        import_image(archive, target)

    assert nothing_left(target)


def test_a_negative_size_in_the_manifest_is_refused(tmp_path: Path, source: Path) -> None:
    # It would shrink the declared total below what the other members write.
    archive = sealed(
        tmp_path / "neg.tar.zst",
        forged(source, {"logs/dump.log": (-(1 << 40), "0" * 64)}),
        genuine(source),
    )
    target = tmp_path / "dst" / "image"

    with pytest.raises(ArchiveError, match=r"manifest lists logs/dump\.log with a negative size"):
        import_image(archive, target, free_bytes=FreeSpace(1 << 50))

    assert nothing_left(target)


def test_a_hard_link_group_arriving_twice_as_data_is_refused_at_its_second_file(
    tmp_path: Path, source: Path
) -> None:
    # The declared total counts a group once: a second copy of its data is never written.
    data = (source / "shm" / "sem.x").read_bytes()
    archive = sealed(
        tmp_path / "twice.tar.zst",
        (source / "manifest.json").read_bytes(),
        genuine(source, {"shm/sem.x": regular("shm/sem.x", data)}),
    )
    target = tmp_path / "dst" / "image"

    with pytest.raises(
        ArchiveError, match=r"member shm/sem\.x is a second copy of hard-link group \d+ "
        r"\(it must be a hard link to shm/link_remap\.7\)"
    ):  # fmt: skip
        import_image(archive, target)

    assert nothing_left(target)


def test_a_member_that_yields_more_than_its_size_stops_before_the_excess_is_written(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tarfile bounds a member's reader by its size; should a reader yield more, the excess is
    # refused, not written, even when the manifest's sha256 covers it.
    more = b"dump log\n" + b"x" * 100
    archive = sealed(
        tmp_path / "more.tar.zst",
        forged(source, {"logs/dump.log": (9, hashlib.sha256(more).hexdigest())}),
        genuine(source),
    )
    original: Callable[..., IO[bytes] | None] = tarfile.TarFile.extractfile

    def overlong(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes] | None:
        reader = original(tar, member)
        if member.name == "logs/dump.log" and reader is not None:
            return io.BytesIO(reader.read() + more[9:])
        return reader

    monkeypatch.setattr(tarfile.TarFile, "extractfile", overlong)
    target = tmp_path / "dst" / "image"

    with pytest.raises(ArchiveError, match=r"member logs/dump\.log holds more than its 9 bytes"):
        import_image(archive, target)

    assert nothing_left(target)
