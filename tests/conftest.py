"""Shared test setup: the ``criu`` marker's skip-or-fail policy and a real-CRIU fixture; the
state directory and captured image of the real agent and pool tests (``agent_state``,
``donor_image``; their helpers are in tests/agent/helpers.py).

Tests marked ``@pytest.mark.registry`` need Debian's ``docker-registry`` (started on loopback
by the ``registry_server`` fixture), and those marked ``@pytest.mark.podman`` need root,
``podman`` and ``runc``, with the same policy.

Tests marked ``@pytest.mark.criu`` need root and a usable CRIU (>= 4.2). Without them they are
skipped on a developer's machine, but fail under ``CI`` (set and not "0"/"false"): CI runs as
root with CRIU installed by scripts/setup, so a skip there would hide a broken install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest

from snapctl.criu import CriuBinary, find_criu
from snapctl.errors import SnapctlError
from snapctl.statedir import StateDir
from tests.containers import Placeholder
from tests.registry.server import BINARY as REGISTRY_BINARY
from tests.registry.server import RegistryServer, registry_binary, start_registry

T = TypeVar("T")


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


def _registry() -> tuple[str | None, str]:
    binary = registry_binary()
    return binary, "" if binary else f"needs {REGISTRY_BINARY} (scripts/setup installs it)"


def _podman() -> tuple[str | None, str]:
    if os.geteuid() != 0:
        return None, "needs root"
    missing = [name for name in ("podman", "runc") if shutil.which(name) is None]
    if missing:
        return None, f"needs {' and '.join(missing)} (scripts/setup installs them)"
    return shutil.which("podman"), ""


def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_unless_found(item, "registry", _registry)
    skip_unless_found(item, "podman", _podman)
    skip_unless_found(item, "criu", _real_criu)


def skip_or_fail(marker: str, problem: str) -> None:
    """Skip a test this machine cannot run, but fail it under CI, which must run them all."""
    if in_ci():
        pytest.fail(f"CI must run {marker} tests, but this machine {problem}", pytrace=False)
    pytest.skip(problem)


def skip_unless_found(
    item: pytest.Item, marker: str, find: Callable[[], tuple[object | None, str]]
) -> None:
    """For a test marked ``marker``: :func:`skip_or_fail` where ``find()`` (what the marker
    needs, or None and why) finds nothing."""
    if item.get_closest_marker(marker) is not None:
        found, problem = find()
        if found is None:
            skip_or_fail(marker, problem)


def found_or_fail(fixture: str, marker: str, find: Callable[[], tuple[T | None, str]]) -> T:
    """What a fixture provides, found by ``find()``; a test that uses it without ``marker``
    (so nothing skipped it) fails, saying why."""
    found, problem = find()
    if found is None:
        pytest.fail(f"{fixture} used without @pytest.mark.{marker}: {problem}", pytrace=False)
    return found


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A real registry on loopback for the session (use with ``@pytest.mark.registry``)."""
    server = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def criu_binary() -> CriuBinary:
    """The real CRIU (use together with ``@pytest.mark.criu``)."""
    return found_or_fail("criu_binary", "criu", _real_criu)


@pytest.fixture
def agent_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StateDir]:
    """A state directory for a test that runs agents, pools and copies for real, with the
    fixture server's API key in the environment; afterwards whatever still runs in it
    (parked copies, activations, orphans) is ended."""
    from tests.activation.criu_helpers import API_KEY, API_KEY_ENV
    from tests.agent.helpers import clean_up

    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    state = StateDir(tmp_path / "state")
    yield state
    clean_up(state)


@pytest.fixture
def donor_image(tmp_path: Path, agent_state: StateDir, criu_binary: CriuBinary) -> tuple[Path, Any]:
    """An image of the fixture server captured in ``agent_state`` (``tmp_path/image``), and
    the donor's greedy completion before it was stopped (use with ``@pytest.mark.criu``)."""
    from tests.agent.helpers import capture_donor

    return capture_donor(tmp_path, agent_state, criu_binary)


@pytest.fixture
def placeholder() -> Iterator[Callable[..., Placeholder]]:
    """Starts a placeholder container when called (after the image exists: its overlay shows
    the host's files as they were then; ``start=False``: created, never started); each
    removed by its name afterwards."""
    made: list[Placeholder] = []

    def make(*, start: bool = True, volumes: Sequence[str] = ()) -> Placeholder:
        made.append(Placeholder.create(start=start, volumes=volumes))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.remove()
