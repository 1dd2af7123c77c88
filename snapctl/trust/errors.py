"""The errors of signing and of the trust policy (their place in the tree: snapctl.errors)."""

from __future__ import annotations

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase
from snapctl.trust.verdict import Verdict


class SigningKeyError(SnapctlError):
    """A key file is unreadable, not in cosign's format, not ECDSA P-256 where a signing key
    must be, or its passphrase is wrong."""

    exit_status = ExitStatus.USAGE


class KeyExistsError(SigningKeyError):
    """``image keygen`` would overwrite a key file."""

    exit_status = ExitStatus.CONFLICT


class PolicyFormatError(SnapctlError):
    """A trust policy file cannot be read, or is not containers-policy.json(5)."""

    exit_status = ExitStatus.USAGE


class PolicyRefusedError(SnapctlError):
    """The trust policy refused an image; ``verdict`` names the rule that refused and why."""

    exit_status = ExitStatus.VERIFY_FAILED

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"{verdict.reference}: {verdict.line()}", phase=HostPhase.REGISTRY)
        self.verdict = verdict


class SignatureStoreError(SnapctlError):
    """An image to sign is not in the registry, or its signature manifest (the ``.sig`` tag)
    is not in cosign's layout."""

    def __init__(self, message: str) -> None:
        super().__init__(message, phase=HostPhase.REGISTRY)
