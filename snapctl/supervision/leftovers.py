"""What a killed snapctl leaves behind outside its activations, and how ``gc`` finds it.

A staging directory beside an image (``.NAME.staging-*``, up to an image's size) and an old
image moved aside while it is replaced (``.NAME.replaced-*``) live wherever the image goes, so
whoever creates them first writes a claim into the state directory naming them and itself
(pid and start time); the claim goes when they are published or removed. ``gc`` removes
what a claim names once its owner is gone, and the claim with it. A record's ``.tmp`` (a
writer killed between create and rename) is removed once no live process holds the name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from pydantic import ValidationError

from snapctl.models import StrictModel
from snapctl.protocol.atomic import TMP_SUFFIX, write_json_atomic
from snapctl.statedir.names import LOCK_SUFFIX, NAME_PATTERN, lock_name
from snapctl.supervision.process import is_same_process, start_time

# Only what these name patterns match is ever removed on a claim's word.
LEFTOVER_NAME = re.compile(r"\..+\.(staging|replaced)-[0-9a-f]{8}", re.DOTALL)
# A .tmp younger than this may be a write in progress (a write takes microseconds).
TMP_GRACE_S = 60.0


class Claim(StrictModel):
    """``claims/ID.json``: directories that only ``owner_pid`` (started then) may use."""

    schema_version: int = 1
    paths: list[str]
    owner_pid: int
    owner_start_time: float


class ClaimHandle:
    """A claim this process wrote; ``release`` (idempotent) drops it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def claim(claims_dir: Path, paths: list[Path]) -> ClaimHandle:
    """Claim ``paths`` (absolute, not yet created) for this process, before creating them."""
    for path in paths:
        if not path.is_absolute() or not LEFTOVER_NAME.fullmatch(path.name):
            raise ValueError(f"not a claimable leftover path: {path}")
    claims_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    me = os.getpid()
    record = Claim(paths=[str(p) for p in paths], owner_pid=me, owner_start_time=start_time(me))
    handle = ClaimHandle(claims_dir / f"{uuid.uuid4().hex}.json")
    write_json_atomic(handle.path, record)
    return handle


def _stale_tmp(path: Path) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > TMP_GRACE_S
    except FileNotFoundError:
        return False


def sweep_claims(claims_dir: Path) -> list[str]:
    """Remove what every claim of a process that is gone names, then the claim; return the
    paths removed (claims themselves not counted)."""
    removed: list[str] = []
    if not claims_dir.is_dir():
        return removed
    for path in sorted(claims_dir.iterdir()):
        if path.name.endswith(TMP_SUFFIX):
            if _stale_tmp(path):
                path.unlink(missing_ok=True)
            continue
        try:
            record = Claim.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            if _stale_tmp(path):
                path.unlink(missing_ok=True)  # torn beyond use: it can vouch for nothing
            continue
        if is_same_process(record.owner_pid, record.owner_start_time):
            continue
        for claimed in map(Path, record.paths):
            if LEFTOVER_NAME.fullmatch(claimed.name) and os.path.lexists(claimed):
                shutil.rmtree(claimed, ignore_errors=True)
                if not os.path.lexists(claimed):
                    removed.append(str(claimed))
        path.unlink(missing_ok=True)
    return removed


def sweep_records(records: Path) -> list[str]:
    """Remove ``NAME.json.tmp`` files (and name locks) whose name no live process holds;
    return the ``.tmp`` files removed."""
    removed: list[str] = []
    if not records.is_dir():
        return removed
    for path in sorted(records.iterdir()):
        if path.name.endswith(TMP_SUFFIX):
            name = path.name.removesuffix(".json" + TMP_SUFFIX)
        elif path.name.endswith(LOCK_SUFFIX):
            name = path.name.removesuffix(LOCK_SUFFIX)
        else:
            continue
        if not NAME_PATTERN.fullmatch(name):
            continue  # not a name snapctl could have written: not ours to judge
        held = lock_name(records, name)
        if held is None:
            continue  # its writer is alive (it holds the name)
        try:
            if path.name.endswith(TMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(str(path))
        finally:
            held.release()  # unlinks the lock file too: no one held it
    return removed
