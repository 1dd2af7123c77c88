"""``image sign``: sign an image in a registry as ``cosign sign --key`` does.

The image's manifest digest is resolved in the registry (a tag is resolved, a digest is
checked), the simple-signing payload names that digest and the reference signed for, the key
signs it, and the signature is attached under the ``.sig`` tag (:mod:`.store`). The signed
reference is the one named, with its tag (``REGISTRY/REPO:TAG``; by digest alone,
``REGISTRY/REPO@DIGEST``), as Podman and skopeo sign: the policy's default identity rule then
accepts the image pulled by that tag or by its digest. cosign itself signs the repository
alone, which the policy accepts only with ``matchRepository``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec

from snapctl.trust import keys, store
from snapctl.trust import payload as simple_signing


@dataclass(frozen=True)
class Signed:
    """What ``image sign`` did (``--json``)."""

    reference: str
    manifest_digest: str
    signed_identity: str
    key: str  # the public key's fingerprint
    signature_tag: str
    signature_reference: str  # REGISTRY/REPO:sha256-HEX.sig
    signature_manifest_digest: str
    signatures: int
    added: bool

    def record(self) -> dict[str, object]:
        return dict(self.__dict__)


def signed_identity(reference: store.ReferenceLike, manifest_digest: str) -> str:
    """The reference a signature is made for: with its tag, else with the digest."""
    name = store.name_of(reference)
    return f"{name}:{reference.tag}" if reference.tag else f"{name}@{manifest_digest}"


def sign_image(client: store.RegistryAccess, key: ec.EllipticCurvePrivateKey) -> Signed:
    """Sign the image ``client.reference`` names and attach the signature to it."""
    reference = client.reference
    digest = store.resolve(client)
    identity = signed_identity(reference, digest)
    payload = simple_signing.build(identity, digest)
    public = key.public_key()
    attached = store.attach(
        client, digest, payload, keys.sign(key, payload),
        signed_already=lambda held: keys.verify(public, held.payload, held.signature),
    )  # fmt: skip
    return Signed(
        reference=f"{store.name_of(reference)}:{reference.target}"
        if reference.digest is None else f"{store.name_of(reference)}@{reference.digest}",
        manifest_digest=digest, signed_identity=identity, key=keys.fingerprint(public),
        signature_tag=attached.tag,
        signature_reference=f"{store.name_of(reference)}:{attached.tag}",
        signature_manifest_digest=attached.manifest_digest,
        signatures=attached.signatures, added=attached.added,
    )  # fmt: skip
