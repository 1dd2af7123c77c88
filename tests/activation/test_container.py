"""``copy --into-container`` without root: finding the container (a fake ``podman inspect`` and
a fake /proc), each refusal and the fix it names, where the copy's cgroup goes, the PID CRIU
writes translated to the host's, the container's files for the image's host mounts, and the
command CRIU runs in."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest

from snapctl.activation.container import (
    Container,
    ContainerError,
    ContainerReferenceError,
    Inspected,
    resolve_container,
)
from snapctl.criu import CriuBinary
from snapctl.criu.external import host_key
from snapctl.errors import ExitStatus
from snapctl.supervision.process import ProcessGoneError

pytestmark = pytest.mark.timeout(60)

CONTAINER_CGROUP = "/libpod_parent/libpod-abc"
# The container's first process: this test's own PID, so that its start time is real.
PID = os.getpid()


def fake_proc(
    tmp_path: Path, *, nspid: str = f"{PID} 1", shared_pidns: bool = False,
    root_visible: bool = True, cap_eff: str = "000001ffffffffff",
) -> Path:  # fmt: skip
    """A /proc with ``self`` (snapctl) and ``PID`` (the container's first process)."""
    proc = tmp_path / "proc"
    root = tmp_path / "merged"
    root.mkdir(parents=True)
    for entry, status in (("self", f"NSpid:\t{PID}\nCapEff:\t{cap_eff}\n"),
                          (str(PID), f"NSpid:\t{nspid}\n")):  # fmt: skip
        (proc / entry / "ns").mkdir(parents=True, exist_ok=True)
        (proc / entry / "status").write_text(status)
    for ns in ("pid", "mnt"):
        (proc / "self" / "ns" / ns).write_text(ns)
        if shared_pidns and ns == "pid":
            os.link(proc / "self" / "ns" / ns, proc / str(PID) / "ns" / ns)
        else:
            (proc / str(PID) / "ns" / ns).write_text(ns)
    # The container's root, a volume (from a directory of the host's second disk) and a
    # volume of a device this host does not mount.
    (proc / str(PID) / "mountinfo").write_text(
        "94 64 0:45 / / rw - overlay overlay rw\n"
        "95 94 254:1 /vol /models ro - ext4 /dev/vdb rw\n"
        "96 94 0:99 / /elsewhere rw - tmpfs tmpfs rw\n"
        "97 94 254:1 /vol2 /data rw - ext4 /dev/vdb rw\n"
    )
    host = "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
    host += f"28 27 254:1 / {tmp_path / 'disk'} rw - ext4 /dev/vdb rw\n"
    if root_visible:
        host += f"62 27 0:45 / {root} rw - overlay overlay rw\n"
    (proc / "self" / "mountinfo").write_text(host)
    (proc / str(PID) / "root").symlink_to(root)  # what the container sees at "/"
    (proc / str(PID) / "cgroup").write_text(
        f"4:memory:{CONTAINER_CGROUP}\n1:cpu:{CONTAINER_CGROUP}\n8:pids:{CONTAINER_CGROUP}\n"
        f"0::{CONTAINER_CGROUP}\n"
    )
    return proc


def running(reference: str) -> Inspected | None:
    return Inspected(pid=PID, running=True, status="running")


def test_a_running_container_by_name_or_by_its_first_process(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    asked: list[str] = []

    def inspect(reference: str) -> Inspected | None:
        asked.append(reference)
        return running(reference)

    by_name = resolve_container("placeholder-1", inspect=inspect, proc=proc)
    assert asked == ["placeholder-1"]
    assert by_name.pid == PID and by_name.level == 1 and by_name.root == tmp_path / "merged"
    assert by_name.host_path("/etc/hosts") == (tmp_path / "merged" / "etc" / "hosts", True, False)
    volume = tmp_path / "disk" / "vol"
    assert by_name.host_path("/models/m/w.bin") == (volume / "m" / "w.bin", False, True)
    assert by_name.host_path("/models") == (volume, False, True)  # read-only in the container
    assert by_name.host_path("/elsewhere/x") is None  # no mount of it here
    by_pid = resolve_container(str(PID), inspect=inspect, proc=proc)
    assert asked == ["placeholder-1"] and by_pid.root == by_name.root  # no lookup for a PID


@pytest.mark.parametrize("reference", ["", "../etc", "a;b", "-rf", "a b", "$(id)", "x" * 200])
def test_a_reference_that_names_no_container_is_refused_before_anything_looks(
    tmp_path: Path, reference: str
) -> None:
    def inspect(reference: str) -> Inspected | None:
        raise AssertionError("looked up")

    with pytest.raises(ContainerReferenceError) as refused:
        resolve_container(reference, inspect=inspect, proc=fake_proc(tmp_path))
    assert refused.value.exit_status == ExitStatus.USAGE
    assert "no container name, ID or PID" in refused.value.message


def test_no_such_container_and_one_not_running_name_the_fix(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    with pytest.raises(ContainerError) as missing:
        resolve_container("gone", inspect=lambda _: None, proc=proc)
    assert missing.value.exit_status == ExitStatus.UNAVAILABLE
    assert "no container 'gone'" in missing.value.message and "podman run" in missing.value.message
    stopped = Inspected(pid=0, running=False, status="exited")
    with pytest.raises(ContainerError) as refused:
        resolve_container("box", inspect=lambda _: stopped, proc=proc)
    assert "box is exited, not running" in refused.value.message
    assert "podman start box" in refused.value.message


def test_a_process_outside_any_container_is_refused(tmp_path: Path) -> None:
    # In this host's PID namespace: its NSpid has one entry.
    proc = fake_proc(tmp_path, nspid=f"{PID}")
    with pytest.raises(ContainerError, match="is not in a container"):
        resolve_container(str(PID), proc=proc)
    # The same PID namespace as snapctl's, however it is numbered.
    proc = fake_proc(tmp_path / "shared", shared_pidns=True)
    with pytest.raises(ContainerError, match="is not in a container"):
        resolve_container(str(PID), proc=proc)


def test_a_process_that_is_not_the_containers_first_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="not its container's first process"):
        resolve_container(str(PID), proc=fake_proc(tmp_path, nspid=f"{PID} 7"))


def test_no_such_process_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="no process 999999999"):
        resolve_container("999999999", proc=fake_proc(tmp_path))


def test_a_root_this_host_does_not_mount_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="root of container box is not mounted"):
        resolve_container("box", inspect=running, proc=fake_proc(tmp_path, root_visible=False))


def test_snapctl_without_the_capabilities_it_needs_is_refused(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cap_eff="0000000000000000")
    with pytest.raises(ContainerError, match="CAP_SYS_ADMIN and CAP_SYS_PTRACE"):
        resolve_container("box", inspect=running, proc=proc)


def container(tmp_path: Path) -> Container:
    return resolve_container("box", inspect=running, proc=fake_proc(tmp_path))


def test_the_copys_cgroup_goes_below_the_containers_on_v1(tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    for controller in ("memory", "cpu", "pids"):
        (cgroups / controller).mkdir(parents=True)
        (cgroups / controller / "cgroup.procs").write_text("")
    layout = container(tmp_path).cgroup_layout(cgroups)
    assert layout is not None and layout.version == 1
    assert layout.parents == {
        controller: cgroups / controller / CONTAINER_CGROUP.strip("/") / "snapctl"
        for controller in ("memory", "cpu", "pids")
    }


def test_the_copys_cgroup_goes_beside_the_containers_on_v2(tmp_path: Path) -> None:
    # A cgroup with processes cannot hand controllers down: below the container's parent (a
    # pod's cgroup on Kubernetes).
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    (cgroups / "cgroup.controllers").write_text("memory cpu pids\n")
    layout = container(tmp_path).cgroup_layout(cgroups)
    assert layout is not None and layout.version == 2
    assert layout.parents == {"unified": cgroups / "libpod_parent" / "snapctl"}


def test_the_pid_criu_writes_is_translated_to_the_hosts(tmp_path: Path) -> None:
    box = container(tmp_path)
    proc = box.proc
    (proc / str(PID) / "task" / str(PID)).mkdir(parents=True)
    (proc / str(PID) / "task" / str(PID) / "children").write_text("4242 4343 ")
    for host, inside in ((4242, 12), (4343, 45)):
        (proc / str(host)).mkdir()
        (proc / str(host) / "status").write_text(f"NSpid:\t{host}\t{inside}\t1\n")
    assert box.host_pid(45) == 4343
    with pytest.raises(ProcessGoneError, match="no process 99"):
        box.host_pid(99)


def volume(box: Container, tmp_path: Path) -> Path:
    """The container's volume at /models (a directory of the host's second disk), with the
    directory ``m`` in it, as the container sees it too."""
    (tmp_path / "disk" / "vol" / "m").mkdir(parents=True)
    (box.root / "models").symlink_to(tmp_path / "disk" / "vol")
    return tmp_path / "disk" / "vol"


def test_the_images_host_mounts_are_the_containers_files(tmp_path: Path) -> None:
    box = container(tmp_path)
    (box.root / "opt" / "m").mkdir(parents=True)
    volume(box, tmp_path)
    work = tmp_path / "work"
    mounts = {"control": "/run/snapctl/control", host_key("/opt/m"): "/opt/m",
              host_key("/models/m"): "/models/m"}  # fmt: skip
    # On the container's root: under its bind; on a volume: that volume's own bind.
    assert box.mount_sources(mounts, work) == {
        host_key("/opt/m"): work / "container-root" / "opt" / "m",
        host_key("/models/m"): work / "container-volumes" / "1",
    }
    with pytest.raises(ContainerError, match="does not hold"):
        box.mount_sources({host_key("/srv/none"): "/srv/none"}, work)
    with pytest.raises(ContainerError, match="does not hold"):
        box.mount_sources({host_key("/elsewhere/x"): "/elsewhere/x"}, work)
    # The host's path is not what the container sees there (another mount covers one).
    (tmp_path / "disk" / "vol2" / "x").mkdir(parents=True)
    (box.root / "data" / "x").mkdir(parents=True)
    with pytest.raises(ContainerError, match="does not hold"):
        box.mount_sources({host_key("/data/x"): "/data/x"}, work)
    assert box.file_view(mounts).mounts == {"/models/m": tmp_path / "disk" / "vol" / "m"}
    assert box.file_view(mounts).root == box.root
    (box.root / "link").symlink_to(box.root / "opt")
    with pytest.raises(ContainerError, match="does not hold"):
        box.mount_sources({host_key("/link"): "/link"}, work)


def test_criu_runs_in_the_containers_pid_namespace_with_its_root_bound(tmp_path: Path) -> None:
    box = container(tmp_path)
    volume(box, tmp_path)
    criu = CriuBinary(path=Path("/opt/criu"), version="4.2", source="option")
    work = tmp_path / "work"
    work.mkdir()
    argv = box.criu(criu, work, {host_key("/models/m"): "/models/m"}).argv
    assert argv[argv.index("--target") + 1] == str(PID) and "--pid" in argv
    # Two binds: the root, then the volume (read-only, as the container has it), each onto
    # its target below the work dir.
    assert "--mount" in argv and argv[-8:] == (
        "2", str(box.root), str(work / "container-root"), "rw",
        str(tmp_path / "disk" / "vol" / "m"), str(work / "container-volumes" / "0"), "ro",
        "/opt/criu",
    )  # fmt: skip
    assert (work / "container-root").is_dir() and (work / "container-volumes" / "0").is_dir()


def test_the_identity_gate_hashes_the_containers_files(tmp_path: Path) -> None:
    from snapctl.images.identity.tree import FileView, hash_files

    root = tmp_path / "merged"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "x.so").write_bytes(b"in the container")
    (tmp_path / "cache").mkdir()
    [record] = hash_files(["/lib/x.so"], tmp_path / "cache", view=FileView(root))
    assert record.path == "/lib/x.so" and record.size == len(b"in the container")
    again = hash_files(["/lib/x.so"], tmp_path / "cache", view=FileView(root))  # from the cache
    assert again == [record]
    (root / "lib" / "x.so").write_bytes(b"changed in the container")
    assert (
        hash_files(["/lib/x.so"], tmp_path / "cache", view=FileView(root))[0].sha256
        != record.sha256
    )
    assert hash_files(["/lib/x.so"], None, view=FileView(tmp_path / "elsewhere")) == []


def test_criu_joins_the_containers_network_namespace_as_its_proc_names_it(
    tmp_path: Path,
) -> None:
    from snapctl.criu.ops import restore_args

    # CRIU runs in the container's PID namespace with a /proc of it: PID 1 is the container's.
    netns = container(tmp_path).netns
    assert netns == "/proc/1/ns/net"
    args = restore_args(Path("/w"), Path("/w/root.pid"), {}, lazy=False, root=Path("/r"),
                        netns=netns)  # fmt: skip
    assert args[args.index("--join-ns") + 1] == "net:/proc/1/ns/net"
    assert "--join-ns" not in restore_args(Path("/w"), Path("/w/root.pid"), {}, lazy=False)


def test_the_containers_network_must_have_the_images_addresses_and_a_free_port(
    tmp_path: Path,
) -> None:
    from snapctl.namespaces.publish import PortInUseError

    # The container's first process is this test's own: its network is this host's.
    box = container(tmp_path)
    assert box.claim_network(["127.0.0.1"], ("127.0.0.1", 18555)) == ("127.0.0.1", 18555)
    address, port = box.claim_network([], ("127.0.0.1", 0))  # any port free there now
    assert address == "127.0.0.1" and port > 0
    with pytest.raises(ContainerError, match=r"198\.51\.100\.7.*ip address add ADDR dev lo"):
        box.claim_network(["127.0.0.1", "198.51.100.7"], ("127.0.0.1", 0))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{busy} is in use on container box"):
            box.claim_network([], ("127.0.0.1", busy))


def test_a_container_hosts_one_copy_at_a_time(tmp_path: Path) -> None:
    box = container(tmp_path)
    locks = tmp_path / "locks"
    held = box.hold(locks)
    with pytest.raises(ContainerError, match="already hosts a copy, or one is being restored"):
        box.hold(locks)
    other = resolve_container("other", inspect=running, proc=box.proc)
    with pytest.raises(ContainerError):
        other.hold(locks)  # the same container by another name
    held.release()
    box.hold(locks).release()  # free again once the copy stopped


def test_what_the_container_has_read_only_is_made_read_only_in_the_copy(tmp_path: Path) -> None:
    box = container(tmp_path)
    (box.root / "opt" / "m").mkdir(parents=True)
    volume(box, tmp_path)
    mounts = {host_key("/opt/m"): "/opt/m", host_key("/models/m"): "/models/m"}
    assert box.read_only_points(mounts) == ["/models/m"]  # its volume is read-only
    # A read-only root (readOnlyRootFilesystem): the root, and a mount bound from it too.
    read_only_root = dataclasses.replace(
        box, mountinfo=box.mountinfo.replace("/ / rw -", "/ / ro -", 1)
    )
    assert read_only_root.read_only_points(mounts) == ["/", "/opt/m", "/models/m"]
