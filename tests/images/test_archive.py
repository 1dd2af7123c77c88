"""Image archives: round trip, verification while streaming, atomic publication, and refusal
of hostile members (built here as real .tar.zst files) without writing outside the target."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
import zstandard

from snapctl.errors import ExitStatus
from snapctl.images import load_manifest, verify_image
from snapctl.images.archive import (
    SEAL_BYTES,
    ArchiveError,
    _seal,
    export_image,
    import_image,
)
from snapctl.images.lock import ImageBusyError, hold_image
from snapctl.images.ownership import check_image_owner
from snapctl.images.store import ImageError, ImageExistsError, is_verified
from tests.images.factories import flip_byte, publish_sample


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, Path]:
    image = tmp_path / "src" / "image"
    publish_sample(image)
    archive = tmp_path / "image.tar.zst"
    export_image(image, archive)
    return image, archive


def members(archive: Path) -> list[tarfile.TarInfo]:
    with archive.open("rb") as raw:
        stream = zstandard.ZstdDecompressor().stream_reader(raw)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            return list(tar)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def refused(archive: Path, target: Path, match: str) -> ArchiveError:
    """The error importing ``archive`` into ``target`` fails with; nothing was published."""
    with pytest.raises(ArchiveError, match=match) as info:
        import_image(archive, target)
    assert not target.exists()
    return info.value


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A published sample image to build archives from."""
    publish_sample(tmp_path / "src")
    return tmp_path / "src"


def test_round_trip_keeps_files_modes_and_hard_links(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    image, archive = exported
    target, cache = tmp_path / "dst" / "image", tmp_path / "verified"

    report = import_image(archive, target, cache_dir=cache)

    manifest = verify_image(target)
    assert manifest == load_manifest(image)
    assert report.image_id == manifest.image_id and report.files == len(manifest.files)
    assert report.archive_bytes == archive.stat().st_size and report.mb_per_s > 0
    a, b = (target / "shm" / "sem.x").stat(), (target / "shm" / "link_remap.7").stat()
    assert a.st_ino == b.st_ino and a.st_mode & 0o777 == 0o640
    assert stat.S_IMODE((target / "shm" / "sub").stat().st_mode) == 0o1777  # sticky kept
    assert is_verified(target, manifest, cache)  # every hash was checked while unpacking
    assert leftovers(target.parent) == []


def test_manifest_is_the_first_member_and_links_are_hard_links(
    exported: tuple[Path, Path],
) -> None:
    listed = members(exported[1])

    assert listed[0].name == "manifest.json"
    links = [m for m in listed if m.islnk()]
    assert [(m.name, m.linkname) for m in links] == [("shm/sem.x", "shm/link_remap.7")]


def test_export_refuses_an_image_that_no_longer_matches(tmp_path: Path) -> None:
    image = tmp_path / "image"
    publish_sample(image)
    path = image / "criu" / "pages-1.img"
    flip_byte(path, 1234, 0x01)
    out = tmp_path / "out.tar.zst"

    with pytest.raises(ArchiveError, match=r"criu/pages-1\.img does not match its sha256"):
        export_image(image, out)
    assert not out.exists() and leftovers(tmp_path) == []


def test_export_refuses_an_existing_archive_and_an_unexpected_file(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    image, archive = exported
    with pytest.raises(ImageExistsError, match="already exists") as info:  # a conflict, like
        export_image(image, archive)  # any other "exists" (not a failed verification)
    assert info.value.exit_status == ExitStatus.CONFLICT
    (image / "criu" / "stray").write_bytes(b"x")
    with pytest.raises(ArchiveError, match="unexpected file in image: criu/stray"):
        export_image(image, tmp_path / "other.tar.zst")


def test_flipped_byte_in_the_archive_fails_and_publishes_nothing(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    _, archive = exported
    flip_byte(archive, mask=0x10)
    target = tmp_path / "dst" / "image"

    error = refused(archive, target, r"image\.tar\.zst: .*(member|corrupt)")
    # Either zstd's checksum or a member's sha256 catches it, naming where it happened.
    assert "criu/" in str(error) or "shm/" in str(error) or "logs/" in str(error)
    assert leftovers(target.parent) == []


def test_every_flipped_byte_of_the_archive_is_caught(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    # Header and tail bytes included: some flips there decompress to the very same content,
    # which only the seal notices.
    _, archive = exported
    original = archive.read_bytes()
    size = len(original)
    positions = [*range(64), *range(size - 200, size), *range(64, size - 200, size // 50)]
    target = tmp_path / "dst" / "image"
    for position in positions:
        data = bytearray(original)
        data[position] ^= 0x10
        archive.write_bytes(bytes(data))
        refused(archive, target, r"image\.tar\.zst: ")
    assert leftovers(target.parent) == []


def test_unsealed_archive_is_refused(tmp_path: Path, exported: tuple[Path, Path]) -> None:
    _, archive = exported
    archive.write_bytes(archive.read_bytes()[:-SEAL_BYTES])  # what `tar | zstd` would give

    refused(archive, tmp_path / "image", "seal")


def test_truncated_archive_fails(tmp_path: Path, exported: tuple[Path, Path]) -> None:
    _, archive = exported
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    target = tmp_path / "dst" / "image"

    refused(archive, target, "corrupt near member")


def test_existing_target_is_refused_or_replaced_only_when_free(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    _, archive = exported
    target = tmp_path / "dst"
    publish_sample(target, image_id="e" * 32)
    with pytest.raises(ImageError, match="already exists"):
        import_image(archive, target)
    with hold_image(target), pytest.raises(ImageBusyError):
        import_image(archive, target, force=True)
    assert load_manifest(target).image_id == "e" * 32

    import_image(archive, target, force=True)

    assert load_manifest(target).image_id == "0" * 32
    assert leftovers(tmp_path) == []


# --- hostile archives ---------------------------------------------------------------------------


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, size, link, 0o600
    return info


def build(
    path: Path, source: Path, extra: list[tuple[tarfile.TarInfo, bytes]], *, sealed: bool = False
) -> None:
    """An archive with the genuine manifest of ``source``, then ``extra`` members; ``sealed``
    as export seals it, so only the members can be what is refused."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        manifest = (source / "manifest.json").read_bytes()
        tar.addfile(_info("manifest.json", size=len(manifest)), io.BytesIO(manifest))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data else None)
    body = zstandard.ZstdCompressor().compress(buffer.getvalue())
    path.write_bytes(body + (_seal(hashlib.sha256(body).digest()) if sealed else b""))


def genuine_members(
    source: Path, *, instead: dict[str, tarfile.TarInfo]
) -> list[tuple[tarfile.TarInfo, bytes]]:
    """Every file of the image at ``source`` as export writes it, except the names in
    ``instead``, which arrive as the given members."""
    manifest = load_manifest(source)
    out: list[tuple[tarfile.TarInfo, bytes]] = []
    first_of_group: dict[int, str] = {}
    for name, entry in sorted(manifest.files.items()):
        if name in instead:
            out.append((instead[name], b""))
        elif entry.link_group in first_of_group:
            out.append((_info(name, tarfile.LNKTYPE, link=first_of_group[entry.link_group]), b""))
        else:
            if entry.link_group is not None:
                first_of_group[entry.link_group] = name
            data = (source / name).read_bytes()
            out.append((_info(name, size=len(data)), data))
    return out


HOSTILE = {
    "absolute path": ([(_info("/tmp/snapctl-evil", size=4), b"evil")], "not a plain relative"),
    "dot-dot": ([(_info("criu/../../evil", size=4), b"evil")], "not a plain relative"),
    "leading dot-dot": ([(_info("../evil", size=4), b"evil")], "not a plain relative"),
    "symlink outside": ([(_info("criu/link", tarfile.SYMTYPE, link="/etc"), b"")],
                        "symbolic link"),
    "hardlink outside": ([(_info("criu/core-1.img", tarfile.LNKTYPE, link="/etc/passwd"), b"")],
                         "not an earlier file"),
    "hardlink dot-dot": ([(_info("criu/core-1.img", tarfile.LNKTYPE, link="../../x"), b"")],
                         "not an earlier file"),
    "device node": ([(_info("criu/null", tarfile.CHRTYPE), b"")], "device node"),
    "fifo": ([(_info("criu/pipe", tarfile.FIFOTYPE), b"")], "fifo"),
    "duplicate member": ([(_info("logs/dump.log", size=9), b"dump log\n"),
                          (_info("logs/dump.log", size=9), b"dump log\n")], "appears twice"),
    "second manifest": ([(_info("manifest.json", size=2), b"{}")], "appears twice"),
    "unlisted file": ([(_info("criu/extra", size=1), b"x")], "not in the manifest"),
    "wrong size": ([(_info("logs/dump.log", size=4), b"dump")], "has 4 bytes"),
    "wrong content": ([(_info("logs/dump.log", size=9), b"DUMP LOG\n")], "sha256"),
    "file below a file": ([(_info("logs/dump.log", size=9), b"dump log\n"),
                           (_info("logs/dump.log/x", tarfile.DIRTYPE), b"")],
                          "logs/dump.log/x is a directory that holds no image file"),
    "unlisted directory": ([(_info("criu/sub", tarfile.DIRTYPE), b"")],
                           "criu/sub is a directory that holds no image file"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_refused_without_writing_outside(
    tmp_path: Path, source: Path, case: str
) -> None:
    extra, message = HOSTILE[case]
    archive = tmp_path / "hostile.tar.zst"
    build(archive, source, extra)
    jail = tmp_path / "jail"
    jail.mkdir()
    target = jail / "sub" / "image"
    before = sorted(str(p) for p in tmp_path.rglob("*"))

    refused(archive, target, message)

    assert [p.name for p in (jail / "sub").iterdir()] == []  # staging removed
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    assert set(after) == {*before, str(jail / "sub")}
    assert not Path("/tmp/snapctl-evil").exists()
    assert (Path("/etc/passwd").stat().st_nlink, os.path.islink("/etc")) == (1, False)


def raw_archive(path: Path, *entries: tuple[str, bytes]) -> Path:
    """An unsealed archive of the given (name, content) regular files, in order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in entries:
            tar.addfile(_info(name, size=len(data)), io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
    return path


def test_invalid_manifest_is_refused(tmp_path: Path) -> None:
    archive = raw_archive(tmp_path / "a.tar.zst", ("manifest.json", b"{}"))

    refused(archive, tmp_path / "image", r"a\.tar\.zst: manifest is not valid")


def test_archive_without_the_manifest_first_is_refused(tmp_path: Path) -> None:
    archive = raw_archive(tmp_path / "a.tar.zst", ("criu/x", b"x"))

    refused(archive, tmp_path / "image", r"first member is 'criu/x', not manifest\.json")


def test_missing_member_is_refused(tmp_path: Path, source: Path) -> None:
    archive = tmp_path / "partial.tar.zst"
    build(archive, source, [])  # the manifest only

    refused(archive, tmp_path / "image", "missing from the archive")


def test_a_listed_file_arriving_as_a_directory_is_refused(tmp_path: Path, source: Path) -> None:
    # Sealed, and every other file genuine: only the directory can be what is refused.
    archive = tmp_path / "dir.tar.zst"
    members_ = genuine_members(
        source, instead={"logs/dump.log": _info("logs/dump.log", tarfile.DIRTYPE)}
    )
    build(archive, source, members_, sealed=True)
    target = tmp_path / "image"

    refused(archive, target, r"logs/dump\.log is a directory; the manifest lists")
    assert leftovers(tmp_path) == []


def test_a_genuine_sealed_rebuild_imports(tmp_path: Path, source: Path) -> None:
    # The helpers above build what export writes: without a substitution it is accepted.
    archive = tmp_path / "same.tar.zst"
    build(archive, source, genuine_members(source, instead={}), sealed=True)

    import_image(archive, tmp_path / "image")

    assert verify_image(tmp_path / "image") == load_manifest(source)


def test_export_of_a_missing_image_or_into_a_missing_directory_is_an_error(
    tmp_path: Path, exported: tuple[Path, Path]
) -> None:
    image, _ = exported
    with pytest.raises(ImageError, match="is not a published image"):
        export_image(tmp_path / "nothing", tmp_path / "x.tar.zst")
    out = tmp_path / "no" / "such" / "dir" / "x.tar.zst"
    with pytest.raises(ArchiveError, match=r"cannot export to .*x\.tar\.zst"):
        export_image(image, out)
    assert not out.parent.exists()


def test_an_import_keeps_no_foreign_owner_and_no_special_mode_bits(
    tmp_path: Path, source: Path
) -> None:
    # Members that say another host's uid/gid, setuid/setgid/sticky and writable by all: the
    # imported entries belong to the importer; what shm/ holds keeps its rwx bits (and a
    # directory its sticky bit), anything else loses its group's and others' write bits, so
    # that what import publishes is an image copy accepts.
    crafted: list[tuple[tarfile.TarInfo, bytes]] = [
        *((_info(name, tarfile.DIRTYPE), b"") for name in ("criu", "logs", "shm", "shm/sub")),
        *genuine_members(source, instead={}),
    ]
    for info, _ in crafted:
        info.mode, info.uid, info.gid = 0o3777 if info.isdir() else 0o6777, 4242, 4243
    archive = tmp_path / "crafted.tar.zst"
    build(archive, source, crafted, sealed=True)

    import_image(archive, tmp_path / "image")

    for info, _ in sorted(crafted, key=lambda member: member[0].isdir()):  # files first
        st = (tmp_path / "image" / info.name).lstat()
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid()), info.name
        in_shm = info.name.startswith("shm")
        expected = (0o1777 if info.isdir() else 0o777) if in_shm else 0o755
        assert stat.S_IMODE(st.st_mode) == expected, (info.name, oct(st.st_mode))
    check_image_owner(tmp_path / "image")
