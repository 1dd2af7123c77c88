"""Activation names: checked before anything uses them, and unique while in use."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from snapctl.activation.copy import start_copies, start_copy
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.cli import main
from snapctl.criu import CriuBinary
from snapctl.errors import ExitStatus
from snapctl.images import ImageError
from snapctl.statedir import StateDir
from snapctl.statedir.names import (
    InvalidNameError,
    NameInUseError,
    ReservationHolder,
    check_name,
    lock_name,
    numbered_names,
)

BAD_NAMES = ["../../x", "a/b", "x" * 260, ".hidden", "-dash", "", "sp ace", "a\nb", "é"]


@pytest.mark.parametrize("name", ["a", "copy-1", "A.b_c-d", "9" * 64])
def test_good_names_pass(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", [*BAD_NAMES, "x" * 65])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidNameError) as info:
        check_name(name)
    assert info.value.exit_status == ExitStatus.USAGE


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_state_dir_builds_no_record_path_from_a_bad_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidNameError):
        StateDir(tmp_path).record_path(name)


def test_numbered_names_are_checked_whole() -> None:
    assert numbered_names("c", 2) == ["c-1", "c-2"]
    with pytest.raises(InvalidNameError):
        numbered_names("x" * 63, 2)  # "x...x-1" is 65 characters


def test_a_name_is_reserved_once_until_released(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    first = state.reserve_name("web")
    with pytest.raises(NameInUseError) as info:
        state.reserve_name("web")
    assert info.value.exit_status == ExitStatus.CONFLICT
    first.release()
    first.release()  # idempotent
    assert not (state.records / "web.lock").exists()
    state.reserve_name("web").release()


def test_a_name_with_a_record_is_in_use_though_no_one_holds_it(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.ensure()
    state.record_path("web").write_text("{}")  # its supervisor was killed; gc not yet run
    with pytest.raises(NameInUseError, match="snapctl gc"):
        state.reserve_name("web")
    assert not (state.records / "web.lock").exists()


def _hold_and_exit(records: Path) -> None:
    assert lock_name(records, "web") is not None  # never released: the process just ends


def test_a_dead_holder_frees_the_name(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.ensure()
    child = multiprocessing.get_context("fork").Process(
        target=_hold_and_exit, args=(state.records,)
    )
    child.start()
    child.join(10)
    assert child.exitcode == 0
    state.reserve_name("web").release()


def _copy_options(name: str) -> LaunchOptions:
    return LaunchOptions(name=name, timeout_s=5)


CRIU = CriuBinary(path=Path("/nonexistent/criu"), version="4.2.1", source="option")


def test_a_copy_with_a_name_in_use_is_refused_before_the_image_is_read(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    held = state.reserve_name("web")
    with pytest.raises(NameInUseError):
        start_copy(
            tmp_path / "no-such-image", _copy_options("web"), criu=CRIU, native=NoNativeStep(),
            publish=None, state=state, progress=lambda step: None,
        )  # fmt: skip
    held.release()


def test_a_failed_start_releases_its_name(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    with pytest.raises(ImageError):
        start_copy(
            tmp_path / "no-such-image", _copy_options("web"), criu=CRIU, native=NoNativeStep(),
            publish=None, state=state, progress=lambda step: None,
        )  # fmt: skip
    state.reserve_name("web").release()


def test_count_refuses_every_copy_when_one_name_is_in_use(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    held = state.reserve_name("web-2")
    with pytest.raises(NameInUseError):
        start_copies(
            tmp_path / "no-such-image", _copy_options("web"), 3, criu=CRIU,
            native=NoNativeStep(), publish_base=None, state=state,
            progress_for=lambda label: lambda step: None,
        )  # fmt: skip
    held.release()
    for name in ("web-1", "web-2", "web-3"):  # all released again
        state.reserve_name(name).release()


@pytest.mark.parametrize("command", ["copy", "donor"])
def test_the_cli_refuses_a_bad_name_as_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    image = tmp_path / "image"
    image.mkdir()
    assert main([command, "--image", str(image), "--name", "../../x"]) == ExitStatus.USAGE
    assert not (tmp_path / "state").exists()  # refused before anything was written


def test_the_cli_refuses_count_names_that_grow_too_long(tmp_path: Path) -> None:
    assert main(["copy", "--image", str(tmp_path), "--name", "x" * 63, "--count", "2"]) == 2


@pytest.mark.parametrize("command", ["stop", "logs"])
def test_stop_and_logs_refuse_a_bad_name(command: str) -> None:
    assert main([command, "../../etc"]) == ExitStatus.USAGE


def test_a_reservation_names_its_holder_and_a_look_names_no_one(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    assert state.name_holder("web") is None  # no lock file at all
    held = state.reserve_name("web")
    holder = state.name_holder("web")
    assert holder == ReservationHolder.current() and holder is not None
    assert holder.pid == os.getpid() and holder.start_ticks > 0 and holder.boot_id
    with pytest.raises(NameInUseError):
        state.check_name_free("web")  # refused as a reservation would be
    held.release()
    assert state.name_holder("web") is None  # released: the file is gone

    state.check_name_free("web")
    assert not (state.records / "web.lock").exists()  # the look left nothing behind


def test_only_the_live_holder_itself_is_pinned(tmp_path: Path) -> None:
    from snapctl.activation.supervise import live_holder, pin_holder

    state = StateDir(tmp_path)
    held = state.reserve_name("web")
    pinned = live_holder(state, "web")
    assert pinned is not None and pinned.pid == os.getpid()
    pinned.close()
    me = ReservationHolder.current()
    # The same PID, started at another time or in another boot, is another process.
    assert pin_holder(ReservationHolder(me.pid, me.start_ticks + 1, me.boot_id)) is None
    assert pin_holder(ReservationHolder(me.pid, me.start_ticks, "another-boot")) is None
    assert ReservationHolder.parse("") is None and ReservationHolder.parse("12 x y") is None
    held.release()


def test_a_dead_holder_s_lock_file_names_a_process_that_is_not_pinned(tmp_path: Path) -> None:
    from snapctl.activation.supervise import live_holder

    state = StateDir(tmp_path)
    state.ensure()
    child = multiprocessing.get_context("fork").Process(target=_reserve_and_exit, args=(tmp_path,))
    child.start()
    child.join(10)
    assert child.exitcode == 0
    holder = state.name_holder("web")
    assert holder is not None and holder.pid == child.pid  # its lock file stays, naming it
    assert live_holder(state, "web") is None


def _reserve_and_exit(root: Path) -> None:
    StateDir(root).reserve_name("web")  # never released: the process just ends
