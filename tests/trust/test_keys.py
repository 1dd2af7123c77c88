"""Key files and signatures in cosign's formats, checked against cosign's, go-securesystemslib's
and containers/image's published test data (tests/trust/data/README.md), and keys made by
``image keygen`` read back."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from snapctl.trust import keys, payload
from snapctl.trust.errors import KeyExistsError, SigningKeyError
from tests.trust.helpers import (
    COSIGN_REPOSITORY,
    DATA,
    IMAGES,
    SIGNED_DIGEST,
    stored_signature,
)

pytestmark = pytest.mark.timeout(60)
COSIGN = DATA / "cosign"
SSL = DATA / "securesystemslib"


@pytest.mark.parametrize("name", ["sigstore-hello.key", "cosign-label-hello.key"])
def test_cosign_s_encrypted_keys_decrypt_with_their_passphrase(name: str) -> None:
    key = keys.load_private_key(COSIGN / name, b"hello")
    assert key.curve.name == "secp256r1"
    signature = keys.sign(key, b"payload")
    assert keys.verify(key.public_key(), b"payload", signature)
    assert not keys.verify(key.public_key(), b"other payload", signature)


def test_a_wrong_passphrase_and_a_key_cosign_refuses_are_refused() -> None:
    with pytest.raises(SigningKeyError, match="wrong passphrase"):
        keys.load_private_key(COSIGN / "sigstore-hello.key", b"hellO")
    # cosign's own test expects this one to fail: its decrypted key is SEC1, not PKCS#8.
    with pytest.raises(SigningKeyError, match="not PKCS#8"):
        keys.load_private_key(COSIGN / "cosign-sec1-hello.key", b"hello")
    with pytest.raises(SigningKeyError, match="not cosign's encrypted private key"):
        keys.load_private_key(IMAGES / "cosign.pub", b"hello")


@pytest.mark.parametrize("name", ["legacy.json", "standard.json", "owasp.json"])
def test_every_scrypt_setting_of_the_envelope_library_decrypts(name: str) -> None:
    plaintext = keys.decrypt((SSL / name).read_bytes(), b"supersecret")
    assert base64.b64decode(json.loads(plaintext)) == b"reallyimportant"
    assert keys.decrypt((SSL / "decrypt.json").read_bytes(), b"supersecret") == (
        b"reallyimportant")  # fmt: skip


def test_unsupported_scrypt_parameters_are_refused_before_any_derivation() -> None:
    with pytest.raises(SigningKeyError, match="unsupported scrypt parameters"):
        keys.decrypt((SSL / "unsupported-params.json").read_bytes(), b"supersecret")


def test_cosign_s_signature_over_its_payload_verifies_with_its_public_key() -> None:
    signed = stored_signature(IMAGES / "dir-img-cosign-valid" / "signature-1")
    cosign_key = keys.read_public_keys(IMAGES / "cosign.pub")[0]
    other_key = keys.read_public_keys(IMAGES / "cosign2.pub")[0]
    assert keys.verify(cosign_key, signed.payload, signed.signature)
    assert not keys.verify(other_key, signed.payload, signed.signature)
    assert not keys.verify(cosign_key, signed.payload + b" ", signed.signature)
    claims = payload.parse(signed.payload)
    assert (claims.docker_reference, claims.manifest_digest) == (COSIGN_REPOSITORY, SIGNED_DIGEST)
    manifest = (IMAGES / "dir-img-cosign-valid" / "manifest.json").read_bytes()
    assert "sha256:" + hashlib.sha256(manifest).hexdigest() == SIGNED_DIGEST
    unknown = stored_signature(IMAGES / "unknown-cosign-key.signature")
    assert not keys.verify(cosign_key, unknown.payload, unknown.signature)


def test_the_payload_is_byte_for_byte_cosign_s() -> None:
    cosign_made = stored_signature(IMAGES / "dir-img-cosign-valid" / "signature-1").payload
    assert payload.build(COSIGN_REPOSITORY, SIGNED_DIGEST) == cosign_made
    expected = (COSIGN / "payload.json").read_bytes()
    digest = "sha256:4aa3054270f7a70b4528f2064ee90961788e1e1518703592ae4463de3b889dec"
    assert payload.build("index.docker.io/namespace/image", digest) == expected


@pytest.mark.parametrize("document", [
    {"critical": {"identity": {"docker-reference": "r/x"}, "image": {
        "docker-manifest-digest": SIGNED_DIGEST}, "type": "cosign container image signature",
        "extra": 1}, "optional": None},
    {"critical": {"identity": {"docker-reference": "r/x"}, "image": {
        "docker-manifest-digest": SIGNED_DIGEST}, "type": "another signature"}, "optional": None},
    {"critical": {"identity": {"docker-reference": "r/x"}, "image": {
        "docker-manifest-digest": SIGNED_DIGEST}, "type": "cosign container image signature"}},
    [1, 2],
])  # fmt: skip
def test_a_payload_outside_the_format_is_refused(document: object) -> None:
    with pytest.raises(payload.PayloadError):
        payload.parse(json.dumps(document).encode())


def test_a_payload_repeating_a_key_is_refused() -> None:
    text = payload.build("r/x", SIGNED_DIGEST).replace(b'"optional"', b'"optional":1,"optional"')
    with pytest.raises(payload.PayloadError, match="duplicate key 'optional'"):
        payload.parse(text)


def test_a_generated_pair_is_cosign_s_format_and_round_trips(tmp_path: Path) -> None:
    pair = keys.generate(tmp_path / "snap", b"correct horse")
    assert stat.S_IMODE(pair.private.stat().st_mode) == 0o600
    assert stat.S_IMODE(pair.public.stat().st_mode) == 0o644
    kind, body = keys.pem_decode(pair.private.read_bytes(), "key")
    assert kind == "ENCRYPTED SIGSTORE PRIVATE KEY"
    assert all(len(line) <= 64 for line in pair.private.read_text().splitlines())
    envelope = json.loads(body)
    assert list(envelope) == ["kdf", "cipher", "ciphertext"]
    assert envelope["kdf"]["name"] == "scrypt" and envelope["cipher"]["name"] == "nacl/secretbox"
    assert envelope["kdf"]["params"] == {"N": 65536, "r": 8, "p": 1}
    assert len(base64.b64decode(envelope["kdf"]["salt"])) == 32
    assert len(base64.b64decode(envelope["cipher"]["nonce"])) == 24
    # Decrypted by hand, as go-securesystemslib does: scrypt, then secretbox, then PKCS#8.
    import nacl.secret

    box_key = Scrypt(salt=base64.b64decode(envelope["kdf"]["salt"]), length=32, n=65536,
                     r=8, p=1).derive(b"correct horse")  # fmt: skip
    der = nacl.secret.SecretBox(box_key).decrypt(
        base64.b64decode(envelope["ciphertext"]), base64.b64decode(envelope["cipher"]["nonce"])
    )
    private = serialization.load_der_private_key(der, None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    public = keys.read_public_keys(pair.public)[0]
    assert pair.public.read_text().startswith("-----BEGIN PUBLIC KEY-----\n")
    assert keys.fingerprint(public) == keys.fingerprint(private.public_key())

    loaded = keys.load_private_key(pair.private, b"correct horse")
    assert keys.verify(public, b"x", keys.sign(loaded, b"x"))
    with pytest.raises(SigningKeyError, match="wrong passphrase"):
        keys.load_private_key(pair.private, b"wrong horse")


def test_keygen_never_overwrites_and_leaves_nothing_half_made(tmp_path: Path) -> None:
    (tmp_path / "taken.pub").write_text("mine")
    with pytest.raises(KeyExistsError, match="never overwrites"):
        keys.generate(tmp_path / "taken", b"p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.pub"]
    assert (tmp_path / "taken.pub").read_text() == "mine"
    keys.generate(tmp_path / "made", b"")  # an empty passphrase, as cosign allows
    with pytest.raises(KeyExistsError):
        keys.generate(tmp_path / "made", b"")
    assert keys.load_private_key(tmp_path / "made.key", b"").curve.name == "secp256r1"


def test_a_public_key_file_may_hold_several_keys_and_must_hold_one(tmp_path: Path) -> None:
    both = (IMAGES / "cosign.pub").read_bytes() + (IMAGES / "cosign2.pub").read_bytes()
    assert len(keys.load_public_keys(both, "both")) == 2
    with pytest.raises(SigningKeyError, match="no PEM public key"):
        keys.load_public_keys(b"nothing here\n", "empty")
    with pytest.raises(SigningKeyError, match="not 'PUBLIC KEY'"):
        keys.load_public_keys((COSIGN / "sigstore-hello.key").read_bytes(), "private")
