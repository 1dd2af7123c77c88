"""Working sets learned from a lazy-pages daemon's log, keyed by each process's pagemap."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.criu.lazy import tuning, workingset
from snapctl.criu.lazy.workingset import (
    faulted_pages,
    learnable,
    pagemap_key,
    read_working_set,
    record_working_sets,
)

LOG = b"""(00.000000) CRIU run id = 1
(00.010000) Add pid ns 9 pid 1
(00.500000) pr27-4 Read 7f0000001000 1 pages
(00.600000) pr1-2 Read 55d64bc43000 16 pages
(00.700000) pr27-4 Read 7f0000001000 1 pages
(00.800000) pr1-2 Read 55d64bc99000 1 pages
(02.000000) pr27-4 Read 7f0000009000 1 pages
"""


def test_only_single_page_reads_before_the_bound_count_as_faults() -> None:
    assert faulted_pages(LOG, 1.0) == {27: {0x7F0000001}, 1: {0x55D64BC99}}
    assert faulted_pages(LOG, 0.55) == {27: {0x7F0000001}}
    assert faulted_pages(LOG, 5.0)[27] == {0x7F0000001, 0x7F0000009}


def test_faults_are_kept_under_their_process_pagemap_and_grow_only_by_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = tmp_path / "criu"
    images.mkdir()
    (images / "pagemap-27.img").write_bytes(b"worker")
    (images / "pagemap-1.img").write_bytes(b"frontend")
    log = tmp_path / "lazy-pages.log"
    log.write_bytes(LOG)
    cache = tmp_path / "views"
    assert record_working_sets(images, cache, log, 1.0) == 2
    assert read_working_set(cache, pagemap_key(b"worker")) == {0x7F0000001}
    assert read_working_set(cache, pagemap_key(b"frontend")) == {0x55D64BC99}
    assert record_working_sets(images, cache, log, 1.0) == 0  # nothing new
    monkeypatch.setattr(workingset, "WORKING_SET_MIN_GROWTH", 1.0)
    assert record_working_sets(images, cache, log, 5.0) == 0  # one page more is not enough
    monkeypatch.setattr(workingset, "WORKING_SET_MIN_GROWTH", tuning.WORKING_SET_MIN_GROWTH)
    assert record_working_sets(images, cache, log, 5.0) == 1
    assert read_working_set(cache, pagemap_key(b"worker")) == {0x7F0000001, 0x7F0000009}
    # A process that touched too much for a working set keeps the set it had.
    monkeypatch.setattr(workingset, "WORKING_SET_MAX_RUNS", 1)
    (images / "pagemap-27.img").write_bytes(b"another worker")
    assert record_working_sets(images, cache, log, 5.0) == 0
    assert read_working_set(cache, pagemap_key(b"worker")) == {0x7F0000001, 0x7F0000009}
    assert learnable(cache, pagemap_key(b"worker"))
    # ... and one that never had a set is not to be learned again (by all-lazy copies).
    assert read_working_set(cache, pagemap_key(b"another worker")) is None
    assert not learnable(cache, pagemap_key(b"another worker"))
    # An unreadable log or image learns nothing.
    assert record_working_sets(images, cache, tmp_path / "missing.log", 5.0) == 0
    (images / "pagemap-1.img").unlink()
    assert record_working_sets(images, tmp_path / "other", log, 5.0) == 0


def test_a_set_is_kept_as_runs_so_a_recovery_that_reads_every_weight_is_learned(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "views"
    weights = range(0x7E0000000, 0x7E0000000 + (4 << 30) // 4096)  # 4 GiB touched whole
    assert workingset.add_pages(cache, "k" * 64, [*weights, 0x55D64BC99]) == len(weights) + 1
    kept = workingset.WorkingSet.model_validate_json(
        workingset.working_set_path(cache, "k" * 64).read_bytes()
    )
    assert kept.runs == [(0x55D64BC99, 1), (0x7E0000000, len(weights))]
    assert kept.page_count == len(weights) + 1
    assert workingset.add_pages(cache, "k" * 64, [0x7E0000005]) == 0  # nothing new


def test_runs_are_sorted_apart_and_merged() -> None:
    assert workingset.page_runs([5, 3, 4, 9, 4]) == [(3, 3), (9, 1)]
    assert workingset.union_runs([(3, 3), (20, 2)], [(6, 2), (1, 1), (21, 5)]) == [
        (1, 1), (3, 5), (20, 6)
    ]  # fmt: skip
    assert workingset.union_runs([], []) == []


def test_a_set_in_the_earlier_page_list_format_is_learned_again(tmp_path: Path) -> None:
    cache = tmp_path / "views"
    cache.mkdir()
    workingset.working_set_path(cache, "k" * 64).write_text('{"version": 1, "pages": [1, 2]}')
    assert read_working_set(cache, "k" * 64) is None
    assert workingset.add_pages(cache, "k" * 64, [7]) == 1
    assert read_working_set(cache, "k" * 64) == {7}


def test_sets_and_marks_an_earlier_version_kept_are_not_read(tmp_path: Path) -> None:
    cache = tmp_path / "views"
    cache.mkdir()
    (cache / f"{'k' * 64}.touched.json").write_text('{"version": 1, "pages": [1, 2]}')
    (cache / f"{'k' * 64}.unlearnable").write_bytes(b"")  # sets past 1 GiB were refused
    assert read_working_set(cache, "k" * 64) is None
    assert learnable(cache, "k" * 64)
