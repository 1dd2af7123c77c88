"""snapctl inside a privileged podman container (the shape of a Kubernetes bake Job and of the
agent DaemonSet), with real CRIU: a donor, a bake and a copy of that bake made inside serve what
a donor on the host serves, and so does a copy inside of an image baked on the host.

The container runs with runc and the host's files (``--rootfs /:O``, an overlay whose writes
stay in the container), so an image baked on the host passes the identity gate inside it; its
``/dev`` is a tmpfs, not the host's devtmpfs, and its cgroups are mounted from its own down. It
has no network (``--network none``): every request goes to its loopback through ``podman
exec``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary
from snapctl.statedir import StateDir
from tests.activation.criu_helpers import (
    API_KEY,
    API_KEY_ENV,
    PUBLISH,
    complete,
    launch_donor,
    leftovers,
    stop_clean,
)

pytestmark = [pytest.mark.criu, pytest.mark.podman, pytest.mark.timeout(420)]

CHECKOUT = Path(__file__).resolve().parents[2]
SNAPCTL = str(CHECKOUT / ".venv" / "bin" / "snapctl")
# podman's default rlimits need CAP_SYS_RESOURCE, which CI's machines lack; crun (podman's
# default runtime) refuses hybrid cgroup hosts, runc does not.
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager=cgroupfs")
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000")
# PID 1 of the container reaps what detached supervisors leave to it, as an init does.
REAPER = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)
ASK = (
    "import json, sys\n"
    "from tests.activation.criu_helpers import complete\n"
    "print(json.dumps(complete(sys.argv[1])))\n"
)
# In the container's overlay: gone with it.
STATE_IN_CONTAINER = "/var/tmp/snapctl-container-test/state"
IMAGES_IN_CONTAINER = "/var/tmp/snapctl-container-test/images"


class Container:
    """A running privileged container, by its unique name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def exec(self, *argv: str, timeout_s: float = 180) -> str:
        """Run ``argv`` inside (its working directory the checkout); its stdout, or fail the
        test with its output."""
        proc = subprocess.run(
            [*PODMAN, "exec", self.name, *argv],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        return proc.stdout

    def snapctl(self, *args: str) -> str:
        return self.exec(SNAPCTL, "--no-agent", *args)

    def ask(self, address: str) -> tuple[list[float], str]:
        """The fixture's greedy completion from ``address`` on the container's loopback."""
        logprobs, text = json.loads(self.exec(sys.executable, "-c", ASK, address))
        return logprobs, text


@pytest.fixture
def container() -> Iterator[Callable[[], Container]]:
    """Starts the container when called (after the host's image exists: the container's
    overlay shows the host's files as they were then); removed by its name afterwards."""
    name = f"snapctl-test-{uuid.uuid4().hex[:12]}"

    def start() -> Container:
        run = [
            *PODMAN, "run", "--detach", "--name", name, "--privileged", "--network", "none",
            *ULIMITS, "--workdir", str(CHECKOUT),
            "--env", f"SNAPCTL_STATE_DIR={STATE_IN_CONTAINER}",
            "--env", f"{API_KEY_ENV}={API_KEY}",
            "--rootfs", "/:O", sys.executable, "-c", REAPER,
        ]  # fmt: skip
        subprocess.run(run, check=True, capture_output=True, timeout=120)
        return Container(name)

    try:
        yield start
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "5", name],
                       capture_output=True, timeout=120, check=False)  # fmt: skip


def in_container_copy(container: Container, image: str, name: str, port: int) -> str:
    """Restore a detached copy of ``image`` inside, published on the container's loopback."""
    address = f"127.0.0.1:{port}"
    container.snapctl("copy", "--image", image, "--name", name, "--detach",
                      "--publish", address, "--api-key-env", API_KEY_ENV)  # fmt: skip
    return address


def running_names(container: Container) -> list[str]:
    rows = json.loads(container.snapctl("ps", "--json"))
    return sorted(str(row["name"]) for row in rows)


def the_hosts_donor(tmp_path: Path, state: StateDir, criu: CriuBinary) -> tuple[Path, object]:
    """Capture the fixture on the host: its image and what its donor answered."""
    image = tmp_path / "host-image"
    donor, report = launch_donor(image, state, criu, publish=PUBLISH)
    try:
        assert report.published
        expected = complete(report.published)
    finally:
        stop_clean(donor)
    assert leftovers(state) == []
    return image, expected


def test_donor_bake_and_copy_inside_a_privileged_container(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary,
    container: Callable[[], Container],
) -> None:  # fmt: skip
    _, expected = the_hosts_donor(tmp_path, state, criu_binary)
    inside = container()
    donor_image, baked = f"{IMAGES_IN_CONTAINER}/donor", f"{IMAGES_IN_CONTAINER}/baked"
    inside.snapctl("donor", "--image", donor_image, "--name", "in-donor", "--detach",
                      "--publish", "127.0.0.1:18000", "--api-key-env", API_KEY_ENV)  # fmt: skip
    assert inside.ask("127.0.0.1:18000") == expected
    inside.snapctl("bake", "--image", baked, "--api-key-env", API_KEY_ENV)
    copy = in_container_copy(inside, baked, "in-copy", 18001)
    assert inside.ask(copy) == expected
    # The image was captured where /dev is a container's tmpfs: it records the sandbox's own.
    manifest = json.loads(inside.exec("cat", f"{baked}/manifest.json"))
    assert manifest["sandbox_dev"] == "own"
    recorded = manifest["external_mounts"].values()
    assert not [p for p in recorded if p.startswith("/dev") and p != "/dev/shm"]
    assert running_names(inside) == ["in-copy", "in-donor"]
    for name in ("in-copy", "in-donor"):
        inside.snapctl("stop", name)
    assert running_names(inside) == []
    assert inside.exec("sh", "-c", f"ls -A {STATE_IN_CONTAINER}/activations").strip() == ""


def test_a_copy_inside_a_container_of_an_image_baked_on_the_host(
    tmp_path: Path, state: StateDir, criu_binary: CriuBinary,
    container: Callable[[], Container],
) -> None:  # fmt: skip
    image, expected = the_hosts_donor(tmp_path, state, criu_binary)
    inside = container()
    copy = in_container_copy(inside, str(image), "from-host", 18002)
    assert inside.ask(copy) == expected
    # Its cgroup is found below the container's own, named as /proc/PID/cgroup names it.
    row = json.loads(inside.snapctl("ps", "--json"))[0]
    if row.get("cgroup"):
        own = inside.exec("cat", f"/proc/{row['root_pid']}/cgroup")
        assert any(line.endswith(":" + row["cgroup"]) for line in own.splitlines())
    inside.snapctl("stop", "from-host")
    assert running_names(inside) == []
