"""``image push``/``pull``, ``inspect REF`` and ``images`` against a real registry on loopback
(sample images, no CRIU)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapctl.cli import main, snapctl
from snapctl.errors import ExitStatus
from snapctl.images.store import hash_tree
from tests.images.factories import publish_sample
from tests.registry.server import RegistryServer, start_registry

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SNAPCTL_IMAGE_ROOT", str(tmp_path / "images"))
    return tmp_path / "state"


def run(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(snapctl, [*args, "--json"])
    assert result.exit_code == 0, result.output
    record: dict[str, object] = json.loads(result.stdout)
    return record


def test_push_inspect_pull_and_list(registry_server: RegistryServer, tmp_path: Path,
                                    state: Path) -> None:  # fmt: skip
    manifest = publish_sample(tmp_path / "image")
    ref = f"{registry_server.address}/cli/sample:v1"

    pushed = run("image", "push", str(tmp_path / "image"), ref, "--plain-http")
    assert pushed["reference"] == ref and pushed["image_id"] == manifest.image_id

    shown = run("inspect", ref, "--plain-http")
    assert shown["manifest_digest"] == pushed["manifest_digest"]
    assert shown["manifest"]["image_id"] == manifest.image_id  # type: ignore[index]
    assert shown["annotations"]["org.criu.checkpoint.engine.name"] == "snapctl"  # type: ignore[index]
    blobs = state / "cache" / "blobs" / "sha256"
    assert len(list(blobs.iterdir())) == 2  # config and manifest.json: no file content

    pulled = run("image", "pull", ref, "--to", str(tmp_path / "pulled"), "--plain-http")
    assert pulled["image_id"] == manifest.image_id and pulled["blobs_fetched"] == 1
    assert hash_tree(tmp_path / "pulled") == hash_tree(tmp_path / "image")
    rows = CliRunner().invoke(snapctl, ["images", "--root", str(tmp_path), "--json"])
    assert [r["verified"] for r in json.loads(rows.stdout) if r["path"].endswith("pulled")] == [
        True]  # fmt: skip


def test_push_warns_when_the_image_s_server_had_a_secret_looking_variable(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    publish_sample(tmp_path / "image", server_env_names=["HF_TOKEN", "PATH", "VLLM_USE_V1"])
    ref = f"{registry_server.address}/cli/keyed:v1"

    result = CliRunner().invoke(
        snapctl, ["image", "push", str(tmp_path / "image"), ref, "--plain-http", "--json"]
    )

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reference"] == ref  # the record alone on stdout
    warning = " ".join(result.stderr.split())
    assert "server was launched with HF_TOKEN in its environment" in warning
    assert "PATH" not in warning and "VLLM_USE_V1" not in warning


def test_pull_without_plain_http_names_the_fix(
    registry_server: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = f"{registry_server.address}/cli/none:v1"

    code = main(["image", "pull", ref, "--to", str(tmp_path / "out")])

    assert code == ExitStatus.ERROR and "--plain-http" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_tag_is_named(registry_server: RegistryServer, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    ref = f"{registry_server.address}/cli/none:v1"

    code = main(["image", "pull", ref, "--to", str(tmp_path / "out"), "--plain-http"])

    assert code == ExitStatus.ERROR and f"{ref} is not in the registry" in capsys.readouterr().err


def test_credentials_from_the_docker_config_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_registry(tmp_path / "registry", htpasswd=("fleet", "s3cret-pass"))
    try:
        manifest = publish_sample(tmp_path / "image")
        ref = f"{server.address}/auth/sample:v1"
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
        code = main(["image", "push", str(tmp_path / "image"), ref, "--plain-http"])
        err = capsys.readouterr().err
        assert code == ExitStatus.ERROR and "HTTP 401" in err and "docker login" in err

        (tmp_path / "docker").mkdir()
        token = base64.b64encode(b"fleet:s3cret-pass").decode()
        (tmp_path / "docker" / "config.json").write_text(
            json.dumps({"auths": {server.address: {"auth": token}}})
        )
        pushed = run("image", "push", str(tmp_path / "image"), ref, "--plain-http")
        assert pushed["image_id"] == manifest.image_id

        monkeypatch.delenv("DOCKER_CONFIG")
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.docker either
        monkeypatch.setenv("SNAPCTL_REGISTRY_USERNAME", "fleet")
        monkeypatch.setenv("SNAPCTL_REGISTRY_PASSWORD", "s3cret-pass")
        pulled = run("image", "pull", ref, "--to", str(tmp_path / "pulled"), "--plain-http")
        assert pulled["image_id"] == manifest.image_id
        assert "s3cret" not in json.dumps(pulled)
    finally:
        server.stop()
