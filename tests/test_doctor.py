"""snapctl.doctor: each check's verdict on a faked machine, and the real one under root+CRIU."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary
from snapctl.criu.locate import CriuNotFound
from snapctl.doctor import (
    NAMESPACE_PROBE,
    ContainerFacts,
    DoctorReport,
    System,
    run_doctor,
)
from snapctl.namespaces.mounts import mount_type
from snapctl.supervision.process import effective_capabilities, missing_capabilities

CRIU_PATH = Path("/opt/fake/criu")
ALL_CAPS = 0x1FFFFFFFFFF
NO_SYS_RESOURCE = 0x1FFFEFFFFFF  # what this project's machines have
MOUNTS = (
    "proc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
    "tmpfs /run tmpfs rw,nosuid,nodev 0 0\n"
)

Response = tuple[int, str] | BaseException
# What `podman run --privileged` gives.
PRIVILEGED = ContainerFacts(
    seccomp=0, proc_sys_writable=True, cgroup_problem=None, mknod_problem=None, dev="tmpfs"
)
# What a default (unprivileged) podman container gives.
UNPRIVILEGED = ContainerFacts(
    seccomp=2,
    proc_sys_writable=False,
    cgroup_problem="cannot make the cgroup: Read-only file system",
    mknod_problem="mknod: Operation not permitted",
    dev="tmpfs",
)


class FakeSystem(System):
    """A machine where everything works unless a test says otherwise; records what ran."""

    def __init__(self, **changes: object) -> None:
        self.events: list[str] = []
        self.euid = 0
        self.cap_eff = NO_SYS_RESOURCE
        self.mounts = MOUNTS
        self.machine = "x86_64"
        self.tools: dict[str, str | None] = {"unshare": "/usr/bin/unshare", "cuda-checkpoint": None}
        self.criu: CriuBinary | BaseException = CriuBinary(CRIU_PATH, "4.2.1", "prefix")
        self.runtime: str | None = None
        self.facts = PRIVILEGED
        self.responses: dict[str, Response] = {
            "criu check": (0, "Warn: something minor\nLooks good."),
            "criu check --feature uffd-noncoop": (0, "uffd-noncoop is supported"),
            "unshare " + " ".join(NAMESPACE_PROBE): (0, ""),
        }
        for name, value in changes.items():
            setattr(self, name, value)

    def run(self, argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
        key = " ".join([Path(argv[0]).name, *argv[1:]])
        self.events.append(key)
        response = self.responses[key]
        if isinstance(response, BaseException):
            raise response
        return response

    def read_text(self, path: str) -> str:
        if path == "/proc/self/status":
            return f"Name:\tpython\nCapInh:\t0\nCapEff:\t{self.cap_eff:016x}\n"
        assert path == "/proc/self/mounts"
        return self.mounts

    def geteuid(self) -> int:
        return self.euid

    def which(self, name: str) -> str | None:
        return self.tools[name]

    def uname(self) -> tuple[str, str]:
        return "6.18.0-test", self.machine

    def find_criu(self, explicit: str | None) -> CriuBinary:
        self.events.append(f"find_criu {explicit}")
        if isinstance(self.criu, BaseException):
            raise self.criu
        return self.criu

    def container_runtime(self) -> str | None:
        return self.runtime

    def container(self) -> ContainerFacts:
        self.events.append("container probes")
        return self.facts


def by_name(report: DoctorReport) -> dict[str, tuple[str, str]]:
    return {check.name: (check.status, check.detail) for check in report.checks}


def test_a_good_machine_is_ready_and_every_probe_ran() -> None:
    system = FakeSystem()

    report = run_doctor("/opt/fake/criu", system=system)

    assert report.ready and report.failed == ()
    checks = by_name(report)
    assert checks["criu"] == ("ok", "4.2.1 at /opt/fake/criu (found by prefix)")
    assert checks["criu check"] == ("ok", "Looks good.")
    assert checks["lazy restore"][0] == "ok"
    assert checks["namespaces"][0] == "ok" and checks["/dev/shm"] == ("ok", "tmpfs")
    assert checks["CRIU kdat cache"] == ("ok", "/run is a tmpfs")
    assert checks["capabilities"][0] == "warn" and "CAP_SYS_RESOURCE" in checks["capabilities"][1]
    assert checks["cuda-checkpoint"][0] == "info" and checks["kernel"][0] == "info"
    assert system.events == [
        "find_criu /opt/fake/criu",
        "criu check",
        "criu check --feature uffd-noncoop",
        "unshare " + " ".join(NAMESPACE_PROBE),
    ]


def test_every_capability_present_is_ok() -> None:
    report = run_doctor(system=FakeSystem(cap_eff=ALL_CAPS))

    assert by_name(report)["capabilities"][0] == "ok"


def test_not_root_without_capabilities_fails_naming_them() -> None:
    report = run_doctor(system=FakeSystem(euid=1000, cap_eff=0))

    assert not report.ready
    assert report.failed == ("root", "capabilities")
    detail = by_name(report)["capabilities"][1]
    for name in ("CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_CHECKPOINT_RESTORE"):
        assert name in detail
    assert "CAP_SYS_RESOURCE" not in detail  # optional: never a reason to fail


def test_missing_criu_fails_and_skips_the_criu_probes() -> None:
    missing = CriuNotFound("CRIU given by option does not exist: /nope", path="/nope")
    system = FakeSystem(criu=missing)

    report = run_doctor("/nope", system=system)

    assert report.failed == ("criu", "criu check")
    checks = {check.name: check for check in report.checks}
    assert checks["criu"].detail == "CRIU given by option does not exist: /nope"
    assert checks["criu"].fix is not None and checks["criu"].fix.startswith("--criu must name")
    assert checks["lazy restore"].status == "warn"
    assert not any(event.startswith("criu") for event in system.events)


def test_no_criu_anywhere_points_at_the_installer() -> None:
    system = FakeSystem(criu=CriuNotFound("no CRIU >= 4.2 found; run scripts/install-criu"))

    report = run_doctor(system=system)

    fix = {check.name: check.fix for check in report.checks}["criu"]
    assert report.failed == ("criu", "criu check") and fix and "install-criu" in fix


def test_failing_criu_check_fails_with_its_output() -> None:
    system = FakeSystem()
    system.responses["criu check"] = (1, "Error (criu/vdso.c:1): Unexpected rt vDSO area bounds")

    report = run_doctor(system=system)

    assert report.failed == ("criu check",)
    assert "Unexpected rt vDSO area bounds" in by_name(report)["criu check"][1]


def test_hanging_criu_check_fails_as_a_timeout() -> None:
    system = FakeSystem()
    system.responses["criu check"] = subprocess.TimeoutExpired(["criu", "check"], 60)

    report = run_doctor(system=system)

    assert by_name(report)["criu check"] == ("fail", "timed out after 60 s")


def test_no_lazy_restore_is_only_a_warning() -> None:
    system = FakeSystem()
    system.responses["criu check --feature uffd-noncoop"] = (1, "uffd-noncoop is NOT supported")

    report = run_doctor(system=system)

    assert report.ready and by_name(report)["lazy restore"][0] == "warn"


def test_missing_unshare_fails_both_checks() -> None:
    system = FakeSystem(tools={"unshare": None, "cuda-checkpoint": None})

    report = run_doctor(system=system)

    assert report.failed == ("unshare", "namespaces")
    assert not any(event.startswith("unshare") for event in system.events)


def test_namespaces_that_cannot_be_created_fail() -> None:
    system = FakeSystem()
    system.responses["unshare " + " ".join(NAMESPACE_PROBE)] = (
        1,
        "unshare: unshare failed: Operation not permitted",
    )

    report = run_doctor(system=system)

    assert report.failed == ("namespaces",)
    assert "Operation not permitted" in by_name(report)["namespaces"][1]


@pytest.mark.parametrize(
    ("mounts", "detail"),
    [("proc /proc proc rw 0 0\n", "not a mount point"), ("x /dev/shm ext4 rw 0 0\n", "is ext4")],
    ids=["missing", "ext4"],
)
def test_dev_shm_that_is_not_tmpfs_is_a_warning(mounts: str, detail: str) -> None:
    report = run_doctor(system=FakeSystem(mounts=mounts))

    status, seen = by_name(report)["/dev/shm"]
    assert report.ready and status == "warn" and detail in seen


def test_run_that_is_not_tmpfs_is_handled_with_a_private_run() -> None:
    report = run_doctor(system=FakeSystem(mounts="proc /proc proc rw 0 0\n"))

    status, seen = by_name(report)["CRIU kdat cache"]
    assert status == "ok" and "/run is not a mount point" in seen and "private /run" in seen


def test_run_that_is_not_tmpfs_without_unshare_warns_about_criu_start_time() -> None:
    system = FakeSystem(
        mounts="proc /proc proc rw 0 0\n", tools={"unshare": None, "cuda-checkpoint": None}
    )

    status, seen = by_name(run_doctor(system=system))["CRIU kdat cache"]
    assert status == "warn" and "probes the kernel" in seen


def test_cuda_checkpoint_is_informational() -> None:
    tools = {"unshare": "/usr/bin/unshare", "cuda-checkpoint": "/usr/bin/cuda-checkpoint"}

    report = run_doctor(system=FakeSystem(tools=tools))

    assert by_name(report)["cuda-checkpoint"] == ("info", "/usr/bin/cuda-checkpoint")


def test_other_architectures_warn_about_the_installer() -> None:
    report = run_doctor(system=FakeSystem(machine="aarch64"))

    assert by_name(report)["kernel"][0] == "warn"


def test_the_report_round_trips_through_json() -> None:
    report = run_doctor(system=FakeSystem(euid=1000))

    assert DoctorReport.model_validate_json(report.model_dump_json()) == report


def test_effective_capabilities_reads_cap_eff() -> None:
    status = "CapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\nCapBnd:\t0\n"

    assert effective_capabilities(status) == NO_SYS_RESOURCE
    with pytest.raises(ValueError, match="CapEff"):
        effective_capabilities("Name:\tx\n")
    needed = ("CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_SYS_PTRACE")
    assert missing_capabilities(status, needed) == ["CAP_SYS_RESOURCE"]
    assert missing_capabilities("Name:\tx\n", needed) == list(needed)


def test_mount_type_takes_the_top_of_stacked_mounts_and_unescapes() -> None:
    mounts = "a /dev/shm tmpfs rw 0 0\nb /dev/shm ext4 rw 0 0\nc /my\\040dir xfs rw 0 0\n"

    assert mount_type(mounts, "/dev/shm") == "ext4"
    assert mount_type(mounts, "/my dir") == "xfs"
    assert mount_type(mounts, "/nowhere") is None


@pytest.mark.criu
def test_this_machine_is_ready(criu_binary: CriuBinary) -> None:
    report = run_doctor()

    assert report.ready, report.failed
    checks = by_name(report)
    assert checks["criu"][0] == "ok" and str(criu_binary.path) in checks["criu"][1]
    assert checks["criu check"][0] == "ok" and checks["namespaces"][0] == "ok"


def test_cuda_checkpoint_from_the_variable_the_native_step_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SNAPCTL_CUDA_CHECKPOINT", "/opt/snapctl/cuda-checkpoint-driver")
    report = run_doctor(system=FakeSystem())
    assert by_name(report)["cuda-checkpoint"] == ("info", "/opt/snapctl/cuda-checkpoint-driver")


def test_host_mounts_that_criu_cannot_dump_are_named() -> None:
    assert by_name(run_doctor(system=FakeSystem()))["host mounts"][0] == "ok"
    mounts = MOUNTS + "/dev/vda / ext4 rw 0 0\n/dev/vdb /usr/local/nvidia squashfs ro 0 0\n"
    status, detail = by_name(run_doctor(system=FakeSystem(mounts=mounts)))["host mounts"]
    assert status == "info" and detail.startswith("/usr/local/nvidia: CRIU cannot dump")


def test_host_mounts_every_sandbox_hides_are_reported_and_not_called_external() -> None:
    assert by_name(run_doctor(system=FakeSystem()))["hidden host mounts"][0] == "ok"
    # What `ip netns add cni-1; ip netns add x; ip netns del x` leaves where /run is no tmpfs.
    mounts = MOUNTS + (
        "/dev/vda / ext4 rw 0 0\n/dev/vda /run/netns ext4 rw 0 0\n"
        "nsfs /run/netns/cni-1 nsfs rw 0 0\nsnapctl-copy-1 /var/lib/snapctl/a/shm tmpfs rw 0 0\n"
    )
    checks = by_name(run_doctor(system=FakeSystem(mounts=mounts)))
    status, detail = checks["hidden host mounts"]
    assert status == "info"
    assert detail.startswith("/run/netns (ext4), /run/netns/cni-1 (nsfs): hidden from every")
    assert checks["host mounts"][0] == "ok"  # neither becomes an external host mount


def test_many_hidden_host_mounts_are_counted() -> None:
    netns = "".join(f"nsfs /run/netns/cni-{n} nsfs rw 0 0\n" for n in range(20))
    detail = by_name(run_doctor(system=FakeSystem(mounts=MOUNTS + netns)))["hidden host mounts"][1]
    assert "/run/netns/cni-7 (nsfs) and 12 more: hidden" in detail


def test_on_a_host_no_container_is_probed() -> None:
    system = FakeSystem()

    report = run_doctor(system=system)

    assert by_name(report)["container"] == ("info", "none detected: on a host")
    assert "container probes" not in system.events
    assert not {"seccomp", "/proc/sys", "device nodes", "cgroup"} & set(by_name(report))


def test_a_privileged_container_has_what_snapctl_needs() -> None:
    system = FakeSystem(runtime="podman")

    report = run_doctor(system=system)

    assert report.ready
    checks = by_name(report)
    assert checks["container"][0] == "info" and "(podman)" in checks["container"][1]
    assert "/dev is tmpfs" in checks["container"][1]
    for name in ("seccomp", "/proc/sys", "device nodes", "cgroup"):
        assert checks[name][0] == "ok"
    assert system.events[-1] == "container probes"


def test_an_unprivileged_container_fails_naming_privileged_for_each_lack() -> None:
    report = run_doctor(system=FakeSystem(runtime="podman", facts=UNPRIVILEGED))

    assert not report.ready
    assert report.failed == ("seccomp", "/proc/sys", "device nodes")
    checks = {check.name: check for check in report.checks}
    assert "ns_last_pid" in checks["/proc/sys"].detail
    assert "Operation not permitted" in checks["device nodes"].detail
    # Without cgroups only limits and accounting go: a warning.
    assert checks["cgroup"].status == "warn" and "Read-only" in checks["cgroup"].detail
    for name in ("seccomp", "/proc/sys", "device nodes", "cgroup"):
        fix = checks[name].fix
        assert fix is not None and "--privileged" in fix
