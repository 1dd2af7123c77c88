"""Which network dumps a restore may leave out: only those a fresh namespace already matches."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from snapctl.criu.lazy.netdumps import (
    IFADDR_MAGIC,
    ROUTE_MAGIC,
    RULE_MAGIC,
    joined_view,
    redundant_net_dumps,
)
from snapctl.criu.lazy.pagemap import lazy_view
from tests.criu.test_pagemap import varint

IFF_UP, IFF_LOOPBACK = 0x1, 0x8


def attribute(kind: int, value: bytes) -> bytes:
    raw = struct.pack("<HH", 4 + len(value), kind) + value
    return raw + b"\0" * (-len(raw) % 4)


def netlink(kind: int, body: bytes) -> bytes:
    return struct.pack("<IHHII", 16 + len(body), kind, 0, 1234, 99) + body


def address(family: int, text: str, prefixlen: int, index: int = 1) -> bytes:
    raw = socket.inet_pton(family, text)
    header = struct.pack("<BBBBI", family, prefixlen, 0x80, 254, index)
    cacheinfo = attribute(6, struct.pack("<IIII", 0xFFFFFFFF, 0xFFFFFFFF, 7, 7))
    return netlink(20, header + attribute(1, raw) + attribute(2, raw) + cacheinfo)


def rule(table: int, priority: int, *extra: bytes, action: int = 1) -> bytes:
    header = struct.pack("<BBBBBBBBI", socket.AF_INET, 0, 0, 0, table, 0, 0, action, 0)
    attributes = attribute(15, struct.pack("<I", table)) + attribute(14, struct.pack("<i", -1))
    attributes += attribute(21, b"\x02")
    if priority:
        attributes += attribute(6, struct.pack("<I", priority))
    return netlink(32, header + attributes + b"".join(extra))


def netdev(flags: int, ifindex: int = 1) -> bytes:
    # net_device_entry: type 1 (loopback), ifindex 2, mtu 3, flags 4, name 5, then a nested
    # conf message that must be skipped.
    body = varint(1 << 3) + varint(1) + varint(2 << 3) + varint(ifindex)
    body += varint(3 << 3) + varint(65536) + varint(4 << 3) + varint(flags)
    body += varint(5 << 3 | 2) + varint(2) + b"lo" + varint(9 << 3 | 2) + varint(2) + b"\x08\x01"
    return struct.pack("<II", 0x54564319, 0x57373951) + struct.pack("<I", len(body)) + body


DEFAULT_RULES = rule(255, 0) + rule(254, 32766) + rule(253, 32767)
LOOPBACK = address(socket.AF_INET, "127.0.0.1", 8) + address(socket.AF_INET6, "::1", 128)


def image(tmp_path: Path, **files: bytes) -> Path:
    """A directory of dumps as snapctl's sandbox leaves them, with ``files`` replaced."""
    dumps = {
        "netdev-10.img": netdev(IFF_UP | IFF_LOOPBACK),
        "ifaddr-10.img": struct.pack("<I", IFADDR_MAGIC) + LOOPBACK,
        "route-10.img": struct.pack("<I", ROUTE_MAGIC),
        "route6-10.img": struct.pack("<I", ROUTE_MAGIC),
        "rule-10.img": struct.pack("<I", RULE_MAGIC) + DEFAULT_RULES,
        "core-1.img": b"not a network dump",
    }
    dumps.update({name.replace("_", "-") + ".img": data for name, data in files.items()})
    directory = tmp_path / "criu"
    directory.mkdir()
    for name, data in dumps.items():
        (directory / name).write_bytes(data)
    return directory


ALL = {"ifaddr-10.img", "route-10.img", "route6-10.img", "rule-10.img"}


def test_a_sandbox_namespace_needs_none_of_its_ip_restores(tmp_path: Path) -> None:
    assert redundant_net_dumps(image(tmp_path)) == ALL


def routes(*messages: bytes) -> bytes:
    return struct.pack("<I", ROUTE_MAGIC) + b"".join(messages)


def rules(*messages: bytes) -> bytes:
    return struct.pack("<I", RULE_MAGIC) + b"".join(messages)


def addresses(*messages: bytes) -> bytes:
    return struct.pack("<I", IFADDR_MAGIC) + b"".join(messages)


A_ROUTE = netlink(24, b"\0" * 12)
FWMARK = attribute(10, b"\1\0\0\0")


@pytest.mark.parametrize(
    ("changes", "kept"),
    [
        # A route to restore.
        ({"route_10": routes(A_ROUTE)}, "route-10.img"),
        ({"route6_10": routes(A_ROUTE)}, "route6-10.img"),
        # Rules: one missing, one added, one that selects by fwmark, another action, none at
        # all (CRIU would flush the defaults), the defaults twice.
        ({"rule_10": rules(rule(255, 0), rule(254, 32766))}, "rule-10.img"),
        ({"rule_10": rules(DEFAULT_RULES, rule(100, 100))}, "rule-10.img"),
        (
            {"rule_10": rules(rule(255, 0, FWMARK), rule(254, 32766), rule(253, 32767))},
            "rule-10.img",
        ),
        (
            {"rule_10": rules(rule(255, 0, action=6), rule(254, 32766), rule(253, 32767))},
            "rule-10.img",
        ),
        ({"rule_10": rules()}, "rule-10.img"),
        ({"rule_10": rules(DEFAULT_RULES, DEFAULT_RULES)}, "rule-10.img"),
        # Addresses: an extra one on lo, one on another link, a lo that comes back down (the
        # kernel then adds nothing).
        (
            {"ifaddr_10": addresses(LOOPBACK, address(socket.AF_INET, "10.77.1.2", 32))},
            "ifaddr-10.img",
        ),
        (
            {"ifaddr_10": addresses(address(socket.AF_INET, "127.0.0.1", 8, index=2))},
            "ifaddr-10.img",
        ),
        ({"netdev_10": netdev(IFF_LOOPBACK)}, "ifaddr-10.img"),
        # Unknown formats: another magic, truncated messages.
        ({"route_10": rules()}, "route-10.img"),
        ({"rule_10": rules(DEFAULT_RULES[:-3])}, "rule-10.img"),
        ({"netdev_10": netdev(IFF_UP)[:-3]}, "ifaddr-10.img"),
    ],
)
def test_a_dump_that_restores_something_is_kept(
    tmp_path: Path, changes: dict[str, bytes], kept: str
) -> None:
    assert redundant_net_dumps(image(tmp_path, **changes)) == ALL - {kept}


def test_no_netdev_image_keeps_the_addresses(tmp_path: Path) -> None:
    directory = image(tmp_path)
    (directory / "netdev-10.img").unlink()
    assert redundant_net_dumps(directory) == ALL - {"ifaddr-10.img"}


def test_the_lazy_view_leaves_out_what_it_is_told(tmp_path: Path) -> None:
    directory = image(tmp_path)
    lazy_view(directory, tmp_path / "view", omit=redundant_net_dumps(directory))
    assert sorted(p.name for p in (tmp_path / "view").iterdir()) == ["core-1.img", "netdev-10.img"]


def test_a_joined_view_leaves_out_every_dump_of_the_namespaces_own_state(tmp_path: Path) -> None:
    directory = image(tmp_path)
    state = ["iptables-10.img", "ip6tables-10.img", "nftables-10.img", "netns-10.img",
             "netns-ct-10.img", "netns-exp-10.img", "route6-10.img"]  # fmt: skip
    sockets = ["inetsk.img", "netlinksk.img", "unixsk.img", "netns-10-extra.img"]
    for name in [*state, *sockets]:
        (directory / name).write_bytes(b"x")
    left_out = joined_view(directory, tmp_path / "view")
    assert left_out == ALL | {"netdev-10.img", *state}
    seen = sorted(p.name for p in (tmp_path / "view").iterdir())
    assert seen == sorted(["core-1.img", *sockets])
    # Each a link to the image's file, not a copy of it.
    assert (tmp_path / "view" / "inetsk.img").resolve() == (directory / "inetsk.img").resolve()
    assert (tmp_path / "view" / "inetsk.img").is_symlink()
