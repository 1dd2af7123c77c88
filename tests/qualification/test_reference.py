"""What qualification reads from a server command: the fixture, flags, the weights file."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.errors import SnapctlError
from snapctl.qualification.reference import (
    flag_value,
    is_fixture,
    is_vllm_bridge,
    model_argument,
    server_from_manifest,
    weights_file,
    without_snapshot_config,
)

FIXTURE = ["/venv/bin/python", "-m", "fixtures", "serve", "--model", "/m", "--port", "8000"]


def test_is_fixture() -> None:
    assert is_fixture(FIXTURE)
    assert not is_fixture(["vllm", "serve", "/m"])
    assert not is_fixture(["python", "-m", "fixtures", "build-model"])


def test_the_vllm_bridge_and_its_model_argument() -> None:
    bridge = ["/v/bin/python", "-m", "snapctl.launcher.vllm", "serve", "/m", "--dtype", "float32"]
    assert is_vllm_bridge(bridge) and not is_fixture(bridge)
    assert not is_vllm_bridge(FIXTURE)
    assert model_argument(bridge) == "/m"
    assert model_argument(FIXTURE) == "/m"
    assert model_argument(["vllm", "serve", "--port", "1"]) is None


def test_flag_value_and_snapshot_config_removal() -> None:
    assert flag_value(FIXTURE, "--model") == "/m"
    assert flag_value(["x", "--model=/a", "--model", "/b"], "--model") == "/b"
    assert flag_value(FIXTURE, "--host") is None
    argv = [*FIXTURE, "--snapshot-config", '{"mode":"startup"}', "--snapshot-config={}"]
    assert without_snapshot_config(argv) == FIXTURE


def test_weights_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "small.safetensors").write_bytes(b"x")
    (model / "large.safetensors").write_bytes(b"x" * 10)

    assert weights_file(["serve", "--model", str(model)]) == model / "large.safetensors"
    assert weights_file(["vllm", "serve", str(model), "--port", "1"]) == (
        model / "large.safetensors"
    )
    assert weights_file(["serve", "--model", str(model / "small.safetensors")]) == (
        model / "small.safetensors"
    )
    assert weights_file(["vllm", "serve", "org/remote-model"]) is None
    assert weights_file(["server"]) is None


def test_a_manifest_with_redacted_secrets_needs_the_command() -> None:
    class Manifest:
        server_argv = [*FIXTURE, "--api-key", "***", "--snapshot-config", "{}"]
        server_cwd = "/repo"

    with pytest.raises(SnapctlError, match="redacted secrets"):
        server_from_manifest(Manifest())  # type: ignore[arg-type]
    Manifest.server_argv = [*FIXTURE, "--snapshot-config", "{}"]
    assert server_from_manifest(Manifest()) == (FIXTURE, Path("/repo"))  # type: ignore[arg-type]
