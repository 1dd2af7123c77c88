"""Parked copies' records without the pool: gc's sweep, the request model's strictness, and
which requests a parked copy can serve."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from snapctl.activation.requests import CopyRequest
from snapctl.pool.identity import restore_fits
from snapctl.pool.models import ActivationOrder
from snapctl.pool.records import RECORD_NAME, parked_home, pool_dir, sweep_parked
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from tests.pool.test_warm import make_record

pytestmark = pytest.mark.timeout(30)


def test_gc_sweeps_what_dead_parked_supervisors_left(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        records = {}
        for name, child in (("pool-00000000000a", dead), ("pool-00000000000b", alive)):
            home = parked_home(state, name)
            home.mkdir(parents=True)
            pid = alive.pid  # a start time read while alive; the dead one's PID is then wrong
            record = make_record(name, "/img", ("i", "d"), pid, os.getpid(), 0.0)
            if child is dead:
                record = record.model_copy(update={"supervisor_pid": dead.pid})
            write_json_atomic(home / RECORD_NAME, record)
            records[name] = home
        torn_old = parked_home(state, "pool-00000000000c")
        torn_old.mkdir()
        os.utime(torn_old, (time.time() - 120, time.time() - 120))
        torn_new = parked_home(state, "pool-00000000000d")
        torn_new.mkdir()
        (pool_dir(state) / "targets.json").write_text("{}")

        removed = sweep_parked(state)

        assert sorted(removed) == sorted([str(records["pool-00000000000a"]), str(torn_old)])
        assert records["pool-00000000000b"].exists() and torn_new.exists()
        assert alive.poll() is None  # a live supervisor discards itself: gc leaves it be
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"image": "relative/dir"}, "pattern"),
        ({"name": "../x"}, "pattern"),
        ({"timeout_s": float("inf")}, "positive, finite"),
        ({"timeout_s": 0}, "positive, finite"),
        ({"timeout_s": 1e10}, "at most 2592000"),
        ({"count": 0}, "greater than or equal to 1"),
        ({"publish": {"port": 70000}}, "less than or equal to 65535"),
        ({"native": "gpu"}, "'none' or 'cuda-checkpoint'"),
        ({"api_key_env": "A-B"}, "pattern"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"port": "8000"}, "valid integer"),
    ],
)
def test_copy_request_is_strict(changes: dict[str, object], problem: str) -> None:
    import json

    with pytest.raises(ValidationError, match=problem):
        CopyRequest.model_validate_json(json.dumps({"image": "/img", **changes}))


def test_api_key_is_never_shown() -> None:
    request = CopyRequest(image="/img", api_key="s3cret")  # type: ignore[arg-type]
    assert "s3cret" not in repr(request) and "s3cret" not in request.model_dump_json()
    order = ActivationOrder(action="activate", request=request)
    assert "s3cret" not in order.model_dump_json()


def test_restore_fits() -> None:
    parked = CopyRequest(image="/img", lazy=False)
    assert restore_fits(parked, CopyRequest(image="/img", name="n", timeout_s=5)) is None
    assert restore_fits(parked, CopyRequest(image="/img", lazy=False)) is None
    assert (
        restore_fits(parked, CopyRequest(image="/other")) == "image differs from the parked copy's"
    )
    assert restore_fits(parked, CopyRequest(image="/img", lazy=True)) is not None
    assert restore_fits(parked, CopyRequest(image="/img", host="127.0.0.2")) is not None
    assert restore_fits(parked, CopyRequest(image="/img", allow_mismatch=("kernel",))) is not None
    assert restore_fits(parked, CopyRequest(image="/img", count=2)) is not None


def test_a_state_dir_too_long_for_the_sockets_is_refused(tmp_path: Path) -> None:
    from snapctl.pool import WarmPool
    from snapctl.pool.warm import PoolError

    state = StateDir(tmp_path / ("s" * 80))
    warm = WarmPool(state, spawner=None)  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="too long a path"):
        warm.set(tmp_path, 1)


def test_the_api_key_goes_under_one_private_name_whatever_the_request_calls_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from snapctl.pool.supervisor.common import PROBE_KEY_ENV, launch_options

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(PROBE_KEY_ENV, raising=False)
    request = CopyRequest(image="/i", api_key_env="LD_PRELOAD", api_key="/tmp/evil.so")
    options = launch_options(request)
    assert "LD_PRELOAD" not in os.environ
    assert options.api_key_env == PROBE_KEY_ENV and options.api_key == "/tmp/evil.so"
    monkeypatch.delenv(PROBE_KEY_ENV)
    assert launch_options(CopyRequest(image="/i", api_key_env="HOME")).api_key is None


def test_the_pool_key_is_the_same_whatever_the_spelling(tmp_path: Path) -> None:
    from snapctl.pool.warm import image_key

    image = tmp_path / "images" / "web"
    image.mkdir(parents=True)
    (tmp_path / "link").symlink_to(image)
    spellings = [image, tmp_path / "images" / ".." / "images" / "web", tmp_path / "link"]
    assert {image_key(path) for path in spellings} == {str(image.resolve())}


def test_a_parked_copy_s_limits_serve_a_request_that_asks_none_or_the_same() -> None:
    parked = CopyRequest(image="/img", lazy=False, memory_bytes=1 << 30, cpus=2.0)
    assert restore_fits(parked, CopyRequest(image="/img")) is None
    assert restore_fits(parked, CopyRequest(image="/img", memory_bytes=1 << 30, cpus=2.0)) is None
    assert restore_fits(parked, CopyRequest(image="/img", memory_bytes=2 << 30)) == (
        "memory_bytes differs from the parked copy's"
    )
    assert restore_fits(parked, CopyRequest(image="/img", cpus=1.0)) == (
        "cpus differs from the parked copy's"
    )
