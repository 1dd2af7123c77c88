"""The launched server's environment with real CRIU: a bake's tree, and so its image's memory
pages, holds the minimal environment and what ``--env``/``--env-file`` name, never another
variable of the caller's; ``--inherit-env`` gives the server the caller's whole environment
(read from ``/proc/PID/environ`` of a donor's server)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapctl.cli import snapctl
from snapctl.criu import CriuBinary
from snapctl.images import load_manifest
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import launch_donor, stop_clean

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def value(name: str) -> str:
    return f"{name.lower()}-{secrets.token_hex(12)}"


def memory_pages(image: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted((image / "criu").glob("pages-*.img")))


def test_a_baked_image_holds_only_the_variables_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    hidden, named, given, from_file, token = (
        value(n) for n in ("HIDDEN", "NAMED", "GIVEN", "FILE", "TOKEN")
    )
    monkeypatch.setenv("ENVTEST_HIDDEN", hidden)  # in the caller's environment only
    monkeypatch.setenv("ENVTEST_NAMED", named)
    env_file = tmp_path / "server.env"
    env_file.write_text(f"# for the server\nENVTEST_FILE={from_file}\nMY_API_TOKEN={token}\n")
    image = tmp_path / "image"

    runner = CliRunner()
    baked = runner.invoke(snapctl, [
        "bake", "--image", str(image), "--timeout", "120", "--json", "--env", "ENVTEST_NAMED",
        "--env", f"ENVTEST_GIVEN={given}", "--env-file", str(env_file)])  # fmt: skip
    assert baked.exit_code == 0, baked.output
    assert json.loads(baked.stdout)["clean"] is True

    manifest = load_manifest(image)
    names = manifest.server_env_names
    assert names is not None and names == sorted(names)
    assert {"ENVTEST_NAMED", "ENVTEST_GIVEN", "ENVTEST_FILE", "MY_API_TOKEN", "PATH"} <= set(names)
    assert "ENVTEST_HIDDEN" not in names
    assert manifest.identity is not None and "ENVTEST_HIDDEN" not in manifest.identity.env
    assert "ENVTEST_NAMED" in manifest.identity.env
    pages = memory_pages(image)
    for wanted in (named, given, from_file, token):
        assert wanted.encode() in pages
    assert hidden.encode() not in pages  # what `grep -a` would find in the image

    shown = runner.invoke(snapctl, ["inspect", str(image), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["manifest"]["server_env_names"]
    assert token not in shown.stdout and named not in shown.stdout  # names, never values
    exported = runner.invoke(snapctl, ["image", "export", str(image), "--out",
                                       str(tmp_path / "image.tar.zst"), "--json"])  # fmt: skip
    assert exported.exit_code == 0, exported.output
    assert "MY_API_TOKEN" in exported.stderr and "ENVTEST_NAMED" not in exported.stderr
    assert json.loads(exported.stdout)["action"] == "export" and token not in exported.stderr


def test_inherit_env_gives_a_donor_the_caller_s_whole_environment(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden = value("HIDDEN")
    monkeypatch.setenv("ENVTEST_HIDDEN", hidden)
    seen: dict[str, dict[str, str]] = {}
    for label, changes in (("default", {}), ("inherit", {"inherit_env": True})):
        donor, _ = launch_donor(tmp_path / label, state, criu_binary, activate=False, **changes)
        try:
            raw = Path(f"/proc/{donor.tree.pid}/environ").read_bytes()
        finally:
            stop_clean(donor)
        pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
        seen[label] = {name.decode(): found.decode() for name, _, found in pairs}
        assert seen[label].keys() == set(load_manifest(tmp_path / label).server_env_names or [])
    assert "ENVTEST_HIDDEN" not in seen["default"] and "PATH" in seen["default"]
    assert seen["inherit"]["ENVTEST_HIDDEN"] == hidden
