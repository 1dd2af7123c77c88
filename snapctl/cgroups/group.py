"""One activation's cgroup: made (in every hierarchy of the :class:`~snapctl.cgroups.layout.
Layout`) with its limits set, processes moved in, usage and OOM kills read, removed once empty.

A process enters it before it forks what the activation runs (:meth:`ActivationCgroup.
enter_argv` wraps a command so that it moves itself in, then execs): the sandbox's launcher for
a donor, ``criu restore`` for a copy, so that every process of the tree, and every page CRIU
restores, is the cgroup's from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import time
from dataclasses import dataclass, field
from pathlib import Path

from snapctl.cgroups.layout import CGROUP_ROOT, UNIFIED, V2_CONTROLLERS, Layout, detect_layout
from snapctl.cgroups.limits import CPU_PERIOD_US, Limits
from snapctl.errors import ExitStatus, SnapctlError

# v1 reports "no limit" as the largest page-aligned signed 64-bit value, or close to it.
V1_UNLIMITED = 1 << 62
# How long removal waits for a cgroup whose last process is still exiting.
REMOVE_WAIT_S = 2.0
# Moves itself into each cgroup.procs named first (their count is $1), then execs the rest.
_ENTER_SCRIPT = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done;'
    ' exec "$@"'
)


class CgroupError(SnapctlError):
    """An activation's cgroup could not be made, limited or entered."""

    exit_status = ExitStatus.UNAVAILABLE


@dataclass(frozen=True)
class CgroupUsage:
    """What ``ps``, ``pool ls`` and ``/metrics`` show of an activation's cgroup."""

    cgroup: str
    memory_bytes: int | None
    memory_limit_bytes: int | None
    cpus: float | None
    oom_kills: int


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as error:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {error.strerror}",
                          path=path) from error  # fmt: skip


def _keyed(text: str | None, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed file (``memory.events``, ``memory.oom_control``)."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


@dataclass(frozen=True)
class ActivationCgroup:
    """An activation's cgroup: its directory in each hierarchy (``unified`` for v2)."""

    dirs: dict[str, Path]
    # Its path inside the hierarchy (the memory one on v1), as /proc/PID/cgroup names it.
    path: str
    limits: Limits = field(default_factory=Limits)

    @property
    def version(self) -> int:
        return 2 if UNIFIED in self.dirs else 1

    @property
    def memory_dir(self) -> Path | None:
        return self.dirs.get(UNIFIED) or self.dirs.get("memory")

    def record(self) -> dict[str, str]:
        """Its directories, as an activation record keeps them to find it again."""
        return {key: str(value) for key, value in self.dirs.items()}

    @classmethod
    def from_record(
        cls, path: str, dirs: dict[str, str], limits: Limits | None = None
    ) -> ActivationCgroup:
        return cls(dirs={k: Path(v) for k, v in dirs.items()}, path=path, limits=limits or Limits())

    def procs_files(self) -> list[Path]:
        return [directory / "cgroup.procs" for directory in self.dirs.values()]

    def enter_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into this cgroup (then execs: the
        PID stays the same), so that everything it forks is born inside."""
        files = [str(path) for path in self.procs_files()]
        return ["/bin/sh", "-c", _ENTER_SCRIPT, "snapctl-cgroup", str(len(files)), *files, *argv]

    def move(self, pid: int) -> None:
        """Move ``pid`` in (a process already inside stays)."""
        for procs in self.procs_files():
            _write(procs, f"{pid}\n")

    def pids(self) -> list[int]:
        """Every process inside (all hierarchies together)."""
        found: set[int] = set()
        for procs in self.procs_files():
            found.update(int(line) for line in (_read(procs) or "").split() if line.isdigit())
        return sorted(found)

    def memory_bytes(self) -> int | None:
        directory = self.memory_dir
        if directory is None:
            return None
        text = _read(
            directory / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")
        )
        return int(text) if text and text.strip().isdigit() else None

    def memory_limit_bytes(self) -> int | None:
        directory = self.memory_dir
        if directory is None:
            return None
        if self.version == 2:
            text = (_read(directory / "memory.max") or "max").strip()
            return int(text) if text.isdigit() else None
        text = (_read(directory / "memory.limit_in_bytes") or "").strip()
        return int(text) if text.isdigit() and int(text) < V1_UNLIMITED else None

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for exceeding its memory limit."""
        directory = self.memory_dir
        if directory is None:
            return 0
        if self.version == 2:
            return _keyed(_read(directory / "memory.events"), "oom_kill") or 0
        control = _read(directory / "memory.oom_control")
        kills = _keyed(control, "oom_kill")
        if kills is not None:
            return kills
        # Older kernels count no kills: under OOM now, or its limit was hit.
        failcnt = (_read(directory / "memory.failcnt") or "0").strip()
        return 1 if _keyed(control, "under_oom") or (failcnt.isdigit() and int(failcnt)) else 0

    def usage(self) -> CgroupUsage:
        return CgroupUsage(
            cgroup=self.path, memory_bytes=self.memory_bytes(),
            memory_limit_bytes=self.memory_limit_bytes(), cpus=self.limits.cpus,
            oom_kills=self.oom_kills(),
        )  # fmt: skip

    def killed_by_memory_limit(self) -> str | None:
        """Why its tree died, if the kernel killed a process of it for its memory limit."""
        if not self.oom_kills():
            return None
        limit = self.limits.describe() or "its cgroup's memory limit"
        return f"killed by its memory limit ({limit.split(' --cpus')[0]})"

    def remove(self, wait_s: float = REMOVE_WAIT_S) -> bool:
        """Remove it from every hierarchy once empty; True if it is gone. A cgroup whose last
        process is still exiting is waited for, up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        for directory in self.dirs.values():
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
        return not any(directory.exists() for directory in self.dirs.values())

    def apply(self, limits: Limits) -> None:
        """Set ``limits`` (swap included: none beyond the memory limit)."""
        if self.version == 2:
            directory = self.dirs[UNIFIED]
            if limits.memory_bytes is not None:
                _write(directory / "memory.max", f"{limits.memory_bytes}\n")
                if (directory / "memory.swap.max").exists():
                    _write(directory / "memory.swap.max", "0\n")
                if (directory / "memory.oom.group").exists():
                    # The whole tree goes at once: a server missing a process serves nothing.
                    _write(directory / "memory.oom.group", "1\n")
            if limits.cpus is not None:
                _write(directory / "cpu.max", f"{limits.cpu_quota_us()} {CPU_PERIOD_US}\n")
            return
        if limits.memory_bytes is not None:
            directory = self._v1("memory")
            _write(directory / "memory.limit_in_bytes", f"{limits.memory_bytes}\n")
            if (directory / "memory.memsw.limit_in_bytes").exists():
                _write(directory / "memory.memsw.limit_in_bytes", f"{limits.memory_bytes}\n")
        if limits.cpus is not None:
            directory = self._v1("cpu")
            _write(directory / "cpu.cfs_period_us", f"{CPU_PERIOD_US}\n")
            _write(directory / "cpu.cfs_quota_us", f"{limits.cpu_quota_us()}\n")

    def _v1(self, controller: str) -> Path:
        if controller not in self.dirs:
            raise CgroupError(f"no cgroup v1 {controller} hierarchy is mounted for the limit")
        return self.dirs[controller]


def _enable_controllers(layout: Layout) -> None:
    """v2: hand the memory, cpu and pids controllers down to the ``snapctl`` parent's children,
    from the hierarchy's root down (only where one is available but not yet enabled)."""
    mount, parent = layout.mounts[UNIFIED], layout.parents[UNIFIED]
    parts = parent.relative_to(mount).parts
    chain = [mount / Path(*parts[:depth]) if depth else mount for depth in range(len(parts) + 1)]
    for directory in chain:
        directory.mkdir(exist_ok=True)
        available = (_read(directory / "cgroup.controllers") or "").split()
        enabled = (_read(directory / "cgroup.subtree_control") or "").split()
        missing = [c for c in V2_CONTROLLERS if c in available and c not in enabled]
        if missing:
            # Busy (processes in a non-root cgroup): the child simply lacks them.
            with contextlib.suppress(OSError):
                text = " ".join(f"+{c}" for c in missing)
                (directory / "cgroup.subtree_control").write_text(text + "\n")


def create_cgroup(
    name: str, limits: Limits, *, root: Path = CGROUP_ROOT, layout: Layout | None = None
) -> ActivationCgroup | None:
    """Make activation ``name``'s cgroup with ``limits``. Without limits it is best effort
    (None where cgroups cannot be made here: no hierarchy, no permission); with limits a
    failure raises :class:`CgroupError`, and nothing it made is left."""
    layout = layout or detect_layout(root)
    if layout is None or not layout.parents:
        if limits.any:
            raise CgroupError(f"{limits.describe()}: no usable cgroup hierarchy under {root}")
        return None
    dirs = {key: parent / name for key, parent in layout.parents.items()}
    key = UNIFIED if UNIFIED in dirs else "memory" if "memory" in dirs else next(iter(dirs))
    group = ActivationCgroup(dirs=dirs, path=layout.cgroup_path(key, dirs[key]), limits=limits)
    made: dict[str, Path] = {}
    try:
        if layout.version == 2:
            _enable_controllers(layout)
        for key, directory in dirs.items():
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir()
            made[key] = directory
        group.apply(limits)
        missing = limits.memory_bytes is not None and group.memory_limit_bytes() is None
        if missing:
            raise CgroupError(f"{limits.describe()}: the memory controller is not available "
                              f"in {group.memory_dir}")  # fmt: skip
    except (OSError, CgroupError) as error:
        # Only what this call made: a directory that was there (a name in use) is another
        # activation's, or one gc removes.
        dataclasses.replace(group, dirs=made).remove(0.0)
        if not limits.any:
            return None
        if isinstance(error, CgroupError):
            raise
        raise CgroupError(f"cannot make the cgroup {dirs}: {error}") from error
    return group


def own_pid_cgroup(pid: int) -> str:
    """``/proc/PID/cgroup``'s text (empty when it is gone), for checks and tests."""
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
