"""Image store: hashing with hard-link groups, verification, atomic publication, shm staging."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from snapctl.errors import ExitStatus, NoSpaceError
from snapctl.images import ImageError, ImageStaging, Manifest, hash_tree, stage_shm_copy
from snapctl.images.lock import ImageBusyError, hold_image
from snapctl.images.store import is_verified, load_manifest, verify_image
from tests.images.factories import flip_byte, make_manifest, publish_sample


def test_hash_tree_groups_hard_links(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1")
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").write_bytes(b"1")
    files = hash_tree(tmp_path)
    assert files["a"].link_group is not None
    assert files["a"].link_group == files["b"].link_group
    assert files["c"].link_group is None
    assert files["a"].sha256 == files["c"].sha256


def test_publish_is_atomic_and_verifies(tmp_path: Path) -> None:
    final = tmp_path / "img"
    manifest = publish_sample(final)
    assert load_manifest(final) == manifest
    assert verify_image(final).image_id == manifest.image_id
    assert [p.name for p in tmp_path.iterdir()] == ["img"]  # no staging left
    assert (final / "manifest.json").stat().st_mode & 0o777 == 0o600


def test_publish_puts_every_file_on_disk_before_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = tmp_path / "img"
    publish_sample(final)
    manifest_tmp = next(path for path in synced if path.name == "manifest.json.tmp")
    staging = manifest_tmp.parent
    before = {str(path.relative_to(staging)) for path in synced[: synced.index(manifest_tmp)]}
    files = {str(p.relative_to(final)) for p in final.rglob("*") if p.name != "manifest.json"}
    assert files | {"."} <= before  # every file and directory, the staging directory too
    assert synced[-1] == tmp_path  # then the rename into place


def test_existing_image_is_refused_without_force(tmp_path: Path) -> None:
    final = tmp_path / "img"
    publish_sample(final)
    with pytest.raises(ImageError, match="already exists"):
        ImageStaging(final)
    replaced = publish_sample_force(final)
    assert load_manifest(final).image_id == replaced.image_id


def publish_sample_force(final: Path) -> Manifest:
    staging = ImageStaging(final, force=True)
    (staging.dir / "criu" / "x").write_bytes(b"new")
    manifest = make_manifest(hash_tree(staging.dir), image_id="f" * 32)
    staging.publish(manifest)
    return manifest


@pytest.mark.parametrize(
    ("victim", "named"),
    [("criu/pages-1.img", r"pages-1\.img"), ("shm/sem.x", r"sem\.x|link_remap\.7")],  # one inode
)
def test_flipped_byte_names_the_file(tmp_path: Path, victim: str, named: str) -> None:
    final = tmp_path / "img"
    publish_sample(final)
    path = final / victim
    flip_byte(path)
    with pytest.raises(ImageError, match=named):
        verify_image(final)


def test_missing_and_extra_files_are_refused(tmp_path: Path) -> None:
    final = tmp_path / "img"
    publish_sample(final)
    (final / "criu" / "extra").write_bytes(b"x")
    with pytest.raises(ImageError, match="unexpected file"):
        verify_image(final)
    (final / "criu" / "extra").unlink()
    (final / "criu" / "pages-1.img").unlink()
    with pytest.raises(ImageError, match="missing"):
        verify_image(final)


def test_verification_cache_still_catches_changes(tmp_path: Path) -> None:
    final, cache = tmp_path / "img", tmp_path / "cache"
    publish_sample(final)
    verify_image(final, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1
    verify_image(final, cache_dir=cache)  # cache hit
    path = final / "criu" / "pages-1.img"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))  # same size; mtime/ctime change
    with pytest.raises(ImageError, match=r"pages-1\.img"):
        verify_image(final, cache_dir=cache)


def test_stage_shm_copy_keeps_hard_links(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "sem.x").write_bytes(b"v")
    os.chmod(source / "sem.x", 0o600)
    os.link(source / "sem.x", source / "link_remap.3")
    (source / "other").write_bytes(b"o")
    stage_shm_copy(source, target)
    a, b = (target / "sem.x").stat(), (target / "link_remap.3").stat()
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    assert a.st_ino != (source / "sem.x").stat().st_ino  # a copy, not the saved file
    assert a.st_mode & 0o777 == 0o600
    assert (target / "other").read_bytes() == b"o"


def test_stage_shm_copy_keeps_holes_and_data(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    size = 64 << 20
    with open(source / "psm_x", "wb") as segment:  # a mostly unwritten shared-memory segment
        segment.truncate(size)
        segment.seek(1 << 20)
        segment.write(b"head")
        segment.seek(size - 4)
        segment.write(b"tail")
    os.chmod(source / "psm_x", 0o640)
    (source / "empty").write_bytes(b"")
    stage_shm_copy(source, target)
    copied = target / "psm_x"
    assert copied.read_bytes() == (source / "psm_x").read_bytes()
    assert copied.stat().st_size == size
    assert copied.stat().st_blocks * 512 < 1 << 20  # holes, not 64 MiB of zeros
    assert copied.stat().st_mode & 0o777 == 0o640
    assert (target / "empty").read_bytes() == b""


def test_replacing_an_image_a_copy_holds_is_refused(tmp_path: Path) -> None:
    final = tmp_path / "img"
    original = publish_sample(final)
    with hold_image(final), pytest.raises(ImageBusyError, match="in use"):
        ImageStaging(final, force=True)
    assert load_manifest(final) == original
    assert [p.name for p in tmp_path.iterdir()] == ["img"]  # no staging left


def test_schema_1_manifest_still_loads_and_names_are_checked(tmp_path: Path) -> None:
    manifest = make_manifest({}, schema_version=1, identity=None)
    assert manifest.identity is None
    with pytest.raises(ValueError, match="identity"):
        make_manifest({}, schema_version=2, identity=None)
    entry = {"size": 1, "sha256": "0" * 64}
    for hostile in ("../x", "/etc/passwd", "criu/../../x", "./criu/x", "manifest.json"):
        with pytest.raises(ValueError, match="not a plain path"):
            make_manifest({hostile: entry})


def test_verification_cache_does_not_vouch_for_an_edited_manifest(tmp_path: Path) -> None:
    final, cache = tmp_path / "img", tmp_path / "cache"
    publish_sample(final)
    verify_image(final, cache_dir=cache)
    manifest_path = final / "manifest.json"
    data = json.loads(manifest_path.read_text())
    data["files"]["logs/dump.log"]["sha256"] = "f" * 64  # same id, the file itself untouched
    manifest_path.write_text(json.dumps(data))

    with pytest.raises(ImageError, match=r"logs/dump\.log does not match"):
        verify_image(final, cache_dir=cache)


def test_an_unwritable_cache_only_costs_a_full_verification(tmp_path: Path) -> None:
    final, cache = tmp_path / "img", tmp_path / "cache"
    publish_sample(final)
    cache.write_text("not a directory")

    assert verify_image(final, cache_dir=cache).image_id == "0" * 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "img"]


def test_hard_links_the_manifest_does_not_record_are_refused(tmp_path: Path) -> None:
    final = tmp_path / "img"
    staging = ImageStaging(final)
    (staging.dir / "criu" / "a").write_bytes(b"same")
    (staging.dir / "criu" / "b").write_bytes(b"same")
    staging.publish(make_manifest(hash_tree(staging.dir)))
    (final / "criu" / "b").unlink()
    os.link(final / "criu" / "a", final / "criu" / "b")  # same bytes, now one inode

    with pytest.raises(ImageError, match=r"criu/a does not share its inode"):
        verify_image(final)


def test_publish_never_replaces_an_image_that_appeared_meanwhile(tmp_path: Path) -> None:
    final = tmp_path / "img"
    staging = ImageStaging(final)
    (staging.dir / "criu" / "x").write_bytes(b"mine")
    theirs = publish_sample(final)  # another publisher won the race

    with pytest.raises(ImageError, match="appeared while this image was staged"):
        staging.publish(make_manifest(hash_tree(staging.dir), image_id="f" * 32))
    staging.abort()

    assert verify_image(final) == theirs
    assert [p.name for p in tmp_path.iterdir()] == ["img"]


def test_invalid_manifest_is_named_in_one_line_without_its_value(tmp_path: Path) -> None:
    final = tmp_path / "img"
    publish_sample(final)
    manifest_path = final / "manifest.json"
    data = json.loads(manifest_path.read_text())
    data["server_argv"] = "srv --api-key sk-live-secret"  # a string, not a list
    manifest_path.write_text(json.dumps(data))

    with pytest.raises(ImageError, match="not a valid manifest: server_argv") as info:
        load_manifest(final)
    assert "\n" not in str(info.value) and "sk-live-secret" not in str(info.value)


def test_staging_shm_into_a_missing_directory_is_an_image_error(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "sem.x").write_bytes(b"v")

    with pytest.raises(ImageError, match=r"cannot stage the saved /dev/shm: .*sem\.x") as info:
        stage_shm_copy(source, tmp_path / "missing")
    assert info.value.phase == "image"


def _plant_file(image: Path) -> str:
    (image / "criu" / "ipcns-msg-11.img").write_bytes(b"\0" * 16)
    return r"unexpected file in image: criu/ipcns-msg-11\.img is not in the manifest"


def _plant_symlink(image: Path) -> str:
    # A name CRIU reads if it is there, pointing at a file the manifest vouches for.
    (image / "criu" / "ipcns-msg-11.img").symlink_to("core-1.img")
    return r"image entry criu/ipcns-msg-11\.img is a symlink"


def _plant_symlinked_directory(image: Path) -> str:
    # The genuine directory moved aside and linked back: every listed file still matches.
    os.rename(image / "criu", image.parent / "elsewhere")
    (image / "criu").symlink_to(image.parent / "elsewhere")
    return r"image entry criu is a symlink"


def _plant_listed_file_as_symlink(image: Path) -> str:
    os.rename(image / "logs" / "dump.log", image.parent / "dump.log")
    (image / "logs" / "dump.log").symlink_to(image.parent / "dump.log")
    return r"image entry logs/dump\.log is a symlink"


def _plant_fifo(image: Path) -> str:
    os.mkfifo(image / "criu" / "pipe")
    return r"image entry criu/pipe is a fifo"


def _plant_directory(image: Path) -> str:
    (image / "criu" / "sub").mkdir()
    return r"unexpected directory in image: criu/sub holds no file of the manifest"


PLANTED = {
    "unlisted file": _plant_file,
    "symlink": _plant_symlink,
    "symlinked directory": _plant_symlinked_directory,
    "listed file as a symlink": _plant_listed_file_as_symlink,
    "fifo": _plant_fifo,
    "unlisted directory": _plant_directory,
}


@pytest.mark.parametrize("plant", PLANTED.values(), ids=PLANTED.keys())
def test_anything_planted_in_a_verified_image_is_refused_cache_or_not(
    tmp_path: Path, plant: Callable[[Path], str]
) -> None:
    final, cache = tmp_path / "img", tmp_path / "cache"
    manifest = publish_sample(final)
    verify_image(final, cache_dir=cache)
    assert is_verified(final, manifest, cache)
    message = plant(final)
    for cache_dir in (cache, None):
        with pytest.raises(ImageError, match=message) as info:
            verify_image(final, cache_dir=cache_dir)
        assert "re-import the image from its archive or bake it again" in info.value.message
    assert not is_verified(final, manifest, cache)  # `snapctl images` does not vouch for it


def test_staging_a_saved_shm_refuses_a_symlink(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "sem.x").symlink_to("/etc/hostname")
    with pytest.raises(ImageError, match=r"sem\.x is a symlink"):
        stage_shm_copy(source, target)
    assert list(target.iterdir()) == []


def test_a_full_disk_at_publication_says_enospc_where_and_how_much_is_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "img"
    staging = ImageStaging(final)
    (staging.dir / "criu" / "x").write_bytes(b"pages")

    def full(root: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("snapctl.images.store.sync_tree", full)
    with pytest.raises(NoSpaceError) as info:
        staging.publish(make_manifest(hash_tree(staging.dir)))
    staging.abort()
    assert "ENOSPC" in info.value.message and str(staging.dir) in info.value.message
    assert "MiB free" in info.value.message and info.value.exit_status == ExitStatus.UNAVAILABLE
    assert list(tmp_path.iterdir()) == []
