"""Baking with real CRIU: bake → export → import elsewhere → copy serves; the identity gate
refuses a changed mapped file, argv, kernel or kernel features (waivable by name, files never)
before CRIU runs, and never refuses another machine or the restorer's environment.

One fixture image is baked per module and shared; tests that change it work on an imported
copy of it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapctl.activation.bake import BakeReport, bake_image
from snapctl.activation.copy import start_copy
from snapctl.activation.gate import check_identity
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.activation.session import Session
from snapctl.cli import snapctl
from snapctl.criu import CriuBinary, find_criu
from snapctl.errors import SnapctlError
from snapctl.images import load_manifest, verify_image
from snapctl.images.identity.compare import IdentityMismatchError
from snapctl.images.manifest import MANIFEST_NAME
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY, complete, get, stop_clean
from tests.images.factories import flip_byte

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]

MAPPING_SERVER = Path(__file__).parents[1] / "servers" / "mapping_server.py"


@dataclass
class Baked:
    image: Path
    state: StateDir
    report: BakeReport


def options(**changes: object) -> LaunchOptions:
    base = LaunchOptions(api_key_env="SNAPCTL_TEST_API_KEY", timeout_s=120)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


@pytest.fixture(scope="module")
def baked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baked]:
    root = tmp_path_factory.mktemp("bake")
    state = StateDir(root / "state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SNAPCTL_TEST_API_KEY", API_KEY)
        report = bake_image(
            options(), image=root / "image", force=False, criu=find_criu(),
            native=NoNativeStep(), state=state, progress=lambda step: None,
        )  # fmt: skip
    yield Baked(image=root / "image", state=state, report=report)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPCTL_TEST_API_KEY", API_KEY)


def copy(image: Path, state: StateDir, running: list[Session], **changes: object) -> str:
    session, report = start_copy(
        image, options(**changes), criu=find_criu(), native=NoNativeStep(),
        publish=("127.0.0.1", 0), state=state, progress=lambda step: None,
    )  # fmt: skip
    running.append(session)
    assert report.published and report.handshake_phases[-1] == "validated"
    return report.published


def cli(*args: str) -> dict[str, object]:
    # --json before any "--": what follows that is the server's command.
    end = args.index("--") if "--" in args else len(args)
    result = CliRunner().invoke(snapctl, [*args[:end], "--json", *args[end:]])
    assert result.exit_code == 0, result.output
    record: dict[str, object] = json.loads(result.stdout)
    return record


def test_bake_publishes_a_donor_form_image_and_never_serves(baked: Baked) -> None:
    report = baked.report
    assert report.clean and report.stopped in ("terminated", "killed", "exited")
    manifest = verify_image(baked.image)
    assert sorted(p.name for p in baked.image.iterdir()) == ["criu", "logs", MANIFEST_NAME, "shm"]
    assert manifest.schema_version == 2 and manifest.identity is not None
    assert report.processes >= 2 and report.dump_stats.pages_written > 0
    assert any(name.startswith("shm/") for name in manifest.files)
    depends = [record.path for record in manifest.identity.files]
    assert os.path.realpath(sys.executable) in depends
    assert not any(p.startswith(("/run/", "/dev/", "/proc/")) for p in depends)
    assert baked.state.activations.exists() and list(baked.state.activations.iterdir()) == []
    log = (Path(report.logs) / "server.log").read_text()
    assert "capture-ready" in log or "startup capture" in log
    assert "validated" not in log and "serving" not in log  # never activated, never bound


def test_export_import_elsewhere_then_copy_serves(
    baked: Baked, tmp_path: Path, running: list[Session]
) -> None:
    archive, imported = tmp_path / "image.tar.zst", tmp_path / "elsewhere" / "image"
    exported = cli("image", "export", str(baked.image), "--out", str(archive))
    result = cli("image", "import", str(archive), "--to", str(imported))
    assert result["image_id"] == baked.report.image_id == exported["image_id"]
    assert result["archive_sha256"] == exported["archive_sha256"]

    reference = complete(copy(baked.image, baked.state, running))
    stop_clean(running[-1])
    published = copy(imported, baked.state, running)
    assert complete(published) == reference
    assert get(published, "/v1/models")[0] == 200
    stop_clean(running[-1])


def imported_with_identity(baked: Baked, tmp_path: Path, **changes: object) -> Path:
    """The baked image exported and imported again, its manifest then saying ``changes`` of
    its identity (as if captured elsewhere)."""
    archive, image = tmp_path / "a.tar.zst", tmp_path / "image"
    cli("image", "export", str(baked.image), "--out", str(archive))
    cli("image", "import", str(archive), "--to", str(image))
    manifest = load_manifest(image)
    assert manifest.identity is not None
    identity = manifest.identity.model_copy(update=changes)
    payload = manifest.model_copy(update={"identity": identity}).model_dump(mode="json")
    write_json_atomic(image / MANIFEST_NAME, payload, overwrite=True, max_bytes=1 << 24)
    return image


def test_restorer_environment_and_another_machine_never_refuse(
    baked: Baked, tmp_path: Path, running: list[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    image = imported_with_identity(baked, tmp_path, host_id="f" * 32, hostname="host-a")
    monkeypatch.setenv("FOO", "1")  # FOO=1 snapctl copy --image IMG
    monkeypatch.setenv("VLLM_USE_V1", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere/secret-path")

    steps: list[str] = []
    session, report = start_copy(
        image, options(), criu=find_criu(), native=NoNativeStep(), publish=("127.0.0.1", 0),
        state=baked.state, progress=steps.append,
    )  # fmt: skip
    running.append(session)
    assert report.published and get(report.published, "/v1/models")[0] == 200
    shown = next(step for step in steps if step.startswith("differs, does not refuse"))
    assert "host_id: image ffffffff..." in shown and "hostname: image host-a" in shown
    assert "VLLM_USE_V1 is set here but was not at capture" in shown
    assert "VLLM_CACHE_ROOT" in shown
    # Compared is what a capture here would have given its server: FOO it would not have.
    assert "FOO" not in shown
    assert "secret-path" not in shown and "waived" not in " ".join(steps)
    stop_clean(running[-1])
    # The waivers older scripts pass are still accepted.
    published = copy(image, baked.state, running, allow_mismatch=("env", "host_id"))
    assert get(published, "/v1/models")[0] == 200
    stop_clean(running[-1])


def test_argv_and_kernel_mismatches_are_refused_and_waivable(baked: Baked, tmp_path: Path) -> None:
    manifest = load_manifest(baked.image)
    assert manifest.identity is not None
    check = lambda **changes: check_identity(  # noqa: E731
        manifest, baked.image, criu_version=manifest.criu_version, options=options(**changes),
        state=baked.state,
    )  # fmt: skip
    assert check() == []

    with pytest.raises(IdentityMismatchError, match="argv: argument 3 differs"):
        check(server_argv=[sys.executable, "-m", "fixtures", "other"])
    waived = check(server_argv=[sys.executable, "-m", "fixtures"], allow_mismatch=("argv",))
    assert [d.field for d in waived] == ["argv"]

    elsewhere = manifest.identity.model_copy(
        update={"kernel": "5.4.0-old", "kernel_features": ["pid_ns", "warp_ns"]}
    )
    changed = manifest.model_copy(update={"identity": elsewhere})
    with pytest.raises(IdentityMismatchError) as info:
        check_identity(changed, baked.image, criu_version=manifest.criu_version,
                       options=options(allow_mismatch=("kernel",)), state=baked.state)  # fmt: skip
    assert "kernel_features: this kernel lacks warp_ns" in str(info.value)
    assert "kernel: image" not in str(info.value)
    waived = check_identity(changed, baked.image, criu_version=manifest.criu_version,
                            options=options(allow_mismatch=("kernel", "kernel_features")),
                            state=baked.state)  # fmt: skip
    assert {d.field for d in waived} == {"kernel", "kernel_features"}


def test_kernel_mismatch_in_the_manifest_refuses_copy(
    baked: Baked, tmp_path: Path, running: list[Session]
) -> None:
    image = imported_with_identity(baked, tmp_path, kernel="5.4.0-old")

    with pytest.raises(IdentityMismatchError, match=r"kernel: image 5\.4\.0-old, here "):
        copy(image, baked.state, running)
    published = copy(image, baked.state, running, allow_mismatch=("kernel",))
    assert get(published, "/v1/models")[0] == 200
    stop_clean(running[-1])


def test_changed_mapped_file_blocks_copy_until_restored(
    tmp_path: Path, running: list[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    model = tmp_path / "weights.bin"
    original = os.urandom(64 * 1024)
    model.write_bytes(original)
    image = tmp_path / "image"
    report = cli("bake", "--image", str(image), "--timeout", "120", "--",
                 sys.executable, str(MAPPING_SERVER), str(model))  # fmt: skip
    assert report["clean"] is True and report["image"] == str(image)
    manifest = load_manifest(image)
    assert manifest.identity is not None
    assert str(model) in [record.path for record in manifest.identity.files]

    flip_byte(model, 0)  # same size, other content: only the hash tells
    with pytest.raises(IdentityMismatchError, match=rf"files: {model} has other content"):
        copy(image, state, running, api_key_env=None)
    with pytest.raises(SnapctlError, match="cannot be waived"):
        copy(image, state, running, api_key_env=None, allow_mismatch=("files",))
    model.unlink()
    with pytest.raises(IdentityMismatchError, match=rf"files: {model} is missing"):
        copy(image, state, running, api_key_env=None)
    assert list(state.activations.iterdir()) == []  # refused before CRIU ran

    model.write_bytes(original)
    published = copy(image, state, running, api_key_env=None)
    assert get(published, "/anything", key=None)[0] == 200
    stop_clean(running[-1])


def test_bake_refuses_to_replace_an_image_a_copy_holds(
    baked: Baked, tmp_path: Path, criu_binary: CriuBinary
) -> None:
    from snapctl.images.lock import ImageBusyError, hold_image

    with hold_image(baked.image), pytest.raises(ImageBusyError, match="in use"):
        bake_image(
            options(), image=baked.image, force=True, criu=criu_binary, native=NoNativeStep(),
            state=baked.state, progress=lambda step: None,
        )  # fmt: skip
    assert load_manifest(baked.image).image_id == baked.report.image_id
    assert list(baked.state.activations.iterdir()) == []
