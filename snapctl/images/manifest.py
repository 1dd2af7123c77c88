"""The image manifest: a strict, schema-versioned record of what was captured and how.

Schema 2 adds ``identity`` (what a restore depends on outside the image, see
:mod:`snapctl.images.identity`); schema-1 manifests still load, without it.
"""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import model_validator

from snapctl.criu.stats import DumpStats
from snapctl.images.identity.models import Identity
from snapctl.models import StrictModel
from snapctl.namespaces.devices import SandboxDev
from snapctl.protocol.facts import CaptureFacts
from snapctl.protocol.models import Oracle

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION: Literal[2] = 2


def is_safe_relative(name: str) -> bool:
    """True for a canonical relative path that stays inside its directory (``a/b``, not
    ``/a``, ``../a``, ``a/../b``, ``./a``, ``a//b`` or ``a/``)."""
    return (
        bool(name)
        and not name.startswith("/")
        and "\0" not in name
        and posixpath.normpath(name) == name
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


class FileEntry(StrictModel):
    """One file of the image: size, sha256 and inode group (hard links share a group)."""

    size: int
    sha256: str
    link_group: int | None = None


class ProcessEntry(StrictModel):
    """One process of the captured tree (PIDs as seen on the host at capture time)."""

    pid: int
    ppid: int
    name: str
    threads: int
    cmdline: list[str]


class Manifest(StrictModel):
    """``manifest.json``: its presence in a published image directory means complete."""

    schema_version: Literal[1, 2] = SCHEMA_VERSION
    image_id: str
    capture_id: str
    created: str
    snapctl_version: str
    criu_version: str
    kernel: str
    hostname: str
    python_version: str
    server_argv: list[str]
    server_cwd: str
    oracle: Oracle
    root_pid: int
    process_tree: list[ProcessEntry]
    dump_stats: DumpStats
    dump_seconds: float
    native_step: str
    external_mounts: dict[str, str]
    lo_addresses: list[str]
    host: str | None
    port: int
    shm_files: list[str]
    files: dict[str, FileEntry]
    identity: Identity | None = None
    # What the server stated about its capture (memory policy, the first load's digests);
    # None where it stated nothing (a server that does not know snapctl's facts file).
    capture_facts: CaptureFacts | None = None
    # The names (never the values) of the environment the server was launched with, which its
    # memory, and so the image, holds; None in images captured before they were recorded.
    server_env_names: list[str] | None = None
    # How the sandbox had its /dev: "host" in images captured before it built its own, whose
    # mount tree only restores where /dev is a devtmpfs (see namespaces.devices).
    sandbox_dev: SandboxDev = "host"

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        if self.schema_version >= 2 and self.identity is None:
            raise ValueError("a schema-2 manifest must record the identity")
        if self.schema_version == 1 and self.identity is not None:
            raise ValueError("a schema-1 manifest has no identity")
        for name in self.files:
            if not is_safe_relative(name) or name == MANIFEST_NAME:
                raise ValueError(f"file name {name!r} is not a plain path inside the image")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())
