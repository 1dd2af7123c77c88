"""Key files in cosign's formats: generate a pair, encrypt and decrypt the private key, sign
and verify bytes.

The private key file is what ``cosign generate-key-pair`` writes: a PEM block of type
``ENCRYPTED SIGSTORE PRIVATE KEY`` (older cosign: ``ENCRYPTED COSIGN PRIVATE KEY``) whose body
is go-securesystemslib's ``encrypted`` envelope, a JSON object::

    {"kdf": {"name": "scrypt", "params": {"N": 65536, "r": 8, "p": 1}, "salt": B64},
     "cipher": {"name": "nacl/secretbox", "nonce": B64}, "ciphertext": B64}

The key is scrypt(passphrase, salt) (32 bytes), the ciphertext is NaCl's secretbox of the
PKCS#8 DER private key under it. Decryption accepts the three scrypt settings that library
writes (N 2^15, 2^16, 2^17; r 8; p 1) and refuses others, as it does, so a tampered file cannot
make the KDF take unbounded memory. New keys use 2^16, its default.

The public key file is PEM ``PUBLIC KEY`` (PKIX). A signature is ECDSA P-256 over SHA-256 of
the payload, ASN.1 DER. Verification also takes RSA (PKCS#1 v1.5, SHA-256) and Ed25519 public
keys, as the policy's verifiers do.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from snapctl.trust.errors import KeyExistsError, SigningKeyError

SIGSTORE_PEM_TYPE = "ENCRYPTED SIGSTORE PRIVATE KEY"
COSIGN_PEM_TYPE = "ENCRYPTED COSIGN PRIVATE KEY"
PUBLIC_PEM_TYPE = "PUBLIC KEY"
PASSWORD_ENV = "SNAPCTL_KEY_PASSWORD"

# go-securesystemslib's scrypt settings: legacy, standard (its default), OWASP.
SCRYPT_SETTINGS = ({"N": 32768, "r": 8, "p": 1}, {"N": 65536, "r": 8, "p": 1},
                   {"N": 131072, "r": 8, "p": 1})  # fmt: skip
DEFAULT_SCRYPT = SCRYPT_SETTINGS[1]
SALT_BYTES = 32
NONCE_BYTES = 24
BOX_KEY_BYTES = 32
MAX_KEY_FILE = 64 << 10

PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey


@dataclass(frozen=True)
class KeyPair:
    """The two files ``image keygen`` writes."""

    private: Path
    public: Path


def encrypt(plaintext: bytes, passphrase: bytes) -> bytes:
    """go-securesystemslib's ``encrypted.Encrypt``: the JSON envelope, as bytes."""
    import nacl.secret

    salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
    key = _derive(passphrase, salt, DEFAULT_SCRYPT)
    sealed = nacl.secret.SecretBox(key).encrypt(plaintext, nonce).ciphertext
    envelope = {
        "kdf": {"name": "scrypt", "params": dict(DEFAULT_SCRYPT), "salt": _b64(salt)},
        "cipher": {"name": "nacl/secretbox", "nonce": _b64(nonce)},
        "ciphertext": _b64(sealed),
    }
    return json.dumps(envelope, separators=(",", ":")).encode()


def decrypt(envelope: bytes, passphrase: bytes, *, what: str = "the key") -> bytes:
    """go-securesystemslib's ``encrypted.Decrypt``; a wrong passphrase and a damaged file are
    one error, as they are indistinguishable."""
    import nacl.exceptions
    import nacl.secret

    try:
        data = json.loads(envelope)
        kdf, cipher = data["kdf"], data["cipher"]
        if kdf["name"] != "scrypt":
            raise SigningKeyError(f"{what}: unknown key derivation {kdf['name']!r} (not scrypt)")
        if cipher["name"] != "nacl/secretbox":
            raise SigningKeyError(f"{what}: unknown cipher {cipher['name']!r} "
                                  "(not nacl/secretbox)")  # fmt: skip
        params = {name: kdf["params"].get(name) for name in ("N", "r", "p")}
        if params not in SCRYPT_SETTINGS or any(type(v) is not int for v in params.values()):
            raise SigningKeyError(f"{what}: unsupported scrypt parameters {kdf['params']}")
        salt, nonce = _unb64(kdf["salt"]), _unb64(cipher["nonce"])
        sealed = _unb64(data["ciphertext"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SigningKeyError(f"{what} is not an encrypted key envelope ({error})") from error
    if len(nonce) != NONCE_BYTES:
        raise SigningKeyError(f"{what}: the nonce is {len(nonce)} bytes, not {NONCE_BYTES}")
    key = _derive(passphrase, salt, params)
    try:
        plaintext: bytes = nacl.secret.SecretBox(key).decrypt(sealed, nonce)
    except nacl.exceptions.CryptoError as error:
        raise SigningKeyError(
            f"{what}: decryption failed (wrong passphrase, or the file is damaged)"
        ) from error
    return plaintext


def _derive(passphrase: bytes, salt: bytes, params: dict[str, Any]) -> bytes:
    kdf = Scrypt(salt=salt, length=BOX_KEY_BYTES, n=params["N"], r=params["r"], p=params["p"])
    return kdf.derive(passphrase)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"expected base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


# --- PEM ------------------------------------------------------------------------------------


def pem_encode(kind: str, der: bytes) -> bytes:
    """A PEM block as Go's ``pem.EncodeToMemory`` writes it (64-column base64)."""
    body = base64.b64encode(der).decode()
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return f"-----BEGIN {kind}-----\n{chr(10).join(lines)}\n-----END {kind}-----\n".encode()


def pem_decode(text: bytes, what: str) -> tuple[str, bytes]:
    """The first PEM block of ``text``: its type and its bytes."""
    try:
        lines = text.decode("ascii").strip().splitlines()
    except UnicodeDecodeError as error:
        raise SigningKeyError(f"{what} is not a PEM file") from error
    begin = next((i for i, line in enumerate(lines) if line.startswith("-----BEGIN ")), None)
    if begin is None or not lines[begin].endswith("-----"):
        raise SigningKeyError(f"{what} is not a PEM file (no BEGIN line)")
    kind = lines[begin][len("-----BEGIN ") : -len("-----")]
    end = f"-----END {kind}-----"
    try:
        stop = lines.index(end, begin + 1)
    except ValueError as error:
        raise SigningKeyError(f"{what}: the PEM block {kind} has no END line") from error
    body = [line.strip() for line in lines[begin + 1 : stop]]
    if any(":" in line for line in body):
        raise SigningKeyError(f"{what}: PEM headers are not supported")
    try:
        return kind, base64.b64decode("".join(body), validate=True)
    except ValueError as error:
        raise SigningKeyError(f"{what}: the PEM block is not base64") from error


# --- key pairs ------------------------------------------------------------------------------


def generate(prefix: Path, passphrase: bytes) -> KeyPair:
    """Write ``PREFIX.key`` (cosign's encrypted private key, mode 0600) and ``PREFIX.pub``
    (mode 0644); neither may exist. On any failure neither is left behind."""
    pair = KeyPair(private=Path(f"{prefix}.key"), public=Path(f"{prefix}.pub"))
    for path in (pair.private, pair.public):
        if os.path.lexists(path):
            raise KeyExistsError(f"{path} exists; snapctl never overwrites a key "
                                 "(remove it, or choose another prefix)", path=path)  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    private_pem = pem_encode(SIGSTORE_PEM_TYPE, encrypt(der, passphrase))
    public_pem = public_key_pem(key.public_key())
    _write_new(pair.private, private_pem, 0o600)
    try:
        _write_new(pair.public, public_pem, 0o644)
    except BaseException:
        pair.private.unlink(missing_ok=True)
        raise
    return pair


def public_key_pem(key: PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)  # fmt: skip


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never an existing one), its bytes on disk once this
    returns."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError as error:
        raise KeyExistsError(f"{path} exists; snapctl never overwrites a key",
                             path=path) from error  # fmt: skip
    except OSError as error:
        raise SigningKeyError(f"cannot create {path}: {error.strerror}", path=path) from error
    try:
        os.fchmod(fd, mode)  # the umask narrowed the public key's mode
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(data)
            out.flush()
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def load_private_key(path: Path, passphrase: bytes) -> ec.EllipticCurvePrivateKey:
    """The ECDSA P-256 signing key in cosign's encrypted file ``path``."""
    kind, body = pem_decode(_read(path), str(path))
    if kind not in (SIGSTORE_PEM_TYPE, COSIGN_PEM_TYPE):
        raise SigningKeyError(f"{path} is a {kind!r} PEM, not cosign's encrypted private key "
                              f"({SIGSTORE_PEM_TYPE!r})", path=path)  # fmt: skip
    return private_key_from_der(decrypt(body, passphrase, what=str(path)), str(path))


def private_key_from_der(der: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    """A PKCS#8 DER private key, which must be ECDSA P-256 (cosign reads only PKCS#8 here)."""
    # PKCS#8 is SEQUENCE { INTEGER 0, SEQUENCE { algorithm } ... }; a SEC1 key (INTEGER 1,
    # OCTET STRING) is what cosign refuses too.
    header = 2 + (der[1] & 0x7F if len(der) > 1 and der[1] & 0x80 else 0)
    if der[header : header + 4] != b"\x02\x01\x00\x30":
        raise SigningKeyError(f"{what}: the decrypted key is not PKCS#8")
    try:
        key = serialization.load_der_private_key(der, password=None)
    except ValueError as error:
        raise SigningKeyError(f"{what}: the decrypted key cannot be parsed ({error})") from error
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise SigningKeyError(f"{what}: snapctl signs with ECDSA P-256 keys only, this is "
                              f"{_describe(key)}")  # fmt: skip
    return key


def load_public_keys(data: bytes, what: str) -> list[PublicKey]:
    """Every ``PUBLIC KEY`` block in ``data`` (a policy's key file may hold several)."""
    keys: list[PublicKey] = []
    rest = data
    while b"-----BEGIN " in rest:
        start = rest.index(b"-----BEGIN ")
        kind, der = pem_decode(rest[start:], what)
        if kind != PUBLIC_PEM_TYPE:
            raise SigningKeyError(f"{what}: a {kind!r} PEM block, not {PUBLIC_PEM_TYPE!r}")
        keys.append(_public_key(der, what))
        end = f"-----END {kind}-----".encode()
        rest = rest[rest.index(end, start) + len(end) :]
    if not keys:
        raise SigningKeyError(f"{what} holds no PEM public key")
    return keys


def _public_key(der: bytes, what: str) -> PublicKey:
    try:
        key = serialization.load_der_public_key(der)
    except ValueError as error:
        raise SigningKeyError(f"{what}: the public key cannot be parsed ({error})") from error
    if isinstance(key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey):
        return key
    raise SigningKeyError(f"{what}: {_describe(key)} is not a signature key snapctl verifies")


def read_public_keys(path: Path) -> list[PublicKey]:
    return load_public_keys(_read(path), str(path))


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_KEY_FILE + 1)
    except OSError as error:
        raise SigningKeyError(f"cannot read {path}: {error.strerror}", path=path) from error
    if len(data) > MAX_KEY_FILE:
        raise SigningKeyError(f"{path} is larger than a key file ({MAX_KEY_FILE} bytes)",
                              path=path)  # fmt: skip
    return data


def _describe(key: object) -> str:
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return f"ECDSA {key.curve.name}"
    if isinstance(key, rsa.RSAPrivateKey | rsa.RSAPublicKey):
        return f"RSA {key.key_size}"
    return type(key).__name__.removeprefix("_").replace("PrivateKey", "").replace("PublicKey", "")


# --- signatures -----------------------------------------------------------------------------


def sign(key: ec.EllipticCurvePrivateKey, payload: bytes) -> str:
    """The base64 of the ASN.1 DER ECDSA signature over SHA-256 of ``payload``."""
    return _b64(key.sign(payload, ec.ECDSA(hashes.SHA256())))


def verify(key: PublicKey, payload: bytes, signature_b64: str) -> bool:
    """Whether ``signature_b64`` is ``key``'s signature over ``payload`` (SHA-256: ECDSA DER,
    RSA PKCS#1 v1.5; Ed25519 signs the payload itself)."""
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except ValueError:
        return False
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, payload, padding.PKCS1v15(), hashes.SHA256())
        else:
            key.verify(signature, payload)
    except InvalidSignature:
        return False
    return True


def fingerprint(key: PublicKey) -> str:
    """A short name for a public key: sha256 of its PKIX DER, first 16 hex digits."""
    der = key.public_bytes(serialization.Encoding.DER,
                           serialization.PublicFormat.SubjectPublicKeyInfo)  # fmt: skip
    return hashlib.sha256(der).hexdigest()[:16]
