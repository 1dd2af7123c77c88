"""Where an activation may be published on the host: a loopback address unless exposing it
was asked for, an address this host has, and a port that is free, all checked before
anything starts; and the listening socket itself, with the same errors if that changed since.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Sequence

import psutil

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase

LOOPBACK = "127.0.0.1"


class PublishError(SnapctlError):
    """A ``--publish`` address that is no address, or not loopback without ``--expose``."""

    exit_status = ExitStatus.USAGE


class PublishAddressMissing(SnapctlError):
    """A ``--publish`` address that this host does not have."""

    exit_status = ExitStatus.UNAVAILABLE


class PortInUseError(SnapctlError):
    """The host port to publish on is taken."""

    exit_status = ExitStatus.CONFLICT


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError as error:
        raise PublishError(
            f"--publish address {text!r} is not an IP address (give one, e.g. {LOOPBACK})",
            phase=HostPhase.PUBLISH,
        ) from error


def host_addresses() -> set[str]:
    """Every IP address on this host's interfaces (in its own network namespace)."""
    return {
        entry.address.split("%")[0]
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in (socket.AF_INET, socket.AF_INET6)
    }


def check_publish_address(address: str, *, exposed: bool) -> str:
    """The address to listen on, refused unless loopback (or ``exposed``) and on this host."""
    ip = _address(address)
    if not ip.is_loopback and not exposed:
        raise PublishError(
            f"--publish {address} would make the copy reachable from other machines; "
            "publish on a loopback address, or add --expose to mean it",
            phase=HostPhase.PUBLISH,
        )
    if not (ip.is_loopback or ip.is_unspecified) and str(ip) not in host_addresses():
        raise PublishAddressMissing(
            f"--publish address {address} is not an address of this host "
            "(ip -brief address lists them)",
            phase=HostPhase.PUBLISH,
        )
    return str(ip)


def bind_listener(address: str, port: int) -> socket.socket:
    """A listening socket on ``address:port``, or the error that says why not."""
    family = socket.AF_INET6 if _address(address).version == 6 else socket.AF_INET
    try:
        return socket.create_server((address, port), family=family, reuse_port=False)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"host port {address}:{port} is in use (choose another --publish port, or 0 "
                "for any free one)",
                phase=HostPhase.PUBLISH,
            ) from error
        if error.errno == errno.EADDRNOTAVAIL:
            raise PublishAddressMissing(
                f"--publish address {address} is not an address of this host",
                phase=HostPhase.PUBLISH,
            ) from error
        raise SnapctlError(
            f"cannot listen on {address}:{port}: {error.strerror}", phase=HostPhase.PUBLISH
        ) from error


def check_publish(address: str, ports: Sequence[int], *, exposed: bool) -> None:
    """Before anything starts: refuse an address not allowed or not here, and a port in use
    (each of ``ports``; 0 takes any free one when publishing, so it is not checked)."""
    address = check_publish_address(address, exposed=exposed)
    for port in ports:
        if port:
            bind_listener(address, port).close()
