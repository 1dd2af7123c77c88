"""The CLI end to end with real CRIU: detached donor and ``copy --count N --detach``, then
``ps``/``stop`` per copy while its siblings keep serving, and nothing left at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from snapctl.activation.supervise import collect_orphans, stop_recorded
from snapctl.images import load_manifest
from snapctl.images.manifest import MANIFEST_NAME
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import API_KEY, API_KEY_ENV, get

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """The state dir of the CLI runs; whatever a failed test left running is stopped after."""
    path = tmp_path / "state"
    yield path
    records = StateDir(path)
    for record in records.load_records():
        stop_recorded(record, records)
    collect_orphans(records)


def snapctl(
    state: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state), API_KEY_ENV: API_KEY, **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "snapctl", *args], env=env, capture_output=True, text=True,
        timeout=180, check=False,
    )  # fmt: skip


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_count_detach_copies_stop_one_at_a_time(
    tmp_path: Path, state: Path, criu_binary: object
) -> None:
    image = tmp_path / "image"
    key = ("--api-key-env", API_KEY_ENV)
    donor = json.loads(ok(snapctl(state, "donor", "--image", str(image), "--name", "d", *key,
                                  "--detach", "--json")))  # fmt: skip
    assert donor["name"] == "d" and donor["image_id"]
    ok(snapctl(state, "stop", "d"))

    started = json.loads(ok(snapctl(state, "copy", "--image", str(image), "--name", "c",
                                    "--count", "2", "--publish", "127.0.0.1:0", *key,
                                    "--detach", "--json")))  # fmt: skip
    copies = {copy["name"]: copy for copy in started["copies"]}
    assert sorted(copies) == ["c-1", "c-2"] and started["total_s"] > 0
    listed = {row["name"]: row for row in json.loads(ok(snapctl(state, "ps", "--json")))}
    assert sorted(listed) == ["c-1", "c-2"] and all(row["running"] for row in listed.values())
    supervisors = {row["supervisor_pid"] for row in listed.values()}
    assert len(supervisors) == 1  # one supervisor for the whole --count

    assert "cleanup: clean" in ok(snapctl(state, "stop", "c-1"))
    assert get(copies["c-2"]["published"], "/v1/models")[0] == 200  # its sibling still serves
    assert [row["name"] for row in json.loads(ok(snapctl(state, "ps", "--json")))] == ["c-2"]
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state)}
    follower = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "logs", "--follow", "c-2"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert follower.stdout is not None
    # Its first line: it found c-2 and follows it (a stop before that would find no c-2).
    first = follower.stdout.readline()
    assert get(copies["c-2"]["published"], "/v1/models")[0] == 200  # one more line to follow
    assert "cleanup: clean" in ok(snapctl(state, "stop", "c-2"))
    rest, errors = follower.communicate(timeout=30)  # ends by itself once c-2 stopped
    followed = first + rest
    assert follower.returncode == 0, errors
    assert b"validated" in followed and b"GET /v1/models" in followed

    assert json.loads(ok(snapctl(state, "ps", "--json"))) == []
    assert list((state / "activations").iterdir()) == []
    supervisor = supervisors.pop()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(supervisor) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = psutil.pid_exists(supervisor) and psutil.Process(supervisor).status() != "zombie"
    assert not alive, "the supervisor exits once its copies are stopped"


def test_count_failure_stops_every_copy(tmp_path: Path, state: Path, criu_binary: object) -> None:
    """A copy that cannot serve (the probe's key is refused) fails the whole --count, cleanly."""
    image = tmp_path / "image"
    # Without a key a copy would serve (readiness is the open /health); a wrong one is refused.
    # (Set at capture too: the identity gate refuses a variable that was not.)
    wrong = {"WRONG_KEY": "not-the-key"}
    ok(snapctl(state, "donor", "--image", str(image), "--name", "d",
               "--api-key-env", API_KEY_ENV, "--detach", "--json", extra_env=wrong))  # fmt: skip
    ok(snapctl(state, "stop", "d"))
    result = snapctl(state, "copy", "--image", str(image), "--count", "2", "--json",
                     "--api-key-env", "WRONG_KEY", extra_env=wrong)  # fmt: skip
    assert result.returncode != 0
    assert "2 of 2 copies failed" in result.stderr and "401" in result.stderr
    assert result.stdout == ""
    assert list((state / "activations").iterdir()) == []


def test_detached_refusal_lists_every_difference(
    tmp_path: Path, state: Path, criu_binary: object
) -> None:
    image = tmp_path / "image"
    ok(snapctl(state, "bake", "--image", str(image), "--api-key-env", API_KEY_ENV, "--json"))
    manifest = load_manifest(image)
    assert manifest.identity is not None
    flags = [*manifest.identity.cpu_flags, "avx9000"]
    elsewhere = manifest.identity.model_copy(update={"kernel": "5.4.0-old", "cpu_flags": flags})
    payload = manifest.model_copy(update={"identity": elsewhere}).model_dump(mode="json")
    write_json_atomic(image / MANIFEST_NAME, payload, overwrite=True, max_bytes=1 << 24)
    result = snapctl(state, "copy", "--image", str(image), "--detach",
                     extra_env={"IDENTITY_TEST_EXTRA": "1"})  # fmt: skip
    assert result.returncode == 5, result.stderr  # ExitStatus.VERIFY_FAILED
    lines = result.stderr.splitlines()
    assert "--allow-mismatch cpu_flags --allow-mismatch kernel" in lines[0]
    assert any(line.strip().startswith("cpu_flags: this CPU lacks avx9000") for line in lines)
    assert any(line.strip().startswith("kernel: image 5.4.0-old") for line in lines)
    assert "IDENTITY_TEST_EXTRA" not in result.stderr  # the restorer's environment never refuses
    assert list((state / "activations").iterdir()) == []


def test_gc_cleans_up_after_a_killed_snapctl_and_spares_live_ones(
    tmp_path: Path, state: Path, criu_binary: object
) -> None:
    image = tmp_path / "image"
    key = ("--api-key-env", API_KEY_ENV)
    ok(snapctl(state, "donor", "--image", str(image), "--name", "d", *key, "--detach", "--json"))
    ok(snapctl(state, "stop", "d"))
    live = json.loads(ok(snapctl(state, "copy", "--image", str(image), "--name", "live", *key,
                                 "--publish", "127.0.0.1:0", "--detach", "--json")))  # fmt: skip
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(state), API_KEY_ENV: API_KEY}
    foreground = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "copy", "--image", str(image), "--name", "doomed", *key],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (state / "records" / "doomed.json").exists():
            assert time.monotonic() < deadline and foreground.poll() is None
            time.sleep(0.05)
        foreground.kill()  # SIGKILL: no cleanup runs, the restored tree keeps serving
    finally:
        foreground.wait()
    doomed = json.loads((state / "records" / "doomed.json").read_text())
    rows = {row["name"]: row for row in json.loads(ok(snapctl(state, "ps", "--json")))}
    assert rows["doomed"]["running"] and not rows["doomed"]["supervised"]
    assert rows["live"]["running"] and rows["live"]["supervised"]

    collected = json.loads(ok(snapctl(state, "gc", "--json")))["activations"]
    assert [entry["names"] for entry in collected] == [["doomed"]]
    assert collected[0]["audit"] == {
        "processes": [], "mounts": [], "directories": [], "listeners": [], "shm_files": []
    }  # fmt: skip
    assert not (state / "activations" / doomed["activation_id"]).exists()
    assert [row["name"] for row in json.loads(ok(snapctl(state, "ps", "--json")))] == ["live"]
    assert get(live["published"], "/v1/models")[0] == 200  # gc left the live copy alone
    assert json.loads(ok(snapctl(state, "gc", "--json"))) == {
        "activations": [], "removed": [], "starting": []
    }  # fmt: skip
    ok(snapctl(state, "stop", "live"))
    assert list((state / "activations").iterdir()) == []
