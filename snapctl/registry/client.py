"""One registry, spoken to over the OCI distribution API: references, credentials, blob and
manifest requests.

ORAS's Python SDK (``oras``) parses references and finds credentials: the docker config
(``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``, with its credential helpers)
and the registry's token or basic-auth challenge. The requests themselves are made here on
the SDK's session: blobs stream in bounded pieces (never whole into memory), a download
resumes with a ``Range`` request, and a failure is reported at once instead of after the SDK's
retries, which sleep 3^n seconds on any error.
"""

from __future__ import annotations

import hashlib
import os
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import requests

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase

# Credentials when there is no docker config (CI jobs): both or neither.
USERNAME_ENV = "SNAPCTL_REGISTRY_USERNAME"
PASSWORD_ENV = "SNAPCTL_REGISTRY_PASSWORD"
TIMEOUT_S = 60.0
STREAM_PIECE = 1 << 20


class RegistryError(SnapctlError):
    """A registry refused, could not be reached, or answered outside the distribution API."""

    def __init__(self, message: str, *, reference: str | None = None) -> None:
        super().__init__(message, phase=HostPhase.REGISTRY)
        self.reference = reference


class RegistryUnreachableError(RegistryError):
    """The registry could not be reached, or a transfer from it broke off (the network)."""

    exit_status = ExitStatus.UNAVAILABLE


class BlobMismatchError(RegistryError):
    """A blob or manifest from the registry does not match its digest or its description;
    nothing was published."""

    exit_status = ExitStatus.VERIFY_FAILED


@dataclass(frozen=True)
class Reference:
    """``REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]``."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> Reference:
        import oras.container

        if "/" not in text:
            raise RegistryError(
                f"{text!r} is not an image reference (REGISTRY/REPOSITORY[:TAG][@DIGEST])",
                reference=text,
            )
        try:
            parsed = oras.container.Container(text)
        except (ValueError, AttributeError) as error:
            raise RegistryError(
                f"{text!r} is not an image reference (REGISTRY/REPOSITORY[:TAG][@DIGEST])",
                reference=text,
            ) from error
        digest = parsed.digest
        if digest is not None and not is_sha256_digest(digest):
            raise RegistryError(f"{text!r}: only sha256 digests are supported", reference=text)
        # ORAS fills in "latest" when no tag is written; with a digest that would be wrong.
        explicit_tag = ":" in text.rsplit("/", 1)[-1].split("@")[0]
        namespace = f"{parsed.namespace}/" if parsed.namespace else ""
        return cls(
            registry=parsed.registry,
            repository=f"{namespace}{parsed.repository}",
            tag=parsed.tag if explicit_tag or digest is None else None,
            digest=digest,
        )

    @property
    def target(self) -> str:
        """What the manifest URL names: the digest when given, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def is_sha256_digest(text: str) -> bool:
    hex_part = text.removeprefix("sha256:")
    return (
        text.startswith("sha256:")
        and len(hex_part) == 64
        and all(c in "0123456789abcdef" for c in hex_part)
    )


def docker_configs() -> list[str]:
    """The docker config files to read credentials from (``$DOCKER_CONFIG`` first)."""
    configured = os.environ.get("DOCKER_CONFIG")
    paths = [os.path.join(configured, "config.json")] if configured else []
    return [path for path in paths if os.path.exists(path)]


class RegistryClient:
    """Requests to one registry for one repository (thread-safe: transfers run in parallel)."""

    def __init__(self, reference: Reference, *, plain_http: bool = False) -> None:
        import oras.provider

        self.reference = reference
        self.scheme = "http" if plain_http else "https"
        self.plain_http = plain_http
        self._oras = oras.provider.Registry(hostname=reference.registry, insecure=plain_http)
        self.session: requests.Session = self._oras.session
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=32)
        self.session.mount(f"{self.scheme}://", adapter)
        self._auth_lock = threading.Lock()
        self._headers: dict[str, str] = {}
        self._credentials(self._oras.auth)

    def _credentials(self, backend: Any) -> None:
        """Give an ORAS auth backend this registry's credentials, if any are configured."""
        import oras.container

        username, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
        if bool(username) != bool(password):
            raise RegistryError(f"set both {USERNAME_ENV} and {PASSWORD_ENV}, or neither")
        container = oras.container.Container(
            f"{self.reference.registry}/{self.reference.repository}"
        )
        if username and password:
            backend.set_basic_auth(username, password)
        else:
            backend.load_configs(container, configs=docker_configs())

    def _backend_for(self, response: requests.Response) -> Any:
        """The ORAS backend that answers this challenge: bearer tokens (the default) or, for a
        registry that asks for Basic (htpasswd), the basic one with the same credentials."""
        import oras.auth

        challenge = response.headers.get("Www-Authenticate", "")
        if not challenge.lower().startswith("basic"):
            return self._oras.auth
        basic = oras.auth.get_auth_backend("basic", self.session, self.plain_http)
        self._credentials(basic)
        # ORAS keeps the credentials it found as ``_basic_auth``; without any, a Basic
        # challenge cannot be answered.
        if not getattr(basic, "_basic_auth", None):
            raise self.refuse(response, "a request without credentials")
        self._oras.auth = basic
        return basic

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.reference.registry}/v2/{self.reference.repository}"

    def _url(self, path: str) -> str:
        return f"{self.base}/{path}"

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        """One request, answering the registry's auth challenge once (through ORAS)."""
        headers: dict[str, str] = {**self._headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", TIMEOUT_S)
        try:
            response = self.session.request(method, url, headers=headers, **kwargs)
            if response.status_code in (401, 403) and "data" not in kwargs:
                with self._auth_lock:
                    new_headers, changed = self._backend_for(response).authenticate_request(
                        response, dict(headers)
                    )
                    if changed:
                        auth = new_headers.get("Authorization")
                        if auth:
                            self._headers["Authorization"] = auth
                if changed:
                    response.close()
                    response = self.session.request(
                        method, url, headers={**headers, **self._headers}, **kwargs
                    )
        except requests.exceptions.SSLError as error:
            raise RegistryError(
                f"TLS with {self.reference.registry} failed ({error.__class__.__name__}); for a "
                "registry without TLS pass --plain-http",
                reference=str(self.reference),
            ) from error
        except requests.RequestException as error:
            raise RegistryUnreachableError(
                f"cannot reach {self.reference.registry}: {error.__class__.__name__}: {error}",
                reference=str(self.reference),
            ) from error
        except ValueError as error:  # ORAS: a challenge it cannot answer
            raise RegistryError(
                f"{self.reference.registry} asks for credentials snapctl cannot give ({error}); "
                f"log in with docker login or set {USERNAME_ENV}/{PASSWORD_ENV}",
                reference=str(self.reference),
            ) from error
        return response

    def refuse(self, response: requests.Response, what: str) -> RegistryError:
        detail = ""
        try:
            errors = response.json().get("errors") or []
            if errors:
                detail = ": " + "; ".join(
                    f"{e.get('code', '?')} {e.get('message', '')}".strip() for e in errors[:3]
                )
        except ValueError:
            pass
        hint = ""
        if response.status_code in (401, 403):
            hint = f" (log in with docker login or set {USERNAME_ENV}/{PASSWORD_ENV})"
        return RegistryError(
            f"{self.reference.registry} answered {what} with HTTP {response.status_code}"
            f"{detail}{hint}",
            reference=str(self.reference),
        )

    # --- manifests ---------------------------------------------------------------------------

    def get_manifest(self, accept: str, max_bytes: int) -> bytes:
        found = self.find_manifest(self.reference.target, accept, max_bytes)
        if found is None:
            raise RegistryError(f"{self.reference} is not in the registry",
                                reference=str(self.reference))  # fmt: skip
        return found

    def find_manifest(self, target: str, accept: str, max_bytes: int) -> bytes | None:
        """The manifest at ``target`` (a tag or digest of this repository); None if absent."""
        return self._find(f"manifests/{target}", accept, max_bytes, f"the manifest {target}")

    def find_referrers(self, digest: str, artifact_type: str, max_bytes: int,
                       no_api: tuple[int, ...] = (404,)) -> bytes | None:  # fmt: skip
        """The OCI image index of the manifests whose subject is ``digest`` (the referrers
        API, filtered by ``artifact_type``); None where the registry has no such API (answers
        with a status in ``no_api``, as registries before OCI distribution 1.1 do)."""
        query = urllib.parse.urlencode({"artifactType": artifact_type})
        return self._find(f"referrers/{digest}?{query}", "application/vnd.oci.image.index.v1+json",
                          max_bytes, f"the referrers of {digest}", no_api)  # fmt: skip

    def _find(self, path: str, accept: str, max_bytes: int, what: str,
              absent: tuple[int, ...] = (404,)) -> bytes | None:  # fmt: skip
        response = self.request("GET", self._url(path), headers={"Accept": accept}, stream=True)
        with response:
            if response.status_code in absent:
                return None
            if response.status_code != 200:
                raise self.refuse(response, f"{what} of {self.reference}")
            return _read_bounded(response, max_bytes, f"{what} of {self.reference}")

    def put_manifest(self, target: str, media_type: str, body: bytes) -> Mapping[str, str]:
        """PUT a manifest at ``target`` (a tag or its digest); the response's headers (any
        case)."""
        response = self.request("PUT", self._url(f"manifests/{target}"), data=body,
                                headers={"Content-Type": media_type})  # fmt: skip
        with response:
            if response.status_code not in (200, 201):
                raise self.refuse(response, f"the manifest for {target}")
            return response.headers

    # --- blobs -------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        response = self.request("HEAD", self._url(f"blobs/{digest}"))
        with response:
            if response.status_code == 200:
                return True
            if response.status_code == 404:
                return False
            raise self.refuse(response, f"HEAD of blob {digest}")

    def upload_blob(self, digest: str, data: bytes) -> None:
        """Upload one blob: start an upload session, then one PUT with the digest."""
        # An empty POST authenticates first: a PUT with a body cannot answer a challenge.
        response = self.request("POST", self._url("blobs/uploads/"))
        with response:
            if response.status_code != 202:
                raise self.refuse(response, f"an upload of blob {digest}")
            location = response.headers.get("Location", "")
        if not location:
            raise RegistryError(f"{self.reference.registry} started an upload without a Location")
        url = urllib.parse.urljoin(f"{self.scheme}://{self.reference.registry}/", location)
        self.check_same_origin(url, "the upload Location")
        separator = "&" if "?" in url else "?"
        response = self.request(
            "PUT", f"{url}{separator}digest={urllib.parse.quote(digest)}", data=data,
            headers={"Content-Type": "application/octet-stream",
                     "Content-Length": str(len(data))},
        )  # fmt: skip
        with response:
            if response.status_code not in (201, 204):
                raise self.refuse(response, f"the upload of blob {digest}")

    def read_blob(self, digest: str, size: int, max_bytes: int, what: str,
                  outcome: str = "nothing was published") -> bytes:  # fmt: skip
        """A small blob read whole (at most ``max_bytes``), checked against its digest; a
        mismatch's message ends with ``outcome``."""
        if size > max_bytes:
            raise BlobMismatchError(f"{what} of {self.reference} exceeds {max_bytes} bytes")
        data = bytearray()
        for piece in self.blob_pieces(digest):
            data += piece
            if len(data) > size:
                break
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise BlobMismatchError(
                f"{what} of {self.reference} does not match its digest {digest} "
                f"(damaged in the registry or in transit): {outcome}"
            )
        return bytes(data)

    def check_same_origin(self, url: str, what: str) -> None:
        """Refuse a URL on another scheme or host: every request carries the registry's
        credentials, which must never reach another host or travel in the clear."""
        parts = urllib.parse.urlsplit(url)
        if (parts.scheme, parts.netloc) != (self.scheme, self.reference.registry):
            raise RegistryError(
                f"{self.reference.registry}: {what} points to {parts.scheme}://{parts.netloc}, "
                "not to the registry itself; snapctl sends its credentials only to the registry "
                "(check the registry's or its proxy's configuration)"
            )

    def blob_pieces(self, digest: str, offset: int = 0) -> Iterator[bytes]:
        """The blob's bytes from ``offset`` on, in pieces; a registry that ignores the range
        (answers 200 to a ranged request) is skipped forward to ``offset``."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        response = self.request("GET", self._url(f"blobs/{digest}"), headers=headers,
                                stream=True)  # fmt: skip
        with response:
            if response.status_code == 404:
                raise RegistryError(f"blob {digest} of {self.reference} is not in the registry",
                                    reference=str(self.reference))  # fmt: skip
            if response.status_code not in (200, 206):
                raise self.refuse(response, f"blob {digest}")
            skip = offset if response.status_code == 200 else 0
            try:
                for piece in response.iter_content(STREAM_PIECE):
                    if skip:
                        dropped = min(skip, len(piece))
                        piece, skip = piece[dropped:], skip - dropped
                    if piece:
                        yield piece
            except requests.RequestException as error:
                raise RegistryUnreachableError(
                    f"blob {digest}: the transfer broke off ({error.__class__.__name__}); "
                    "pull again to resume it", reference=str(self.reference),
                ) from error  # fmt: skip

    def close(self) -> None:
        self.session.close()


def _read_bounded(response: requests.Response, max_bytes: int, what: str) -> bytes:
    data = bytearray()
    try:
        for piece in response.iter_content(STREAM_PIECE):
            data += piece
            if len(data) > max_bytes:
                raise BlobMismatchError(f"{what} exceeds {max_bytes} bytes")
    except requests.RequestException as error:
        raise RegistryUnreachableError(
            f"{what}: the transfer broke off ({error.__class__.__name__})"
        ) from error
    return bytes(data)
