"""The shipped systemd unit: what systemd itself makes of it, and the settings the agent's
promises rest on (copies outlive the agent; a stop is not cut short)."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapctl.agent.daemon import IN_FLIGHT_WAIT_S
from snapctl.statedir.layout import DEFAULT_STATE_DIR

UNIT = Path(__file__).parents[2] / "contrib" / "systemd" / "snapctl-agent.service"


def service_section() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def test_the_unit_keeps_copies_alive_and_waits_for_the_agent_s_stop() -> None:
    service = service_section()
    # Only the agent is signalled: the copies' supervisors must keep serving.
    assert service["KillMode"] == "process"
    assert shlex.split(service["ExecStart"])[1:] == ["agent"]
    assert service["Environment"] == f"SNAPCTL_STATE_DIR={DEFAULT_STATE_DIR}"
    timeout = service["TimeoutStopSec"]
    assert timeout.endswith("s") and float(timeout[:-1]) > IN_FLIGHT_WAIT_S


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_accepts_the_unit_without_a_warning(tmp_path: Path) -> None:
    """``systemd-analyze verify`` exits 0 on settings it ignores; a warning about this unit is a
    failure here (not one about another unit of the host's that it loads on the way)."""
    executable = shlex.split(service_section()["ExecStart"])[0]
    unit = tmp_path / UNIT.name
    # The unit names where a user installs snapctl; here, this venv's.
    unit.write_text(
        UNIT.read_text().replace(executable, str(Path(sys.executable).parent / "snapctl"))
    )
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    about_ours = [line for line in (done.stdout + done.stderr).splitlines()
                  if str(unit) in line or line.startswith(f"{unit.name}:")]  # fmt: skip
    assert (done.returncode, about_ours) == (0, []), done.stdout + done.stderr
