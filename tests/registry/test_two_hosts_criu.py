"""Restore on a second host for real: host B (its own network and mount namespaces, state
directory, image cache and machine id) pulls from the registry on host A over a veth pair and
restores; the copy answers as the donor did on host A."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.images import load_manifest
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV
from tests.registry.hosts import TwoHosts, make_two_hosts
from tests.registry.server import registry_binary, start_registry

pytestmark = [pytest.mark.criu, pytest.mark.registry, pytest.mark.timeout(420)]

CLIENT = (
    "import json, sys; from tests.activation.criu_helpers import complete; "
    "print(json.dumps(complete(sys.argv[1])))"
)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    assert registry_binary() is not None
    made = make_two_hosts(tmp_path)
    try:
        yield made
    finally:
        try:
            for host in (made.b, made.a):  # whatever a failed test left running
                with_records = host.state / "records"
                if with_records.is_dir() and any(with_records.iterdir()):
                    host.run(sys.executable, "-c", "import sys; from tests.registry."
                             "test_registry_criu import stop_all; stop_all(__import__('pathlib')"
                             ".Path(sys.argv[1]))", str(host.state))  # fmt: skip
        finally:
            made.close()


def test_host_b_pulls_over_the_veth_and_serves_the_donors_answers(
    hosts: TwoHosts, tmp_path: Path, criu_binary: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = hosts.a, hosts.b
    env = {API_KEY_ENV: API_KEY}
    image = tmp_path / "a" / "image"
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(a.state))
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    registry = start_registry(tmp_path / "a" / "registry", host=a.address, port=5000,
                              popen_prefix=tuple(a.enter()))  # fmt: skip
    try:
        donor = json.loads(a.snapctl("donor", "--image", str(image), "--name", "d",
                                     "--api-key-env", API_KEY_ENV, "--publish", "127.0.0.1:0",
                                     "--detach", "--json", env=env))  # fmt: skip
        answered = a.run(sys.executable, "-c", CLIENT, donor["published"], env=env)
        assert answered.returncode == 0, answered.stderr
        a.snapctl("stop", "d")
        ref = f"{a.address}:5000/fleet/fixture:v1"
        a.snapctl("image", "push", str(image), ref, "--plain-http", "--json")

        seen_by_b = b.run("cat", "/etc/machine-id")
        assert seen_by_b.stdout.strip() == b.machine_id != a.machine_id
        assert load_manifest(image).identity.host_id == a.machine_id  # type: ignore[union-attr]
        copy = json.loads(b.snapctl("copy", "--image", ref, "--plain-http", "--name", "c",
                                    "--api-key-env", API_KEY_ENV, "--publish", "127.0.0.1:0",
                                    "--detach", "--json", env={**env, "FOO": "1"}))  # fmt: skip
        try:
            from_b = b.run(sys.executable, "-c", CLIENT, copy["published"], env=env)
            assert from_b.returncode == 0, from_b.stderr
            assert json.loads(from_b.stdout) == json.loads(answered.stdout)
        finally:
            b.snapctl("stop", "c")
        assert (b.state / "cache" / "images").is_dir() and not (a.state / "cache").exists()
    finally:
        registry.stop()
