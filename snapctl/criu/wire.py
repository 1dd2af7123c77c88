"""The one piece of protobuf's wire format that reading CRIU's images here needs: varints.

CRIU's stats and pagemap images hold small proto2 messages with (almost) only varint fields, so
:mod:`snapctl.criu.stats` and :mod:`snapctl.criu.lazy.pagemap` walk them by hand, with no protobuf
runtime or generated code; both decode their varints here.
"""

from __future__ import annotations


def read_varint(data: bytes, at: int, end: int | None = None) -> tuple[int, int]:
    """The varint at ``data[at]`` and the offset after it; ValueError if it runs past ``end``
    (the end of ``data`` when None)."""
    stop = len(data) if end is None else end
    value = shift = 0
    while at < stop:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise ValueError("truncated varint")
