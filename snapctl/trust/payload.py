"""cosign's "simple signing" payload: the bytes a signature signs.

One JSON object, as cosign (sigstore's ``payload.SimpleContainerImage``) writes it::

    {"critical": {"identity": {"docker-reference": REF},
                  "image": {"docker-manifest-digest": "sha256:..."},
                  "type": "cosign container image signature"},
     "optional": null}

``critical`` says what is signed: the manifest digest, and the reference it was signed for
(cosign writes the repository alone; Podman and skopeo, and snapctl, write the reference as it
was named, with its tag). A reader must understand all of it: like containers/image, this
reads ``critical`` strictly (exactly these fields, no duplicate keys) and ``optional`` as free
annotations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from snapctl.protocol.atomic import reject_duplicate_keys

MEDIA_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_TYPE = "cosign container image signature"
MAX_PAYLOAD = 1 << 20


class PayloadError(ValueError):
    """A payload that is not a simple-signing payload (a reason to refuse its signature)."""


@dataclass(frozen=True)
class Claims:
    """What a verified payload says: the manifest digest and the signed reference."""

    docker_reference: str
    manifest_digest: str
    optional: dict[str, Any] | None


def build(docker_reference: str, manifest_digest: str) -> bytes:
    """The payload for ``manifest_digest`` signed for ``docker_reference``, byte for byte as
    cosign's Go code marshals it (compact, fields in this order, no trailing newline)."""
    document = {
        "critical": {
            "identity": {"docker-reference": docker_reference},
            "image": {"docker-manifest-digest": manifest_digest},
            "type": SIGNATURE_TYPE,
        },
        "optional": None,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def parse(payload: bytes) -> Claims:
    """The claims of ``payload``; :class:`PayloadError` names what is wrong with it."""
    if len(payload) > MAX_PAYLOAD:
        raise PayloadError(f"the payload exceeds {MAX_PAYLOAD} bytes")
    try:
        document = json.loads(payload, object_pairs_hook=reject_duplicate_keys)
    except ValueError as error:
        raise PayloadError(f"the payload is not JSON ({error})") from error
    critical = _exact(document, "the payload", {"critical", "optional"})["critical"]
    optional = document["optional"]
    if optional is not None and not isinstance(optional, dict):
        raise PayloadError("the payload's optional is not an object")
    fields = _exact(critical, "critical", {"identity", "image", "type"})
    if fields["type"] != SIGNATURE_TYPE:
        raise PayloadError(f"the payload's type is {fields['type']!r}, not {SIGNATURE_TYPE!r}")
    digest = _exact(fields["image"], "critical.image", {"docker-manifest-digest"})
    identity = _exact(fields["identity"], "critical.identity", {"docker-reference"})
    manifest_digest, reference = digest["docker-manifest-digest"], identity["docker-reference"]
    if not isinstance(manifest_digest, str) or not isinstance(reference, str):
        raise PayloadError("the payload's digest and reference must be strings")
    return Claims(docker_reference=reference, manifest_digest=manifest_digest,
                  optional=optional)  # fmt: skip


def _exact(value: object, what: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PayloadError(f"{what} is not an object")
    if set(value) != names:
        raise PayloadError(f"{what} has the fields {sorted(value)}, not {sorted(names)}")
    return value
