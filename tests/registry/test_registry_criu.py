"""Real CRIU and a real registry: bake → push → ``copy --image REF`` on an empty cache serves
the donor's answers; a second copy uses the cached pull; ``images`` lists it by reference; a
re-bake of the same server pushed to the same repository uploads under 30% of the first; the
working sets one host's lazy copies learned reach another host's first lazy copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.activation.bake import bake_image
from snapctl.activation.copy import start_copy
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.activation.supervise import collect_orphans, stop_recorded
from snapctl.criu import CriuBinary
from snapctl.criu.lazy.pagemap import lazy_view
from snapctl.registry.client import Reference, RegistryClient
from snapctl.registry.pull import pull_cached
from snapctl.registry.push import push_image
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV, complete
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.criu, pytest.mark.registry, pytest.mark.timeout(300)]


def stop_all(state: Path) -> None:
    records = StateDir(state)
    for record in records.load_records():
        stop_recorded(record, records)
    collect_orphans(records)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """The donor's state dir; whatever a failed test left running (here or in the copy's
    state dir, ``elsewhere``) is stopped after."""
    yield tmp_path / "state"
    for path in (tmp_path / "state", tmp_path / "elsewhere"):
        stop_all(path)


def snapctl(state: Path, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "snapctl", *args],
        env={**os.environ, "SNAPCTL_STATE_DIR": str(state), API_KEY_ENV: API_KEY, **(env or {})},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_push_then_copy_from_the_reference_serves_the_donors_answers(
    registry_server: RegistryServer, tmp_path: Path, state: Path, criu_binary: object
) -> None:
    image, ref = tmp_path / "image", f"{registry_server.address}/criu/fixture:v1"
    key = ("--api-key-env", API_KEY_ENV)
    donor = json.loads(snapctl(state, "donor", "--image", str(image), "--name", "d", *key,
                               "--publish", "127.0.0.1:0", "--detach", "--json"))  # fmt: skip
    reference_answer = complete(donor["published"])
    snapctl(state, "stop", "d")
    pushed = json.loads(snapctl(state, "image", "push", str(image), ref, "--plain-http", "--json"))

    # Another state directory: an empty image cache, as on another host.
    elsewhere = tmp_path / "elsewhere"
    copy = json.loads(snapctl(elsewhere, "copy", "--image", ref, "--plain-http", "--name", "c",
                              *key, "--publish", "127.0.0.1:0", "--detach", "--json",
                              env={"FOO": "1"}))  # fmt: skip
    try:
        assert complete(copy["published"]) == reference_answer
    finally:
        snapctl(elsewhere, "stop", "c")
    hex_digest = pushed["manifest_digest"].removeprefix("sha256:")
    pulled = elsewhere / "cache" / "images" / f"sha256-{hex_digest}"  # the whole digest
    assert (pulled / "manifest.json").is_file()
    rows = json.loads(snapctl(elsewhere, "images", "--json"))
    assert [(r["reference"], r["verified"]) for r in rows] == [(ref, True)]

    again = json.loads(snapctl(elsewhere, "copy", "--image", ref, "--plain-http", "--name", "c2",
                               *key, "--publish", "127.0.0.1:0", "--detach", "--json"))  # fmt: skip
    try:
        assert complete(again["published"]) == reference_answer
    finally:
        snapctl(elsewhere, "stop", "c2")


def test_a_rebake_of_the_same_server_pushes_under_30_percent(
    registry_server: RegistryServer, tmp_path: Path, state: Path, criu_binary: CriuBinary,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    pushed = []
    for tag in ("1", "2"):
        image = tmp_path / f"bake-{tag}"
        bake_image(
            LaunchOptions(api_key_env=API_KEY_ENV, timeout_s=120, fixture_retained_mb=256),
            image=image, force=False, criu=criu_binary, native=NoNativeStep(),
            state=StateDir(state), progress=lambda step: None,
        )  # fmt: skip
        reference = Reference.parse(f"{registry_server.address}/criu/rebake:{tag}")
        pushed.append(push_image(image, reference, RegistryClient(reference, plain_http=True)))
    first, second = pushed
    assert first.image_id != second.image_id
    # What a re-bake uploads again are the pages that differ between two starts (addresses
    # moved by ASLR): about 50 MB of the fixture, whatever its retained memory.
    assert second.bytes_uploaded < 0.3 * first.bytes_uploaded, (first, second)


def test_a_pulled_image_brings_the_working_sets_its_lazy_copies_learned(
    registry_server: RegistryServer, tmp_path: Path, state: Path, criu_binary: CriuBinary,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Host A's lazy copy learns its working sets; pushed with the image, they are what host
    B's first lazy copy restores eagerly (its view has them), and that copy serves."""
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    image, ref = tmp_path / "image", f"{registry_server.address}/criu/learned:v1"
    options = LaunchOptions(api_key_env=API_KEY_ENV, timeout_s=120, fixture_retained_mb=256)
    host_a = StateDir(state)
    bake_image(options, image=image, force=False, criu=criu_binary, native=NoNativeStep(),
               state=host_a, progress=lambda step: None)  # fmt: skip
    session, report = start_copy(image, options, criu=criu_binary, native=NoNativeStep(),
                                 publish=("127.0.0.1", 0), state=host_a,
                                 progress=lambda step: None, lazy=True)  # fmt: skip
    try:
        answer = complete(report.published)
        assert session.lazy is not None and session.lazy.wait(120).state == "complete"
    finally:
        session.stop(10.0)
    learned = sorted(p.name for p in host_a.views.glob("*.touched-runs.json"))
    assert learned, "the lazy copy learned nothing"

    pushed = json.loads(snapctl(state, "image", "push", str(image), ref, "--plain-http", "--json"))
    assert pushed["working_sets"]["processes"] == len(learned)

    # Host B pulls as ``copy --image REF`` does, before any copy there could learn the sets.
    elsewhere = tmp_path / "elsewhere"
    host_b = StateDir(elsewhere)
    host_b.ensure()
    client = RegistryClient(Reference.parse(ref), plain_http=True)
    try:
        pulled = pull_cached(client, host_b)
    finally:
        client.close()
    assert pulled.working_sets.processes == len(learned) and pulled.working_sets.error is None
    assert sorted(p.name for p in host_b.views.glob("*.touched-runs.json")) == learned
    summary = lazy_view(Path(pulled.image) / "criu", tmp_path / "view", cache_dir=host_b.views)
    assert summary.learned_processes >= 1

    copy = json.loads(snapctl(elsewhere, "copy", "--image", ref, "--plain-http", "--lazy",
                              "--name", "c", "--api-key-env", API_KEY_ENV,
                              "--publish", "127.0.0.1:0", "--detach", "--json"))  # fmt: skip
    try:
        assert complete(copy["published"]) == answer
    finally:
        snapctl(elsewhere, "stop", "c")
