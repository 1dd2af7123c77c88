"""What a trust policy decided for one image: :class:`Verdict`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """The policy's decision for ``reference`` at ``manifest_digest``.

    ``scope`` names the rule that applied as the policy file spells it (``default``, or
    ``transports.docker["SCOPE"]``, ``""`` being the transport's own default), ``requirement``
    the requirement type that decided (on acceptance, every requirement of the rule, joined by
    ``+``), ``detail`` why, in words. ``policy`` is the file read, or why none was
    (``note``).
    """

    accepted: bool
    reference: str
    manifest_digest: str
    scope: str
    requirement: str
    detail: str
    policy: str
    note: str | None = None

    def line(self) -> str:
        """One line for a person: what applied and what it decided."""
        outcome = "accepted" if self.accepted else "refused"
        return (f"{outcome} by {self.scope} ({self.requirement}) of {self.policy}: "
                f"{self.detail}")  # fmt: skip

    def record(self) -> dict[str, object]:
        """The verdict as a ``--json`` record."""
        return {
            "accepted": self.accepted, "reference": self.reference,
            "manifest_digest": self.manifest_digest, "scope": self.scope,
            "requirement": self.requirement, "detail": self.detail, "policy": self.policy,
            "note": self.note,
        }  # fmt: skip
