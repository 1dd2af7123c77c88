"""Test factories for images: ``make_identity``, ``make_manifest`` and a small published image."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from snapctl.criu.stats import DumpStats
from snapctl.images import ImageStaging, Manifest, hash_tree
from snapctl.images.identity.host import hashed_env
from snapctl.images.identity.models import FileRecord, Identity
from snapctl.protocol.models import Oracle

SALT = "5a17" * 8


def make_identity(**changes: Any) -> Identity:
    fields: dict[str, Any] = dict(
        kernel="6.18.0", kernel_features=["mnt_ns", "net_ns", "pid_ns"], criu_version="4.2.1",
        cpu_vendor="AuthenticAMD", cpu_model="EPYC",
        cpu_flags=["avx", "avx2", "sse4_2"], host_id="ab" * 16, hostname="h",
        python_version="3.11.7", argv=["srv", "--api-key", "***"], env_salt=SALT,
        env=hashed_env({"PATH": "/usr/bin", "HF_TOKEN": "hf_secret_value"}, SALT),
        files=[FileRecord(path="/usr/lib/libx.so", size=3, sha256="0" * 64)],
    )  # fmt: skip
    fields.update(changes)
    return Identity.model_validate(fields)


def make_manifest(files: dict[str, Any], **changes: Any) -> Manifest:
    fields: dict[str, Any] = dict(
        image_id="0" * 32, capture_id="1" * 32, created="2026-11-30T00:00:00+00:00",
        snapctl_version="0.1.0", criu_version="4.2.1", kernel="6.18", hostname="h",
        python_version="3.11.7", server_argv=["srv", "--api-key", "***"], server_cwd="/",
        oracle=Oracle(token_ids=[1], text="a", sampled_token_logprob=-0.5), root_pid=10,
        process_tree=[], dump_stats=DumpStats(), dump_seconds=0.1, native_step="none",
        external_mounts={"shm": "/dev/shm"}, lo_addresses=[], host="127.0.0.1", port=8000,
        shm_files=[], files=files, identity=make_identity(),
    )  # fmt: skip
    fields.update(changes)
    return Manifest.model_validate(fields)


def publish_sample(final: Path, *, force: bool = False, **changes: Any) -> Manifest:
    """A small image: a CRIU-like page file, a nested dir, and a hard-linked shm pair."""
    staging = ImageStaging(final, force=force)
    (staging.dir / "criu" / "pages-1.img").write_bytes(os.urandom(300_000))
    (staging.dir / "criu" / "core-1.img").write_bytes(b"core" * 100)
    (staging.dir / "shm" / "sem.x").write_bytes(b"semaphore")
    os.chmod(staging.dir / "shm" / "sem.x", 0o640)
    os.link(staging.dir / "shm" / "sem.x", staging.dir / "shm" / "link_remap.7")
    (staging.dir / "shm" / "sub").mkdir()
    os.chmod(staging.dir / "shm" / "sub", 0o1777)
    (staging.dir / "shm" / "sub" / "f").write_bytes(b"nested")
    (staging.dir / "logs" / "dump.log").write_text("dump log\n")
    manifest = make_manifest(hash_tree(staging.dir), **changes)
    staging.publish(manifest)
    return manifest
