"""The identity gate without CRIU: an image without an identity still names the CRIU that
dumped it, and another one here is refused like any other identity difference."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.activation.gate import check_identity
from snapctl.activation.launch import LaunchOptions
from snapctl.cli import exit_status_for
from snapctl.errors import ExitStatus
from snapctl.images.identity.compare import IdentityMismatchError
from snapctl.statedir import StateDir
from tests.images.factories import make_manifest

SCHEMA_1 = make_manifest({}, schema_version=1, identity=None, criu_version="4.1")


def check(tmp_path: Path, *waived: str, criu_version: str = "4.2.1") -> list[str]:
    shown = check_identity(
        SCHEMA_1, tmp_path / "image", criu_version=criu_version,
        options=LaunchOptions(allow_mismatch=waived), state=StateDir(tmp_path / "state"),
    )  # fmt: skip
    return [d.field for d in shown]


def test_another_criu_is_an_identity_refusal_that_can_be_waived(tmp_path: Path) -> None:
    with pytest.raises(IdentityMismatchError) as info:
        check(tmp_path, "identity")
    assert "criu_version: image 4.1, here 4.2.1" in info.value.message
    assert "--allow-mismatch criu_version" in info.value.message
    assert exit_status_for(info.value) is ExitStatus.VERIFY_FAILED
    assert check(tmp_path, "identity", "criu_version") == ["identity", "criu_version"]
    assert check(tmp_path, "identity", criu_version="4.1") == ["identity"]


def test_an_image_without_identity_is_refused_first(tmp_path: Path) -> None:
    with pytest.raises(IdentityMismatchError, match="re-bake it"):
        check(tmp_path, "criu_version")
