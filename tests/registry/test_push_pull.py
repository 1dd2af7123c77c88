"""Push and pull against a real registry on loopback, with sample images (no CRIU): the OCI
layout, verification while streaming, atomic publication, chunk reuse, resumed pulls."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import stat
from pathlib import Path

import pytest

from snapctl.images import verify_image
from snapctl.images.ownership import check_image_owner
from snapctl.images.store import ImageStaging, hash_tree, load_manifest
from snapctl.registry import layout
from snapctl.registry.cache import BlobCache
from snapctl.registry.client import BlobMismatchError, Reference, RegistryClient
from snapctl.registry.pull import Remote, describe, pull_image
from snapctl.registry.push import PushReport, push_image
from tests.images.factories import flip_byte, make_manifest, publish_sample
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]


def client(server: RegistryServer, name: str) -> RegistryClient:
    return RegistryClient(Reference.parse(f"{server.address}/{name}"), plain_http=True)


def publish_paged(final: Path, pages: bytes, *, force: bool = False) -> None:
    """A sample image whose page file is ``pages`` (large: chunked)."""
    staging = ImageStaging(final, force=force)
    (staging.dir / "criu" / "pages-1.img").write_bytes(pages)
    (staging.dir / "criu" / "core-1.img").write_bytes(b"core" * 100 + os.urandom(8))
    (staging.dir / "shm" / "sem.x").write_bytes(b"semaphore")
    os.link(staging.dir / "shm" / "sem.x", staging.dir / "shm" / "link_remap.7")
    staging.publish(make_manifest(hash_tree(staging.dir), image_id=os.urandom(16).hex()))


def push(server: RegistryServer, image: Path, name: str) -> PushReport:
    return push_image(image, Reference.parse(f"{server.address}/{name}"), client(server, name))


def pushed_paged(
    server: RegistryServer, tmp_path: Path, name: str, page_bytes: int
) -> tuple[Path, BlobCache, Remote]:
    """A paged sample image pushed as ``name``, a fresh cache and the image as the registry
    describes it (through that cache)."""
    image = tmp_path / "image"
    publish_paged(image, os.urandom(page_bytes))
    push(server, image, name)
    cache = BlobCache(tmp_path / "cache")
    return image, cache, describe(client(server, name), cache)


def test_push_then_pull_round_trips_an_image(registry_server: RegistryServer,
                                             tmp_path: Path) -> None:  # fmt: skip
    image = tmp_path / "image"
    publish_paged(image, os.urandom(6 << 20))
    manifest = load_manifest(image)
    pushed = push(registry_server, image, "t/round:v1")
    assert pushed.blobs_uploaded == pushed.blobs and pushed.bytes_uploaded > 6 << 20

    cache = BlobCache(tmp_path / "cache")
    remote = describe(client(registry_server, "t/round:v1"), cache)
    assert remote.oci.artifactType == layout.ARTIFACT_TYPE
    assert remote.oci.annotations["org.criu.checkpoint.engine.name"] == "snapctl"
    assert remote.oci.annotations["org.criu.checkpoint.criu.version"] == manifest.criu_version
    assert remote.manifest_digest == pushed.manifest_digest
    pages = next(f for f in remote.config.files if f.name == "criu/pages-1.img")
    assert pages.chunks is not None and len(pages.chunks) > 1  # content-defined chunks
    assert [f.link_to for f in remote.config.files if f.link_to] == ["shm/link_remap.7"]

    out = tmp_path / "pulled"
    report = pull_image(client(registry_server, "t/round:v1"), out, cache=cache,
                        verified_cache=tmp_path / "verified")  # fmt: skip
    assert report.image_id == manifest.image_id and report.bytes_fetched >= 6 << 20
    assert verify_image(out) == load_manifest(out)
    assert hash_tree(out) == hash_tree(image)  # same bytes, same hard links
    by_digest = Reference.parse(f"{registry_server.address}/t/round@{pushed.manifest_digest}")
    again = pull_image(RegistryClient(by_digest, plain_http=True), tmp_path / "again",
                       cache=cache, verified_cache=None)  # fmt: skip
    assert again.bytes_fetched == 0 and again.blobs_cached == again.blobs - 2  # all cached


def test_a_rebake_pushes_only_the_changed_chunks(registry_server: RegistryServer,
                                                 tmp_path: Path) -> None:  # fmt: skip
    # Seeded: where content-defined chunks cut depends on the bytes, and random ones made
    # the changed chunks' share vary from run to run.
    noise = random.Random(20261206)
    pages = bytearray(noise.randbytes(16 << 20))
    publish_paged(tmp_path / "one", bytes(pages))
    first = push(registry_server, tmp_path / "one", "t/rebake:1")
    pages[5 << 20 : (5 << 20) + 4096] = noise.randbytes(4096)  # a page changed
    pages[9 << 20 : 9 << 20] = noise.randbytes(8192)  # two pages more, shifting the rest
    publish_paged(tmp_path / "two", bytes(pages))
    second = push(registry_server, tmp_path / "two", "t/rebake:2")
    assert second.bytes_uploaded < 0.3 * first.bytes_uploaded, (second, first)


def test_a_corrupt_blob_in_the_registry_publishes_nothing(registry_server: RegistryServer,
                                                          tmp_path: Path) -> None:  # fmt: skip
    _, cache, remote = pushed_paged(registry_server, tmp_path, "t/corrupt:v1", 3 << 20)
    victim = next(iter(remote.config.chunk_digests()))
    flip_byte(registry_server.blob_data(victim), mask=0x01)
    before = sorted(p.name for p in cache.root.rglob("*"))

    with pytest.raises(BlobMismatchError, match=f"blob {victim} .* does not match its digest"):
        pull_image(client(registry_server, "t/corrupt:v1"), tmp_path / "out", cache=cache,
                   verified_cache=None)  # fmt: skip

    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert not cache.has(victim) and not cache.partial(victim).exists()
    after = {p.name for p in cache.root.rglob("*")}
    assert {n for n in after if n.endswith(".partial")} == set()
    assert set(before) <= after  # verified blobs stay; nothing unverified was kept


def test_a_corrupt_manifest_json_is_refused(registry_server: RegistryServer,
                                            tmp_path: Path) -> None:  # fmt: skip
    image = tmp_path / "image"
    publish_sample(image)
    push(registry_server, image, "t/badmeta:v1")
    remote = describe(client(registry_server, "t/badmeta:v1"), BlobCache(tmp_path / "c1"))
    data = registry_server.blob_data(remote.oci.layers[0].digest)
    text = json.loads(data.read_bytes())
    text["files"]["criu/core-1.img"]["sha256"] = "0" * 64
    data.write_bytes(json.dumps(text).encode())

    with pytest.raises(BlobMismatchError, match=r"manifest\.json .* does not match its digest"):
        pull_image(client(registry_server, "t/badmeta:v1"), tmp_path / "out",
                   cache=BlobCache(tmp_path / "c2"), verified_cache=None)  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_partial_download_resumes_where_it_stopped(registry_server: RegistryServer,
                                                     tmp_path: Path) -> None:  # fmt: skip
    image, cache, remote = pushed_paged(registry_server, tmp_path, "t/resume:v1", 8 << 20)
    chunks = list(remote.config.chunk_digests().items())
    cache.ensure()
    complete, (half, size) = chunks[0], chunks[1]
    cache.path(complete[0]).write_bytes(registry_server.blob_data(complete[0]).read_bytes())
    cache.partial(half).write_bytes(registry_server.blob_data(half).read_bytes()[: size // 2])
    needed = sum(s for _, s in chunks) + remote.config.small_files_size

    report = pull_image(client(registry_server, "t/resume:v1"), tmp_path / "out", cache=cache,
                        verified_cache=None)  # fmt: skip

    assert report.bytes_resumed == size // 2
    assert report.bytes_fetched == needed - complete[1] - size // 2
    assert report.blobs_cached == 1 and hash_tree(tmp_path / "out") == hash_tree(image)


def test_a_cached_blob_damaged_on_disk_is_dropped_and_fetched_again(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    publish_paged(image, os.urandom(3 << 20))
    push(registry_server, image, "t/disk:v1")
    cache = BlobCache(tmp_path / "cache")
    pull_image(client(registry_server, "t/disk:v1"), tmp_path / "one", cache=cache,
               verified_cache=None)  # fmt: skip
    victim = next(iter(describe(client(registry_server, "t/disk:v1"), cache).config
                       .chunk_digests()))  # fmt: skip
    flip_byte(cache.path(victim), 7, 0x80)

    with pytest.raises(BlobMismatchError, match="does not match its sha256"):
        pull_image(client(registry_server, "t/disk:v1"), tmp_path / "two", cache=cache,
                   verified_cache=None)  # fmt: skip
    assert not (tmp_path / "two").exists() and not cache.has(victim)

    again = pull_image(client(registry_server, "t/disk:v1"), tmp_path / "two", cache=cache,
                       verified_cache=None)  # fmt: skip
    assert again.blobs_fetched == 1 and hash_tree(tmp_path / "two") == hash_tree(image)


def test_a_pull_keeps_no_foreign_owner_and_no_special_mode_bits(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    # A layer that says another host's uid/gid, setuid/setgid/sticky and writable by all: the
    # pulled entries belong to the puller (whose restore alone reads them); what shm/ holds
    # keeps its rwx bits (a directory its sticky bit too: a saved /dev/shm is safe only with
    # it), anything else loses its group's and others' write bits, so that what pull
    # publishes is an image copy accepts.
    image = tmp_path / "image"
    publish_sample(image)
    push(registry_server, image, "t/owner:v1")
    cache = BlobCache(tmp_path / "cache")
    genuine = describe(client(registry_server, "t/owner:v1"), cache)
    files = [f.model_copy(update={"mode": 0o6777, "uid": 4242, "gid": 4243})
             for f in genuine.config.files]  # fmt: skip
    directories = [d.model_copy(update={"mode": 0o3777}) for d in genuine.config.directories]
    crafted = dataclasses.replace(
        genuine, config=genuine.config.model_copy(update={"files": files,
                                                          "directories": directories}),
    )  # fmt: skip

    out = tmp_path / "out"
    pull_image(client(registry_server, "t/owner:v1"), out, cache=cache, verified_cache=None,
               remote=crafted)  # fmt: skip

    assert directories and files
    for entry in [*files, *directories]:
        st = (out / entry.name).lstat()
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid()), entry.name
        in_shm = entry.name == "shm" or entry.name.startswith("shm/")
        expected = (0o1777 if entry in directories else 0o777) if in_shm else 0o755
        assert stat.S_IMODE(st.st_mode) == expected, (entry.name, oct(st.st_mode))
    assert {"criu", "shm"} <= {entry.name for entry in directories}
    check_image_owner(out)
