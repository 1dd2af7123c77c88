"""Placeholder containers for the tests of ``copy --into-container`` (real podman): started
from the host's own files (``--rootfs /:O``), with no network of their own to reach
(``--network none``: a copy is asked through ``nsenter --net``), each removed by its unique
name."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]
# runc: crun refuses hybrid cgroup hosts; lowered rlimits: podman's defaults need
# CAP_SYS_RESOURCE, which CI's machines lack.
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager=cgroupfs")
ASK = (
    "import json, sys\n"
    "from tests.activation.criu_helpers import complete\n"
    "print(json.dumps(complete(sys.argv[1])))\n"
)
GET = (
    "import json, sys\n"
    "from tests.activation.criu_helpers import get\n"
    "print(json.dumps(get(sys.argv[1], sys.argv[2])))\n"
)


class Placeholder:
    """A running placeholder container, by its unique name."""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def create(cls, *, start: bool = True, volumes: Sequence[str] = ()) -> Placeholder:
        """A new placeholder (``start``: running ``sleep infinity``; else created only), with
        ``volumes`` (podman's ``-v`` values)."""
        name = f"snapctl-placeholder-{uuid.uuid4().hex[:12]}"
        run = [
            *PODMAN, "run" if start else "create", *(["--detach"] if start else []),
            "--name", name, "--network", "none", "--memory", "4g",
            *(option for volume in volumes for option in ("--volume", volume)),
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000",
            "--rootfs", "/:O", "sleep", "infinity",
        ]  # fmt: skip
        placeholder = cls(name)
        try:
            subprocess.run(run, check=True, capture_output=True, timeout=120)
        except BaseException:
            placeholder.remove()  # created half-way, maybe
            raise
        return placeholder

    def remove(self) -> None:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "1", self.name],
                       capture_output=True, timeout=120, check=False)  # fmt: skip

    def inspect(self, template: str) -> str:
        return subprocess.run(
            [*PODMAN, "inspect", "--format", template, self.name],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip

    @property
    def pid(self) -> int:
        return int(self.inspect("{{.State.Pid}}"))

    @property
    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def memory_cgroup(self) -> str:
        """The container's memory cgroup, as /proc/PID/cgroup names it."""
        text = Path(f"/proc/{self.pid}/cgroup").read_text()
        return next(line.split(":", 2)[2] for line in text.splitlines()
                    if "memory" in line.split(":")[1].split(","))  # fmt: skip

    def in_network(self, *argv: str) -> list[str]:
        """``argv`` run in the container's network namespace (its loopback, never its bridge
        address)."""
        return ["nsenter", "--net", "--target", str(self.pid), *argv]

    def run_in_network(self, *argv: str) -> str:
        """What ``argv`` prints, run in the container's network namespace."""
        return subprocess.run(
            self.in_network(*argv), capture_output=True, text=True, timeout=30, check=True
        ).stdout

    def network_sysctl(self, name: str) -> str:
        """A setting of the container's network namespace (``name`` under /proc/sys)."""
        return self.run_in_network("cat", f"/proc/sys/{name}").strip()

    def set_network_sysctl(self, name: str, value: str) -> None:
        self.run_in_network("sh", "-c", 'echo "$1" > "/proc/sys/$2"', "-", value, name)

    def ask(self, address: str) -> tuple[list[float], str]:
        """The fixture's greedy completion from ``address`` on the container's network."""
        logprobs, text = self._python(ASK, address)
        return logprobs, text

    def get(self, address: str, path: str) -> tuple[int, dict[str, Any]]:
        """An authenticated GET of ``path`` from ``address`` on the container's network."""
        status, body = self._python(GET, address, path)
        return status, body

    def _python(self, script: str, *args: str) -> Any:
        done = subprocess.run(
            self.in_network(sys.executable, "-c", script, *args),
            capture_output=True, text=True, timeout=120, cwd=CHECKOUT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def stop(self) -> None:
        subprocess.run([*PODMAN, "stop", "--time", "1", self.name],
                       capture_output=True, timeout=120, check=True)  # fmt: skip
