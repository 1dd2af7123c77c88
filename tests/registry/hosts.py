"""Two hosts on one machine, for restoring elsewhere for real.

Each host is a network namespace of its own, held by a small process made here, joined to the
other by a veth pair whose ends and addresses exist only inside those namespaces (198.18.0.0/15,
the range set aside for benchmarks between networks). Host B's holder also has a mount
namespace of its own: there a file with another machine id is bind-mounted over
``/etc/machine-id``, and B's commands run with their own state directory (image cache
included). Commands enter with ``nsenter`` (``--net``, for B also ``--mount``), not ``ip netns
exec``, whose fresh mount namespace (with /sys remounted) breaks dumps. No ``/run/netns``
entries are made: they are mounts, which a capture taken meanwhile would record and every
later restore would then need. ``close`` stops both holders by PID, which ends their
namespaces and the veth pair with them.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBNET_PREFIX = "198.18.20."


def _ip(holder: subprocess.Popen[bytes], *args: str) -> None:
    """``ip ARGS`` inside ``holder``'s network namespace."""
    subprocess.run(["nsenter", f"--target={holder.pid}", "--net", "ip", *args], check=True,
                   capture_output=True, timeout=30)  # fmt: skip


def _hold(*unshare: str, script: str = "", args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """A process in new namespaces (``unshare`` options) that runs ``script``, then sleeps."""
    holder = subprocess.Popen(
        ["unshare", *unshare, "sh", "-c", f"{script}echo ready && exec sleep infinity", "sh",
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None
    if holder.stdout.readline() != b"ready\n":
        _stop(holder)
        raise AssertionError(f"namespace holder: {holder.stderr.read() if holder.stderr else ''!r}")
    return holder


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class Host:
    """One host: where its commands run, its address on the veth, its state directory."""

    name: str
    address: str
    state: Path
    machine_id: str
    holder: subprocess.Popen[bytes] | None = None
    own_mounts: bool = False

    def enter(self) -> list[str]:
        """The nsenter prefix of a command run on this host."""
        assert self.holder is not None
        mount = ["--mount"] if self.own_mounts else []
        return ["nsenter", f"--target={self.holder.pid}", "--net", *mount]

    def run(self, *args: str, env: dict[str, str] | None = None,
            timeout_s: float = 240) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run(
            [*self.enter(), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
            # nsenter --mount starts in the target's root: name the checkout for python -c.
            env={**os.environ, "SNAPCTL_STATE_DIR": str(self.state), "PYTHONPATH": str(REPO),
                 **(env or {})},
            check=False,
        )  # fmt: skip

    def snapctl(self, *args: str, env: dict[str, str] | None = None) -> str:
        result = self.run(sys.executable, "-m", "snapctl", *args, env=env)
        assert result.returncode == 0, f"host {self.name}: snapctl {args[0]}: {result.stderr}"
        return result.stdout


@dataclass
class TwoHosts:
    a: Host
    b: Host

    def close(self) -> None:
        """Stop both holders by PID: their namespaces, and the veth pair, go with them."""
        for host in (self.b, self.a):
            if host.holder is not None:
                _stop(host.holder)


def make_two_hosts(root: Path) -> TwoHosts:
    """Two hosts joined by a veth pair (see the module docstring); ``close`` undoes it."""
    machine_id = root / "b" / "machine-id"
    machine_id.parent.mkdir(parents=True, exist_ok=True)
    hosts = TwoHosts(
        a=Host("a", SUBNET_PREFIX + "1", root / "a" / "state",
               Path("/etc/machine-id").read_text().strip()),
        b=Host("b", SUBNET_PREFIX + "2", root / "b" / "state", secrets.token_hex(16),
               own_mounts=True),
    )  # fmt: skip
    machine_id.write_text(hosts.b.machine_id + "\n")
    try:
        hosts.a.holder = _hold("--net")
        hosts.b.holder = _hold("--net", "--mount", "--propagation", "private",
                               script='mount --bind "$1" /etc/machine-id && ',
                               args=(str(machine_id),))  # fmt: skip
        for host in (hosts.a, hosts.b):
            _ip(host.holder, "link", "set", "lo", "up")
        # Made inside A with its peer moved straight into B: nothing touches this host's network.
        tag = f"{os.getpid() % 100000}"
        veth_a, veth_b = f"fl{tag}a", f"fl{tag}b"
        _ip(hosts.a.holder, "link", "add", veth_a, "type", "veth", "peer", "name", veth_b,
            "netns", str(hosts.b.holder.pid))  # fmt: skip
        for host, veth in ((hosts.a, veth_a), (hosts.b, veth_b)):
            assert host.holder is not None
            _ip(host.holder, "addr", "add", f"{host.address}/30", "dev", veth)
            _ip(host.holder, "link", "set", veth, "up")
    except BaseException:
        hosts.close()
        raise
    return hosts
