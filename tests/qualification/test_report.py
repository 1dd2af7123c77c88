"""The report (model, report.json round trip, report.md, the table) and the suite's plan
helpers: run names and order, the generated API key, the exit status of a failed check."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.cli import exit_status_for, main
from snapctl.criu import CriuBinary
from snapctl.errors import ExitStatus
from snapctl.qualification import checks, suite
from snapctl.qualification.report import (
    Report,
    environment,
    render_table,
    render_timings,
    write_report,
)
from snapctl.qualification.runs import LazyPages, RunContext, RunResult, Timings
from snapctl.qualification.suite import (
    DEFAULT_RUNS,
    LAZY_RETAINED_MB,
    RUN_ORDER,
    Plan,
    QualificationError,
    QualificationFailed,
    api_key,
    parse_runs,
    require_passed,
    retained_mb_for,
)
from snapctl.statedir import StateDir
from tests.qualification.factories import make_audit, make_observation

CRIU = CriuBinary(path=Path("/opt/snapctl/criu/bin/criu"), version="4.2.1", source="prefix")


def make_report(*failing: str) -> Report:
    """A report of a donor and a copy; the named checks of copy-1 fail."""
    runs = []
    for name, kind in (("donor", "donor"), ("copy-1", "copy")):
        found = [
            checks.passed("run completed", "every step ran"),
            checks.skipped("parameter digests = model file", "skipped (endpoint absent)"),
        ]
        found += [
            checks.failed(check, f"{check} differs | here") for check in failing if name == "copy-1"
        ]
        run = RunResult(
            name=name, kind=kind, activation_ids=[f"{kind}-abc"], checks=found,
            timings=Timings(restore_s=0.25, shutdown_s=0.1), wall_s=1.5,
            cleanup=make_audit(), observation=make_observation(),
        )  # fmt: skip
        runs.append(run)
    env = environment(CRIU, "none", Path("/img"), "f" * 32, ["python", "-m", "fixtures"], True)
    return Report(created="2026-01-01T00:00:00+00:00", environment=env, runs=runs, wall_s=3.0)


def test_report_json_round_trips_and_markdown_names_failures(tmp_path: Path) -> None:
    report = make_report("prompts match reference")

    json_path, md_path = write_report(report, tmp_path / "out")

    assert Report.model_validate_json(json_path.read_text()) == report
    text = md_path.read_text()
    assert "**FAILED**: 2 checks passed, 1 failed, 2 skipped" in text
    row = "| copy-1 | prompts match reference | **failed** | prompts match reference differs \\|"
    assert row in text
    assert "| criu_version | `4.2.1` |" in text and "| restore | 250.0 ms | 250.0 ms |" in text
    assert "- copy-1: prompts match reference: prompts match reference differs" in text
    assert not report.passed and make_report().passed


def test_table_shows_each_check_with_its_evidence_verbatim() -> None:
    report = make_report("image unchanged")
    report.runs[1].checks.append(checks.passed("no public listener", "[note] kept as text"))
    console = Console(file=io.StringIO(), width=200)

    console.print(render_table(report))
    console.print(render_timings(report))

    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "qualification FAILED: 3 passed, 1 failed, 2 skipped" in out
    assert "image unchanged differs" in out and "[note] kept as text" in out
    assert "restore 250.0 ms · shutdown 100.0 ms · run 1.50 s" in out


def test_require_passed_names_the_first_failure_and_maps_to_verify_failed() -> None:
    require_passed(make_report())

    with pytest.raises(QualificationFailed) as info:
        require_passed(make_report("auth", "image unchanged"))

    assert str(info.value) == (
        "qualification failed: copy-1: auth: auth differs | here (and 1 more)"
    )
    assert exit_status_for(info.value) is ExitStatus.VERIFY_FAILED


def test_a_report_with_no_run_fails() -> None:
    empty = make_report().model_copy(update={"runs": []})

    with pytest.raises(QualificationFailed, match="ran nothing"):
        require_passed(empty)
    assert not empty.passed


def test_a_run_that_raises_becomes_a_failed_check_and_the_next_run_still_happens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def perform(name: str, plan: Plan, ctx: RunContext) -> list[RunResult]:
        if name == "fault":
            raise RuntimeError("a bug in the run")
        return [RunResult(name=name, kind="stale", checks=[checks.check_completed(None)], wall_s=0)]

    monkeypatch.setattr(suite, "_perform", perform)
    plan = Plan(options=LaunchOptions(), criu=CRIU, native=NoNativeStep(), runs=("fault", "stale"))
    ctx = RunContext(
        options=plan.options, criu=CRIU, native=plan.native, state=StateDir(tmp_path),
        image=tmp_path / "image", work=tmp_path, progress=lambda _: None,
    )  # fmt: skip

    results = suite._run_all(plan, ctx, [], tmp_path)

    assert [run.name for run in results] == ["fault", "stale"]
    assert results[0].checks[0].status == "failed"
    assert results[0].checks[0].evidence == "RuntimeError: a bug in the run"
    assert results[1].passed


def test_run_names_keep_the_fixed_order() -> None:
    assert parse_runs("stale,copy-2,donor") == ("donor", "copy-2", "stale")
    assert parse_runs(",".join(reversed(RUN_ORDER))) == RUN_ORDER
    assert parse_runs("lazy-fault,fault,stale") == ("fault", "lazy-fault", "stale")
    # The lazy-pages daemon fault is a default run only when the copies are lazy.
    assert "lazy-fault" not in parse_runs(None) and parse_runs(None) == DEFAULT_RUNS
    assert parse_runs(None, lazy=True) == RUN_ORDER
    assert parse_runs("donor,copy-1", lazy=True) == ("donor", "copy-1")
    with pytest.raises(QualificationError, match="unknown run 'copy-3'"):
        parse_runs("donor,copy-3")
    with pytest.raises(QualificationError, match="no run named"):
        parse_runs(" , ")


def test_api_key_is_generated_only_when_none_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SNAPCTL_API_KEY", raising=False)
    options = LaunchOptions()
    with api_key(options):
        generated = options.api_key
        assert options.api_key_env == "SNAPCTL_API_KEY" and generated and len(generated) >= 24
    assert "SNAPCTL_API_KEY" not in os.environ

    monkeypatch.setenv("MY_KEY", "given")
    options = LaunchOptions(api_key_env="MY_KEY")
    with api_key(options):
        assert options.api_key == "given"
    assert os.environ["MY_KEY"] == "given"


def test_no_api_key_configures_no_key_and_the_report_says_the_checks_were_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SNAPCTL_API_KEY", raising=False)
    options = LaunchOptions()
    with api_key(options, required=False) as hint:
        assert (options.api_key_env, options.api_key, hint) == (None, None, "")
    assert "SNAPCTL_API_KEY" not in os.environ

    env = environment(CRIU, "none", Path("/img"), None, ["server"], False, api_key_checked=False)
    run = RunResult(name="donor", kind="donor", checks=[checks.auth_skipped()], wall_s=1.0)
    report = Report(created="2026-01-01T00:00:00+00:00", environment=env, runs=[run], wall_s=1.0)
    json_path, md_path = write_report(report, tmp_path / "out")
    saved = json.loads(json_path.read_text())
    assert saved["environment"]["api_key"] == "skipped by request (--no-api-key)"
    assert saved["runs"][0]["checks"][0]["status"] == "skipped"
    text = md_path.read_text()
    assert "| api_key | `skipped by request (--no-api-key)` |" in text
    assert "| donor | API key enforced | skipped | skipped by request (--no-api-key)" in text
    assert make_report().environment.api_key == "checked"


def test_the_cli_refuses_no_api_key_with_api_key_env() -> None:
    assert main(["qualify", "--no-api-key", "--api-key-env", "K"]) == ExitStatus.USAGE


def make_lazy_report() -> Report:
    """A lazy copy whose pages completed after it was ready, and a lazy-fault run."""
    copy = RunResult(
        name="copy-1", kind="copy", activation_ids=["copy-abc"],
        checks=[checks.passed("pages complete", "lazy-pages daemon 41 exited 0")],
        timings=Timings(lazy_pages_start_s=0.03, restore_s=0.1), wall_s=1.0, lazy=True,
        pages=LazyPages(
            lazy_pages_pid=41, complete_when_ready=False, pages_complete=True,
            pages_complete_s=0.305, pages_complete_at="2026-01-01T00:00:00.305+00:00",
        ),
    )  # fmt: skip
    fault = RunResult(
        name="lazy-fault", kind="lazy-fault", activation_ids=["copy-def"],
        checks=[checks.passed("copy stopped at once", "gone 8 ms after")],
        timings=Timings(kill_to_exit_s=0.008), wall_s=1.0, lazy=True,
        pages=LazyPages(
            lazy_pages_pid=42, complete_when_ready=False, pages_complete=False,
            failure="lazy-pages daemon killed by SIGKILL before every page was copied",
        ),
    )  # fmt: skip
    env = environment(CRIU, "none", Path("/img"), "f" * 32, ["python", "-m", "fixtures"], True)
    return Report(created="2026-01-01T00:00:00+00:00", environment=env, runs=[copy, fault],
                  wall_s=2.0)  # fmt: skip


def test_lazy_runs_report_their_pages(tmp_path: Path) -> None:
    report = make_lazy_report()

    json_path, md_path = write_report(report, tmp_path / "out")

    assert Report.model_validate_json(json_path.read_text()) == report
    saved = json.loads(json_path.read_text())["runs"][0]
    assert saved["lazy"] is True and saved["pages"]["pages_complete"] is True
    assert saved["pages"]["pages_complete_s"] == 0.305
    text = md_path.read_text()
    assert "| copy-1 (lazy) | pages complete | passed |" in text
    assert "| restore → pages complete | 305.0 ms | - |" in text
    assert "| daemon killed → copy gone | - | 8.0 ms |" in text
    assert "- copy-1: copy-abc; lazy-pages daemon 41: pages complete 305.0 ms after the restore " \
        "started (after the copy was ready)" in text  # fmt: skip
    assert "- lazy-fault: copy-def; lazy-pages daemon 42: pages never complete: " \
        "lazy-pages daemon killed by SIGKILL" in text  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    console.print(render_table(report))
    console.print(render_timings(report))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "copy-1 (lazy)" in out and "lazy-fault (lazy)" not in out
    assert "restore 100.0 ms · restore → pages complete 305.0 ms · run 1.00 s" in out


def test_a_lazy_run_raises_the_fixtures_retained_memory() -> None:
    for lazy, runs, retained, expected in [
        (False, ("donor",), None, LaunchOptions().fixture_retained_mb),
        (True, ("donor",), None, LAZY_RETAINED_MB),
        (False, ("donor", "lazy-fault"), None, LAZY_RETAINED_MB),
        (True, ("donor",), 64, 64),
    ]:
        plan = Plan(options=LaunchOptions(), criu=CRIU, native=NoNativeStep(), runs=runs,
                    lazy=lazy, retained_mb=retained)  # fmt: skip
        assert retained_mb_for(plan) == expected, (lazy, runs, retained)


def test_fault_command_refuses_a_weights_fault_with_lazy(tmp_path: Path) -> None:
    assert main(["fault", "--image", str(tmp_path), "--lazy", "--fault", "unreadable"]) == 2
