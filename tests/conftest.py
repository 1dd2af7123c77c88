"""Shared test setup: the ``criu`` marker's skip-or-fail policy and a real-CRIU fixture.

Tests marked ``@pytest.mark.criu`` need root and a usable CRIU (>= 4.2). Without them they are
skipped on a developer's machine, but fail under ``CI`` (set and not "0"/"false"): CI runs as
root with CRIU installed by scripts/setup, so a skip there would hide a broken install.
"""

from __future__ import annotations

import os
from functools import cache

import pytest

from snapctl.criu import CriuBinary, find_criu
from snapctl.errors import SnapctlError


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@cache
def _real_criu() -> tuple[CriuBinary | None, str]:
    """The real CRIU, or why there is none usable (looked up once per session)."""
    if os.geteuid() != 0:
        return None, "needs root"
    try:
        return find_criu(), ""
    except SnapctlError as error:
        return None, f"needs CRIU: {error.message}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("criu") is None:
        return
    criu, problem = _real_criu()
    if criu is not None:
        return
    if in_ci():
        pytest.fail(f"CI must run criu tests, but this machine {problem}", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def criu_binary() -> CriuBinary:
    """The real CRIU (use together with ``@pytest.mark.criu``)."""
    criu, problem = _real_criu()
    if criu is None:
        pytest.fail(f"criu_binary used without @pytest.mark.criu: {problem}", pytrace=False)
    return criu
