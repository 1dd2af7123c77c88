"""``snapctl doctor``: can this machine capture and restore a server tree with CRIU?

This module owns the checks and the report; ``snapctl/cli/doctor.py`` only renders it. Every
check yields a :class:`Check` with a status, what was seen and, when not ``ok``, how to fix it. A
``fail`` means capture cannot work here (no usable CRIU, ``criu check`` fails, not root, missing
capabilities, no namespaces); a ``warn`` degrades something optional; ``info`` only informs.
All access to the machine goes through :class:`System`, so tests can swap in a fake.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from snapctl import __version__
from snapctl.cgroups import CgroupError, Limits, create_cgroup, detect_layout
from snapctl.criu.external import undumpable
from snapctl.criu.locate import INSTALL_HINT, CriuBinary, find_criu
from snapctl.errors import SnapctlError
from snapctl.models import StrictModel
from snapctl.namespaces.devices import dev_fstype
from snapctl.namespaces.hostview import HostMount, hidden_mounts, hides
from snapctl.namespaces.mounts import mount_lines, mount_type
from snapctl.supervision.process import (
    CAPABILITIES,
    effective_capabilities,
    missing_capabilities,
    status_field,
)

CheckStatus = Literal["ok", "warn", "fail", "info"]

# A root-mode CRIU dump/restore of a tree in its own namespaces needs every capability of
# CAPABILITIES; CAP_SYS_RESOURCE only lets CRIU raise its own RLIMIT_NOFILE.
OPTIONAL_CAPABILITIES = frozenset({"CAP_SYS_RESOURCE"})
NAMESPACE_PROBE = ("--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "true")
MINIMUM_PYTHON = (3, 11)
SEARCH_ORDER = "SNAPCTL_CRIU, the prefix, PATH"
# Hidden host mounts named by doctor (a Kubernetes node has one per pod network).
MAX_HIDDEN_SHOWN = 8


class Check(StrictModel):
    """One line of the report."""

    name: str
    status: CheckStatus
    detail: str
    fix: str | None = None


class DoctorReport(StrictModel):
    """All checks; ``ready`` is false when any check failed (capture cannot work here)."""

    version: Literal[1] = 1
    snapctl_version: str
    ready: bool
    checks: tuple[Check, ...]

    @classmethod
    def from_checks(cls, checks: Sequence[Check]) -> DoctorReport:
        ready = all(check.status != "fail" for check in checks)
        return cls(snapctl_version=__version__, ready=ready, checks=tuple(checks))

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(check.name for check in self.checks if check.status == "fail")


# Files container runtimes leave in a container's root, and what each names.
CONTAINER_MARKERS = {"/run/.containerenv": "podman", "/.dockerenv": "docker"}
# The least memory limit a cgroup takes (the probe's; nothing runs in it).
PROBE_MEMORY_BYTES = 64 << 20
PRIVILEGED_FIX = "run the container with --privileged (Kubernetes: securityContext.privileged)"


@dataclass(frozen=True)
class ContainerFacts:
    """What a container gives snapctl, probed only inside one (see :meth:`System.container`)."""

    # /proc/self/status's Seccomp: 0 none, 1 strict, 2 a filter (a runtime's default profile).
    seccomp: int | None
    # Whether /proc/sys takes writes: CRIU sets restored namespaces' sysctls there.
    proc_sys_writable: bool
    # Why an activation's cgroup cannot be made here (None: one was made and removed).
    cgroup_problem: str | None
    # Why a device node cannot be made here (None: one was made and removed).
    mknod_problem: str | None
    # What is mounted at /dev.
    dev: str | None


def _seccomp_mode(status_text: str) -> int | None:
    value = status_field(status_text, "Seccomp")
    return int(value) if value is not None and value.isdigit() else None


def _probe_mknod() -> str | None:
    """Make and remove a /dev/null node in a scratch directory: what each sandbox's /dev
    needs (a device cgroup that refuses it is a container's, unless privileged)."""
    with tempfile.TemporaryDirectory(prefix="snapctl-doctor-") as scratch:
        try:
            os.mknod(os.path.join(scratch, "null"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except OSError as error:
            return f"mknod: {error.strerror}"
    return None


def _probe_cgroup() -> str | None:
    """Make an activation's cgroup with a memory limit, then remove it."""
    if detect_layout() is None:
        return "no cgroup hierarchy is mounted under /sys/fs/cgroup"
    try:
        group = create_cgroup(f"doctor-{os.getpid()}", Limits(memory_bytes=PROBE_MEMORY_BYTES))
    except CgroupError as error:
        return error.message
    if group is not None:
        with contextlib.suppress(OSError):
            group.remove()
    return None


class System:
    """The machine as the doctor sees it; tests override methods to fake a different one."""

    def run(self, argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
        """Run ``argv``: (exit status, stdout and stderr); OSError or TimeoutExpired if it can't."""
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
        return proc.returncode, proc.stdout.strip()

    def read_text(self, path: str) -> str:
        return Path(path).read_text()

    def geteuid(self) -> int:
        return os.geteuid()

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def uname(self) -> tuple[str, str]:
        """Kernel release and machine architecture."""
        return platform.release(), platform.machine()

    def find_criu(self, explicit: str | None) -> CriuBinary:
        return find_criu(explicit)

    def python(self) -> tuple[tuple[int, int, int], str]:
        major, minor, micro = sys.version_info[:3]
        return (major, minor, micro), sys.executable

    def container_runtime(self) -> str | None:
        """The container runtime this process runs under, if it can tell (None: a host)."""
        for marker, runtime in CONTAINER_MARKERS.items():
            # /.dockerenv stays in an image made into a machine's root, whose /dev is then a
            # devtmpfs, which no container runtime mounts.
            if os.path.exists(marker) and (runtime != "docker" or dev_fstype() != "devtmpfs"):
                return runtime
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return "kubernetes"
        with contextlib.suppress(OSError):
            environ = Path("/proc/1/environ").read_bytes().split(b"\0")
            for entry in environ:
                if entry.startswith(b"container="):
                    return entry.split(b"=", 1)[1].decode(errors="replace") or "container"
        return None

    def container(self) -> ContainerFacts:
        """Probe what snapctl needs of a container (makes and removes a node and a cgroup)."""
        try:
            seccomp = _seccomp_mode(Path("/proc/self/status").read_text())
        except OSError:
            seccomp = None
        return ContainerFacts(
            seccomp=seccomp,
            proc_sys_writable=os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
            cgroup_problem=_probe_cgroup(),
            mknod_problem=_probe_mknod(),
            dev=dev_fstype(),
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(no output)"


def _run_probe(system: System, argv: Sequence[str], timeout_s: float) -> tuple[bool, str]:
    """Run a probe command; (succeeded, output or the reason it could not run)."""
    try:
        returncode, output = system.run(argv, timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:g} s"
    except OSError as error:
        return False, f"cannot run {argv[0]}: {error.strerror or error}"
    return returncode == 0, output


def check_root(system: System) -> Check:
    euid = system.geteuid()
    if euid == 0:
        return Check(name="root", status="ok", detail="running as root (euid 0)")
    return Check(
        name="root",
        status="fail",
        detail=f"running as euid {euid}",
        fix="run snapctl as root: CRIU dumps and restores whole process trees and namespaces",
    )


def check_capabilities(system: System) -> Check:
    try:
        status = system.read_text("/proc/self/status")
        effective_capabilities(status)
    except (OSError, ValueError) as error:
        return Check(name="capabilities", status="fail", detail=f"cannot read CapEff: {error}")
    missing = missing_capabilities(status, CAPABILITIES)
    needed = [name for name in missing if name not in OPTIONAL_CAPABILITIES]
    if needed:
        return Check(
            name="capabilities",
            status="fail",
            detail=f"missing {', '.join(needed)}",
            fix="run with full root capabilities (for a container: --privileged, or add "
            + ", ".join(name.removeprefix("CAP_") for name in needed)
            + ")",
        )
    if missing:
        return Check(
            name="capabilities",
            status="warn",
            detail=f"all needed present; {', '.join(missing)} missing (harmless: CRIU only logs "
            "that it cannot raise its own RLIMIT_NOFILE)",
        )
    return Check(name="capabilities", status="ok", detail="all capabilities CRIU needs")


def check_kernel(system: System) -> Check:
    release, machine = system.uname()
    if machine != "x86_64":
        return Check(
            name="kernel",
            status="warn",
            detail=f"{release} on {machine}",
            fix="scripts/install-criu supports x86_64 only; provide CRIU >= 4.2 yourself",
        )
    return Check(name="kernel", status="info", detail=f"{release} on {machine}")


def _criu_fix(error: SnapctlError, explicit: str | None) -> str:
    # find_criu never falls back from a CRIU named explicitly, so say how to name a usable one
    # (or to stop naming one) rather than how to install one.
    if error.path is not None:
        if explicit and error.path == Path(explicit):
            return f"--criu must name a CRIU >= 4.2, or leave it out to search {SEARCH_ORDER}"
        env = os.environ.get("SNAPCTL_CRIU")
        if env and error.path == Path(env):
            return "SNAPCTL_CRIU must name a CRIU >= 4.2, or unset it to search the prefix and PATH"
    return INSTALL_HINT


def check_criu(system: System, explicit: str | None) -> tuple[Check, CriuBinary | None]:
    try:
        criu = system.find_criu(explicit)
    except SnapctlError as error:
        return Check(
            name="criu", status="fail", detail=error.message, fix=_criu_fix(error, explicit)
        ), None
    except (OSError, subprocess.SubprocessError) as error:
        return Check(name="criu", status="fail", detail=str(error), fix=INSTALL_HINT), None
    detail = f"{criu.version} at {criu.path} (found by {criu.source})"
    return Check(name="criu", status="ok", detail=detail), criu


def check_criu_check(system: System, criu: CriuBinary | None) -> Check:
    if criu is None:
        return Check(name="criu check", status="fail", detail="not run: no usable CRIU")
    passed, output = _run_probe(system, [*criu.argv, "check"], timeout_s=60)
    if passed:
        return Check(name="criu check", status="ok", detail=_last_line(output))
    return Check(
        name="criu check",
        status="fail",
        detail=_tail(output),
        fix=f"see `{criu.path} check -v4`; kernel and CRIU version must match (kernels >= 6.13 "
        "need CRIU >= 4.2)",
    )


def check_lazy_restore(system: System, criu: CriuBinary | None) -> Check:
    name = "lazy restore"
    if criu is None:
        return Check(name=name, status="warn", detail="not run: no usable CRIU")
    argv = [*criu.argv, "check", "--feature", "uffd-noncoop"]
    passed, output = _run_probe(system, argv, timeout_s=30)
    if passed:
        return Check(name=name, status="ok", detail="userfaultfd (uffd-noncoop) supported")
    return Check(
        name=name,
        status="warn",
        detail=f"uffd-noncoop unsupported: {_tail(output, 1)}",
        fix="lazy restore needs userfaultfd in the kernel; plain restore still works",
    )


def check_unshare(system: System) -> tuple[Check, str | None]:
    path = system.which("unshare")
    if path is None:
        fix = "install util-linux (apt-get install util-linux)"
        return Check(name="unshare", status="fail", detail="not found on PATH", fix=fix), None
    return Check(name="unshare", status="ok", detail=path), path


def check_namespaces(system: System, unshare: str | None) -> Check:
    name = "namespaces"
    if unshare is None:
        return Check(name=name, status="fail", detail="not tested: unshare is missing")
    passed, output = _run_probe(system, [unshare, *NAMESPACE_PROBE], timeout_s=20)
    if passed:
        return Check(name=name, status="ok", detail="can create pid, net, ipc, uts and mnt ones")
    return Check(
        name=name,
        status="fail",
        detail=f"unshare failed: {_tail(output, 1)}",
        fix="run as root without a seccomp/AppArmor profile that forbids unshare "
        "(a privileged container)",
    )


def check_dev_shm(system: System) -> Check:
    try:
        fstype = mount_type(system.read_text("/proc/self/mounts"), "/dev/shm")
    except OSError as error:
        return Check(name="/dev/shm", status="warn", detail=f"cannot read mounts: {error}")
    if fstype == "tmpfs":
        return Check(name="/dev/shm", status="ok", detail="tmpfs")
    detail = "not a mount point" if fstype is None else f"is {fstype}, not tmpfs"
    return Check(
        name="/dev/shm",
        status="warn",
        detail=detail,
        fix="mount a tmpfs on /dev/shm: servers keep named semaphores and shared memory there",
    )


def check_kdat_cache(system: System) -> Check:
    """CRIU keeps what it probed of the kernel in /run/criu.kdat, but only on a tmpfs."""
    name = "CRIU kdat cache"
    try:
        fstype = mount_type(system.read_text("/proc/self/mounts"), "/run")
    except OSError as error:
        return Check(name=name, status="warn", detail=f"cannot read mounts: {error}")
    if fstype == "tmpfs":
        return Check(name=name, status="ok", detail="/run is a tmpfs")
    where = "not a mount point" if fstype is None else f"{fstype}, not tmpfs"
    if system.which("unshare") is not None:
        return Check(
            name=name,
            status="ok",
            detail=f"/run is {where}, so CRIU keeps no cache there; snapctl runs restores with "
            "a private /run holding a cache it keeps per boot (STATE/criu)",
        )
    return Check(
        name=name,
        status="warn",
        detail=f"/run is {where} and unshare is missing: every CRIU restore probes the kernel "
        "again (20-40 ms on a 2-core VM; a lazy copy runs two CRIU processes)",
        fix="install util-linux (unshare), or mount a tmpfs on /run at boot (systemd does)",
    )


def _host_mounts(system: System) -> list[HostMount]:
    return [HostMount(*line) for line in mount_lines(system.read_text("/proc/self/mounts"))]


def check_host_mounts(system: System) -> Check:
    """Mounts a sandbox keeps that CRIU cannot dump: captured as external, bound back."""
    name = "host mounts"
    try:
        entries = [(m.point, m.fstype) for m in _host_mounts(system) if not hides(m)]
    except OSError as error:
        return Check(name=name, status="warn", detail=f"cannot read mounts: {error}")
    points = sorted(undumpable(entries).values())
    if not points:
        return Check(name=name, status="ok", detail="CRIU dumps every mount here itself")
    return Check(
        name=name,
        status="info",
        detail=f"{', '.join(points)}: CRIU cannot dump these; captures record them as "
        "external and copies bind the host's own back (the image needs them on every host)",
    )


def check_hidden_mounts(system: System) -> Check:
    """Host mounts every sandbox hides (runtime state under /run and /tmp, nsfs, container
    runtimes' mounts): the server never sees them and images never record them."""
    name = "hidden host mounts"
    try:
        hidden = hidden_mounts(_host_mounts(system))
    except OSError as error:
        return Check(name=name, status="warn", detail=f"cannot read mounts: {error}")
    if not hidden:
        return Check(name=name, status="ok", detail="none: the sandbox hides nothing here")
    shown = ", ".join(f"{m.point} ({m.fstype})" for m in hidden[:MAX_HIDDEN_SHOWN])
    more = f" and {len(hidden) - MAX_HIDDEN_SHOWN} more" if len(hidden) > MAX_HIDDEN_SHOWN else ""
    return Check(
        name=name,
        status="info",
        detail=f"{shown}{more}: hidden from every sandbox (each has a private /run and /tmp), "
        "so images never record them and they may come and go; a path the server names "
        "under /tmp is bound in",
    )


def check_cuda_checkpoint(system: System) -> Check:
    # The same lookup as the native step: the variable first, then PATH.
    path = os.environ.get("SNAPCTL_CUDA_CHECKPOINT") or system.which("cuda-checkpoint")
    if path is None:
        return Check(
            name="cuda-checkpoint",
            status="info",
            detail="not found (only servers that hold CUDA state need it)",
            fix="with the NVIDIA driver but not the tool, set SNAPCTL_CUDA_CHECKPOINT to "
            "scripts/cuda-checkpoint-driver (the same driver calls; docs/gpu.md)",
        )
    return Check(name="cuda-checkpoint", status="info", detail=path)


def check_python(system: System) -> Check:
    version, executable = system.python()
    shown = ".".join(map(str, version))
    if version[:2] < MINIMUM_PYTHON:
        return Check(
            name="python",
            status="fail",
            detail=f"{shown} at {executable}",
            fix="snapctl needs Python >= 3.11; run scripts/setup",
        )
    return Check(name="python", status="ok", detail=f"{shown} at {executable}")


def container_checks(runtime: str | None, facts: ContainerFacts | None) -> list[Check]:
    """What a container lacks for snapctl (one line on a host)."""
    if runtime is None or facts is None:
        return [Check(name="container", status="info", detail="none detected: on a host")]
    checks = [
        Check(
            name="container",
            status="info",
            detail=f"running in a container ({runtime}); /dev is {facts.dev or 'not mounted'} "
            "(each sandbox builds its own /dev; images captured by a snapctl whose sandbox "
            "kept the host's /dev restore only on a host)",
        )
    ]
    if facts.seccomp == 2:
        checks.append(
            Check(
                name="seccomp",
                status="fail",
                detail="a seccomp filter confines this container: a runtime's default "
                "profile refuses syscalls CRIU needs (ptrace, kcmp, mount, unshare, ...)",
                fix=f"{PRIVILEGED_FIX}, or --security-opt seccomp=unconfined",
            )
        )
    else:
        checks.append(Check(name="seccomp", status="ok", detail="no seccomp filter"))
    if facts.proc_sys_writable:
        checks.append(Check(name="/proc/sys", status="ok", detail="writable"))
    else:
        checks.append(
            Check(
                name="/proc/sys",
                status="fail",
                detail="/proc/sys/kernel/ns_last_pid is not writable (/proc/sys read-only): "
                "CRIU sets restored PIDs and namespaces' sysctls there",
                fix=PRIVILEGED_FIX,
            )
        )
    if facts.mknod_problem is None:
        checks.append(Check(name="device nodes", status="ok", detail="mknod works"))
    else:
        checks.append(
            Check(
                name="device nodes",
                status="fail",
                detail=f"{facts.mknod_problem}: each sandbox's /dev is built with mknod, "
                "which this container's device rules refuse",
                fix=PRIVILEGED_FIX,
            )
        )
    if facts.cgroup_problem is None:
        checks.append(
            Check(name="cgroup", status="ok", detail="activations' cgroups can be made here")
        )
    else:
        checks.append(
            Check(
                name="cgroup",
                status="warn",
                detail=f"{facts.cgroup_problem}: --memory and --cpus are refused, and "
                "activations are not accounted on their own",
                fix=f"{PRIVILEGED_FIX} (cgroupfs writable); on cgroup v2, start snapctl in a "
                "child cgroup of the container's (or set SNAPCTL_CGROUP_PARENT)",
            )
        )
    return checks


def run_doctor(criu: str | None = None, system: System | None = None) -> DoctorReport:
    """Run every check (``criu`` names a CRIU binary to use) and return the report."""
    system = system or System()
    criu_found, binary = check_criu(system, criu)
    unshare_found, unshare = check_unshare(system)
    checks = [
        check_root(system),
        check_capabilities(system),
        check_kernel(system),
        criu_found,
        check_criu_check(system, binary),
        check_lazy_restore(system, binary),
        unshare_found,
        check_namespaces(system, unshare),
        check_dev_shm(system),
        check_kdat_cache(system),
        check_host_mounts(system),
        check_hidden_mounts(system),
        check_cuda_checkpoint(system),
        check_python(system),
    ]
    runtime = system.container_runtime()
    checks += container_checks(runtime, system.container() if runtime is not None else None)
    return DoctorReport.from_checks(checks)
