"""The trust policy: containers-policy.json(5), the file Podman, CRI-O and skopeo read, and
what it decides for one image.

A policy has a ``default`` list of requirements and, per transport, lists for scopes. Images
in a registry are the ``docker`` transport's. For ``REGISTRY/REPO:TAG`` the most specific
scope wins: the reference itself (``REGISTRY/REPO:TAG``, or ``REGISTRY/REPO@DIGEST`` when it
names a digest), then the repository and each namespace above it up to the registry
(``REGISTRY/REPO``, ``REGISTRY/NS``, ``REGISTRY``), then wildcard domains (``*.example.com``,
``*.com``; a port is dropped first), then the transport's ``""``, then ``default``. Every
requirement of the list found must accept.

Requirements understood: ``insecureAcceptAnything``, ``reject`` and ``sigstoreSigned`` with
public keys (``keyPath``, ``keyPaths``, ``keyData``, ``keyDatas``: base64 of PEM) and a
``signedIdentity``. A ``sigstoreSigned`` image is accepted when one of its signatures (see
:mod:`.store`) verifies with one of the keys, its payload names exactly this manifest digest,
and the reference it was signed for matches the identity rule (:mod:`.identity`; the default
``matchRepoDigestOrExact`` accepts the same tag, or the same repository when the image is
named by digest). cosign's own signatures name the repository only, which only
``matchRepository`` and ``exactRepository`` accept (the man page says the same).
Requirements snapctl cannot check (GPG ``signedBy``, ``signedBaseLayer``, Fulcio or PKI
certificates, a Rekor key) are parsed and refuse when they apply: nothing is accepted
unchecked. A relative key path is taken from the policy file's directory.

The policy file is read strictly (unknown fields, types or an empty list are errors, as in
containers/image). Without a file, :func:`load_policy` accepts every image, and says so.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapctl.protocol.atomic import reject_duplicate_keys
from snapctl.trust import keys as keyfiles
from snapctl.trust.errors import PolicyFormatError, PolicyRefusedError, SigningKeyError
from snapctl.trust.identity import (
    IDENTITY_FIELDS,
    DockerRef,
    Identity,
    docker_ref,
    identity_matches,
    intended_reference,
    namespaces,
)
from snapctl.trust.payload import PayloadError, parse
from snapctl.trust.store import ReferenceLike, RegistryAccess, Signature, read_signatures
from snapctl.trust.verdict import Verdict

SYSTEM_POLICY = Path("/etc/containers/policy.json")
TRANSPORT = "docker"
MAX_POLICY = 4 << 20
BUILT_IN = "the built-in policy"
NO_POLICY_NOTE = (f"no {SYSTEM_POLICY}: every image is accepted, signed or not "
                  "(write one, or name one, to require signatures)")  # fmt: skip

ACCEPT_ANYTHING = "insecureAcceptAnything"
REJECT = "reject"
SIGSTORE_SIGNED = "sigstoreSigned"
SIGNED_BY = "signedBy"
SIGNED_BASE_LAYER = "signedBaseLayer"

KEY_SOURCES = ("keyPath", "keyPaths", "keyData", "keyDatas", "fulcio", "pki")
REKOR_FIELDS = ("rekorPublicKeyPath", "rekorPublicKeyPaths", "rekorPublicKeyData",
                "rekorPublicKeyDatas")  # fmt: skip

SignatureFetcher = Callable[[str], Sequence[Signature]]


@dataclass(frozen=True)
class Requirement:
    """One requirement of a policy list.

    For ``sigstoreSigned``: ``key_files`` and ``key_data`` are its public keys (at least one
    of them), ``unsupported`` why snapctl cannot check it (None: it can).
    """

    type: str
    key_files: tuple[Path, ...] = ()
    key_data: tuple[bytes, ...] = ()
    identity: Identity = field(default_factory=Identity)
    unsupported: str | None = None

    def describe(self) -> str:
        """The requirement as a person reads it in the policy."""
        if self.type != SIGSTORE_SIGNED or self.unsupported:
            return self.type
        keys = [f"keyPath {path}" for path in self.key_files]
        keys += ["keyData"] * len(self.key_data)
        return f"{self.type}, {', '.join(keys)}, signedIdentity {self.identity.type}"


@dataclass(frozen=True)
class Policy:
    """A parsed policy: ``default`` and the scopes of each transport; ``source`` is the file
    read (or :data:`BUILT_IN`), ``note`` says why there was none."""

    default: tuple[Requirement, ...]
    transports: dict[str, dict[str, tuple[Requirement, ...]]]
    source: str
    note: str | None = None

    def rule_for(self, reference: ReferenceLike) -> tuple[str, tuple[Requirement, ...]]:
        """The most specific rule for ``reference``: its scope as named in the file, and its
        requirements."""
        scopes = self.transports.get(TRANSPORT, {})
        intended = intended_reference(reference)
        for scope in (intended.identity(), *namespaces(intended.name)):
            if scope in scopes:
                return f'transports.{TRANSPORT}["{scope}"]', scopes[scope]
        if "" in scopes:
            return f'transports.{TRANSPORT}[""]', scopes[""]
        return "default", self.default


# --- reading the file -------------------------------------------------------------------------


def load_policy(path: Path | None = None) -> Policy:
    """The policy in ``path``; without one, the system's (``/etc/containers/policy.json``)
    when it exists, else a policy that accepts every image, with a note saying so."""
    if path is None:
        if not SYSTEM_POLICY.exists():
            return Policy(default=(Requirement(ACCEPT_ANYTHING),), transports={},
                          source=BUILT_IN, note=NO_POLICY_NOTE)  # fmt: skip
        path = SYSTEM_POLICY
    try:
        with path.open("rb") as file:
            data = file.read(MAX_POLICY + 1)
    except OSError as error:
        raise PolicyFormatError(f"cannot read the policy {path}: {error.strerror}",
                                path=path) from error  # fmt: skip
    if len(data) > MAX_POLICY:
        raise PolicyFormatError(f"the policy {path} exceeds {MAX_POLICY} bytes", path=path)
    return parse_policy(data, source=str(path), base=path.absolute().parent)


def parse_policy(data: bytes, *, source: str = "the policy", base: Path | None = None) -> Policy:
    """A policy from its JSON; relative key paths are taken from ``base``."""
    try:
        document = json.loads(data, object_pairs_hook=reject_duplicate_keys)
    except ValueError as error:
        raise PolicyFormatError(f"{source} is not JSON: {error}") from error
    reader = _Reader(source, base or Path.cwd())
    top = reader.members(document, "the policy", required=("default",), optional=("transports",))
    transports: dict[str, dict[str, tuple[Requirement, ...]]] = {}
    for transport, scopes in reader.members(top.get("transports", {}), "transports").items():
        where = f"transports.{transport}"
        transports[transport] = {
            scope: reader.requirements(requirements, f'{where}["{scope}"]')
            for scope, requirements in reader.members(scopes, where).items()
        }
    return Policy(default=reader.requirements(top["default"], "default"),
                  transports=transports, source=source)  # fmt: skip


@dataclass
class _Reader:
    source: str
    base: Path

    def fail(self, message: str) -> PolicyFormatError:
        return PolicyFormatError(f"{self.source}: {message}")

    def members(self, value: object, where: str, *, required: Sequence[str] = (),
               optional: Sequence[str] | None = None) -> dict[str, Any]:  # fmt: skip
        """``value`` as an object; with ``optional`` given, exactly these fields."""
        if not isinstance(value, dict):
            raise self.fail(f"{where} must be an object")
        missing = [name for name in required if name not in value]
        if missing:
            raise self.fail(f"{where} lacks {', '.join(missing)}")
        if optional is not None:
            unknown = sorted(set(value) - {*required, *optional})
            if unknown:
                raise self.fail(f"{where} has unknown fields: {', '.join(unknown)}")
        return value

    def string(self, value: object, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(f"{where} must be a non-empty string")
        return value

    def strings(self, value: object, where: str) -> list[str]:
        if not isinstance(value, list) or not value:
            raise self.fail(f"{where} must be a non-empty list of strings")
        return [self.string(item, f"{where}[{i}]") for i, item in enumerate(value)]

    def requirements(self, value: object, where: str) -> tuple[Requirement, ...]:
        if not isinstance(value, list) or not value:
            raise self.fail(f"{where} must be a non-empty list of requirements")
        return tuple(self.requirement(item, f"{where}[{i}]") for i, item in enumerate(value))

    def requirement(self, value: object, where: str) -> Requirement:
        kind = self.members(value, where, required=("type",)).get("type")
        if kind in (ACCEPT_ANYTHING, REJECT):
            self.members(value, where, required=("type",), optional=())
            return Requirement(str(kind))
        if kind == SIGNED_BY:
            self.members(value, where, required=("type", "keyType"),
                        optional=("keyPath", "keyPaths", "keyData", "signedIdentity"))  # fmt: skip
            return Requirement(SIGNED_BY, unsupported="GPG signatures (signedBy) are not "
                               "checked by snapctl; use sigstoreSigned")  # fmt: skip
        if kind == SIGNED_BASE_LAYER:
            self.members(value, where, required=("type", "baseLayerIdentity"), optional=())
            return Requirement(SIGNED_BASE_LAYER, unsupported="signedBaseLayer is not checked "
                               "by snapctl (its images have no base layer)")  # fmt: skip
        if kind == SIGSTORE_SIGNED:
            return self.sigstore(value, where)
        raise self.fail(f"{where} has an unknown requirement type {kind!r}")

    def sigstore(self, value: object, where: str) -> Requirement:
        fields = self.members(value, where, required=("type",),
                             optional=(*KEY_SOURCES, *REKOR_FIELDS, "signedIdentity"))  # fmt: skip
        sources = [name for name in KEY_SOURCES if name in fields]
        if len(sources) != 1:
            raise self.fail(f"{where}: exactly one of {', '.join(KEY_SOURCES)} must be given")
        if sum(name in fields for name in REKOR_FIELDS) > 1:
            raise self.fail(f"{where}: at most one of {', '.join(REKOR_FIELDS)} may be given")
        identity = self.identity(fields.get("signedIdentity"), f"{where}.signedIdentity")
        source = sources[0]
        if source in ("fulcio", "pki"):
            return Requirement(SIGSTORE_SIGNED, identity=identity, unsupported=(
                f"sigstoreSigned with {source} certificates is not checked by snapctl; "
                "use public keys (keyPath)"))  # fmt: skip
        paths: list[str] = []
        datas: list[bytes] = []
        if source == "keyPath":
            paths = [self.string(fields[source], f"{where}.keyPath")]
        elif source == "keyPaths":
            paths = self.strings(fields[source], f"{where}.keyPaths")
        else:
            encoded = ([self.string(fields[source], f"{where}.keyData")] if source == "keyData"
                       else self.strings(fields[source], f"{where}.keyDatas"))  # fmt: skip
            for i, text in enumerate(encoded):
                try:
                    datas.append(base64.b64decode(text, validate=True))
                except ValueError as error:
                    raise self.fail(f"{where}.{source} entry {i} is not base64") from error
        unsupported = None
        if any(name in fields for name in REKOR_FIELDS):
            unsupported = ("sigstoreSigned with a Rekor key is not checked by snapctl (it "
                           "does not verify transparency-log entries)")  # fmt: skip
        return Requirement(SIGSTORE_SIGNED, key_files=tuple(self.base / p for p in paths),
                           key_data=tuple(datas), identity=identity,
                           unsupported=unsupported)  # fmt: skip

    def identity(self, value: object, where: str) -> Identity:
        if value is None:
            return Identity()
        kind = self.members(value, where, required=("type",)).get("type")
        if kind not in IDENTITY_FIELDS:
            raise self.fail(f"{where} has an unknown type {kind!r}")
        names = IDENTITY_FIELDS[str(kind)]
        fields = self.members(value, where, required=("type", *names), optional=())
        values = tuple((name, self.string(fields[name], f"{where}.{name}")) for name in names)
        for name, text in values:
            if name in ("dockerReference", "dockerRepository") and docker_ref(text) is None:
                raise self.fail(f"{where}.{name} {text!r} is not a docker reference")
        return Identity(str(kind), values)


# --- evaluation -------------------------------------------------------------------------------


def evaluate(policy: Policy, reference: ReferenceLike, manifest_digest: str,
             fetch_signatures: SignatureFetcher) -> Verdict:  # fmt: skip
    """The policy's verdict on the image ``reference`` whose manifest (verified by the caller)
    has ``manifest_digest``; a refusal raises :class:`PolicyRefusedError`, which carries its
    verdict. ``fetch_signatures(digest)`` gives the stored signatures of a manifest digest;
    it is called at most once, and only when a requirement needs signatures."""
    scope, requirements = policy.rule_for(reference)
    intended = intended_reference(reference)
    fetched: list[Sequence[Signature]] = []

    def signatures() -> Sequence[Signature]:
        if not fetched:
            fetched.append(fetch_signatures(manifest_digest))
        return fetched[0]

    details = []
    for requirement in requirements:
        if intended.digest not in (None, manifest_digest):
            accepted, detail = False, f"the reference names {intended.digest}, not this manifest"
        else:
            accepted, detail = _check(requirement, intended, manifest_digest, signatures)
        if not accepted:
            raise PolicyRefusedError(Verdict(
                accepted=False, reference=str(intended), manifest_digest=manifest_digest,
                scope=scope, requirement=requirement.describe(), detail=detail,
                policy=policy.source, note=policy.note))  # fmt: skip
        details.append(detail)
    return Verdict(accepted=True, reference=str(intended), manifest_digest=manifest_digest,
                   scope=scope, requirement=" + ".join(r.describe() for r in requirements),
                   detail="; ".join(details), policy=policy.source,
                   note=policy.note)  # fmt: skip


def verify_pull(policy: Policy, reference: ReferenceLike, manifest_digest: str,
                client: RegistryAccess) -> Verdict:  # fmt: skip
    """:func:`evaluate` for an image being pulled through ``client`` (a
    :class:`~snapctl.registry.client.RegistryClient` of the reference's repository): the
    signatures are read from the registry's ``.sig`` tag. Call it once the manifest's digest
    is verified and before any image byte is used; it raises :class:`PolicyRefusedError`."""
    return evaluate(policy, reference, manifest_digest,
                    lambda digest: read_signatures(client, digest))  # fmt: skip


def _check(requirement: Requirement, intended: DockerRef, manifest_digest: str,
           signatures: Callable[[], Sequence[Signature]]) -> tuple[bool, str]:  # fmt: skip
    if requirement.type == ACCEPT_ANYTHING:
        return True, "insecureAcceptAnything accepts any image, signed or not"
    if requirement.type == REJECT:
        return False, "this scope rejects every image"
    if requirement.unsupported is not None:
        return False, requirement.unsupported
    try:
        public_keys = _public_keys(requirement)
    except SigningKeyError as error:
        return False, f"its key cannot be used: {error.message}"
    found = signatures()
    if not found:
        return False, ("the image is not signed (no signature manifest "
                       f"sha256-{manifest_digest.removeprefix('sha256:')}.sig)")  # fmt: skip
    reasons = []
    for number, signature in enumerate(found, 1):
        verifies = [k for k in public_keys
                    if keyfiles.verify(k, signature.payload, signature.signature)]  # fmt: skip
        if not verifies:
            reasons.append(f"signature {number} is not by its key")
            continue
        try:
            claims = parse(signature.payload)
        except PayloadError as error:
            reasons.append(f"signature {number} signs no image ({error})")
            continue
        if claims.manifest_digest != manifest_digest:
            reasons.append(f"signature {number} signs {claims.manifest_digest}, not this "
                           "manifest")  # fmt: skip
            continue
        if not identity_matches(requirement.identity, intended, claims.docker_reference):
            reasons.append(f"signature {number} was made for {claims.docker_reference}, "
                           f"which {requirement.identity.type} does not accept for "
                           f"{intended}")  # fmt: skip
            continue
        return True, (f"signature {number} of {len(found)} verified with key "
                      f"{keyfiles.fingerprint(verifies[0])}, made for "
                      f"{claims.docker_reference}")  # fmt: skip
    return False, f"no signature is accepted: {'; '.join(reasons)}"


def _public_keys(requirement: Requirement) -> list[keyfiles.PublicKey]:
    found: list[keyfiles.PublicKey] = []
    for path in requirement.key_files:
        found += keyfiles.read_public_keys(path)
    for number, data in enumerate(requirement.key_data, 1):
        found += keyfiles.load_public_keys(data, f"keyData {number}")
    return found
