"""scripts/gpu-check rehearsed without a GPU (FIXTURE_DEVICE=cpu): its snapctl steps run for
real, with real CRIU, so the script a GPU machine gets is the one CI exercised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SNAPCTL_STEPS = ["criu-check", "doctor", "build-model", "qualify-plain", "qualify-lazy"]


def test_gpu_check_snapctl_steps_pass_on_the_cpu_fixture(
    tmp_path: Path, criu_binary: CriuBinary
) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "FIXTURE_DEVICE": "cpu", "PYTHON": sys.executable}
    env.pop("SNAPCTL_STATE_DIR", None)  # the script keeps its own
    # 256 MiB retained: enough for the lazy-fault run to find a transfer to interrupt.
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), str(out), "256"],
        env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    summary = (out / "summary.txt").read_text()
    status = {line.split()[0]: line.split()[1] for line in summary.splitlines() if " rc=" in line}
    assert {step: status[step] for step in SNAPCTL_STEPS} == dict.fromkeys(SNAPCTL_STEPS, "rc=0"), (
        summary + (out / "steps.log").read_text()[-4000:]
    )
    # Its exit status counts failed steps: here only the GPU ones can fail.
    gpu_failed = sum(status[step] != "rc=0" for step in status if step not in SNAPCTL_STEPS)
    assert done.returncode == gpu_failed
    for name, runs in (("plain", 9), ("lazy", 4)):
        report = json.loads((out / f"report-{name}.json").read_text())
        results = {check["status"] for run in report["runs"] for check in run["checks"]}
        assert results == {"passed"} and len(report["runs"]) == runs
    assert json.loads((out / "doctor.json").read_text())["ready"] is True
