"""Which of an image's network dumps a restore may leave out: those that only hold what a fresh
network namespace with its loopback up has anyway.

CRIU restores a namespace's addresses, routes and rules by feeding the dumps it took with
``ip addr|route|rule save`` (``ifaddr-N.img``, ``route-N.img``, ``route6-N.img``,
``rule-N.img``) to ``ip ... restore``: six ``ip`` runs (the rules take three), a noticeable
part of a lazy copy's restore (docs/lazy.md, step 2). In a server's namespace as snapctl lays it
out (only ``lo``, up) they say nothing new: no route of the main tables, the kernel's three
default IPv4 rules (which CRIU flushes and restores as they were), and the addresses the kernel
puts on ``lo`` itself when it comes up (restoring them fails with "address already assigned").
CRIU treats a missing dump as empty and runs no ``ip`` for it, so a restore view
(:func:`snapctl.criu.lazy.pagemap.lazy_view`) leaves such dumps out. Anything else (another address,
a route, another rule, a format this module does not know) keeps its dump, restored as usual.

The dumps are iproute2's: a 32-bit magic, then netlink messages (``nlmsghdr``, the family's
fixed header, ``rtattr`` attributes). pyroute2 decodes these too, but importing it costs far
more than the ``ip`` runs it would save (docs/lazy.md, step 2); the few fixed fields needed are
read here.
``netdev-N.img`` (CRIU's own format, a proto2 ``net_device_entry`` per link) tells whether
``lo`` comes back up, without which the kernel adds no address to it.

A restore that joins a network namespace that exists (a container's, ``criu restore --join-ns``)
leaves out every dump of the namespace's own state (:func:`joined_view`): CRIU restores whatever
of those it finds into the namespace it joins, so the container's firewall rules, sysctls and
link settings would become the donor's.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

from snapctl.criu.lazy.pagemap import link_relative, relative_dir_of
from snapctl.criu.wire import read_varint

# iproute2's dump magics (ip/ipaddress.c, ip/iproute.c, ip/iprule.c).
IFADDR_MAGIC, ROUTE_MAGIC, RULE_MAGIC = 0x47361222, 0x45311224, 0x71706986
# CRIU's image magics for netdev-N.img: IMG_COMMON_MAGIC, NETDEV_MAGIC.
_NETDEV_MAGICS = (0x54564319, 0x57373951)
_NLMSG_HEADER = struct.Struct("<IHHII")  # len, type, flags, seq, pid
_RTATTR_HEADER = struct.Struct("<HH")  # len, type
_IFADDRMSG = struct.Struct("<BBBBI")  # family, prefixlen, flags, scope, index
# family, dst_len, src_len, tos, table, two reserved bytes, action, flags
_FIB_RULE_HDR = struct.Struct("<BBBBBBBBI")
RTM_NEWADDR, RTM_NEWRULE = 20, 32
IFA_ADDRESS, IFA_LOCAL = 1, 2
FRA_PRIORITY, FRA_SUPPRESS_PREFIXLEN, FRA_TABLE, FRA_PROTOCOL = 6, 14, 15, 21
FR_ACT_TO_TBL, RTPROT_KERNEL, IFF_UP, ND_TYPE_LOOPBACK = 1, 2, 0x1, 1
# What a fresh namespace has by itself: on an up lo, 127.0.0.1/8 and ::1/128 (the kernel adds
# them when lo comes up), and the IPv4 rules "from all lookup local|main|default" at priorities
# 0, 32766 and 32767 (fib4_rules_init), as (table, priority).
LOOPBACK_ADDRESSES = frozenset({(socket.AF_INET, "127.0.0.1", 8), (socket.AF_INET6, "::1", 128)})
DEFAULT_RULES = frozenset({(255, 0), (254, 32766), (253, 32767)})
_DUMP_NAME = re.compile(r"(ifaddr|route|route6|rule)-(\d+)\.img")
# Every dump of a network namespace's own state: links, addresses, routes, rules, firewall
# (iptables-save's, ip6tables-save's, nft's), sysctls, conntrack and expectation tables.
_NAMESPACE_DUMP = re.compile(
    r"(netdev|ifaddr|route6?|rule|ip6?tables|nftables|netns|netns-ct|netns-exp)-\d+\.img"
)


def network_state_dumps(images_dir: Path) -> frozenset[str]:
    """The names of the dumps in ``images_dir`` of its network namespaces' own state, which a
    restore that joins a namespace that exists leaves out (see the module docstring)."""
    return frozenset(path.name for path in images_dir.iterdir()
                     if _NAMESPACE_DUMP.fullmatch(path.name))  # fmt: skip


def joined_view(images_dir: Path, target: Path) -> frozenset[str]:
    """Create ``target``: ``images_dir`` through symbolic links, without its
    :func:`network_state_dumps`, which it returns."""
    target.mkdir(mode=0o700)
    relative_dir = relative_dir_of(images_dir, target)
    left_out = network_state_dumps(images_dir)
    for path in sorted(images_dir.resolve().iterdir()):
        if path.name not in left_out:
            link_relative(path, target / path.name, relative_dir)
    return left_out


def redundant_net_dumps(images_dir: Path) -> frozenset[str]:
    """The names of the network dumps in ``images_dir`` that restore nothing a fresh namespace
    with an up ``lo`` lacks (see the module docstring); an unreadable one is never among them."""
    redundant = set()
    for path in images_dir.iterdir():
        match = _DUMP_NAME.fullmatch(path.name)
        if match is None:
            continue
        kind, netns = match.groups()
        try:
            data = path.read_bytes()
            if kind in ("route", "route6"):
                found = data == struct.pack("<I", ROUTE_MAGIC)
            elif kind == "rule":
                found = _only_default_rules(data)
            else:
                lo_index = _up_loopback_index(images_dir / f"netdev-{netns}.img")
                found = lo_index is not None and _only_loopback_addresses(data, lo_index)
        except (OSError, ValueError, struct.error):
            found = False
        if found:
            redundant.add(path.name)
    return frozenset(redundant)


def _messages(data: bytes, magic: int, message_type: int) -> Iterator[bytes]:
    """Each message's body (its family header and attributes, after ``nlmsghdr``); ValueError
    on another magic or message type, or a truncated message."""
    if len(data) < 4 or struct.unpack_from("<I", data)[0] != magic:
        raise ValueError("not the expected iproute2 dump")
    at = 4
    while at < len(data):
        length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, at)
        if kind != message_type or length < _NLMSG_HEADER.size or at + length > len(data):
            raise ValueError(f"unexpected netlink message at {at}")
        yield data[at + _NLMSG_HEADER.size : at + length]
        at += (length + 3) & ~3


def _attributes(body: bytes, start: int) -> dict[int, bytes]:
    """The ``rtattr`` attributes from ``body[start]``; ValueError on a repeated or cut one."""
    attributes: dict[int, bytes] = {}
    at = start
    while at + _RTATTR_HEADER.size <= len(body):
        length, kind = _RTATTR_HEADER.unpack_from(body, at)
        if length < _RTATTR_HEADER.size or at + length > len(body) or kind in attributes:
            raise ValueError(f"unexpected netlink attribute at {at}")
        attributes[kind] = body[at + _RTATTR_HEADER.size : at + length]
        at += (length + 3) & ~3
    return attributes


def _only_default_rules(data: bytes) -> bool:
    found = []
    for body in _messages(data, RULE_MAGIC, RTM_NEWRULE):
        family, dst_len, src_len, tos, table, _, _, action, flags = _FIB_RULE_HDR.unpack_from(body)
        attributes = _attributes(body, _FIB_RULE_HDR.size)
        # Anything that selects traffic or acts differently is not a default rule.
        if (family, dst_len, src_len, tos, action, flags) != (
            socket.AF_INET, 0, 0, 0, FR_ACT_TO_TBL, 0,
        ):  # fmt: skip
            return False
        known = {
            FRA_TABLE: struct.pack("<I", table),
            FRA_SUPPRESS_PREFIXLEN: struct.pack("<i", -1),
            FRA_PROTOCOL: bytes([RTPROT_KERNEL]),
        }
        priority = attributes.pop(FRA_PRIORITY, struct.pack("<I", 0))
        if any(known.get(kind) != value for kind, value in attributes.items()):
            return False
        found.append((table, struct.unpack("<I", priority)[0]))
    return len(found) == len(DEFAULT_RULES) and set(found) == DEFAULT_RULES


def _only_loopback_addresses(data: bytes, lo_index: int) -> bool:
    for body in _messages(data, IFADDR_MAGIC, RTM_NEWADDR):
        family, prefixlen, _, _, index = _IFADDRMSG.unpack_from(body)
        attributes = _attributes(body, _IFADDRMSG.size)
        raw = attributes.get(IFA_LOCAL, attributes.get(IFA_ADDRESS))
        if raw is None or index != lo_index:
            return False
        address = str(ipaddress.ip_address(raw))
        if (family, address, prefixlen) not in LOOPBACK_ADDRESSES:
            return False
    return True


def _up_loopback_index(netdev: Path) -> int | None:
    """The ifindex of the loopback link in a ``netdev-N.img``, if that link is restored up."""
    data = netdev.read_bytes()
    if struct.unpack_from("<II", data) != _NETDEV_MAGICS:
        raise ValueError(f"{netdev.name} is not a netdev image")
    at = 8
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at)
        if at + 4 + length > len(data):
            raise ValueError(f"{netdev.name} is truncated")
        fields = _varint_fields(data, at + 4, at + 4 + length)
        if fields.get(1) == ND_TYPE_LOOPBACK:
            return fields.get(2) if fields.get(4, 0) & IFF_UP else None
        at += 4 + length
    return None


def _varint_fields(data: bytes, at: int, end: int) -> dict[int, int]:
    """The top-level varint fields of one proto2 message (other wire types are skipped)."""
    fields: dict[int, int] = {}
    while at < end:
        key, at = read_varint(data, at, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            fields[number], at = read_varint(data, at, end)
        elif wire_type == 2:
            size, at = read_varint(data, at, end)
            at += size
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    if at != end:
        raise ValueError("truncated message")
    return fields
