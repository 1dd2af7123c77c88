"""ControlDir: the safety checks (on every access), typed reads, create-once writes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from snapctl.errors import ControlDirError, ProtocolError
from snapctl.protocol.atomic import write_json_atomic
from snapctl.protocol.controldir import ControlDir, ControlModel, create_control_dir
from snapctl.protocol.models import Activation, ControlFile, Status
from tests.protocol.factories import (
    make_activation,
    make_challenge,
    make_error,
    make_ready,
    make_release,
    make_status,
    ready_fields,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")
OTHER_UID = 54321


@pytest.fixture
def control(tmp_path: Path) -> ControlDir:
    path = tmp_path / "control"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return ControlDir(path)


class TestValidate:
    def test_fresh_private_directory_passes(self, control: ControlDir) -> None:
        control.validate(require_empty=True)

    @pytest.mark.parametrize("path", ["relative/control", "control", ""])
    def test_relative_path_is_rejected(self, path: str) -> None:
        with pytest.raises(ControlDirError, match="absolute"):
            ControlDir(path).validate()

    def test_dotdot_is_rejected(self, control: ControlDir) -> None:
        # It would even resolve to the same, valid directory.
        sneaky = f"{control.path}/../{control.path.name}"
        with pytest.raises(ControlDirError, match=r"'\.\.'"):
            ControlDir(sneaky).validate()

    def test_missing_directory_is_rejected(self, tmp_path: Path) -> None:
        with pytest.raises(ControlDirError, match="does not exist"):
            ControlDir(tmp_path / "absent").validate()

    def test_regular_file_is_rejected(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("")
        os.chmod(tmp_path / "file", 0o600)
        with pytest.raises(ControlDirError, match="not a directory"):
            ControlDir(tmp_path / "file").validate()

    def test_symlinked_control_dir_is_rejected(self, control: ControlDir, tmp_path: Path) -> None:
        (tmp_path / "link").symlink_to(control.path)
        with pytest.raises(ControlDirError, match="symlink") as caught:
            ControlDir(tmp_path / "link").validate()
        assert caught.value.path == tmp_path / "link"

    def test_symlinked_ancestor_is_rejected(self, tmp_path: Path) -> None:
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        (real / "control").mkdir(mode=0o700)
        (tmp_path / "alias").symlink_to(real)
        with pytest.raises(ControlDirError, match="symlink component") as caught:
            ControlDir(tmp_path / "alias" / "control").validate()
        assert caught.value.path == tmp_path / "alias"

    @pytest.mark.parametrize("mode", [0o770, 0o707, 0o750, 0o705, 0o701, 0o710, 0o777])
    def test_group_or_other_bits_are_rejected(self, control: ControlDir, mode: int) -> None:
        os.chmod(control.path, mode)
        with pytest.raises(ControlDirError, match=f"{mode:04o}"):
            control.validate()

    @pytest.mark.parametrize("mode", [0o700, 0o500])
    def test_owner_only_modes_pass(self, control: ControlDir, mode: int) -> None:
        os.chmod(control.path, mode)
        try:
            control.validate()
        finally:
            os.chmod(control.path, 0o700)

    @pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
    def test_group_or_world_writable_ancestor_is_rejected(self, tmp_path: Path, mode: int) -> None:
        parent = tmp_path / "shared"
        parent.mkdir()
        (parent / "control").mkdir(mode=0o700)
        os.chmod(parent, mode)
        with pytest.raises(ControlDirError, match="group- or world-writable") as caught:
            ControlDir(parent / "control").validate()
        assert caught.value.path == parent

    def test_root_owned_sticky_world_writable_ancestor_passes(self, tmp_path: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("the sticky exception is for root-owned directories")
        parent = tmp_path / "sticky"
        parent.mkdir()
        os.chmod(parent, 0o1777)
        (parent / "control").mkdir(mode=0o700)
        ControlDir(parent / "control").validate()

    @needs_root
    def test_sticky_ancestor_not_owned_by_root_is_rejected(self, tmp_path: Path) -> None:
        parent = tmp_path / "sticky"
        parent.mkdir()
        (parent / "control").mkdir(mode=0o700)
        os.chmod(parent, 0o1777)
        os.chown(parent, OTHER_UID, OTHER_UID)
        with pytest.raises(ControlDirError, match="untrusted owner"):
            ControlDir(parent / "control").validate()

    @needs_root
    def test_ancestor_owned_by_another_user_is_rejected(self, tmp_path: Path) -> None:
        parent = tmp_path / "theirs"
        parent.mkdir(mode=0o755)
        (parent / "control").mkdir(mode=0o700)
        os.chown(parent, OTHER_UID, OTHER_UID)
        with pytest.raises(ControlDirError, match="untrusted owner"):
            ControlDir(parent / "control").validate()

    @needs_root
    def test_control_dir_owned_by_another_user_is_rejected(self, control: ControlDir) -> None:
        os.chown(control.path, OTHER_UID, OTHER_UID)
        with pytest.raises(ControlDirError, match="not the effective uid"):
            control.validate()

    def test_non_empty_is_rejected_only_when_required(self, control: ControlDir) -> None:
        (control.path / "leftover").write_text("")
        control.validate()
        with pytest.raises(ControlDirError, match="must be empty, found 1 entries: leftover"):
            control.validate(require_empty=True)

    def test_checks_run_again_on_every_read_and_write(self, control: ControlDir) -> None:
        control.write(make_ready())
        assert control.read(ControlFile.CAPTURE_READY) == make_ready()
        os.chmod(control.path, 0o770)
        with pytest.raises(ControlDirError):
            control.read(ControlFile.CAPTURE_READY)
        with pytest.raises(ControlDirError):
            control.write(make_status(), overwrite=True)
        with pytest.raises(ControlDirError):
            control.present()
        with pytest.raises(ControlDirError):
            control.exists(ControlFile.STATUS)
        assert not control.file_path(ControlFile.STATUS).exists()

    def test_dir_swapped_for_a_symlink_is_caught_on_the_next_read(
        self, control: ControlDir, tmp_path: Path
    ) -> None:
        control.write(make_ready())
        moved = tmp_path / "moved"
        control.path.rename(moved)
        control.path.symlink_to(moved)
        with pytest.raises(ControlDirError, match="symlink"):
            control.read(ControlFile.CAPTURE_READY)


class TestFiles:
    def test_read_missing_is_none(self, control: ControlDir) -> None:
        for name in ControlFile:
            assert control.read(name) is None

    def test_each_model_goes_to_its_own_file(self, control: ControlDir) -> None:
        models: list[ControlModel] = [
            make_ready(),
            make_activation(),
            make_challenge(),
            make_release(),
            make_status(),
            make_error(),
        ]
        for model in models:
            control.write(model)
        for name, model in zip(ControlFile, models, strict=True):
            read = control.read(name)
            assert type(read) is type(model)
            assert read == model
            assert stat.S_IMODE(control.file_path(name).lstat().st_mode) == 0o600
        assert sorted(os.listdir(control.path)) == sorted(name.value for name in ControlFile)

    def test_present_lists_files_in_protocol_order(self, control: ControlDir) -> None:
        assert control.present() == ()
        control.write(make_status())
        control.write(make_ready())
        assert control.present() == (ControlFile.CAPTURE_READY, ControlFile.STATUS)

    @pytest.mark.parametrize(
        "model",
        [make_ready(), make_activation(), make_challenge(), make_release()],
        ids=lambda model: type(model).__name__,
    )
    def test_create_once_files_refuse_overwrite(
        self, control: ControlDir, model: Activation
    ) -> None:
        control.write(model)
        with pytest.raises(ProtocolError, match="refusing to overwrite"):
            control.write(model)
        with pytest.raises(ValueError, match="create-once"):
            control.write(model, overwrite=True)

    def test_status_and_error_may_be_overwritten(self, control: ControlDir) -> None:
        control.write(make_status())
        control.write(make_status(phase="validated"), overwrite=True)
        status = control.read(ControlFile.STATUS)
        assert isinstance(status, Status)
        assert status.phase == "validated"
        control.write(make_error())
        control.write(make_error(phase="recover"), overwrite=True)
        error = control.read(ControlFile.ERROR)
        assert error is not None
        assert error.phase == "recover"
        assert [name for name in os.listdir(control.path) if name.endswith(".tmp")] == []

    def test_unknown_names_and_models_are_refused(self, control: ControlDir) -> None:
        with pytest.raises(ValueError):
            control.file_path("../escape.json")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            control.write(object())  # type: ignore[arg-type]

    def test_symlinked_control_file_is_an_error(self, control: ControlDir, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "real.json", ready_fields())
        control.file_path(ControlFile.CAPTURE_READY).symlink_to(tmp_path / "real.json")
        with pytest.raises(ProtocolError, match="symlink"):
            control.read(ControlFile.CAPTURE_READY)

    def test_fifo_control_file_is_an_error(self, control: ControlDir) -> None:
        os.mkfifo(control.file_path(ControlFile.ACTIVATION), 0o600)
        with pytest.raises(ProtocolError, match="fifo"):
            control.read(ControlFile.ACTIVATION)

    def test_directory_control_file_is_an_error(self, control: ControlDir) -> None:
        control.file_path(ControlFile.ACTIVATION).mkdir()
        with pytest.raises(ProtocolError, match="directory"):
            control.read(ControlFile.ACTIVATION)

    def test_torn_control_file_is_an_error(self, control: ControlDir) -> None:
        control.file_path(ControlFile.ACTIVATION).write_text('{"version": 1, "capt')
        with pytest.raises(ProtocolError, match="not valid JSON"):
            control.read(ControlFile.ACTIVATION)

    def test_invalid_model_is_an_error(self, control: ControlDir) -> None:
        write_json_atomic(control.file_path(ControlFile.CAPTURE_READY), ready_fields(pid="1"))
        with pytest.raises(ProtocolError, match=r"invalid capture-ready\.json: pid"):
            control.read(ControlFile.CAPTURE_READY)


class TestCreate:
    @pytest.mark.parametrize("umask", [0o022, 0o077, 0o700])
    def test_creates_a_0700_directory_whatever_the_umask(self, tmp_path: Path, umask: int) -> None:
        previous = os.umask(umask)
        try:
            control = create_control_dir(tmp_path / "control")
        finally:
            os.umask(previous)
        assert stat.S_IMODE(control.path.lstat().st_mode) == 0o700
        control.validate(require_empty=True)

    def test_adopts_an_existing_empty_private_directory(self, control: ControlDir) -> None:
        assert create_control_dir(control.path).path == control.path

    def test_refuses_a_non_empty_directory(self, control: ControlDir) -> None:
        control.write(make_ready())
        with pytest.raises(ControlDirError, match="must be empty"):
            create_control_dir(control.path)

    def test_refuses_an_existing_unsafe_directory(self, tmp_path: Path) -> None:
        (tmp_path / "control").mkdir(mode=0o755)
        os.chmod(tmp_path / "control", 0o755)
        with pytest.raises(ControlDirError, match="0755"):
            create_control_dir(tmp_path / "control")

    def test_refuses_a_symlink(self, control: ControlDir, tmp_path: Path) -> None:
        (tmp_path / "link").symlink_to(control.path)
        with pytest.raises(ControlDirError, match="symlink"):
            create_control_dir(tmp_path / "link")

    def test_does_not_create_under_an_unsafe_ancestor(self, tmp_path: Path) -> None:
        parent = tmp_path / "shared"
        parent.mkdir()
        os.chmod(parent, 0o777)
        with pytest.raises(ControlDirError, match="world-writable"):
            create_control_dir(parent / "control")
        assert not (parent / "control").exists()

    def test_missing_parent_is_an_error(self, tmp_path: Path) -> None:
        with pytest.raises(ControlDirError, match="does not exist"):
            create_control_dir(tmp_path / "absent" / "control")
