"""CRIU's own timings from ``stats-dump`` / ``stats-restore`` (protobuf ``StatsEntry``).

The image is CRIU's service image format: two 32-bit magics, then one entry framed by a 32-bit
little-endian length. The entry is the small proto2 message from CRIU's ``images/stats.proto``;
only varint fields occur in it, so a minimal wire-format walk suffices and no protobuf runtime
or generated code is needed.
"""

from __future__ import annotations

import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.criu.wire import read_varint
from snapctl.errors import SnapctlError

_DUMP_FIELD, _RESTORE_FIELD = 1, 2
_DUMP_NAMES = {
    1: "freezing_time_us",
    2: "frozen_time_us",
    3: "memdump_time_us",
    4: "memwrite_time_us",
    5: "pages_scanned",
    6: "pages_skipped_parent",
    7: "pages_written",
    8: "irmap_resolve_us",
    9: "pages_lazy",
}
_RESTORE_NAMES = {
    1: "pages_compared",
    2: "pages_skipped_cow",
    3: "forking_time_us",
    4: "restore_time_us",
    5: "pages_restored",
}


class DumpStats(BaseModel):
    """CRIU's dump statistics (times in microseconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    freezing_time_us: int = 0
    frozen_time_us: int = 0
    memdump_time_us: int = 0
    memwrite_time_us: int = 0
    pages_scanned: int = 0
    pages_skipped_parent: int = 0
    pages_written: int = 0
    irmap_resolve_us: int = 0
    pages_lazy: int = 0


class RestoreStats(BaseModel):
    """CRIU's restore statistics (times in microseconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pages_compared: int = 0
    pages_skipped_cow: int = 0
    forking_time_us: int = 0
    restore_time_us: int = 0
    pages_restored: int = 0


class StatsFormatError(SnapctlError):
    """A CRIU stats image could not be decoded."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    try:
        return read_varint(data, pos)
    except ValueError as error:
        raise StatsFormatError(f"{error} in CRIU stats image") from error


def _fields(data: bytes) -> dict[int, int | bytes]:
    fields: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            fields[number], pos = _varint(data, pos)
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            fields[number] = data[pos : pos + length]
            pos += length
        else:
            raise StatsFormatError(f"unexpected protobuf wire type {wire_type} in stats image")
    return fields


def _entry(path: Path, which: int) -> dict[str, int]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise StatsFormatError(f"cannot read {path}: {error.strerror}", path=str(path)) from error
    if len(raw) < 12:
        raise StatsFormatError(f"{path} is too short for a CRIU stats image", path=str(path))
    (length,) = struct.unpack_from("<I", raw, 8)
    outer = _fields(raw[12 : 12 + length])
    inner = outer.get(which)
    if not isinstance(inner, bytes):
        raise StatsFormatError(f"{path} holds no {'dump' if which == 1 else 'restore'} stats")
    names = _DUMP_NAMES if which == _DUMP_FIELD else _RESTORE_NAMES
    return {names[k]: v for k, v in _fields(inner).items() if k in names and isinstance(v, int)}


def read_dump_stats(images_dir: Path) -> DumpStats:
    """Decode ``stats-dump`` in an images (or work) directory."""
    return DumpStats(**_entry(images_dir / "stats-dump", _DUMP_FIELD))


def read_restore_stats(work_dir: Path) -> RestoreStats:
    """Decode ``stats-restore`` (written to the work dir when ``-W`` is used)."""
    return RestoreStats(**_entry(work_dir / "stats-restore", _RESTORE_FIELD))
