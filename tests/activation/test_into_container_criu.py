"""``snapctl copy --into-container``, with real CRIU and real podman: an image baked on the host
restored inside a placeholder container (``sleep infinity``, runc, ``--rootfs /:O`` so its files
are the host's, ``--network none``, ``--memory 4g``), as a Kubernetes placeholder pod would run.

The copy serves on the container's own loopback (reached with ``nsenter --net``, never the
host's: the host's loopback does not answer), every process of its tree is in the container's
memory cgroup, ``podman stop`` ends it and its supervisor cleans up, ``snapctl stop`` ends it
and leaves the container running, and a stopped or missing container is refused before CRIU
runs; the same through the agent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from snapctl.criu import CriuBinary
from snapctl.criu.external import host_key
from snapctl.namespaces import mounts
from snapctl.statedir import StateDir
from snapctl.supervision.process import descendants
from tests.activation.criu_helpers import API_KEY_ENV, get, launch_donor, leftovers
from tests.agent.helpers import AgentProcess, cli, until
from tests.containers import PODMAN, Placeholder

pytestmark = [pytest.mark.criu, pytest.mark.podman, pytest.mark.timeout(420)]
QLEN_SYSCTL = "net/unix/max_dgram_qlen"
RETAINED_MB = 256


def copy_into(
    state: StateDir, image: Path, name: str, container: str, port: int, *more: str,
    agent: bool = False,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return cli(
        state, *([] if agent else ["--no-agent"]), "copy", "--image", str(image), "--name", name,
        "--into-container", container, "--publish", f"127.0.0.1:{port}", "--api-key-env",
        API_KEY_ENV, "--timeout", "60", "--detach", "--json", *more, check=False,
    )  # fmt: skip


def names(state: StateDir, *, agent: bool = False) -> list[str]:
    rows = json.loads(cli(state, *([] if agent else ["--no-agent"]), "ps", "--json").stdout)
    return sorted(str(row["name"]) for row in rows)


def pages_complete(state: StateDir, name: str) -> bool:
    rows = json.loads(cli(state, "--no-agent", "ps", "--json").stdout)
    return any(row["name"] == name and row.get("pages_complete") is True for row in rows)


def host_answers(port: int) -> bool:
    """Whether anything listens on the host's own loopback at ``port``."""
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def served(report: dict[str, Any]) -> list[int]:
    """Every process of the copy's tree now."""
    return descendants(int(report["root_pid"]))


def test_a_copy_restored_into_a_placeholder_serves_there_and_ends_with_it(
    agent_state: StateDir, donor_image: tuple[Path, Any],
    placeholder: Callable[..., Placeholder],
) -> None:  # fmt: skip
    state, (image, expected) = agent_state, donor_image
    box = placeholder()
    # A setting of the container's network namespace that the donor's differs in: restoring
    # the image's network state into the container would put the donor's back.
    box.set_network_sysctl(QLEN_SYSCTL, "123")
    done = copy_into(state, image, "in-box", box.name, 18210)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["published"] == "127.0.0.1:18210"
    assert box.ask("127.0.0.1:18210") == expected
    assert not host_answers(18210)  # published on the container's network, not the host's
    # The tree is in the container's network namespace, and its server itself listens there:
    # nothing relays.
    netns = os.stat(f"/proc/{box.pid}/ns/net").st_ino
    assert {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in served(report)} == {netns}
    listening = box.run_in_network("ss", "-Hltnp", "sport = :18210")
    assert f"pid={report['root_pid']}," in listening, listening
    assert box.network_sysctl(QLEN_SYSCTL) == "123"
    memory = box.memory_cgroup()
    for pid in served(report):
        line = next(line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                    if "memory" in line.split(":")[1].split(","))  # fmt: skip
        assert line.split(":", 2)[2].startswith(memory + "/"), (pid, line, memory)
    assert names(state) == ["in-box"]
    # A container hosts one copy: a second one is refused before CRIU runs.
    second = copy_into(state, image, "second", box.name, 18212)
    assert second.returncode == 7 and "already hosts a copy" in second.stderr, second.stderr
    assert names(state) == ["in-box"]

    # snapctl stop ends the copy; the container keeps running.
    stopped = json.loads(cli(state, "--no-agent", "stop", "in-box", "--json").stdout)
    assert not any(stopped["audit"].values()), stopped
    assert box.running and names(state) == []

    # A second copy into the same container ends when the container stops.
    done = copy_into(state, image, "ends-with-box", str(box.pid), 18211)
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    assert box.ask("127.0.0.1:18211") == expected
    root = int(second["root_pid"])
    box.stop()
    until(lambda: names(state) == [], timeout_s=60, shown=lambda: names(state))
    assert not Path(f"/proc/{root}").exists() or "Z" in Path(f"/proc/{root}/stat").read_text()
    until(lambda: leftovers(state) == [], timeout_s=30, shown=lambda: leftovers(state))
    outcome = json.loads((Path(second["logs"]) / "stopped.json").read_text())
    assert not any(outcome["audit"].values()), outcome


def test_a_lazy_copy_into_a_placeholder_has_the_donors_memory(
    agent_state: StateDir, tmp_path: Path, criu_binary: CriuBinary,
    placeholder: Callable[..., Placeholder],
) -> None:  # fmt: skip
    state = agent_state
    image = tmp_path / "retaining"
    donor, report = launch_donor(
        image, state, criu_binary, publish=("127.0.0.1", 0), fixture_retained_mb=RETAINED_MB
    )
    try:
        assert report.published is not None
        status, retained = get(report.published, "/v1/debug/retained-digest")
        assert status == 200 and retained["mb"] == RETAINED_MB
    finally:
        donor.stop()
    box = placeholder()
    box.set_network_sysctl(QLEN_SYSCTL, "123")
    done = copy_into(state, image, "lazy-in-box", box.name, 18250, "--lazy")
    assert done.returncode == 0, done.stderr
    copied = json.loads(done.stdout)
    assert copied["lazy"] is True
    # Its daemon runs on the host; only the restore enters the container.
    logs = Path(copied["logs"])
    assert "nsenter" in (logs / "restore.argv").read_text()
    assert "nsenter" not in (logs / "lazy-pages.argv").read_text()
    netns = os.stat(f"/proc/{box.pid}/ns/net").st_ino
    assert {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in served(copied)} == {netns}
    manifest = json.loads((image / "manifest.json").read_text())
    # The retained memory was left to the daemon, not restored with the tree.
    assert copied["restore_stats"]["pages_restored"] < manifest["dump_stats"]["pages_written"]
    until(lambda: pages_complete(state, "lazy-in-box"), timeout_s=120,
          shown=lambda: cli(state, "--no-agent", "ps", "--json").stdout)  # fmt: skip
    assert box.get("127.0.0.1:18250", "/v1/debug/retained-digest") == (200, retained)
    assert box.network_sysctl(QLEN_SYSCTL) == "123"  # its view has no network state either
    stopped = json.loads(cli(state, "--no-agent", "stop", "lazy-in-box", "--json").stdout)
    assert not any(stopped["audit"].values()), stopped
    assert leftovers(state) == []


def test_a_host_mount_of_the_image_comes_from_the_containers_volume(
    agent_state: StateDir, tmp_path: Path, criu_binary: CriuBinary,
    placeholder: Callable[..., Placeholder],
) -> None:  # fmt: skip
    """An image whose donor saw a mount CRIU cannot dump (a model on its own disk: a ramfs
    here) binds it back from the container's volume at that path, as a pod mounts its model,
    not from the container's root filesystem (which holds only the empty mount point)."""
    state = agent_state
    driver = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="snapctl-test-model-"))
    volume = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="snapctl-test-volume-"))
    mounts.mount("snapctl-test-ramfs", driver, "ramfs", 0)
    try:
        (driver / "marker").write_text("donor's disk\n")
        image = tmp_path / "with-model"
        donor, _ = launch_donor(image, state, criu_binary, activate=False)
        donor.stop()
        recorded = json.loads((image / "manifest.json").read_text())["external_mounts"]
        assert recorded[host_key(str(driver))] == str(driver)
        (volume / "marker").write_text("pod's volume\n")
        box = placeholder(volumes=[f"{volume}:{driver}:ro"])
        done = copy_into(state, image, "model-in-box", box.name, 18260)
        assert done.returncode == 0, done.stderr
        copied = json.loads(done.stdout)
        seen = Path(f"/proc/{copied['root_pid']}/root") / str(driver).lstrip("/") / "marker"
        assert seen.read_text() == "pod's volume\n"
        # Read-only in the copy too, as the container has it.
        options = next(line.split()[5] for line in
                       Path(f"/proc/{copied['root_pid']}/mountinfo").read_text().splitlines()
                       if line.split()[4] == str(driver))  # fmt: skip
        assert "ro" in options.split(","), options
        stopped = json.loads(cli(state, "--no-agent", "stop", "model-in-box", "--json").stdout)
        assert not any(stopped["audit"].values()), stopped
    finally:
        mounts.umount(driver, detach=True)
        driver.rmdir()
        shutil.rmtree(volume)
    assert leftovers(state) == []


def test_a_stopped_or_missing_container_is_refused_before_criu_runs(
    agent_state: StateDir, donor_image: tuple[Path, Any],
    placeholder: Callable[..., Placeholder],
) -> None:  # fmt: skip
    state, (image, _) = agent_state, donor_image
    created = placeholder(start=False)
    before = sorted(state.logs.iterdir())  # the donor's
    missing = f"snapctl-no-such-{uuid.uuid4().hex[:8]}"
    # This test's own process: a process, but no container's.
    refusals = ((created.name, "not running"), (missing, "no container"),
                (str(os.getpid()), "not in a container"))  # fmt: skip
    for container, says in refusals:
        done = copy_into(state, image, "refused", container, 18220)
        assert done.returncode == 7, done.stderr  # UNAVAILABLE: the host lacks what it needs
        assert says in done.stderr, done.stderr
    # A container whose files differ from the donor's: the identity gate, on its files.
    changed = placeholder()
    manifest = json.loads((image / "manifest.json").read_text())
    path = next(f["path"] for f in manifest["identity"]["files"] if f["path"].startswith("/usr/"))
    subprocess.run([*PODMAN, "exec", changed.name, "sh", "-c", f"echo >> {path}"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    done = copy_into(state, image, "refused", changed.name, 18220)
    assert done.returncode == 5 and path in done.stderr, done.stderr  # VERIFY_FAILED
    for hostile in ("../etc", "a;b", "-rf"):
        done = copy_into(state, image, "refused", hostile, 18220)
        assert done.returncode == 2, done.stderr  # a usage error, before anything looked
    # Nothing ran: no activation, no CRIU log, no name kept.
    assert sorted(state.logs.iterdir()) == before
    assert names(state) == [] and leftovers(state) == []


def test_the_same_through_the_agent(
    agent_state: StateDir, donor_image: tuple[Path, Any],
    placeholder: Callable[..., Placeholder],
) -> None:  # fmt: skip
    state, (image, expected) = agent_state, donor_image
    box = placeholder()
    agent = AgentProcess(state)
    try:
        done = copy_into(state, image, "via-agent", box.name, 18230, agent=True)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["from_pool"] is False
        assert box.ask("127.0.0.1:18230") == expected
        assert not host_answers(18230)
        assert names(state, agent=True) == ["via-agent"]
        box.stop()
        until(lambda: names(state, agent=True) == [], timeout_s=60,
              shown=lambda: names(state, agent=True))  # fmt: skip
        refused = copy_into(state, image, "via-agent", box.name, 18231, agent=True)
        assert refused.returncode == 7 and "not running" in refused.stderr, refused.stderr
    finally:
        agent.kill(signal.SIGTERM)
    until(lambda: leftovers(state) == [], timeout_s=30, shown=lambda: leftovers(state))
