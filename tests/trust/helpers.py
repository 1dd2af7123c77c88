"""Test data of the trust tests (tests/trust/data, with its sources) and a signature fetcher
that serves it."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from snapctl.trust.store import Signature

DATA = Path(__file__).parent / "data"
IMAGES = DATA / "containers-image"
# The manifest every containers/image signature here signs.
SIGNED_DIGEST = "sha256:634a8f35b5f16dcf4aaa0822adc0b1964bb786fca12f6831de8ddc45e5986a00"
COSIGN_REPOSITORY = "192.168.64.2:5000/cosign-signed-single-sample"
SIGSTORE_PREFIX = b"\x00sigstore-json\n"


def stored_signature(path: Path) -> Signature:
    """A containers/image signature file as the layer of a ``.sig`` manifest would hold it."""
    raw = path.read_bytes()
    assert raw.startswith(SIGSTORE_PREFIX), path
    document = json.loads(raw[len(SIGSTORE_PREFIX) :])
    return Signature(payload=base64.b64decode(document["payload"]),
                     signature=document["annotations"]["dev.cosignproject.cosign/signature"],
                     layer_digest="sha256:" + "0" * 64)  # fmt: skip


@dataclass(frozen=True)
class Ref:
    """A reference as the policy takes it (snapctl.registry.client.Reference's fields)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def target(self) -> str:
        return self.digest or self.tag or "latest"


def ref(text: str) -> Ref:
    """``REGISTRY/REPO[:TAG][@DIGEST]`` split as snapctl's Reference splits it."""
    rest, _, digest = text.partition("@")
    registry, _, path = rest.partition("/")
    repository, tag = path, None
    if ":" in path:
        repository, _, tag = path.rpartition(":")
    return Ref(registry, repository, tag, digest or None)


class Fetcher:
    """Serves fixed signatures and counts the calls."""

    def __init__(self, *signatures: Signature) -> None:
        self.signatures = list(signatures)
        self.calls: list[str] = []

    def __call__(self, digest: str) -> list[Signature]:
        self.calls.append(digest)
        return self.signatures
