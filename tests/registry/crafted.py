"""Images built by hand for pull's tests: a manifest.json, a config and blobs put in a real
registry as they are given, so a pull meets what a hostile or broken pusher could write (the
push's own checks never run on them)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from snapctl.images.manifest import MANIFEST_NAME
from snapctl.registry import layout
from snapctl.registry.client import Reference, RegistryClient
from tests.images.factories import make_manifest
from tests.registry.server import RegistryServer


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Parts:
    """An image's parts as JSON-ready dicts (edit them freely) and the blobs the config
    names (the small-files blob and every distinct chunk)."""

    manifest: dict[str, Any]
    config: dict[str, Any]
    blobs: list[bytes] = field(default_factory=list)


def build(
    small: dict[str, bytes],
    chunked: dict[str, list[bytes]] | None = None,
    links: dict[str, str] | None = None,
    directories: tuple[str, ...] = ("criu", "logs", "shm"),
    image_id: str = "c" * 32,
) -> Parts:
    """The parts a push would write for these files: ``small`` in the small-files blob,
    ``chunked`` as their list of chunks (a chunk may repeat), ``links`` (name -> the file it
    is a hard link of)."""
    chunked, links = chunked or {}, links or {}
    contents = {**small, **{name: b"".join(pieces) for name, pieces in chunked.items()}}
    groups = {target: index for index, target in enumerate(sorted(set(links.values())))}
    files: dict[str, Any] = {}
    for name in sorted([*contents, *links]):
        data = contents[links.get(name, name)]
        group = groups.get(links.get(name, name))
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                       "link_group": group}  # fmt: skip
    blob = bytearray()
    stored: list[dict[str, Any]] = []
    blobs: dict[str, bytes] = {}
    for name in sorted(files):
        entry: dict[str, Any] = {"name": name, "size": files[name]["size"],
                                 "sha256": files[name]["sha256"], "mode": 0o644, "uid": 0,
                                 "gid": 0}  # fmt: skip
        if name in links:
            entry["link_to"] = links[name]
        elif name in small:
            entry["offset"] = len(blob)
            blob += small[name]
        else:
            entry["chunks"] = [{"digest": digest(c), "size": len(c)} for c in chunked[name]]
            blobs.update({digest(c): c for c in chunked[name]})
        stored.append(entry)
    manifest = make_manifest(files, image_id=image_id).model_dump(mode="json")
    config = {
        "version": 1,
        "image_id": image_id,
        "manifest_digest": "",  # set by put_image, from the manifest as it is then
        "small_files_digest": digest(bytes(blob)),
        "small_files_size": len(blob),
        "directories": [{"name": name, "mode": 0o755} for name in directories],
        "files": stored,
    }
    return Parts(manifest, config, [bytes(blob), *blobs.values()])


def put_image(server: RegistryServer, name: str, parts: Parts) -> str:
    """Put ``parts`` at ``name`` (REPOSITORY:TAG) as a snapctl image; its manifest digest.
    The layers are what the config names, each chunk once, with the size the config says."""
    client = RegistryClient(Reference.parse(f"{server.address}/{name}"), plain_http=True)
    try:
        manifest_bytes = json.dumps(parts.manifest).encode()
        config = {**parts.config, "manifest_digest": digest(manifest_bytes)}
        config_bytes = json.dumps(config).encode()
        for data in (manifest_bytes, config_bytes, *parts.blobs):
            if not client.has_blob(digest(data)):
                client.upload_blob(digest(data), data)
        chunks: dict[str, int] = {}
        for stored in config["files"]:
            for chunk in stored.get("chunks") or []:
                chunks.setdefault(chunk["digest"], chunk["size"])
        layers = [
            {"mediaType": layout.IMAGE_MANIFEST_MEDIA_TYPE, "digest": digest(manifest_bytes),
             "size": len(manifest_bytes), "annotations": {layout.TITLE: MANIFEST_NAME}},
            {"mediaType": layout.SMALL_FILES_MEDIA_TYPE, "digest": config["small_files_digest"],
             "size": config["small_files_size"]},
            *({"mediaType": layout.CHUNK_MEDIA_TYPE, "digest": d, "size": s}
              for d, s in chunks.items()),
        ]  # fmt: skip
        oci = {
            "schemaVersion": 2,
            "mediaType": layout.OCI_MANIFEST,
            "artifactType": layout.ARTIFACT_TYPE,
            "config": {"mediaType": layout.CONFIG_MEDIA_TYPE, "digest": digest(config_bytes),
                       "size": len(config_bytes)},
            "layers": layers,
        }  # fmt: skip
        oci_bytes = json.dumps(oci).encode()
        tag = Reference.parse(f"{server.address}/{name}").tag
        assert tag is not None
        client.put_manifest(tag, layout.OCI_MANIFEST, oci_bytes)
        return digest(oci_bytes)
    finally:
        client.close()
