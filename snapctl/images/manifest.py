"""The image manifest: a strict, schema-versioned record of what was captured and how."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from snapctl.criu.stats import DumpStats
from snapctl.protocol.models import Oracle

MANIFEST_NAME = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileEntry(_Strict):
    """One file of the image: size, sha256 and inode group (hard links share a group)."""

    size: int
    sha256: str
    link_group: int | None = None


class ProcessEntry(_Strict):
    """One process of the captured tree (PIDs as seen on the host at capture time)."""

    pid: int
    ppid: int
    name: str
    threads: int
    cmdline: list[str]


class Manifest(_Strict):
    """``manifest.json``: its presence in a published image directory means complete."""

    schema_version: Literal[1] = 1
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

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())
