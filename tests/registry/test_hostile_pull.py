"""A pull meets images built by hand in a real registry on loopback: what it writes is bounded
by what the disk holds, it publishes only the tree an image may have (what ``image import``
accepts, what a copy's verification accepts), and the local image cache reuses an image only
for exactly its manifest digest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from snapctl.errors import ExitStatus, NoSpaceError
from snapctl.images import verify_image
from snapctl.images.store import hash_tree, is_verified, load_manifest, record_verified
from snapctl.registry import layout
from snapctl.registry.cache import (
    BlobCache,
    pulled_image,
    read_record,
    record_path,
    write_record,
)
from snapctl.registry.chunks import MAX_CHUNK
from snapctl.registry.client import BlobMismatchError, Reference, RegistryClient
from snapctl.registry.pull import PullReport, describe, free_bytes, pull_cached, pull_image
from snapctl.registry.source import list_pulled
from snapctl.statedir import StateDir
from tests.images.factories import flip_byte
from tests.registry.crafted import Parts, build, digest, put_image
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]

CORE = b"core" * 100


def client(server: RegistryServer, name: str) -> RegistryClient:
    return RegistryClient(Reference.parse(f"{server.address}/{name}"), plain_http=True)


def pull(server: RegistryServer, name: str, tmp_path: Path, **options: object) -> PullReport:
    return pull_image(client(server, name), tmp_path / "out", cache=BlobCache(tmp_path / "cache"),
                      verified_cache=tmp_path / "verified", **options)  # type: ignore[arg-type]  # fmt: skip


def assert_nothing_published(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert not (tmp_path / "verified").exists() or not any((tmp_path / "verified").iterdir())


def cached_blobs(tmp_path: Path) -> set[str]:
    root = tmp_path / "cache" / "sha256"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


# --- what a pull writes is bounded --------------------------------------------------------


def repeated(chunk: bytes, times: int) -> Parts:
    """An image whose page file is one chunk ``times`` over (as a run of zero pages is)."""
    return build({"criu/core-1.img": CORE}, {"criu/pages-1.img": [chunk] * times})


def test_a_repeated_chunk_is_fetched_once_and_refused_when_its_writes_do_not_fit(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    chunk = os.urandom(1 << 20)
    put_image(registry_server, "hostile/repeat:v1", repeated(chunk, 64))
    asked: list[Path] = []

    def free(path: Path) -> int:
        asked.append(path)
        return 32 << 20  # more than the blobs, less than the files they make

    with pytest.raises(
        NoSpaceError, match=r"hostile/repeat:v1: it needs 6\d MiB at .*, 32 MiB free"
    ) as error:
        pull(registry_server, "hostile/repeat:v1", tmp_path, free_space=free)

    assert error.value.exit_status == ExitStatus.UNAVAILABLE and asked
    assert_nothing_published(tmp_path)
    assert digest(chunk).removeprefix("sha256:") not in cached_blobs(tmp_path)  # not fetched
    assert not any(name.endswith(".partial") for name in cached_blobs(tmp_path))

    # A repeated chunk is a legitimate image: with the space, it is pulled, the chunk once.
    report = pull(registry_server, "hostile/repeat:v1", tmp_path, free_space=lambda _: 1 << 40)
    pages = tmp_path / "out" / "criu" / "pages-1.img"
    assert pages.stat().st_size == 64 << 20 and pages.read_bytes()[-len(chunk) :] == chunk
    assert report.bytes_fetched == len(chunk) + len(CORE)
    assert verify_image(tmp_path / "out").image_id == report.image_id


def test_a_config_declaring_more_than_the_disk_holds_fetches_nothing(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    # Chunk references are cheap (a few dozen bytes of config each, the same blob): a config
    # far under its bound declares a terabyte, or more than this disk holds. Refused with the
    # real free space, before anything is fetched.
    chunk = os.urandom(MAX_CHUNK)
    references = max(1 << 18, free_bytes(tmp_path) // MAX_CHUNK + 1)
    if references > 400_000:  # a config of that many would pass its own bound
        pytest.skip("this disk has more space than such a config can declare")
    parts = repeated(chunk, 1)
    pages = next(f for f in parts.config["files"] if f["name"] == "criu/pages-1.img")
    pages["chunks"] = pages["chunks"] * references
    pages["size"] = parts.manifest["files"]["criu/pages-1.img"]["size"] = references * MAX_CHUNK
    put_image(registry_server, "hostile/huge:v1", parts)
    # Should the pull ever go ahead, it stops at this chunk's digest instead of filling the
    # disk this test runs on.
    flip_byte(registry_server.blob_data(digest(chunk)))

    with pytest.raises(NoSpaceError, match="nothing was fetched or published"):
        pull(registry_server, "hostile/huge:v1", tmp_path)

    assert_nothing_published(tmp_path)
    assert digest(chunk).removeprefix("sha256:") not in cached_blobs(tmp_path)
    assert pull_image.__kwdefaults__["free_space"] is free_bytes
    assert free_bytes(tmp_path) == shutil.disk_usage(tmp_path).free


def test_the_space_asked_for_is_that_of_the_files_and_the_missing_blobs(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    chunk = os.urandom(1 << 20)
    put_image(registry_server, "hostile/exact:v1", repeated(chunk, 4))
    remote = describe(client(registry_server, "hostile/exact:v1"), BlobCache(tmp_path / "c"))
    files = (4 << 20) + len(CORE) + len(remote.manifest_bytes)
    need = files + len(chunk) + len(CORE)  # the cache is on the same filesystem

    with pytest.raises(NoSpaceError):
        pull(registry_server, "hostile/exact:v1", tmp_path, free_space=lambda _: need - 1)
    pull(registry_server, "hostile/exact:v1", tmp_path, free_space=lambda _: need)
    assert (tmp_path / "out" / "criu" / "pages-1.img").stat().st_size == 4 << 20


BIG = os.urandom(MAX_CHUNK + 1)


def longer_than_its_chunks(parts: Parts) -> None:
    parts.config["files"][2]["size"] += 1
    parts.manifest["files"]["criu/pages-1.img"]["size"] += 1


def a_chunk_no_push_cuts(parts: Parts) -> None:
    parts.config["files"][2]["chunks"][0] = {"digest": digest(BIG), "size": len(BIG)}
    parts.config["files"][2]["size"] += len(BIG) - (1 << 20)
    parts.blobs.append(BIG)


def small_files_overlapping(parts: Parts) -> None:
    parts.config["files"][1]["offset"] = 0  # core-1.img on a.img's bytes


def small_files_leaving_bytes_out(parts: Parts) -> None:
    parts.blobs[0] += b"unread"
    parts.config["small_files_digest"] = digest(parts.blobs[0])
    parts.config["small_files_size"] = len(parts.blobs[0])


@pytest.mark.parametrize(
    ("craft", "problem"),
    [
        (longer_than_its_chunks, "chunks do not add up to its size"),
        (a_chunk_no_push_cuts, "less than or equal to 4194304"),
        (small_files_overlapping, "the small files do not follow one another"),
        (small_files_leaving_bytes_out, "the small files do not fill the small-files blob"),
    ],
)
def test_a_config_whose_pieces_do_not_tile_its_files_is_refused(
    registry_server: RegistryServer, tmp_path: Path, craft: Callable[[Parts], None], problem: str
) -> None:
    # Every file is its pieces, in order, each byte once: a file's chunks add up to its size
    # (they may repeat), the small files fill their blob one after the other.
    parts = build({"criu/a.img": b"a" * 100, "criu/core-1.img": CORE},
                  {"criu/pages-1.img": [os.urandom(1 << 20)] * 3})  # fmt: skip
    assert [f["name"] for f in parts.config["files"]] == [
        "criu/a.img", "criu/core-1.img", "criu/pages-1.img"]  # fmt: skip
    craft(parts)
    put_image(registry_server, "hostile/tile:v1", parts)

    with pytest.raises(BlobMismatchError, match=f"the config of .* is not valid: .*{problem}"):
        pull(registry_server, "hostile/tile:v1", tmp_path)
    assert_nothing_published(tmp_path)
    assert cached_blobs(tmp_path) == set()  # not even the config is kept


# --- only the tree an image may have is published, and recorded verified -----------------


def shm_image() -> Parts:
    """Files, a nested /dev/shm directory and a hard-linked pair, as a capture has them."""
    return build(
        {"criu/core-1.img": CORE, "shm/sem.x": b"semaphore", "shm/sub/f": b"nested",
         "logs/dump.log": b"dump log\n"},
        links={"shm/link_remap.7": "shm/sem.x"},
        directories=("criu", "logs", "shm", "shm/sub", "shm/empty"),
    )  # fmt: skip


def test_a_genuine_tree_is_published_and_recorded_verified(registry_server: RegistryServer,
                                                           tmp_path: Path) -> None:  # fmt: skip
    put_image(registry_server, "hostile/genuine:v1", shm_image())

    pull(registry_server, "hostile/genuine:v1", tmp_path)

    manifest = load_manifest(tmp_path / "out")
    assert is_verified(tmp_path / "out", manifest, tmp_path / "verified")
    assert verify_image(tmp_path / "out") == manifest
    assert (tmp_path / "out" / "shm" / "empty").is_dir()  # a saved /dev/shm's empty directory


@pytest.mark.parametrize(
    ("directory", "problem"),
    [
        ("bin", "a directory bin that holds no file"),
        ("criu/extra", "a directory criu/extra that holds no file"),
        ("logs/old/older", "a directory logs/old/older that holds no file"),
        ("criu/core-1.img", "a directory criu/core-1.img that holds no file"),  # a listed file
    ],
)
def test_a_directory_the_image_may_not_have_is_refused(
    registry_server: RegistryServer, tmp_path: Path, directory: str, problem: str
) -> None:
    parts = shm_image()
    parts.config["directories"].append({"name": directory, "mode": 0o755})
    put_image(registry_server, "hostile/dirs:v1", parts)

    with pytest.raises(BlobMismatchError, match=problem):
        pull(registry_server, "hostile/dirs:v1", tmp_path)
    assert_nothing_published(tmp_path)


def test_a_file_listed_as_another_files_directory_is_refused(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    parts = build({"criu/core-1.img": CORE, "criu/core-1.img/x": b"x"})
    put_image(registry_server, "hostile/filedir:v1", parts)

    with pytest.raises(BlobMismatchError, match=r"criu/core-1\.img both as a file and as a dir"):
        pull(registry_server, "hostile/filedir:v1", tmp_path)
    assert_nothing_published(tmp_path)


def test_hard_links_must_arrive_as_the_manifest_records_them(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    # A link whose recorded sha256 is not its target's: it would hash as its target.
    parts = shm_image()
    other = hashlib.sha256(b"not a semaphore").hexdigest()
    parts.manifest["files"]["shm/link_remap.7"]["sha256"] = other
    next(f for f in parts.config["files"] if f["name"] == "shm/link_remap.7")["sha256"] = other
    put_image(registry_server, "hostile/links:v1", parts)
    with pytest.raises(BlobMismatchError, match=r"shm/link_remap\.7 is a hard link the manifest"):
        pull(registry_server, "hostile/links:v1", tmp_path)
    assert_nothing_published(tmp_path)

    # A hard-linked pair stored as two files: two inodes where the manifest records one.
    parts = build({"criu/core-1.img": CORE, "shm/link_remap.7": b"semaphore",
                   "shm/sem.x": b"semaphore"})  # fmt: skip
    for name in ("shm/link_remap.7", "shm/sem.x"):
        parts.manifest["files"][name]["link_group"] = 0
    put_image(registry_server, "hostile/links:v2", parts)
    with pytest.raises(BlobMismatchError, match=r"hard-link group 0 of manifest\.json is not one"):
        pull(registry_server, "hostile/links:v2", tmp_path)
    assert_nothing_published(tmp_path)

    # A group of one name: no inode is shared, so the image could never verify.
    parts = build({"criu/core-1.img": CORE, "shm/sem.x": b"semaphore"})
    parts.manifest["files"]["shm/sem.x"]["link_group"] = 3
    put_image(registry_server, "hostile/links:v3", parts)
    with pytest.raises(BlobMismatchError, match=r"hard-link group 3 of manifest\.json is not one"):
        pull(registry_server, "hostile/links:v3", tmp_path)
    assert_nothing_published(tmp_path)


# --- the local image cache: one entry per whole manifest digest ----------------------------


def test_pulled_images_are_named_by_the_whole_manifest_digest(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    hex_digest = "0123456789abcdef" * 4

    assert pulled_image(state, f"sha256:{hex_digest}").name == f"sha256-{hex_digest}"
    for bad in ("sha256:0123", f"sha512:{hex_digest}", f"sha256:{hex_digest}/..", ""):
        with pytest.raises(ValueError, match="not a sha256 manifest digest"):
            pulled_image(state, bad)


def plant(image: Path, where: Path, state: StateDir, recorded_digest: str) -> None:
    """A copy of the pulled ``image`` at ``where``, verified and recorded as pulled by
    ``recorded_digest``: what a pull of a colliding name, or an older snapctl, left there."""
    shutil.copytree(image, where)
    record_verified(where, load_manifest(where), state.verified)
    write_record(where, manifest_digest=recorded_digest, image_id=load_manifest(where).image_id,
                 reference="elsewhere/planted:v1", pulled="2026-12-01T00:00:00+00:00")  # fmt: skip


def test_a_digest_pinned_pull_gets_exactly_that_image(registry_server: RegistryServer,
                                                      tmp_path: Path) -> None:  # fmt: skip
    # Two images with the same (free-text) image id and other files.
    one = build({"criu/core-1.img": CORE, "criu/pages-1.img": b"one" * 1000})
    two = build({"criu/core-1.img": CORE, "criu/pages-1.img": b"two" * 1000})
    first, second = (put_image(registry_server, f"hostile/cache:{tag}", parts)
                     for tag, parts in (("one", one), ("two", two)))  # fmt: skip
    state = StateDir(tmp_path / "state")
    state.ensure()

    def by_digest(manifest_digest: str) -> RegistryClient:
        return client(registry_server, f"hostile/cache@{manifest_digest}")

    pulled_one = Path(pull_cached(by_digest(first), state).image)
    assert pulled_one == pulled_image(state, first)
    # The first image under the names a shorter digest, or a forged record, would give the
    # second: under the second's 64-bit prefix (as an older snapctl named entries), and under
    # its whole digest with a record that names another digest, or that names the second's
    # digest beside the first image's manifest.
    hex_two = second.removeprefix("sha256:")
    legacy = pulled_image(state, first).with_name(f"sha256-{hex_two[:16]}")
    plant(pulled_one, legacy, state, second)

    report = pull_cached(by_digest(second), state)
    assert not report.already_pulled and Path(report.image) == pulled_image(state, second)
    assert (Path(report.image) / "criu/pages-1.img").read_bytes() == b"two" * 1000
    assert read_record(Path(report.image)).manifest_digest == second  # type: ignore[union-attr]

    for recorded in (first, second):
        shutil.rmtree(pulled_image(state, second))
        record_path(pulled_image(state, second)).unlink()
        plant(pulled_one, pulled_image(state, second), state, recorded)
        report = pull_cached(by_digest(second), state)
        assert not report.already_pulled, recorded
        assert (Path(report.image) / "criu/pages-1.img").read_bytes() == b"two" * 1000

    again = pull_cached(by_digest(second), state)  # now exactly that image: used as it is
    assert again.already_pulled and again.blobs_fetched == 0
    assert hash_tree(Path(again.image)) == hash_tree(Path(report.image))

    # The older entry is still listed (and can be removed), never taken for a digest.
    rows = {Path(row.path).name: row for row in list_pulled(state)}
    assert set(rows) == {f"sha256-{first[7:]}", f"sha256-{hex_two}", legacy.name}
    assert rows[legacy.name].reference == "elsewhere/planted:v1"


def test_a_cached_image_is_used_again_without_a_transfer(registry_server: RegistryServer,
                                                         tmp_path: Path) -> None:  # fmt: skip
    manifest_digest = put_image(registry_server, "hostile/again:v1", shm_image())
    state = StateDir(tmp_path / "state")
    state.ensure()

    first = pull_cached(client(registry_server, "hostile/again:v1"), state)
    second = pull_cached(client(registry_server, f"hostile/again@{manifest_digest}"), state)

    assert not first.already_pulled and second.already_pulled and second.image == first.image
    record = json.loads(record_path(Path(first.image)).read_text())
    assert record["manifest_digest"] == manifest_digest
    name = f"{registry_server.address}/hostile/again"
    assert record["references"] == [f"{name}:v1", f"{name}@{manifest_digest}"]


def test_the_layout_bounds_chunks_at_the_cutters_largest() -> None:
    sha = "0" * 64
    with pytest.raises(ValueError, match="less than or equal"):
        layout.Chunk(digest=digest(b"x"), size=MAX_CHUNK + 1)
    largest = layout.Chunk(digest=digest(b"x"), size=MAX_CHUNK)
    stored = layout.StoredFile(name="criu/pages-1.img", size=3 * MAX_CHUNK, sha256=sha,
                               mode=0o644, uid=0, gid=0, chunks=[largest] * 3)  # fmt: skip
    config = layout.ImageConfig(image_id="i", manifest_digest=digest(b"m"),
                                small_files_digest=digest(b""), small_files_size=0,
                                directories=[], files=[stored])  # fmt: skip
    assert config.written_bytes() == 3 * MAX_CHUNK and len(config.chunk_digests()) == 1
