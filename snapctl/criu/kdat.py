"""CRIU's kernel probe cache on hosts whose /run is not a tmpfs.

Every CRIU process starts by probing the kernel (``kerndat``: it creates network namespaces,
forks ptrace tests, reads /proc), which takes longer when two CRIU processes probe at once,
as a lazy copy's daemon and restore do (figures in docs/criu.md). CRIU keeps the result in
``/run/criu.kdat``, but only when /run is a tmpfs: a file that outlived a reboot could describe
another kernel. Where /run is not a tmpfs (some VMs and containers) every restore pays again.

There snapctl keeps the cache itself and gives CRIU a /run of its own:

- **The cache** is ``criu.kdat`` in a directory of snapctl's state, made by running ``criu
  check`` once with a private tmpfs /run and copying out what CRIU saved there. Beside it,
  ``criu.kdat.json`` (:class:`KdatRecord`) says for which boot (``boot_id``), kernel and CRIU
  binary it was made, and its sha256: any difference and it is made again, so it never outlives
  the boot or the CRIU it describes, just like CRIU's own.
- **The restore** runs as ``unshare --mount --propagation slave -- sh -c 'mount a 1 MiB tmpfs
  on /run, copy the cache into it, exec criu ...'``: CRIU finds its cache, sees every mount the
  host has or makes (slave propagation), and the host sees nothing of its /run. The restored
  tree is unaffected: its root is a plain bind of / and its /run its own tmpfs from the image.
  The wrapper (three small programs) costs far less than the probe it saves (docs/criu.md).
  If the tmpfs cannot be mounted, CRIU runs as before, probing.

Only restores and lazy-pages daemons, where a copy waits, run this way; dumps probe before they
freeze the tree, so the probe does not lengthen the pause.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pydantic import ValidationError

from snapctl.criu.locate import CriuBinary
from snapctl.models import StrictModel
from snapctl.namespaces import mounts

KDAT = "criu.kdat"
RECORD = "criu.kdat.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# sh -c SCRIPT snapctl-criu-run CACHE CRIU_ARGV...: $1 is the cache, the rest is CRIU's argv.
PRIVATE_RUN_SCRIPT = (
    'mount -t tmpfs -o size=1m,mode=0755 snapctl-criu-run /run && cp "$1" /run/criu.kdat; '
    'shift; exec "$@"'
)
MAKE_SCRIPT = (
    "mount -t tmpfs -o size=1m,mode=0755 snapctl-criu-run /run || exit 1; "
    '"$@" check >/dev/null 2>&1; cp /run/criu.kdat "$0"'
)
MAKE_TIMEOUT_S = 60.0


class KdatKey(StrictModel):
    """What a kdat cache describes: this boot, this kernel, this CRIU binary."""

    boot_id: str
    kernel: str
    criu: list[str]  # the argv that runs it
    criu_version: str
    criu_size: int
    criu_mtime_ns: int


class KdatRecord(StrictModel):
    """``criu.kdat.json``: the key a cache was made for, and its content's sha256."""

    key: KdatKey
    sha256: str


def run_is_tmpfs() -> bool:
    """Whether /run is a tmpfs (then CRIU keeps its own cache and nothing here is needed)."""
    return mounts.mount_type(Path("/proc/self/mounts").read_text(), "/run") == "tmpfs"


def current_key(criu: CriuBinary) -> KdatKey:
    program = Path(criu.argv[-1])
    stat = program.stat()
    return KdatKey(
        boot_id=BOOT_ID.read_text().strip(),
        kernel=os.uname().release,
        criu=list(criu.argv),
        criu_version=criu.version,
        criu_size=stat.st_size,
        criu_mtime_ns=stat.st_mtime_ns,
    )


def cached_kdat(criu: CriuBinary, cache_dir: Path) -> Path | None:
    """The kdat cache for this boot, kernel and CRIU, made now if there is none (one ``criu
    check``); None if it cannot be made."""
    try:
        key = current_key(criu)
    except OSError:
        return None
    kdat = cache_dir / KDAT
    try:
        record = KdatRecord.model_validate_json((cache_dir / RECORD).read_bytes())
        if record.key == key and _sha256(kdat) == record.sha256:
            return kdat
    except (OSError, ValidationError):
        pass
    return _make(criu, key, cache_dir)


def _private_run(script: str) -> tuple[str, ...] | None:
    """The argv prefix that runs ``sh -c script`` in a mount namespace of its own (None
    without ``unshare``); the script's arguments follow it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    return (unshare, "--mount", "--propagation", "slave", "--", "/bin/sh", "-c", script)


def _make(criu: CriuBinary, key: KdatKey, cache_dir: Path) -> Path | None:
    make = _private_run(MAKE_SCRIPT)
    if make is None:
        return None
    cache_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".make-") as scratch:
        made = Path(scratch) / KDAT
        try:
            subprocess.run(
                [*make, str(made), *criu.argv],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                timeout=MAKE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        if not made.is_file() or made.stat().st_size == 0:
            return None
        record = KdatRecord(key=key, sha256=_sha256(made))
        (Path(scratch) / RECORD).write_text(record.model_dump_json())  # in a 0700 directory
        # Cache first, record second: a reader that sees the new record sees its cache too.
        os.replace(made, cache_dir / KDAT)
        os.replace(Path(scratch) / RECORD, cache_dir / RECORD)
    return cache_dir / KDAT


def with_private_run(criu: CriuBinary, cache_dir: Path) -> CriuBinary:
    """``criu``, run with a private /run holding its kdat cache where /run is not a tmpfs (see
    the module's docstring); ``criu`` itself where that is not needed or not possible."""
    if run_is_tmpfs():
        return criu
    wrapper = _private_run(PRIVATE_RUN_SCRIPT)
    kdat = cached_kdat(criu, cache_dir) if wrapper is not None else None
    if wrapper is None or kdat is None:
        return criu
    command = (*wrapper, "snapctl-criu-run", str(kdat), *criu.argv)
    return dataclasses.replace(criu, command=command)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
