"""The one piece of protobuf's wire format that CRIU's images here need: varints.

CRIU's stats and pagemap images hold small proto2 messages with (almost) only varint fields, so
:mod:`snapctl.criu.stats` and :mod:`snapctl.criu.lazy` walk them by hand, with no protobuf
runtime or generated code; they decode their varints here, and the pagemap rewriter encodes
them here too.
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


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def encode_varint(value: int) -> bytes:
    """``value`` (not negative) as a varint."""
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
