"""The steps of donor, bake and copy, in order, and their cleanup at every failure point, run
without root through fake tools (see ``fake_tools``); the real steps are tested with CRIU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapctl.activation.bake import bake_image
from snapctl.activation.copy import activate_copy, restore_copy, start_copy
from snapctl.activation.donor import CaptureError, start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.activation.states import SessionState, TransitionError, check_transition
from snapctl.images import load_manifest
from snapctl.images.lock import hold_image
from snapctl.namespaces.devices import DevLayoutError
from snapctl.statedir import STOPPED_FILE, StateDir, StopOutcome
from tests.activation.fake_tools import (
    CAPTURE_ID,
    CRIU,
    FakeSandbox,
    InjectedFailure,
    Steps,
    fake_tools,
)

DONOR_STEPS = [
    "create_dirs", "launch", "wait_capture_ready", "capture_identity", "external_mounts",
    "require_dumpable", "dump", "connect", "handshake", "probe", "publish",
]  # fmt: skip
COPY_STEPS = [
    "verify", "check_identity", "create_dirs", "stage_shm", "restore", "connect", "handshake",
    "probe", "publish",
]  # fmt: skip
PUBLISH = ("127.0.0.1", 18123)


def options(name: str | None = None) -> LaunchOptions:
    return LaunchOptions(server_argv=["fake-server", "--serve"], name=name, timeout_s=5)


def donor(state: StateDir, image: Path, steps: Steps, *, activate: bool = True) -> object:
    return start_donor(
        options("d"), image=image, force=False, criu=CRIU, native=NoNativeStep(),
        publish=PUBLISH, state=state, progress=lambda step: None, activate_donor=activate,
        tools=fake_tools(steps),
    )  # fmt: skip


def assert_nothing_left(state: StateDir, steps: Steps, *names: str) -> None:
    assert steps.trees_running() == []
    assert list(state.activations.iterdir()) == []
    assert state.load_records() == []
    for name in names:  # every name is free again
        state.reserve_name(name).release()


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return state


@pytest.fixture
def image(tmp_path: Path, state: StateDir) -> Path:
    """An image published by a donor on fake tools (its files are real), the donor stopped."""
    steps = Steps()
    session, _ = donor(state, tmp_path / "image", steps)  # type: ignore[misc]
    session.stop()
    return tmp_path / "image"


def test_a_donor_runs_its_steps_in_order_and_serves(state: StateDir, tmp_path: Path) -> None:
    steps = Steps()
    session, report = donor(state, tmp_path / "image", steps)  # type: ignore[misc]
    try:
        assert steps.calls == DONOR_STEPS
        assert session.state is SessionState.SERVING
        assert report.kind == "donor" and report.published == "127.0.0.1:18123"
        assert report.handshake_phases == ["restore", "validate"]
        assert set(report.timings_s) >= {"launch_to_capture_ready", "dump", "handshake"}
        assert [record.name for record in state.load_records()] == ["d"]
        assert load_manifest(tmp_path / "image").capture_id == CAPTURE_ID
    finally:
        _, audit = session.stop()
    assert audit.clean and session.state is SessionState.STOPPED
    assert_nothing_left(state, steps, "d")


@pytest.mark.parametrize("fail_at", DONOR_STEPS)
def test_a_donor_that_fails_at_any_step_leaves_nothing(
    state: StateDir, tmp_path: Path, fail_at: str
) -> None:
    steps = Steps(fail_at=fail_at)
    with pytest.raises((InjectedFailure, CaptureError)) as info:
        donor(state, tmp_path / "image", steps)
    assert steps.calls == DONOR_STEPS[: DONOR_STEPS.index(fail_at) + 1]
    assert "cleanup: clean" in str(info.value) or fail_at == "create_dirs"
    captured = DONOR_STEPS.index(fail_at) > DONOR_STEPS.index("dump")
    # Until the dump succeeded nothing is published; an image published stays.
    assert (tmp_path / "image").exists() is captured
    assert [p.name for p in tmp_path.iterdir() if p.name != "state"] == (
        ["image"] if captured else []
    )
    assert_nothing_left(state, steps, "d")


def test_a_failed_dump_is_the_captures_error(state: StateDir, tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="capture failed, no image published") as info:
        donor(state, tmp_path / "image", Steps(fail_at="dump"))
    assert info.value.phase == "capture"


def test_bake_never_activates_and_stops_the_original(state: StateDir, tmp_path: Path) -> None:
    steps = Steps()
    report = bake_image(
        options(), image=tmp_path / "image", force=False, criu=CRIU, native=NoNativeStep(),
        state=state, progress=lambda step: None, tools=fake_tools(steps),
    )  # fmt: skip
    assert steps.calls == DONOR_STEPS[: DONOR_STEPS.index("dump") + 1]
    assert report.clean and report.image_id == load_manifest(tmp_path / "image").image_id
    assert_nothing_left(state, steps)


def copy(state: StateDir, image: Path, steps: Steps, name: str = "c") -> object:
    return start_copy(
        image, options(name), criu=CRIU, native=NoNativeStep(), publish=PUBLISH, state=state,
        progress=lambda step: None, tools=fake_tools(steps),
    )  # fmt: skip


def test_a_copy_runs_its_steps_in_order_and_serves(state: StateDir, image: Path) -> None:
    steps = Steps()
    session, report = copy(state, image, steps)  # type: ignore[misc]
    try:
        assert steps.calls == COPY_STEPS
        assert session.state is SessionState.SERVING and session.image_hold is None
        assert report.kind == "copy" and report.restore_stats == {"pages_restored": 1}
        assert not report.lazy and not report.from_pool
        assert set(report.timings_s) >= {"verify", "stage", "restore", "handshake"}
    finally:
        _, audit = session.stop()
    assert audit.clean
    assert_nothing_left(state, steps, "c")


@pytest.mark.parametrize("fail_at", COPY_STEPS)
def test_a_copy_that_fails_at_any_step_leaves_nothing_and_lets_go_of_its_image(
    state: StateDir, image: Path, fail_at: str
) -> None:
    steps = Steps(fail_at=fail_at)
    with pytest.raises(Exception, match=f"injected failure at {fail_at}"):
        copy(state, image, steps)
    assert steps.calls == COPY_STEPS[: COPY_STEPS.index(fail_at) + 1]
    assert_nothing_left(state, steps, "c")
    hold_image(image, exclusive=True).release()  # nobody holds it any more


def test_a_parked_copy_waits_until_activated_under_another_name(
    state: StateDir, image: Path
) -> None:
    steps = Steps()
    tools = fake_tools(steps)
    parked = restore_copy(
        image, options("pool-1"), criu=CRIU, native=NoNativeStep(), state=state,
        progress=lambda step: None, tools=tools,
    )  # fmt: skip
    assert parked.session.state is SessionState.PARKED and parked.session.alive()
    assert "handshake" not in steps.calls and state.load_records() == []
    session, report = activate_copy(
        parked, options(), publish=None, progress=lambda step: None, name="web", tools=tools,
    )  # fmt: skip
    try:
        assert steps.calls[-3:] == ["connect", "handshake", "probe"]
        assert report.name == "web" and [r.name for r in state.load_records()] == ["web"]
        state.reserve_name("pool-1").release()  # the parked name was let go
    finally:
        session.stop()
    assert_nothing_left(state, steps, "web")


def test_a_parked_copy_that_fails_to_activate_is_stopped(state: StateDir, image: Path) -> None:
    steps = Steps()
    tools = fake_tools(steps)
    parked = restore_copy(
        image, options("pool-1"), criu=CRIU, native=NoNativeStep(), state=state,
        progress=lambda step: None, tools=tools,
    )  # fmt: skip
    steps.fail_at = "handshake"
    with pytest.raises(InjectedFailure):
        activate_copy(parked, options(), publish=None, progress=print, name="web", tools=tools)
    assert parked.session.state is SessionState.FAILED
    assert_nothing_left(state, steps, "web", "pool-1")


def test_the_lifecycle_refuses_what_it_does_not_allow() -> None:
    check_transition(SessionState.PARKED, SessionState.ACTIVATING)
    with pytest.raises(TransitionError):
        check_transition(SessionState.RESTORED, SessionState.SERVING)  # never activated
    with pytest.raises(TransitionError):
        check_transition(SessionState.STOPPED, SessionState.STOPPING)
    for state in SessionState:  # every live state can be stopped
        if state not in (SessionState.STOPPING, SessionState.STOPPED, SessionState.FAILED):
            check_transition(state, SessionState.STOPPING)


def test_a_second_stop_tears_nothing_down_again(
    state: StateDir, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = Steps()
    session, _ = copy(state, image, steps)  # type: ignore[misc]
    first = session.stop()
    dropped: list[str] = []  # its name may be another activation's record by now
    monkeypatch.setattr(session.state_dir, "drop_record", dropped.append)
    assert session.stop() == first and dropped == []


def test_a_stop_keeps_how_it_ended_in_the_logs_before_the_record_goes(
    state: StateDir, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = Steps()
    session, _ = copy(state, image, steps)  # type: ignore[misc]
    session.failure = "lazy-pages daemon killed by SIGKILL before every page was copied"
    kept = session.dirs.logs / STOPPED_FILE
    seen_at_drop: list[bool] = []
    drop = state.drop_record

    def dropping(name: str) -> None:
        seen_at_drop.append(kept.exists())  # a client that sees the record gone finds it
        drop(name)

    monkeypatch.setattr(session.state_dir, "drop_record", dropping)
    how, audit = session.stop()
    assert seen_at_drop == [True]
    outcome = StopOutcome.model_validate_json(kept.read_text())
    assert outcome == StopOutcome(
        name=session.name, stopped=how, audit=audit.model_dump(), failure=session.failure
    )


def test_an_image_that_kept_the_hosts_dev_is_refused_before_criu_where_dev_differs(
    state: StateDir, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As captured before sandboxes built their own /dev: no sandbox_dev recorded.
    manifest = image / "manifest.json"
    recorded = json.loads(manifest.read_text())
    assert recorded.pop("sandbox_dev") == "own"
    manifest.write_text(json.dumps(recorded))
    monkeypatch.setattr(FakeSandbox, "dev_fstype", lambda self: "tmpfs")  # a container's
    steps = Steps()
    with pytest.raises(DevLayoutError, match="bake the image again"):
        copy(state, image, steps)
    assert "restore" not in steps.calls
    assert_nothing_left(state, steps, "c")
