"""Shared pieces of the real-CRIU qualification tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.activation.session import Session
from snapctl.criu import find_criu
from snapctl.qualification.watch import HOST_SHM
from snapctl.statedir import StateDir


@contextmanager
def captured_image(
    tmp_path_factory: pytest.TempPathFactory, name: str, **options: object
) -> Iterator[Path]:
    """A fixture image captured once (donor stopped, audit clean), with SNAPCTL_STATE_DIR
    pointing at its state while the context lasts."""
    root = tmp_path_factory.mktemp(name)
    state = StateDir(root / "state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SNAPCTL_STATE_DIR", str(state.root))
        donor: Session | None = None
        try:
            donor, _ = start_donor(
                LaunchOptions(timeout_s=120, **options),  # type: ignore[arg-type]
                image=root / "image", force=False, criu=find_criu(), native=NoNativeStep(),
                publish=None, state=state, progress=lambda step: None,
            )  # fmt: skip
        finally:
            if donor is not None:
                _, audit = donor.stop()
                assert audit.clean, audit.describe()
        yield root / "image"


def assert_nothing_left(state: StateDir, shm_before: set[str]) -> None:
    """No activation directory, no temporary image, no link remap of ours in the host's shm."""
    assert list(state.activations.iterdir()) == []
    assert not (state.root / "qualify").exists() or list((state.root / "qualify").iterdir()) == []
    remaps = {name for name in os.listdir(HOST_SHM) if name.startswith("link_remap.")}
    assert remaps <= shm_before
