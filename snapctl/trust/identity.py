"""Docker references as a trust policy sees them, and the ``signedIdentity`` rules that
match the reference a signature was made for against the one an image is pulled by.

References are normalized as containers/image normalizes them (``busybox`` is
``docker.io/library/busybox``). The rules and their semantics are containers/image's:
``matchRepoDigestOrExact`` (the default: the same tag, or the same repository when pulled by
digest), ``matchExact``, ``matchRepository``, ``exactReference``, ``exactRepository`` and
``remapIdentity``. A signature made for a repository alone (cosign's) is accepted only by the
two repository rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from snapctl.trust.store import ReferenceLike

IDENTITY_FIELDS = {
    "matchExact": (), "matchRepoDigestOrExact": (), "matchRepository": (),
    "exactReference": ("dockerReference",), "exactRepository": ("dockerRepository",),
    "remapIdentity": ("prefix", "signedPrefix"),
}  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """A ``signedIdentity``: its type and that type's fields."""

    type: str = "matchRepoDigestOrExact"
    fields: tuple[tuple[str, str], ...] = ()

    def get(self, name: str) -> str:
        return dict(self.fields)[name]


_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}")


@dataclass(frozen=True)
class DockerRef:
    """A docker reference, normalized as containers/image normalizes one: ``name`` has its
    registry (``docker.io`` when none is written, with ``library/`` for a single
    component)."""

    name: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name_only(self) -> bool:
        return self.tag is None and self.digest is None

    def __str__(self) -> str:
        return (self.name + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))  # fmt: skip

    def identity(self) -> str:
        """The policy scope of this exact image: with its digest when it has one, else its
        tag."""
        if self.digest:
            return f"{self.name}@{self.digest}"
        return f"{self.name}:{self.tag}" if self.tag else self.name


def docker_ref(text: str) -> DockerRef | None:
    """``text`` parsed and normalized; None if it is not a docker reference."""
    rest, _, digest = text.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        return None
    name, tag = rest, None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = rest.rpartition(":")
        if not _TAG.fullmatch(tag):
            return None
    if not _NAME.fullmatch(name):
        return None
    return DockerRef(normalized_name(name), tag, digest or None)


def normalized_name(name: str) -> str:
    """``busybox`` → ``docker.io/library/busybox``; a name with a registry stays as it is
    (``index.docker.io`` is ``docker.io``)."""
    first, _, rest = name.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"
                        or first != first.lower()):  # fmt: skip
        first, rest = "docker.io", name
    if first == "index.docker.io":
        first = "docker.io"
    if first == "docker.io" and "/" not in rest:
        rest = f"library/{rest}"
    return f"{first}/{rest}"


def intended_reference(reference: ReferenceLike) -> DockerRef:
    """The reference an image is pulled by, as a policy sees it: a reference with both a tag
    and a digest is taken by its digest (the pull is pinned to it)."""
    name = normalized_name(f"{reference.registry}/{reference.repository}")
    if reference.digest:
        return DockerRef(name, None, reference.digest)
    return DockerRef(name, reference.tag or "latest", None)


def namespaces(name: str) -> list[str]:
    """The scopes above an image, most specific first: the repository, each namespace up to
    the registry, then wildcard domains (containers/image's docker naming)."""
    found = []
    while True:
        found.append(name)
        if "/" not in name:
            break
        name = name.rsplit("/", 1)[0]
    host = name.split(":", 1)[0]
    while "." in host:
        host = host.split(".", 1)[1]
        found.append(f"*.{host}")
    return found


def identity_matches(identity: Identity, intended: DockerRef, signed_text: str) -> bool:
    """Whether a signature for ``signed_text`` is one for ``intended`` under ``identity``."""
    signed = docker_ref(signed_text)
    if signed is None:
        return False
    kind = identity.type
    if kind == "matchExact":
        return not intended.name_only and not signed.name_only and str(signed) == str(intended)
    if kind == "matchRepoDigestOrExact":
        return _repo_digest_or_exact(intended, signed)
    if kind == "matchRepository":
        return signed.name == intended.name
    if kind == "exactReference":
        wanted = docker_ref(identity.get("dockerReference"))
        return (wanted is not None and not wanted.name_only and not signed.name_only
                and str(signed) == str(wanted))  # fmt: skip
    if kind == "exactRepository":
        wanted = docker_ref(identity.get("dockerRepository"))
        return wanted is not None and signed.name == wanted.name
    if kind == "remapIdentity":
        prefix, signed_prefix = identity.get("prefix"), identity.get("signedPrefix")
        if intended.name == prefix or intended.name.startswith(f"{prefix}/"):
            remapped = docker_ref(str(intended).replace(prefix, signed_prefix, 1))
            if remapped is None:
                return False
            intended = remapped
        return _repo_digest_or_exact(intended, signed)
    return False


def _repo_digest_or_exact(intended: DockerRef, signed: DockerRef) -> bool:
    if signed.name_only:
        return False
    if intended.tag is not None:
        return str(signed) == str(intended)
    if intended.digest is not None:
        return signed.name == intended.name
    return False
