"""The bridge's reload policy, forced on vLLM's CPU platform: an image that states it, a copy
whose recovery reads the weights files again (and compares their digests) and answers like the
donor, and a fault run that changes the weights file for one copy, which must fail closed in
``recovery: restore memory``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapctl.images import load_manifest
from snapctl.qualification.report import Report
from snapctl.qualification.watch import HOST_SHM
from snapctl.statedir import StateDir
from tests.qualification.criu_helpers import assert_nothing_left
from tests.vllm.conftest import RealVllm
from tests.vllm.test_vllm_criu import _snapctl, bake

pytestmark = [pytest.mark.criu, pytest.mark.vllm, pytest.mark.timeout(1200)]

RELOAD = ("--snapctl-memory-policy", "reload", "--snapctl-reload-digests")


def test_a_reload_policy_image_reloads_compares_and_fails_closed_on_a_changed_file(
    vllm: RealVllm, tmp_path: Path
) -> None:
    state = StateDir(tmp_path / "state")
    image = tmp_path / "image"
    shm_before = set(os.listdir(HOST_SHM))
    bake(vllm, state, image, *RELOAD)
    facts = load_manifest(image).capture_facts
    assert facts is not None
    assert (facts.memory_policy, facts.reload_digests) == ("reload", True)

    copied = _snapctl(
        ["copy", "--json", "--image", str(image), "--name", "reloaded", "--detach",
         "--publish", "127.0.0.1:0", "--api-key-env", "SNAPCTL_VLLM_KEY"],
        state, 600,
    )  # fmt: skip
    assert copied.returncode == 0, copied.stderr[-3000:]
    try:
        logs = _snapctl(["logs", "reloaded"], state, 60).stdout
        restored = [line for line in logs.splitlines() if "snapctl: memory restored" in line]
        assert "(reload): reload weights and digests" in restored[-1]
    finally:
        assert _snapctl(["stop", "reloaded"], state, 120).returncode == 0

    fault = _snapctl(
        ["fault", "--json", "--image", str(image), "--api-key-env", "SNAPCTL_VLLM_KEY",
         "--timeout", "600"],
        state, 900,
    )  # fmt: skip
    report = Report.model_validate_json(fault.stdout.strip().splitlines()[-1])
    assert fault.returncode == 0, report.failures()
    checks = {check.name: check for check in report.runs[0].checks}
    assert checks["error.json at recover"].evidence.startswith("recovery: restore memory")
    assert "differ from the first load" in checks["error.json at recover"].evidence
    assert checks["fault confined to the activation"].status == "passed"
    print(json.dumps({name: check.evidence for name, check in checks.items()})[:2000])
    assert_nothing_left(state, shm_before)
