"""The benchmark harness, end to end on a tiny fixture (8 MB retained, one repetition).

Proves the machinery the full run uses (capture, every contender, donor pause, concurrency, CLI
start, the JSON, the docs writer) still works. It asserts on the structure of the results,
never on timings: benchmarks print figures, tests do not judge them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import docs
from bench.cli import main
from bench.plan import tiny
from bench.results import Results
from bench.run import Runner

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    work = tmp_path_factory.mktemp("bench")
    return Runner(tiny(), work, lambda message: None).run()


def test_every_measurement_has_every_contender(results: Results) -> None:
    plan = tiny()
    (size,) = plan.sizes_mb
    names = [c.name for c in plan.contenders]
    assert results.settings.contenders == names
    for name in names:
        assert results.find("ready_s", name, size) is not None, name
    restores = [n for n in names if n != "cold start"]
    for metric in ("validated_s", "handshake_ms", "criu_restore_time_s"):
        for name in restores:
            figure = results.find(metric, name, size)
            assert figure is not None and len(figure.samples) == plan.reps, (metric, name)
    # Throughput only where CRIU returns with every page in; a lazy copy reports when they were.
    for name in ("bare CRIU", "snapctl copy"):
        assert results.find("restore_MBps", name, size) is not None, name
    assert results.find("restore_MBps", "snapctl copy --lazy", size) is None
    assert results.find("pages_complete_s", "snapctl copy --lazy", size) is not None
    # The lazy copy's daemon starts with its restore: timed, but not a phase of its own.
    assert results.find("lazy_pages_ready_s", "snapctl copy --lazy", size) is not None
    assert results.find("lazy_pages_ready_s", "snapctl copy", size) is None
    steps = ("verify", "identity", "setup", "stage", "criu", "after restore", "handshake")
    lazy_steps = ("lazy view",)
    for name, extra in (("snapctl copy", ()), ("snapctl copy --lazy", lazy_steps)):
        phases = {
            f.metric
            for f in results.figures
            if f.contender == name and f.metric.startswith("phase:")
        }
        assert phases == {f"phase:{p}" for p in (*steps, *extra)}, name
    after = {
        f.metric
        for f in results.figures
        if f.metric.startswith("after:") and f.contender == "snapctl copy"
    }
    assert after == {
        "after:HTTP probe", "after:rest of start_copy", "after:first completion",
    }  # fmt: skip
    assert results.find("after:first completion", "bare CRIU", size) is not None
    for which in ("page cache -> reused buffer", "page cache -> fresh memory"):
        assert results.find("read_MBps", which, size) is not None
    for which in ("snapctl donor", "bare CRIU dump", "bare CRIU dump -v4"):
        assert results.find("frozen_s", which, size) is not None
        assert results.find("dump_s", which, size) is not None
    for count in plan.concurrency:
        total = results.find("concurrent_total_s", f"{count} at once", plan.concurrency_mb)
        per_copy = results.find("concurrent_per_copy_s", f"{count} at once", plan.concurrency_mb)
        assert total is not None and per_copy is not None
        assert len(per_copy.samples) == count * plan.reps
    for name in ("snapctl copy", "snapctl copy --lazy"):
        assert results.find("pages_present_s", name, size) is not None, name
    (at_once,) = plan.at_once_sizes_mb
    for name in ("snapctl copy", "snapctl copy --lazy"):
        for count in plan.concurrency:
            label = f"{name}, {count} at once"
            for metric in ("at_once_ready_s", "at_once_pages_present_s"):
                figure = results.find(metric, label, at_once)
                assert figure is not None and len(figure.samples) == count * plan.at_once_reps
    for command in ("python -c pass", "snapctl --help", "snapctl copy --help"):
        assert results.find("cli_start_s", command) is not None
    assert all(value > 0 for f in results.figures for value in f.samples)


def test_targets_are_judged_from_this_run(results: Results) -> None:
    names = {t.name for t in results.targets}
    assert names == {
        "copy restore-to-validated / bare CRIU, 8 MB",
        "restore throughput / page-cache read, 8 MB",
        "donor frozen time / bare CRIU dump, 8 MB",
        "handshake (activation -> validated)",
        "snapctl --help",
        "2 concurrent copies / one copy",
        "lazy copy: first correct completion, 8 MB",
        "plain / lazy copy: first correct completion, 8 MB",
        "lazy / plain copy: all pages present, 8 MB",
    }
    for target in results.targets:
        expected = {"<=": target.measured <= target.limit, ">=": target.measured >= target.limit}
        assert target.met == expected.get(target.comparison, target.measured < target.limit)


def test_json_and_docs_round_trip(
    results: Results, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "benchmarks.json"
    saved.write_text(results.model_dump_json())
    assert main(["--from-json", str(saved), "--json"]) == 0
    again = Results.model_validate_json(capsys.readouterr().out)
    assert again == results

    written = docs.write(results, tmp_path / "docs")
    assert {p.name for p in written} >= {"benchmarks.md", "benchmarks.json"}
    text = (tmp_path / "docs" / "benchmarks.md").read_text()
    headings = (
        "## Targets", "## Method", "## Machine", "## 7. Concurrent copies",
        "Lazy against plain: first correct completion",
        "### Plain and lazy copies started together",
    )  # fmt: skip
    for heading in headings:
        assert heading in text
    assert json.loads((tmp_path / "docs" / "benchmarks.json").read_text())["schema_version"] == 1
