"""A copy request started as the CLI in-process and a copy's supervisor start it
(:mod:`snapctl.activation.start`): what it finds and decides before anything starts, then its
steps in order, one copy or several, and what a failure leaves (nothing), on fake tools."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.copy import CopiesReport
from snapctl.activation.core import ActivationReport
from snapctl.activation.requests import CopyRequest
from snapctl.activation.start import prepare_copies
from snapctl.criu.locate import CriuNotFound
from snapctl.criu.stats import DumpStats
from snapctl.images.lock import hold_image
from snapctl.statedir import StateDir
from tests.activation.fake_tools import CRIU, InjectedFailure, Steps, fake_tools
from tests.activation.test_steps import COPY_STEPS, PUBLISH, assert_nothing_left, donor
from tests.images.factories import publish_sample


@dataclass
class FailOnce(Steps):
    """Steps where only the first call of ``fail_at`` fails (of several copies: one)."""

    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, name: str) -> None:
        with self.lock:
            self.calls.append(name)
            failing = name == self.fail_at
            if failing:
                self.fail_at = None
        if failing:
            raise InjectedFailure(f"injected failure at {name}", phase=name)


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return state


@pytest.fixture
def image(tmp_path: Path, state: StateDir) -> Path:
    """An image published by a donor on fake tools, the donor stopped."""
    session, _ = donor(state, tmp_path / "image", Steps())  # type: ignore[misc]
    session.stop()
    return tmp_path / "image"


@pytest.fixture
def criu_found(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The CRIU each start asked for (the path its request names, or None)."""
    asked: list[str | None] = []

    def find_criu(path: str | None = None) -> Any:
        asked.append(path)
        return CRIU

    monkeypatch.setattr("snapctl.criu.find_criu", find_criu)
    return asked


def request(image: Path, **fields: Any) -> CopyRequest:
    base = {"image": str(image), "name": "c", "lazy": False, "timeout_s": 5,
            "server_argv": ("fake-server", "--serve"),
            "publish": {"address": PUBLISH[0], "port": PUBLISH[1]}}  # fmt: skip
    return CopyRequest.model_validate({**base, **fields}, strict=False)


def lanes() -> tuple[dict[str, list[str]], Any]:
    """Each lane's progress, and the ``progress_for`` that records it."""
    seen: dict[str, list[str]] = {}

    def progress_for(lane: str) -> Any:
        return seen.setdefault(lane, []).append

    return seen, progress_for


def test_one_copy_finds_its_criu_first_then_runs_the_copy_steps_and_serves(
    state: StateDir, image: Path, criu_found: list[str | None]
) -> None:
    steps = Steps()
    copies = prepare_copies(request(image, criu_path="/opt/criu"), state, tools=fake_tools(steps))
    assert criu_found == ["/opt/criu"] and steps.calls == []  # found, nothing started yet
    assert copies.publish == PUBLISH and not copies.lazy and copies.native.name == "none"
    seen, progress_for = lanes()
    sessions, report = copies(progress_for)
    try:
        assert steps.calls == COPY_STEPS
        assert isinstance(report, ActivationReport) and report.name == "c"
        assert report.published == f"{PUBLISH[0]}:{PUBLISH[1]}"
        assert list(seen) == [""] and "activating the copy" in seen[""]  # one copy: one lane
    finally:
        for session in sessions:
            session.stop()
    assert_nothing_left(state, steps, "c")


def test_the_supervisor_s_own_launch_options_are_the_ones_started_with(
    state: StateDir, image: Path, criu_found: list[str | None]
) -> None:
    given = request(image)
    options = replace(given.launch_options(), name="its-own")
    steps = Steps()
    sessions, report = prepare_copies(given, state, options=options, tools=fake_tools(steps))(
        lanes()[1]
    )
    try:
        assert isinstance(report, ActivationReport) and report.name == "its-own"
    finally:
        for session in sessions:
            session.stop()
    assert_nothing_left(state, steps, "its-own")


def test_whether_it_restores_lazily_is_decided_before_anything_starts_and_said(
    state: StateDir, tmp_path: Path, criu_found: list[str | None]
) -> None:
    big = tmp_path / "big"
    publish_sample(big, dump_stats=DumpStats(pages_written=65536))
    notes: list[str] = []
    copies = prepare_copies(request(big, lazy=None), state, note=notes.append)
    assert copies.lazy and len(notes) == 1 and "restoring lazily" in notes[0]
    asked = prepare_copies(request(big, lazy=False), state, note=notes.append)
    assert not asked.lazy and len(notes) == 1  # asked for: nothing to say
    assert state.load_records() == []


def test_a_criu_not_found_starts_nothing(
    state: StateDir, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def find_criu(path: str | None = None) -> Any:
        raise CriuNotFound("no usable criu")

    monkeypatch.setattr("snapctl.criu.find_criu", find_criu)
    steps = Steps()
    with pytest.raises(CriuNotFound):
        prepare_copies(request(image), state, tools=fake_tools(steps))
    assert steps.calls == []
    assert_nothing_left(state, steps, "c")


@pytest.mark.parametrize("fail_at", ["verify", "restore", "handshake", "publish"])
def test_one_copy_that_fails_leaves_nothing_and_lets_go_of_its_image(
    state: StateDir, image: Path, criu_found: list[str | None], fail_at: str
) -> None:
    steps = Steps(fail_at=fail_at)
    copies = prepare_copies(request(image), state, tools=fake_tools(steps))
    with pytest.raises(Exception, match=f"injected failure at {fail_at}"):
        copies(lanes()[1])
    assert steps.calls == COPY_STEPS[: COPY_STEPS.index(fail_at) + 1]
    assert_nothing_left(state, steps, "c")
    hold_image(image, exclusive=True).release()  # nobody holds it any more


def test_several_copies_start_each_on_its_lane_name_and_port(
    state: StateDir, image: Path, criu_found: list[str | None]
) -> None:
    steps = Steps()
    copies = prepare_copies(request(image, count=2), state, tools=fake_tools(steps))
    seen, progress_for = lanes()
    sessions, report = copies(progress_for)
    try:
        assert criu_found == [None]  # once for all of them
        assert isinstance(report, CopiesReport) and report.total_s > 0
        assert [(c.name, c.published) for c in report.copies] == [
            ("c-1", f"{PUBLISH[0]}:{PUBLISH[1]}"), ("c-2", f"{PUBLISH[0]}:{PUBLISH[1] + 1}")
        ]  # fmt: skip
        assert sorted(seen) == ["copy 1", "copy 2"]
        # The image verified once before the parallel starts, then each copy's own steps.
        assert steps.calls[0] == "verify"
        assert all(steps.calls.count(step) == 2 for step in ("restore", "handshake", "publish"))
    finally:
        for session in sessions:
            session.stop()
    assert_nothing_left(state, steps, "c-1", "c-2")


def test_several_copies_are_all_or_nothing(
    state: StateDir, image: Path, criu_found: list[str | None]
) -> None:
    steps = FailOnce(fail_at="handshake")
    copies = prepare_copies(request(image, count=2), state, tools=fake_tools(steps))
    with pytest.raises(Exception, match=r"1 of 2 copies failed \(the others were stopped\)"):
        copies(lanes()[1])
    assert steps.calls.count("handshake") == 2  # the other one served, then was stopped
    assert_nothing_left(state, steps, "c-1", "c-2")
    hold_image(image, exclusive=True).release()
