"""Starting and probing a real server with real CRIU as vLLM's users do: the server's own limit
comes from --server-timeout, and readiness is the open GET /health, so a donor and a copy of
a server that requires an API key serve without --api-key-env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary
from snapctl.images import load_manifest
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    API_KEY,
    PUBLISH,
    get,
    launch_donor,
    leftovers,
    restore_copy,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def test_the_server_gets_its_own_limit_from_server_timeout(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    donor, _ = launch_donor(tmp_path / "image", state, criu_binary, activate=False,
                            server_timeout_s=1234.5)  # fmt: skip
    stop_clean(donor)
    argv = load_manifest(tmp_path / "image").server_argv
    config = json.loads(argv[argv.index("--snapshot-config") + 1])
    assert config["timeout_s"] == 1234.5


def test_donor_and_copy_of_a_keyed_server_serve_without_api_key_env(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary
) -> None:
    # The server requires a key snapctl is not told about (--api-key-env not given): it is
    # given as any other variable (--env FIXTURE_API_KEY=...).
    image = tmp_path / "image"
    donor, report = launch_donor(
        image, state, criu_binary, publish=PUBLISH, api_key_env=None,
        env={"FIXTURE_API_KEY": API_KEY},
    )  # fmt: skip
    try:
        assert report.published
        assert get(report.published, "/health", key=None)[0] == 200
        assert get(report.published, "/v1/models", key=None)[0] == 401  # the key is required
        assert get(report.published, "/v1/models")[0] == 200
    finally:
        stop_clean(donor)
    copy, copy_report = restore_copy(image, state, criu_binary, publish=PUBLISH, api_key_env=None)
    try:
        assert copy_report.published and "validated_to_http_200" in copy_report.timings_s
        assert get(copy_report.published, "/v1/models", key=None)[0] == 401
        assert get(copy_report.published, "/v1/models")[0] == 200
    finally:
        stop_clean(copy)
    assert leftovers(state) == []
