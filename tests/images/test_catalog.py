"""Image listing (no hashing; verified from the cache) and removal under an exclusive hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.images.catalog import list_images, remove_image, server_summary
from snapctl.images.lock import ImageBusyError, hold_image
from snapctl.images.store import ImageError, verify_image
from tests.images.factories import publish_sample


def test_list_images_reports_each_image_and_its_verification(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "verified"
    publish_sample(root / "b", image_id="b" * 32)
    publish_sample(root / "a", image_id="a" * 32)
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text("{}")
    (root / "not-an-image").mkdir()
    verify_image(root / "a", cache_dir=cache)

    rows = {Path(row.path).name: row for row in list_images(root, cache)}

    assert sorted(rows) == ["a", "b", "broken"]
    assert rows["a"].verified and not rows["b"].verified
    assert rows["a"].image_id == "a" * 32 and rows["a"].criu_version == "4.2.1"
    assert rows["a"].bytes and rows["a"].bytes > 300_000 and rows["a"].schema_version == 2
    assert rows["broken"].problem and "not a valid manifest" in rows["broken"].problem
    path = root / "a" / "criu" / "core-1.img"
    path.write_bytes(path.read_bytes())  # rewritten (same bytes): no longer known verified
    assert not {Path(r.path).name: r for r in list_images(root, cache)}["a"].verified


def test_list_of_a_missing_root_is_empty(tmp_path: Path) -> None:
    assert list_images(tmp_path / "nothing", tmp_path) == []


@pytest.mark.parametrize(
    ("argv", "summary"),
    [
        (["/venv/bin/python", "-m", "fixtures", "serve", "--model", "/m", "--port", "1"],
         "python -m fixtures serve --model /m"),
        (["vllm", "serve", "meta/llama", "--port", "8000"], "vllm serve meta/llama"),
        (["srv", "--port", "1", "--model=/m/x"], "srv --model /m/x"),
        ([], "-"),
    ],
)  # fmt: skip
def test_server_summary(argv: list[str], summary: str) -> None:
    assert server_summary(argv) == summary


def test_remove_refuses_while_held_then_removes(tmp_path: Path) -> None:
    image = tmp_path / "image"
    publish_sample(image)

    with hold_image(image), pytest.raises(ImageBusyError, match="in use"):
        remove_image(image)
    assert (image / "manifest.json").exists()

    remove_image(image)
    assert list(tmp_path.iterdir()) == []


def test_remove_refuses_a_directory_that_is_not_an_image(tmp_path: Path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data").write_text("keep")

    with pytest.raises(ImageError, match="not a published image"):
        remove_image(tmp_path / "precious")
    assert (tmp_path / "precious" / "data").read_text() == "keep"
