"""Working sets travel with an image through a real registry on loopback (sample images, no
CRIU): attached by a push as a referrer of the image's manifest, adopted by a pull, the image's
own digest unchanged, other tools' referrers kept, and a damaged set never failing a pull."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pytest
from click.testing import CliRunner
from requests.structures import CaseInsensitiveDict

from snapctl.cli import snapctl
from snapctl.criu.lazy.workingset import WorkingSet, pagemap_key, read_working_set
from snapctl.criu.lazy.workingset import working_set_path as set_path
from snapctl.images.store import ImageStaging, hash_tree
from snapctl.registry import layout, workingsets
from snapctl.registry.cache import BlobCache
from snapctl.registry.client import Reference, RegistryClient, RegistryError
from snapctl.registry.pull import pull_cached, pull_image
from snapctl.registry.push import push_image
from snapctl.statedir import StateDir
from tests.images.factories import make_manifest
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]

PAGES = list(range(100, 400, 3))


def client(server: RegistryServer, name: str) -> RegistryClient:
    return RegistryClient(Reference.parse(f"{server.address}/{name}"), plain_http=True)


def publish_with_pagemaps(final: Path) -> list[str]:
    """A sample image with two processes' pagemaps; their working-set keys."""
    staging = ImageStaging(final)
    for pid in (1, 7):
        (staging.dir / "criu" / f"pagemap-{pid}.img").write_bytes(os.urandom(96))
    (staging.dir / "criu" / "pages-1.img").write_bytes(os.urandom(8192))
    staging.publish(make_manifest(hash_tree(staging.dir), image_id=os.urandom(16).hex()))
    return [pagemap_key((final / "criu" / f"pagemap-{pid}.img").read_bytes()) for pid in (1, 7)]


def learn(views: Path, key: str, pages: list[int]) -> None:
    views.mkdir(parents=True, exist_ok=True)
    set_path(views, key).write_bytes(WorkingSet.of_pages(pages).model_dump_json().encode())


def pull(
    server: RegistryServer, name: str, out: Path, views: Path
) -> workingsets.WorkingSetsTransfer:
    cache = BlobCache(out.parent / f"{out.name}.cache")
    report = pull_image(client(server, name), out, cache=cache, verified_cache=None, views=views)
    return report.working_sets


def index_at_tag(server: RegistryServer, name: str, subject: str) -> dict[str, object]:
    found = client(server, name).find_manifest(
        workingsets.referrers_tag(subject), workingsets.INDEX_MEDIA_TYPE, 1 << 20
    )
    assert found is not None
    index: dict[str, object] = json.loads(found)
    return index


def test_a_pull_adopts_the_sets_the_push_attached(registry_server: RegistryServer,
                                                  tmp_path: Path) -> None:  # fmt: skip
    image = tmp_path / "image"
    engine, frontend = publish_with_pagemaps(image)
    views = tmp_path / "host-a" / "views"
    learn(views, engine, PAGES)
    learn(views, "f" * 64, [1, 2, 3])  # another image's process: not this image's to carry

    pushed = push_image(image, Reference.parse(f"{registry_server.address}/ws/a:v1"),
                        client(registry_server, "ws/a:v1"), views=views)  # fmt: skip
    assert pushed.working_sets == workingsets.WorkingSetsTransfer(processes=1, pages=len(PAGES))

    host_b = tmp_path / "host-b" / "views"
    adopted = pull(registry_server, "ws/a:v1", tmp_path / "pulled", host_b)
    assert adopted == workingsets.WorkingSetsTransfer(processes=1, pages=len(PAGES))
    assert read_working_set(host_b, engine) == frozenset(PAGES)
    assert read_working_set(host_b, frontend) is None
    assert read_working_set(host_b, "f" * 64) is None
    # The registry here has no referrers API: the artifact is listed under the tag schema.
    index = index_at_tag(registry_server, "ws/a", pushed.manifest_digest)
    listed = index["manifests"]
    assert [m["artifactType"] for m in listed] == [workingsets.ARTIFACT_TYPE]  # type: ignore[union-attr, index, attr-defined]
    # The same sets pushed again are the same artifact: nothing piles up.
    push_image(image, Reference.parse(f"{registry_server.address}/ws/a:v1"),
               client(registry_server, "ws/a:v1"), views=views)  # fmt: skip
    assert index_at_tag(registry_server, "ws/a", pushed.manifest_digest)["manifests"] == listed


def test_sets_pushed_again_replace_the_old_keep_the_digest_and_other_referrers(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    engine, frontend = publish_with_pagemaps(image)
    views = tmp_path / "views"
    learn(views, engine, PAGES)
    ref = Reference.parse(f"{registry_server.address}/ws/b:v1")
    first = push_image(image, ref, client(registry_server, "ws/b:v1"), views=views)
    # Another tool's referrer (a signature, say) under the same tag, with a field of its own.
    tag_index = index_at_tag(registry_server, "ws/b", first.manifest_digest)
    signature = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                 "digest": first.manifest_digest, "size": 1,
                 "artifactType": "application/vnd.dev.cosign.artifact.sig.v1+json",
                 "platform": {"os": "linux"}}  # fmt: skip
    tag_index["manifests"] = [signature, *tag_index["manifests"]]  # type: ignore[misc]
    client(registry_server, "ws/b").put_manifest(
        workingsets.referrers_tag(first.manifest_digest),
        workingsets.INDEX_MEDIA_TYPE,
        json.dumps(tag_index).encode(),
    )
    learn(views, frontend, [5, 6])

    second = push_image(image, ref, client(registry_server, "ws/b:v1"), views=views)

    assert second.manifest_digest == first.manifest_digest  # digest pins and signatures hold
    assert second.working_sets.processes == 2
    manifests = index_at_tag(registry_server, "ws/b", first.manifest_digest)["manifests"]
    assert manifests[0] == signature  # type: ignore[index]
    assert [m.get("artifactType") for m in manifests] == [  # type: ignore[attr-defined, union-attr]
        signature["artifactType"], workingsets.ARTIFACT_TYPE]  # fmt: skip
    host_b = tmp_path / "host-b"
    assert pull(registry_server, "ws/b:v1", tmp_path / "pulled", host_b).processes == 2
    assert read_working_set(host_b, frontend) == frozenset([5, 6])


def test_no_sets_and_damaged_sets_never_fail_a_transfer(registry_server: RegistryServer,
                                                        tmp_path: Path) -> None:  # fmt: skip
    image = tmp_path / "image"
    engine, _ = publish_with_pagemaps(image)
    ref = Reference.parse(f"{registry_server.address}/ws/c:v1")
    bare = push_image(image, ref, client(registry_server, "ws/c:v1"), views=tmp_path / "none")
    assert bare.working_sets == workingsets.WorkingSetsTransfer()
    assert pull(registry_server, "ws/c:v1", tmp_path / "one", tmp_path / "v1") == (
        workingsets.WorkingSetsTransfer())  # fmt: skip

    learn(tmp_path / "views", engine, PAGES)
    pushed = push_image(image, ref, client(registry_server, "ws/c:v1"), views=tmp_path / "views")
    blob = workingsets.WorkingSets(sets={engine: PAGES}).model_dump_json().encode()
    stored = registry_server.blob_data(workingsets._digest(blob))
    stored.write_bytes(stored.read_bytes().replace(b"100", b"999", 1))

    host_b = tmp_path / "host-b"
    damaged = pull(registry_server, "ws/c:v1", tmp_path / "two", host_b)
    assert damaged.processes == 0 and damaged.error is not None
    assert "does not match its digest" in damaged.error and "none were adopted" in damaged.error
    assert hash_tree(tmp_path / "two") == hash_tree(image)  # the image itself was pulled
    assert not set_path(host_b, engine).exists()
    assert pushed.working_sets.processes == 1


def test_adopt_takes_only_the_images_own_processes(tmp_path: Path) -> None:
    image = tmp_path / "image"
    engine, frontend = publish_with_pagemaps(image)
    views = tmp_path / "views"
    sets = workingsets.WorkingSets(sets={engine: [1, 2], "0" * 64: [3]})
    assert workingsets.adopt(image, views, sets) == workingsets.WorkingSetsTransfer(
        processes=1, pages=2
    )
    assert read_working_set(views, engine) == frozenset([1, 2])
    assert sorted(p.name for p in views.iterdir()) == [f"{engine}.touched-runs.json"]
    with pytest.raises(ValueError, match="not the sha256 of a pagemap"):
        workingsets.WorkingSets(sets={"../escape": [1]})
    with pytest.raises(ValueError, match="negative"):
        workingsets.WorkingSets(sets={frontend: [-1]})


def test_the_cli_says_what_became_of_the_sets(registry_server: RegistryServer, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    image = tmp_path / "image"
    engine, _ = publish_with_pagemaps(image)
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    ref = f"{registry_server.address}/ws/cli:v1"
    before = CliRunner().invoke(snapctl, ["image", "push", str(image), ref, "--plain-http"])
    assert before.exit_code == 0, before.output
    assert "working sets: none learned here yet" in before.stdout
    shown = CliRunner().invoke(snapctl, ["inspect", ref, "--plain-http", "--brief"])
    assert "none attached" in shown.stdout, shown.output
    learn(tmp_path / "state" / "views", engine, PAGES)
    pushed = CliRunner().invoke(snapctl, ["image", "push", str(image), ref, "--plain-http"])
    assert f"working sets: 1 process, {len(PAGES)} pages attached" in pushed.stdout
    shown = CliRunner().invoke(snapctl, ["inspect", ref, "--plain-http", "--json"])
    assert json.loads(shown.stdout)["working_sets"] == {"artifacts": 1, "pages": len(PAGES),
                                                        "error": None}  # fmt: skip

    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "host-b"))
    pulled = CliRunner().invoke(snapctl, ["image", "pull", ref, "--to", str(tmp_path / "out"),
                                          "--plain-http", "--json"])  # fmt: skip
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.stdout)["working_sets"] == {"processes": 1, "pages": len(PAGES),
                                                         "error": None}  # fmt: skip
    assert read_working_set(tmp_path / "host-b" / "views", engine) == frozenset(PAGES)


class FakeRegistry:
    """The calls the working sets make, against a registry with or without the referrers API
    (``no_api``: the status its referrers endpoint answers then), or one refusing tags."""

    def __init__(self, *, referrers_api: bool, no_api: int = 404, refuse_tags: bool = False):
        self.referrers_api, self.no_api, self.refuse_tags = referrers_api, no_api, refuse_tags
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}

    def has_blob(self, digest: str) -> bool:
        return digest in self.blobs

    def upload_blob(self, digest: str, data: bytes) -> None:
        self.blobs[digest] = data

    def put_manifest(self, target: str, media_type: str, body: bytes) -> Mapping[str, str]:
        if self.refuse_tags and not target.startswith("sha256:"):
            raise RegistryError(f"PUT {target}: DENIED")
        self.manifests[target] = body
        subject = json.loads(body).get("subject")
        headers = {"oci-subject": subject["digest"]} if subject and self.referrers_api else {}
        return CaseInsensitiveDict(headers)

    def find_manifest(self, target: str, accept: str, max_bytes: int) -> bytes | None:
        return self.manifests.get(target)

    def find_referrers(self, digest: str, artifact_type: str, max_bytes: int,
                       no_api: tuple[int, ...] = (404,)) -> bytes | None:  # fmt: skip
        if not self.referrers_api:
            if self.no_api in no_api:
                return None
            raise RegistryError(f"referrers: HTTP {self.no_api}")
        entries = [{"mediaType": layout.OCI_MANIFEST, "digest": workingsets._digest(body),
                    "size": len(body), "artifactType": json.loads(body)["artifactType"],
                    "annotations": json.loads(body).get("annotations", {})}
                   for body in self.manifests.values()
                   if json.loads(body).get("subject", {}).get("digest") == digest]  # fmt: skip
        return json.dumps({"schemaVersion": 2, "mediaType": workingsets.INDEX_MEDIA_TYPE,
                           "manifests": entries}).encode()  # fmt: skip

    def read_blob(self, digest: str, size: int, max_bytes: int, what: str,
                  outcome: str = "") -> bytes:  # fmt: skip
        return self.blobs[digest]


SUBJECT = layout.Descriptor(mediaType=layout.OCI_MANIFEST, digest="sha256:" + "ab" * 32, size=9)


@pytest.mark.parametrize(("referrers_api", "no_api"), [(True, 404), (False, 404), (False, 405)])
def test_the_referrers_api_or_else_the_tag(tmp_path: Path, referrers_api: bool,
                                           no_api: int) -> None:  # fmt: skip
    image = tmp_path / "image"
    engine, _ = publish_with_pagemaps(image)
    registry = FakeRegistry(referrers_api=referrers_api, no_api=no_api)
    fake = cast(RegistryClient, registry)

    pushed = workingsets.push_working_sets(fake, {engine: PAGES}, SUBJECT)
    assert pushed == workingsets.WorkingSetsTransfer(processes=1, pages=len(PAGES))
    tag = workingsets.referrers_tag(SUBJECT.digest)
    assert (tag in registry.manifests) is not referrers_api  # the API keeps it: no tag
    adopted = workingsets.pull_working_sets(fake, image, tmp_path / "views", SUBJECT.digest)
    assert adopted == workingsets.WorkingSetsTransfer(processes=1, pages=len(PAGES))


def test_a_registry_refusing_the_tag_or_the_api_fails_only_the_sets(tmp_path: Path) -> None:
    image = tmp_path / "image"
    engine, _ = publish_with_pagemaps(image)
    refusing = cast(RegistryClient, FakeRegistry(referrers_api=False, refuse_tags=True))
    pushed = workingsets.push_working_sets(refusing, {engine: PAGES}, SUBJECT)
    assert pushed.processes == 0 and pushed.error is not None and "DENIED" in pushed.error

    broken = cast(RegistryClient, FakeRegistry(referrers_api=False, no_api=500))
    pulled = workingsets.pull_working_sets(broken, image, tmp_path / "views", SUBJECT.digest)
    assert pulled.error == "referrers: HTTP 500" and not (tmp_path / "views").exists()


def test_an_image_pulled_already_adopts_sets_only_while_none_are_known(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    engine, _ = publish_with_pagemaps(image)
    ref = Reference.parse(f"{registry_server.address}/ws/again:v1")
    learn(tmp_path / "views", engine, PAGES)
    push_image(image, ref, client(registry_server, "ws/again:v1"), views=tmp_path / "views")
    host = StateDir(tmp_path / "host")
    host.ensure()

    first = pull_cached(client(registry_server, "ws/again:v1"), host)
    assert not first.already_pulled and first.working_sets.processes == 1
    set_path(host.views, engine).unlink()  # say, pulled before the sets were pushed
    second = pull_cached(client(registry_server, "ws/again:v1"), host)
    assert second.already_pulled and second.working_sets.processes == 1
    assert read_working_set(host.views, engine) == frozenset(PAGES)
    third = pull_cached(client(registry_server, "ws/again:v1"), host)
    assert third.already_pulled and third.working_sets == workingsets.WorkingSetsTransfer()
