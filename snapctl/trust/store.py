"""Signatures in the registry, where cosign keeps them: an OCI manifest at the tag
``sha256-<hex of the signed manifest's digest>.sig`` of the image's own repository.

Each of its layers is one signature: the simple-signing payload as the blob (media type
``application/vnd.dev.cosign.simplesigning.v1+json``) and the base64 signature as the layer's
annotation ``dev.cosignproject.cosign/signature``. The config is an empty OCI image config
whose ``rootfs.diff_ids`` list the layers, as cosign's. Signing again appends a layer to the
manifest already there (other tools' layers are written back as they were read); a signature
by the same key over the same payload is not added twice, as cosign does not.

The registry is reached through :class:`RegistryAccess`, the few requests this needs, which
:class:`snapctl.registry.client.RegistryClient` provides.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from snapctl.trust import payload as simple_signing
from snapctl.trust.errors import SignatureStoreError

SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
# What a signed image's manifest may be: an image or an index, OCI or Docker.
MANIFEST_TYPES = (OCI_MANIFEST, "application/vnd.oci.image.index.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.docker.distribution.manifest.list.v2+json")  # fmt: skip
MAX_MANIFEST = 4 << 20
ZERO_TIME = "0001-01-01T00:00:00Z"


class ReferenceLike(Protocol):
    """An image reference: ``REGISTRY/REPOSITORY[:TAG][@DIGEST]``."""

    @property
    def registry(self) -> str: ...
    @property
    def repository(self) -> str: ...
    @property
    def tag(self) -> str | None: ...
    @property
    def digest(self) -> str | None: ...
    @property
    def target(self) -> str: ...


class RegistryAccess(Protocol):
    """The requests to one repository that signing and verifying make."""

    @property
    def reference(self) -> ReferenceLike: ...
    def find_manifest(self, target: str, accept: str, max_bytes: int) -> bytes | None: ...
    def read_blob(self, digest: str, size: int, max_bytes: int, what: str,
                  outcome: str = ...) -> bytes: ...  # fmt: skip
    def has_blob(self, digest: str) -> bool: ...
    def upload_blob(self, digest: str, data: bytes) -> None: ...
    def put_manifest(self, target: str, media_type: str, body: bytes) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class Signature:
    """One signature as stored: the payload it signs and the base64 signature (unverified)."""

    payload: bytes
    signature: str
    layer_digest: str


@dataclass(frozen=True)
class Attached:
    """What :func:`attach` did: the tag, its manifest's digest, the signatures it holds, and
    whether this signature was added (False: the key had signed that payload already)."""

    tag: str
    manifest_digest: str
    signatures: int
    added: bool


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def is_sha256_digest(text: object) -> bool:
    return isinstance(text, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", text) is not None


def signature_tag(manifest_digest: str) -> str:
    """``sha256:HEX`` → ``sha256-HEX.sig``."""
    algorithm, _, hex_part = manifest_digest.partition(":")
    return f"{algorithm}-{hex_part}.sig"


def name_of(reference: ReferenceLike) -> str:
    return f"{reference.registry}/{reference.repository}"


def resolve(client: RegistryAccess) -> str:
    """The digest of the manifest the client's reference names (its tag resolved); a
    reference with a digest must name a manifest with that digest."""
    reference = client.reference
    raw = client.find_manifest(reference.target, ", ".join(MANIFEST_TYPES), MAX_MANIFEST)
    if raw is None:
        raise SignatureStoreError(f"{name_of(reference)}:{reference.target} is not in the "
                                  "registry")  # fmt: skip
    digest = digest_of(raw)
    if reference.digest is not None and reference.digest != digest:
        raise SignatureStoreError(f"{name_of(reference)}@{reference.digest}: the registry "
                                  f"answered a manifest with the digest {digest}")  # fmt: skip
    return digest


def read_signatures(client: RegistryAccess, manifest_digest: str) -> list[Signature]:
    """The signatures stored for ``manifest_digest`` (none without a ``.sig`` tag); each
    payload is checked against its digest, nothing is verified."""
    found = _signature_manifest(client, manifest_digest)
    return [] if found is None else _signatures_in(client, found[0])


def _signatures_in(client: RegistryAccess, manifest: dict[str, Any]) -> list[Signature]:
    signatures = []
    for layer in manifest["layers"]:
        signature = (layer.get("annotations") or {}).get(SIGNATURE_ANNOTATION)
        if layer.get("mediaType") != simple_signing.MEDIA_TYPE or not isinstance(signature, str):
            continue  # another tool's attachment
        data = client.read_blob(layer["digest"], layer["size"], simple_signing.MAX_PAYLOAD,
                                "a signature payload",
                                outcome="the signature cannot be used")  # fmt: skip
        signatures.append(Signature(payload=data, signature=signature,
                                    layer_digest=layer["digest"]))  # fmt: skip
    return signatures


def attach(client: RegistryAccess, manifest_digest: str, payload: bytes, signature: str,
           signed_already: Callable[[Signature], bool]) -> Attached:  # fmt: skip
    """Add one signature to the ``.sig`` manifest of ``manifest_digest`` (creating it), unless
    ``signed_already`` says one it holds is by the same signer over the same payload."""
    tag = signature_tag(manifest_digest)
    existing = _signature_manifest(client, manifest_digest)
    layers: list[dict[str, Any]] = []
    if existing is not None:
        manifest, raw = existing
        layers = list(manifest["layers"])
        for held in _signatures_in(client, manifest):
            if held.payload == payload and signed_already(held):
                return Attached(tag=tag, manifest_digest=digest_of(raw),
                                signatures=len(layers), added=False)  # fmt: skip
    payload_digest = digest_of(payload)
    if not client.has_blob(payload_digest):
        client.upload_blob(payload_digest, payload)
    layers.append({"mediaType": simple_signing.MEDIA_TYPE, "size": len(payload),
                   "digest": payload_digest,
                   "annotations": {SIGNATURE_ANNOTATION: signature}})  # fmt: skip
    config = _config([layer["digest"] for layer in layers])
    config_digest = digest_of(config)
    if not client.has_blob(config_digest):
        client.upload_blob(config_digest, config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "size": len(config), "digest": config_digest},
        "layers": layers,
    }
    body = json.dumps(manifest, separators=(",", ":")).encode()
    client.put_manifest(tag, OCI_MANIFEST, body)
    return Attached(tag=tag, manifest_digest=digest_of(body), signatures=len(layers),
                    added=True)  # fmt: skip


def _config(diff_ids: list[str]) -> bytes:
    """An empty OCI image config over these layers, as go-containerregistry writes one for
    cosign (every layer is stored uncompressed, so its digest is its diff id)."""
    config = {
        "architecture": "",
        "created": ZERO_TIME,
        "history": [{"created": ZERO_TIME} for _ in diff_ids],
        "os": "",
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "config": {},
    }
    return json.dumps(config, separators=(",", ":")).encode()


def _signature_manifest(
    client: RegistryAccess, manifest_digest: str
) -> tuple[dict[str, Any], bytes] | None:
    """The ``.sig`` manifest of ``manifest_digest`` (parsed, and as read), checked to be an
    image manifest whose layers are descriptors; None if there is none."""
    tag = signature_tag(manifest_digest)
    raw = client.find_manifest(tag, f"{OCI_MANIFEST}, {MANIFEST_TYPES[2]}", MAX_MANIFEST)
    if raw is None:
        return None
    where = f"{name_of(client.reference)}:{tag}"
    try:
        manifest = json.loads(raw)
    except ValueError as error:
        raise SignatureStoreError(f"{where} is not a JSON manifest ({error})") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise SignatureStoreError(f"{where} is not an image manifest with layers")
    for layer in manifest["layers"]:
        if not (isinstance(layer, dict) and is_sha256_digest(layer.get("digest"))
                and type(layer.get("size")) is int and layer["size"] >= 0
                and isinstance(layer.get("annotations") or {}, dict)):  # fmt: skip
            raise SignatureStoreError(f"{where} has a layer that is not a descriptor: "
                                      f"{json.dumps(layer)[:200]}")  # fmt: skip
    return manifest, raw
