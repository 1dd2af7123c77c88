"""``python -m bench.agent`` end to end on a tiny fixture (8 MB retained, one repetition, 3
concurrent requests with a pool of 2): every mode measured, the pool's copy taken from the
pool and the others not, every concurrent request served. Structure only, never timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.agent import MODES, Bench, table

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]


def test_every_mode_is_measured_and_the_concurrent_requests_are_served(tmp_path: Path) -> None:
    results = Bench(tmp_path, [8], 1, requests=3, pool=2).run()["results"]

    assert set(results["copy_first_correct_s"][8]) == set(MODES)
    assert results["from_pool"][8] == {mode: int(mode == "agent pool") for mode in MODES}
    concurrent = results["concurrent"]
    assert concurrent["served"] == 3 and concurrent["errors"] == []
    assert concurrent["from_pool"] >= 1
    assert set(results["ps_wall_s"]) >= {"snapctl ps (agent)", "snapctl --no-agent ps"}
    assert "| 8 MiB |" in table(results)
