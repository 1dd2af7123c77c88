"""``snapctl images``, ``image export/import/rm`` and ``inspect`` on small sample images, and
``copy``'s early refusal of a waiver that cannot be given (no CRIU needed)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapctl.cli import main, snapctl
from snapctl.errors import ExitStatus
from snapctl.images.lock import hold_image
from snapctl.images.store import verify_image
from snapctl.statedir import StateDir
from tests.images.factories import flip_byte, publish_sample


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(snapctl, list(args))
    return result.exit_code, result.stdout


def test_export_import_then_images_lists_both(tmp_path: Path) -> None:
    root = tmp_path / "images"
    manifest = publish_sample(
        root / "a",
        external_mounts={"shm": "/dev/shm", "host:/usr/local/nvidia": "/usr/local/nvidia"},
    )
    archive = tmp_path / "a.tar.zst"

    code, out = run("image", "export", str(root / "a"), "--out", str(archive), "--json")
    assert code == 0, out
    exported = json.loads(out)
    assert exported["archive_bytes"] == archive.stat().st_size
    assert exported["image_bytes"] > 300_000 and exported["mb_per_s"] > 0

    code, out = run("image", "import", str(archive), "--to", str(root / "b"), "--json")
    assert code == 0, out
    imported = json.loads(out)
    assert imported["image_id"] == manifest.image_id
    assert imported["archive_sha256"] == exported["archive_sha256"]
    assert imported["manifest_sha256"] == exported["manifest_sha256"]

    code, out = run("images", "--root", str(root), "--json")
    rows = {Path(row["path"]).name: row for row in json.loads(out)}
    assert code == 0 and sorted(rows) == ["a", "b"]
    assert rows["b"]["verified"] is True and rows["a"]["verified"] is False

    code, out = run("inspect", str(root / "a"), "--verify")
    assert code == 0 and "every sha256 matches" in out and "libx.so" in out
    code, out = run("inspect", str(root / "a"), "--brief")
    assert code == 0 and "capture id" in out and "libx.so" not in out
    assert "host mounts" in out and "/usr/local/nvidia" in out
    code, out = run("images", "--root", str(root))
    assert code == 0 and out.count("yes") == 2  # --verify recorded a


def test_image_rm_refuses_while_held(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "image"
    publish_sample(image)

    with hold_image(image):
        assert main(["image", "rm", str(image)]) == ExitStatus.CONFLICT
    assert "is in use" in capsys.readouterr().err and image.exists()

    assert main(["image", "rm", str(image), "--json"]) == ExitStatus.OK
    assert json.loads(capsys.readouterr().out) == {"removed": str(image)}
    assert not image.exists()


def test_import_of_a_damaged_archive_exits_verify_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish_sample(tmp_path / "a")
    archive = tmp_path / "a.tar.zst"
    assert main(["image", "export", str(tmp_path / "a"), "--out", str(archive)]) == 0
    flip_byte(archive, mask=0x01)

    code = main(["image", "import", str(archive), "--to", str(tmp_path / "b")])

    assert code == ExitStatus.VERIFY_FAILED
    assert "a.tar.zst" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_inspect_json_and_a_schema_1_image(tmp_path: Path) -> None:
    publish_sample(tmp_path / "v1", schema_version=1, identity=None)

    code, out = run("inspect", str(tmp_path / "v1"), "--json")
    assert code == 0 and json.loads(out)["manifest"]["identity"] is None
    code, out = run("inspect", str(tmp_path / "v1"))
    assert code == 0 and "not recorded (schema 1 image)" in out


@pytest.mark.parametrize(("field", "message"), [("files", "cannot be waived"),
                                                ("colour", "unknown identity field")])  # fmt: skip
def test_copy_refuses_a_bad_waiver_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, message: str
) -> None:
    publish_sample(tmp_path / "image")

    code = main(["copy", "--image", str(tmp_path / "image"), "--allow-mismatch", field])

    error = capsys.readouterr().err
    assert code == ExitStatus.USAGE and message in error and "'--allow-mismatch'" in error
    assert not (tmp_path / "state" / "activations").exists()


def _plant_symlink(image: Path) -> None:
    (image / "criu" / "ipcns-msg-11.img").symlink_to("core-1.img")


def _plant_file(image: Path) -> None:
    (image / "criu" / "ipcns-msg-11.img").write_bytes(b"\0" * 16)


def _plant_symlinked_directory(image: Path) -> None:
    os.rename(image / "criu", image.parent / "elsewhere")
    (image / "criu").symlink_to(image.parent / "elsewhere")


PLANTED = {
    "unlisted file": (_plant_file, "unexpected file in image: criu/ipcns-msg-11.img"),
    "symlink": (_plant_symlink, "image entry criu/ipcns-msg-11.img is a symlink"),
    "symlinked directory": (_plant_symlinked_directory, "image entry criu is a symlink"),
}


@pytest.mark.parametrize(("plant", "message"), PLANTED.values(), ids=PLANTED.keys())
def test_inspect_verify_refuses_anything_planted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plant: Callable[[Path], None], message: str
) -> None:
    publish_sample(tmp_path / "image")
    assert main(["inspect", str(tmp_path / "image"), "--verify"]) == 0
    plant(tmp_path / "image")
    capsys.readouterr()

    code = main(["inspect", str(tmp_path / "image"), "--verify"])

    err = capsys.readouterr().err
    assert code != 0 and message in err and "bake it again" in err


@pytest.mark.criu  # copy finds CRIU before it reads the image
@pytest.mark.parametrize(("plant", "message"), PLANTED.values(), ids=PLANTED.keys())
def test_copy_refuses_anything_planted_before_criu_runs(
    tmp_path: Path,
    state: Path,
    capsys: pytest.CaptureFixture[str],
    plant: Callable[[Path], None],
    message: str,
) -> None:
    publish_sample(tmp_path / "image")
    # Verified as a copy verifies (the cache then vouches for every listed file), then planted.
    verify_image(tmp_path / "image", cache_dir=StateDir(state).verified)
    assert list(StateDir(state).verified.iterdir())
    plant(tmp_path / "image")
    capsys.readouterr()

    code = main(["copy", "--image", str(tmp_path / "image")])

    assert code != 0 and message in capsys.readouterr().err
    assert not (state / "activations").exists() or not any((state / "activations").iterdir())
    assert not list(state.glob("logs/copy-*/restore.log"))  # CRIU never ran


def test_images_with_nothing_to_list_says_where_it_looked_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=200, color_system=None)
    monkeypatch.setattr("snapctl.cli.output.stderr", lambda: console)
    empty = tmp_path / "empty"
    empty.mkdir()

    code, _ = run("images", "--root", str(empty))
    assert code == 0
    assert f"no images in {empty}" in terminal.getvalue()
    assert "snapctl images --root DIR" in terminal.getvalue()

    code, out = run("images", "--root", str(empty), "--json")
    assert code == 0 and json.loads(out) == [] and terminal.getvalue().count("no images") == 1
