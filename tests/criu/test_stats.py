"""Decoding CRIU's stats-dump / stats-restore images, built byte by byte in the test."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from snapctl.criu import DumpStats, RestoreStats, read_dump_stats, read_restore_stats
from snapctl.criu.stats import StatsFormatError

# IMG_SERVICE_MAGIC and STATS_MAGIC from CRIU's criu/include/magic.h (the decoder skips them).
MAGICS = struct.pack("<II", 0x55105940, 0x57093306)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3 | 0) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def stats_image(entry: bytes) -> bytes:
    """CRIU's service image framing: two magics, a 32-bit LE length, the StatsEntry."""
    return MAGICS + struct.pack("<I", len(entry)) + entry


def test_varint_helper_matches_the_protobuf_examples() -> None:
    assert varint(1) == b"\x01" and varint(150) == b"\x96\x01" and varint(300) == b"\xac\x02"


def test_dump_stats_are_decoded(tmp_path: Path) -> None:
    dump_entry = b"".join(
        [
            field_varint(1, 1_234),  # freezing_time
            field_varint(2, 44_000),  # frozen_time
            field_varint(3, 5_000),  # memdump_time
            field_varint(4, 300_000),  # memwrite_time: a multi-byte varint
            field_varint(5, 2_200),  # pages_scanned
            field_varint(6, 0),  # pages_skipped_parent
            field_varint(7, 2_175),  # pages_written
            field_varint(9, 17),  # pages_lazy
            field_varint(15, 99),  # a field from a newer CRIU: ignored
        ]
    )
    (tmp_path / "stats-dump").write_bytes(stats_image(field_bytes(1, dump_entry)))

    stats = read_dump_stats(tmp_path)

    assert stats == DumpStats(
        freezing_time_us=1_234,
        frozen_time_us=44_000,
        memdump_time_us=5_000,
        memwrite_time_us=300_000,
        pages_scanned=2_200,
        pages_written=2_175,
        pages_lazy=17,
    )


def test_restore_stats_are_decoded(tmp_path: Path) -> None:
    restore_entry = field_varint(3, 70_000) + field_varint(4, 180_000) + field_varint(5, 4_096)
    (tmp_path / "stats-restore").write_bytes(stats_image(field_bytes(2, restore_entry)))

    stats = read_restore_stats(tmp_path)

    assert stats == RestoreStats(
        forking_time_us=70_000, restore_time_us=180_000, pages_restored=4_096
    )


def test_missing_entry_is_an_error(tmp_path: Path) -> None:
    dump_only = field_bytes(1, field_varint(2, 1))
    (tmp_path / "stats-restore").write_bytes(stats_image(dump_only))

    with pytest.raises(StatsFormatError, match="no restore stats"):
        read_restore_stats(tmp_path)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StatsFormatError, match=r"cannot read .*stats-restore") as info:
        read_restore_stats(tmp_path)
    assert info.value.path == tmp_path / "stats-restore"


def test_short_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "stats-dump").write_bytes(MAGICS)

    with pytest.raises(StatsFormatError, match="too short"):
        read_dump_stats(tmp_path)


def test_truncated_varint_is_an_error(tmp_path: Path) -> None:
    truncated = field_bytes(1, field_varint(2, 300_000)[:-1])
    (tmp_path / "stats-dump").write_bytes(stats_image(truncated))

    with pytest.raises(StatsFormatError, match="truncated varint"):
        read_dump_stats(tmp_path)


def test_unexpected_wire_type_is_an_error(tmp_path: Path) -> None:
    fixed64 = varint(1 << 3 | 1) + bytes(8)
    (tmp_path / "stats-dump").write_bytes(stats_image(fixed64))

    with pytest.raises(StatsFormatError, match="wire type 1"):
        read_dump_stats(tmp_path)
