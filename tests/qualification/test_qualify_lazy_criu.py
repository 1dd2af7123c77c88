"""Qualification of lazy copies with real CRIU and the bundled fixture.

One test runs ``snapctl qualify --lazy`` through the CLI with only the runs lazy copies add to
the evidence (reference, donor, lazy copy-1 and copy-2, lazy-fault) and requires every check to
pass. The others share one image with the lazy runs' retained memory (captured once for the
module) and run ``snapctl fault --lazy`` alone against it, plus an attempt whose daemon is never
paused, which the run must report as a failure after its retries, leaving nothing behind, and
one whose pause comes late, which the held transfer must still find running.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.images.lock import hold_image
from snapctl.qualification import lazy_fault
from snapctl.qualification.report import Report
from snapctl.qualification.suite import LAZY_RETAINED_MB
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess
from tests.qualification.criu_helpers import (
    assert_nothing_left,
    captured_image,
    fresh_state,
    printed_report,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

LAZY_FAULT_CHECKS = (
    "run completed", "transfer running when killed", "copy stopped at once", "failure reported",
    "no public listener", "image unchanged", "image verifies and is free", "nothing left behind",
)  # fmt: skip


def _checks(report: Report, run: str) -> dict[str, tuple[str, str]]:
    (found,) = [r for r in report.runs if r.name == run]
    return {check.name: (check.status, check.evidence) for check in found.checks}


def test_qualify_lazy_passes_every_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shm_before = fresh_state(tmp_path, monkeypatch)

    status = main([
        "qualify", "--lazy", "--runs", "donor,copy-1,copy-2,lazy-fault",
        "--report", str(tmp_path / "report"), "--json",
    ])  # fmt: skip

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    assert [run.name for run in report.runs] == [
        "reference", "donor", "copy-1", "copy-2", "lazy-fault",
    ]  # fmt: skip
    assert report.counts()["skipped"] == 0
    for run in report.runs[2:4]:
        assert run.lazy and run.pages is not None and run.pages.pages_complete
        assert run.pages.pages_complete_s and run.pages.pages_complete_at
        checks = _checks(report, run.name)
        for name in ("prompts match reference", "concurrency matches reference",
                     "parameter digests = model file", "nothing left behind"):  # fmt: skip
            assert checks[name][0] == "passed"
        assert checks["pages complete"][0] == "passed"
        assert f"daemon {run.pages.lazy_pages_pid} exited 0" in checks["pages complete"][1]
        retained = checks["retained memory = donor"]
        assert (
            retained[0] == "passed" and f"{LAZY_RETAINED_MB} MiB hash to the donor's" in retained[1]
        )
    donor, fault = report.runs[1], report.runs[4]
    assert not donor.lazy and donor.pages is None
    assert donor.observation is not None and donor.observation.retained is not None
    assert donor.observation.retained.mb == LAZY_RETAINED_MB
    assert sorted(_checks(report, "lazy-fault")) == sorted(LAZY_FAULT_CHECKS)
    assert fault.pages is not None and not fault.pages.pages_complete
    assert "killed by SIGKILL" in (fault.pages.failure or "")
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["runs"][2]["lazy"] is True and saved["runs"][2]["pages"]["pages_complete"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| restore → pages complete | - | - |" in markdown
    assert "| copy-1 (lazy) | pages complete | passed |" in markdown
    # The lazy-fault attempt's logs say why its copy was stopped.
    (activation,) = fault.activation_ids
    failure = tmp_path / "report" / "runs" / "lazy-fault" / activation / "failure.txt"
    assert "before every page was copied" in failure.read_text()
    assert_nothing_left(StateDir(tmp_path / "state"), shm_before)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One image with the lazy runs' retained memory (donor stopped), and SNAPCTL_STATE_DIR
    pointing at its state."""
    with captured_image(
        tmp_path_factory, "qualify-lazy-image", fixture_retained_mb=LAZY_RETAINED_MB
    ) as path:
        yield path


def test_lazy_fault_command_alone(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["fault", "--image", str(image), "--lazy", "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    (run,) = report.runs
    assert run.name == "lazy-fault" and run.kind == "lazy-fault" and run.lazy
    checks = _checks(report, "lazy-fault")
    assert {name: status for name, (status, _) in checks.items()} == dict.fromkeys(
        LAZY_FAULT_CHECKS, "passed"
    )
    assert "killed by snapctl's watcher" in checks["copy stopped at once"][1]
    assert "killed by SIGKILL before every page was copied" in checks["failure reported"][1]
    assert run.timings.kill_to_exit_s is not None
    assert run.cleanup is not None and run.cleanup.clean
    hold_image(image, exclusive=True).release()


def test_a_pause_that_comes_late_still_finds_the_transfer_running(
    image: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A loaded machine: half a second from the restore's end to the pause. Unheld, this image's
    # first copy had its 256 MiB in within about 0.1 s, and every attempt found it ended.
    pause = lazy_fault.pause

    def late(process: PinnedProcess, timeout_s: float = lazy_fault.PAUSE_TIMEOUT_S) -> bool:
        time.sleep(0.5)
        return pause(process, timeout_s)

    monkeypatch.setattr(lazy_fault, "pause", late)

    status = main(["fault", "--image", str(image), "--lazy", "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    evidence = _checks(report, "lazy-fault")["transfer running when killed"][1]
    assert "transfer released, then SIGKILLed" in evidence and "on attempt" not in evidence


def test_a_daemon_never_paused_fails_after_every_attempt_and_leaves_nothing(
    image: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paused: list[int] = []

    def never(process: PinnedProcess, timeout_s: float = 0.0) -> bool:
        paused.append(process.pid)
        return False  # as if the transfer had always ended first

    monkeypatch.setattr(lazy_fault, "pause", never)

    status = main(["fault", "--image", str(image), "--lazy", "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.VERIFY_FAILED
    assert len(paused) == lazy_fault.ATTEMPTS and len(set(paused)) == lazy_fault.ATTEMPTS
    checks = _checks(report, "lazy-fault")
    assert checks["transfer running when killed"][0] == "failed"
    assert f"({lazy_fault.ATTEMPTS} attempts)" in checks["transfer running when killed"][1]
    assert "copy stopped at once" not in checks  # nothing was killed: nothing to judge
    for name in ("run completed", "image unchanged", "image verifies and is free",
                 "nothing left behind"):  # fmt: skip
        assert checks[name][0] == "passed", checks[name]
    assert len(report.runs[0].activation_ids) == lazy_fault.ATTEMPTS
    state = StateDir(Path(os.environ["SNAPCTL_STATE_DIR"]))
    assert list(state.activations.iterdir()) == []
