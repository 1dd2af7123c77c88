"""Qualification end to end with real CRIU and the bundled fixture.

One test runs the whole ``snapctl qualify`` (reference, donor, copies, fault, stale, CRIU
faults) and requires every check to pass. The others share one image (captured once for the
module) and run ``snapctl fault`` and ``snapctl stale`` alone against it, plus a fault that is
not injected, which the fail-closed checks must report as failures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fixtures.model import build_model
from snapctl.activation.session import Session
from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.images import load_manifest
from snapctl.qualification import faults
from snapctl.qualification.report import Report
from snapctl.qualification.suite import DEFAULT_RUNS
from snapctl.statedir import StateDir
from tests.qualification.criu_helpers import (
    assert_nothing_left,
    captured_image,
    fresh_state,
    printed_report,
)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]


def _statuses(report: Report) -> dict[tuple[str, str], str]:
    return {(run.name, check.name): check.status for run in report.runs for check in run.checks}


def test_qualify_on_the_fixture_passes_every_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shm_before = fresh_state(tmp_path, monkeypatch)

    status = main(["qualify", "--report", str(tmp_path / "report"), "--json"])

    report = printed_report(capsys.readouterr().out)
    failures = report.failures()
    assert status == ExitStatus.OK, failures
    assert report.passed and failures == []
    names = [run.name for run in report.runs]
    expected = ["reference", *DEFAULT_RUNS]
    expected[expected.index("stale")] = "stale-files"
    expected.insert(expected.index("stale-files") + 1, "stale-replay")
    assert names == expected
    assert report.counts()["skipped"] == 0  # the fixture has every endpoint and a model file
    statuses = _statuses(report)
    for run in ("donor", "copy-1", "copy-2"):
        for check in ("prompts match reference", "concurrency matches reference",
                      "API key enforced", "parameter digests = model file",
                      "parameter digests = image's first load", "image unchanged",
                      "nothing left behind"):  # fmt: skip
            assert statuses[(run, check)] == "passed"
    assert statuses[("fault", "error.json at recover")] == "passed"
    assert statuses[("stale-replay", "error.json at capture barrier")] == "passed"
    donor = report.runs[1]
    assert donor.timings.dump_frozen_s and donor.timings.launch_to_capture_ready_s
    assert report.runs[3].timings.restore_s and report.environment.criu_version
    # The report directory holds both files and every activation's control files and logs.
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["runs"][0]["name"] == "reference"
    assert "PASSED" in (tmp_path / "report" / "report.md").read_text()
    copy_dir = tmp_path / "report" / "runs" / "copy-1"
    assert (copy_dir / "control" / "release.json").exists()
    assert (copy_dir / "logs" / "server.log").stat().st_size > 0
    assert (tmp_path / "report" / "runs" / "fault" / "control" / "error.json").exists()
    # Nothing of any run is left: no activation directory, no temporary image, no shm file.
    assert_nothing_left(StateDir(tmp_path / "state"), shm_before)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One captured image (donor stopped), and SNAPCTL_STATE_DIR pointing at its state."""
    with captured_image(tmp_path_factory, "qualify-image") as path:
        yield path


@pytest.mark.parametrize("mode", ["changed", "unreadable"])
def test_fault_command_fails_closed(
    image: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["fault", "--image", str(image), "--fault", mode, "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    (run,) = report.runs
    checks = {check.name: check for check in run.checks}
    assert checks["error.json at recover"].evidence.startswith("recovery: restore memory")
    assert checks["tree exited by itself"].status == "passed"
    assert checks["no public listener"].status == "passed"
    assert checks["fault confined to the activation"].status == "passed"
    assert run.cleanup is not None and run.cleanup.clean


@pytest.fixture(scope="module")
def in_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An image of the fixture under the in-image memory policy (weights copied into memory)."""
    model = tmp_path_factory.mktemp("in-image-model") / "model"
    build_model(model, 2.0, seed=7)
    server = [sys.executable, "-m", "fixtures", "serve", "--model", str(model),
              "--memory-policy", "in-image"]  # fmt: skip
    with captured_image(tmp_path_factory, "in-image", server_argv=server) as path:
        yield path


def test_an_in_image_images_fault_breaks_the_copys_memory(
    in_image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts = load_manifest(in_image).capture_facts
    assert facts is not None and facts.memory_policy == "in-image"
    assert len(facts.parameter_digests) > 1

    status = main(["fault", "--image", str(in_image), "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    (run,) = report.runs
    checks = {check.name: check for check in run.checks}
    assert checks["error.json at recover"].evidence.startswith("recovery: canary")
    assert checks["fault injected in the copy's memory"].status == "passed"
    assert checks["tree exited by itself"].status == "passed"
    assert checks["image unchanged"].status == "passed"
    assert run.cleanup is not None and run.cleanup.clean


def _mergeable_bytes(pid: int) -> int:
    """What of ``pid``'s memory is marked mergeable by KSM (smaps' ``mg`` flag)."""
    total, size = 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif line.startswith("VmFlags:") and " mg" in line:
            total += size
    return total


def _cli(*args: str) -> str:
    """The console command in its own process (a detached copy forks its supervisor)."""
    done = subprocess.run([sys.executable, "-m", "snapctl", *args], capture_output=True,
                          text=True, timeout=180, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_in_image_copy_keeps_its_weights_mergeable(in_image: Path) -> None:
    _cli("copy", "--image", str(in_image), "--name", "merge", "--detach", "--json")
    try:
        (row,) = [r for r in json.loads(_cli("ps", "--json")) if r["name"] == "merge"]
        assert row["memory_bytes"] > 1 << 20  # its tree's PSS, the weights included
        engine = next(
            child for child in psutil.Process(row["root_pid"]).children(recursive=True)
            if child.name() == "fixture-engine"
        )  # fmt: skip
        # The mark the fixture set before the capture came back with CRIU's restore: its
        # 2 MB model's weights, page-rounded.
        assert _mergeable_bytes(engine.pid) >= 1_900_000
    finally:
        assert "cleanup: clean" in _cli("stop", "merge")


def test_stale_command_fails_closed(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["stale", "--image", str(image), "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    assert [run.name for run in report.runs] == ["stale-files", "stale-replay"]
    files, replay = ({c.name: c for c in run.checks} for run in report.runs)
    assert "stale activation control" in files["error.json at capture barrier"].evidence
    assert "made up" in files["error.json at capture barrier"].evidence
    assert "release.json does not match" in replay["error.json at capture barrier"].evidence


def test_a_fault_that_is_not_injected_fails_the_fail_closed_checks(
    image: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_fault(session: Session, weights: str, mode: str, record: object) -> None:
        record.host_before = faults._sha256(weights)  # type: ignore[attr-defined]
        record.inside = record.host_before  # type: ignore[attr-defined]

    monkeypatch.setattr(faults, "inject_weights_fault", no_fault)

    status = main(["fault", "--image", str(image), "--json"])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.VERIFY_FAILED
    checks = {check.name: check for check in report.runs[0].checks}
    assert checks["error.json at recover"].evidence == "no error.json was written"
    assert checks["never validated"].status == "failed"
    assert "the fault was not detected" in checks["never validated"].evidence
    assert checks["fault confined to the activation"].evidence.endswith("no fault")
    assert checks["tree exited by itself"].status == "failed"
    assert checks["nothing left behind"].status == "passed"  # stopped and cleaned up anyway


def test_a_server_started_without_a_key_fails_saying_so_unless_no_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server command that takes no key (the fixture given as a command is given none):
    the key check says the server was started without one and how to give it one; with
    --no-api-key the qualification passes, and the report says the key checks were skipped."""
    shm_before = fresh_state(tmp_path, monkeypatch)
    model = tmp_path / "model"
    build_model(model, 2.0, seed=3)
    server = ["--", sys.executable, "-m", "fixtures", "serve", "--model", str(model)]

    status = main(["qualify", "--runs", "donor", "--json", *server])

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.VERIFY_FAILED
    failures = report.failures()
    assert failures and all("API key enforced" in failure for failure in failures), failures
    assert "missing key got 200, expected 401" in failures[0]
    assert "it was started without one" in failures[0] and "--api-key-env" in failures[0]
    assert "--no-api-key" in failures[0] and report.environment.api_key == "checked"

    out = tmp_path / "report"
    status = main(["qualify", "--runs", "donor", "--no-api-key", "--report", str(out), "--json",
                   *server])  # fmt: skip

    report = printed_report(capsys.readouterr().out)
    assert status == ExitStatus.OK, report.failures()
    assert {_statuses(report)[(run, "API key enforced")] for run in ("reference", "donor")} == {
        "skipped"
    }
    saved = json.loads((out / "report.json").read_text())
    assert saved["environment"]["api_key"] == "skipped by request (--no-api-key)"
    assert "skipped by request (--no-api-key)" in (out / "report.md").read_text()
    assert_nothing_left(StateDir(tmp_path / "state"), shm_before)
