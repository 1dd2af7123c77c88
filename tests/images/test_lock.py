"""Image holds: shared readers coexist and exclude an exclusive hold, and the reverse."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.images.lock import ImageBusyError, hold_image


def test_shared_holds_coexist_and_block_exclusive(tmp_path: Path) -> None:
    with (
        hold_image(tmp_path),
        hold_image(tmp_path),
        pytest.raises(ImageBusyError, match="in use"),
    ):
        hold_image(tmp_path, exclusive=True)
    with hold_image(tmp_path, exclusive=True) as hold:
        assert hold.held
        with pytest.raises(ImageBusyError, match="being changed"):
            hold_image(tmp_path)
    hold_image(tmp_path, exclusive=True).release()


def test_release_is_idempotent_and_leaves_no_file(tmp_path: Path) -> None:
    hold = hold_image(tmp_path)
    hold.release()
    hold.release()
    assert not hold.held
    assert list(tmp_path.iterdir()) == []
