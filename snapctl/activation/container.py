"""A copy restored inside a running container (``copy --into-container``): the placeholder
pattern, in which a container of the workload's image runs ``sleep infinity`` and the copy's
tree is restored inside it.

What the copy shares with the container, and how:

- **PID namespace.** ``criu restore`` runs in the container's PID namespace (``nsenter --pid``
  forks it there), so the tree's own PID namespace nests inside the container's: when the
  container's first process ends, the kernel kills the tree with every other process of it.
  CRIU then sees a ``/proc`` of that namespace, mounted in a mount namespace of its own, and
  writes the tree's PID as the container counts it: :meth:`Container.host_pid` translates.
- **Files.** The tree's root is the container's root (CRIU's ``--root``: the host's mount of
  it, bound where CRIU's private ``/run`` does not hide it), so it reads the container's files;
  the identity gate hashes them as the tree will see them (:meth:`Container.file_view`). Each
  mount the image recorded as external (a model's own disk) comes from the container's mount
  at that path: its root, or the volume there, found through the host's mount of the same
  filesystem (:meth:`Container.host_path`) and bound the same way. What the container has
  read-only is made read-only in the tree once CRIU restored it (:meth:`Container.keep_read_only`).
- **One copy.** A container hosts one copy at a time (:meth:`Container.hold`).
- **cgroup.** The copy's cgroup is made below the container's (cgroup v1), or beside it below
  its parent (cgroup v2, where a cgroup holding processes cannot hand controllers down: a
  pod's cgroup on Kubernetes), and CRIU enters it before it forks the tree.
- **Network.** The tree joins the container's network namespace (``criu restore --join-ns``),
  and none of the image's network state is restored into it (the donor's firewall rules,
  sysctls and links stay out: ``netdumps.joined_view``). The server listens on the
  container's own network, where ``--publish`` names (no relay: a pod's address and port
  reach it directly); the image's extra loopback addresses must be there already.

Everything here is refused before CRIU runs, each with the fix: a reference that is no name,
ID or PID; no such container; one not running; a process that is no container's first
process; a root this host cannot see; a file or volume the image binds that the container
lacks or this host does not mount; a loopback address the image's server uses that the
container's network lacks, or a port taken there; a container that already hosts a copy (one
copy per container: copies there would share its network); a snapctl without the
capabilities it needs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from snapctl.activation.requests import CONTAINER_REFERENCE
from snapctl.cgroups.layout import CGROUP_ROOT, UNIFIED, Layout, cgroup_paths, detect_layout
from snapctl.criu import CriuBinary
from snapctl.criu.external import host_key, host_mounts
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images.identity.tree import FileView
from snapctl.namespaces.mounts import unescape_mount_field
from snapctl.phases import HostPhase
from snapctl.statedir.flock import try_lock
from snapctl.supervision.process import (
    ProcessGoneError,
    is_same_process,
    missing_capabilities,
    start_time,
    status_field,
)

REFERENCE = re.compile(CONTAINER_REFERENCE)
INSPECT_TIMEOUT_S = 30.0
# The capabilities snapctl needs to enter a container's namespaces and run CRIU there.
NEEDED_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SYS_PTRACE")
# Run in the container's PID namespace and a mount namespace of CRIU's own: a /proc of that
# PID namespace (CRIU reads its own and its children's entries by the PIDs it sees), and the
# container's root and volumes bound where a private /run cannot hide them ($1 times a source,
# a target and "ro" or "rw", as the container has it, while CRIU runs; CRIU then gives each
# mount the donor's flags, and keep_read_only puts the container's back), then CRIU.
ENTER_SCRIPT = (
    'mount -t proc snapctl-proc /proc || exit 125; n=$1; shift; while [ "$n" -gt 0 ]; do '
    'mount --bind "$1" "$2" || exit 125; if [ "$3" = ro ]; then '
    'mount -o remount,bind,ro "$2" || exit 125; fi; shift 3; n=$((n-1)); done; exec "$@"'
)
ROOT_BIND = "container-root"
# Where a container is held for the copy it hosts (a tmpfs: nothing outlives a reboot).
LOCK_DIR = Path("/run/lock/snapctl")
VOLUME_BINDS = "container-volumes"


# (device, root in its filesystem, mount point, the mount's own options): a mountinfo line.
MountEntry = tuple[str, str, str, str]


class Located(NamedTuple):
    """Where this host mounts a file or directory of a container, and how the container has
    it: on its root filesystem (else on a volume), read-only."""

    path: Path
    on_root: bool
    read_only: bool


class ContainerHold:
    """An open descriptor on a container's lock file carrying a ``flock``: the one copy the
    container hosts (:meth:`Container.hold`)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


class ContainerError(SnapctlError):
    """A container that cannot host the copy; nothing was started."""

    exit_status = ExitStatus.UNAVAILABLE


class ContainerReferenceError(ContainerError):
    """``--into-container`` names no container, ID or PID in a form snapctl accepts."""

    exit_status = ExitStatus.USAGE


@dataclass(frozen=True)
class Inspected:
    """What the container runtime says of a container."""

    pid: int
    running: bool
    status: str


Inspect = Callable[[str], "Inspected | None"]


def podman_inspect(reference: str) -> Inspected | None:
    """``podman inspect`` of a container: None where there is no such container."""
    podman = shutil.which("podman")
    if podman is None:
        raise ContainerError(
            f"cannot look up container {reference!r}: podman is not installed here (give the "
            "container's first process's PID instead)",
            phase=HostPhase.RESTORE,
        )
    try:
        proc = subprocess.run(
            [podman, "inspect", "--type", "container", "--format", "json", "--", reference],
            capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as error:
        raise ContainerError(f"podman inspect {reference} timed out",
                             phase=HostPhase.RESTORE) from error  # fmt: skip
    if proc.returncode != 0:
        return None
    try:
        state = json.loads(proc.stdout)[0]["State"]
        return Inspected(
            pid=int(state["Pid"]), running=bool(state["Running"]), status=str(state["Status"])
        )
    except (ValueError, LookupError, TypeError) as error:
        raise ContainerError(f"podman inspect {reference} answered what snapctl cannot read",
                             phase=HostPhase.RESTORE) from error  # fmt: skip


@dataclass(frozen=True)
class Container:
    """A running container that hosts a copy: its first process (``pid``, on this host),
    its root as this host mounts it, its cgroups and its PID namespace's depth."""

    reference: str
    pid: int
    start_time: float
    root: Path
    cgroup: str  # the text of /proc/PID/cgroup
    level: int  # how deep its PID namespace is (0: this host's)
    proc: Path = Path("/proc")
    mountinfo: str = ""  # the text of /proc/PID/mountinfo

    def alive(self) -> bool:
        return is_same_process(self.pid, self.start_time)

    def require_alive(self) -> None:
        if not self.alive():
            raise ContainerError(
                f"container {self.reference} stopped (start it again: podman start "
                f"{self.reference})",
                phase=HostPhase.RESTORE, pid=self.pid,
            )  # fmt: skip

    def file_view(self, external_mounts: Mapping[str, str]) -> FileView:
        """The container's files as the copy's tree will see them, where the identity gate
        reads them: its root filesystem, and the volumes that the image's ``host:`` mounts
        come from (:meth:`mount_sources`)."""
        return FileView(
            root=self.root,
            mounts={
                external_mounts[key]: located.path
                for key, (_, located) in self._host_mounts(external_mounts).items()
                if not located.on_root
            },
        )

    def host_path(self, inside: str, own: list[MountEntry] | None = None) -> Located | None:
        """Where this host mounts the container's file or directory ``inside`` (below the
        host's mount of the filesystem the container's mount at ``inside`` comes from), and
        how the container has it; None where this host does not mount it (a volume of another
        mount namespace). ``own``: this host's mount entries, when already read."""
        covering = _covering_mount(_mount_entries(self.mountinfo), inside)
        if covering is None:
            return None
        device, root, point, options = covering
        within = os.path.normpath(os.path.join(root, os.path.relpath(inside, point)))
        if own is None:
            own = _mount_entries((self.proc / "self" / "mountinfo").read_text())
        found = [
            (host_root, host_point)
            for host_device, host_root, host_point, _ in own
            if host_device == device and _below(within, host_root)
        ]
        if not found:
            return None
        host_root, host_point = max(found, key=lambda entry: len(entry[0]))
        rest = os.path.relpath(within, host_root)
        return Located(
            path=Path(host_point) if rest == "." else Path(host_point) / rest,
            on_root=point == "/",
            read_only="ro" in options.split(","),
        )

    def cgroup_layout(self, cgroup_root: Path | None = None) -> Layout | None:
        """Where the copy's cgroup goes: below the container's (v1), beside it (v2)."""
        layout = detect_layout(cgroup_root or CGROUP_ROOT, self_cgroup=self.cgroup)
        if layout is None:
            return None
        if layout.version == 1:
            # detect_layout put snapctl's parent below the container's cgroup in each
            # hierarchy, unless SNAPCTL_CGROUP_PARENT moved it: the container's decides here.
            own = cgroup_paths(self.cgroup)
            parents = {
                key: _inside(layout.mounts[key], own.get(key, "/"), layout.roots.get(key, "/"))
                / "snapctl"
                for key in layout.parents
            }
            return dataclasses.replace(layout, parents=parents)
        mine = cgroup_paths(self.cgroup).get(UNIFIED, "/")
        base = str(Path(mine).parent) if mine.strip("/") else "/"
        unified = layout.mounts["unified"]
        parent = _inside(unified, base, layout.roots.get(UNIFIED, "/")) / "snapctl"
        return dataclasses.replace(layout, parents={"unified": parent})

    def criu(
        self, criu: CriuBinary, work_dir: Path, external_mounts: Mapping[str, str]
    ) -> CriuBinary:
        """``criu`` run in the container's PID namespace, with a /proc of it, the container's
        root bound at :meth:`root_bind` and each volume an image's ``host:`` mount comes from
        bound below the work dir (see the module's docstring and :meth:`mount_sources`)."""
        bind = self.root_bind(work_dir)
        bind.mkdir(mode=0o700, exist_ok=True)
        binds = [(self.root, bind, False), *self._volume_binds(external_mounts, work_dir)]
        for source, target, _ in binds[1:]:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if source.is_dir():
                target.mkdir(mode=0o700, exist_ok=True)
            else:
                target.touch(mode=0o600, exist_ok=True)
        nsenter, unshare = _tool("nsenter"), _tool("unshare")
        command = (
            nsenter, "--target", str(self.pid), "--pid", "--",
            unshare, "--mount", "--propagation", "slave", "--",
            "/bin/sh", "-c", ENTER_SCRIPT, "snapctl-container", str(len(binds)),
            *(field for source, target, read_only in binds
              for field in (str(source), str(target), "ro" if read_only else "rw")),
            *criu.argv,
        )  # fmt: skip
        return dataclasses.replace(criu, command=command)

    @property
    def netns(self) -> str:
        """The container's network namespace as CRIU names it (in the container's PID
        namespace, with a /proc of it: its first process is PID 1)."""
        return "/proc/1/ns/net"

    @staticmethod
    def root_bind(work_dir: Path) -> Path:
        """Where CRIU's mount namespace binds the container's root (empty on the host)."""
        return work_dir / ROOT_BIND

    def mount_sources(self, external_mounts: Mapping[str, str], work_dir: Path) -> dict[str, Path]:
        """For each ``host:`` mount of the image, the container's own file or directory at
        that path (as CRIU sees it: under :meth:`root_bind`, or a volume's bind below the work
        dir), checked to exist here."""
        sources = {}
        for key, (index, located) in self._host_mounts(external_mounts).items():
            point = external_mounts[key]
            sources[key] = (
                self.root_bind(work_dir) / point.lstrip("/")
                if located.on_root
                else _volume_bind(work_dir, index)
            )
        return sources

    def _volume_binds(
        self, external_mounts: Mapping[str, str], work_dir: Path
    ) -> list[tuple[Path, Path, bool]]:
        """(where this host mounts it, where CRIU's mount namespace binds it, read-only) of
        each volume that one of the image's ``host:`` mounts comes from."""
        return [
            (located.path, _volume_bind(work_dir, index), located.read_only)
            for index, located in self._host_mounts(external_mounts).values()
            if not located.on_root
        ]

    def _host_mounts(self, external_mounts: Mapping[str, str]) -> dict[str, tuple[int, Located]]:
        """For each ``host:`` mount of the image: its key, and its index among them, where
        this host mounts the container's file or directory at that path and whether that is
        on the container's root; refused where the container holds no plain file or
        directory there that this host mounts (checked to be the very file the container
        sees)."""
        found: dict[str, tuple[int, Located]] = {}
        points = host_mounts(external_mounts)
        if not points:
            return found
        own = _mount_entries((self.proc / "self" / "mountinfo").read_text())
        for index, point in enumerate(points):
            located = self.host_path(point, own)
            seen = self.proc / str(self.pid) / "root" / point.lstrip("/")
            if (
                located is None or os.path.realpath(located.path) != str(located.path)
                or not _same_file(located.path, seen)
            ):  # fmt: skip
                raise ContainerError(
                    f"the image binds {point}, which container {self.reference} does not "
                    "hold as a plain file or directory on a mount this host sees (run the "
                    "container from the image the donor ran in, with the same volumes)",
                    phase=HostPhase.RESTORE, path=Path(point),
                )  # fmt: skip
            found[host_key(point)] = (index, located)
        return found

    def claim_network(self, lo_addresses: list[str], listen: tuple[str, int]) -> tuple[str, int]:
        """Where the copy's server will listen on the container's network: ``listen``, its
        port free there now (0: a port free there now). Refused unless the container's network
        has each of an image's extra loopback addresses (its server may listen or connect
        there), or where the port is taken (an earlier copy, the container's own process)."""
        from snapctl.namespaces.netns import NetnsConnector
        from snapctl.namespaces.publish import PortInUseError, host_addresses

        address, port = listen
        try:
            with NetnsConnector(self.pid) as there:
                present = {ipaddress.ip_address(each) for each in there.call(host_addresses)}
                missing = [each for each in lo_addresses
                           if ipaddress.ip_address(each) not in present]  # fmt: skip
                if missing:
                    raise ContainerError(
                        f"the image's server uses the loopback address(es) "
                        f"{', '.join(missing)}, which container {self.reference}'s network "
                        "lacks (add each to its lo, as the donor's sandbox had them: ip address "
                        "add ADDR dev lo)",
                        phase=HostPhase.RESTORE, pid=self.pid,
                    )  # fmt: skip
                try:
                    with there.listen(address, port) as probe:
                        return address, int(probe.getsockname()[1])
                except PortInUseError as error:
                    raise PortInUseError(
                        f"{address}:{port} is in use on container {self.reference}'s network "
                        "(by a copy restored there before, or by the container's own process: "
                        "give another --publish port, or 0 for any free one)",
                        phase=HostPhase.PUBLISH,
                    ) from error
        except OSError as error:
            raise ContainerError(
                f"the network of container {self.reference} cannot be entered: "
                f"{error.strerror or error} (is it still running?)",
                phase=HostPhase.RESTORE, pid=self.pid,
            ) from error  # fmt: skip

    def read_only_points(self, external_mounts: Mapping[str, str]) -> list[str]:
        """The mounts of a tree restored here that :meth:`keep_read_only` makes read-only."""
        points = [
            external_mounts[key]
            for key, (_, located) in self._host_mounts(external_mounts).items()
            if located.read_only
        ]
        root = _covering_mount(_mount_entries(self.mountinfo), "/")
        if root is not None and "ro" in root[3].split(","):
            points.insert(0, "/")
        return points

    def keep_read_only(self, tree_pid: int, external_mounts: Mapping[str, str]) -> None:
        """Make read-only in the restored tree whatever of it the container has read-only:
        its root, and the image's ``host:`` mounts that come from a read-only mount of the
        container (its root's, or a volume's). CRIU restores each mount with the donor's
        flags, so a pod's read-only model volume would otherwise be writable to the copy, and
        the host's directory behind it too. OSError (a timeout too) where that fails."""
        points = self.read_only_points(external_mounts)
        if not points:
            return
        # -P, and from /: nothing of the caller's working directory is importable.
        done = subprocess.run(
            [sys.executable, "-P", "-m", "snapctl.namespaces.readonly", str(tree_pid), *points],
            capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S, check=False, cwd="/",
        )  # fmt: skip
        if done.returncode != 0:
            raise OSError(
                f"cannot keep {', '.join(points)} read-only in the copy, as container "
                f"{self.reference} has them: {done.stderr.strip() or done.returncode}"
            )

    def hold(self, lock_dir: Path = LOCK_DIR) -> ContainerHold:
        """Hold the container for one copy, until :meth:`ContainerHold.release` (the copy's
        session releases it when it stops); refused while another copy holds it, however far
        that one got: copies in one container would share its network, where what each brings
        back (its loopback connections, its server's port) is the same."""
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = try_lock(lock_dir / f"container-{self.pid}-{self.start_time:.2f}.lock")
        if fd is None:
            raise ContainerError(
                f"container {self.reference} already hosts a copy, or one is being restored "
                "into it (a container hosts one copy: copies would share its network; stop "
                "that one first: snapctl ps lists it)",
                phase=HostPhase.RESTORE, pid=self.pid,
            )  # fmt: skip
        return ContainerHold(fd)

    def host_pid(self, inside: int) -> int:
        """The host's PID of the process the container's PID namespace numbers ``inside``
        (a child of its first process: a restored tree's root is reparented there)."""
        for pid in _children(self.proc, self.pid):
            ns = _nspids(self.proc, pid)
            if len(ns) > self.level and ns[self.level] == inside:
                return pid
        raise ProcessGoneError(
            f"no process {inside} in container {self.reference}'s PID namespace", pid=inside
        )


def _volume_bind(work_dir: Path, index: int) -> Path:
    return work_dir / VOLUME_BINDS / str(index)


def _same_file(here: Path, seen: Path) -> bool:
    """Whether ``here`` is the file or directory the container sees at ``seen`` (its path
    through ``/proc/PID/root``): another mount on the host may cover ``here``."""
    try:
        ours, theirs = os.stat(here), os.stat(seen)
    except OSError:
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ContainerError(f"{name} (util-linux) is needed to restore into a container",
                             phase=HostPhase.RESTORE)  # fmt: skip
    return found


def _inside(mount: Path, path: str, mount_root: str) -> Path:
    """``path`` (as /proc/PID/cgroup names it) in a hierarchy mounted at ``mount`` from
    ``mount_root`` down."""
    base = mount_root.rstrip("/")
    if base and (path == base or path.startswith(base + "/")):
        path = path[len(base) :]
    return mount / path.strip("/") if path.strip("/") else mount


def _children(proc: Path, pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(proc / str(pid) / "task")
    except OSError:
        return found
    for task in tasks:
        try:
            text = (proc / str(pid) / "task" / task / "children").read_text()
        except OSError:
            continue
        found.extend(int(child) for child in text.split())
    return found


def _status_field(proc: Path, pid: int | str, name: str) -> str | None:
    try:
        return status_field((proc / str(pid) / "status").read_text(), name)
    except OSError:
        return None


def _nspids(proc: Path, pid: int) -> list[int]:
    value = _status_field(proc, pid, "NSpid")
    return [int(part) for part in value.split()] if value else []


def _mount_entries(mountinfo: str) -> list[MountEntry]:
    """(device, root in its filesystem, mount point, the mount's own options) of each line of
    a mountinfo text."""
    entries = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 5:
            entries.append(
                (fields[2], unescape_mount_field(fields[3]), unescape_mount_field(fields[4]),
                 fields[5])
            )  # fmt: skip
    return entries


def _below(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def _covering_mount(entries: list[MountEntry], path: str) -> MountEntry | None:
    """The mount ``path`` is on: the deepest mount point above it (the last of those stacked)."""
    found = None
    for entry in entries:
        if _below(path, entry[2]) and (found is None or len(entry[2]) >= len(found[2])):
            found = entry
    return found


def _mounted_at(entries: list[MountEntry], device: str, root: str) -> Path | None:
    """Where ``entries`` mount ``device`` from ``root`` (the first such mount)."""
    for each_device, each_root, point, _ in entries:
        if (each_device, each_root) == (device, root):
            return Path(point)
    return None


def has_capabilities(proc: Path = Path("/proc")) -> bool:
    """Whether this process holds CAP_SYS_ADMIN and CAP_SYS_PTRACE (effective)."""
    try:
        status = (proc / "self" / "status").read_text()
    except OSError:
        return False
    return not missing_capabilities(status, NEEDED_CAPABILITIES)


def check_reference(reference: str) -> str:
    """``reference`` if it may name a container (a name, an ID or a PID), else refused."""
    if not REFERENCE.fullmatch(reference):
        raise ContainerReferenceError(
            f"--into-container {reference!r} is no container name, ID or PID (a letter or "
            "digit, then letters, digits, '_', '.' or '-')",
            phase=HostPhase.RESTORE,
        )
    return reference


def resolve_container(
    reference: str,
    *,
    inspect: Inspect = podman_inspect,
    proc: Path = Path("/proc"),
    capable: Callable[[], bool] | None = None,
) -> Container:
    """The running container ``reference`` names (a podman name or ID, or its first process's
    PID), or the refusal that says why it cannot host a copy and how to fix that. Nothing
    runs in it here."""
    check_reference(reference)
    if not (capable or (lambda: has_capabilities(proc)))():
        raise ContainerError(
            "restoring into a container needs CAP_SYS_ADMIN and CAP_SYS_PTRACE: run snapctl "
            "as root on the host (or in a privileged container with the host's PID namespace)",
            phase=HostPhase.RESTORE,
        )
    if reference.isdigit():
        pid = int(reference)
    else:
        inspected = inspect(reference)
        if inspected is None:
            raise ContainerError(
                f"no container {reference!r} (podman ps lists those running; start the "
                f"placeholder first: podman run -d --name {reference} IMAGE sleep infinity)",
                phase=HostPhase.RESTORE,
            )
        if not inspected.running or inspected.pid <= 0:
            raise ContainerError(
                f"container {reference} is {inspected.status}, not running (start it: podman "
                f"start {reference})",
                phase=HostPhase.RESTORE,
            )
        pid = inspected.pid
    nspids = _nspids(proc, pid)
    if not nspids:
        raise ContainerError(f"no process {pid} (is container {reference} running?)",
                             phase=HostPhase.RESTORE, pid=pid)  # fmt: skip
    level = len(nspids) - 1
    if level == 0:
        raise ContainerError(
            f"process {pid} is not in a container (it is in this host's PID namespace): give "
            "a running container's name, ID or first process's PID",
            phase=HostPhase.RESTORE, pid=pid,
        )  # fmt: skip
    try:
        own_pidns = os.stat(proc / "self" / "ns" / "pid").st_ino
        its_pidns = os.stat(proc / str(pid) / "ns" / "pid").st_ino
        own_mntns = os.stat(proc / "self" / "ns" / "mnt").st_ino
        its_mntns = os.stat(proc / str(pid) / "ns" / "mnt").st_ino
    except OSError as error:
        raise ContainerError(f"cannot read process {pid}'s namespaces: {error.strerror}",
                             phase=HostPhase.RESTORE, pid=pid) from error  # fmt: skip
    if own_pidns == its_pidns or own_mntns == its_mntns:
        raise ContainerError(
            f"process {pid} is not in a container (it shares this host's PID or mount "
            "namespace): give a running container's name, ID or first process's PID",
            phase=HostPhase.RESTORE, pid=pid,
        )  # fmt: skip
    if nspids[-1] != 1:
        raise ContainerError(
            f"process {pid} is not its container's first process (PID 1 inside): give the "
            "container's name, or its first process (podman inspect --format "
            "'{{.State.Pid}}' NAME)",
            phase=HostPhase.RESTORE, pid=pid,
        )  # fmt: skip
    try:
        started = start_time(pid)
        its_mounts = (proc / str(pid) / "mountinfo").read_text()
        own_mounts = (proc / "self" / "mountinfo").read_text()
        cgroup = (proc / str(pid) / "cgroup").read_text()
    except (OSError, ProcessGoneError) as error:
        raise ContainerError(f"container {reference} ended while snapctl looked at it",
                             phase=HostPhase.RESTORE, pid=pid) from error  # fmt: skip
    found = _covering_mount(_mount_entries(its_mounts), "/")
    root = _mounted_at(_mount_entries(own_mounts), *found[:2]) if found is not None else None
    if root is None or not root.is_dir():
        raise ContainerError(
            f"the root of container {reference} is not mounted where snapctl sees it (run "
            "snapctl in the host's mount namespace, where the container runtime mounts it)",
            phase=HostPhase.RESTORE, pid=pid,
        )  # fmt: skip
    return Container(
        reference=reference, pid=pid, start_time=started, root=root, cgroup=cgroup,
        level=level, proc=proc, mountinfo=its_mounts,
    )  # fmt: skip
