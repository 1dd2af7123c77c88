"""Publish addresses: loopback unless exposed on purpose, on this host, and a free port, all
refused before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.namespaces.publish import (
    PortInUseError,
    PublishAddressMissing,
    PublishError,
    bind_listener,
    check_publish,
)
from tests.images.factories import publish_sample

# TEST-NET-1 (RFC 5737): never an address of a real host.
NOT_HERE = "192.0.2.55"


def test_loopback_is_allowed_without_expose() -> None:
    check_publish("127.0.0.1", [0], exposed=False)
    check_publish("127.0.0.2", [], exposed=False)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", NOT_HERE])
def test_anything_but_loopback_needs_expose(address: str) -> None:
    with pytest.raises(PublishError, match="--expose") as info:
        check_publish(address, [0], exposed=False)
    assert info.value.exit_status == ExitStatus.USAGE


def test_an_exposed_address_must_be_on_this_host() -> None:
    with pytest.raises(PublishAddressMissing) as info:
        check_publish(NOT_HERE, [8000], exposed=True)
    assert info.value.exit_status == ExitStatus.UNAVAILABLE
    check_publish("0.0.0.0", [0], exposed=True)


def test_a_host_name_is_not_an_address() -> None:
    with pytest.raises(PublishError, match="not an IP address"):
        check_publish("localhost", [0], exposed=False)


def test_a_port_in_use_is_refused_before_anything_starts() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)) as info:
            check_publish("127.0.0.1", [port], exposed=False)
        assert info.value.exit_status == ExitStatus.CONFLICT
        with pytest.raises(PortInUseError):
            bind_listener("127.0.0.1", port)  # what Publisher meets if it was taken since


def test_ipv6_loopback_listens() -> None:
    with bind_listener("::1", 0) as listener:
        assert listener.family == socket.AF_INET6


@pytest.mark.parametrize(
    ("publish", "extra", "status"),
    [
        ("0.0.0.0:18123", [], ExitStatus.USAGE),
        (f"{NOT_HERE}:18123", ["--expose"], ExitStatus.UNAVAILABLE),
        (None, ["--expose"], ExitStatus.USAGE),
    ],
)
def test_copy_refuses_a_publish_address_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publish: str | None, extra: list[str],
    status: ExitStatus,
) -> None:  # fmt: skip
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    publish_sample(tmp_path / "image")
    args = ["copy", "--image", str(tmp_path / "image"), "--no-lazy", *extra]
    assert main([*args, *(["--publish", publish] if publish else [])]) == status
    assert not (tmp_path / "state").exists()


def test_copy_count_refuses_when_any_of_its_ports_is_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    publish_sample(tmp_path / "image")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = ["copy", "--image", str(tmp_path / "image"), "--count", "2", "--no-lazy"]
        assert main([*args, "--publish", f"127.0.0.1:{port - 1}"]) == ExitStatus.CONFLICT
    assert not (tmp_path / "state").exists()
