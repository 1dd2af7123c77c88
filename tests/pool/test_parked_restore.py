"""A parked copy's restore, with CRIU stood in for (no root): a lazy copy reads its image long
after the restore, so a change to the image while the restore runs must show later too."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapctl.activation.requests import CopyRequest
from snapctl.images.store import load_manifest
from snapctl.pool.supervisor import parked
from tests.images.factories import publish_sample


def _restored(image: Path, monkeypatch: pytest.MonkeyPatch, *, change: bool) -> parked._Parked:
    copy = object.__new__(parked._Parked)
    copy.image, copy.state = image, None  # type: ignore[assignment]
    copy.reporter = SimpleNamespace(progress=print)  # type: ignore[assignment]
    copy.request = CopyRequest(image=str(image), lazy=True)
    copy.manifest_stat, copy.file_keys = None, None

    def restore_copy(*args: Any, **kwargs: Any) -> SimpleNamespace:
        if change:  # in place, after the restore verified the image: a page file rewritten
            with (image / "criu" / "pages-1.img").open("r+b") as pages:
                pages.write(b"changed")
        return SimpleNamespace(manifest=load_manifest(image), session=None)

    monkeypatch.setattr(parked, "restore_copy", restore_copy)
    monkeypatch.setattr("snapctl.criu.find_criu", lambda path: None)
    copy.restore()
    return copy


@pytest.mark.parametrize("change", [False, True])
def test_a_lazy_copy_sees_an_image_changed_during_its_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: bool
) -> None:
    image = tmp_path / "image"
    publish_sample(image)
    assert _restored(image, monkeypatch, change=change).still_verified() is not change
