"""The identity record a manifest carries: what a restore depends on outside the image, and one
way a host differs from it (see :mod:`snapctl.images.identity`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from snapctl.models import StrictModel


class FileRecord(StrictModel):
    """One file outside the image that the captured tree had mapped or open."""

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Identity(StrictModel):
    """Everything outside the image a restore depends on (see the module docstring)."""

    version: Literal[1] = 1
    kernel: str
    # None in images captured before features were recorded: not compared.
    kernel_features: list[str] | None = None
    criu_version: str
    cpu_vendor: str
    cpu_model: str  # shown, not compared: flags decide what restored code can execute
    cpu_flags: list[str]
    host_id: str  # shown, never refuses: a fleet restores on other machines
    hostname: str  # shown, never refuses
    python_version: str
    argv: list[str]
    env_salt: str
    # name -> sha256(salt, name, value): the server's environment at capture, shown; the
    # restorer's differing from it never refuses (the restored tree keeps this one).
    env: dict[str, str]
    files: list[FileRecord]


class Difference(StrictModel):
    """One way this host differs from the recorded identity (never a secret value).

    ``refuses``: the copy is refused unless ``waivable`` and waived; otherwise only shown.
    """

    field: str
    detail: str
    waivable: bool
    refuses: bool = True
